"""The quantization math of SageAttention: the single source of truth.

Every backend computes exactly what this module describes and is tested
against it. Arrays here are in the canonical per-head layout ``[..., T, H]``:
leading axes are batch and heads (``[B, N, T, H]`` for Q, ``[B, K, S, H]`` for
K and V), then tokens, then channels.

The pieces, in the order a forward pass uses them:

* Smoothing (SageAttention §3, SageAttention2 §3.1). K minus a mean over
  tokens: exact for *any* fixed vector, since softmax is invariant to a
  per-row shift of the scores, so it is the mean of ``MEAN_SAMPLES`` evenly
  strided tokens (:func:`sampled_mean`; as accurate as all tokens,
  benchmarks/NOTES.md Mosaic 12, and no pass over K).
  Q minus the mean of each Q block, with ΔS = q̄·γ(K)ᵀ added back to the scores
  in FP32. V minus its mean over tokens, added back to the output (rows of
  the normalised P sum to one).
* Symmetric integer quantizers, round to nearest even, INT8 (±127) or INT4
  (±7), with one scale per group of tokens (:func:`token_groups`). Scales are
  returned broadcast to one per token, ``[..., T]``: every backend then applies
  ``s = (q·k) * q_scale[t] * k_scale[s]`` whatever the granularity, and the
  granularity only decides which tokens share a value. ``sm_scale·log2(e)`` is
  folded into the Q scale so the softmax runs in base 2.
* FP8 e4m3: V per channel (scale = max|V[:, c]| / 448); P̃ = exp2(s − m) ∈ [0, 1]
  times the static 448.

NaN and Inf (what every backend and kernel must do, so that a non-finite
input shows in the output as it does in exact attention, never vanishes):

* Q/K: a token holding a NaN or ±Inf gets scale NaN and values 0
  (:func:`group_scales`); its group's other tokens are scaled by the largest
  *finite* magnitude of the group. The dequantized scores of that token are
  then NaN: a poisoned query row gives a NaN output row, a poisoned key gives
  NaN in exactly the rows that may see it (masking replaces the score first).
* V: a channel holding a NaN or ±Inf gets scale NaN, whatever the P·V dtype
  (FP8 values of that channel are 0): output channel ``c`` is NaN in every row
  of that (batch, KV head), as in dense exact attention where ``0·NaN`` is NaN.
* Means (K, V and Q-block smoothing) sum the finite values only
  (:func:`finite_part`), so one poisoned token does not poison the tokens it
  is subtracted from; it stays non-finite itself.
* An attention kernel counts a row whose running sum ``l`` is NaN as seen
  (``l != 0``, not ``l > 0``): its output and LSE are NaN, never the zeros of a
  row that sees no key. Kernels read non-finiteness with comparisons
  (``|x| < inf`` is False for NaN and ±Inf) because Triton's ``max`` ignores
  NaN.

:func:`quantize` pads T to a multiple of ``block_q`` and S to a multiple of
``block_k`` (padding tokens are zero, so they never change a scale) and
returns a :class:`QuantizedQKV`, the interface every attention backend takes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from sagejax.config import (
    SageConfig,
    THREAD_KEY_GROUPS,
    THREAD_KEY_PERIOD,
    THREAD_ROW_GROUPS,
)

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Tokens a sampled smoothing mean is taken over (sampled_mean); a power of two.
MEAN_SAMPLES = 256
# Largest finite float8_e4m3fn value: P̃ ∈ [0, 1] is stored as P̃·448 and V as
# V / (max|V[:, c]| / 448).
FP8_MAX = 448.0
P_SCALE = FP8_MAX
FP8_DTYPE = jnp.float8_e4m3fn
# The P·V operand type of each SageConfig.pv_dtype.
PV_OPERAND_DTYPES = {"fp8_e4m3": FP8_DTYPE, "fp16": jnp.float16,
                     "bf16": jnp.bfloat16}

Role = Literal["q", "k"]


# ----------------------------------------------------------------------------
# Quantization groups.
# ----------------------------------------------------------------------------


def _group_view(role: Role, config: SageConfig, n_tokens: int):
  """How the token axis of a padded Q or K splits into quantization groups.

  Returns ``(shape, reduce)``: the token axis reshaped to ``shape`` (row-major)
  and the axes of ``shape`` that run *inside* one group. Tokens that differ only
  along ``reduce`` share a scale. This one description drives both the scales
  (:func:`group_amax`) and the documented membership (:func:`token_groups`).
  """
  g = config.qk_granularity
  if g == "per_token":
    return (n_tokens,), ()
  if role == "q":
    bq, w = config.block_q, config.num_warps
    if n_tokens % bq:
      raise ValueError(f"{n_tokens} query tokens is not a multiple of "
                       f"block_q={bq}; pad first (see quantize).")
    nb = n_tokens // bq
    if g == "per_block":
      return (nb, bq), (1,)
    if g == "per_warp":
      return (nb, w, bq // w), (2,)
    # per_thread: within a warp's rows, rows with the same index mod 8.
    r = bq // w // THREAD_ROW_GROUPS
    return (nb, w, r, THREAD_ROW_GROUPS), (2,)
  if role == "k":
    bk = config.block_k
    if n_tokens % bk:
      raise ValueError(f"{n_tokens} key tokens is not a multiple of "
                       f"block_k={bk}; pad first (see quantize).")
    nb = n_tokens // bk
    if g in ("per_block", "per_warp"):  # a K block is never split over warps
      return (nb, bk), (1,)
    # per_thread: keys with the same (index mod 8) // 2 inside a K block.
    period = THREAD_KEY_PERIOD
    pair = period // THREAD_KEY_GROUPS
    return (nb, bk // period, THREAD_KEY_GROUPS, pair), (1, 3)
  raise ValueError(f"role must be 'q' or 'k', got {role!r}")


def token_groups(n_tokens: int, role: Role, config: SageConfig) -> np.ndarray:
  """Group id of each token, ``int[n_tokens]``; equal ids share a scale.

  ``n_tokens`` must be a multiple of ``block_q`` (Q) or ``block_k`` (K).
  """
  shape, reduce = _group_view(role, config, n_tokens)
  idx = np.indices(shape)
  keep = [a for a in range(len(shape)) if a not in reduce]
  if not keep:
    return np.zeros(n_tokens, np.int64)
  ids = np.ravel_multi_index([idx[a] for a in keep],
                             [shape[a] for a in keep])
  return ids.reshape(n_tokens)


def group_max(row_values: jax.Array, role: Role, config: SageConfig
              ) -> jax.Array:
  """Max of ``row_values [..., T]`` over each token's quantization group.

  Pure reshapes and reductions, so kernels call it on their own block of
  rows (groups never straddle a block).
  """
  *lead, n = row_values.shape
  shape, reduce = _group_view(role, config, n)
  if not reduce:
    return row_values
  v = row_values.reshape(*lead, *shape)
  axes = tuple(len(lead) + a for a in reduce)
  g = jnp.max(v, axis=axes, keepdims=True)
  return jnp.broadcast_to(g, v.shape).reshape(*lead, n)


def abs_max(x: jax.Array, axis: int = -1) -> jax.Array:
  """max |x| along ``axis``, f32; +inf where the values hold a NaN or ±Inf.

  Never NaN: reductions may drop NaN (Triton's ``max`` is ``maxnum``, and so
  is XLA's CPU reduction on some shapes), so NaN is read as +inf first.
  """
  a = jnp.abs(x.astype(jnp.float32))
  return jnp.max(jnp.where(a < jnp.inf, a, jnp.inf), axis=axis)


def row_amax(x: jax.Array) -> jax.Array:
  """:func:`abs_max` over the channels of ``x [..., T, H]``: f32 ``[..., T]``,
  +inf for a token holding a NaN or ±Inf."""
  return abs_max(x, axis=-1)


def group_amax(x: jax.Array, role: Role, config: SageConfig) -> jax.Array:
  """max |x| over the finite tokens of each quantization group, ``[..., T]``."""
  amax = row_amax(x)
  return group_max(jnp.where(amax < jnp.inf, amax, 0.0), role, config)


# ----------------------------------------------------------------------------
# Integer quantizers.
# ----------------------------------------------------------------------------


def scale_from_amax(amax: jax.Array, qmax: float) -> jax.Array:
  """Symmetric scale: ``amax / qmax``; an all-zero group gets scale 1, a NaN
  or infinite ``amax`` scale NaN."""
  scale = jnp.where(amax > 0, amax / qmax, 1.0)
  return jnp.where(amax < jnp.inf, scale, jnp.nan).astype(jnp.float32)


def group_scales(row_amax_: jax.Array, role: Role, config: SageConfig
                 ) -> jax.Array:
  """Per-token scales ``[..., T]`` from per-token :func:`row_amax` values.

  A token's scale is its group's largest finite magnitude over ``qmax``; a
  non-finite token (``row_amax`` inf) gets NaN. Pure ``jnp`` on a block of
  rows, so the quantization kernels call it as is.
  """
  finite = row_amax_ < jnp.inf
  amax = group_max(jnp.where(finite, row_amax_, 0.0), role, config)
  return jnp.where(finite, scale_from_amax(amax, config.qmax), jnp.nan)


def quantize_int(x: jax.Array, scale: jax.Array, qmax: int) -> jax.Array:
  """``round(x / scale)`` (nearest even), clipped to ±qmax, as int8.

  ``scale`` is per token, ``[..., T]``; a token with scale NaN gets zeros.
  """
  y = x.astype(jnp.float32) / scale[..., None]
  y = jnp.clip(jnp.round(y), -qmax, qmax)
  return jnp.where(jnp.isnan(scale)[..., None], 0.0, y).astype(jnp.int8)


def quantize_groups(x: jax.Array, role: Role, config: SageConfig
                    ) -> tuple[jax.Array, jax.Array]:
  """Quantizes Q or K ``[..., T, H]`` at the config's granularity and dtype.

  Returns ``(values int8 [..., T, H], scale f32 [..., T])`` with
  ``x ≈ values * scale[..., None]``; a token holding a NaN or ±Inf gets values
  0 and scale NaN. INT4 values are not packed here; see :func:`pack_int4`.
  """
  scale = group_scales(row_amax(x), role, config)
  return quantize_int(x, scale, config.qmax), scale


def pack_int4(x: jax.Array) -> jax.Array:
  """Packs INT4 values (int8 in [-8, 7]) two per byte along the last axis.

  Channel ``c`` goes to the low nibble and channel ``c + H/2`` to the high
  nibble of byte ``c``, so unpacking gives the two halves of the channel axis
  and a Q·Kᵀ product is ``lo_q·lo_kᵀ + hi_q·hi_kᵀ`` without interleaving.
  Returns int8 ``[..., H/2]``: half the memory of INT8.
  """
  h = x.shape[-1]
  if h % 2:
    raise ValueError(f"INT4 packing needs an even last axis, got {h}.")
  lo = x[..., : h // 2].astype(jnp.int8)
  hi = x[..., h // 2:].astype(jnp.int8)
  return jnp.bitwise_or(jnp.bitwise_and(lo, jnp.int8(0x0F)),
                        jnp.left_shift(hi, jnp.int8(4)))


def unpack_int4_halves(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Inverse of :func:`pack_int4`, as the two channel halves (int8 each)."""
  lo = jnp.right_shift(jnp.left_shift(packed, jnp.int8(4)), jnp.int8(4))
  hi = jnp.right_shift(packed, jnp.int8(4))
  return lo, hi


def unpack_int4(packed: jax.Array) -> jax.Array:
  """Inverse of :func:`pack_int4`: int8 ``[..., 2 * H/2]``."""
  return jnp.concatenate(unpack_int4_halves(packed), axis=-1)


# ----------------------------------------------------------------------------
# FP8.
# ----------------------------------------------------------------------------


def quantize_v_fp8(v: jax.Array) -> tuple[jax.Array, jax.Array]:
  """V ``[..., S, H]`` to FP8 e4m3 with one scale per channel.

  Returns ``(values e4m3 [..., S, H], scale f32 [..., H])``,
  ``scale = max_s |V[s, c]| / 448`` (1 for an all-zero channel; NaN, with
  values 0, for a channel holding a NaN or ±Inf).
  """
  scale = scale_from_amax(abs_max(v, axis=-2), FP8_MAX)
  y = jnp.clip(v.astype(jnp.float32) / scale[..., None, :], -FP8_MAX, FP8_MAX)
  y = jnp.where(jnp.isnan(scale)[..., None, :], 0.0, y)
  return y.astype(FP8_DTYPE), scale


def unit_v_scale(v: jax.Array) -> jax.Array:
  """The V scale of 16-bit P·V operands, f32 ``[..., H]``: 1, or NaN for a
  channel of ``v [..., S, H]`` holding a NaN or ±Inf."""
  return jnp.where(abs_max(v, axis=-2) < jnp.inf, 1.0, jnp.nan
                   ).astype(jnp.float32)


def quantize_p_fp8(p: jax.Array) -> jax.Array:
  """P̃ = exp2(s − m) ∈ [0, 1] to FP8 e4m3 with the static scale 448."""
  return (p * P_SCALE).astype(FP8_DTYPE)


def truncate_to_fp22(x: jax.Array) -> jax.Array:
  """Truncates FP32 to 13 mantissa bits, as the FP8 MMA accumulator keeps."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  bits = jnp.bitwise_and(bits, jnp.uint32(0xFFFFE000))
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


# ----------------------------------------------------------------------------
# Smoothing.
# ----------------------------------------------------------------------------


def _valid_tokens(n: int, lengths: Optional[jax.Array], lead_ndim: int):
  """Boolean ``[B, 1.., n, 1]`` of tokens below ``lengths`` (or None)."""
  if lengths is None:
    return None
  valid = jnp.arange(n)[None, :] < lengths[:, None]
  return valid.reshape(valid.shape[:1] + (1,) * (lead_ndim - 1) + (n, 1))


def finite_part(x: jax.Array) -> jax.Array:
  """``x`` with NaN and ±Inf read as 0 (what the smoothing means sum)."""
  return jnp.where(jnp.abs(x) < jnp.inf, x, jnp.zeros((), x.dtype))


def token_mean(x: jax.Array, lengths: Optional[jax.Array] = None
               ) -> jax.Array:
  """Mean over the valid tokens of ``x [B, ..., T, H]``: f32 ``[B, ..., H]``.

  Non-finite values count as 0 (:func:`finite_part`).
  """
  x = finite_part(x.astype(jnp.float32))
  valid = _valid_tokens(x.shape[-2], lengths, x.ndim - 2)
  if valid is None:
    return jnp.mean(x, axis=-2)
  total = jnp.sum(jnp.where(valid, x, 0.0), axis=-2)
  count = jnp.maximum(jnp.sum(valid, axis=-2), 1)
  return total / count


def sampled_mean(x: jax.Array, lengths: Optional[jax.Array] = None,
                 token_axis: int = -2, tokens: Optional[int] = None
                 ) -> jax.Array:
  """The smoothing mean of ``x [B, ..., T, H]``: f32 ``[B, ..., H]``, the mean
  of the ``MEAN_SAMPLES`` tokens ``⌊i·L / MEAN_SAMPLES⌋`` (``L`` the batch's
  valid length; tokens repeat when ``L`` is smaller; 0 when ``L`` is 0).

  Where any fixed vector will do (K smoothing, forward and backward: the
  output and the gradient are exact for every k̄), this one reads a few
  tokens, not all of them.
  Non-finite values count as 0 (:func:`finite_part`). ``token_axis``: where
  the tokens are (1 for ``[B, S, K, H]``); the result drops that axis.
  ``tokens``: without ``lengths``, every batch's valid length (default: all
  of ``x``'s tokens; fewer where ``x`` is padded).
  """
  axis = token_axis % x.ndim
  b = x.shape[0]
  t = x.shape[axis] if tokens is None else tokens
  n_len = valid_lengths(lengths, b, t)
  if lengths is None and t % MEAN_SAMPLES == 0:
    # Every batch whole: the tokens i·t/MEAN_SAMPLES, a strided slice (no
    # gather, no index arrays: small kernels fewer on a GPU).
    rows = jax.lax.slice_in_dim(x, 0, t, t // MEAN_SAMPLES, axis=axis)
  else:  # [B | 1, MEAN_SAMPLES], below L
    length = t if lengths is None else n_len[:, None]
    idx = (jnp.arange(MEAN_SAMPLES, dtype=jnp.int32)[None, :]
           * length) // MEAN_SAMPLES
    shape = [1] * x.ndim
    shape[0], shape[axis] = idx.shape
    rows = jnp.take_along_axis(x, idx.reshape(shape), axis=axis)
  rows = finite_part(jnp.moveaxis(rows, axis, -2).astype(jnp.float32))
  # A pairwise sum of slices: the same additions in the same order whatever
  # the layout, batch sharding or fusion (a reduce may be reordered).
  n = MEAN_SAMPLES
  while n > 1:
    n //= 2
    rows = rows[..., :n, :] + rows[..., n:2 * n, :]
  mean = rows[..., 0, :] * (1.0 / MEAN_SAMPLES)
  empty = (n_len == 0).reshape((b,) + (1,) * (mean.ndim - 1))
  return jnp.where(empty, 0.0, mean)


def block_mean(x: jax.Array, block: int, lengths: Optional[jax.Array] = None
               ) -> jax.Array:
  """Mean of each block of ``block`` tokens: f32 ``[B, ..., T/block, H]``
  (non-finite values count as 0)."""
  *lead, n, h = x.shape
  x = finite_part(x.astype(jnp.float32))
  valid = _valid_tokens(n, lengths, len(lead))
  if valid is None:
    valid = jnp.ones((1,) * len(lead) + (n, 1), bool)
  xb = jnp.where(valid, x, 0.0).reshape(*lead, n // block, block, h)
  cb = valid.reshape(*valid.shape[:-2], n // block, block, 1)
  return jnp.sum(xb, axis=-2) / jnp.maximum(jnp.sum(cb, axis=-2), 1)


def zero_padding(x: jax.Array, lengths: Optional[jax.Array]) -> jax.Array:
  """Zeroes the tokens of ``x [B, ..., T, H]`` at or past ``lengths``."""
  valid = _valid_tokens(x.shape[-2], lengths, x.ndim - 2)
  return x if valid is None else jnp.where(valid, x, jnp.zeros((), x.dtype))


# ----------------------------------------------------------------------------
# The whole quantization step.
# ----------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedQKV:
  """Quantized attention inputs: what every attention backend consumes.

  Token axes are padded to ``T_pad`` (multiple of ``block_q``) and ``S_pad``
  (multiple of ``block_k``); ``N = K * groups``.

  Attributes:
    q: int8 ``[B, N, T_pad, H]``, or INT4 packed ``[B, N, T_pad, H/2]``.
    q_scale: f32 ``[B, N, T_pad]``; includes ``sm_scale * log2(e)``.
    k: int8 ``[B, K, S_pad, H]`` or packed ``[B, K, S_pad, H/2]``.
    k_scale: f32 ``[B, K, S_pad]``.
    v: ``[B, K, S_pad, H]`` in the P·V operand type (FP8 e4m3, FP16, BF16).
    v_scale: f32 ``[B, K, H]``; multiplies the output (ones unless FP8;
      NaN for a channel holding a NaN or ±Inf).
    v_mean: f32 ``[B, K, H]`` added to the output when V was smoothed, else
      None.
    delta_s: f32 ``[B, N, T_pad / block_q, S_pad]``, ΔS = q̄·γ(K)ᵀ in base-2
      score units, when Q was smoothed, else None.
    lse_shift: f32 ``[B, N, T]`` (unpadded), what K smoothing took out of each
      row's natural-log LSE (:func:`lse_shift`); backends add it to the LSE
      the attention arithmetic yields. None when K was not smoothed. With a
      logit soft cap the shift is added to each score *before* the cap
      instead (the cap is not shift invariant; :func:`soft_cap_base2`), and
      the LSE then needs none.
  """

  q: jax.Array
  q_scale: jax.Array
  k: jax.Array
  k_scale: jax.Array
  v: jax.Array
  v_scale: jax.Array
  v_mean: Optional[jax.Array]
  delta_s: Optional[jax.Array]
  lse_shift: Optional[jax.Array] = None


def _pad_tokens(x: jax.Array, multiple: int) -> jax.Array:
  n = x.shape[-2]
  pad = -n % multiple
  if not pad:
    return x
  widths = [(0, 0)] * (x.ndim - 2) + [(0, pad), (0, 0)]
  return jnp.pad(x, widths)


def _pad_channels_even(x: jax.Array) -> jax.Array:
  if x.shape[-1] % 2 == 0:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 1)])


def valid_lengths(lengths: Optional[jax.Array], batch: int, n: int
                  ) -> jax.Array:
  """Per-batch valid lengths, int32 ``[B]``; ``n`` where none were given."""
  if lengths is not None:
    return lengths.astype(jnp.int32)
  return jnp.full((batch,), n, jnp.int32)


def quantize_q(q: jax.Array, config: SageConfig, sm_scale: float,
               q_lengths: Optional[jax.Array] = None):
  """Q ``[B, N, T, H]`` → (values, scale ``[B, N, T_pad]``, block mean or None).

  The scale includes ``sm_scale * log2(e)``; the block mean ``[B, N,
  T_pad/block_q, H]`` (f32, unscaled) is returned when ``smooth_q``.
  """
  lengths = valid_lengths(q_lengths, q.shape[0], q.shape[-2])
  q = _pad_tokens(zero_padding(q, lengths), config.block_q)
  q_mean = None
  if config.smooth_q:
    q_mean = block_mean(q, config.block_q, lengths)
    q = q.astype(jnp.float32) - jnp.repeat(q_mean, config.block_q, axis=-2)
    q = zero_padding(q, lengths)
  if config.qk_dtype == "int4":
    q = _pad_channels_even(q)
  values, scale = quantize_groups(q, "q", config)
  if config.qk_dtype == "int4":
    values = pack_int4(values)
  return values, scale * (sm_scale * LOG2E), q_mean


def quantize_k(k: jax.Array, config: SageConfig,
               kv_lengths: Optional[jax.Array] = None):
  """K ``[B, K, S, H]`` → (values, scale ``[B, K, S_pad]``, smoothed K f32,
  mean f32 ``[B, K, H]`` or None).

  The smoothed K (zero past the valid lengths) is what ΔS is computed from.
  """
  lengths = valid_lengths(kv_lengths, k.shape[0], k.shape[-2])
  k = k.astype(jnp.float32)
  k_mean = None
  if config.smooth_k:
    k_mean = sampled_mean(k, lengths)
    k = k - k_mean[..., None, :]
  k = _pad_tokens(zero_padding(k, lengths), config.block_k)
  if config.qk_dtype == "int4":
    k = _pad_channels_even(k)
  values, scale = quantize_groups(k, "k", config)
  if config.qk_dtype == "int4":
    values = pack_int4(values)
  return values, scale, k, k_mean


def quantize_v(v: jax.Array, config: SageConfig,
               kv_lengths: Optional[jax.Array] = None):
  """V ``[B, K, S, H]`` → (values, scale ``[B, K, H]``, mean or None)."""
  lengths = valid_lengths(kv_lengths, v.shape[0], v.shape[-2])
  v_mean = None
  if config.smooth_v:
    v_mean = token_mean(v, lengths)
    v = v.astype(jnp.float32) - v_mean[..., None, :]
  v = _pad_tokens(zero_padding(v, lengths), config.block_k)
  if config.pv_dtype == "fp8_e4m3":
    values, scale = quantize_v_fp8(v)
  else:
    dtype = jnp.float16 if config.pv_dtype == "fp16" else jnp.bfloat16
    values = v.astype(dtype)
    scale = unit_v_scale(v)
  return values, scale, v_mean


def delta_scores(q_mean: jax.Array, k_smoothed: jax.Array, sm_scale: float
                 ) -> jax.Array:
  """ΔS = q̄·γ(K)ᵀ · sm_scale · log2(e): f32 ``[B, N, T_pad/block_q, S_pad]``.

  ``q_mean`` is ``[B, N, nQ, H]`` and ``k_smoothed`` ``[B, K, S_pad, H]``;
  GQA groups N = K·G share their K head without copying it.
  """
  b, n, nq, h = q_mean.shape
  kh = k_smoothed.shape[1]
  qm = q_mean.reshape(b, kh, n // kh, nq, h)
  ds = jnp.einsum("bkgqh,bksh->bkgqs", qm, k_smoothed[..., :h],
                  precision=jax.lax.Precision.HIGHEST)
  return ds.reshape(b, n, nq, -1) * (sm_scale * LOG2E)


def quantize(q: jax.Array, k: jax.Array, v: jax.Array, config: SageConfig,
             sm_scale: float, q_lengths: Optional[jax.Array] = None,
             kv_lengths: Optional[jax.Array] = None) -> QuantizedQKV:
  """Smooths and quantizes Q ``[B, N, T, H]``, K and V ``[B, K, S, H]``.

  Tokens at or past ``q_lengths`` / ``kv_lengths`` (int ``[B]``) are treated as
  padding: they are zeroed and do not count in any mean or scale.
  """
  qv, q_scale, q_mean = quantize_q(q, config, sm_scale, q_lengths)
  kv_, k_scale, k_smoothed, k_mean = quantize_k(k, config, kv_lengths)
  vv, v_scale, v_mean = quantize_v(v, config, kv_lengths)
  delta_s = None
  if q_mean is not None:
    delta_s = delta_scores(q_mean, k_smoothed, sm_scale)
  shift = None
  if k_mean is not None:  # padding rows (LSE −inf anyway) get no shift
    shift = lse_shift(zero_padding(q, q_lengths), k_mean, sm_scale)
  return QuantizedQKV(q=qv, q_scale=q_scale, k=kv_, k_scale=k_scale, v=vv,
                      v_scale=v_scale, v_mean=v_mean, delta_s=delta_s,
                      lse_shift=shift)


def lse_shift(q: jax.Array, k_mean: jax.Array, sm_scale: float) -> jax.Array:
  """What K smoothing removes from every score of a row: ``sm_scale·q·k̄``.

  Smoothing shifts row t's logits by −sm_scale·q_t·k̄, which leaves the softmax
  (and so the output) unchanged but not the log-sum-exp: add this (natural-log
  units) to an LSE computed from smoothed K. ``q`` is ``[B, N, T, H]``,
  ``k_mean`` ``[B, K, H]``; returns f32 ``[B, N, T]``.
  """
  b, n, t, h = q.shape
  kh = k_mean.shape[1]
  qg = q.astype(jnp.float32).reshape(b, kh, n // kh, t, h)
  shift = jnp.einsum("bkgth,bkh->bkgt", qg, k_mean[..., :h],
                     precision=jax.lax.Precision.HIGHEST)
  return shift.reshape(b, n, t) * sm_scale


def soft_cap_base2(s: jax.Array, cap: float,
                   row_shift: Optional[jax.Array] = None) -> jax.Array:
  """Gemma-2's logit soft cap on base-2 scores ``s``.

  The natural-log logits ``x = s·ln 2 (+ row_shift)`` become ``cap·tanh(x /
  cap)``; returned in base 2 again. ``row_shift`` (natural log, broadcast to
  ``s``) is :func:`lse_shift`, restoring what K smoothing removed, since the
  cap is not shift invariant. Pure ``jnp``: kernels call it on their tile.
  """
  return (cap * LOG2E) * _capped_tanh(s, cap, row_shift)


def soft_cap_base2_and_slope(s: jax.Array, cap: float,
                             row_shift: Optional[jax.Array] = None
                             ) -> tuple[jax.Array, jax.Array]:
  """:func:`soft_cap_base2` and its slope ``1 − tanh²(x / cap)``: the
  derivative of the capped logits by the uncapped ones (in either base),
  with which the backward carries dS back to the logits before the cap.
  Pure ``jnp``."""
  t = _capped_tanh(s, cap, row_shift)
  return (cap * LOG2E) * t, 1.0 - t * t


def capped_dq_shift(lam: jax.Array, d_sum: jax.Array, d_lse: jax.Array
                    ) -> jax.Array:
  """Under a soft cap, from the forward's saved statistics: the factor of
  a fixed k̄ (K's mean) that dQ = Σ_j dX_ij K_j gains (before
  ``sm_scale``), −λ(D − dLSE), from row sums over all keys ``[..., T]``:
  ``lam`` λ = Σ_j P(1 − t²) and ``d_sum`` D = Σ_j dS = Σ_j P(dP − δ).
  With exact statistics D = dLSE and it vanishes; with saved ones it
  cancels the first-order error that δ's makes through Σ_j dX_ij·k̄
  (benchmarks/NOTES.md B39: dQ cos ≥ 0.99999 against 0.996 without it on
  channel-outlier K). Pure ``jnp``: the oracle and the kernels share it."""
  return -lam * (d_sum - d_lse)


def _capped_tanh(s, cap, row_shift):
  x = s * (LN2 / cap)
  if row_shift is not None:
    x = x + row_shift * (1.0 / cap)
  return jnp.tanh(x)


def dequantize_qk(values: jax.Array, scale: jax.Array, config: SageConfig
                  ) -> jax.Array:
  """Back to f32 ``[..., T, H]`` (INT4 unpacked); Q keeps sm_scale·log2(e)."""
  if config.qk_dtype == "int4":
    values = unpack_int4(values)
  return values.astype(jnp.float32) * scale[..., None]

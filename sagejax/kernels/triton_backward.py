"""Pallas (Triton) kernels: the backward of attention, FlashAttention-2 style.

The gradient is that of *exact* softmax attention (the forward's quantizers
are straight-through). With base-2 logits s = (q·kᵀ)·c + bias·log2 e,
c = sm_scale·log2 e, and lse₂ the row LSE in base 2:

  P = exp2(s − lse₂),  dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP − δ),
  δ = rowsum(dO ∘ O) − dLSE,  dK = dSᵀ·Q·sm_scale,  dbias = dS,
  dQ = dS·(K − k̄)·sm_scale + dLSE·k̄·sm_scale.

The last line is exact (each row of dS sums to dLSE) and keeps a large K
mean (channel outliers, what K smoothing is for) from multiplying the
rounding error of dS or δ: without it dQ on channel-biased K has cosine
0.46–0.9 to the exact gradient even with δ from the exact output rounded to
bf16 (benchmarks/NOTES.md). So every kernel takes K smoothed — K − k̄ in 16
bits, or INT8-quantized after smoothing — and lse₂ of the smoothed logits
(the true LSE minus the row shift q·k̄·sm_scale). With a logit soft cap
(s capped to c·log2 e·tanh(s·ln 2 / c)) dS is carried back through it, dX =
dS ∘ (1 − tanh²), and K comes unsmoothed: the rows of dX do not sum to
dLSE.

Kernels (all read and write the caller's layout ``[B, T, N, H]`` or ``[B, N,
T, H]`` in place through their BlockSpecs):

* ``_delta_kernel``: δ and lse₂ from the forward's saved output and LSE.
* ``_stats_kernel``: δ and lse₂ recomputed exactly — a 16-bit forward with an
  online softmax whose output never leaves registers.
* ``_dkdv_kernel``: one program per (KV block, batch, KV head); loops over the
  G query heads of its GQA group and, for each, over the query blocks that
  see the KV block (the causal diagonal, window and lengths skip the rest),
  recomputing P from Q, K and lse₂. dK/dV are summed over the group in
  registers; K/V are read once. Optionally it also accumulates dQ with FP32
  atomics (FlashAttention-2's original scheme) instead of the dQ kernel.
* ``_dq_kernel``: one program per (query block, batch, query head), over the
  KV blocks the query block sees.

Products run on 16-bit tensor cores with FP32 accumulation (IEEE FP32 for
FP32 inputs). With ``int8`` (SageBwd, SageAttention3 §4): Q·Kᵀ, Pᵀ·dO, dSᵀ·Q
and dS·K take INT8 operands — Q per block of the dK/dV kernel's query tile,
K (smoothed) per block of the tile that contracts it in dS·K, dO per query
tile, P and dS per tile with a scale from the tile's max — and dO·Vᵀ stays
16-bit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sagejax import quant
from sagejax.kernels._common import (key_blocks, layout_dims, query_blocks,
                                     round_half_even, visit_blocks)
from sagejax.masks import MaskSpec

_INF = float("inf")


@dataclasses.dataclass(frozen=True)
class BackwardTiling:
  """Tuning of the backward kernels (not part of the math).

  Attributes:
    block_q: dK/dV kernel: query rows per inner step.
    block_k: dK/dV kernel: keys per program.
    block_q_dq: dQ (and statistics) kernel: query rows per program.
    block_k_dq: dQ (and statistics) kernel: keys per inner step.
    num_warps, num_stages: of the dK/dV kernel.
    num_warps_dq, num_stages_dq: of the dQ and statistics kernels.
    dq_atomic: accumulate dQ in the dK/dV kernel with FP32 atomic adds (5
      products per tile pair) instead of the dQ kernel (7: it recomputes
      Q·Kᵀ and dO·Vᵀ).
    unmasked_first: the dK/dV and dQ kernels visit the blocks every row
      sees first, then the masked ones in one loop
      (:func:`sagejax.kernels._common.visit_blocks`).
  """

  block_q: int = 64
  block_k: int = 128
  block_q_dq: int = 128
  block_k_dq: int = 64
  num_warps: int = 8
  num_stages: int = 2
  num_warps_dq: int = 8
  num_stages_dq: int = 2
  dq_atomic: bool = False
  unmasked_first: bool = False

  def __post_init__(self):
    for field in ("block_q", "block_k", "block_q_dq", "block_k_dq",
                  "num_warps", "num_warps_dq"):
      v = getattr(self, field)
      if not isinstance(v, int) or v < 1 or v & (v - 1):
        raise ValueError(f"BackwardTiling.{field} must be a power of two, "
                         f"got {v!r}.")
    for field in ("block_q", "block_k", "block_q_dq", "block_k_dq"):
      if getattr(self, field) < 16:
        raise ValueError(f"BackwardTiling.{field} must be >= 16 (tensor-core "
                         f"tiles), got {getattr(self, field)}.")
    for field in ("num_stages", "num_stages_dq"):
      if not 1 <= getattr(self, field) <= 6:
        raise ValueError(f"BackwardTiling.{field} must be in 1..6, got "
                         f"{getattr(self, field)}.")
    if not isinstance(self.dq_atomic, bool):
      raise ValueError(f"BackwardTiling.dq_atomic must be True or False, got "
                       f"{self.dq_atomic!r}.")


# ----------------------------------------------------------------------------
# Which blocks a tile sees (kernels._common, the rule of masks.MaskSpec).
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# Tile helpers.
# ----------------------------------------------------------------------------


def _rows(ref, layout: str, g, start, size: int):
  """Rows [start, start + size) of head ``g`` of a ``[T, G, H]`` (BTNH) or
  ``[G, T, H]`` ref, or of a ``[G, T]`` vector ref."""
  if len(ref.shape) == 2:
    return ref[g, pl.ds(start, size)]
  if layout == "BTNH":
    return ref[pl.ds(start, size), g, :]
  return ref[g, pl.ds(start, size), :]


def _rows_index(layout: str, g, start, size: int):
  if layout == "BTNH":
    return (pl.ds(start, size), g, slice(None))
  return (g, pl.ds(start, size), slice(None))


def _tile_max(x: jax.Array) -> jax.Array:
  return jnp.max(jnp.max(x, axis=1), axis=0)


def _quantize_tile(x: jax.Array, interpret: bool):
  """INT8 with one scale for the whole tile: (values, scale)."""
  amax = _tile_max(jnp.abs(x))
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  v = jnp.clip(round_half_even(x * (1.0 / scale), interpret), -127.0, 127.0)
  return v.astype(jnp.int8), scale


def _dot(a, b, trans_a=False, trans_b=False):
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b)


def _logits(q, k, q_scale, k_scale, c: float, bias, ok,
            soft_cap: Optional[float] = None):
  """(Base-2 logits of a tile, the soft cap's slope or None);
  ``q_scale``/``k_scale`` for INT8 operands. With ``soft_cap`` the logits
  are capped (:func:`sagejax.quant.soft_cap_base2_and_slope`) before the
  masks."""
  if q_scale is None:
    s = _dot(q, k, trans_b=True) * c
  else:
    s = (_dot(q, k, trans_b=True).astype(jnp.float32)
         * (q_scale * c)[:, None] * k_scale[None, :])
  if bias is not None:
    s = s + bias.astype(jnp.float32) * quant.LOG2E
  slope = None
  if soft_cap is not None:
    s, slope = quant.soft_cap_base2_and_slope(s, soft_cap)
  if ok is not None:
    s = jnp.where(ok, s, -_INF)
    if slope is not None:  # (a masked NaN key: no NaN slope)
      slope = jnp.where(ok, slope, 0.0)
  return s, slope


def _visible(spec: MaskSpec, rows, cols, q_len, kv_len, mask):
  ok = spec.visible_at(rows[:, None], cols[None, :], q_len, kv_len)
  if mask is not None:
    ok = ok & (mask != 0)
  return ok


def _key_tile(j, block_k: int, q, q_scale, k_ref, ks_ref, v_ref, c: float,
              bias_ref, mask_ref, spec: MaskSpec, rows, q_len, kv_len,
              masked: bool, soft_cap: Optional[float]):
  """KV block ``j`` of a query tile's loop: ((K, its INT8 scales or None),
  V, (the tile's base-2 logits, masked when ``masked``, and the soft cap's
  slope or None))."""
  start = pl.multiple_of(j * block_k, block_k)
  k = k_ref[pl.ds(start, block_k), :]
  v = v_ref[pl.ds(start, block_k), :]
  k_scale = None if ks_ref is None else ks_ref[pl.ds(start, block_k)]
  bias = None if bias_ref is None else bias_ref[:, pl.ds(start, block_k)]
  ok = None
  if masked:
    mask = None if mask_ref is None else mask_ref[:, pl.ds(start, block_k)]
    ok = _visible(spec, rows, start + jnp.arange(block_k), q_len, kv_len,
                  mask)
  return (k, k_scale), v, _logits(q, k, q_scale, k_scale, c, bias, ok,
                                  soft_cap)


# ----------------------------------------------------------------------------
# δ and lse₂.
# ----------------------------------------------------------------------------


def _delta_kernel(o_ref, do_ref, lse_ref, shift_ref, dlse_ref, lse2_ref,
                  delta_ref):
  """δ = rowsum(dO ∘ O) − dLSE and lse₂ = (LSE − shift)·log2 e (+inf for a
  row that sees no key) from the forward's output and LSE."""
  o = o_ref[...].astype(jnp.float32)
  do = do_ref[...].astype(jnp.float32)
  delta = jnp.sum(o * do, axis=1)
  lse = lse_ref[...]
  seen = lse > -_INF
  if dlse_ref is not None:
    delta = delta - jnp.where(seen, dlse_ref[...], 0.0)
  delta_ref[...] = delta
  lse2_ref[...] = jnp.where(seen, (lse - shift_ref[...]) * quant.LOG2E, _INF)


def _saved_rows_kernel(o_ref, do_ref, lse_ref, dlse_ref, q_ref, km_ref,
                       ql_ref, lse2_ref, delta_ref, *, block: int,
                       sm_scale: float):
  """lse₂ = (LSE − sm_scale·q·k̄)·log2 e and δ = rowsum(dO ∘ O) − dLSE of a
  block of rows, reading Q, O and dO once: :func:`saved_statistics`.
  Without ``q_ref``, ``lse_ref`` holds lse₂ already: δ alone."""
  if q_ref is None:
    seen = lse_ref[...] != _INF
  else:
    i = pl.program_id(0)
    valid = (i * block + jnp.arange(block)) < ql_ref[...]
    q = jnp.where(valid[:, None], q_ref[...].astype(jnp.float32), 0.0)
    lse = lse_ref[...] - jnp.sum(q * km_ref[...][None, :], axis=1) * sm_scale
    seen = lse != -_INF  # a NaN LSE is seen: it reaches the gradients
    lse2_ref[...] = jnp.where(seen, lse * quant.LOG2E, _INF)
  if delta_ref is not None:
    delta = jnp.sum(o_ref[...].astype(jnp.float32)
                    * do_ref[...].astype(jnp.float32), axis=1)
    if dlse_ref is not None:
      delta = delta - dlse_ref[...]
    delta_ref[...] = jnp.where(seen, delta, 0.0)


def saved_statistics(q: Optional[jax.Array], lse: jax.Array,
                     k_mean: Optional[jax.Array], *,
                     q_lengths: jax.Array, sm_scale: float, layout: str,
                     out: Optional[jax.Array] = None,
                     d_out: Optional[jax.Array] = None,
                     d_lse: Optional[jax.Array] = None, block: int = 64,
                     interpret: bool = False
                     ) -> tuple[jax.Array, Optional[jax.Array]]:
  """The backward's row statistics from the forward's, in one pass.

  Args:
    q: ``[B, T_pad, N, H]`` (``layout="BTNH"``) or ``[B, N, T_pad, H]``;
      rows at or past ``q_lengths`` count as zeros. None when ``lse`` is
      lse₂ already (the forward's: ``mosaic.forward_residual``); then only
      δ is made, from ``out`` and ``d_out`` alone.
    lse: f32 ``[B, N, T_pad]``, the forward's natural-log LSE (−inf where a
      row sees no key), or lse₂ without ``q``.
    k_mean: f32 ``[B, K, H]``, the k̄ the backward takes out of K (None
      without ``q``).
    out, d_out: the forward's output and its cotangent (``q``'s layout), or
      None for lse₂ alone.
    d_lse: f32 ``[B, N, T_pad]`` or None.

  Returns:
    ``(lse₂, δ)``, f32 ``[B, N, T_pad]``: lse₂ the base-2 LSE of the logits
    of smoothed K (+inf for a row that sees no key, NaN kept; ``lse``
    itself without ``q``), δ = rowsum(dO ∘ O) − dLSE (0 for a row that sees
    no key), or None without ``out``.
  """
  if (q is None) != (k_mean is None) or (q is None and out is None):
    raise ValueError("Pass q with k_mean (lse₂ from the LSE), or neither "
                     "with out and d_out (δ alone, lse being lse₂).")
  rows_of = q if q is not None else out
  if layout == "BTNH":
    b, t_pad, n, h = rows_of.shape
    rows = pl.BlockSpec((None, block, None, h), lambda i, bb, nn: (bb, i, nn, 0))
  else:
    b, n, t_pad, h = rows_of.shape
    rows = pl.BlockSpec((None, None, block, h), lambda i, bb, nn: (bb, nn, i, 0))
  if t_pad % block:
    raise ValueError(f"{t_pad} rows is not a multiple of block={block}.")
  vec = pl.BlockSpec((None, None, block), lambda i, bb, nn: (bb, nn, i))
  vec_shape = jax.ShapeDtypeStruct((b, n, t_pad), jnp.float32)
  with_delta = out is not None
  with_q = q is not None
  g = n // k_mean.shape[1] if with_q else 1
  kernel = functools.partial(_saved_rows_kernel, block=block,
                             sm_scale=float(sm_scale))
  lse2, delta = pl.pallas_call(
      kernel, grid=(t_pad // block, b, n),
      in_specs=[rows if with_delta else None, rows if with_delta else None,
                vec, None if d_lse is None else vec,
                rows if with_q else None,
                pl.BlockSpec((None, None, h), lambda i, bb, nn: (bb, nn // g,
                                                                 0))
                if with_q else None,
                pl.BlockSpec((None,), lambda i, bb, nn: (bb,))],
      out_specs=[vec if with_q else None, vec if with_delta else None],
      out_shape=[vec_shape if with_q else None,
                 vec_shape if with_delta else None],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name="sage_attention_bwd_saved_rows",
  )(out if with_delta else None, d_out if with_delta else None, lse, d_lse,
    q, k_mean, q_lengths)
  return (lse2 if with_q else lse), delta


def _stats_kernel(q_ref, k_ref, v_ref, do_ref, dlse_ref, mask_ref, bias_ref,
                  ql_ref, kl_ref, lse2_ref, delta_ref, *, spec: MaskSpec,
                  block_q: int, block_k: int, c: float, num_kv_blocks: int,
                  all_masked: bool, q_block_of, soft_cap: Optional[float]):
  """Exact lse₂ and δ: a forward over the visible key blocks whose output
  stays in registers (FP32) and is only dotted with dO."""
  i = q_block_of(pl.program_id(0))
  q_len, kv_len = ql_ref[...], kl_ref[...]
  q_first = i * block_q
  blocks = key_blocks(spec, q_first, block_q, q_len, kv_len, block_k,
                      num_kv_blocks, all_masked)
  q = q_ref[...]
  rows = q_first + jnp.arange(block_q)

  def body(j, carry, masked: bool):
    acc, m, l = carry
    _, v, (s, _) = _key_tile(j, block_k, q, None, k_ref, None, v_ref, c,
                             bias_ref, mask_ref, spec, rows, q_len, kv_len,
                             masked, soft_cap)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -_INF, 0.0, m_new)
    alpha = jnp.exp2(m - m_use)
    p = jnp.exp2(s - m_use[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_new, l

  h = q_ref.shape[-1]
  carry = (jnp.zeros((block_q, h), jnp.float32),
           jnp.full((block_q,), -_INF, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  acc, m, l = visit_blocks(blocks, body, carry)
  seen = (l > 0) & (rows < q_len)
  l_safe = jnp.where(seen, l, 1.0)
  delta = jnp.sum(acc * do_ref[...].astype(jnp.float32), axis=1) / l_safe
  if dlse_ref is not None:
    delta = delta - jnp.where(seen, dlse_ref[...], 0.0)
  delta_ref[...] = jnp.where(seen, delta, 0.0)
  lse2_ref[...] = jnp.where(seen, m + jnp.log2(l_safe), _INF)


# ----------------------------------------------------------------------------
# dK, dV (and dQ by atomics).
# ----------------------------------------------------------------------------


def _dkdv_kernel(q_ref, qs_ref, k_ref, ks_ref, v_ref, do_ref, do8_ref,
                 dos_ref, lse2_ref, delta_ref, mask_ref, bias_ref, ql_ref,
                 kl_ref, dq_in_ref, dbias_in_ref, dk_ref, dv_ref, dq_ref,
                 dbias_ref, *, spec: MaskSpec, layout: str, q_layout: str,
                 block_q: int, block_k: int, groups: int, sm_scale: float,
                 num_q_blocks: int, all_masked: bool, int8: bool,
                 dbias_heads: bool, dbias_batch: bool, interpret: bool,
                 soft_cap: Optional[float], unmasked_first: bool = False):
  del dq_in_ref, dbias_in_ref  # aliased to dq_ref, dbias_ref (zeros)
  j, b, kh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  q_len, kv_len = ql_ref[...], kl_ref[...]
  k_first = j * block_k
  blocks = query_blocks(spec, k_first, block_k, q_len, kv_len, block_q,
                        num_q_blocks, all_masked)
  k = k_ref[...]
  v = v_ref[...]
  k_scale = ks_ref[...] if int8 else None
  cols = k_first + jnp.arange(block_k)
  c = sm_scale * quant.LOG2E

  def step(g, i, carry, masked: bool):
    dk, dv = carry
    r = pl.multiple_of(i * block_q, block_q)
    q = _rows(q_ref, q_layout, g, r, block_q)
    do = _rows(do_ref, layout, g, r, block_q)
    lse2 = _rows(lse2_ref, layout, g, r, block_q)
    delta = _rows(delta_ref, layout, g, r, block_q)
    gm = g if mask_ref is not None and mask_ref.shape[0] > 1 else 0
    gb = g if bias_ref is not None and bias_ref.shape[0] > 1 else 0
    bias = (None if bias_ref is None
            else bias_ref[gb, pl.ds(r, block_q), :])
    ok = None
    if masked:
      mask = None if mask_ref is None else mask_ref[gm, pl.ds(r, block_q), :]
      ok = _visible(spec, r + jnp.arange(block_q), cols, q_len, kv_len, mask)
    q_scale = _rows(qs_ref, q_layout, g, r, block_q) if int8 else None
    s, slope = _logits(q, k, q_scale, k_scale, c, bias, ok, soft_cap)
    p = jnp.exp2(s - lse2[:, None])
    dp = _dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    if slope is not None:  # back to the logits before the cap
      ds = ds * slope
    if int8:
      p8, p_scale = _quantize_tile(p, interpret)
      do8 = _rows(do8_ref, q_layout, g, r, block_q)
      do_scale = jnp.max(_rows(dos_ref, q_layout, g, r, block_q))
      dv = dv + _dot(p8, do8, trans_a=True).astype(jnp.float32) * (
          p_scale * do_scale)
      ds8, ds_scale = _quantize_tile(ds, interpret)
      dk = dk + _dot(ds8, q, trans_a=True).astype(jnp.float32) * (
          ds_scale * jnp.max(q_scale))
    else:
      dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
      dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
    if dq_ref is not None:
      if int8:
        part = _dot(ds8, k).astype(jnp.float32) * (
            ds_scale * jnp.max(k_scale) * sm_scale)
      else:
        part = _dot(ds.astype(k.dtype), k) * sm_scale
      plgpu.atomic_add(dq_ref, _rows_index(layout, g, r, block_q), part)
    if dbias_ref is not None:
      zero = jnp.int32(0)  # (a Python 0 is no array index for atomics)
      _add_dbias(dbias_ref, ds, b if dbias_batch else zero,
                 kh * groups + g if dbias_heads else zero, r, k_first)
    return dk, dv

  def head(g, carry):
    return visit_blocks(blocks, functools.partial(step, g), carry,
                        unmasked_first=unmasked_first)

  h = k_ref.shape[-1]
  zeros = jnp.zeros((block_k, h), jnp.float32)
  dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
  dk_ref[...] = (dk * sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _add_dbias(dbias_ref, ds, bi, ni, r, k_first):
  """Adds a dS tile into an FP32 ``[B|1, N|1, T|1, S|1]`` buffer (summed over
  the axes the bias broadcasts, atomically: several programs share them)."""
  rows_b, cols_b = ds.shape
  rows, cols = pl.ds(r, rows_b), pl.ds(k_first, cols_b)
  if dbias_ref.shape[2] == 1:
    ds = jnp.sum(ds, axis=0, keepdims=True)
    rows = pl.ds(0, 1)
  if dbias_ref.shape[3] == 1:
    ds = jnp.sum(ds, axis=1, keepdims=True)
    cols = pl.ds(0, 1)
  plgpu.atomic_add(dbias_ref, (bi, ni, rows, cols), ds)


# ----------------------------------------------------------------------------
# dQ.
# ----------------------------------------------------------------------------


def _dq_kernel(q_ref, qs_ref, k_ref, ks_ref, v_ref, do_ref, lse2_ref,
               delta_ref, dlse_ref, kbar_ref, mask_ref, bias_ref, ql_ref,
               kl_ref, dq_ref, *, spec: MaskSpec, block_q: int, block_k: int,
               sm_scale: float, num_kv_blocks: int, all_masked: bool,
               int8: bool, q_block_of, interpret: bool,
               soft_cap: Optional[float], unmasked_first: bool = False):
  i = q_block_of(pl.program_id(0))
  q_len, kv_len = ql_ref[...], kl_ref[...]
  q_first = i * block_q
  capped = soft_cap is not None  # λ and D (quant.capped_dq_shift) too
  blocks = key_blocks(spec, q_first, block_q, q_len, kv_len, block_k,
                      num_kv_blocks, all_masked)
  q = q_ref[...]
  q_scale = qs_ref[...] if int8 else None
  do = do_ref[...]
  lse2 = lse2_ref[...]
  delta = delta_ref[...]
  rows = q_first + jnp.arange(block_q)
  c = sm_scale * quant.LOG2E

  def body(j, carry, masked: bool):
    (k, k_scale), v, (s, slope) = _key_tile(
        j, block_k, q, q_scale, k_ref, ks_ref, v_ref, c, bias_ref, mask_ref,
        spec, rows, q_len, kv_len, masked, soft_cap)
    p = jnp.exp2(s - lse2[:, None])
    dp = _dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    if capped:  # back to the logits before the cap; the row sums
      dq, lam, d_sum = carry
      lam, d_sum = lam + jnp.sum(p * slope, axis=1), d_sum + jnp.sum(ds, 1)
      ds = ds * slope
    else:
      dq = carry
    if int8:
      ds8, ds_scale = _quantize_tile(ds, interpret)
      dq = dq + _dot(ds8, k).astype(jnp.float32) * (
          ds_scale * jnp.max(k_scale))
    else:
      dq = dq + _dot(ds.astype(k.dtype), k)
    return (dq, lam, d_sum) if capped else dq

  dq = jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32)
  if capped:
    dq = (dq, jnp.zeros((block_q,), jnp.float32),
          jnp.zeros((block_q,), jnp.float32))
  dq = visit_blocks(blocks, body, dq, unmasked_first=unmasked_first)
  if kbar_ref is not None:  # Σ_j dS_ij = dLSE_i: the K mean's share
    # (capped: always given, for the correction)
    dlse = (jnp.zeros_like(lse2) if dlse_ref is None else
            jnp.where(lse2 < _INF, dlse_ref[...], 0.0))
    if capped:  # from saved statistics (exact ones: D = dLSE, nothing)
      dq, lam, d_sum = dq
      dlse = quant.capped_dq_shift(lam, d_sum, dlse)
    dq = dq + dlse[:, None] * kbar_ref[...][None, :]
  dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)


# ----------------------------------------------------------------------------
# The whole backward.
# ----------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Operands:
  """SageBwd's INT8 operands (canonical ``[B, *, T_pad, H]``) and their
  per-token scales ``[B, *, T_pad]`` (constant over each kernel tile that
  contracts them)."""
  q: jax.Array
  q_scale: jax.Array
  k: jax.Array
  k_scale: jax.Array
  do: jax.Array
  do_scale: jax.Array


def attention_backward(
    q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array, *,
    k_mean: jax.Array, lse_shift: jax.Array, q_lengths: jax.Array,
    kv_lengths: jax.Array, spec: MaskSpec, sm_scale: float, layout: str,
    out: Optional[jax.Array] = None, lse: Optional[jax.Array] = None,
    d_lse: Optional[jax.Array] = None, mask: Optional[jax.Array] = None,
    bias: Optional[jax.Array] = None, dbias_shape=None,
    int8: Optional[Int8Operands] = None,
    tiling: BackwardTiling = BackwardTiling(), interpret: bool = False,
    logits_soft_cap: Optional[float] = None,
) -> tuple[jax.Array, jax.Array, jax.Array, Optional[jax.Array]]:
  """Gradients of attention w.r.t. Q, K, V (and the bias), on padded inputs.

  Args:
    q, d_out: ``[B, T_pad, N, H]`` (``layout="BTNH"``) or ``[B, N, T_pad,
      H]``; T_pad a multiple of both query tiles, H a power of two >= 32.
    k, v: ``[B, S_pad, K, H]`` or ``[B, K, S_pad, H]``; ``k`` smoothed (K − k̄,
      in its dtype), S_pad a multiple of both key tiles.
    k_mean: f32 ``[B, K, H]``, the k̄ taken out of ``k``.
    lse_shift: f32 ``[B, N, T_pad]``, q·k̄·sm_scale (natural-log units).
    q_lengths, kv_lengths: int32 ``[B]`` valid lengths.
    spec: causal / window description.
    out, lse: the forward's output (``q``'s layout) and natural-log LSE
      ``[B, N, T_pad]`` (−inf where a row sees nothing) to take δ and the LSE
      from; None: recompute them exactly.
    d_lse: the LSE's cotangent f32 ``[B, N, T_pad]``, or None.
    mask: int8 ``[B|1, N|1, T_pad, S_pad]`` (nonzero = attend), or None.
    bias: float ``[B|1, N|1, T_pad, S_pad]``, or None.
    dbias_shape: the bias's ``[B|1, N|1, T|1, S|1]`` shape (padded T/S) to
      return its gradient in; None for no bias gradient.
    int8: SageBwd's INT8 operands (see :func:`quantize_int8`), or None.
    logits_soft_cap: Gemma-2's cap ``c`` (natural-log logits x, after the
      bias, become ``c·tanh(x / c)`` before the masks), or None. With a cap
      ``k`` must not be smoothed (``lse_shift`` zeros): the rows of dX = dS
      ∘ (1 − tanh²) do not sum to dLSE, so no K mean can be taken out of
      dQ; ``k_mean`` is then k̄, any vector near K's mean, and the dQ
      kernel adds −λ(D − dLSE)·k̄ from its row sums
      (:func:`sagejax.quant.capped_dq_shift`; nothing with exact
      statistics). Saved statistics not with ``tiling.dq_atomic`` (no
      row sums there).

  Returns:
    (dq, dk, dv in the inputs' layout and dtypes, padded; dbias f32 in
    ``dbias_shape`` or None).
  """
  b, n, t_pad, h, kh, s_pad = layout_dims(q, k, layout)
  g = n // kh
  bq, bk = tiling.block_q, tiling.block_k
  bq2, bk2 = tiling.block_q_dq, tiling.block_k_dq
  for size, tile, what in ((t_pad, bq, "block_q"), (t_pad, bq2, "block_q_dq"),
                           (s_pad, bk, "block_k"), (s_pad, bk2, "block_k_dq")):
    if size % tile:
      raise ValueError(f"padded length {size} is not a multiple of the "
                       f"tiling's {what}={tile}.")
  if logits_soft_cap is not None and tiling.dq_atomic and out is not None:
    raise ValueError("Under a soft cap, saved statistics need the row sums "
                     "of the dQ kernel: pass BackwardTiling(dq_atomic=False)"
                     " or recompute the statistics (out=None).")
  all_masked = mask is not None or bias is not None
  causal = spec.is_causal
  f32 = jnp.float32
  q_layout = "BNTH" if int8 is not None else layout

  per_batch = pl.BlockSpec((None,), lambda x, y, z: (y,))

  # --- δ and lse₂ (grid: query block, batch, head) --------------------------
  nq2, nk2 = t_pad // bq2, s_pad // bk2
  # Causal: the query blocks with the most keys first (load balance).
  i2 = (lambda x: nq2 - 1 - x) if causal else (lambda x: x)
  vec2 = pl.BlockSpec((None, None, bq2), lambda x, y, z: (y, z, i2(x)))

  def band2(x):
    """A [bq2, S_pad] row band of a [B|1, N|1, T_pad, S_pad] mask/bias."""
    if x is None:
      return None
    xb, xn = x.shape[0], x.shape[1]
    return pl.BlockSpec((None, None, bq2, s_pad), lambda x_, y, z: (
        y if xb > 1 else 0, z if xn > 1 else 0, i2(x_), 0))

  if layout == "BTNH":
    q_blk = pl.BlockSpec((None, bq2, None, h),
                         lambda x, y, z: (y, i2(x), z, 0))
    kv_full = pl.BlockSpec((None, s_pad, None, h),
                           lambda x, y, z: (y, 0, z // g, 0))
  else:
    q_blk = pl.BlockSpec((None, None, bq2, h),
                         lambda x, y, z: (y, z, i2(x), 0))
    kv_full = pl.BlockSpec((None, None, s_pad, h),
                           lambda x, y, z: (y, z // g, 0, 0))
  vec_shape = jax.ShapeDtypeStruct((b, n, t_pad), f32)
  grid2 = (nq2, b, n)
  if out is not None:
    lse2, delta = pl.pallas_call(
        _delta_kernel, grid=grid2,
        in_specs=[q_blk, q_blk, vec2, vec2,
                  None if d_lse is None else vec2],
        out_specs=[vec2, vec2], out_shape=[vec_shape, vec_shape],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="sage_attention_bwd_delta",
    )(out, d_out, lse, lse_shift, d_lse)
  else:
    kernel = functools.partial(
        _stats_kernel, spec=spec, block_q=bq2, block_k=bk2,
        c=sm_scale * quant.LOG2E, num_kv_blocks=nk2, all_masked=all_masked,
        q_block_of=i2, soft_cap=logits_soft_cap)
    lse2, delta = pl.pallas_call(
        kernel, grid=grid2,
        in_specs=[q_blk, kv_full, kv_full, q_blk,
                  None if d_lse is None else vec2, band2(mask), band2(bias),
                  per_batch, per_batch],
        out_specs=[vec2, vec2], out_shape=[vec_shape, vec_shape],
        compiler_params=plgpu.CompilerParams(
            num_warps=tiling.num_warps_dq, num_stages=tiling.num_stages_dq),
        interpret=interpret, name="sage_attention_bwd_stats",
    )(q, k, v, d_out, d_lse, mask, bias, q_lengths, kv_lengths)

  # --- dK, dV (grid: KV block, batch, KV head) --------------------------------
  nq, nk = t_pad // bq, s_pad // bk

  def group_spec(x_layout):
    """All rows of the G query heads of KV head ``z``."""
    if x_layout == "BTNH":
      return pl.BlockSpec((None, t_pad, g, h), lambda x, y, z: (y, 0, z, 0))
    return pl.BlockSpec((None, g, t_pad, h), lambda x, y, z: (y, z, 0, 0))

  group_vec = pl.BlockSpec((None, g, t_pad), lambda x, y, z: (y, z, 0))
  if layout == "BTNH":
    kv_blk = pl.BlockSpec((None, bk, None, h), lambda x, y, z: (y, x, z, 0))
  else:
    kv_blk = pl.BlockSpec((None, None, bk, h), lambda x, y, z: (y, z, x, 0))
  k_blk = kv_blk
  k_scale_blk = None
  if int8 is not None:
    k_blk = pl.BlockSpec((None, None, bk, h), lambda x, y, z: (y, z, x, 0))
    k_scale_blk = pl.BlockSpec((None, None, bk), lambda x, y, z: (y, z, x))

  def band(x):
    """A [G|1, T_pad, bk] column band of a [B|1, N|1, T_pad, S_pad] array."""
    if x is None:
      return None
    xb, xn = x.shape[0], x.shape[1]
    return pl.BlockSpec((None, g if xn > 1 else 1, t_pad, bk),
                        lambda x_, y, z: (y if xb > 1 else 0,
                                          z if xn > 1 else 0, 0, x_))

  inputs = [int8.q if int8 else q, int8.q_scale if int8 else None,
            int8.k if int8 else k, int8.k_scale if int8 else None, v, d_out,
            int8.do if int8 else None, int8.do_scale if int8 else None, lse2,
            delta, mask, bias, q_lengths, kv_lengths]
  in_specs = [group_spec(q_layout), group_vec if int8 else None, k_blk,
              k_scale_blk, kv_blk, group_spec(layout),
              group_spec("BNTH") if int8 else None,
              group_vec if int8 else None, group_vec, group_vec, band(mask),
              band(bias), per_batch, per_batch]
  out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype)]
  out_specs = [kv_blk, kv_blk]
  aliases = {}
  dq_acc = None
  if tiling.dq_atomic:
    dq_acc = jnp.zeros(q.shape, f32)
    aliases[len([x for x in inputs if x is not None])] = 2
    out_shape.append(jax.ShapeDtypeStruct(q.shape, f32))
    out_specs.append(group_spec(layout))
  else:
    out_shape.append(None)
    out_specs.append(None)
  inputs.append(dq_acc)
  in_specs.append(None if dq_acc is None else group_spec(layout))
  dbias_acc = None
  if dbias_shape is not None:
    dbias_acc = jnp.zeros(dbias_shape, f32)
    full = pl.BlockSpec(dbias_shape, lambda x, y, z: (0, 0, 0, 0))
    aliases[len([x for x in inputs if x is not None])] = len(
        [o for o in out_shape if o is not None])
    out_shape.append(jax.ShapeDtypeStruct(dbias_shape, f32))
    out_specs.append(full)
  else:
    full = None
    out_shape.append(None)
    out_specs.append(None)
  inputs.append(dbias_acc)
  in_specs.append(full)
  kernel = functools.partial(
      _dkdv_kernel, spec=spec, layout=layout, q_layout=q_layout, block_q=bq,
      block_k=bk, groups=g, sm_scale=sm_scale, num_q_blocks=nq,
      all_masked=all_masked, int8=int8 is not None,
      dbias_heads=dbias_shape is not None and dbias_shape[1] > 1,
      dbias_batch=dbias_shape is not None and dbias_shape[0] > 1,
      interpret=interpret, soft_cap=logits_soft_cap,
      unmasked_first=tiling.unmasked_first)
  dk, dv, dq_acc, dbias = pl.pallas_call(
      kernel, grid=(nk, b, kh), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps,
                                           num_stages=tiling.num_stages),
      interpret=interpret, name="sage_attention_bwd_dkdv",
  )(*inputs)

  # --- dQ ---------------------------------------------------------------------
  if tiling.dq_atomic:
    dq = dq_acc
    if d_lse is not None and logits_soft_cap is None:  # Σ_j dS_ij = dLSE_i
      dl = jnp.where(lse2 < _INF, d_lse, 0.0) * sm_scale
      dl = dl[..., None] * jnp.repeat(k_mean, g, axis=1)[:, :, None, :]
      dq = dq + (jnp.swapaxes(dl, 1, 2) if layout == "BTNH" else dl)
    return dq.astype(q.dtype), dk, dv, dbias
  kernel = functools.partial(
      _dq_kernel, spec=spec, block_q=bq2, block_k=bk2, sm_scale=sm_scale,
      num_kv_blocks=nk2, all_masked=all_masked, int8=int8 is not None,
      q_block_of=i2, interpret=interpret, soft_cap=logits_soft_cap,
      unmasked_first=tiling.unmasked_first)
  if int8 is not None:
    q8_blk = pl.BlockSpec((None, None, bq2, h),
                          lambda x, y, z: (y, z, i2(x), 0))
    k8_full = pl.BlockSpec((None, None, s_pad, h),
                           lambda x, y, z: (y, z // g, 0, 0))
    ks_full = pl.BlockSpec((None, None, s_pad),
                           lambda x, y, z: (y, z // g, 0))
    q_in, k_in = (int8.q, q8_blk), (int8.k, k8_full)
    qs_in, ks_in = (int8.q_scale, vec2), (int8.k_scale, ks_full)
  else:
    q_in, k_in = (q, q_blk), (k, kv_full)
    qs_in = ks_in = (None, None)
  head_vec = pl.BlockSpec((None, None, h), lambda x, y, z: (y, z // g, 0))
  with_kbar = d_lse is not None or logits_soft_cap is not None
  dq = pl.pallas_call(
      kernel, grid=grid2,
      in_specs=[q_in[1], qs_in[1], k_in[1], ks_in[1], kv_full, q_blk, vec2,
                vec2, None if d_lse is None else vec2,
                head_vec if with_kbar else None, band2(mask),
                band2(bias), per_batch, per_batch],
      out_specs=q_blk, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps_dq,
                                           num_stages=tiling.num_stages_dq),
      interpret=interpret, name="sage_attention_bwd_dq",
  )(q_in[0], qs_in[0], k_in[0], ks_in[0], v, d_out, lse2, delta, d_lse,
    k_mean if with_kbar else None, mask, bias, q_lengths, kv_lengths)
  return dq, dk, dv, dbias

"""Pallas (Triton) kernel: the fused SageAttention forward.

One program computes one block of ``block_q`` queries of one head against
the keys it may see (GQA: query head n reads KV head n // G, never a copy):

  s  = (q_int8 · k_int8ᵀ)_int32 · q_scale · k_scale (+ ΔS)   base-2 logits
  m' = max(m, rowmax s);  p̃ = exp2(s − m');  l' = l·2^(m−m') + rowsum p̃
  acc = acc·2^(m−m') + fp8(448·p̃) · v_fp8        (each block's product fresh,
                                                   then added: fp32+fp32)
  out = acc · v_scale / (448 · l) (+ V mean),   lse = (m + log2 l)·ln 2

With a logit soft cap, s is capped in natural-log units after ΔS and the bias
(plus K smoothing's row shift, :func:`sagejax.quant.soft_cap_base2`) and the
row scale no longer rides on the exp2. The KV loop visits only the blocks a
query block can see (causal diagonal, local window, per-batch lengths) and
applies the mask only to blocks that straddle an edge (user mask/bias arrays:
every block). When V holds FP8 values stored as FP16, P̃ is rounded to FP8 and
the product runs on FP16 tensor cores with the same operands (every e4m3 value
is an FP16 value). Inputs come from :mod:`sagejax.kernels.triton_quantize` (or
:func:`sagejax.quant.quantize`, with ``v_transposed=False``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sagejax import quant
from sagejax.kernels._common import kv_block_range, visit_blocks
from sagejax.masks import MaskSpec

_LOG2_P_SCALE = math.log2(quant.P_SCALE)


@dataclasses.dataclass(frozen=True)
class KernelTiling:
  """Tuning of the attention kernel (not part of the math).

  Attributes:
    block_q: query rows per program; divides the config's ``block_q`` when Q
      is smoothed (ΔS rows are per config block).
    block_k: keys per inner-loop step; a multiple of the config's ``block_k``
      is not required (scales are per token).
    num_warps: warps per program.
    num_stages: software-pipelining depth of the KV loop.
    heads_outer: launch order: all query blocks of one (batch, head) next to
      each other (True) or one query block of every head (False).
    heavy_first: visit query blocks last-to-first, so that under a causal mask
      the blocks with the most keys start first (load balance).
  """

  block_q: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 3
  heads_outer: bool = False
  heavy_first: bool = False

  def __post_init__(self):
    for field in ("block_q", "block_k", "num_warps"):
      v = getattr(self, field)
      if not isinstance(v, int) or v < 1 or v & (v - 1):
        raise ValueError(f"KernelTiling.{field} must be a power of two, got "
                         f"{v!r}.")
    if self.block_q < 16 or self.block_k < 32:
      raise ValueError("KernelTiling needs block_q >= 16 and block_k >= 32 "
                       f"(INT8 dots), got {self.block_q}, {self.block_k}.")
    if not 1 <= self.num_stages <= 6:
      raise ValueError(f"KernelTiling.num_stages must be in 1..6, got "
                       f"{self.num_stages}.")


def _fwd_kernel(q_ref, qs_ref, k_ref, ks_ref, v_ref, vs_ref, vm_ref, ds_ref,
                mask_ref, bias_ref, shift_ref, ql_ref, kl_ref, o_ref, lse_ref,
                *, block_q: int, block_k: int, int4: bool, fp8: bool,
                v_transposed: bool, spec: MaskSpec, num_kv_blocks: int,
                q_block_of, soft_cap: Optional[float]):
  i = q_block_of(pl.program_id(0), pl.program_id(1), pl.program_id(2))
  q_len = ql_ref[...]
  kv_len = kl_ref[...]
  q_first = i * block_q
  q_last = jnp.minimum(q_first + block_q, q_len) - 1

  # Block ranges: masked head [blo, fblo), unmasked [fblo, fbhi), masked tail
  # [fbhi, bhi). A query block past q_len sees nothing.
  blo, fblo, fbhi, bhi = kv_block_range(spec, q_first, q_last, q_len, kv_len,
                                        block_k, num_kv_blocks)

  q = q_ref[...]
  if int4:  # packed: low nibble = channel c, high = c + H/2 (quant.pack_int4)
    q_parts = ((q << jnp.int8(4)) >> jnp.int8(4), q >> jnp.int8(4))
  else:
    q_parts = (q,)
  q_scale = qs_ref[...]
  additive = ds_ref is not None or bias_ref is not None
  inv_q_scale = 1.0 / q_scale if additive else None
  rows = q_first + jnp.arange(block_q)
  # Without a soft cap the row scale q_scale rides on the exp2 (row_scale);
  # with one, the scores are capped in full (base-2) units, row scale 1.
  row_scale = q_scale if soft_cap is None else None
  shift = None if shift_ref is None else shift_ref[...][:, None]

  def body(j, carry, masked: bool):
    acc, m, l = carry
    start = pl.multiple_of(j * block_k, block_k)
    k = k_ref[pl.ds(start, block_k), :]
    if int4:
      k_parts = ((k << jnp.int8(4)) >> jnp.int8(4), k >> jnp.int8(4))
    else:
      k_parts = (k,)
    s_int = plgpu.dot(q_parts[0], k_parts[0], trans_b=True)
    if int4:
      s_int = s_int + plgpu.dot(q_parts[1], k_parts[1], trans_b=True)
    # Logits in base 2 are q_scale · t with t = s_int · k_scale. q_scale > 0
    # is a per-row factor, so rowmax(q_scale · t) = q_scale · rowmax(t) and
    # the row scale rides on the exp2's FMA: one multiply per element saved.
    t = s_int.astype(jnp.float32) * ks_ref[pl.ds(start, block_k)][None, :]
    if ds_ref is not None:  # ΔS is already in base-2 logit units.
      t = t + ds_ref[pl.ds(start, block_k)][None, :] * inv_q_scale[:, None]
    if bias_ref is not None:  # the user's bias, natural-log units
      bias = bias_ref[:, pl.ds(start, block_k)].astype(jnp.float32)
      t = t + bias * (quant.LOG2E * inv_q_scale[:, None])
    if soft_cap is not None:  # on natural-log logits (+ K smoothing's shift)
      t = quant.soft_cap_base2(t * q_scale[:, None], soft_cap, shift)
    if mask_ref is not None:  # the user's mask (int8, 1 = attend)
      t = jnp.where(mask_ref[:, pl.ds(start, block_k)] != 0, t, -jnp.inf)
    if masked:  # the rule of masks.MaskSpec, on this tile
      cols = start + jnp.arange(block_k)
      ok = spec.visible_at(rows[:, None], cols[None, :], q_len, kv_len)
      t = jnp.where(ok, t, -jnp.inf)
    t_max = jnp.max(t, axis=1)
    m_new = jnp.maximum(m, t_max if row_scale is None else row_scale * t_max)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_use)
    s = t if row_scale is None else t * row_scale[:, None]
    if fp8:
      # 448·P̃ = exp2(s − m + log2 448): the static scale rides on the exp2.
      p = jnp.exp2(s - (m_use - _LOG2_P_SCALE)[:, None])
      l = l * alpha + jnp.sum(p, axis=1) * (1.0 / quant.P_SCALE)
      p_op = p.astype(quant.FP8_DTYPE)
      if v_ref.dtype != quant.FP8_DTYPE:  # FP8 values on 16-bit tensor cores
        p_op = p_op.astype(v_ref.dtype)
    else:
      p = jnp.exp2(s - m_use[:, None])
      l = l * alpha + jnp.sum(p, axis=1)
      p_op = p.astype(v_ref.dtype)
    if v_transposed:
      v = v_ref[:, pl.ds(start, block_k)]
      pv = plgpu.dot(p_op, v, trans_b=True)
    else:
      v = v_ref[pl.ds(start, block_k), :]
      pv = plgpu.dot(p_op, v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l

  h = o_ref.shape[-1]
  carry = (jnp.zeros((block_q, h), jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  acc, m, l = visit_blocks((blo, fblo, fbhi, bhi), body, carry)

  # l != 0, not l > 0: a NaN sum (a poisoned input, quant's NaN scales) is
  # seen and gives NaN; a row that sees no key gives zeros, even past a NaN V
  # scale.
  seen = (l != 0) & (rows < q_len)
  p_scale = quant.P_SCALE if fp8 else 1.0
  inv = jnp.where(seen, 1.0 / (jnp.where(seen, l, 1.0) * p_scale), 0.0)
  out = acc * inv[:, None] * vs_ref[...][None, :]
  if vm_ref is not None:
    out = out + vm_ref[...][None, :]
  out = jnp.where(seen[:, None], out, 0.0)
  o_ref[...] = out.astype(o_ref.dtype)
  lse_ref[...] = jnp.where(
      seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * quant.LN2, -jnp.inf)


def attention_forward(
    qkv: quant.QuantizedQKV, spec: MaskSpec, *, q_lengths: jax.Array,
    kv_lengths: jax.Array, config_block_q: int, out_dtype,
    out_layout: str = "BNTH", v_transposed: bool = False,
    int4: bool = False, p_fp8: Optional[bool] = None,
    tiling: KernelTiling = KernelTiling(),
    mask: Optional[jax.Array] = None, bias: Optional[jax.Array] = None,
    logits_soft_cap: Optional[float] = None,
    row_shift: Optional[jax.Array] = None,
    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Runs the fused forward on quantized inputs.

  Args:
    qkv: quantized inputs (:class:`sagejax.quant.QuantizedQKV`); ``qkv.v`` is
      ``[B, K, S_pad, H]``, or ``[B, K, H, S_pad]`` with ``v_transposed``.
    spec: the causal / window description (``q_len``, ``kv_len`` unpadded).
    q_lengths, kv_lengths: int32 ``[B]`` valid lengths (full when unpadded).
    config_block_q: the quantization config's ``block_q`` (ΔS rows).
    out_dtype: output dtype.
    out_layout: ``"BNTH"`` or ``"BTNH"`` for the ``[B, *, T_pad, *, H]`` output.
    int4: Q and K are INT4-packed.
    p_fp8: round P̃ to FP8 e4m3 (static scale 448); default: when V is FP8.
      With V holding FP8 values stored as FP16, the P·V product runs on FP16
      tensor cores with exactly the FP8 operands (every e4m3 value is an
      FP16 value).
    mask: optional int8 ``[B|1, N|1, T_pad, S_pad]``, nonzero = attend.
    bias: optional float ``[B|1, N|1, T_pad, S_pad]`` added to the logits
      (natural-log units, after the scale).
    logits_soft_cap: optional cap ``c``: natural-log logits x (after the bias)
      become ``c·tanh(x / c)`` before the masks
      (:func:`sagejax.quant.soft_cap_base2`).
    row_shift: f32 ``[B, N, T_pad]`` natural-log shift added to every score
      of a row before the cap (``qkv.lse_shift``, padded); only with a cap.

  Returns:
    (output ``[B, N, T_pad, H]`` or ``[B, T_pad, N, H]``, natural-log LSE f32
    ``[B, N, T_pad]``). Rows past ``q_lengths`` are zero.
  """
  b, n, t_pad, hq = qkv.q.shape
  kh = qkv.k.shape[1]
  g = n // kh
  if v_transposed:
    h, s_pad = qkv.v.shape[2], qkv.v.shape[3]
  else:
    s_pad, h = qkv.v.shape[2], qkv.v.shape[3]
  bq = min(tiling.block_q, t_pad)
  bk = min(tiling.block_k, s_pad)
  if t_pad % bq or s_pad % bk:
    raise ValueError(f"padded lengths T={t_pad}, S={s_pad} must be multiples "
                     f"of the kernel blocks ({bq}, {bk}).")
  if qkv.delta_s is not None and config_block_q % bq:
    raise ValueError(f"kernel block_q={bq} must divide the config's block_q="
                     f"{config_block_q} when Q is smoothed.")
  fp8 = qkv.v.dtype == quant.FP8_DTYPE if p_fp8 is None else p_fp8
  nq = t_pad // bq
  # Program ids → (query block, batch, head), in the tiling's launch order.
  if tiling.heads_outer:
    grid = (b, n, nq)
    ids = lambda x, y, z: (z, x, y)
  else:
    grid = (nq, b, n)
    ids = lambda x, y, z: (x, y, z)
  if tiling.heavy_first:
    order = lambda x, y, z: ((nq - 1 - ids(x, y, z)[0]),) + ids(x, y, z)[1:]
  else:
    order = ids

  def spec_of(block, index):
    """BlockSpec whose index map takes (query block, batch, head)."""
    return pl.BlockSpec(block, lambda x, y, z: index(*order(x, y, z)))

  kernel = functools.partial(
      _fwd_kernel, block_q=bq, block_k=bk, int4=int4, fp8=fp8,
      v_transposed=v_transposed, spec=spec, num_kv_blocks=s_pad // bk,
      q_block_of=lambda x, y, z: order(x, y, z)[0],
      soft_cap=logits_soft_cap)
  if row_shift is not None and logits_soft_cap is None:
    raise ValueError("row_shift is only used with logits_soft_cap.")
  kv_head = lambda i, bb, nn: (bb, nn // g, 0, 0)
  head_vec = spec_of((None, None, h), lambda i, bb, nn: (bb, nn // g, 0))
  per_batch = spec_of((None,), lambda i, bb, nn: (bb,))
  ds_spec = None
  if qkv.delta_s is not None:
    ratio = config_block_q // bq
    ds_spec = spec_of((None, None, None, s_pad),
                      lambda i, bb, nn: (bb, nn, i // ratio, 0))
  def pairwise_spec(x):
    """Spec of a [B|1, N|1, T_pad, S_pad] mask/bias: a [bq, S_pad] row band."""
    if x is None:
      return None
    xb, xn = x.shape[0], x.shape[1]
    return spec_of((None, None, bq, s_pad),
                   lambda i, bb, nn: (bb if xb > 1 else 0,
                                      nn if xn > 1 else 0, i, 0))

  v_block = (None, None, h, s_pad) if v_transposed else (None, None, s_pad, h)
  in_specs = [
      spec_of((None, None, bq, hq), lambda i, bb, nn: (bb, nn, i, 0)),
      spec_of((None, None, bq), lambda i, bb, nn: (bb, nn, i)),
      spec_of((None, None, s_pad, hq), kv_head),
      spec_of((None, None, s_pad), lambda i, bb, nn: (bb, nn // g, 0)),
      spec_of(v_block, kv_head),
      head_vec,
      None if qkv.v_mean is None else head_vec,
      ds_spec,
      pairwise_spec(mask),
      pairwise_spec(bias),
      None if row_shift is None else spec_of(
          (None, None, bq), lambda i, bb, nn: (bb, nn, i)),
      per_batch,
      per_batch,
  ]
  if out_layout == "BTNH":
    out_shape = (b, t_pad, n, h)
    out_spec = spec_of((None, bq, None, h), lambda i, bb, nn: (bb, i, nn, 0))
  else:
    out_shape = (b, n, t_pad, h)
    out_spec = spec_of((None, None, bq, h), lambda i, bb, nn: (bb, nn, i, 0))
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs,
      out_specs=[out_spec,
                 spec_of((None, None, bq), lambda i, bb, nn: (bb, nn, i))],
      out_shape=[jax.ShapeDtypeStruct(out_shape, out_dtype),
                 jax.ShapeDtypeStruct((b, n, t_pad), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps,
                                           num_stages=tiling.num_stages),
      interpret=interpret, name="sage_attention_fwd",
  )(qkv.q, qkv.q_scale, qkv.k, qkv.k_scale, qkv.v, qkv.v_scale, qkv.v_mean,
    qkv.delta_s, mask, bias, row_shift, q_lengths, kv_lengths)

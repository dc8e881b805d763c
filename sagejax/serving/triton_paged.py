"""Pallas (Triton) kernel: attention over a paged KV cache (decode and extend).

One program takes ``block_q`` query tokens of one sequence and *all* the query
heads of one KV head (GQA packing: rows = token × head, ``block_q · Gp`` ≥ 16
rows so the dots have tensor-core shapes), and one of ``num_splits`` slices
of the keys those rows may see (split-KV flash-decoding). Decoding is
``block_q = 1`` with several splits; extend (prefix caching, chunked prefill)
is ``block_q`` ≥ 16 / Gp, usually one split. Per block of ``ppb`` pages
(``block_k = ppb · page_size`` keys) the program reads the pages' ids from
the page table and gathers K, V and their scales straight from the pool:

  s  = (q_int8 · k_int8ᵀ)_int32 · k_scale · q_scale            base-2 logits
       (plain cache: q·kᵀ in the cache dtype, f32 accumulation)
  [soft-cap, causal bottom-right + window mask on edge blocks]
  m' = max(m, rowmax s);  p̃ = exp2(s − m');  l' = l·2^(m−m') + rowsum p̃
  c  = max(v_scale over the block);  P' = p̃ · v_scale / c ∈ [0, 1]
  acc = acc·2^(m−m') + c · (round(P') · v_fp8)     (FP8 tensor cores when P'
       is FP8 and the V pages are transposed [H, page_size]; else both
       widened to FP16)

Queries are quantized to INT8 per row inside the kernel. Each split writes
its normalized output and base-2 LSE; with one split the program writes the
final output (plus ``v_smooth``). The arithmetic is
:func:`sagejax.serving.reference.paged_attention`'s.

A sequence with bad lengths, or whose page table names a page outside the
pool among the pages holding its tokens, reads nothing more and gives NaN;
every page id is clipped into the pool before it is dereferenced (keys past
a sequence's tokens, read from whatever page their id names, are masked).
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
from sagejax.kernels._common import kv_block_range, visit_blocks
from sagejax.serving.reference import PagedMath, quantize_query, soft_cap_logits

# Page-table entries checked per step of the validity scan.
_TABLE_CHUNK = 128


@dataclasses.dataclass(frozen=True)
class PagedTiling:
  """Tuning of the paged kernel (not part of the math, except ``block_k``:
  the P·V normalization block, see :class:`PagedMath`).

  Attributes:
    block_q: query tokens per program (decode: 1).
    block_k: keys per inner step; raised to the page size when smaller.
    num_splits: programs per (sequence, KV head, query block) that share its
      keys (split-KV); None: enough to fill the GPU.
    num_warps: warps per program.
    num_stages: software-pipelining depth of the key loop.
  """

  block_q: int = 1
  block_k: int = 64
  num_splits: Optional[int] = None
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for field in ("block_q", "block_k", "num_warps"):
      v = getattr(self, field)
      if not isinstance(v, int) or v < 1 or v & (v - 1):
        raise ValueError(f"PagedTiling.{field} must be a power of two, got "
                         f"{v!r}.")
    if self.block_k < 16:
      raise ValueError(f"PagedTiling.block_k must be >= 16, got "
                       f"{self.block_k}.")
    if self.num_splits is not None and (not isinstance(self.num_splits, int)
                                        or self.num_splits < 1):
      raise ValueError(f"PagedTiling.num_splits must be a positive int or "
                       f"None, got {self.num_splits!r}.")
    if not 1 <= self.num_stages <= 8:
      raise ValueError(f"PagedTiling.num_stages must be in 1..8, got "
                       f"{self.num_stages}.")


def _cdiv(a, b):
  return (a + b - 1) // b


def _kernel(qstart_ref, qlen_ref, qcap_ref, kvlen_ref, q_ref, pt_ref, k_ref,
            ks_ref, v_ref, vs_ref, km_ref, vm_ref, o_ref, lse_ref, *,
            math: PagedMath, groups: int, gp: int, bt: int, ppb: int,
            num_pages: int, num_splits: int, v_transposed: bool,
            interpret: bool):
  kh, i, split = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  ps, h = k_ref.shape[1], k_ref.shape[-1]
  bk = ppb * ps
  rows = bt * gp
  max_pages = pt_ref.shape[0]
  quantized = ks_ref is not None
  q_start, q_len, q_cap = qstart_ref[...], qlen_ref[...], qcap_ref[...]
  kv_len = kvlen_ref[...]
  bad = ((kv_len < 0) | (kv_len > max_pages * ps) | (q_len < 0)
         | (q_len > kv_len) | (q_len > q_cap))
  kv_len = jnp.where(bad, 0, kv_len)
  q_len = jnp.where(bad, 0, q_len)

  # Rows: token t (of this program's block) × head g of this KV head's group.
  q_first = i * bt
  tok_in = (q_first + jnp.arange(bt)) < q_cap            # this sequence's rows
  head_in = jnp.arange(gp) < groups
  io_mask = (tok_in[:, None] & head_in[None, :])[:, :, None]
  io_at = (pl.ds(q_start + q_first, bt), pl.ds(kh * groups, gp),
           slice(None))
  q = plgpu.load(q_ref.at[io_at], mask=io_mask, other=0.0).reshape(rows, h)
  tok = q_first + jnp.arange(rows) // gp

  shift = None
  if quantized:
    q_op, q_scale = quantize_query(q, math.sm_scale, interpret)
    if math.soft_cap is not None and km_ref is not None:
      shift = jnp.sum(q.astype(jnp.float32) * km_ref[...][None, :],
                      axis=1) * math.sm_scale
  else:
    q_op = q.astype(k_ref.dtype)

  # Key blocks [blo, bhi) may be seen by some row, [f_lo, f_hi) by every
  # row; this split takes its share of [blo, bhi).
  q_last = jnp.minimum(q_first + bt, q_len) - 1
  blo, f_lo, f_hi, bhi = kv_block_range(
      math.mask, q_first, q_last, q_len, kv_len, bk,
      _cdiv(max_pages * ps, bk))
  chunk = _cdiv(bhi - blo, num_splits)
  s_lo = jnp.minimum(blo + split * chunk, bhi)
  s_hi = jnp.minimum(s_lo + chunk, bhi)
  f_lo = jnp.clip(f_lo, s_lo, s_hi)
  f_hi = jnp.clip(f_hi, f_lo, s_hi)

  def body(j, carry, masked: bool):
    acc, m, l = carry
    slots = j * ppb + jnp.arange(ppb)
    ids = plgpu.load(pt_ref.at[pl.ds(j * ppb, ppb)], mask=slots < max_pages,
                     other=0)
    ids = jnp.clip(ids, 0, num_pages - 1)   # masked past kv_len
    k = k_ref[ids].reshape(bk, h)
    if v_transposed:   # pages [H, ps] -> the block's [H, bk]
      v = v_ref[ids[None, :, None], jnp.arange(h)[:, None, None],
                jnp.arange(ps)[None, None, :]].reshape(h, bk)
    else:
      v = v_ref[ids].reshape(bk, h)
    cols = j * bk + jnp.arange(bk)
    if quantized:
      s_int = plgpu.dot(q_op, k, trans_b=True)
      s = (s_int.astype(jnp.float32) * ks_ref[ids].reshape(bk)[None, :]
           * q_scale[:, None])
    else:
      s = plgpu.dot(q_op, k, trans_b=True) * (math.sm_scale * quant.LOG2E)
    if math.soft_cap is not None:
      s = soft_cap_logits(s, None if shift is None else shift[:, None],
                          math.soft_cap)
    if masked:
      visible = math.mask.visible_at(tok[:, None], cols[None, :], q_len,
                                     kv_len)
      s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_use)
    p = jnp.exp2(s - m_use[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    key_in = cols < kv_len               # past it: stale slots, masked
    if quantized:
      v_scale = vs_ref[ids].reshape(bk)
      # FP8 P̃ against transposed FP8 pages on FP8 tensor cores; otherwise
      # both widened to 16 bits.
      native = v_transposed and math.pv_dtype == "fp8_e4m3"
      op_dtype = (quant.FP8_DTYPE if native else
                  jnp.bfloat16 if math.pv_dtype == "bf16" else jnp.float16)
      v = v.astype(op_dtype)
      if masked:
        v_scale = jnp.where(key_in, v_scale, 0.0)
        in_v = key_in[None, :] if v_transposed else key_in[:, None]
        v = jnp.where(in_v, v, jnp.zeros((), op_dtype))
      c = jnp.max(v_scale)
      c = jnp.where(c > 0, c, 1.0)
      p = p * (v_scale * (1.0 / c))[None, :]
      if math.pv_dtype == "fp8_e4m3":
        p_op = (p * quant.P_SCALE).astype(quant.FP8_DTYPE).astype(op_dtype)
        c = c * (1.0 / quant.P_SCALE)
      else:
        p_op = p.astype(op_dtype)
      acc = acc * alpha[:, None] + plgpu.dot(p_op, v,
                                             trans_b=v_transposed) * c
    else:
      if masked:
        v = jnp.where(key_in[:, None], v, jnp.zeros((), v.dtype))
      acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
    return acc, m_new, l

  carry = (jnp.zeros((rows, h), jnp.float32),
           jnp.full((rows,), -jnp.inf, jnp.float32),
           jnp.zeros((rows,), jnp.float32))
  acc, m, l = visit_blocks((s_lo, f_lo, f_hi, s_hi), body, carry)

  # The first split checks every page holding the sequence's tokens.
  n_used = _cdiv(kv_len, ps)
  n_chunks = jnp.where((split == 0) & (q_first < q_cap),
                       _cdiv(n_used, _TABLE_CHUNK), 0)

  def check(c, outside):
    slots = c * _TABLE_CHUNK + jnp.arange(_TABLE_CHUNK)
    ids = plgpu.load(pt_ref.at[pl.ds(c * _TABLE_CHUNK, _TABLE_CHUNK)],
                     mask=slots < max_pages, other=0)
    wrong = (slots < n_used) & ((ids < 0) | (ids >= num_pages))
    return jnp.maximum(outside, jnp.max(wrong.astype(jnp.int32)))

  bad = bad | (lax.fori_loop(0, n_chunks, check, jnp.int32(0)) > 0)

  # Padding rows ride along unmasked blocks; a NaN row sum counts as seen.
  seen = ~(l <= 0) & (tok < q_len)
  out = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0)
  if lse_ref is None and vm_ref is not None:
    out = jnp.where(seen[:, None], out + vm_ref[...][None, :], 0.0)
  out = jnp.where(bad, jnp.nan, out)
  plgpu.store(o_ref.at[io_at], out.reshape(bt, gp, h).astype(o_ref.dtype),
              mask=io_mask)
  if lse_ref is not None:
    lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)
    plgpu.store(lse_ref.at[io_at[:2]], lse.reshape(bt, gp),
                mask=io_mask[..., 0])


def paged_attention(q: jax.Array, q_start: jax.Array, q_len: jax.Array,
                    q_cap: jax.Array, kv_len: jax.Array, cache,
                    page_table: jax.Array, math: PagedMath, *,
                    num_q_blocks: int, tiling: PagedTiling, num_splits: int,
                    out_dtype, interpret: bool = False, poison: bool = False):
  """Runs the paged kernel.

  Args:
    q: ``[rows, N, H]``: sequence b's query tokens are rows ``q_start[b] +
      [0, q_cap[b])``, the first ``q_len[b]`` of them real (the last ``q_len``
      of its ``kv_len`` tokens), the rest padding (output zeros).
    q_start, q_len, q_cap, kv_len: int32 ``[B]``.
    cache: a :class:`sagejax.serving.PagedKVCache`.
    page_table: int32 ``[B, max_pages]``.
    math: the static description (``math.block_k`` = the kernel's block).
    num_q_blocks: programs along each sequence's query tokens (covering its
      longest ``q_cap``).
    tiling, num_splits: tiles and the split count (resolved, not None).
    out_dtype: output dtype with one split.
    poison: start the outputs as NaN (checks: every row the kernel owns must
      be written).

  Returns:
    One split: the output ``[rows, N, H]`` in ``out_dtype``. Several: f32
    outputs ``[num_splits, rows, N, H]`` normalized per split and their
    base-2 LSEs ``[num_splits, rows, N]`` (:func:`merge_splits` combines
    them). Rows no program owns are left unwritten.
  """
  rows_total, n, h = q.shape
  b, max_pages = page_table.shape
  kh = cache.num_kv_heads
  groups = n // kh
  bt = tiling.block_q
  gp = max(1 << max(0, (groups - 1).bit_length()), 16 // bt)
  ps = cache.page_size
  bk = max(tiling.block_k, ps)
  if math.block_k != bk:
    raise ValueError(f"math.block_k={math.block_k} must be the kernel's "
                     f"block of keys {bk}.")
  grid = (b, kh, num_q_blocks, num_splits)
  per_seq = pl.BlockSpec((None,), lambda bb, hh, i, s: (bb,))
  whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa
  if cache.layout == "KPSH":
    pages = pl.BlockSpec((None, cache.num_pages, ps, h),
                         lambda bb, hh, i, s: (hh, 0, 0, 0))
    v_pages = pl.BlockSpec((None, cache.num_pages) + cache.v_pages.shape[2:],
                           lambda bb, hh, i, s: (hh, 0, 0, 0))
    scales = pl.BlockSpec((None, cache.num_pages, ps),
                          lambda bb, hh, i, s: (hh, 0, 0))
  else:
    pages = v_pages = pl.BlockSpec((cache.num_pages, ps, None, h),
                                   lambda bb, hh, i, s: (0, 0, hh, 0))
    scales = pl.BlockSpec((cache.num_pages, ps, None),
                          lambda bb, hh, i, s: (0, 0, hh))
  head_vec = pl.BlockSpec((None, h), lambda bb, hh, i, s: (hh, 0))
  quantized = cache.quantized
  smooth = cache.v_smooth is not None
  in_specs = [per_seq] * 4 + [
      whole(q), pl.BlockSpec((None, max_pages), lambda bb, hh, i, s: (bb, 0)),
      pages, scales if quantized else None, v_pages,
      scales if quantized else None,
      head_vec if smooth and math.soft_cap is not None else None,
      head_vec if smooth else None]
  if num_splits == 1:
    out_shape = [jax.ShapeDtypeStruct(q.shape, out_dtype)]
    out_specs = [whole(q)]
  else:
    out_shape = [jax.ShapeDtypeStruct((num_splits,) + q.shape, jnp.float32),
                 jax.ShapeDtypeStruct((num_splits, rows_total, n),
                                      jnp.float32)]
    out_specs = [
        pl.BlockSpec((None,) + q.shape, lambda bb, hh, i, s: (s, 0, 0, 0)),
        pl.BlockSpec((None, rows_total, n), lambda bb, hh, i, s: (s, 0, 0))]
  kernel = functools.partial(
      _kernel, math=math, groups=groups, gp=gp, bt=bt, ppb=bk // ps,
      num_pages=cache.num_pages, num_splits=num_splits,
      v_transposed=cache.v_transposed, interpret=interpret)
  km = cache.k_smooth if smooth and math.soft_cap is not None else None
  args = [q_start, q_len, q_cap, kv_len, q, page_table, cache.k_pages,
          cache.k_scales, cache.v_pages, cache.v_scales, km,
          cache.v_smooth if smooth else None]
  aliases = {}
  if poison:
    first = sum(a is not None for a in args)   # None inputs are no operands
    aliases = {first + i: i for i in range(len(out_shape))}
    args += [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
    in_specs = in_specs + out_specs
  kernel = functools.partial(_drop_refs, kernel, len(in_specs) - len(aliases),
                             len(aliases), num_splits == 1)
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps,
                                           num_stages=tiling.num_stages),
      interpret=interpret, name="sage_paged_attention",
  )(*args)


def _drop_refs(kernel, n_in: int, n_poison: int, one_output: bool, *refs):
  """Calls ``kernel`` without the poisoned (aliased) input refs, and with
  ``lse_ref=None`` when there is one output."""
  outs = refs[n_in + n_poison:]
  return kernel(*refs[:n_in], *outs, *((None,) if one_output else ()))


def merge_splits(out: jax.Array, lse: jax.Array,
                 v_smooth: Optional[jax.Array], out_dtype) -> jax.Array:
  """Combines per-split outputs ``[S, rows, N, H]`` by their base-2 LSEs
  ``[S, rows, N]`` (adds ``v_smooth [K, H]`` to rows that saw a key)."""
  m = jnp.max(lse, axis=0)
  w = jnp.exp2(lse - jnp.where(jnp.isfinite(m), m, 0.0))
  den = jnp.sum(w, axis=0)
  seen = (den > 0)[..., None]
  merged = jnp.sum(w[..., None] * out, axis=0) / jnp.where(seen, den[..., None],
                                                          1.0)
  merged = jnp.where(seen, merged, jnp.where(jnp.isnan(merged), merged, 0.0))
  if v_smooth is not None:
    n, kh = out.shape[2], v_smooth.shape[0]
    merged = merged + jnp.where(
        seen, jnp.repeat(v_smooth, n // kh, axis=0)[None], 0.0)
  return merged.astype(out_dtype)

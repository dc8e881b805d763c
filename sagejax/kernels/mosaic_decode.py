"""Pallas Mosaic GPU kernel: decode attention over a paged INT8/FP8 KV cache (sm90).

Decoding reads every cached key and value once per generated token and does
little arithmetic with them: it is bound by memory bandwidth, and an INT8 K /
FP8 V cache halves the bytes. The Triton paged kernel stalls at 2-2.5 TB/s on
an H200 (load latency and instructions per key, benchmarks/NOTES.md); this
kernel keeps whole pages in flight with TMA.

A CTA owns one sequence's KV head and a contiguous slice of its pages
(split-KV: ``num_splits`` CTAs share a sequence), and runs three warpgroups:

* a producer reads each page's id from the page table and copies the page's
  K ``[page_size, H]`` (INT8), Vᵀ ``[H, page_size]`` (FP8, the cache's
  transposed V pages) and their per-token scales with TMA into a
  ``num_stages``-deep shared-memory ring;
* two consumers take alternate pages, each with its own online softmax over
  the rows of one 64-row ``wgmma`` tile: the GQA group's query heads (INT8,
  quantized per row outside), padded with zero rows. Per page (``c``: the
  largest V scale of its keys, the normalization block of
  :class:`sagejax.serving.reference.PagedMath` with ``block_k = page_size``):

    s  = (q8 · k8ᵀ)_int32 · k_scale[key] · q_scale[row]        (wgmma s8)
    m' = max(m, rowmax s);  p̃ = exp2(s − m')
    P8 = fp8(448 · p̃ · v_scale[key] / c)                       (∈ [0, 448])
    acc = acc · 2^(m − m') · c_prev / c + P8 · v8              (wgmma e4m3)

  so that ``acc · c`` is the running (448-scaled) P·V; P8 goes through shared
  memory, which puts it in the token order of the V pages. Each consumer
  writes its normalized partial output and base-2 LSE; the partials of both
  consumers and all splits are merged by LSE outside (as the Triton kernel's
  splits are).

Keys past the sequence's length (the stale slots of its last page) and
before a local window are masked; the last page's stale V entries are zeroed
in shared memory first (a stale NaN would otherwise reach the output through
a zero P̃). Pages no key of which is visible are never read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sagejax import quant
from sagejax.kernels._common import kv_block_range
from sagejax.kernels.mosaic_attention import (_element, _mgpu, _quad_reduce,
                                              _row_array, _tree,
                                              check_registers, load_all,
                                              row_sum, wgmma_smem)
from sagejax.masks import MaskSpec

ROWS = 64  # one wgmma M tile: the GQA group's query heads, zero-padded
PAGE_SIZES = (32, 64, 128)
HEAD_DIMS = (64, 128)
_LOG2_P_SCALE = math.log2(quant.P_SCALE)


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
  """Tuning of the Mosaic decode kernel (not part of the math).

  Attributes:
    num_stages: pages in flight per CTA (the shared-memory ring); even, so
      that each consumer owns every other slot. None: at least 4 and 64 KiB
      (:func:`default_stages`).
    num_splits: CTAs per (sequence, KV head), each taking a contiguous
      share of the pages; None: :func:`choose_splits`.
    consumer_registers, producer_registers: per-thread registers
      (``setmaxnreg``) of the two consumer warpgroups and the producer.
  """

  num_stages: Optional[int] = None
  num_splits: Optional[int] = None
  consumer_registers: int = 232
  producer_registers: int = 40

  def __post_init__(self):
    if self.num_stages is not None and (
        self.num_stages % 2 or not 2 <= self.num_stages <= 16):
      raise ValueError(f"DecodeTiling.num_stages must be even, in 2..16, got "
                       f"{self.num_stages}.")
    if self.num_splits is not None and (not isinstance(self.num_splits, int)
                                        or self.num_splits < 1):
      raise ValueError(f"DecodeTiling.num_splits must be a positive int or "
                       f"None, got {self.num_splits!r}.")
    check_registers("DecodeTiling", self.consumer_registers,
                    self.producer_registers)


_SMEM_BYTES = 227 << 10   # what one CTA may take on sm90


def default_stages(page_size: int, head_dim: int) -> int:
  """Ring depth: at least 4 pages and 64 KiB in flight (measured on an H200
  with pages of 64: 4 and 8 stages within 2% of each other, 4 ahead at 4k
  tokens), within the shared memory left beside Q, the P̃ tiles and the
  partial outputs."""
  fixed = ROWS * head_dim + 2 * ROWS * page_size + 2 * ROWS * head_dim * 4 + (
      2 * ROWS * 4 + ROWS * 4 + 1024)
  stage = 2 * page_size * head_dim + 8 * page_size
  want = max(4, -(-(64 << 10) // stage))
  fits = (_SMEM_BYTES - fixed) // stage
  return max(2, min(want + want % 2, fits - fits % 2))


def default_tiling(page_size: int, head_dim: int) -> DecodeTiling:
  """:class:`DecodeTiling` with the ring :func:`default_stages` picks."""
  return DecodeTiling(num_stages=default_stages(page_size, head_dim))


def choose_splits(pairs: int, pages: int, num_sms: int,
                  overhead_pages: float = 4.0, max_splits: int = 64) -> int:
  """CTAs per (sequence, KV head) for ``pairs`` of them with ``pages``
  pages each on ``num_sms`` SMs (one CTA per SM at a time): the count that
  minimizes waves × (pages per CTA + a fixed cost of about
  ``overhead_pages`` pages: launch, Q, filling the ring)."""
  best, best_cost = 1, math.inf
  for s in range(1, max(1, min(max_splits, pages // 2)) + 1):
    waves = -(-pairs * s // num_sms)
    cost = waves * (pages / s + overhead_pages)
    if cost < best_cost - 1e-9:
      best, best_cost = s, cost
  return best


def _col_max(x: jax.Array, rows: int) -> jax.Array:
  """The maximum of a ``[N]`` column-layout (``WGMMA.reduce(0)``) vector,
  as a ``[rows]`` row-layout vector of equal values (NaN propagates)."""

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA.reduce(0),),
      return_type=plgpu.ShapeDtypeStruct((rows,), jnp.float32,
                                         layout=plgpu.Layout.WGMMA.reduce(1)))
  def reduce(_, x):
    _, _, _, arith, _ = _mgpu()
    v = _tree(arith.maximumf, list(x.registers.reshape(-1)))
    v = _quad_reduce(arith.maximumf,
                     arith.maximumf(_element(v, 0), _element(v, 1)))
    return _row_array([v, v], rows)

  return reduce(x)


def decode_forward(q: jax.Array, q_scale: jax.Array, k_pages: jax.Array,
                   k_scales: jax.Array, v_pages: jax.Array,
                   v_scales: jax.Array, page_table: jax.Array,
                   kv_len: jax.Array, *, groups: int,
                   window: Optional[int] = None, num_splits: int = 1,
                   tiling: DecodeTiling = DecodeTiling()
                   ) -> tuple[jax.Array, jax.Array]:
  """Runs the decode kernel.

  Args:
    q: int8 ``[B, K, 64, H]``: row g < ``groups`` is query head ``k·groups +
      g``, quantized per row; the other rows zeros.
    q_scale: f32 ``[B, K, 64]`` (with ``sm_scale·log2 e``); 1 on padding.
    k_pages: int8 ``[K, P, page_size, H]``; ``k_scales``, ``v_scales``: f32
      ``[K, P, page_size]``; ``v_pages``: float8_e4m3fn ``[K, P, H,
      page_size]``.
    page_table: int32 ``[B, max_pages]`` (ids are clipped into the pool).
    kv_len: int32 ``[B]`` cached tokens; the query is the last of them.
    groups: query heads per KV head (at most 64).
    window: the query sees keys ``[kv_len − 1 − window, kv_len − 1]``; None:
      all.
    num_splits: CTAs per (sequence, KV head).

  Returns:
    ``(out, lse)``: f32 ``[2·num_splits, B, K, groups, H]`` partial outputs,
    each normalized by its own sum, and their base-2 LSEs f32
    ``[2·num_splits, B, K, 64]`` (−inf where a partial saw no key; rows past
    ``groups`` are padding). Partial ``2·split + consumer``.
  """
  b, kh, rows, h = q.shape
  _, num_pages, ps, _ = k_pages.shape
  max_pages = page_table.shape[1]
  stages = tiling.num_stages or default_stages(ps, h)
  if rows != ROWS or not 1 <= groups <= ROWS:
    raise ValueError(f"q must be [B, K, {ROWS}, H] holding 1..{ROWS} query "
                     f"heads per KV head, got {q.shape} with {groups}.")
  if ps not in PAGE_SIZES or h not in HEAD_DIMS:
    raise ValueError(f"page_size {ps} / head dim {h}: the kernel takes "
                     f"pages of {PAGE_SIZES} tokens and head dims "
                     f"{HEAD_DIMS}.")
  if v_pages.shape != (kh, num_pages, h, ps) or (
      v_pages.dtype != quant.FP8_DTYPE) or k_pages.dtype != jnp.int8:
    raise ValueError("k_pages must be int8 [K, P, page_size, H] and v_pages "
                     "float8_e4m3fn [K, P, H, page_size] (transposed).")
  spec = MaskSpec(is_causal=True, causal_alignment="bottom_right",
                  window=None if window is None else (int(window), 0),
                  q_len=1, kv_len=0)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  col_layout = plgpu.Layout.WGMMA.reduce(0)

  def kernel(q_ref, qs_ref, k_ref, ks_ref, v_ref, vs_ref, pt_ref, kl_ref,
             out_ref, lse_ref, scratch):
    (q_smem, qs_smem, k_smem, ks_smem, v_smem, vs_smem, p_smem, o_smem,
     lse_smem) = scratch[0]
    q_bar, full, free = scratch[1:]
    split = lax.axis_index("splits")
    head = lax.axis_index("heads")
    batch = lax.axis_index("batch")
    wg = lax.axis_index("wg")
    length = kl_ref[batch]
    blo, flo, fhi, bhi = kv_block_range(spec, 0, 0, 1, length, ps, max_pages)
    chunk = lax.div(bhi - blo + num_splits - 1, jnp.int32(num_splits))
    s_lo = jnp.minimum(blo + split * chunk, bhi)
    s_hi = jnp.minimum(s_lo + chunk, bhi)
    flo = jnp.clip(flo, s_lo, s_hi)
    fhi = jnp.clip(fhi, flo, s_hi)

    @pl.when(wg < 2)
    def _consumer():
      plgpu.set_max_registers(tiling.consumer_registers, action="increase")
      first = s_lo + wg   # this consumer's pages: first, first + 2, ...

      def index(page):    # of this consumer's first page at or after page
        return lax.div(jnp.maximum(page - first + 1, 0), jnp.int32(2))

      plgpu.barrier_wait(q_bar)
      qs = load_all(qs_smem, row_layout)
      qs_b = lax.broadcast_in_dim(qs, (ROWS, ps), [0])

      def step(i, carry, masked: bool):
        acc, m, l, c_prev = carry
        j = first + 2 * i
        slot = lax.rem(j - s_lo, jnp.int32(stages))
        plgpu.barrier_wait(full.at[slot])

        def qk(s_ref):
          plgpu.wgmma(s_ref, q_smem,
                      plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
          return s_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((ROWS, ps), jnp.int32))
        ks = load_all(ks_smem.at[slot], col_layout)
        vs = load_all(vs_smem.at[slot], col_layout)
        t = s.astype(jnp.float32) * lax.broadcast_in_dim(ks, (ROWS, ps), [1])
        if masked:
          keys = j * ps + plgpu.broadcasted_iota(jnp.int32, (ps,), 0,
                                                 layout=col_layout)
          seen = spec.visible_at(jnp.int32(0), keys, jnp.int32(1), length)
          t = jnp.where(lax.broadcast_in_dim(seen, (ROWS, ps), [1]), t,
                        -jnp.inf)
          vs = jnp.where(keys < length, vs, 0.0)   # stale slots: no scale

          @pl.when((j + 1) * ps > length)
          def _zero_stale_values():
            # 8-bit values admit only bitwise operations: AND with a mask.
            tile = v_smem.at[slot]
            vt = lax.bitcast_convert_type(
                load_all(tile, plgpu.Layout.WGMMA), jnp.int8)
            key = j * ps + plgpu.broadcasted_iota(jnp.int32, (h, ps), 1,
                                                  layout=plgpu.Layout.WGMMA)
            keep = jnp.where(key < length, -1, 0).astype(jnp.int8)
            tile[...] = lax.bitcast_convert_type(vt & keep, quant.FP8_DTYPE)
            plgpu.commit_smem()

        m_new = jnp.maximum(m, qs * t.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_use)
        c = _col_max(vs, ROWS)
        c = jnp.where(c > 0, c, 1.0)
        # p = 448 · p̃ / c: the normalization by c rides in the exponent.
        shift = m_use - _LOG2_P_SCALE + jnp.log2(c)
        p = jnp.exp2(t * qs_b - lax.broadcast_in_dim(shift, (ROWS, ps), [0]))
        l = l * alpha + row_sum(p) * c
        p = p * lax.broadcast_in_dim(vs, (ROWS, ps), [1])
        p_smem.at[wg][...] = p.astype(quant.FP8_DTYPE)
        plgpu.commit_smem()

        def pv(pv_ref):
          plgpu.wgmma(pv_ref, p_smem.at[wg],
                      plgpu.transpose_ref(v_smem.at[slot], (1, 0)))

        block = pl.run_state(pv)(plgpu.ACC.init(
            plgpu.layout_cast(jnp.zeros((ROWS, h), jnp.float32),
                              plgpu.Layout.WGMMA)))
        plgpu.barrier_arrive(free.at[slot])
        factor = lax.broadcast_in_dim(alpha * c_prev / c, (ROWS, h), [0])
        return acc * factor + block, m_new, l, c

      carry = (plgpu.layout_cast(jnp.zeros((ROWS, h), jnp.float32),
                                 plgpu.Layout.WGMMA),
               plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32),
                                 row_layout),
               plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout),
               plgpu.layout_cast(jnp.ones((ROWS,), jnp.float32), row_layout))
      bounds = (index(s_lo), index(flo), index(fhi), index(s_hi))
      masked = lambda i, c: step(i, c, masked=True)  # noqa: E731
      carry = lax.fori_loop(bounds[0], bounds[1], masked, carry)
      carry = lax.fori_loop(bounds[1], bounds[2],
                            lambda i, c: step(i, c, masked=False), carry)
      acc, m, l, c = lax.fori_loop(bounds[2], bounds[3], masked, carry)

      seen = l != 0   # a NaN sum is seen (quant's rules)
      scale = jnp.where(seen, c / jnp.where(seen, l, 1.0), 0.0)
      o_smem.at[wg][...] = acc * lax.broadcast_in_dim(scale, (ROWS, h), [0])
      lse = m + jnp.log2(jnp.where(seen, l, 1.0)) - _LOG2_P_SCALE
      lse_smem.at[wg][...] = jnp.where(seen, lse, -jnp.inf)
      plgpu.commit_smem()
      part = 2 * split + wg
      plgpu.copy_smem_to_gmem(o_smem.at[wg, pl.ds(0, groups)],
                              out_ref.at[part, batch, head])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[part, batch, head])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(tiling.producer_registers, action="decrease")
      plgpu.copy_gmem_to_smem(q_ref.at[batch, head], q_smem, q_bar)
      plgpu.copy_gmem_to_smem(qs_ref.at[batch, head], qs_smem, q_bar)

      @pl.loop(0, s_hi - s_lo)
      def _(r):
        slot = lax.rem(r, jnp.int32(stages))
        page = jnp.clip(pt_ref[batch, s_lo + r], 0, num_pages - 1)

        @pl.when(r >= stages)
        def _():
          plgpu.barrier_wait(free.at[slot])

        bar = full.at[slot]
        plgpu.copy_gmem_to_smem(k_ref.at[head, page], k_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(ks_ref.at[head, page], ks_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(v_ref.at[head, page], v_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(vs_ref.at[head, page], vs_smem.at[slot], bar)

  def entry(*refs):
    smem = (
        wgmma_smem((ROWS, h), jnp.int8),
        plgpu.SMEM((ROWS,), jnp.float32),
        wgmma_smem((stages, ps, h), jnp.int8),
        plgpu.SMEM((stages, ps), jnp.float32),
        wgmma_smem((stages, h, ps), quant.FP8_DTYPE),
        plgpu.SMEM((stages, ps), jnp.float32),
        wgmma_smem((2, ROWS, ps), quant.FP8_DTYPE),
        plgpu.SMEM((2, ROWS, h), jnp.float32),
        plgpu.SMEM((2, ROWS), jnp.float32),
    )
    pl.run_scoped(
        lambda *scratch: kernel(*refs, scratch), smem,
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        collective_axes="wg")

  parts = 2 * num_splits
  return plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((parts, b, kh, groups, h), jnp.float32),
                jax.ShapeDtypeStruct((parts, b, kh, ROWS), jnp.float32)),
      grid=(num_splits, kh, b),
      grid_names=("splits", "heads", "batch"),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(q, q_scale, k_pages, k_scales, v_pages, v_scales, page_table, kv_len)

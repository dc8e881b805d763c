"""Pallas Mosaic GPU kernel: decode attention over a paged KV cache (sm90).

Decoding reads every cached key and value once per generated token and does
little arithmetic with them: it is bound by memory bandwidth, and an INT8 K /
FP8 V cache halves the bytes. The Triton paged kernel stalls at 2-2.5 TB/s on
an H200 (load latency and instructions per key, benchmarks/NOTES.md); this
kernel keeps whole pages in flight with TMA.

A work item is one sequence's KV head and a contiguous slice of its pages
(split-KV: ``num_splits`` items share a sequence); a persistent grid of CTAs
(one per SM) takes the items in turn. A producer warpgroup reads page ids
from the page table and copies each page's K ``[page_size, H]`` (INT8), Vᵀ
``[H, page_size]`` (FP8: the cache's transposed V pages) and their per-token
scales with TMA into a ``num_stages``-deep ring that runs on across a CTA's
items (the next item's pages load while this one's last steps compute).
``num_consumers`` consumer warpgroups take steps of ``max(64, page_size)``
keys in turn, each with its own online softmax. The products run with the
*keys as rows*, so that the GQA group's few query heads (``NQ``, padded to a
multiple of 8) are the small ``N`` of the ``wgmma``, not 64 padded rows:

    sᵀ = (k8 · q8ᵀ)_int32 · k_scale[key] · q_scale[head]    [keys, NQ] (s8)
    m' = max(m, colmax sᵀ);  c = max v_scale over the step's keys
    P  = fp8(448 · exp2(sᵀ − m') · v_scale[key] / c)          (∈ [0, 448])
    oᵀ = oᵀ · 2^(m − m') · c_prev / c + vᵀ8 · P                [H, NQ] (e4m3)

so that ``oᵀ · c`` is the running (448-scaled) P·V; a step is the
normalization block of :class:`sagejax.serving.reference.PagedMath`
(``block_k =`` :func:`step_keys`). P is written to shared memory transposed
(``[NQ, keys]``, the K-major B operand that 8-bit ``wgmma`` requires, and
whose swizzle matches the V tile's) by element stores at the hardware
swizzle (:func:`_store_transposed`); the maxima and sums over keys cross the
warpgroup's warps through each consumer's own shared memory
(:func:`_over_keys`).

The queries arrive as they are (``[B, N, H]``): the producer copies the
group's rows into shared memory and each consumer quantizes them per row
into its own INT8 tile (:func:`_stage_query`). At the end of an item
consumer 0 merges the consumers' partials by their LSEs. With one split it
writes the output; with several (``DecodeTiling.merge_splits``, at most 8),
a sequence's splits are the CTAs of one cluster, which the hardware runs
together: a split after the first publishes its partial in global memory
and arrives on a cluster barrier, and the first split's CTA waits, merges
and writes (no state outside the call: nothing to zero before it, nothing
shared between calls). Otherwise the partials go out for the caller's
merge. A sequence whose length is out of range or whose pages include an id
outside the pool gives NaN.

A logit soft cap takes each step's base-2 logits (head scale in, K
smoothing's per-head shift added back) through c·tanh(x / c) before the
masks and the maxima.

16-bit pages (``k_scales`` None: bf16/fp16 K and V ``[page_size, H]``, pages
of 64 or 128) take the same path with 16-bit products: Q in the pages'
dtype, V transposed as the A operand (16-bit operands may be), P in the
pages' dtype, no scales and no 448.

Keys past the sequence's length (the stale slots of its last page) and
before a local window are masked; the last step's stale V entries are zeroed
in shared memory first (a stale NaN would otherwise reach the output through
a zero P). Pages no key of which is visible are never read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sagejax import quant
from sagejax.backends._device import sm_count
from sagejax.kernels._common import kv_block_range
from sagejax.kernels.mosaic_attention import (_element, _mgpu, _tree,
                                              check_registers, load_all,
                                              persistent_tiles,
                                              register_budget, wgmma_smem)
from sagejax.masks import MaskSpec

PAGE_SIZES = (32, 64, 128)
HEAD_DIMS = (64, 128)
MAX_GROUPS = 32  # query heads per KV head (the wgmma N, padded to 8)
MAX_CLUSTER = 8  # CTAs in a cluster (the portable limit): splits merged
_LOG2_P_SCALE = math.log2(quant.P_SCALE)
_SMEM_BYTES = 227 << 10   # what one CTA may take on sm90


def step_keys(page_size: int) -> int:
  """Keys per consumer step: a whole number of pages, at least one 64-row
  ``wgmma`` tile. With pages of 32 a step holds two, and the V scales'
  normalization ``c`` spans both (``PagedMath.block_k = 64``)."""
  return max(64, page_size)


def padded_groups(groups: int) -> int:
  """``NQ``: query heads per KV head rounded up to 8, 16 or 32 (a ``wgmma``
  N step whose rows split the warpgroup's threads evenly when the kernel
  quantizes them)."""
  return 8 if groups <= 8 else 16 if groups <= 16 else 32


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
  """Tuning of the Mosaic decode kernel (not part of the math).

  Attributes:
    num_consumers: consumer warpgroups per CTA, taking steps in turn.
    num_stages: steps in flight per CTA (the shared-memory ring), a multiple
      of ``num_consumers`` so that each consumer owns its slots. None: at
      least 4 steps and 64 KiB (:func:`default_stages`).
    num_splits: work items per (sequence, KV head), each a contiguous
      share of its steps; None: :func:`choose_splits`.
    num_ctas: the persistent grid's CTAs, taking the work items in turn;
      None: one per SM.
    consumer_registers, producer_registers: per-thread registers
      (``setmaxnreg``); None: what the register file leaves the consumers
      beside a producer of ``producer_registers``.
    merge_splits: several splits of a sequence (at most 8) merged in the
      kernel: they run as one CTA cluster and the first split's CTA waits on
      a cluster barrier for the others' partials; with more splits, or
      False, the caller merges them. ``num_ctas`` then counts whole
      clusters' CTAs (at least one cluster).
  """

  num_consumers: int = 2
  num_stages: Optional[int] = None
  num_splits: Optional[int] = None
  num_ctas: Optional[int] = None
  consumer_registers: Optional[int] = None
  producer_registers: int = 40
  merge_splits: bool = True

  def __post_init__(self):
    if self.num_consumers not in (1, 2, 3, 4):
      raise ValueError(f"DecodeTiling.num_consumers must be 1..4, got "
                       f"{self.num_consumers}.")
    if self.num_stages is not None and (
        self.num_stages % self.num_consumers
        or not self.num_consumers <= self.num_stages <= 16):
      raise ValueError(
          f"DecodeTiling.num_stages must be a multiple of num_consumers="
          f"{self.num_consumers} in {self.num_consumers}..16, got "
          f"{self.num_stages}.")
    for name in ("num_splits", "num_ctas"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"DecodeTiling.{name} must be a positive int or "
                         f"None, got {value!r}.")
    check_registers("DecodeTiling", self.registers(),
                    self.producer_registers, self.num_consumers)

  def registers(self) -> int:
    """The consumers' registers per thread."""
    if self.consumer_registers is not None:
      return self.consumer_registers
    free = (register_budget(self.num_consumers) - self.producer_registers
            ) // self.num_consumers
    return min(232, free // 8 * 8)


def _stage_bytes(page_size: int, head_dim: int, itemsize: int) -> int:
  """A ring slot: a step's K and V (and, 8-bit, their f32 scales)."""
  sk = step_keys(page_size)
  return 2 * sk * head_dim * itemsize + (8 * sk if itemsize == 1 else 0)


def _smem_bytes(page_size: int, head_dim: int, nq: int, consumers: int,
                stages: int, itemsize: int = 1, q_itemsize: int = 4) -> int:
  """Shared memory of the kernel (an upper bound: f32 queries and
  output, ``v_smooth`` and the merge's buffers counted)."""
  sk = step_keys(page_size)
  q_tiles = (2 * nq * head_dim * (q_itemsize + consumers * itemsize)
             + consumers * 2 * nq * 4)
  fixed = (q_tiles + 2 * nq * head_dim * 4 + 2 * head_dim * 4 + consumers * (
      sk * nq * itemsize + head_dim * nq * 4 + MAX_GROUPS * 4
      + 64 * (nq + 8)) + 1024)
  return fixed + stages * _stage_bytes(page_size, head_dim, itemsize)


def default_stages(page_size: int, head_dim: int, nq: int = 8,
                   consumers: int = 2, itemsize: int = 1,
                   q_itemsize: int = 4) -> int:
  """Ring depth: at least 4 steps and 64 KiB in flight (on an H200 with
  pages of 64, 4 and 8 stages ran within 2% of each other), a multiple of
  ``consumers``, within shared memory (``itemsize``: 1 for INT8/FP8
  pages, 2 for 16-bit ones; ``q_itemsize``: the queries')."""
  stage = _stage_bytes(page_size, head_dim, itemsize)
  want = max(4, -(-(64 << 10) // stage))
  stages = -(-want // consumers) * consumers
  while stages > consumers and _smem_bytes(
      page_size, head_dim, nq, consumers, stages, itemsize,
      q_itemsize) > _SMEM_BYTES:
    stages -= consumers
  return stages


def choose_splits(pairs: int, steps: int, ctas: int,
                  overhead_steps: float = 2.0, max_splits: int = 64) -> int:
  """Work items per (sequence, KV head) for ``pairs`` of them with
  ``steps`` steps each on ``ctas`` persistent CTAs: the count that
  minimizes the busiest CTA's items × (steps per item + about
  ``overhead_steps`` steps of its own: Q, the partial outputs)."""
  best, best_cost = 1, math.inf
  for s in range(1, max(1, min(max_splits, steps // 2)) + 1):
    waves = -(-pairs * s // ctas)
    cost = waves * (steps / s + overhead_steps)
    if cost < best_cost - 1e-9:
      best, best_cost = s, cost
  return best


def _thread_coords(bits: int = 32):
  """(row, column) of this thread's first element in a WGMMA-layout tile
  (lowering-time): thread ``4r + c`` of warp ``w`` holds rows ``16w + r``
  (``+ 8``, ``+ 64·t``) and columns ``2c``, ``2c + 1`` (``+ 8·n``); as
  ``bits``-wide integers."""
  mgpu, _, ir, arith, _ = _mgpu()
  t = ir.IntegerType.get_signless(bits)
  c = lambda v: arith.constant(t, v)  # noqa: E731
  tid = mgpu.utils.thread_idx()
  if bits != 32:
    tid = arith.extui(t, tid)
  lane = arith.andi(tid, c(31))
  warp = arith.andi(arith.shrui(tid, c(5)), c(3))
  row = arith.addi(arith.muli(warp, c(16)), arith.shrui(lane, c(2)))
  return row, arith.muli(arith.andi(lane, c(3)), c(2))


def _fence_cluster() -> None:
  """``fence.acq_rel.cluster`` by every thread of the warpgroup, then a
  warpgroup barrier: the threads' global stores before it are ordered, at
  the cluster's scope, before an arrival any of them makes after it (and a
  wait before it before their loads after it)."""

  @plgpu.inline_mgpu()
  def fence(_):
    mgpu, _, ir, _, _ = _mgpu()
    from jax._src.lib.mlir.dialects import llvm  # lowering-time only
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.acq_rel.cluster;",
                    "", has_side_effects=True)
    mgpu.utils.warpgroup_barrier()

  fence()


def _store_transposed(p: jax.Array, ref, page_size: int) -> None:
  """``ref[k // page_size, g, k % page_size] = p[k, g]`` for ``p [keys,
  NQ]`` (WGMMA layout; FP8 or 16-bit) and ``ref [keys / page_size, NQ,
  page_size]``, each page a :func:`wgmma_smem` tile (rows of ``page_size``
  elements in swizzled tiles of 8 rows × ``min(128, row bytes)``): one store
  per element, at the address the hardware's swizzle gives (the 16-byte
  chunk index XOR address bits 7 and up), so no transposing store is
  needed."""
  keys, nq = p.shape
  itemsize = jnp.dtype(p.dtype).itemsize
  swizzle = min(128, page_size * itemsize)
  per_tile = swizzle // itemsize          # elements of a row in one tile
  tiles_per_row = page_size // per_tile
  chunk_mask = swizzle // 16 - 1

  @plgpu.inline_mgpu(arg_types=(
      plgpu.Layout.WGMMA,
      plgpu.RefType((plgpu.TilingTransform((8, per_tile)),
                     plgpu.SwizzleTransform(swizzle)))))
  def store(_, p, smem):
    mgpu, _, ir, arith, vector = _mgpu()
    from jax._src.lib.mlir.dialects import llvm  # lowering-time only
    word = ir.IntegerType.get_signless(8 * itemsize)
    i64 = ir.IntegerType.get_signless(64)
    c = lambda v: arith.constant(i64, v)  # noqa: E731
    row, col = _thread_coords(64)
    ptr = mgpu.utils.memref_ptr(smem)
    base = llvm.ptrtoint(i64, ptr)
    regs = p.registers.reshape(keys // 64, nq // 8, 2)
    for tile, n8, half in np.ndindex(regs.shape):
      reg = regs[tile, n8, half]
      key = arith.addi(row, c(64 * tile + 8 * half))
      page = arith.divui(key, c(page_size))
      slot = arith.remui(key, c(page_size))
      for e in range(2):
        g = arith.addi(col, c(8 * n8 + e))
        block = arith.addi(   # which 8-row tile of the page
            arith.muli(arith.divui(g, c(8)), c(tiles_per_row)),
            arith.divui(slot, c(per_tile)))
        offset = arith.addi(
            arith.addi(arith.muli(page, c(nq * page_size * itemsize)),
                       arith.muli(block, c(8 * swizzle))),
            arith.addi(arith.muli(arith.remui(g, c(8)), c(swizzle)),
                       arith.muli(arith.remui(slot, c(per_tile)),
                                  c(itemsize))))
        addr = arith.addi(base, offset)
        chunk = arith.shli(
            arith.andi(arith.shrui(addr, c(7)), c(chunk_mask)), c(4))
        value = vector.extract(reg, dynamic_position=[],
                               static_position=ir.DenseI64ArrayAttr.get([e]))
        llvm.store(arith.bitcast(word, value),
                   llvm.inttoptr(ptr.type, arith.xori(addr, chunk)))

  store(p, ref)


def _stage_query(x_ref, q_ref, qs_ref, scale_mult: float) -> None:
  """Copies the query rows ``x_ref`` (``[R, H]``, float, unswizzled, as a
  TMA from any row lands; R of 8, 16 or 32) into the ``wgmma`` tile
  ``q_ref`` (``[R, H]``, a :func:`wgmma_smem` tile: the element stores land
  at the hardware swizzle). An int8 ``q_ref`` gets each row quantized as
  :func:`sagejax.serving.reference.quantize_query` does, and ``qs_ref`` (f32
  ``[R]``) the row scales times ``scale_mult`` (NaN for a row holding a NaN
  or ±Inf); a 16-bit one the rows in its dtype (``qs_ref`` None). ``128 /
  R`` threads of the warpgroup share a row (their maxima meet by lane
  shuffles)."""
  rows, h = x_ref.shape
  lanes = 128 // rows               # threads per row
  per = h // lanes                  # elements per thread
  itemsize = jnp.dtype(x_ref.dtype).itemsize
  out_size = jnp.dtype(q_ref.dtype).itemsize
  quantize = out_size == 1
  load = min(per, 16 // itemsize)   # elements per (≤ 16-byte) load
  store = min(per, 16 // out_size)  # elements per (≤ 16-byte) store
  swizzle = min(128, h * out_size)
  per_tile = swizzle // out_size    # elements of a row in one tile
  chunk_mask = swizzle // 16 - 1

  @plgpu.inline_mgpu(arg_types=(
      plgpu.RefType(),
      plgpu.RefType((plgpu.TilingTransform((8, per_tile)),
                     plgpu.SwizzleTransform(swizzle))),
      plgpu.RefType()) if quantize else (
          plgpu.RefType(),
          plgpu.RefType((plgpu.TilingTransform((8, per_tile)),
                         plgpu.SwizzleTransform(swizzle)))))
  def stage(_, x, q, *qs):
    mgpu, _, ir, arith, _ = _mgpu()
    from jax._src.lib.mlir.dialects import llvm  # lowering-time only
    from jax._src.lib.mlir.dialects import math as mlir_math
    i64 = ir.IntegerType.get_signless(64)
    f32 = ir.F32Type.get()
    c = lambda v: arith.constant(i64, v)  # noqa: E731
    f = lambda v: arith.constant(f32, v)  # noqa: E731
    tid = arith.andi(arith.extui(i64, mgpu.utils.thread_idx()), c(127))
    row = arith.divui(tid, c(lanes))
    first = arith.muli(arith.remui(tid, c(lanes)), c(per))
    x_ptr = mgpu.utils.memref_ptr(x)
    x_addr = arith.addi(llvm.ptrtoint(i64, x_ptr), arith.muli(
        arith.addi(arith.muli(row, c(h)), first), c(itemsize)))
    x_type = ir.MemRefType(x.type).element_type
    q_type = ir.MemRefType(q.type).element_type
    values = []
    for i in range(0, per, load):
      v = llvm.load(ir.VectorType.get((load,), x_type),
                    llvm.inttoptr(x_ptr.type,
                                  arith.addi(x_addr, c(i * itemsize))),
                    alignment=load * itemsize)
      for e in range(load):
        value = _element(v, e)
        values.append(value if x_type == f32 else arith.extf(f32, value))
    if quantize:
      amax = _tree(arith.maximumf, [mlir_math.absf(v) for v in values])
      for d in range(1, lanes):       # NaN propagates (maximumf)
        if d & (d - 1) == 0:
          amax = arith.maximumf(amax, mgpu.utils.shfl_bfly(amax, d))
      finite = arith.cmpf(arith.CmpFPredicate.OLT, amax, f(math.inf))
      positive = arith.cmpf(arith.CmpFPredicate.OGT, amax, f(0.0))
      scale = arith.select(positive, arith.divf(amax, f(127.0)), f(1.0))
      out = []
      for v in values:   # clamps by minnum/maxnum: NaN gives a defined int
        r = mlir_math.roundeven(arith.divf(v, scale))
        r = arith.maxnumf(arith.minnumf(r, f(127.0)), f(-127.0))
        out.append(arith.fptosi(q_type, r))
      qs_ptr = mgpu.utils.memref_ptr(qs[0])
      llvm.store(arith.select(finite, arith.mulf(scale, f(scale_mult)),
                              f(math.nan)),
                 llvm.inttoptr(qs_ptr.type, arith.addi(
                     llvm.ptrtoint(i64, qs_ptr), arith.muli(row, c(4)))))
    else:
      out = [arith.truncf(q_type, v) for v in values]
    q_ptr = mgpu.utils.memref_ptr(q)
    q_base = llvm.ptrtoint(i64, q_ptr)
    tiles_per_row = h // per_tile
    for i in range(0, per, store):
      e = arith.addi(first, c(i))     # the row's element, then its tile
      tile = arith.addi(arith.muli(arith.divui(row, c(8)), c(tiles_per_row)),
                        arith.divui(e, c(per_tile)))
      addr = arith.addi(q_base, arith.addi(
          arith.addi(arith.muli(tile, c(8 * swizzle)),
                     arith.muli(arith.remui(row, c(8)), c(swizzle))),
          arith.muli(arith.remui(e, c(per_tile)), c(out_size))))
      chunk = arith.shli(
          arith.andi(arith.shrui(addr, c(7)), c(chunk_mask)), c(4))
      llvm.store(_vector(out[i:i + store]),
                 llvm.inttoptr(q_ptr.type, arith.xori(addr, chunk)),
                 alignment=store * out_size)

  stage(x_ref, q_ref, *(() if qs_ref is None else (qs_ref,)))


def _index(base, offset: int):
  """``base + offset`` (an i32 value, lowering-time) as an MLIR index."""
  _, _, ir, arith, _ = _mgpu()
  i32 = ir.IntegerType.get_signless(32)
  return arith.index_cast(ir.IndexType.get(),
                          arith.addi(base, arith.constant(i32, offset)))


def _store_rows(x: jax.Array, ref) -> None:
  """``ref[g, h] = x[h, g]`` for ``x [H, NQ]`` (WGMMA layout) and an
  unswizzled ``ref [NQ, H]`` of its dtype: one store per element."""
  h, nq = x.shape

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
  def store(_, x, smem):
    from jax._src.lib.mlir.dialects import memref  # lowering-time only
    row, col = _thread_coords()
    regs = x.registers.reshape(h // 64, nq // 8, 2)
    for tile, n8, half in np.ndindex(regs.shape):
      hh = _index(row, 64 * tile + 8 * half)
      for e in range(2):
        g = _index(col, 8 * n8 + e)
        memref.store(_element(regs[tile, n8, half], e), smem, [g, hh])

  store(x, ref)


def _load_rows(ref, h: int) -> jax.Array:
  """f32 ``x [H, NQ]`` (WGMMA layout) with ``x[h, g] = ref[g, h]``, from an
  unswizzled f32 ``ref [NQ, H]`` (what :func:`_store_rows` wrote)."""
  nq = ref.shape[0]
  layout = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(),),
      return_type=plgpu.ShapeDtypeStruct((h, nq), jnp.float32,
                                         layout=layout))
  def load(_, smem):
    mgpu, fa, _, _, _ = _mgpu()
    from jax._src.lib.mlir.dialects import memref  # lowering-time only
    row, col = _thread_coords()
    shape = fa.WGMMA_LAYOUT.registers_shape((h, nq))
    regs = np.empty(shape, dtype=object)
    flat = regs.reshape(h // 64, nq // 8, 2)
    for tile, n8, half in np.ndindex(flat.shape):
      hh = _index(row, 64 * tile + 8 * half)
      flat[tile, n8, half] = _vector([
          memref.load(smem, [_index(col, 8 * n8 + e), hh])
          for e in range(2)])
    return mgpu.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT,
                                _is_signed=None)

  return load(ref)


def _store_columns(x: jax.Array, ref) -> None:
  """``ref[g] = x[g]`` for an f32 ``[NQ]`` column-layout vector (one
  value per ``wgmma`` column, held by every row's thread) and an unswizzled
  ``ref [NQ]`` (shared or global memory)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA.reduce(0),
                                plgpu.RefType()))
  def store(_, x, ref):
    from jax._src.lib.mlir.dialects import memref  # lowering-time only
    _, col = _thread_coords()
    for n8, v in enumerate(x.registers.reshape(-1)):
      for e in range(2):
        memref.store(_element(v, e), ref, [_index(col, 8 * n8 + e)])

  store(x, ref)


def _load_columns(ref) -> jax.Array:
  """The f32 ``[NQ]`` column-layout vector :func:`_store_columns` stored."""
  nq = ref.shape[0]
  layout = plgpu.Layout.WGMMA.reduce(0)

  @plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(),),
      return_type=plgpu.ShapeDtypeStruct((nq,), jnp.float32, layout=layout))
  def load(_, ref):
    mgpu, fa, _, _, _ = _mgpu()
    from jax._src.lib.mlir.dialects import memref  # lowering-time only
    _, col = _thread_coords()
    col_layout = fa.WGMMA_LAYOUT.reduce((0,))
    regs = np.empty(col_layout.registers_shape((nq,)), dtype=object)
    for n8 in range(nq // 8):
      regs.reshape(-1)[n8] = _vector(
          [memref.load(ref, [_index(col, 8 * n8 + e)]) for e in range(2)])
    return mgpu.FragmentedArray(_registers=regs, _layout=col_layout,
                                _is_signed=None)

  return load(ref)


def _over_keys(x: jax.Array, vs: Optional[jax.Array], scratch, op: str
               ) -> tuple[jax.Array, ...]:
  """Reductions over the keys (rows) of f32 ``x [keys, NQ]`` (WGMMA
  layout), per column, and of the ``[keys]`` row-layout ``vs`` (or None), as
  ``[NQ]`` column-layout vectors (``vs``'s result in every column).

  Within each warp by shuffles; across the warpgroup's 4 warps through
  ``scratch`` (f32 ``[4, NQ + 8]``, this consumer's own: Mosaic's reductions
  share one scratch buffer among the CTA's warpgroups, which raced between
  consumers on an H200) after one warpgroup barrier. A caller alternates
  two buffers so that the next reduction's stores cannot overtake this
  one's loads. ``op``: ``"max"`` (NaN propagates) or ``"add"``."""
  keys, nq = x.shape
  col = plgpu.Layout.WGMMA.reduce(0)
  outs = 1 if vs is None else 2
  arg_types = (plgpu.Layout.WGMMA,) + (
      () if vs is None else (plgpu.Layout.WGMMA.reduce(1),)) + (
          plgpu.RefType(),)

  @plgpu.inline_mgpu(
      arg_types=arg_types,
      return_type=tuple(plgpu.ShapeDtypeStruct((nq,), jnp.float32,
                                               layout=col)
                        for _ in range(outs)))
  def reduce(_, x, *rest):
    mgpu, fa, ir, arith, _ = _mgpu()
    from jax._src.lib.mlir.dialects import memref  # lowering-time only
    f = arith.maximumf if op == "max" else arith.addf
    index = ir.IndexType.get()
    i32 = ir.IntegerType.get_signless(32)
    c = lambda v: arith.constant(i32, v)  # noqa: E731
    vs, smem = (None, rest[0]) if len(rest) == 1 else rest
    regs = x.registers.reshape(keys // 64, nq // 8, 2)
    groups = [_tree(f, [regs[t, n8, h] for t in range(keys // 64)
                        for h in range(2)]) for n8 in range(nq // 8)]
    scalar = None
    if vs is not None:
      scalar = _tree(f, [_element(v) for v in vs.registers.reshape(-1)])
    for lanes in (4, 8, 16):   # lanes 4r + c of equal c: the warp's rows
      groups = [f(g, mgpu.utils.shfl_bfly(g, lanes)) for g in groups]
      if scalar is not None:
        scalar = f(scalar, mgpu.utils.shfl_bfly(scalar, lanes))
    tid = mgpu.utils.thread_idx()
    warp = arith.andi(arith.shrui(tid, c(5)), c(3))
    col0 = arith.muli(arith.andi(tid, c(3)), c(2))
    at = lambda *ix: [arith.index_cast(index, i) for i in ix]  # noqa: E731
    for n8, g in enumerate(groups):   # every lane of a quad column stores
      for e in range(2):
        memref.store(_element(g, e), smem,
                     at(warp, arith.addi(col0, c(8 * n8 + e))))
    if scalar is not None:
      memref.store(scalar, smem, at(warp, c(nq)))
    mgpu.utils.warpgroup_barrier()

    def across_warps(column):
      return _tree(f, [memref.load(smem, at(c(w), column)) for w in range(4)])

    layout = fa.WGMMA_LAYOUT.reduce((0,))
    columns = np.empty(layout.registers_shape((nq,)), dtype=object)
    for n8 in range(nq // 8):
      columns.reshape(-1)[n8] = _vector(
          [across_warps(arith.addi(col0, c(8 * n8 + e))) for e in range(2)])
    results = [columns]
    if scalar is not None:   # one value, in every column
      total = across_warps(c(nq))
      results.append(np.full(columns.shape, _vector([total, total]),
                             dtype=object))
    return tuple(mgpu.FragmentedArray(_registers=r, _layout=layout,
                                      _is_signed=None) for r in results)

  return reduce(x, *(() if vs is None else (vs,)), scratch)


def _vector(values):
  """A vector of scalars (lowering-time)."""
  _, _, ir, _, vector = _mgpu()
  return vector.from_elements(
      ir.VectorType.get((len(values),), values[0].type), values)


def decode_forward(q: jax.Array, k_pages: jax.Array,
                   k_scales: Optional[jax.Array], v_pages: jax.Array,
                   v_scales: Optional[jax.Array], page_table: jax.Array,
                   kv_len: jax.Array, *, sm_scale: float,
                   window: Optional[int] = None, num_splits: int = 1,
                   v_smooth: Optional[jax.Array] = None, out_dtype=None,
                   tiling: DecodeTiling = DecodeTiling(),
                   logits_soft_cap: Optional[float] = None,
                   row_shift: Optional[jax.Array] = None
                   ) -> tuple[jax.Array, Optional[jax.Array]]:
  """Runs the decode kernel.

  Args:
    q: ``[B, N, H]`` queries, float (8-bit pages: quantized to INT8 per row
      in the kernel, as :func:`sagejax.serving.reference.quantize_query`
      does) or, for 16-bit pages, in the pages' dtype; N = K·G, query head
      ``k·G + g`` on KV head ``k``.
    k_pages: int8 ``[K, P, page_size, H]``; ``k_scales``, ``v_scales``: f32
      ``[K, P, page_size]``; ``v_pages``: float8_e4m3fn ``[K, P, H,
      page_size]``. 16-bit pages: ``[K, P, page_size, H]`` each, no scales.
    page_table: int32 ``[B, max_pages]`` (ids are clipped into the pool).
    kv_len: int32 ``[B]`` cached tokens; the query is the last of them.
    sm_scale: the logits' scale.
    window: the query sees keys ``[kv_len − 1 − window, kv_len − 1]``; None:
      all.
    num_splits: work items per (sequence, KV head), each a contiguous
      share of its steps.
    v_smooth: f32 ``[K, H]`` added to the output of every head that saw a
      key (by the kernel when it writes the final output, else by the
      caller's merge).
    out_dtype: the merged output's dtype (one split); default ``q``'s.
    logits_soft_cap: Gemma-2's cap ``c``: the natural-log logits (plus
      ``row_shift``) become ``c·tanh(x / c)`` before the masks
      (:func:`sagejax.quant.soft_cap_base2`, ``tanh.approx``), or None.
    row_shift: f32 ``[B, N]``, what K smoothing took out of each head's
      logits (q·k̄·sm_scale, natural log: :func:`sagejax.quant.lse_shift`),
      added back before the cap; None: none taken out. Only with
      ``logits_soft_cap``.

  Returns:
    ``(out, None)`` when the kernel writes the final output (one split, or
    several merged in it: ``tiling.merge_splits`` and at most 8 splits, a
    cluster's CTAs): ``out [B, N, H]``, ``v_smooth`` added;
    NaN for every head of a sequence whose length is outside ``[1,
    max_pages · page_size]`` or, without a window, whose used pages include
    an id outside the pool (with a window the caller checks: pages before
    it are never read). Otherwise ``(out, lse)``: f32 ``[parts, B, K, NQ,
    H]`` partial outputs, each normalized by its own sum, and their base-2
    LSEs f32 ``[parts, B, K, MAX_GROUPS]`` (−inf where a partial saw no
    key; entries past NQ undefined), ``parts = num_splits · num_consumers``
    (partial ``consumers · split + consumer``), for
    :func:`~sagejax.serving.triton_paged.merge_splits` (which adds
    ``v_smooth``); the caller checks the sequences.
  """
  b, n, h = q.shape
  kh, num_pages, ps, _ = k_pages.shape
  groups = n // kh
  nq = padded_groups(groups)
  max_pages = page_table.shape[1]
  quantized = k_scales is not None
  items = num_splits * kh * b
  ctas = min(items, tiling.num_ctas or sm_count())
  # The kernel writes the final output with one split, and with several
  # (at most a CTA cluster's 8) when it merges them: a sequence's splits are
  # then the CTAs of one cluster, which the hardware runs together.
  clustered = (num_splits > 1 and tiling.merge_splits
               and num_splits <= MAX_CLUSTER)
  final = num_splits == 1 or clustered
  if clustered:   # whole clusters, each taking (sequence, KV head) pairs
    clusters = max(1, min(b * kh, ctas // num_splits))
    ctas = clusters * num_splits
  check_pages = final and window is None
  out_dtype = jnp.dtype(out_dtype or q.dtype)
  sk = step_keys(ps)
  pps = sk // ps               # pages per step
  cons = tiling.num_consumers
  stages = tiling.num_stages or default_stages(
      ps, h, nq, cons, k_pages.dtype.itemsize, q.dtype.itemsize)
  if n % kh or groups > MAX_GROUPS:
    raise ValueError(f"q must be [B, N, H] with N a multiple of the "
                     f"{kh} KV heads and at most {MAX_GROUPS} query heads "
                     f"per KV head, got {q.shape}.")
  if ps not in PAGE_SIZES or h not in HEAD_DIMS or (
      not quantized and ps != sk):
    raise ValueError(f"page_size {ps} / head dim {h}: the kernel takes "
                     f"pages of {PAGE_SIZES} tokens (16-bit: at least 64) "
                     f"and head dims {HEAD_DIMS}.")
  if quantized and (v_pages.shape != (kh, num_pages, h, ps) or (
      v_pages.dtype != quant.FP8_DTYPE) or k_pages.dtype != jnp.int8 or
                    q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32)):
    raise ValueError("k_pages must be int8 [K, P, page_size, H], v_pages "
                     "float8_e4m3fn [K, P, H, page_size] (transposed) and q "
                     "bf16, fp16 or f32.")
  if not quantized and (v_pages.shape != k_pages.shape or k_pages.dtype
                        not in (jnp.bfloat16, jnp.float16) or
                        v_pages.dtype != k_pages.dtype or q.dtype !=
                        k_pages.dtype or v_scales is not None):
    raise ValueError("16-bit pages: k_pages and v_pages [K, P, page_size, "
                     "H] of one 16-bit dtype, q in it, no scales.")
  if logits_soft_cap is not None and not logits_soft_cap > 0:
    raise ValueError(f"logits_soft_cap={logits_soft_cap!r}: pass a float > 0 "
                     "or None.")
  if row_shift is not None and (logits_soft_cap is None
                                or row_shift.shape != (b, n)):
    raise ValueError(f"row_shift (f32 [B, N] = {(b, n)}) goes with "
                     f"logits_soft_cap only, got {row_shift.shape}.")
  cap = None if logits_soft_cap is None else float(logits_soft_cap)
  if row_shift is not None:   # [B, K, MAX_GROUPS]: a copy of 128 bytes
    row_shift = jnp.pad(row_shift.astype(jnp.float32).reshape(b, kh, groups),
                        ((0, 0), (0, 0), (0, MAX_GROUPS - groups)))
  if n < nq:   # a TMA box of NQ query rows must fit in N
    q = jnp.pad(q, ((0, 0), (0, nq - n), (0, 0)))
  page_dtype = k_pages.dtype
  scale_mult = float(sm_scale) * quant.LOG2E
  spec = MaskSpec(is_causal=True, causal_alignment="bottom_right",
                  window=None if window is None else (int(window), 0),
                  q_len=1, kv_len=0)
  num_blocks = -(-max_pages // pps)
  acc_dtype = jnp.int32 if quantized else jnp.float32
  key_layout = plgpu.Layout.WGMMA.reduce(1)    # [keys]: one per row
  head_layout = plgpu.Layout.WGMMA.reduce(0)   # [NQ]: one per column

  def kernel(*refs):
    refs = list(refs)
    q_ref = refs.pop(0)
    k_ref, ks_ref = refs.pop(0), (refs.pop(0) if quantized else None)
    v_ref, vs_ref = refs.pop(0), (refs.pop(0) if quantized else None)
    pt_ref, kl_ref = refs.pop(0), refs.pop(0)
    vm_ref = refs.pop(0) if v_smooth is not None else None
    rs_ref = refs.pop(0) if row_shift is not None else None
    out_ref = refs.pop(0)
    lse_ref = None if final else refs.pop(0)
    part_ref = part_lse_ref = None
    if clustered:
      part_ref, part_lse_ref = refs.pop(0), refs.pop(0)
    scratch = refs.pop(0)
    (qx_smem, q_smem, qs_smem, k_smem, ks_smem, v_smem, vs_smem, p_smem,
     o_smem, lse_smem, x_smem, out_smem, vm_smem, flag_smem,
     rs_smem) = scratch[0]
    (q_bar, q_free, full, free, part_bar, part_free, flag_bar,
     split_bars) = scratch[1:]
    wg = lax.axis_index("wg")
    cta = lax.axis_index("cta")   # clustered: the cluster's index
    if clustered:   # cluster c takes pairs c, c + clusters, ...
      n_items = persistent_tiles(cta, b * kh, clusters)
    else:
      n_items = persistent_tiles(cta, items, ctas)

    def item(it):
      """Work item ``it`` of this CTA: (batch, KV head, split), the
      sequence's length (0 if out of range), whether it is out of range,
      its step range ``[s_lo, s_hi)`` and the unmasked part ``[flo,
      fhi)``."""
      if clustered:   # the split is the CTA's rank in its cluster
        pair = cta + it * clusters
        batch = lax.div(pair, jnp.int32(kh))
        head = lax.rem(pair, jnp.int32(kh))
        split = lax.axis_index("split")
      else:
        w = cta + it * ctas
        batch = lax.div(w, jnp.int32(kh * num_splits))
        head = lax.rem(lax.div(w, jnp.int32(num_splits)), jnp.int32(kh))
        split = lax.rem(w, jnp.int32(num_splits))
      length = kl_ref[batch]
      bad_length = (length < 1) | (length > max_pages * ps)
      length = jnp.where(bad_length, 0, length)
      blo, flo, fhi, bhi = kv_block_range(spec, 0, 0, 1, length, sk,
                                          num_blocks)
      chunk = lax.div(bhi - blo + num_splits - 1, jnp.int32(num_splits))
      s_lo = jnp.minimum(blo + split * chunk, bhi)
      s_hi = jnp.minimum(s_lo + chunk, bhi)
      flo = jnp.clip(flo, s_lo, s_hi)
      fhi = jnp.clip(fhi, flo, s_hi)
      return (batch, head, split, length, bad_length,
              (s_lo, flo, fhi, s_hi))

    @pl.when(wg < cons)
    def _consumer():
      plgpu.set_max_registers(tiling.registers(), action="increase")

      def heads(x):
        return plgpu.layout_cast(jnp.full((nq,), x, jnp.float32),
                                 head_layout)

      def run_item(it, done):
        """One work item; ``done``: ring steps of this CTA's earlier items
        (the ring's slots and their consumers run on across items)."""
        (batch, head, split, length, bad_length,
         (s_lo, flo, fhi, s_hi)) = item(it)
        qslot = lax.rem(it, jnp.int32(2))
        # This consumer's steps: those whose ring index is wg mod cons.
        first = s_lo + lax.rem(wg - lax.rem(done, jnp.int32(cons))
                               + cons, jnp.int32(cons))

        def index(block):   # of this consumer's first step at/after block
          return lax.div(jnp.maximum(block - first + cons - 1, 0),
                         jnp.int32(cons))

        plgpu.barrier_wait(q_bar.at[qslot])
        # Each consumer quantizes (16-bit: copies) Q into its own tile.
        q_tile = q_smem.at[wg, qslot]
        _stage_query(qx_smem.at[qslot], q_tile,
                     qs_smem.at[wg, qslot] if quantized else None,
                     scale_mult)
        plgpu.commit_smem()   # before the wgmma reads it
        if quantized:
          qs = load_all(qs_smem.at[wg, qslot], head_layout)
        else:
          qs = heads(scale_mult)
        shift = None
        if rs_ref is not None:
          shift = lax.broadcast_in_dim(
              load_all(rs_smem.at[qslot, pl.ds(0, nq)], head_layout),
              (sk, nq), [1])

        def step(i, carry, masked: bool):
          acc, m, l_acc, c_prev = carry
          j = first + cons * i
          slot = lax.rem(done + j - s_lo, jnp.int32(stages))
          plgpu.barrier_wait(full.at[slot])

          def qk(s_ref):
            plgpu.wgmma(s_ref, k_smem.at[slot],
                        q_tile.transpose((1, 0)))
            return s_ref[...]

          s = pl.run_scoped(qk, plgpu.ACC((sk, nq), acc_dtype))
          t = s.astype(jnp.float32)
          vs = None
          if quantized:
            ks = load_all(ks_smem.at[slot], key_layout)
            vs = load_all(vs_smem.at[slot], key_layout)
            t = t * lax.broadcast_in_dim(ks, (sk, nq), [0])
          if cap is not None:   # base-2 logits, capped (the head scale in)
            t = quant.soft_cap_base2(
                t * lax.broadcast_in_dim(qs, (sk, nq), [1]), cap, shift)
          if masked:
            keys = j * sk + plgpu.broadcasted_iota(jnp.int32, (sk,), 0,
                                                   layout=key_layout)
            seen = spec.visible_at(jnp.int32(0), keys, jnp.int32(1), length)
            t = jnp.where(lax.broadcast_in_dim(seen, (sk, nq), [0]), t,
                          -jnp.inf)
            if quantized:
              vs = jnp.where(keys < length, vs, 0.0)  # stale: no scale

            @pl.when((j + 1) * sk > length)
            def _zero_stale_values():
              for page in range(pps):
                tile = v_smem.at[slot, page]
                if quantized:   # 8 bits: only bitwise operations, AND
                  vt = lax.bitcast_convert_type(
                      load_all(tile, plgpu.Layout.WGMMA), jnp.int8)
                  key = j * sk + page * ps + plgpu.broadcasted_iota(
                      jnp.int32, (h, ps), 1, layout=plgpu.Layout.WGMMA)
                  keep = jnp.where(key < length, -1, 0).astype(jnp.int8)
                  tile[...] = lax.bitcast_convert_type(vt & keep,
                                                       quant.FP8_DTYPE)
                else:           # [page_size, H]
                  vt = load_all(tile, plgpu.Layout.WGMMA)
                  key = j * sk + plgpu.broadcasted_iota(
                      jnp.int32, (ps, h), 0, layout=plgpu.Layout.WGMMA)
                  tile[...] = jnp.where(key < length, vt,
                                        jnp.zeros((), page_dtype))
              plgpu.commit_smem()

          scratch = x_smem.at[wg, lax.rem(i, 2)]
          if quantized:
            t_max, c = _over_keys(t, vs, scratch, "max")
            c = jnp.where(c > 0, c, 1.0)
            # p = 448 · p̃ / c: the normalization by c rides in the exponent.
            shift_c = jnp.log2(c) - _LOG2_P_SCALE
          else:
            [t_max] = _over_keys(t, None, scratch, "max")
            c, shift_c = heads(1.0), 0.0
          if cap is None:
            m_new = jnp.maximum(m, qs * t_max)
          else:   # the head scale is in t already
            m_new = jnp.maximum(m, t_max)
          m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
          alpha = jnp.exp2(m - m_use)
          p = jnp.exp2((t if cap is not None else
                        t * lax.broadcast_in_dim(qs, (sk, nq), [1]))
                       - lax.broadcast_in_dim(m_use + shift_c, (sk, nq), [1]))
          if quantized:
            l_acc = (l_acc * lax.broadcast_in_dim(alpha, (sk, nq), [1])
                     + p * lax.broadcast_in_dim(c, (sk, nq), [1]))
            p = p * lax.broadcast_in_dim(vs, (sk, nq), [0])
            _store_transposed(p.astype(quant.FP8_DTYPE), p_smem.at[wg], ps)
          else:
            l_acc = l_acc * lax.broadcast_in_dim(alpha, (sk, nq), [1]) + p
            _store_transposed(p.astype(page_dtype), p_smem.at[wg], ps)
          plgpu.commit_smem()

          def pv(pv_ref):
            for page in range(pps):
              v_tile = v_smem.at[slot, page]   # 8-bit: Vᵀ; 16-bit: V
              plgpu.wgmma(pv_ref, v_tile if quantized
                          else v_tile.transpose((1, 0)),
                          p_smem.at[wg, page].transpose((1, 0)))

          block = pl.run_state(pv)(plgpu.ACC.init(
              plgpu.layout_cast(jnp.zeros((h, nq), jnp.float32),
                                plgpu.Layout.WGMMA)))
          plgpu.barrier_arrive(free.at[slot])
          factor = lax.broadcast_in_dim(alpha * c_prev / c, (h, nq), [1])
          return acc * factor + block, m_new, l_acc, c

        carry = (plgpu.layout_cast(jnp.zeros((h, nq), jnp.float32),
                                   plgpu.Layout.WGMMA),
                 heads(-jnp.inf),
                 plgpu.layout_cast(jnp.zeros((sk, nq), jnp.float32),
                                   plgpu.Layout.WGMMA),
                 heads(1.0))
        bounds = (index(s_lo), index(flo), index(fhi), index(s_hi))
        masked = lambda i, c: step(i, c, masked=True)  # noqa: E731
        carry = lax.fori_loop(bounds[0], bounds[1], masked, carry)
        carry = lax.fori_loop(bounds[1], bounds[2],
                              lambda i, c: step(i, c, masked=False), carry)
        acc, m, l_acc, c = lax.fori_loop(bounds[2], bounds[3], masked,
                                         carry)

        # Final sums alternate two buffers of their own (see _over_keys).
        [l] = _over_keys(l_acc, None, x_smem.at[wg, 2 + qslot], "add")
        seen = l != 0   # a NaN sum is seen (quant's rules)
        scale = jnp.where(seen, c / jnp.where(seen, l, 1.0), 0.0)
        o = acc * lax.broadcast_in_dim(scale, (h, nq), [1])
        lse = m + jnp.log2(jnp.where(seen, l, 1.0))
        if quantized:
          lse = lse - _LOG2_P_SCALE
        lse = jnp.where(seen, lse, -jnp.inf)
        if final:
          finish_final(it, qslot, batch, head, split, bad_length, o, lse)
        else:
          # The last item's partials have left shared memory (the issuing
          # thread waits; the barrier tells the others).
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          plgpu.commit_smem()
          _store_rows(o, o_smem.at[wg])
          lse_smem.at[wg, pl.ds(0, nq)][...] = lse
          plgpu.commit_smem()
          part = cons * split + wg
          plgpu.copy_smem_to_gmem(o_smem.at[wg],
                                  out_ref.at[part, batch, head])
          plgpu.copy_smem_to_gmem(lse_smem.at[wg],
                                  lse_ref.at[part, batch, head])
        plgpu.barrier_arrive(q_free.at[qslot])
        return done + (s_hi - s_lo)

      def combine(os, lses):
        """Partial outputs (normalized, ``[H, NQ]``) and their base-2 LSEs
        merged as ``merge_splits`` does: (output, LSE, seen)."""
        m = lses[0]
        for x in lses[1:]:
          m = jnp.maximum(m, x)
        m = jnp.where(jnp.abs(m) < jnp.inf, m, 0.0)   # −inf, NaN: 0
        ws = [jnp.exp2(x - m) for x in lses]
        den = ws[0]
        num = os[0] * lax.broadcast_in_dim(ws[0], (h, nq), [1])
        for w, x in zip(ws[1:], os[1:]):
          den = den + w
          num = num + x * lax.broadcast_in_dim(w, (h, nq), [1])
        seen = den > 0
        out = num / lax.broadcast_in_dim(jnp.where(seen, den, 1.0),
                                         (h, nq), [1])
        seen2 = lax.broadcast_in_dim(seen, (h, nq), [1])
        out = jnp.where(seen2, out, jnp.where(out != out, out, 0.0))
        lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, den, 1.0)),
                        jnp.where(den != den, den, -jnp.inf))
        return out, lse, seen

      def finish_final(it, qslot, batch, head, split, bad_length, o, lse):
        """Consumer 0 merges the item's consumers' partials (the others
        hand theirs over in shared memory). One split: it writes ``out[batch,
        head·G : (head + 1)·G]``. Several (a cluster's CTAs): splits after
        the first write their partial to global memory and arrive on the
        cluster's barrier; the first split's CTA waits for them, merges and
        writes."""
        if cons > 1:
          @pl.when(wg > 0)
          def _hand_over():
            @pl.when(it > 0)
            def _():   # consumer 0 has read the last item's
              plgpu.barrier_wait(part_free)

            _store_rows(o, o_smem.at[wg])
            lse_smem.at[wg, pl.ds(0, nq)][...] = lse
            plgpu.barrier_arrive(part_bar)

        @pl.when(wg == 0)
        def _merge():
          os, lses = [o], [lse]
          if cons > 1:
            plgpu.barrier_wait(part_bar)
            for k in range(1, cons):
              os.append(_load_rows(o_smem.at[k], h))
              lses.append(load_all(lse_smem.at[k, pl.ds(0, nq)],
                                   head_layout))
            plgpu.barrier_arrive(part_free)
          out, lse_c, seen = combine(os, lses)
          bad = bad_length
          if check_pages:
            plgpu.barrier_wait(flag_bar.at[qslot])
            bad = bad | (flag_smem[qslot] != 0)
          nan = jnp.where(bad, jnp.float32(jnp.nan), jnp.float32(0))

          def write(out, seen):
            seen2 = lax.broadcast_in_dim(seen, (h, nq), [1])
            if vm_ref is not None:
              vm = load_all(vm_smem.at[qslot], key_layout)   # [H]: per row
              out = out + jnp.where(
                  seen2, lax.broadcast_in_dim(vm, (h, nq), [0]), 0.0)
            # The item before last's rows have left shared memory.
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            plgpu.commit_smem()
            _store_rows(out.astype(out_dtype), out_smem.at[qslot])
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem.at[qslot, pl.ds(0, groups)],
                out_ref.at[batch, pl.ds(head * groups, groups)])

          if num_splits == 1:
            write(out + nan, seen)
            return
          # A bad sequence's partials are NaN, so its merge is.
          out, lse_c = out + nan, lse_c + nan
          ready, merged_bar = split_bars

          @pl.when(split > 0)
          def _publish():
            _store_rows(out, part_ref.at[split, batch, head])
            _store_columns(lse_c, part_lse_ref.at[split, batch, head])
            _fence_cluster()   # every thread's stores, then the arrival
            plgpu.barrier_arrive(ready)

          @pl.when(split == 0)
          def _gather():
            plgpu.barrier_arrive(ready)
            plgpu.barrier_wait(ready)
            _fence_cluster()
            os, lses = [out], [lse_c]
            for k in range(1, num_splits):
              os.append(_load_rows(part_ref.at[k, batch, head], h))
              lses.append(_load_columns(part_lse_ref.at[k, batch, head]))
            merged, _, seen_all = combine(os, lses)
            write(merged, seen_all)

          # Every split waits for the merge of this item before its next
          # one (no split arrives twice in a phase of `ready`), and no CTA
          # leaves while another may still arrive on its barriers.
          plgpu.barrier_arrive(merged_bar)
          plgpu.barrier_wait(merged_bar)

      lax.fori_loop(0, n_items, run_item, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == cons)
    def _producer():
      plgpu.set_max_registers(tiling.producer_registers, action="decrease")

      def load_item(it, done):
        batch, head, _, length, _, (s_lo, _, _, s_hi) = item(it)
        qslot = lax.rem(it, jnp.int32(2))

        @pl.when(it >= 2)
        def _():
          plgpu.barrier_wait(q_free.at[qslot])

        # Into an unswizzled buffer: a TMA into a swizzled tile would need
        # a first row that is a multiple of 8.
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(head * groups, nq)],
                                qx_smem.at[qslot], q_bar.at[qslot])
        if vm_ref is not None:
          plgpu.copy_gmem_to_smem(vm_ref.at[head], vm_smem.at[qslot],
                                  q_bar.at[qslot])
        if rs_ref is not None:
          plgpu.copy_gmem_to_smem(rs_ref.at[batch, head], rs_smem.at[qslot],
                                  q_bar.at[qslot])
        used = lax.div(length + ps - 1, jnp.int32(ps))

        def load_step(r, bad):
          ring = done + r
          slot = lax.rem(ring, jnp.int32(stages))

          @pl.when(ring >= stages)
          def _():
            plgpu.barrier_wait(free.at[slot])

          bar = full.at[slot]
          for i in range(pps):
            entry = jnp.minimum((s_lo + r) * pps + i, max_pages - 1)
            raw = pt_ref[batch, entry]
            bad = bad | ((entry < used) & ((raw < 0) | (raw >= num_pages)))
            page = jnp.clip(raw, 0, num_pages - 1)
            rows = pl.ds(i * ps, ps)
            plgpu.copy_gmem_to_smem(k_ref.at[head, page],
                                    k_smem.at[slot, rows], bar)
            plgpu.copy_gmem_to_smem(v_ref.at[head, page],
                                    v_smem.at[slot, i], bar)
            if quantized:
              plgpu.copy_gmem_to_smem(ks_ref.at[head, page],
                                      ks_smem.at[slot, rows], bar)
              plgpu.copy_gmem_to_smem(vs_ref.at[head, page],
                                      vs_smem.at[slot, rows], bar)
          return bad

        bad = lax.fori_loop(0, s_hi - s_lo, load_step, False)
        if check_pages:   # every used page was loaded (no window)
          flag_smem[qslot] = bad.astype(jnp.int32)
          plgpu.barrier_arrive(flag_bar.at[qslot])
        return done + (s_hi - s_lo)

      lax.fori_loop(0, n_items, load_item, jnp.int32(0))

  def entry(*refs):
    v_tile = (pps, h, ps) if quantized else (1, ps, h)
    p_tile = (pps, nq, ps)
    p_dtype = quant.FP8_DTYPE if quantized else page_dtype
    smem = (
        plgpu.SMEM((2, nq, h), q.dtype),
        wgmma_smem((cons, 2, nq, h), jnp.int8 if quantized else page_dtype),
        plgpu.SMEM((cons, 2, nq), jnp.float32) if quantized else None,
        wgmma_smem((stages, sk, h), page_dtype),
        plgpu.SMEM((stages, sk), jnp.float32) if quantized else None,
        wgmma_smem((stages,) + v_tile, v_pages.dtype),
        plgpu.SMEM((stages, sk), jnp.float32) if quantized else None,
        wgmma_smem((cons,) + p_tile, p_dtype),
        plgpu.SMEM((cons, nq, h), jnp.float32),
        plgpu.SMEM((cons, MAX_GROUPS), jnp.float32),
        plgpu.SMEM((cons, 4, 4, nq + 8), jnp.float32),   # _over_keys
        plgpu.SMEM((2, nq, h), out_dtype) if final else None,
        plgpu.SMEM((2, h), jnp.float32) if v_smooth is not None else None,
        plgpu.SMEM((2,), jnp.int32) if check_pages else None,
        plgpu.SMEM((2, MAX_GROUPS), jnp.float32)
        if row_shift is not None else None,
    )
    pl.run_scoped(
        lambda *scratch: kernel(*refs, scratch), smem,
        plgpu.Barrier(num_arrivals=1 + (v_smooth is not None)
                      + (row_shift is not None), num_barriers=2),
        plgpu.Barrier(num_arrivals=cons, num_barriers=2),
        plgpu.Barrier(num_arrivals=(4 if quantized else 2) * pps,
                      num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=max(1, cons - 1)),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=1, num_barriers=2),
        # a cluster's splits: partials published, and merged
        (plgpu.ClusterBarrier(collective_axes=("split",)),) * 2
        if clustered else None,
        collective_axes="wg")

  if final:
    out_type = (jax.ShapeDtypeStruct((b, n, h), out_dtype),)
    if clustered:   # the splits' partials, for the first to merge
      out_type += (
          jax.ShapeDtypeStruct((num_splits, b, kh, nq, h), jnp.float32),
          jax.ShapeDtypeStruct((num_splits, b, kh, nq), jnp.float32))
  else:
    parts = cons * num_splits
    out_type = (jax.ShapeDtypeStruct((parts, b, kh, nq, h), jnp.float32),
                jax.ShapeDtypeStruct((parts, b, kh, MAX_GROUPS),
                                     jnp.float32))
  outs = plgpu.kernel(
      entry,
      out_type=out_type,
      grid=(clusters,) if clustered else (ctas,),
      grid_names=("cta",),
      cluster=(num_splits,) if clustered else (),
      cluster_names=("split",) if clustered else (),
      num_threads=cons + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(*(x for x in (q, k_pages, k_scales, v_pages, v_scales, page_table,
                  kv_len, v_smooth, row_shift) if x is not None))
  return (outs[0], None) if final else tuple(outs)

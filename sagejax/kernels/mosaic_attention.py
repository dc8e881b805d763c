"""Pallas Mosaic GPU kernel: the SageAttention forward on Hopper (sm90).

FlashAttention-3 structure with 8-bit tensor cores. A CTA owns
``num_consumers * block_q`` query rows of one head and runs a warpgroup per
``block_q`` rows and one more:

* a producer (few registers) streams each KV step's K tile ``[block_kv, H]``
  (INT8), its per-key scales and the V tile into a ``num_stages``-deep shared
  memory ring with TMA, waiting on "consumed" barriers before reusing a slot;
* the consumers (two, or three with ``MosaicTiling.num_consumers``),
  ``block_q`` rows each, compute

    s  = (q_int8 · k_int8ᵀ)_int32 · k_scale[key] (+ ΔS / q_scale)   (wgmma s8)
    m' = max(m, q_scale · rowmax s);  p̃ = exp2(q_scale · s − m' + log2 448)
    l' = l · 2^(m − m') + rowsum p̃
    acc = acc · 2^(m − m') + fp8(p̃) · v_fp8                         (wgmma e4m3)

  taking turns on the tensor cores (a shared "schedule" barrier): while one
  warpgroup runs its softmax the other's two products run. Three consumers
  give each SM sub-partition three dependent softmax chains to interleave
  (benchmarks/NOTES.md, Mosaic section 9); they fit the register file with
  160 registers each. Taking turns around their exponentials in three
  phases (one consumer's ``exp2`` beside another's P·V and a third's
  Q·Kᵀ), on the persistent grid, they are the default for non-causal
  calls from 2048 keys with enough queries to fill their tiles (section
  37).

P̃ never leaves registers: the FP8 values of the FP32 accumulator layout are
re-labelled as the 8-bit A-operand layout of the second ``wgmma``
(:func:`_as_pv_operand`), which permutes the keys inside every group of 16;
V is stored transposed ``[H, S]`` with the same permutation
(:func:`pv_key_order`), so the product is unchanged. 8-bit ``wgmma`` operands
must be K-major in shared memory, hence K as ``[S, H]`` and Vᵀ as ``[H, S]``.
With 16-bit P·V (``sage1``), V is ``[S, H]`` and P̃ is cast to V's dtype.

The softmax's key scales and row sums work on registers where the K scale
groups allow (:func:`grouped_logits`; the unmasked steps read each thread's
scale per 64 keys from :func:`group_key_scales`, made before the kernel, and
take their row maxima over the INT32 sums, three at a time: Hopper's
three-input integer maximum, benchmarks/NOTES.md, section 44);
``MosaicTiling.overlap_qk`` issues the next step's Q·Kᵀ before the softmax
(benchmarks/NOTES.md, section 4);
``MosaicTiling.schedule_exp`` makes the consumers alternate their
exponentials rather than their softmaxes (the H=64 default, section 5);
``MosaicTiling.quantize_q`` has each consumer quantize its 16-bit Q rows in
the prologue (:class:`QuantizeQ`, section 6; off).

Each KV block's P·V starts from a fresh accumulator and is added into the
FP32 output accumulator (``"fp32+fp32"``); with ``pv_two_level=False`` the
running accumulator is fed to the ``wgmma`` instead. KV blocks a CTA cannot
see (causal diagonal, local window, per-batch lengths) are never loaded; the
mask is applied only to the blocks that straddle an edge. A caller's mask
or bias array streams in tiles beside K, and then every step is masked.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sagejax import quant
from sagejax._inputs import MAX_HEAD_DIM
from sagejax.backends._device import sm_count
from sagejax.kernels._common import (GROUP_SCALES_ONE, GROUP_SCALES_PER_STEP,
                                     kv_block_range)
from sagejax.masks import MaskSpec

_LOG2_P_SCALE = math.log2(quant.P_SCALE)
_PV_KEY_GROUP = 16  # keys permuted inside each group (see pv_key_order)


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
  """Tuning of the Mosaic attention kernel (not part of the math).

  Attributes:
    block_q: query rows per consumer warpgroup (a CTA owns
      ``num_consumers`` blocks).
    block_kv: keys per pipeline step, a multiple of 64.
    num_stages: depth of the K/V shared-memory ring.
    consumer_registers: per-thread registers of the consumer warpgroups
      (``setmaxnreg``); the producer keeps ``producer_registers``.
    num_consumers: consumer warpgroups per CTA, 2 or 3. Three need
      ``consumer_registers <= 160`` (e.g. 160 with a 32-register producer).
    schedule_barrier: consumers take turns on the tensor cores.
    schedule_exp: the consumers meet (with ``schedule_barrier``) before and
      after each softmax's exponentials instead of around the products:
      the MUFU-bound ``exp2`` of one runs while the other does everything
      else. Three consumers meet a third time at each step's start, so
      that one runs its exponentials, one its Q·Kᵀ and row maxima and one
      its P·V and accumulation.
    overlap_qk: each consumer issues the next KV step's Q·Kᵀ before this
      step's softmax (FlashAttention-3's intra-warpgroup pipelining), so the
      tensor cores compute it while the softmax runs; costs one more score
      accumulator of registers, and applies the key scales per key. Its
      Q·Kᵀ is in flight across the KV loop's back edge, and ptxas injects
      a ``wgmma`` wait to read it (C7517), so the overlap is partial (a
      deferred P·V in flight there was serialized outright:
      benchmarks/NOTES.md, Mosaic section 38).
    register_softmax: the softmax's reductions as trees over registers, and
      with ``k_scale_grouped`` inputs the key scales applied once per
      thread and 64 keys (the functions above ``_as_pv_operand``) rather
      than to every score.
    quantize_q: Q quantized in the kernel's prologue where its groups allow
      (:class:`QuantizeQ`; same arithmetic as the Pallas pass before the
      kernel). Off: measured slower on an H100 (benchmarks/NOTES.md, Mosaic
      section 6): the prologue costs a CTA as much as the pass saves, and
      the unprofiled KV loop ran 6% slower at H=128.
    heavy_first: under a causal mask the CTAs of the last query rows (the
      most KV blocks) start first, so that the grid's last wave holds the
      shortest ones (CTAs start in grid order).
    persistent: a grid of ``num_ctas`` CTAs, each taking the query tiles
      ``cta, cta + num_ctas, ...`` in turn (under a causal mask the tiles
      sorted heaviest first and dealt back and forth:
      :func:`persistent_index`): its producer streams the next tile's K/V
      while the consumers finish the current one, and each consumer loads
      its next tile's Q during the current tile (a per-CTA prologue and
      epilogue once per kernel, not once per tile; with ``quantize_q``
      the next tile's 16-bit Q is loaded once this tile's is quantized).
      Not with ``overlap_qk``.
    pv_part_cols: above this head dim, P·V, its two-level accumulation
      and the output's store run in parts of this many columns (32, 64
      or 128), one part's product at a time (registers).
    group_key_scales: where the key scales are grouped (``k_scale_grouped``
      with ``register_softmax``; no ΔS, soft cap, mask or bias array; not
      ``overlap_qk``; steps of 64, 128 or 256 keys), the unmasked steps
      read each thread's scale per 64 keys from a small array made before
      the kernel (:func:`group_key_scales`, streamed with K) rather than
      reducing its per-key scales in every step (benchmarks/NOTES.md,
      Mosaic section 35: at 128 keys 46 fewer instructions a step and ~30
      registers); the masked steps still read per-key scales.
    overlap_epilogues: persistent, taking turns: each consumer arrives at
      one more meeting before a tile's epilogue and waits for it after,
      so that the consumer a meeting behind finishes its tile meanwhile
      (off: the turns hold the others while one stores its output).
      Pays with two consumers; three in lockstep gain nothing from it.
    skip_idle_rows: without a causal mask, a consumer whose query rows all
      lie past the query length (a CTA's last tile reaching past T, or a
      batch's shorter length) skips its steps' work, keeping their barrier
      operations, and writes zeros; a persistent grid whose last query
      tile of each head is partial deals those tiles after all full ones,
      back and forth (:func:`partial_last_tile`), so that the CTAs that
      take two cheaper tiles are not those that take one more full one
      (kernel +0.6-0.8% at 4k and 16k, H=64 and 128; benchmarks/NOTES.md,
      Mosaic section 48). Not with ``overlap_qk``.
    alpha_hint: where the unmasked steps read the grouped K scales, the
      accumulator's α is multiplied by the 1.0 that ends each step's
      grouped scales (``GROUP_SCALES_ONE``), read from shared memory beside
      them: the values do not change (outputs bit for bit the same), but
      ptxas then spreads the conversions of the sums among the
      exponentials (benchmarks/NOTES.md, Mosaic section 55: three-phase
      kernel at H=128 −1.5 to −2.8% at 4k and 16k, −1% at 16k causal; +1-2%
      at H=64, +3.5% with two consumers, where it stays off).
    num_ctas: with ``persistent``, the grid's CTAs (at most one per tile);
      None: one per SM of the device seen when tracing (132, an H100's or
      H200's, without a GPU: a program exported from a CPU host for a GPU
      with fewer SMs would run some CTAs a wave late).
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  consumer_registers: int = 232
  producer_registers: int = 40
  schedule_barrier: bool = True
  schedule_exp: bool = False
  overlap_qk: bool = False
  register_softmax: bool = True
  quantize_q: bool = False
  heavy_first: bool = True
  num_consumers: int = 2
  persistent: bool = False
  num_ctas: Optional[int] = None
  pv_part_cols: int = 128
  group_key_scales: bool = True
  overlap_epilogues: bool = True
  skip_idle_rows: bool = True
  alpha_hint: bool = False

  def __post_init__(self):
    if self.persistent and self.overlap_qk:
      raise ValueError("MosaicTiling(persistent=True) does not take "
                       "overlap_qk; pass persistent=False.")
    if self.num_ctas is not None and self.num_ctas < 1:
      raise ValueError(f"MosaicTiling.num_ctas must be positive, got "
                       f"{self.num_ctas}.")
    if self.block_q != 64:
      raise ValueError(f"MosaicTiling.block_q must be 64 (one wgmma M tile "
                       f"per consumer warpgroup), got {self.block_q}.")
    if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
      raise ValueError("MosaicTiling.block_kv must be 64, 128, 192 or 256, "
                       f"got {self.block_kv}.")
    if not 2 <= self.num_stages <= 6:
      raise ValueError(f"MosaicTiling.num_stages must be in 2..6, got "
                       f"{self.num_stages}.")
    if self.pv_part_cols not in (32, 64, 128):
      raise ValueError("MosaicTiling.pv_part_cols must be 32, 64 or 128, got "
                       f"{self.pv_part_cols}.")
    if self.num_consumers not in (2, 3):
      raise ValueError("MosaicTiling.num_consumers must be 2 or 3, got "
                       f"{self.num_consumers}.")
    check_registers("MosaicTiling", self.consumer_registers,
                    self.producer_registers, self.num_consumers)

  @property
  def block_rows(self) -> int:
    """Query rows per CTA."""
    return self.num_consumers * self.block_q


def register_budget(consumers: int) -> int:
  """Registers per thread of a CTA's ``consumers`` warpgroups and its
  producer together. The CTA is launched with 65536 registers over its
  warpgroups of 128 threads, rounded down to a multiple of 8 per thread
  (168 each for three warpgroups: 504 in all; 96 each for five);
  ``setmaxnreg`` only moves registers among them, so asking for more waits
  forever (224 + 224 + 64 hung on an H100, 4 × 112 + 40 on an H200)."""
  warpgroups = consumers + 1
  return 65536 // (128 * warpgroups) // 8 * 8 * warpgroups


def check_registers(owner: str, consumer: int, producer: int,
                    consumers: int = 2) -> None:
  """Raises unless ``consumers`` warpgroups of ``consumer`` registers per
  thread and a producer of ``producer`` fit the register file."""
  regs = (consumer, producer)
  if any(r % 8 or not 24 <= r <= 256 for r in regs):
    raise ValueError(f"{owner} register counts must be multiples of 8 in "
                     f"24..256, got {regs}.")
  warpgroups = consumers + 1
  budget = register_budget(consumers)
  if consumers * consumer + producer > budget:
    raise ValueError(
        f"{owner}: {consumers} * consumer_registers + producer_registers "
        f"must be <= {budget} (the register file over {warpgroups} "
        f"warpgroups), got {regs}; lower consumer_registers (to "
        f"{(budget - producer) // consumers // 8 * 8}).")


@dataclasses.dataclass(frozen=True)
class QuantizeQ:
  """Q quantized in the kernel's prologue (no pass over Q before the kernel).

  Each consumer loads its ``[block_q, H]`` rows of the 16-bit Q, zeroes the
  rows past the query length, and quantizes them symmetrically (round to
  nearest even) by the largest finite magnitude of their group, as
  :func:`sagejax.quant.quantize_groups` does with groups that live inside one
  warp of the wgmma layout (a warp owns 16 rows; thread ``4r + c`` rows ``r``
  and ``r + 8``). It multiplies by the scale's reciprocal where quant.py
  divides: a value on a rounding tie may land one step away.

  Attributes:
    qmax: 127 (INT8) or 7 (INT4 values, kept in int8: Hopper has no 4-bit
      tensor cores).
    rows_per_group: rows sharing a scale: 1 (per token), 2 (per thread: rows
      ``r`` and ``r + 8`` of a warp's 16) or 16 (per warp).
    scale_mult: folded into the scales (``sm_scale·log2 e``).
    shift_mult: with ``k_mean``, the LSE gains ``shift_mult · q·k̄`` per row
      (:func:`sagejax.quant.lse_shift`; ``sm_scale``).
  """

  qmax: int
  rows_per_group: int
  scale_mult: float
  shift_mult: float = 1.0

  def __post_init__(self):
    if self.qmax not in (7, 127):
      raise ValueError(f"QuantizeQ.qmax must be 7 or 127, got {self.qmax}.")
    if self.rows_per_group not in (1, 2, 16):
      raise ValueError("QuantizeQ.rows_per_group must be 1, 2 or 16 (groups "
                       f"inside one warp), got {self.rows_per_group}.")


def pv_key_order(n: int) -> np.ndarray:
  """The key permutation of the FP8 P·V operands: ``v_perm = v[..., order, :]``.

  The FP32 accumulator gives thread ``4r + c`` the columns ``2c, 2c+1`` of
  each group of 8; the 8-bit A operand wants ``4c .. 4c+3`` of each group of
  16. Re-labelling the registers without moving them puts key
  ``16j + 8a + 2c + i`` at position ``16j + 4c + 2a + i``: V's keys are stored
  in that order so the product is unchanged. ``n`` must be a multiple of 16.
  """
  if n % _PV_KEY_GROUP:
    raise ValueError(f"{n} keys is not a multiple of {_PV_KEY_GROUP}.")
  # position (j, c, a, i) holds key (j, a, c, i)
  keys = np.arange(n).reshape(n // 16, 2, 4, 2)  # [j, a, c, i] -> key
  return keys.transpose(0, 2, 1, 3).reshape(n)


def load_all(ref, layout) -> jax.Array:
  """``plgpu.load`` of a whole ref (JAX 0.10 needs the index; 0.11 warns)."""
  if inspect.signature(plgpu.load).parameters["idx"].default is (
      inspect.Parameter.empty):
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def _swizzle(row_bytes: int) -> int:
  for s in (128, 64, 32):
    if row_bytes % s == 0:
      return s
  raise ValueError(f"rows of {row_bytes} bytes cannot be swizzled")


def wgmma_smem(shape, dtype):
  """A shared-memory tile with the tiling/swizzle a wgmma operand needs."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = _swizzle(shape[-1] * itemsize)
  transforms = (plgpu.TilingTransform((8, swizzle // itemsize)),
                plgpu.SwizzleTransform(swizzle))
  return plgpu.SMEM(shape, dtype, transforms=transforms)


# --------------------------------------------------------------------------
# Register-level pieces of the softmax (Mosaic GPU's FragmentedArray).
#
# In the WGMMA accumulator layout, thread 4r + c of a warp holds rows r and
# r + 8 of its 16 and, of every group of 8 keys, keys 2c and 2c + 1.
# SageAttention2's per-thread K groups (and per-block ones of >= 64 keys)
# give all the keys a thread holds within 64 one K scale: the row maximum
# of s·k_scale is then the maximum over the quad of k_scale times the
# thread's largest s, and the exponent s·k_scale·q_scale − shift is one FMA
# with a per-thread factor (no multiply of every score by its key's scale).
# That factor is the NaN-propagating max of the thread's keys' scales, so a
# non-finite key (scale NaN) still reaches every row that sees it.
# --------------------------------------------------------------------------


def _mgpu():
  from jax.experimental.mosaic import gpu as mgpu  # lowering-time only
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, vector
  return mgpu, fa, ir, arith, vector


def _tree(op, values):
  """Pairwise (tree) reduction: log-depth dependency chains."""
  values = list(values)
  while len(values) > 1:
    pairs = [op(values[i], values[i + 1])
             for i in range(0, len(values) - 1, 2)]
    values = pairs + values[len(pairs) * 2:]
  return values[0]


def _tree3(op, values):
  """Like :func:`_tree`, three values at a time (``op(op(a, b), c)``):
  ptxas makes each such pair of integer maxima one three-input
  ``VIMNMX3`` (Hopper)."""
  values = list(values)
  while len(values) > 1:
    triples = [op(op(values[i], values[i + 1]), values[i + 2])
               for i in range(0, len(values) - 2, 3)]
    rest = values[len(triples) * 3:]
    values = triples + ([op(*rest)] if len(rest) == 2 else rest)
  return values[0]


def _element(v, i: int = 0):
  _, _, ir, _, vector = _mgpu()
  return vector.extract(v, dynamic_position=[],
                        static_position=ir.DenseI64ArrayAttr.get([i]))


def _splat(x, n: int):
  _, _, ir, _, vector = _mgpu()
  return vector.broadcast(ir.VectorType.get((n,), x.type), x)


def _quad_reduce(op, x):
  mgpu, *_ = _mgpu()
  x = op(x, mgpu.utils.shfl_bfly(x, 1))
  return op(x, mgpu.utils.shfl_bfly(x, 2))


def _thread_key_scales(k_regs: np.ndarray) -> list:
  """A thread's K scale for each 64 keys, from its ``[N]`` column-layout
  registers: their maximum, so that a NaN (the scale of a non-finite key)
  reaches the scores as in exact attention."""
  _, _, _, arith, _ = _mgpu()
  k_regs = k_regs.reshape(-1)
  out = []
  for g in range(0, k_regs.shape[0], 8):
    v = _tree(arith.maximumf, [k_regs[i] for i in range(g, g + 8)])
    out.append(arith.maximumf(_element(v, 0), _element(v, 1)))
  return out


def group_key_scales(k_scale: jax.Array, block_kv: int) -> jax.Array:
  """Per-key scales ``[B, K, S_pad]`` whose keys share one value per thread
  within each 64 (``k_scale_grouped``) → ``[B, K, steps · 32]``: for each
  KV step of ``block_kv`` keys, lane class ``c = (key mod 8) // 2`` and 64
  keys, the maximum over its 16 keys (a NaN, the scale of a non-finite key,
  propagates), ordered ``[c][64 keys]`` inside a step so that a thread's
  values are adjacent (then zeros up to 32 values a step, the last 1.0:
  ``MosaicTiling.alpha_hint``)."""
  b, kh, s = k_scale.shape
  blocks, steps = block_kv // 64, s // block_kv
  x = k_scale.reshape(b, kh, steps, blocks, 8, 4, 2)
  x = jnp.max(x, axis=(4, 6))  # [.., step, block, c]
  x = jnp.swapaxes(x, 3, 4).reshape(b, kh, steps, 4 * blocks)
  x = jnp.pad(x, ((0, 0), (0, 0), (0, 0),
                  (0, GROUP_SCALES_PER_STEP - 4 * blocks)))
  x = x.at[..., GROUP_SCALES_ONE].set(1.0)
  return x.reshape(b, kh, steps * GROUP_SCALES_PER_STEP)


def uses_group_key_scales(tiling: MosaicTiling, *, k_scale_grouped: bool,
                          smoothed_q: bool, logits_soft_cap: Optional[float],
                          mask_or_bias: bool) -> bool:
  """Whether :func:`attention_forward` reads :func:`group_key_scales` (its
  unmasked steps' K scales one per thread and 64 keys): grouped K scales
  on the register softmax's tiles, without ΔS, soft cap, mask or bias
  array."""
  return (tiling.group_key_scales and k_scale_grouped
          and tiling.register_softmax and not smoothed_q
          and logits_soft_cap is None and not mask_or_bias
          and not tiling.overlap_qk and tiling.block_kv != 192)


def _thread_group_scales(ref, blocks: int) -> list:
  """A thread's K scale for each 64 keys of a step (``blocks`` of them: 1,
  2 or 4), read from that step's :func:`group_key_scales` in shared memory
  with one aligned vector load."""
  mgpu, _, ir, arith, vector = _mgpu()
  i32 = ir.IntegerType.get_signless(32)
  lane = arith.remui(mgpu.utils.thread_idx(), mgpu.c(4, i32))
  start = arith.index_cast(ir.IndexType.get(),
                           arith.muli(lane, mgpu.c(blocks, i32)))
  v = vector.load(ir.VectorType.get((blocks,), ir.F32Type.get()), ref,
                  [start])
  return [_element(v, i) for i in range(blocks)]


def mask_keys(t: jax.Array, first: jax.Array, last: jax.Array,
              lower: bool = True, fill: float = -float("inf")) -> jax.Array:
  """``t [64, N]`` (f32, WGMMA layout) with ``fill`` where column ``c``
  (0 ≤ c < N: a step's key) lies outside ``first[r] <= c <= last[r]`` for
  its row (``[64]`` int32, row layout; ``lower=False``: ``first`` is ≤ 0
  and not compared). Each thread compares its keys' offsets as immediates against
  two per-row bounds: no per-key index held in registers (a key iota's 32
  per-thread offsets, hoisted out of the KV loop by LLVM, spilled three
  consumers' registers: benchmarks/NOTES.md, Mosaic section 40)."""
  rows, n = t.shape
  layout = plgpu.Layout.WGMMA.reduce(1)

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA, layout, layout),
      return_type=plgpu.ShapeDtypeStruct((rows, n), jnp.float32,
                                         layout=plgpu.Layout.WGMMA))
  def masked(_, t, first, last):
    mgpu, fa, ir, arith, vector = _mgpu()
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    # This thread's keys of every 8 are 2c and 2c + 1 (c = lane mod 4):
    # bounds taken relative to its first one.
    own = arith.muli(arith.remui(mgpu.utils.thread_idx(), mgpu.c(4, i32)),
                     mgpu.c(2, i32))
    lo = [arith.subi(_element(x), own) for x in first.registers.reshape(2)]
    hi = [arith.subi(_element(x), own) for x in last.registers.reshape(2)]
    hidden = mgpu.c(fill, f32)
    regs = np.array(t.registers, dtype=object)
    flat = _wgmma_rows(regs)  # a view of regs
    for g in range(flat.shape[0]):
      for r in range(2):
        values = []
        for e in range(2):
          key = mgpu.c(8 * g + e, i32)
          seen = arith.cmpi(arith.CmpIPredicate.sle, key, hi[r])
          if lower:
            seen = arith.andi(seen, arith.cmpi(arith.CmpIPredicate.sge, key,
                                               lo[r]))
          values.append(arith.select(seen, _element(flat[g, r], e), hidden))
        flat[g, r] = vector.from_elements(ir.VectorType.get((2,), f32),
                                          values)
    return mgpu.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT,
                                _is_signed=None)

  return masked(t, first, last)


def _wgmma_rows(regs: np.ndarray) -> np.ndarray:
  """The registers of a ``[64, N]`` WGMMA-layout array as ``[N / 8, 2]``
  (key group of 8, row r / r + 8)."""
  return regs.reshape(regs.shape[1], 2)


def _row_array(values, rows: int):
  """A ``[rows]`` row-layout array from its two per-thread scalars."""
  mgpu, fa, *_ = _mgpu()
  layout = fa.WGMMA_LAYOUT.reduce((1,))
  regs = np.empty(layout.registers_shape((rows,)), dtype=object)
  flat = regs.reshape(2)
  for r in range(2):
    flat[r] = _splat(values[r], 1)
  return mgpu.FragmentedArray(_registers=regs, _layout=layout,
                              _is_signed=None)


def grouped_logits(sums: jax.Array, q_scale: jax.Array, k_scale,
                   from_ref: bool = False, read_one: bool = False) -> tuple:
  """For the INT32 Q·Kᵀ sums ``sums [64, N]`` (WGMMA layout), ``q_scale
  [64]`` and a ``k_scale [N]`` whose keys share one value per thread within
  each 64 (see above): ``max over keys of sums · k_scale`` per row (NaN
  propagates) and ``q_scale[row] · k_scale[key]`` as a ``[64, N]`` f32
  array holding four registers' worth of distinct values (no per-score
  multiply). The maxima are integer ones, three at a time (Hopper's
  ``VIMNMX3``), not waiting for the sums' conversion to f32; the same
  values, as every sum below 2**24 converts exactly.
  ``from_ref``: ``k_scale`` is a shared-memory ref to the step's
  :func:`group_key_scales` (``[N / 16]``) instead; ``read_one`` (with it):
  also return its entry ``GROUP_SCALES_ONE`` (a 1.0) as a ``[64]`` row
  array (``MosaicTiling.alpha_hint``)."""
  rows, n = sums.shape
  if read_one and not from_ref:
    raise ValueError("read_one reads the step's grouped scales: from_ref.")

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1),
                 plgpu.RefType() if from_ref
                 else plgpu.Layout.WGMMA.reduce(0)),
      return_type=(
          plgpu.ShapeDtypeStruct((rows,), jnp.float32,
                                 layout=plgpu.Layout.WGMMA.reduce(1)),
          plgpu.ShapeDtypeStruct((rows, n), jnp.float32,
                                 layout=plgpu.Layout.WGMMA))
      + ((plgpu.ShapeDtypeStruct((rows,), jnp.float32,
                                 layout=plgpu.Layout.WGMMA.reduce(1)),)
         if read_one else ()))
  def grouped(_, sums, q, k):
    mgpu, fa, ir, arith, vector = _mgpu()
    s_regs = _wgmma_rows(sums.registers)
    q_vals = [_element(x, 0) for x in q.registers.reshape(2)]
    k_vals = (_thread_group_scales(k, n // 64) if from_ref
              else _thread_key_scales(k.registers))
    row_max = []
    for r in range(2):
      groups = []
      for g in range(0, s_regs.shape[0], 8):
        x = _tree3(arith.maxsi, [_element(s_regs[i, r], e)
                                 for i in range(g, g + 8) for e in (0, 1)])
        x = arith.sitofp(ir.F32Type.get(), x)
        groups.append(arith.mulf(x, k_vals[g // 8]))
      row_max.append(_quad_reduce(arith.maximumf,
                                  _tree(arith.maximumf, groups)))
    regs = np.empty(fa.WGMMA_LAYOUT.registers_shape((rows, n)), dtype=object)
    flat = _wgmma_rows(regs)
    for g in range(0, flat.shape[0], 8):
      for r in range(2):
        product = _splat(arith.mulf(q_vals[r], k_vals[g // 8]), 2)
        for i in range(g, g + 8):
          flat[i, r] = product
    scales = mgpu.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT,
                                  _is_signed=None)
    if not read_one:
      return _row_array(row_max, rows), scales
    one = _element(vector.load(
        ir.VectorType.get((1,), ir.F32Type.get()), k,
        [arith.constant(ir.IndexType.get(), GROUP_SCALES_ONE)]))
    return _row_array(row_max, rows), scales, _row_array([one, one], rows)

  return grouped(sums, q_scale, k_scale)


def row_sum(p: jax.Array) -> jax.Array:
  """``p.sum(axis=1)`` of an f32 ``[64, N]`` WGMMA-layout array, summed as
  a tree (short dependency chains) instead of a running sum."""
  rows, _ = p.shape

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct((rows,), jnp.float32,
                                         layout=plgpu.Layout.WGMMA.reduce(1)))
  def total(_, p):
    _, _, _, arith, _ = _mgpu()
    regs = _wgmma_rows(p.registers)
    out = []
    for r in range(2):
      v = _tree(arith.addf, [regs[i, r] for i in range(regs.shape[0])])
      out.append(_quad_reduce(arith.addf,
                              arith.addf(_element(v, 0), _element(v, 1))))
    return _row_array(out, rows)

  return total(p)


def group_rows_max(x: jax.Array, rows_per_group: int) -> jax.Array:
  """Max of a ``[64]`` row-layout vector over groups of rows inside a warp:
  2 (the rows ``r``, ``r + 8`` one thread holds) or 16 (the warp's rows,
  across the lanes ``4r + c`` of equal ``c``). Values must not be NaN."""
  rows = x.shape[0]
  if rows_per_group == 1:
    return x
  layout = plgpu.Layout.WGMMA.reduce(1)

  @plgpu.inline_mgpu(
      arg_types=(layout,),
      return_type=plgpu.ShapeDtypeStruct((rows,), jnp.float32, layout=layout))
  def grouped(_, x):
    mgpu, _, _, arith, _ = _mgpu()
    v = arith.maximumf(*(_element(r) for r in x.registers.reshape(2)))
    if rows_per_group == 16:
      for lanes in (4, 8, 16):
        v = arith.maximumf(v, mgpu.utils.shfl_bfly(v, lanes))
    return _row_array([v, v], rows)

  return grouped(x)


def _as_pv_operand(p8: jax.Array) -> jax.Array:
  """FP8 P̃ in the accumulator layout → the 8-bit wgmma A-operand layout.

  No data moves: pairs of registers are concatenated, which permutes the
  columns inside each group of 16 as :func:`pv_key_order` says.
  """
  from jax.experimental.mosaic import gpu as mgpu  # lowering-time only
  from jax.experimental.mosaic.gpu import fragmented_array as fa

  shape = p8.shape
  p8 = plgpu.layout_cast(p8, plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct(shape, p8.dtype,
                                         layout=plgpu.Layout.WGMMA_8BIT))
  def relabel(_, p):
    regs = p.registers
    new_shape = fa.WGMMA_LAYOUT_8BIT.registers_shape(shape)
    new = np.empty(new_shape, dtype=object)
    for idx in np.ndindex(new_shape):
      lo = list(idx)
      hi = list(idx)
      lo[1], hi[1] = 2 * idx[1], 2 * idx[1] + 1
      new[idx] = mgpu.utils.vector_concat([regs[tuple(lo)], regs[tuple(hi)]])
    return mgpu.FragmentedArray(_registers=new, _layout=fa.WGMMA_LAYOUT_8BIT,
                                _is_signed=None)

  return relabel(p8)


class QueryTile(NamedTuple):
  """A CTA's query tile: its head, tile index, batch, KV head, the valid
  lengths, its first row and its KV block range ``(lo, full_lo, full_hi,
  hi)`` (:func:`sagejax.kernels._common.kv_block_range`)."""
  head: jax.Array
  qt: jax.Array
  batch: jax.Array
  kv_head: jax.Array
  q_len: jax.Array
  kv_len: jax.Array
  first_row: jax.Array
  blocks: tuple


def persistent_tiles(cta, num_tiles: int, num_ctas: int,
                     snake: bool = False):
  """How many tiles the persistent CTA ``cta`` takes: the indices
  :func:`persistent_index` gives it below ``num_tiles``."""
  if not snake:
    return lax.div(jnp.int32(num_tiles + num_ctas - 1) - cta,
                   jnp.int32(num_ctas))
  full = num_tiles // num_ctas
  last = cta if full % 2 == 0 else jnp.int32(num_ctas - 1) - cta
  return jnp.int32(full) + (jnp.asarray(last) < num_tiles % num_ctas
                            ).astype(jnp.int32)


def persistent_index(cta, i, num_ctas: int, snake: bool = False):
  """The tile index of the persistent CTA ``cta``'s ``i``-th tile: ``cta +
  i · num_ctas``; with ``snake``, dealt back and forth (rounds of
  ``num_ctas`` tiles, every other round in reverse), so that tiles sorted
  by decreasing work even out over the CTAs (:func:`ranked_tile`)."""
  if not snake:
    return cta + i * num_ctas
  back = jnp.int32(num_ctas - 1) - cta
  return i * num_ctas + jnp.where(lax.rem(i, jnp.int32(2)) == 0, cta, back)


def persistent_tile(index, num_heads: int, num_q_tiles: int):
  """(head, query tile, batch) of the persistent grid's tile ``index``.
  Query tiles vary fastest: the CTAs at work at any time share few heads'
  K/V in L2, however far apart their progress drifts (benchmarks/NOTES.md,
  Mosaic section 11)."""
  qt = lax.rem(index, jnp.int32(num_q_tiles))
  head = lax.rem(lax.div(index, jnp.int32(num_q_tiles)),
                 jnp.int32(num_heads))
  batch = lax.div(index, jnp.int32(num_heads * num_q_tiles))
  return head, qt, batch


def partial_last_tile(index, num_heads: int, batch_size: int,
                      num_q_tiles: int):
  """(head, query tile, batch) of tile ``index`` with each head's last
  (partial) query tile after every full one: the full tiles as
  :func:`persistent_tile` orders them, then the last tiles, heads fastest.
  ``num_q_tiles`` >= 2."""
  full = num_q_tiles - 1
  first_last = jnp.int32(full * num_heads * batch_size)
  in_last = index >= first_last
  pair = jnp.where(in_last, index - first_last,
                   lax.div(index, jnp.int32(full)))
  qt = jnp.where(in_last, jnp.int32(full), lax.rem(index, jnp.int32(full)))
  return (lax.rem(pair, jnp.int32(num_heads)), qt,
          lax.div(pair, jnp.int32(num_heads)))


RANK_GROUP = 8  # query tiles of one head taken side by side (ranked_tile)


def ranked_tile(index, num_heads: int, batch_size: int, num_q_tiles: int,
                group: int = RANK_GROUP):
  """(head, rank, batch) of tile ``index`` in rank order, nearly: ranks in
  groups of ``group`` (the heaviest group first under a causal mask, with
  ``heavy_first``), within a group every head and batch, and within those
  the group's ranks fastest, so that the CTAs at work at any time share
  each head's K/V ``group`` ways in L2 (heads fastest alone made every CTA
  read its own head's K/V: −9% at B=4, 4k, NOTES section 15)."""
  pairs = num_heads * batch_size
  full, last = divmod(num_q_tiles, group)
  first_of_last = jnp.int32(full * group * pairs)
  in_last = index >= first_of_last
  size = jnp.where(in_last, jnp.int32(max(last, 1)), jnp.int32(group))
  offset = jnp.where(in_last, index - first_of_last,
                     lax.rem(index, jnp.int32(group * pairs)))
  start = jnp.where(in_last, jnp.int32(full * group),
                    lax.div(index, jnp.int32(group * pairs)) * group)
  pair = lax.div(offset, size)
  rank = start + lax.rem(offset, size)
  return (lax.rem(pair, jnp.int32(num_heads)), rank,
          lax.div(pair, jnp.int32(num_heads)))


def tile_rows(ref, layout: str, batch, head, start, size: int):
  """The ``[size, H]`` rows ``[start, start + size)`` of one head of a
  ``[B, T, N, H]`` (``"BTNH"``) or ``[B, N, T, H]`` (``"BNTH"``) ref."""
  if layout == "BTNH":
    return ref.at[batch, pl.ds(start, size), head]
  return ref.at[batch, head, pl.ds(start, size)]


def attention_forward(
    q: jax.Array, q_scale: jax.Array, k: jax.Array, k_scale: jax.Array,
    v: jax.Array, v_scale: jax.Array, v_mean: Optional[jax.Array],
    delta_s: Optional[jax.Array], spec: MaskSpec, *, q_lengths: jax.Array,
    kv_lengths: jax.Array, config_block_q: int = 128, out_dtype=jnp.bfloat16,
    out_layout: str = "BNTH", pv_two_level: bool = True,
    v_key_scale: Optional[jax.Array] = None,
    k_scale_grouped: bool = False,
    quantize_q: Optional[QuantizeQ] = None,
    k_mean: Optional[jax.Array] = None,
    q_layout: str = "BNTH",
    v_layout: str = "BNTH",
    tiling: MosaicTiling = MosaicTiling(),
    profile_dir: Optional[str] = None,
    return_smoothed_lse: bool = False,
    logits_soft_cap: Optional[float] = None,
    row_shift: Optional[jax.Array] = None,
    mask: Optional[jax.Array] = None,
    bias: Optional[jax.Array] = None,
    bias_has_mask: bool = False,
    k_group_scales: Optional[jax.Array] = None,
) -> tuple[jax.Array, ...]:
  """Runs the Mosaic GPU forward on quantized inputs.

  Args:
    q: int8 ``[B, N, T_pad, H]``; ``T_pad`` a multiple of ``tiling.block_q``
      (a CTA's last ``tiling.block_rows`` rows may reach past it).
      With ``quantize_q``: the 16-bit Q in ``q_layout`` (``[B, T_pad, N,
      H]`` for ``"BTNH"``), quantized by the kernel.
    q_scale: f32 ``[B, N, T_pad]`` (includes ``sm_scale·log2 e``); None with
      ``quantize_q``.
    k: int8 ``[B, K, S_pad, H]``; ``S_pad`` a multiple of ``block_kv``.
    k_scale: f32 ``[B, K, S_pad]``.
    v: FP8 e4m3 ``[B, K, H, S_pad]`` with keys in :func:`pv_key_order`, or
      16-bit ``[B, K, S_pad, H]`` (P·V on the 16-bit tensor cores; ``[B,
      S_pad, K, H]`` with ``v_layout="BTNH"``, e.g. the caller's V read in
      place).
    v_scale, v_mean: f32 ``[B, K, H]`` (``v_mean`` may be None).
    delta_s: f32 ``[B, N, T_pad / config_block_q, S_pad]`` (ΔS of smoothed
      Q, base-2 units) or None.
    spec: causal/window description; ``q_len``/``kv_len`` unpadded.
    q_lengths, kv_lengths: int32 ``[B]`` valid lengths.
    out_layout: ``"BNTH"`` or ``"BTNH"`` for the ``[B, *, T_pad, *, H]`` output.
    pv_two_level: each block's P·V from a fresh accumulator (``fp32+fp32``).
    v_key_scale: f32 ``[B, K, S_pad]`` or None: a per-key factor of V (V
      quantized per token, normalized to at most 1), multiplied into P̃
      before it is rounded to the P·V operand; the softmax sum does not see
      it. ``v_scale`` then holds what the normalization took out.
    k_scale_grouped: a promise that ``k_scale`` is one value per 64 keys
      and key index mod 8 // 2 (SageAttention2's per-thread K groups, or
      per-block ones of a multiple of 64 keys); the kernel then applies it
      once per thread and 64 keys (:func:`grouped_logits`).
    quantize_q: Q quantized in the prologue (:class:`QuantizeQ`).
    k_mean: with ``quantize_q``, f32 ``[B, K, H]``: K's mean, whose row
      shift ``quantize_q.shift_mult · q·k̄`` (made by the kernel) is
      added to the LSE.
    q_layout: ``q``'s layout, ``"BNTH"`` or (with ``quantize_q``) ``"BTNH"``.
    v_layout: a 16-bit ``v``'s layout, ``"BNTH"`` or ``"BTNH"``.
    profile_dir: write a Perfetto trace of each call's named regions per
      warpgroup (Mosaic GPU's on-device profiler, ``%clock`` stamps) there;
      ``benchmarks/kernel_profile.py`` reads it. The stamps constrain the
      instruction schedule: time with it off.
    return_smoothed_lse: also return the LSE of the logits the kernel
      computes, those of K smoothed by ``k_mean`` (without its row shift;
      the LSE itself where there is no ``k_mean``).
    logits_soft_cap: Gemma-2's cap ``c``: the natural-log logits (plus
      ``row_shift``) become ``c·tanh(x / c)`` before the masks
      (:func:`sagejax.quant.soft_cap_base2`; ``tanh.approx``, relative
      error 2⁻¹¹, moved the output's error to a fixed reference by under
      1e-5 relative L2 against an accurate tanh: benchmarks/NOTES.md,
      Mosaic section 29); the LSE is then that of the capped logits. One
      more MUFU op per score.
    row_shift: f32 ``[B, N, T_pad]``, natural log, added to each row's
      logits before the cap (K smoothing's ``q·k̄·scale``); only with
      ``logits_soft_cap``.
    mask: the caller's mask array, bf16 ``[B|1, N|1, T_pad, S_pad]``,
      nonzero = attend: each consumer's ``[64, block_kv]`` tile of it
      streams with K (TMA), and every step takes the masked path
      (logits selected, so a masked NaN score is dropped as in exact
      attention). Head dims up to 128.
    bias: the caller's bias array in natural-log units, f16 or bf16
      ``[B|1, N|1, T_pad, S_pad]``, streamed as ``mask`` is (not beside
      it: fold a mask into the bias as −inf) and added to each step's
      logits before the soft cap (a NaN score plus −inf stays NaN, as in
      exact attention). Head dims up to 128.
    bias_has_mask: ``bias``'s −inf entries are a mask folded in: they are
      selected (a NaN score there dropped, as a mask drops it); under a
      soft cap they would otherwise become −cap.
    k_group_scales: f32 ``[B, K, S_pad / block_kv · 32]``: what
      :func:`group_key_scales` makes of ``k_scale`` (e.g. written by the K
      pass; with ``tiling.alpha_hint`` its 1.0 entries too), taken where
      :func:`uses_group_key_scales`; made here if None.

  Returns:
    (output in ``out_dtype`` and ``out_layout``, natural-log LSE f32
    ``[B, N, T_pad]``[, the smoothed logits' LSE]); rows that see no key
    give zeros and −inf.
  """
  if q_layout == "BTNH":
    b, t_pad, n, h = q.shape
  else:
    b, n, t_pad, h = q.shape
  kh, s_pad = k.shape[1], k.shape[2]
  g = n // kh
  fp8 = v.dtype == quant.FP8_DTYPE
  bq, bkv, stages = tiling.block_q, tiling.block_kv, tiling.num_stages
  nc, rows_cta = tiling.num_consumers, tiling.block_rows
  if t_pad % bq or s_pad % bkv:
    raise ValueError(f"padded lengths T={t_pad}, S={s_pad} must be multiples "
                     f"of {bq} and {bkv}.")
  if quantize_q is None:
    if q.dtype != jnp.int8 or q_layout != "BNTH" or q_scale is None:
      raise ValueError("Without quantize_q, q must be int8 [B, N, T_pad, H] "
                       "with its q_scale.")
  elif jnp.dtype(q.dtype).itemsize != 2 or q_scale is not None:
    raise ValueError("With quantize_q, q must be 16-bit (bf16/fp16) and "
                     "q_scale None (the kernel makes it).")
  if quantize_q is not None and delta_s is not None:
    raise ValueError("smoothed Q (delta_s) needs Q quantized before the "
                     "kernel: pass quantize_q=None.")
  if logits_soft_cap is not None and not logits_soft_cap > 0:
    raise ValueError(f"logits_soft_cap={logits_soft_cap!r}: pass a float > 0 "
                     "or None.")
  if row_shift is not None and logits_soft_cap is None:
    raise ValueError("row_shift is added before the soft cap: pass it with "
                     "logits_soft_cap only.")
  if mask is not None and (mask.dtype != jnp.bfloat16 or mask.ndim != 4
                           or mask.shape[2:] != (t_pad, s_pad)
                           or mask.shape[0] not in (1, b)
                           or mask.shape[1] not in (1, n) or h > 128):
    raise ValueError(f"mask {mask.shape} {mask.dtype}: pass bf16 [B|1, N|1, "
                     f"{t_pad}, {s_pad}] (nonzero = attend), head dims up to "
                     "128.")
  if bias is not None and (mask is not None
                           or bias.dtype not in (jnp.float16, jnp.bfloat16)
                           or bias.ndim != 4
                           or bias.shape[2:] != (t_pad, s_pad)
                           or bias.shape[0] not in (1, b)
                           or bias.shape[1] not in (1, n) or h > 128):
    raise ValueError(f"bias {bias.shape} {bias.dtype}: pass f16 or bf16 "
                     f"[B|1, N|1, {t_pad}, {s_pad}] (natural-log units; a "
                     "mask folded in as -inf, not beside it), head dims up "
                     "to 128.")
  if bias_has_mask and bias is None:
    raise ValueError("bias_has_mask=True describes a bias array: pass one "
                     "(a mask folded in as -inf), or leave it False.")
  if logits_soft_cap is not None and quantize_q is not None:
    raise ValueError("the soft cap needs Q quantized before the kernel "
                     "(its row shifts): pass quantize_q=None.")
  if k_mean is not None and quantize_q is None:
    raise ValueError("k_mean is the in-kernel LSE shift: only with "
                     "quantize_q (else the caller adds quant.lse_shift).")
  if k.dtype != jnp.int8:
    raise ValueError("k must be int8 (INT4 is unpacked to int8 first).")
  if v_layout not in ("BNTH", "BTNH") or (fp8 and v_layout != "BNTH"):
    raise ValueError(f"v_layout={v_layout!r}: pass 'BNTH', or 'BTNH' for a "
                     "16-bit v ([B, S_pad, K, H]); FP8 V is [B, K, H, S_pad].")
  if delta_s is not None and config_block_q % rows_cta:
    raise ValueError(f"config block_q={config_block_q} must be a multiple of "
                     f"{rows_cta} when Q is smoothed.")
  # Head dims above ``tiling.pv_part_cols``: P·V, the output accumulator
  # and its store in parts of that many columns (registers: one part's
  # two-level block at a time; shared memory: a 16-bit output tile of one
  # part).
  pv_cols = min(h, tiling.pv_part_cols)
  pv_parts = h // pv_cols
  if h % pv_cols or h > MAX_HEAD_DIM:
    raise ValueError(f"head dim {h}: pass 64, 128 or {MAX_HEAD_DIM} (pad "
                     "others up to one of them).")
  if pv_parts > 1 and not (jnp.dtype(out_dtype).itemsize == 2
                           and quantize_q is None and not tiling.overlap_qk
                           and nc == 2):
    raise ValueError(f"head dim {h} in parts of {pv_cols} columns runs with "
                     "a 16-bit output, Q quantized by the pass and two "
                     "consumers without overlap_qk (shared memory and "
                     "registers); pass H <= 128 for the others.")
  num_kv_blocks = s_pad // bkv
  ds_rows = None if delta_s is None else config_block_q // rows_cta
  # A last tile may reach past T (three 64-row consumers on T = 2^k rows):
  # its loads are TMA copies, which fill rows past the array with zeros
  # (Pallas's default out-of-bounds mode for loads; never stored), so
  # Q need not be padded to the CTA's rows (a copy of Q and one of the
  # output, 3% of the 16k forward: NOTES Mosaic section 36); see t_rows
  # below for the stores.
  num_q_tiles = -(-t_pad // rows_cta)
  persistent = tiling.persistent
  num_tiles = n * num_q_tiles * b
  num_ctas = min(num_tiles, tiling.num_ctas or sm_count())
  # Idle consumers skip their work (not causal: there the heaviest tiles,
  # dealt first, are the partial ones, and the kernel measured 2% slower
  # at 16k: benchmarks/NOTES.md, Mosaic section 48).
  skip_idle = (tiling.skip_idle_rows and not tiling.overlap_qk
               and not spec.is_causal)
  # Each head's last query tile has idle consumers: those tiles cost less,
  # so they go last, dealt back and forth.
  partial_last = (persistent and skip_idle and num_q_tiles > 1
                  and t_pad % rows_cta != 0)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  pv_dtype = v.dtype

  def kernel(refs, out_ref, lse_ref, shift_ref, scratch):
    q_ref, k_ref, ks_ref, v_ref, vs_ref, ql_ref, kl_ref = (
        refs[name] for name in ("q", "k", "ks", "v", "vs", "ql", "kl"))
    vm_ref, ds_ref, vks_ref = refs.get("vm"), refs.get("ds"), refs.get("vks")
    qs_ref, km_ref, rs_ref = refs.get("qs"), refs.get("km"), refs.get("rs")
    mk_ref, bias_ref = refs.get("mk"), refs.get("bias")
    ksg_ref = refs.get("ksg")
    pair_ref = mk_ref if mk_ref is not None else bias_ref  # streamed with K
    (q_smem, qs_smem, k_smem, ks_smem, v_smem, ds_smem, o_smem, lse_smem,
     vs_smem, vm_smem, vks_smem, qx_smem, km_smem, shift_smem,
     rs_smem, pair_smem, ksg_smem) = scratch[0]
    q_bar, k_bar, v_bar = scratch[1]
    k_free, v_free = scratch[2]
    sched = scratch[3]

    def tile_info(head, qt, batch) -> QueryTile:
      """The query tile ``qt`` of ``head`` in ``batch``."""
      kv_head = lax.div(head, jnp.int32(g))
      q_len = ql_ref[batch]
      kv_len = kl_ref[batch]
      cta_first = qt * rows_cta
      cta_last = jnp.minimum(cta_first + rows_cta, q_len) - 1
      blocks = kv_block_range(spec, cta_first, cta_last, q_len, kv_len, bkv,
                              num_kv_blocks)
      return QueryTile(head, qt, batch, kv_head, q_len, kv_len, cta_first,
                       blocks)

    def heavy(qt):
      if spec.is_causal and tiling.heavy_first:
        return num_q_tiles - 1 - qt
      return qt

    if persistent:  # this CTA's tiles: cta, cta + num_ctas, ...
      wg = lax.axis_index("wg")
      cta = lax.axis_index("ctas")
      # Causal tiles differ in work: heaviest first, dealt back and forth.
      snake = spec.is_causal or partial_last
      my_tiles = persistent_tiles(cta, num_tiles, num_ctas, snake)

      def tile_of(i):
        index = persistent_index(cta, i, num_ctas, snake)
        if partial_last:
          head, qt, batch = partial_last_tile(index, n, b, num_q_tiles)
        elif snake:
          head, qt, batch = ranked_tile(index, n, b, num_q_tiles,
                                        RANK_GROUP)
        else:
          head, qt, batch = persistent_tile(index, n, num_q_tiles)
        return tile_info(head, heavy(qt), batch)
    else:
      head = lax.axis_index("heads")
      qt = heavy(lax.axis_index("q_tiles"))
      batch = lax.axis_index("batch")
      wg = lax.axis_index("wg")
      tile = tile_info(head, qt, batch)

    # Where the consumers meet: around the products, around the
    # exponentials, or nowhere.
    turns_at = (None if not tiling.schedule_barrier
                else "exp" if tiling.schedule_exp else "products")
    # The turns' meeting points in a step: with three consumers around
    # their exponentials, a third at the step's start, so that at any time
    # one runs its exponentials, one its P·V and accumulation, one its
    # Q·Kᵀ and row maxima (NOTES Mosaic section 37: the step's start beat
    # a third meeting after the Q·Kᵀ issue or after the P·V issue).
    meet_at = (() if turns_at is None
               else ("exp", "step") if turns_at == "exp" and nc == 3
               else (turns_at,))

    def meet(where: Optional[str] = None):
      """All consumers meet here (any ``where``, when they take turns), or
      only when they take turns ``where``."""
      if meet_at and (where is None or where in meet_at):
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    def stagger():
      """Consumer ``c`` starts ``c`` meetings behind consumer 0, so that
      their turns alternate (with two: one softmax beside the other's
      products)."""
      for c in range(1, nc):
        pl.when(wg >= c)(meet)

    def answer_last_meetings():
      """The earlier consumers answer the later ones' last arrivals."""
      for c in range(nc - 1):
        pl.when(wg <= c)(meet)

    def mine(ref, buf):
      """This consumer's part of a per-consumer buffer (of tile buffer
      ``buf`` when persistent)."""
      return ref.at[wg] if buf is None else ref.at[buf, wg]

    def q_barrier(buf):
      return q_bar.at[wg] if buf is None else q_bar.at[buf * nc + wg]

    def load_q(t, buf) -> jax.Array:
      """Starts the loads of this consumer's Q rows of tile ``t`` (with
      their scales, K's mean, V's scales and mean); returns the first row."""
      head, batch, kv_head = t.head, t.batch, t.kv_head
      row0 = t.first_row + wg * bq
      q_rows = tile_rows(q_ref, q_layout, batch, head, row0, bq)
      bar = q_barrier(buf)
      if quantize_q is None:
        plgpu.copy_gmem_to_smem(q_rows, mine(q_smem, buf), bar)
        plgpu.copy_gmem_to_smem(qs_ref.at[batch, head, pl.ds(row0, bq)],
                                mine(qs_smem, buf), bar)
      else:
        plgpu.copy_gmem_to_smem(q_rows, qx_smem.at[wg], bar)
      if km_ref is not None:
        plgpu.copy_gmem_to_smem(km_ref.at[batch, kv_head], km_smem.at[wg],
                                bar)
      plgpu.copy_gmem_to_smem(vs_ref.at[batch, kv_head], mine(vs_smem, buf),
                              bar)
      if vm_ref is not None:
        plgpu.copy_gmem_to_smem(vm_ref.at[batch, kv_head],
                                mine(vm_smem, buf), bar)
      if rs_ref is not None:
        plgpu.copy_gmem_to_smem(rs_ref.at[batch, head, pl.ds(row0, bq)],
                                mine(rs_smem, buf), bar)
      return row0

    def consumer_tile(t, buf=None, base=None, prefetch=None):
      """Tile ``t``: the KV loop and the output. Persistent (``buf``: the
      tile's Q buffer, ``base``: the ring's step count before it): its Q
      was loaded ahead; returns the step count after it. ``prefetch``
      (persistent, ``quantize_q``): starts the next tile's loads once this
      tile's 16-bit Q (one buffer) has been quantized."""
      head, qt, batch, kv_head, q_len, kv_len, cta_first, blocks = t
      blo, fblo, fbhi, bhi = blocks

      def quantize_rows(row0):
        """This consumer's Q rows quantized into ``q_smem`` (see
        :class:`QuantizeQ`), their scales into ``qs_smem`` (with
        ``scale_mult``; NaN for a row holding a NaN or ±Inf) and, with
        ``k_mean``, their LSE shifts ``shift_mult · q·k̄`` into
        ``shift_smem``."""
        qq = quantize_q
        x = load_all(qx_smem.at[wg], plgpu.Layout.WGMMA).astype(jnp.float32)
        rows = row0 + plgpu.broadcasted_iota(jnp.int32, (bq, h), 0,
                                             layout=plgpu.Layout.WGMMA)
        x = jnp.where(rows < q_len, x, 0.0)
        a = jnp.abs(x)
        amax = jnp.where(a < jnp.inf, a, jnp.inf).max(axis=1)  # NaN -> inf
        finite = amax < jnp.inf
        group = group_rows_max(jnp.where(finite, amax, 0.0), qq.rows_per_group)
        scale = jnp.where(group > 0, group / qq.qmax, 1.0)
        inv_scale = lax.broadcast_in_dim(1.0 / scale, (bq, h), [0])
        y = jnp.round(x * inv_scale)
        y = jnp.where(lax.broadcast_in_dim(finite, (bq, h), [0]),
                      jnp.clip(y, -qq.qmax, qq.qmax), 0.0)
        mine(q_smem, buf)[...] = y.astype(jnp.int8)
        # The scales and shifts wait in shared memory (no registers held
        # through the KV loop).
        mine(qs_smem, buf)[...] = jnp.where(finite, scale * qq.scale_mult,
                                            jnp.nan)
        if km_ref is not None:
          km = load_all(km_smem.at[wg], col_layout)
          shift = (x * lax.broadcast_in_dim(km, (bq, h), [1])).sum(axis=1)
          mine(shift_smem, buf)[...] = shift * qq.shift_mult
        plgpu.commit_smem()  # the stores, before the wgmma reads them

      def slot_of(j):
        return lax.rem(j - blo if base is None else base + (j - blo),
                       jnp.int32(stages))

      if buf is None:
        row0 = load_q(t, None)
      else:
        row0 = cta_first + wg * bq
      with jax.named_scope("wait_q"):
        plgpu.barrier_wait(q_barrier(buf))
      if quantize_q is not None:
        with jax.named_scope("quantize_q"):
          quantize_rows(row0)  # ends with a warpgroup barrier
        if prefetch is not None:
          prefetch()
      qs = load_all(mine(qs_smem, buf), row_layout)
      inv_qs = 1.0 / qs if ds_ref is not None else None
      cap = logits_soft_cap  # scores capped in base-2 units, row scale 1
      # Logits scaled per row before the softmax (a cap or a bias array).
      row_scaled = cap is not None or bias_ref is not None
      rs = (None if rs_ref is None
            else load_all(mine(rs_smem, buf), row_layout))
      m = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32),
                            row_layout)
      l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)
      acc = tuple(plgpu.layout_cast(jnp.zeros((bq, pv_cols), jnp.float32),
                                    plgpu.Layout.WGMMA)
                  for _ in range(pv_parts))

      def issue_qk(s_ref, slot):
        plgpu.wgmma(s_ref, mine(q_smem, buf),
                    k_smem.at[slot].transpose((1, 0)))
        meet("products")

      grouped = k_scale_grouped and tiling.register_softmax and ds_ref is None
      sum_rows = (row_sum if tiling.register_softmax
                  else (lambda p: p.sum(axis=1)))

      def key_vectors(slot, release: bool = True):
        """Step ``slot``'s per-key vectors (K scales, V factors, ΔS) and
        this consumer's mask or bias tile read out of shared memory; then
        the K slot is released (``release=False``: by the caller, once it
        has read the slot's grouped K scales)."""
        ks = load_all(ks_smem.at[slot], col_layout)
        vks = (None if vks_ref is None
               else load_all(vks_smem.at[slot], col_layout))
        ds = (None if ds_ref is None
              else load_all(ds_smem.at[slot], col_layout))
        pair = (None if pair_ref is None
                else load_all(pair_smem.at[slot, wg], plgpu.Layout.WGMMA))
        if release:
          plgpu.barrier_arrive(k_free.at[slot])
        return ks, vks, ds, pair

      def logits(s_f, keys, j, masked: bool):
        """Step ``j``'s base-2 logits before ``q_scale``: the INT32 sums
        (as f32) times the key scales, plus ΔS, masked (with a soft cap or
        a bias array: times ``q_scale``, plus the bias, capped, before the
        masks)."""
        ks, _, ds, pair = keys
        t = s_f * lax.broadcast_in_dim(ks, (bq, bkv), [1])
        if ds is not None:
          t = t + (lax.broadcast_in_dim(ds, (bq, bkv), [1])
                   * lax.broadcast_in_dim(inv_qs, (bq, bkv), [0]))
        if row_scaled:  # then with q_scale, biased, capped, before the masks
          rows_b = lambda x: lax.broadcast_in_dim(x, (bq, bkv), [0])
          t = t * rows_b(qs)
          if bias_ref is not None:
            t = t + pair.astype(jnp.float32) * quant.LOG2E
          if cap is not None:
            t = quant.soft_cap_base2(t, cap,
                                     None if rs is None else rows_b(rs))
          if bias_has_mask:  # a folded mask hides its keys (NaN dropped)
            t = jnp.where(pair == -jnp.inf, -jnp.inf, t)
        if mk_ref is not None:  # a mask array (selected: NaN dropped)
          t = jnp.where(pair != 0, t, -jnp.inf)
        if masked:  # each row's visible keys, relative to the step's
          rows = row0 + plgpu.broadcasted_iota(jnp.int32, (bq,), 0,
                                               layout=row_layout)
          first, last = (plgpu.layout_cast(x - j * bkv, row_layout)
                         for x in spec.visible_keys(rows, q_len, kv_len))
          t = mask_keys(t, first, last, lower=spec.window is not None)
        return t

      def softmax(x, keys, j, masked: bool, m, l, *, scaled: bool = False,
                  group_slot=None, sums=None):
        """Online softmax of step ``j``: ``x`` holds the INT32 sums as f32
        (or, ``scaled``, the :func:`logits`; ``sums``: the INT32 sums
        themselves, which the grouped row maxima read); ``keys`` the
        ``key_vectors``. Returns (P·V operand, α broadcast to the output,
        new max, new sum). ``group_slot``: the step's slot, whose grouped
        K scales (:func:`group_key_scales`) are read, and which is then
        released."""
        ks, vks, _, _ = keys
        use_grouped = grouped and not masked and not scaled and not row_scaled
        with jax.named_scope("row_max"):
          if use_grouped:
            from_ref = group_slot is not None
            read_one = from_ref and tiling.alpha_hint
            row_max, factors, *one = grouped_logits(
                sums, qs, ksg_smem.at[group_slot] if from_ref else ks,
                from_ref, read_one)
            if from_ref:  # the slot's grouped scales read: release it
              plgpu.barrier_arrive(k_free.at[group_slot])
            m_new = jnp.maximum(m, qs * row_max)
          else:
            one = []
            t = x if scaled else logits(x, keys, j, masked)
            t_max = t.max(axis=1)
            m_new = jnp.maximum(m, t_max if row_scaled else qs * t_max)
          m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
          alpha = jnp.exp2(m - m_use)
          shift = m_use - _LOG2_P_SCALE if fp8 else m_use
          shift_b = lax.broadcast_in_dim(shift, (bq, bkv), [0])
        meet("exp")
        with jax.named_scope("exp"):
          if use_grouped:
            p = jnp.exp2(x * factors - shift_b)
          elif row_scaled:
            p = jnp.exp2(t - shift_b)
          else:
            p = jnp.exp2(t * lax.broadcast_in_dim(qs, (bq, bkv), [0])
                         - shift_b)
        meet("exp")
        with jax.named_scope("row_sum"):
          l = l * alpha + sum_rows(p)
        with jax.named_scope("pack"):
          if vks is not None:
            p = p * lax.broadcast_in_dim(vks, (bq, bkv), [1])
          if fp8:
            p_op = _as_pv_operand(p.astype(pv_dtype))
          else:
            p_op = p.astype(pv_dtype)
        alpha_out = alpha * one[0] if one else alpha  # (alpha_hint)
        return (p_op, lax.broadcast_in_dim(alpha_out, (bq, pv_cols), [0]),
                m_new, l)

      def v_tile(slot, part: int = 0):
        cols = pl.ds(part * pv_cols, pv_cols)
        if fp8:  # [H, keys]
          if pv_parts > 1:
            return v_smem.at[slot, cols].transpose((1, 0))
          return v_smem.at[slot].transpose((1, 0))
        return v_smem.at[slot, :, cols] if pv_parts > 1 else v_smem.at[slot]

      def wait_for_v(slot):
        """Waits for step ``slot``'s V tile and the consumer's P·V turn."""
        rendezvous = turns_at == "products"
        if rendezvous:
          plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(v_bar.at[slot])
        if rendezvous:
          plgpu.barrier_wait(sched)

      def step(j, carry, masked: bool):
        acc, m, l = carry
        slot = slot_of(j)
        meet("step")

        def qk(s_ref):
          issue_qk(s_ref, slot)
          return s_ref[...]

        with jax.named_scope("qk"):
          s_int = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.int32))
        with jax.named_scope("softmax"):
          # Unmasked steps read the grouped K scales (then release the slot).
          by_group = (ksg_ref is not None and grouped and not masked
                      and not row_scaled)
          with jax.named_scope("convert"):
            s_f = s_int.astype(jnp.float32)
            keys = key_vectors(slot, release=not by_group)
          p_op, alpha_b, m_new, l = softmax(
              s_f, keys, j, masked, m, l,
              group_slot=slot if by_group else None, sums=s_int)
          scaled_first = not pv_two_level or pv_parts > 1  # in parts: α first
          if scaled_first:
            acc = tuple(a * alpha_b for a in acc)
        with jax.named_scope("wait_v"):
          wait_for_v(slot)

        def pv(part: int):
          def issue(pv_ref):
            plgpu.wgmma(pv_ref, p_op, v_tile(slot, part))
            if part < pv_parts - 1:
              return
            nxt = j + 1

            @pl.when(nxt < bhi)
            def _():
              with jax.named_scope("wait_k"):
                plgpu.barrier_wait(k_bar.at[slot_of(nxt)])
          return issue

        # One part's product at a time: a two-level block is added into
        # the output before the next part's is made.
        parts = []
        for part, a in enumerate(acc):
          with jax.named_scope("pv"):
            if pv_two_level:
              block = pl.run_state(pv(part))(plgpu.ACC.init(
                  plgpu.layout_cast(jnp.zeros((bq, pv_cols), jnp.float32),
                                    plgpu.Layout.WGMMA)))
            else:
              a = pl.run_state(pv(part))(plgpu.ACC.init(a))
          if pv_two_level:
            with jax.named_scope("accumulate"):
              a = (a if scaled_first else a * alpha_b) + block
              if pv_parts > 1:
                # Added before the next part's product is issued: without
                # the barrier LLVM sinks every part's adds below the last
                # product, and the parts' fresh blocks, live at once,
                # spill (benchmarks/NOTES.md, Mosaic section 18).
                a = lax.optimization_barrier(a)
          parts.append(a)
        plgpu.barrier_arrive(v_free.at[slot])
        return tuple(parts), m_new, l

      def overlapped_step(j, carry, masked: bool, s_ref, pv_ref):
        """One KV step with the next step's Q·Kᵀ (issued into ``s_ref``,
        which holds this step's scores on entry) running during the
        softmax."""
        acc, m, l = carry
        slot = slot_of(j)
        meet("step")
        # The logits are made before the next Q·Kᵀ is issued into the same
        # accumulator: with the INT32 sums still live across the issue,
        # ptxas waits for that product (measured: 0.7x the speed).
        with jax.named_scope("qk"):
          s_i = plgpu.wgmma_accumulator_load(s_ref, wait_n=0)
        with jax.named_scope("logits"):
          s_f = s_i.astype(jnp.float32)
          keys = key_vectors(slot)
          t = logits(s_f, keys, j, masked)
        nxt = j + 1

        @pl.when(nxt < bhi)
        def _():
          nslot = slot_of(nxt)
          with jax.named_scope("wait_k"):
            plgpu.barrier_wait(k_bar.at[nslot])
          s_ref[...] = plgpu.layout_cast(jnp.zeros((bq, bkv), jnp.int32),
                                         plgpu.Layout.WGMMA)
          with jax.named_scope("issue_qk"):
            issue_qk(s_ref, nslot)

        with jax.named_scope("softmax"):
          p_op, alpha_b, m_new, l = softmax(t, keys, j, masked, m, l,
                                            scaled=True)
        with jax.named_scope("wait_v"):
          wait_for_v(slot)
        acc, = acc  # one part (attention_forward checks)
        if pv_two_level:
          pv_ref[...] = plgpu.layout_cast(jnp.zeros((bq, h), jnp.float32),
                                          plgpu.Layout.WGMMA)
        else:
          pv_ref[...] = acc * alpha_b
        with jax.named_scope("pv"):
          plgpu.wgmma(pv_ref, p_op, v_tile(slot))
          block = plgpu.wgmma_accumulator_load(pv_ref, wait_n=0)
        with jax.named_scope("accumulate"):
          acc = acc * alpha_b + block if pv_two_level else block
        plgpu.barrier_arrive(v_free.at[slot])
        return (acc,), m_new, l

      # An idle consumer (skip_idle: all its rows past the query length)
      # runs no step's work. Its steps keep every barrier operation of a
      # step, in order: the meetings and the slots' releases that the
      # barriers count, and the waits for K and V, which also keep this
      # thread's record of each barrier's phase (Mosaic GPU flips a parity
      # bit per wait) and hold it behind the producer.
      idle = (row0 >= q_len) if skip_idle else None
      work = ((lambda x: x) if idle is None
              else (lambda x: jnp.where(idle, blo, x)))

      def idle_step(j, carry):
        slot = slot_of(j)
        meet("step")
        meet("products")
        plgpu.barrier_arrive(k_free.at[slot])
        meet("exp")
        meet("exp")
        wait_for_v(slot)

        @pl.when(j + 1 < bhi)
        def _():
          plgpu.barrier_wait(k_bar.at[slot_of(j + 1)])

        plgpu.barrier_arrive(v_free.at[slot])
        return carry

      def run_steps(step_fn, carry):
        masked = functools.partial(step_fn, masked=True)
        if idle is not None:
          lax.fori_loop(blo, jnp.where(idle, bhi, blo), idle_step, 0)
        if pair_ref is not None:  # a mask or bias array: any step, masked
          return lax.fori_loop(blo, work(bhi), masked, carry)
        carry = lax.fori_loop(blo, work(fblo), masked, carry)
        carry = lax.fori_loop(work(fblo), work(fbhi),
                              functools.partial(step_fn, masked=False), carry)
        return lax.fori_loop(work(fbhi), work(bhi), masked, carry)

      if tiling.overlap_qk:
        stagger()

        def overlapped(s_ref, pv_ref):
          @pl.when(bhi > blo)
          def _():
            plgpu.barrier_wait(k_bar.at[0])
            issue_qk(s_ref, 0)

          return run_steps(functools.partial(
              overlapped_step, s_ref=s_ref, pv_ref=pv_ref), (acc, m, l))

        acc, m, l = pl.run_scoped(overlapped,
                                  plgpu.ACC((bq, bkv), jnp.int32),
                                  plgpu.ACC((bq, h), jnp.float32))
      else:
        @pl.when(bhi > blo)
        def _():
          plgpu.barrier_wait(k_bar.at[0 if base is None else slot_of(blo)])

        if base is None:
          stagger()
        acc, m, l = run_steps(step, (acc, m, l))
      if base is None:
        answer_last_meetings()
      # Persistent, taking turns: a meeting whose arrival comes before the
      # epilogue and whose wait after it, so that the consumer a meeting
      # behind finishes its tile while this one stores its output (two
      # consumers: kernel +7.5% at 1k; three, in lockstep, still spend one
      # long interval per consumer's epilogue: NOTES Mosaic section 47).
      split_meeting = (base is not None and bool(meet_at)
                       and tiling.overlap_epilogues)
      if split_meeting:
        plgpu.barrier_arrive(sched)

      with jax.named_scope("epilogue"):
        rows = row0 + plgpu.broadcasted_iota(jnp.int32, (bq,), 0,
                                             layout=row_layout)
        seen = (l != 0) & (rows < q_len)  # a NaN sum is seen (quant's rules)
        inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
        out_rows = tile_rows(out_ref, out_layout, batch, head, row0, bq)

        def columns(ref, part):  # a part's columns of a [..., H] ref
          return ref if pv_parts == 1 else ref.at[..., pl.ds(part * pv_cols,
                                                             pv_cols)]

        for part, a in enumerate(acc):
          vs = load_all(columns(mine(vs_smem, buf), part), col_layout)
          out = (a * lax.broadcast_in_dim(inv_l, (bq, pv_cols), [0])
                 * lax.broadcast_in_dim(vs, (bq, pv_cols), [1]))
          if vm_ref is not None:
            vm = load_all(columns(mine(vm_smem, buf), part), col_layout)
            out = jnp.where(lax.broadcast_in_dim(seen, (bq, pv_cols), [0]),
                            out + lax.broadcast_in_dim(vm, (bq, pv_cols), [1]),
                            0.0)
          if base is not None or part:  # the last store is out of o_smem
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          o_smem.at[wg][...] = out.astype(out_dtype)
          if part < pv_parts - 1:
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], columns(out_rows, part))
        p_shift = _LOG2_P_SCALE if fp8 else 0.0
        lse = (m + jnp.log2(jnp.where(seen, l, 1.0)) - p_shift) * quant.LN2
        lse_smem.at[wg][...] = jnp.where(seen, lse, -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg],
                                columns(out_rows, pv_parts - 1))
        plgpu.copy_smem_to_gmem(lse_smem.at[wg],
                                lse_ref.at[batch, head, pl.ds(row0, bq)])
        if shift_ref is not None:  # the row shifts quantize_rows left there
          plgpu.copy_smem_to_gmem(mine(shift_smem, buf),
                                  shift_ref.at[batch, head, pl.ds(row0, bq)])
      if base is None:
        plgpu.wait_smem_to_gmem(0)
        return None
      if split_meeting:
        with jax.named_scope("epilogue_meeting"):
          plgpu.barrier_wait(sched)
      return base + (bhi - blo)

    @pl.when(wg < nc)
    def _consumer():
      plgpu.set_max_registers(tiling.consumer_registers, action="increase")
      if not persistent:
        consumer_tile(tile)
        return
      load_q(tile_of(0), 0)
      stagger()

      def next_tile(i, base):
        buf = lax.rem(i, jnp.int32(2))

        def prefetch():
          @pl.when(i + 1 < my_tiles)  # its buffer's last tile is done
          def _():
            load_q(tile_of(i + 1), 1 - buf)

        if quantize_q is not None:  # after this tile's Q left qx_smem
          return consumer_tile(tile_of(i), buf, base, prefetch)
        prefetch()
        return consumer_tile(tile_of(i), buf, base)

      lax.fori_loop(0, my_tiles, next_tile, jnp.int32(0))
      answer_last_meetings()
      plgpu.wait_smem_to_gmem(0)

    def produce_tile(t, base=None):
      """Streams tile ``t``'s K and V tiles (after ``base`` steps of the
      ring, persistent); returns the step count after them."""
      head, qt, batch, kv_head = t.head, t.qt, t.batch, t.kv_head
      blo, bhi = t.blocks[0], t.blocks[3]

      @pl.loop(blo, bhi)
      def _(j):
        ring_step = j - blo if base is None else base + (j - blo)
        slot = lax.rem(ring_step, jnp.int32(stages))
        keys = pl.ds(j * bkv, bkv)

        @pl.when(ring_step >= stages)
        def _():
          with jax.named_scope("wait_k_free"):
            plgpu.barrier_wait(k_free.at[slot])

        plgpu.copy_gmem_to_smem(k_ref.at[batch, kv_head, keys],
                                k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(ks_ref.at[batch, kv_head, keys],
                                ks_smem.at[slot], k_bar.at[slot])
        if ksg_ref is not None:
          plgpu.copy_gmem_to_smem(
              ksg_ref.at[batch, kv_head, pl.ds(j * GROUP_SCALES_PER_STEP,
                                               GROUP_SCALES_PER_STEP)],
              ksg_smem.at[slot], k_bar.at[slot])
        if ds_ref is not None:
          plgpu.copy_gmem_to_smem(
              ds_ref.at[batch, head, lax.div(qt, jnp.int32(ds_rows)), keys],
              ds_smem.at[slot], k_bar.at[slot])
        if vks_ref is not None:
          plgpu.copy_gmem_to_smem(vks_ref.at[batch, kv_head, keys],
                                  vks_smem.at[slot], k_bar.at[slot])
        if pair_ref is not None:  # each consumer's rows of the mask or bias
          mb = batch if pair_ref.shape[0] > 1 else 0
          mh = head if pair_ref.shape[1] > 1 else 0
          for c in range(nc):
            rows = pl.ds(t.first_row + c * bq, bq)
            plgpu.copy_gmem_to_smem(pair_ref.at[mb, mh, rows, keys],
                                    pair_smem.at[slot, c], k_bar.at[slot])

        @pl.when(ring_step >= stages)
        def _():
          with jax.named_scope("wait_v_free"):
            plgpu.barrier_wait(v_free.at[slot])

        if fp8:
          v_src = v_ref.at[batch, kv_head, :, keys]
        else:
          v_src = tile_rows(v_ref, v_layout, batch, kv_head, j * bkv, bkv)
        plgpu.copy_gmem_to_smem(v_src, v_smem.at[slot], v_bar.at[slot])

      return None if base is None else base + (bhi - blo)

    @pl.when(wg == nc)
    def _producer():
      plgpu.set_max_registers(tiling.producer_registers, action="decrease")
      if not persistent:
        produce_tile(tile)
        return
      lax.fori_loop(0, my_tiles,
                    lambda i, base: produce_tile(tile_of(i), base),
                    jnp.int32(0))

  # The unmasked steps' K scales, one per thread and 64 keys (tiling).
  if not uses_group_key_scales(
      tiling, k_scale_grouped=k_scale_grouped, smoothed_q=delta_s is not None,
      logits_soft_cap=logits_soft_cap, mask_or_bias=(mask is not None
                                                     or bias is not None)):
    k_group_scales = None
  elif k_group_scales is None:
    k_group_scales = group_key_scales(k_scale, bkv)
  elif k_group_scales.shape != (b, kh, s_pad // bkv * GROUP_SCALES_PER_STEP):
    raise ValueError(
        f"k_group_scales of shape {k_group_scales.shape}: pass "
        f"group_key_scales(k_scale, {bkv}) ({s_pad // bkv} steps).")
  inputs = dict(q=q, qs=q_scale, k=k, ks=k_scale, v=v, vs=v_scale, vm=v_mean,
                ds=delta_s, vks=v_key_scale, km=k_mean, ql=q_lengths,
                kl=kv_lengths, rs=row_shift, mk=mask, bias=bias,
                ksg=k_group_scales)
  names = tuple(name for name, x in inputs.items() if x is not None)

  def entry(*all_refs):
    refs = dict(zip(names, all_refs[:len(names)]))
    out_ref, lse_ref, *shift_ref = all_refs[len(names):]
    ds_ref = refs.get("ds")
    pair = refs.get("mk", refs.get("bias"))  # mask or bias tiles, with K
    v_tile = (stages, h, bkv) if fp8 else (stages, bkv, h)
    q_bufs = (2, nc) if persistent else (nc,)  # per tile, per consumer
    smem = (
        wgmma_smem((*q_bufs, bq, h), jnp.int8),
        plgpu.SMEM((*q_bufs, bq), jnp.float32),
        wgmma_smem((stages, bkv, h), jnp.int8),
        plgpu.SMEM((stages, bkv), jnp.float32),
        wgmma_smem(v_tile, pv_dtype),
        None if ds_ref is None else plgpu.SMEM((stages, bkv), jnp.float32),
        wgmma_smem((nc, bq, pv_cols), out_dtype),
        plgpu.SMEM((nc, bq), jnp.float32),
        plgpu.SMEM((*q_bufs, h), jnp.float32),
        None if "vm" not in refs else plgpu.SMEM((*q_bufs, h), jnp.float32),
        None if "vks" not in refs else plgpu.SMEM((stages, bkv), jnp.float32),
        None if quantize_q is None else wgmma_smem((nc, bq, h), q.dtype),
        None if "km" not in refs else plgpu.SMEM((nc, h), jnp.float32),
        None if "km" not in refs else plgpu.SMEM((*q_bufs, bq), jnp.float32),
        None if "rs" not in refs else plgpu.SMEM((*q_bufs, bq), jnp.float32),
        None if pair is None else wgmma_smem((stages, nc, bq, bkv),
                                             pair.dtype),
        None if "ksg" not in refs else plgpu.SMEM(
            (stages, GROUP_SCALES_PER_STEP), jnp.float32),
    )
    # Q (and its scales, or K's mean), V's scales and mean, the row shifts.
    q_arrivals = 2 + sum(name in refs for name in ("qs", "km", "vm", "rs"))
    k_arrivals = (2 + (ds_ref is not None) + ("vks" in refs) + ("ksg" in refs)
                  + nc * (pair is not None))
    pl.run_scoped(
        lambda *scratch: kernel(refs, out_ref, lse_ref,
                                (shift_ref or [None])[0], scratch),
        smem,
        (plgpu.Barrier(num_arrivals=q_arrivals,
                       num_barriers=math.prod(q_bufs)),
         plgpu.Barrier(num_arrivals=k_arrivals, num_barriers=stages),
         plgpu.Barrier(num_barriers=stages)),
        (plgpu.Barrier(num_arrivals=nc, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=nc),
        collective_axes="wg",
    )

  # Rows a last tile reaching past T may be written to. A store is clipped
  # to the array's bounds only where a tile's rows are not contiguous in
  # memory: the output in BTNH with several heads (a tensor TMA). Stores of
  # contiguous rows (the LSE; the output in BNTH or of one head) are bulk
  # copies bounded only by the whole array and would reach the next head's
  # rows, so those arrays are allocated in whole tiles and sliced after.
  t_rows = num_q_tiles * rows_cta
  out_clipped = out_layout == "BTNH" and n > 1
  if out_layout == "BTNH":
    out_shape = (b, t_pad if out_clipped else t_rows, n, h)
  else:
    out_shape = (b, n, t_rows, h)
  if persistent:
    grid, grid_names = (num_ctas,), ("ctas",)
    profile_tiles = -(-num_tiles // num_ctas)  # a CTA's query tiles
  else:
    grid, grid_names = (n, num_q_tiles, b), ("heads", "q_tiles", "batch")
    profile_tiles = 1
  rows = jax.ShapeDtypeStruct((b, n, t_rows), jnp.float32)
  out, lse, *shift = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct(out_shape, out_dtype), rows)
      + ((rows,) if k_mean is not None else ()),
      grid=grid,
      grid_names=grid_names,
      num_threads=nc + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          approx_math=True, **_profile_params(profile_dir, num_kv_blocks,
                                                  profile_tiles)),
  )(*(inputs[name] for name in names))
  if t_rows != t_pad:
    lse, shift = lse[:, :, :t_pad], [x[:, :, :t_pad] for x in shift]
    if not out_clipped:
      out = (out[:, :t_pad] if out_layout == "BTNH" else out[:, :, :t_pad])
  smoothed_lse = lse
  if shift:  # the LSE of the logits q·k, from that of q·(k − k̄)
    lse = lse + shift[0]
  return (out, lse, smoothed_lse) if return_smoothed_lse else (out, lse)


def _profile_params(profile_dir: Optional[str], num_kv_blocks: int,
                    num_tiles: int) -> dict:
  """CompilerParams fields of Mosaic GPU's on-device profiler for a CTA of
  ``num_tiles`` query tiles of ``num_kv_blocks`` steps: room for twelve
  regions per KV step and four per tile (``wait_q``, ``quantize_q``,
  ``epilogue``, ``epilogue_meeting``), per warpgroup."""
  if not profile_dir:
    return {}
  return dict(profile_space=(12 * num_kv_blocks + 4) * num_tiles + 16,
              profile_dir=profile_dir)

"""Pallas Mosaic GPU kernels: the backward of attention on Hopper (sm90).

The gradient of *exact* attention (the forward's quantizers are
straight-through), FlashAttention-2/3 style, with the conventions of
:mod:`sagejax.kernels.triton_backward`: K arrives smoothed (K − k̄, 16-bit),
``lse₂`` is the base-2 LSE of the smoothed logits (+inf for a row that sees
no key) and ``δ = rowsum(dO ∘ O) − dLSE`` (0 for such a row). With
``c = sm_scale·log2 e``:

  P = exp2(c·Q·Kᵀ − lse₂),  dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP − δ),
  dK = dSᵀ·Q·sm_scale,  dQ = dS·K·sm_scale.

With a logit soft cap the logits are capped before the ``exp2`` and dS is
carried back through the cap, dS ∘ (1 − tanh²) (K then unsmoothed).

Two kernels, each with a TMA producer warpgroup feeding a shared-memory ring
and two consumer warpgroups that own 64 rows each (one ``wgmma`` M tile) and
run BF16/FP16 ``wgmma`` with FP32 accumulators:

* dK/dV: a CTA owns 128 keys of one KV head. The producer streams, for each
  of the G query heads of the GQA group and each query block that sees the
  keys (the causal diagonal, window and lengths skip the rest), the Q and dO
  tiles with their lse₂ and δ. Each consumer computes Sᵀ = K·Qᵀ and
  dPᵀ = V·dOᵀ (one wait), then Pᵀ and dSᵀ in registers, and adds
  Pᵀ·dO into dV and dSᵀ·Q into dK (register A operands). dK/dV are summed
  over the group in registers: K/V are read once, never repeated. Where
  all tiles do the same work, those of the grid's last, partial round of
  CTAs may each be run by several CTAs over shares of the query blocks
  (``MosaicBackwardTiling.split_last_round``).
* dQ: a CTA owns 128 query rows of one head; the producer streams the K and
  V tiles it sees; each consumer computes S = Q·Kᵀ and dP = dO·Vᵀ, then dS,
  and adds dS·K into dQ. Causal CTAs run heaviest first. It runs first:
  given only an estimate of lse₂ it also returns the exact lse₂ and δ
  (no separate statistics pass).
* Above H=128 (δ given) a consumer's 64 rows of two H-wide f32
  accumulators do not fit its registers; both kernels split the work by
  product instead: a CTA owns 64 keys (dK/dV) or 64 query rows (dQ),
  consumer 0 makes the probabilities and leaves them in shared memory,
  consumer 1 makes dP and dS from them; for dK/dV each adds into one
  accumulator (dV, dK), for dQ consumer 1 holds dQ.
* Or, with ``MosaicBackwardTiling.fused_dq``, dQ in the dK/dV kernel: the
  consumers put their dSᵀ rows in shared memory and each adds one 64 × 64
  half of the step's dS·K into an FP32 dQ by TMA reduce-add (given only an
  estimate of lse₂, a statistics-only pass of the dQ kernel runs first);
  with ``dq_turns`` they take turns making both halves and the producer
  adds them.

Every operand is read in the caller's layout (``[B, T, N, H]`` or ``[B, N,
T, H]``) in place by TMA, and dQ, dK, dV are written in it.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sagejax import quant
from sagejax.kernels._common import (key_blocks, layout_dims, query_blocks,
                                     visit_block, visit_blocks,
                                     visit_position)
from sagejax.kernels.mosaic_attention import (check_registers, load_all,
                                              mask_keys, tile_rows,
                                              wgmma_smem)
from sagejax.masks import MaskSpec

ROWS = 64  # rows per consumer warpgroup (the wgmma M tile); a CTA owns 2x
# Above this head dim the kernels split dK/dV and dQ by product over the two
# consumers (_dkdv_wide, _dq_wide): a consumer's 64 rows of two H-wide f32
# accumulators no longer fit its registers.
WIDE_ABOVE_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class MosaicBackwardTiling:
  """Tuning of the Mosaic backward kernels (not part of the math).

  Attributes:
    block_q: dK/dV kernel: query rows per pipeline step (64 or 128).
    block_kv: dQ kernel: keys per pipeline step (64 or 128).
    num_stages: depth of both kernels' shared-memory rings.
    consumer_registers, producer_registers: per-thread registers of the two
      consumer warpgroups and of the producer (``setmaxnreg``).
    fused_dq: accumulate dQ in the dK/dV kernel: each CTA adds its ``dS·K``
      into an FP32 dQ by TMA reduce-add (FlashAttention-3's scheme: 5
      products per tile pair instead of 7; when recomputing, a statistics
      pass of 2 products runs first). Needs ``block_q · H = 8192`` (each
      consumer computes one 64 × 64 half of a step's dQ tile). Off: dQ has
      its own kernel, which also makes the exact statistics — measured
      faster on an H100 (benchmarks/NOTES.md, B7).
    dq_turns: with ``fused_dq``, the consumers take turns making a step's
      whole dQ tile (both halves of ``dS·K``, after their dV and dK
      products), store it, fence and arrive on a barrier; the producer
      issues the TMA reduce-adds and hands the buffer on (cuDNN's
      arrangement, read off its kernel with Nsight Compute). Each consumer
      then has dQ's products and epilogue every other step, and no
      warpgroup barrier or TMA issue of its own. Measured faster at H=64
      (causal too) and slower at H=128, most under a causal mask
      (benchmarks/NOTES.md, B14-B15).
    static_consumers: dK/dV kernel: trace the consumer code once per
      consumer warpgroup, its index a constant (the shared-memory addresses
      of its K/V rows and dQ half fold into constants), instead of once with
      the index read at run time. Twice the code; measured faster at H=128
      and slower wherever ``dq_turns`` is on (benchmarks/NOTES.md, B16).
    unmasked_first: dK/dV kernel: visit the query blocks every row of the
      CTA's keys sees first, then the masked ones (the causal diagonal,
      a window's edges, lengths) in one loop, instead of masked head,
      unmasked middle, masked tail (three loops); the producer loads in
      the same order.
    split_last_round: with ``fused_dq`` and without ``dq_turns`` (else
      it has no effect), where every tile does the same work (no causal
      mask, window, lengths or padding): the tiles of the grid's last,
      partial round of CTAs (:func:`last_round_split`) are each run by
      several CTAs, each over a share of the query blocks, whose 16-bit
      partial dK/dV are summed in f32 after the kernel.
  """

  block_q: int = 64
  block_kv: int = 64
  num_stages: int = 2
  consumer_registers: int = 240
  producer_registers: int = 24
  fused_dq: bool = False
  dq_turns: bool = False
  static_consumers: bool = False
  unmasked_first: bool = False
  split_last_round: bool = False

  def __post_init__(self):
    for field in ("block_q", "block_kv"):
      if getattr(self, field) not in (64, 128):
        raise ValueError(f"MosaicBackwardTiling.{field} must be 64 or 128, "
                         f"got {getattr(self, field)!r}.")
    if not 2 <= self.num_stages <= 4:
      raise ValueError("MosaicBackwardTiling.num_stages must be in 2..4, got "
                       f"{self.num_stages!r}.")
    check_registers("MosaicBackwardTiling", self.consumer_registers,
                    self.producer_registers)
    if self.dq_turns and not self.fused_dq:
      raise ValueError("MosaicBackwardTiling(dq_turns=True) needs "
                       "fused_dq=True (only the fused kernel adds into dQ).")


def _check_wide(tiling: MosaicBackwardTiling, delta) -> None:
  """The wide kernels' limits (their shared memory: 209 KB each)."""
  if delta is None:
    raise ValueError(
        f"above H={WIDE_ABOVE_HEAD_DIM} the Mosaic backward takes δ from the "
        "saved output (no statistics pass); pass delta, or run the 'pallas' "
        "backward (SageConfig(backward_stats='recompute') does).")
  if (tiling.block_q, tiling.block_kv, tiling.num_stages,
      tiling.fused_dq) != (ROWS, ROWS, 2, False):
    raise ValueError(
        f"above H={WIDE_ABOVE_HEAD_DIM} the Mosaic backward runs "
        f"MosaicBackwardTiling(block_q={ROWS}, block_kv={ROWS}, "
        f"num_stages=2, fused_dq=False), got {tiling}.")


# A CTA's fixed cost (K/V load, pipeline fill, epilogue), in query-block
# steps, for :func:`last_round_split`'s model.
_CTA_OVERHEAD_STEPS = 1.5


def last_round_split(rows: int, tiles_per_row: int, steps: int,
                     num_sms: int, min_gain: float = 0.01
                     ) -> Optional[tuple[int, int]]:
  """Which tiles of a grid of equal tiles to split, and in how many parts.

  The grid's ``rows · tiles_per_row`` tiles (for :func:`_dkdv`: KV heads ·
  tiles a head), each ``steps`` query-block steps long, run one CTA an SM
  in launch order, so ``T`` tiles take ``⌈T / num_sms⌉`` tile times and
  the last round leaves SMs idle (NOTES, Mosaic §24). Splitting the last
  ``m`` rows' tiles in ``k`` parts of ``steps / k`` steps each, launched
  after the whole tiles, fills those SMs; each CTA also pays a fixed cost
  of ``_CTA_OVERHEAD_STEPS``. The plan is the ``(m, k)`` whose greedy
  schedule ends first, or None when none ends ``min_gain`` sooner than the
  unsplit grid.
  """
  total = rows * tiles_per_row
  rem = total % num_sms
  if rem == 0 or steps < 4:
    return None
  unit = steps + _CTA_OVERHEAD_STEPS  # a whole tile's time
  unsplit = -(-total // num_sms) * unit
  m_min = -(-rem // tiles_per_row)
  stride = max(1, -(-num_sms // tiles_per_row) // 8)
  best, plan = unsplit * (1.0 - min_gain), None
  for m in range(m_min, min(rows, m_min + 8 * stride) + 1, stride):
    whole = total - m * tiles_per_row
    rounds, busy = divmod(whole, num_sms)
    for k in (2, 3, 4, 6, 8):
      if 2 * k > steps:
        break
      free = [(rounds + 1) * unit] * busy + [rounds * unit] * (num_sms - busy)
      heapq.heapify(free)
      for p in range(m * tiles_per_row * k):
        share = (p % k + 1) * steps // k - (p % k) * steps // k
        heapq.heapreplace(free, free[0] + share + _CTA_OVERHEAD_STEPS)
      end = max(max(free), (rounds + (busy > 0)) * unit)
      if end < best:
        best, plan = end, (m, k)
  return plan


def _hand_over(tile, smem, free_bar, ready_bar, *, n_step, buf) -> None:
  """A wide kernel's consumer leaves ``tile`` in buffer ``buf`` (of two) of
  ``smem`` for the other consumer, once that one has freed it (the tile of
  two steps ago), and arrives on ``ready_bar``. ``tile`` and ``smem`` may
  be tuples (several tiles, one barrier)."""
  @pl.when(n_step >= 2)
  def _():
    plgpu.barrier_wait(free_bar.at[buf])

  pairs = zip(tile, smem) if isinstance(tile, tuple) else [(tile, smem)]
  for x, ref in pairs:
    ref.at[buf][...] = x
  plgpu.commit_smem()
  plgpu.barrier_arrive(ready_bar.at[buf])


def _take_over(smem, ready_bar, free_bar, *, buf):
  """The tile the other consumer left in buffer ``buf`` of ``smem``
  (:func:`_hand_over`; a tuple of them for a tuple ``smem``), loaded into
  registers once it is ready; the buffer is then freed at once."""
  plgpu.barrier_wait(ready_bar.at[buf])
  refs = smem if isinstance(smem, tuple) else (smem,)
  tiles = tuple(load_all(ref.at[buf], plgpu.Layout.WGMMA) for ref in refs)
  plgpu.barrier_arrive(free_bar.at[buf])
  return tiles if isinstance(smem, tuple) else tiles[0]


def _query_cta(ql_ref, kl_ref, *, causal: bool, num_q_tiles: int, g: int):
  """A dQ kernel CTA's (head, query tile, batch, warpgroup, KV head, query
  length, key length); causal: the tiles with the most keys first."""
  head = lax.axis_index("heads")
  qt = lax.axis_index("q_tiles")
  if causal:
    qt = num_q_tiles - 1 - qt
  batch = lax.axis_index("batch")
  wg = lax.axis_index("wg")
  kv_head = lax.div(head, jnp.int32(g))
  return head, qt, batch, wg, kv_head, ql_ref[batch], kl_ref[batch]


def _zeros(*shape: int, layout=plgpu.Layout.WGMMA) -> jax.Array:
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout)


def _store_through(smem, value: jax.Array, dst) -> None:
  """Stores ``value`` (registers) to the rows ``dst`` of an output through
  ``smem`` (in its dtype) by TMA, and waits until ``smem`` has been read."""
  smem[...] = value.astype(smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, dst)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _fence_async_shared() -> None:
  """This thread's shared-memory writes made visible to the async proxy
  (TMA, wgmma): ``commit_smem`` without its warpgroup barrier, for threads
  that then arrive on an mbarrier their reader waits on."""
  @plgpu.inline_mgpu()
  def fence(_):
    from jax._src.lib.mlir import ir  # lowering-time only
    from jax._src.lib.mlir.dialects import llvm
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [],
                    "fence.proxy.async.shared::cta;", "",
                    has_side_effects=True)

  fence()


def _capped_sums(lam: jax.Array, d_sum: jax.Array, pw: jax.Array,
                 ds: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A dQ kernel's running row sums under a soft cap, from saved
  statistics (:func:`sagejax.quant.capped_dq_shift`): λ += Σ_j P ∘ slope
  (``pw``), D += Σ_j P (dP − δ) (``ds``, before the slope)."""
  return lam + pw.sum(axis=1), d_sum + ds.sum(axis=1)


def _product(acc: jax.Array, operands) -> jax.Array:
  """``acc + a·b``: one ``wgmma`` into ``acc``, waited on; ``operands()``
  returns ``(a, b)``, called inside the ``wgmma``'s own state scope: these
  kernels' shared-memory views (``ref.at[slot]``, a traced slot) made
  outside it failed to lower under JAX 0.11 ("Shaped arrays must be
  represented by ir.Values"), though 0.10 lowers them (NOTES B34)."""
  return pl.run_state(lambda ref: plgpu.wgmma(ref, *operands()))(
      plgpu.ACC.init(acc))


def _two_products(first, second, cols: int):
  """``(a·b, c·d)`` for ``first=(a, b)``, ``second=(c, d)``: two ``wgmma``
  into fresh f32 ``[ROWS, cols]`` accumulators, waited on together."""
  zeros = _zeros(ROWS, cols)

  def products(refs):
    plgpu.wgmma(refs[0], *first)
    plgpu.wgmma(refs[1], *second)

  return pl.run_state(products)((plgpu.ACC.init(zeros),
                                 plgpu.ACC.init(zeros)))


def _visible(spec: MaskSpec, q_first, k_first, shape, q_len, kv_len, *,
             keys_on_rows: bool, also=None):
  """The mask rule on a ``shape`` tile (WGMMA layout) whose query positions
  start at ``q_first`` and key positions at ``k_first``, keys along the rows
  (a transposed tile) or along the columns: a function that zeroes an f32
  tile's hidden pairs (and, ``also``, where that boolean tile is False).
  Each row's visible columns are an interval (``MaskSpec.visible_keys`` /
  ``visible_queries``) that :func:`mask_keys` compares as immediates, no
  iota held in registers (benchmarks/NOTES.md, Mosaic section 40)."""
  rows, _ = shape
  layout = plgpu.Layout.WGMMA.reduce(1)
  row_first, col_first = (k_first, q_first) if keys_on_rows else (q_first,
                                                                  k_first)
  pos = row_first + plgpu.broadcasted_iota(jnp.int32, (rows,), 0,
                                           layout=layout)
  bounds = (spec.visible_queries if keys_on_rows else spec.visible_keys)(
      pos, q_len, kv_len)
  first, last = (plgpu.layout_cast(x - col_first, layout) for x in bounds)
  lower = keys_on_rows or spec.window is not None

  def hide(x):
    x = mask_keys(x, first, last, lower=lower, fill=0.0)
    return x if also is None else jnp.where(also, x, 0.0)
  return hide


def _probabilities(s, c: float, lse, soft_cap: Optional[float],
                   visible=None):
  """(P = exp2(c·s − lse₂), the soft cap's slope or None) of a tile of raw
  Q·Kᵀ sums ``s`` (either orientation), the logits capped first
  (:func:`sagejax.quant.soft_cap_base2_and_slope`); both zero where
  ``visible()`` (the tile's mask, a function that zeroes its hidden
  pairs: :func:`_visible`; None: all visible) hides them. ``lse``:
  lse₂ broadcast to the tile, or a function that makes it. (Both functions
  are called where the kernels made their values before the cap existed,
  so that uncapped programs lower as they did.)"""
  x, slope = s * c, None
  if callable(lse):
    lse = lse()
  if soft_cap is not None:
    x, slope = quant.soft_cap_base2_and_slope(x, soft_cap)
  p = jnp.exp2(x - lse)
  if visible is not None:
    hide = visible()
    p = hide(p)
    if slope is not None:
      slope = hide(slope)
  return p, slope


def _stream_query_tiles(refs, smems, in_bar, free, *, stages: int, kv_head,
                        g: int, per, total, blocks, order: bool, bq: int,
                        layout: str, batch, after=None, mask=None) -> None:
  """A dK/dV kernel's producer: for each of the ``total`` steps (``per``
  query blocks for each of the group's ``g`` heads, in the consumers'
  visiting order), once its ring slot is free again, the block's Q, lse₂,
  δ and dO rows (``refs``/``smems``: those four) into it, and with ``mask``
  (``(mask ref [B|1, N|1, S_pad, T_pad], its ring, the CTA's first key,
  its keys)``) the tile of the transposed mask; then ``after(step)``, if
  given."""
  q_ref, lse_ref, dl_ref, do_ref = refs
  q_smem, lse_smem, dl_smem, do_smem = smems

  @pl.loop(0, total)
  def _(step):
    slot = lax.rem(step, jnp.int32(stages))
    head = kv_head * g + lax.div(step, per)
    q0 = visit_block(blocks, lax.rem(step, per), order) * bq

    @pl.when(step >= stages)
    def _():
      plgpu.barrier_wait(free.at[slot])

    bar = in_bar.at[slot]
    plgpu.copy_gmem_to_smem(tile_rows(q_ref, layout, batch, head, q0, bq),
                            q_smem.at[slot], bar)
    plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, pl.ds(q0, bq)],
                            lse_smem.at[slot], bar)
    plgpu.copy_gmem_to_smem(dl_ref.at[batch, head, pl.ds(q0, bq)],
                            dl_smem.at[slot], bar)
    plgpu.copy_gmem_to_smem(tile_rows(do_ref, layout, batch, head, q0, bq),
                            do_smem.at[slot], bar)
    if mask is not None:
      mk_ref, mk_smem, k_first, keys = mask
      mb = batch if mk_ref.shape[0] > 1 else 0
      mh = head if mk_ref.shape[1] > 1 else 0
      plgpu.copy_gmem_to_smem(
          mk_ref.at[mb, mh, pl.ds(k_first, keys), pl.ds(q0, bq)],
          mk_smem.at[slot], bar)
    if after is not None:
      after(step)


def attention_backward(
    q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array,
    lse2: jax.Array, delta: jax.Array, d_lse: jax.Array, k_mean: jax.Array,
    spec: MaskSpec, *, sm_scale: float, layout: str, q_lengths: jax.Array,
    kv_lengths: jax.Array,
    tiling: MosaicBackwardTiling = MosaicBackwardTiling(),
    uniform_tiles: bool = False, num_sms: int = 132,
    logits_soft_cap: Optional[float] = None,
    mask: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """dQ, dK, dV of exact attention on padded 16-bit inputs.

  Args:
    q, d_out: ``[B, T_pad, N, H]`` (``layout="BTNH"``) or ``[B, N, T_pad,
      H]``, one 16-bit dtype; ``T_pad`` a multiple of 128 and of
      ``tiling.block_q``; H 64, 128 or 256 (256: ``delta`` given).
    k, v: ``[B, S_pad, K, H]`` or ``[B, K, S_pad, H]``; ``k`` smoothed;
      ``S_pad`` a multiple of 128 and of ``tiling.block_kv``.
    lse2, delta: f32 ``[B, N, T_pad]`` (see the module docstring). With
      ``delta=None`` the dQ kernel computes both exactly, ``lse2`` serving
      as an estimate (e.g. the quantized forward's LSE): it also sums P̂ =
      exp2(c·Q·Kᵀ − lse2), P̂·dP and their products with K, then P = P̂ /
      rowsum P̂ exactly (one more product than with δ given).
    d_lse: f32 ``[B, N, T_pad]``, the LSE's cotangent (0 where a row sees
      no key); each row of dS sums to it, so dQ gains dLSE·k̄·sm_scale.
    k_mean: f32 ``[B, K, H]``, the k̄ taken out of ``k`` (under a soft cap:
      see ``logits_soft_cap``).
    spec: causal / window description (unpadded ``q_len``/``kv_len``).
    q_lengths, kv_lengths: int32 ``[B]`` valid lengths.
    tiling: kernel tiles; ``tiling.fused_dq`` picks the dQ arrangement.
    uniform_tiles: no ``*_lengths`` limit any row (the caller passed
      none), so that without a causal mask or window, and unpadded, every
      dK/dV tile does the same work (``tiling.split_last_round``).
    num_sms: the device's SMs, for ``tiling.split_last_round``'s plan.
    logits_soft_cap: Gemma-2's cap ``c``: the logits ``x`` become
      ``c·tanh(x / c)`` and dS is carried back through it (dX = dS ∘ (1 −
      tanh²)). ``k`` must then be K itself (``lse2`` the capped logits'
      base-2 LSE): the cap is not shift invariant, and the rows of dX do
      not sum to dLSE. With ``delta`` given (saved statistics), dQ gains
      −λ(D − dLSE)·k̄·sm_scale instead, ``k_mean`` being k̄ (any vector
      near K's mean; :func:`sagejax.quant.capped_dq_shift`), from row sums
      that only the dQ kernels make: not with ``tiling.fused_dq``.
    mask: the caller's mask array transposed, bf16 0/1 ``[B|1, N|1, S_pad,
      T_pad]`` (nonzero: attend), or None. Only in the fused kernel
      (``tiling.fused_dq``, δ given) at H=128: each step's tile streams
      with Q (TMA) and every step takes the masked path.

  Returns:
    (dQ, dK, dV) in ``layout`` and the inputs' dtype, padded.
  """
  b, n, t_pad, h, kh, s_pad = layout_dims(q, k, layout)
  dtypes = {jnp.dtype(x.dtype) for x in (q, k, v, d_out)}
  if len(dtypes) != 1 or dtypes.pop().itemsize != 2:
    raise ValueError("q, k, v and d_out must share one 16-bit dtype, got "
                     f"{[str(x.dtype) for x in (q, k, v, d_out)]}.")
  if h not in (64, 128, 256):
    raise ValueError(f"head dim {h} must be 64, 128 or 256 (pad it).")
  for size, tile, what in ((t_pad, 2 * ROWS, "T_pad"),
                           (t_pad, tiling.block_q, "T_pad"),
                           (s_pad, 2 * ROWS, "S_pad"),
                           (s_pad, tiling.block_kv, "S_pad")):
    if size % tile:
      raise ValueError(f"{what}={size} must be a multiple of {tile}.")
  fused = tiling.fused_dq
  if h > WIDE_ABOVE_HEAD_DIM:
    _check_wide(tiling, delta)
  if fused and tiling.block_q * h != 2 * ROWS * ROWS:
    raise ValueError(
        f"MosaicBackwardTiling(fused_dq=True) needs block_q * H = "
        f"{2 * ROWS * ROWS}, got block_q={tiling.block_q}, H={h}: pass "
        f"block_q={2 * ROWS * ROWS // h} or fused_dq=False.")
  if logits_soft_cap is not None and not logits_soft_cap > 0:
    raise ValueError(f"logits_soft_cap={logits_soft_cap!r}: pass a float > 0 "
                     "or None.")
  if logits_soft_cap is not None and fused and delta is not None:
    raise ValueError(
        "Under a soft cap, saved statistics (delta given) need the row sums "
        "of the dQ kernel (NOTES B39), which the fused kernel does not "
        "make: pass MosaicBackwardTiling(fused_dq=False), or delta=None.")
  if mask is not None and (
      not fused or delta is None or h != 2 * ROWS or mask.ndim != 4
      or mask.dtype != jnp.bfloat16 or mask.shape[2:] != (s_pad, t_pad)
      or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, n)):
    raise ValueError(
        f"mask {mask.shape} {mask.dtype}: the Hopper backward takes a bf16 "
        f"[B|1, N|1, S_pad={s_pad}, T_pad={t_pad}] mask (transposed) in its "
        f"fused kernel only (fused_dq=True, δ given, H={2 * ROWS}); the "
        "'pallas' backward takes other mask calls.")
  common = dict(spec=spec, c=sm_scale * quant.LOG2E, sm_scale=sm_scale,
                layout=layout, tiling=tiling, dims=(b, n, t_pad, h, kh, s_pad),
                soft_cap=logits_soft_cap)
  lengths = (q_lengths.astype(jnp.int32), kv_lengths.astype(jnp.int32))
  if h > WIDE_ABOVE_HEAD_DIM:
    dq = _dq_wide(q, k, v, d_out, lse2, delta, d_lse, k_mean, *lengths,
                  **common)
    return (dq, *_dkdv_wide(q, k, v, d_out, lse2, delta, *lengths, **common))
  if not fused:
    dq = _dq(q, k, v, d_out, lse2, delta, d_lse, k_mean, *lengths, **common)
    if delta is None:  # the dQ kernel made the exact statistics
      dq, lse2, delta = dq
    dk, dv = _dkdv(q, k, v, d_out, lse2, delta, *lengths, **common)
    return dq, dk, dv
  if delta is None:  # a statistics-only pass of the dQ kernel
    lse2, delta = _dq(q, k, v, d_out, lse2, None, d_lse, k_mean, *lengths,
                      stats_only=True, **common)
  split = None
  if (tiling.split_last_round and not tiling.dq_turns and uniform_tiles
      and mask is None and not spec.is_causal and spec.window is None
      and (spec.q_len, spec.kv_len) == (t_pad, s_pad)):
    split = last_round_split(kh, b * (s_pad // (2 * ROWS)),
                             steps=t_pad // tiling.block_q, num_sms=num_sms)
  acc = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
  dk, dv, *parts = _dkdv(q, k, v, d_out, lse2, delta, *lengths, acc,
                         split=split, mask=mask, **common)
  if parts:
    # Without the barrier, XLA (0.11.2's) pulls the kernel into a
    # dynamic-slice fusion with the update of its own output by the parts'
    # sum: a cycle, or wrong gradients (NOTES B35).
    dk, dv, *parts = lax.optimization_barrier((dk, dv, *parts))
    dk, dv = (_place_parts(x, x_parts, layout) for x, x_parts in
              zip((dk, dv), parts))
  if logits_soft_cap is not None:  # exact statistics: no k̄ term
    return (acc[...] * sm_scale).astype(q.dtype), dk, dv
  # Σ_j dS_ij = dLSE_i: the K mean's share of dQ.
  g = n // kh
  shift = d_lse[..., None] * jnp.repeat(k_mean.astype(jnp.float32), g,
                                        axis=1)[:, :, None]
  if layout == "BTNH":
    shift = jnp.swapaxes(shift, 1, 2)
  dq = ((acc[...] + shift) * sm_scale).astype(q.dtype)
  return dq, dk, dv


def split_grid(kh: int, n_kt: int, b: int, split: tuple[int, int]
               ) -> tuple[int, int]:
  """(CTAs that run a whole tile, all CTAs) of :func:`_dkdv`'s grid of
  ``kh · n_kt · b`` tiles with the last ``m`` KV heads' tiles in ``k``
  parts (``split=(m, k)``)."""
  m, k = split
  tiles = kh * n_kt * b
  whole = tiles - m * n_kt * b
  return whole, whole + (tiles - whole) * k


def split_cta(cta, whole: int, k: int, b: int, n_kt: int):
  """``(kv_head, kv_tile, batch, part)`` of CTA ``cta`` of a split grid
  (:func:`split_grid`): the whole tiles in the unsplit grid's order (batch
  fastest, KV head slowest), then each split tile's ``k`` parts in turn;
  ``part`` is meaningful for ``cta >= whole`` only."""
  in_part = cta >= whole
  tile = jnp.where(in_part, whole + lax.div(cta - whole, jnp.int32(k)), cta)
  part = lax.rem(cta - whole, jnp.int32(k))
  batch = lax.rem(tile, jnp.int32(b))
  kv_tile = lax.rem(lax.div(tile, jnp.int32(b)), jnp.int32(n_kt))
  kv_head = lax.div(tile, jnp.int32(b * n_kt))
  return kv_head, kv_tile, batch, part


def _place_parts(x: jax.Array, parts: jax.Array, layout: str) -> jax.Array:
  """``x`` (dK or dV, ``[B, S_pad, K, H]`` or ``[B, K, S_pad, H]``) with
  its last ``m`` KV heads set to the f32 sum of the ``k`` parts ``parts``
  ``[k · B, m, S_pad, H]`` (:func:`_dkdv`'s split); XLA updates ``x`` in
  place."""
  b = x.shape[0]
  _, m, s_pad, h = parts.shape
  heads = jnp.sum(parts.reshape(-1, b, m, s_pad, h).astype(jnp.float32),
                  axis=0).astype(x.dtype)
  if layout == "BTNH":
    kh = x.shape[2]
    return lax.dynamic_update_slice(x, jnp.swapaxes(heads, 1, 2),
                                    (0, 0, kh - m, 0))
  kh = x.shape[1]
  return lax.dynamic_update_slice(x, heads, (0, kh - m, 0, 0))


def _dkdv(q, k, v, d_out, lse2, delta, q_lengths, kv_lengths, dq_acc=None,
          *, spec: MaskSpec, c: float, sm_scale: float, layout: str,
          tiling: MosaicBackwardTiling, dims,
          soft_cap: Optional[float] = None,
          split: Optional[tuple[int, int]] = None,
          mask: Optional[jax.Array] = None):
  """dK, dV; with ``dq_acc`` (a zeroed f32 ref shaped like ``q``) also adds
  every CTA's ``dS·K`` into it by TMA reduce-add.

  CTAs run in the grid's order, batch fastest, KV head slowest (Pallas
  gives the CUDA grid its axes reversed), so the CTAs on the device at
  once share a few heads' Q and dO in L2. ``split=(m, k)``
  (:func:`last_round_split`; fused, every tile unmasked): the tiles of the
  last ``m`` KV heads, launched after the others in that order, are run by
  ``k`` CTAs each, part ``p`` over the ``p``-th ``k``-th of the query
  blocks of every head of the group; their dK (times ``sm_scale``) and dV
  go to two extra outputs ``[k · B, m, S_pad, H]`` instead (to be summed:
  :func:`_place_parts`), and their rows of dK and dV are left unwritten.
  ``mask`` (fused, no split): the transposed mask array, whose tile of
  each step the producer streams with Q and every step applies.
  """
  b, n, t_pad, h, kh, s_pad = dims
  n_kt = s_pad // (2 * ROWS)
  if split is not None:
    m_split, k_split = split
    whole, num_ctas = split_grid(kh, n_kt, b, split)
    if dq_acc is None or tiling.dq_turns or not 1 <= m_split <= kh:
      raise ValueError(f"split={split} needs the fused kernel without "
                       f"turns and 1 <= m <= {kh}.")
  g = n // kh
  bq, stages = tiling.block_q, tiling.num_stages
  num_q_blocks = t_pad // bq
  dtype = q.dtype
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  fused = dq_acc is not None
  turns = fused and tiling.dq_turns
  # The dQ tile [bq, H] of a step is two 64 x 64 halves, one per consumer:
  # split along H (bq = 64) or along the rows (H = 64, bq = 128).
  split_cols = h == 2 * ROWS
  order = tiling.unmasked_first

  def kernel(*refs):
    mk_ref = None
    if mask is not None:  # an input after the lengths
      refs = list(refs)
      mk_ref = refs.pop(8)
    if fused:
      (q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, ql_ref, kl_ref,
       dq_ref, dk_ref, dv_ref, *parts, scratch) = refs
    else:
      (q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, ql_ref, kl_ref,
       dk_ref, dv_ref, scratch) = refs
    (k_smem, v_smem, q_smem, do_smem, lse_smem, dl_smem) = scratch[0][:6]
    kv_bar, in_bar, free = scratch[1][:3]
    if split is None:
      kv_head = lax.axis_index("kv_heads")
      kt = lax.axis_index("kv_tiles")
      batch = lax.axis_index("batch")
    else:  # a flat grid: whole tiles, then k CTAs per split tile
      dkp_ref, dvp_ref = parts
      cta = lax.axis_index("ctas")
      kv_head, kt, batch, part = split_cta(cta, whole, k_split, b, n_kt)
      in_part = cta >= whole
    wg = lax.axis_index("wg")
    q_len, kv_len = ql_ref[batch], kl_ref[batch]
    cta_first = kt * (2 * ROWS)
    blocks = query_blocks(spec, cta_first, 2 * ROWS, q_len, kv_len, bq,
                          num_q_blocks, mk_ref is not None)
    if split is not None:  # a part's share of the (unmasked) query blocks
      lo, hi = blocks[0], blocks[3]
      first = lo + lax.div(part * (hi - lo), jnp.int32(k_split))
      last = lo + lax.div((part + 1) * (hi - lo), jnp.int32(k_split))
      blocks = tuple(jnp.where(in_part, x, y) for x, y in
                     zip((first, first, last, last), blocks))
    lo, hi = blocks[0], blocks[3]
    per_head = hi - lo
    if fused:  # dSᵀ of two steps; the dQ halves on their way to dq_ref
      ds_smem, dq_smem = scratch[0][6:8]
    if turns:  # a consumer's dQ tile stored / added by the producer
      dq_ready, dq_free = scratch[1][5:7]
    if mk_ref is not None:
      mk_smem = scratch[0][-1]

    def rows_of(wg):  # consumer wg's 64 keys, or its half of a dQ tile
      if isinstance(wg, int):
        return pl.ds(wg * ROWS, ROWS)
      return pl.ds(pl.multiple_of(wg * ROWS, ROWS), ROWS)

    def dq_window(gi, i, part):
      """Half ``part`` (a Python int or a consumer index) of the dQ tile of
      query block ``i`` of the group's head ``gi``."""
      head = kv_head * g + gi
      if split_cols:
        return tile_rows(dq_ref, layout, batch, head, i * bq, bq).at[
            :, rows_of(part)]
      return tile_rows(dq_ref, layout, batch, head, i * bq + part * ROWS,
                       ROWS)

    def _consumer(wg):
      plgpu.set_max_registers(tiling.consumer_registers, action="increase")
      k0 = cta_first + wg * ROWS
      own = rows_of(wg)  # this wg's keys
      k_own, v_own = k_smem.at[own], v_smem.at[own]
      plgpu.copy_gmem_to_smem(tile_rows(k_ref, layout, batch, kv_head, k0,
                                        ROWS), k_own, kv_bar.at[wg])
      plgpu.copy_gmem_to_smem(tile_rows(v_ref, layout, batch, kv_head, k0,
                                        ROWS), v_own, kv_bar.at[wg])
      plgpu.barrier_wait(kv_bar.at[wg])

      if fused:
        ds_bar = scratch[1][3]
        half = rows_of(wg)

      def step(i, carry, masked: bool, gi):
        dk, dv = carry
        n_step = gi * per_head + visit_position(blocks, i, order)
        slot = lax.rem(n_step, jnp.int32(stages))
        plgpu.barrier_wait(in_bar.at[slot])

        s_t, dp_t = _two_products(  # Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ
            (k_own, q_smem.at[slot].transpose((1, 0))),
            (v_own, do_smem.at[slot].transpose((1, 0))),
            bq)
        lse = lax.broadcast_in_dim(load_all(lse_smem.at[slot], col_layout),
                                   (ROWS, bq), [1])
        dl = lax.broadcast_in_dim(load_all(dl_smem.at[slot], col_layout),
                                  (ROWS, bq), [1])
        def visible():
          also = None
          if mk_ref is not None:  # the caller's mask (selected: NaN dropped)
            mk = load_all(mk_smem.at[slot, own], plgpu.Layout.WGMMA)
            also = mk != 0
          return _visible(spec, i * bq, k0, (ROWS, bq), q_len, kv_len,
                          keys_on_rows=True, also=also)

        p_t, slope = _probabilities(s_t, c, lse, soft_cap,
                                    visible if masked else None)
        ds_t = p_t * (dp_t - dl)
        if slope is not None:  # back to the logits before the cap
          ds_t = ds_t * slope
        ds_t = ds_t.astype(dtype)
        if fused:  # both consumers' dSᵀ rows in shared memory (2 buffers)
          buf = lax.rem(n_step, jnp.int32(2))
          ds_smem.at[buf, own][...] = ds_t
          plgpu.commit_smem()
          plgpu.barrier_arrive(ds_bar.at[buf])

        def grads(refs):  # dV += Pᵀ·dO, dK += dSᵀ·Q (and this half of dS·K)
          plgpu.wgmma(refs[0], p_t.astype(dtype), do_smem.at[slot])
          plgpu.wgmma(refs[1], ds_t, q_smem.at[slot])
          if fused and not turns:
            plgpu.barrier_wait(ds_bar.at[buf])
            if split_cols:  # dQ[:, half] = dS · K[:, half]
              plgpu.wgmma(refs[2],
                          ds_smem.at[buf].transpose((1, 0)),
                          k_smem.at[:, half])
            else:  # dQ[half] = dS[half] · K
              plgpu.wgmma(refs[2],
                          ds_smem.at[buf, :, half].transpose((1, 0)), k_smem)

        if turns:
          return dq_turn(n_step, slot, buf, grads, dk, dv)
        accs = (plgpu.ACC.init(dv), plgpu.ACC.init(dk))
        if fused:
          accs += (plgpu.ACC.init(_zeros(ROWS, ROWS)),)
        out = pl.run_state(grads)(accs)
        plgpu.barrier_arrive(free.at[slot])
        if fused:  # add the dQ half into dq_ref (TMA reduce-add)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          dq_smem.at[wg][...] = out[2]
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(dq_smem.at[wg], dq_window(gi, i, wg),
                                  reduction_op="add")
        return out[1], out[0]

      def dq_turn(n_step, slot, buf, grads, dk, dv):
        """dV and dK by ``grads``; then, on this consumer's turn, the step's
        whole dQ tile, half by half, for the producer to add."""
        dv, dk = pl.run_state(grads)((plgpu.ACC.init(dv),
                                      plgpu.ACC.init(dk)))
        plgpu.barrier_arrive(free.at[slot])
        plgpu.barrier_wait(ds_bar.at[buf])  # the other's dSᵀ rows too

        @pl.when(lax.rem(n_step, jnp.int32(2)) == wg)
        def _():
          @pl.when(n_step > 0)  # the last tile's adds have read the buffer
          def _():
            plgpu.barrier_wait(dq_free.at[wg])

          for part in range(2):  # one 64 x 64 accumulator at a time
            cols = pl.ds(part * ROWS, ROWS)

            def product(ref, cols=cols):
              if split_cols:  # dQ[:, part] = dS · K[:, part]
                plgpu.wgmma(ref, ds_smem.at[buf].transpose((1, 0)),
                            k_smem.at[:, cols])
              else:  # dQ[part] = dS[part] · K
                plgpu.wgmma(ref, ds_smem.at[buf, :, cols].transpose((1, 0)),
                            k_smem)

            dq_smem.at[part][...] = pl.run_state(product)(
                plgpu.ACC.init(_zeros(ROWS, ROWS)))
          _fence_async_shared()
          plgpu.barrier_arrive(dq_ready.at[wg])

        return dk, dv

      def head(gi, carry):
        return visit_blocks(blocks, functools.partial(step, gi=gi), carry,
                            unmasked_first=order)

      dk, dv = lax.fori_loop(0, g, head, (_zeros(ROWS, h), _zeros(ROWS, h)))
      if fused:  # the other consumer's last dS·K may still read our K rows
        done = scratch[1][4]
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)
      k_own[...] = (dk * sm_scale).astype(dk_ref.dtype)
      v_own[...] = dv.astype(dv_ref.dtype)
      plgpu.commit_smem()

      def store(dk_rows, dv_rows):
        plgpu.copy_smem_to_gmem(k_own, dk_rows)
        plgpu.copy_smem_to_gmem(v_own, dv_rows)

      def store_whole():
        store(tile_rows(dk_ref, layout, batch, kv_head, k0, ROWS),
              tile_rows(dv_ref, layout, batch, kv_head, k0, ROWS))

      if split is None:
        store_whole()
      else:
        pl.when(cta < whole)(store_whole)

        @pl.when(in_part)
        def _():  # part `part` of a tile of the split heads
          at = (part * b + batch, kv_head - (kh - m_split), k0, ROWS)
          store(tile_rows(dkp_ref, "BNTH", *at),
                tile_rows(dvp_ref, "BNTH", *at))

      # Shared memory is read out before the CTA exits (the writes finish
      # without us; NOTES B18).
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if tiling.static_consumers:  # one copy of the code per consumer
      for consumer in range(2):
        pl.when(wg == consumer)(functools.partial(_consumer, consumer))
    else:
      pl.when(wg < 2)(functools.partial(_consumer, wg))

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(tiling.producer_registers, action="decrease")
      per = jnp.maximum(per_head, 1)
      total = g * per_head

      def add_dq(step):
        """Adds the dQ tile of ``step`` (stored by that step's consumer)
        into dq_ref, then hands the buffer to the next step's consumer."""
        gi = lax.div(step, per)
        i = visit_block(blocks, lax.rem(step, per), order)
        turn = lax.rem(step, jnp.int32(2))
        plgpu.barrier_wait(dq_ready.at[turn])
        for part in range(2):
          plgpu.copy_smem_to_gmem(dq_smem.at[part],
                                  dq_window(gi, i, part), reduction_op="add")
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.barrier_arrive(dq_free.at[1 - turn])

      def after(step):  # after the loads, which wait on no dQ
        @pl.when(step >= stages)
        def _():
          add_dq(step - stages)

      _stream_query_tiles(
          (q_ref, lse_ref, dl_ref, do_ref),
          (q_smem, lse_smem, dl_smem, do_smem), in_bar, free, stages=stages,
          kv_head=kv_head, g=g, per=per, total=total, blocks=blocks,
          order=order, bq=bq, layout=layout, batch=batch,
          after=after if turns else None,
          mask=None if mk_ref is None else (mk_ref, mk_smem, cta_first,
                                            2 * ROWS))

      if turns:  # the last steps' dQ tiles
        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _(step):
          plgpu.barrier_wait(free.at[lax.rem(step, jnp.int32(stages))])
          add_dq(step)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def entry(*refs):
    smem = (
        wgmma_smem((2 * ROWS, h), dtype),
        wgmma_smem((2 * ROWS, h), dtype),
        wgmma_smem((stages, bq, h), dtype),
        wgmma_smem((stages, bq, h), dtype),
        plgpu.SMEM((stages, bq), jnp.float32),
        plgpu.SMEM((stages, bq), jnp.float32),
    )
    barriers = (plgpu.Barrier(num_arrivals=2, num_barriers=2),
                plgpu.Barrier(num_arrivals=4 + (mask is not None),
                              num_barriers=stages),
                plgpu.Barrier(num_arrivals=2, num_barriers=stages))
    if fused:
      smem += (wgmma_smem((2, 2 * ROWS, bq), dtype),  # dSᵀ of 2 steps
               wgmma_smem((2, ROWS, ROWS), jnp.float32))  # dQ halves
      barriers += (plgpu.Barrier(num_arrivals=2, num_barriers=2),  # dSᵀ
                   plgpu.Barrier(num_arrivals=2))  # both consumers done
    if turns:  # per consumer: its dQ tile stored; the buffer free for it
      barriers += (plgpu.Barrier(num_arrivals=1, num_barriers=2),) * 2
    if mask is not None:  # the transposed mask's tile of each step
      smem += (wgmma_smem((stages, 2 * ROWS, bq), jnp.bfloat16),)
    pl.run_scoped(lambda *scratch: kernel(*refs, scratch), smem, barriers,
                  collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct(k.shape, k.dtype),
              jax.ShapeDtypeStruct(v.shape, v.dtype))
  if split is None:
    grid, grid_names = (kh, n_kt, b), ("kv_heads", "kv_tiles", "batch")
  else:
    grid, grid_names = (num_ctas,), ("ctas",)
    part_type = jax.ShapeDtypeStruct((k_split * b, m_split, s_pad, h),
                                     k.dtype)
    out_type += (part_type, part_type)
  mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=3,
                    thread_name="wg")
  params = plgpu.CompilerParams(approx_math=True)
  inputs = (q, k, v, d_out, lse2, delta, q_lengths, kv_lengths)
  if mask is not None:
    if not fused or split is not None:
      raise ValueError("a mask needs the fused kernel without a split.")
    inputs += (mask,)
  if fused:  # dq_acc is a Ref: pl.kernel aliases it in and out
    return pl.kernel(entry, out_type=out_type, mesh=mesh,
                     compiler_params=params)(*inputs, dq_acc)
  return plgpu.kernel(entry, out_type=out_type, grid=mesh.grid,
                      grid_names=mesh.grid_names, num_threads=3,
                      thread_name="wg", compiler_params=params)(*inputs)


def _dkdv_wide(q, k, v, d_out, lse2, delta, q_lengths, kv_lengths, *,
               spec: MaskSpec, c: float, sm_scale: float, layout: str,
               tiling: MosaicBackwardTiling, dims,
               soft_cap: Optional[float] = None):
  """dK, dV for head dims above 128, δ given, split by product: a CTA owns
  64 keys; consumer 0 makes Sᵀ = K·Qᵀ and Pᵀ, leaves Pᵀ in shared memory
  and adds Pᵀ·dO into dV; consumer 1 makes dPᵀ = V·dOᵀ and, with that Pᵀ,
  dSᵀ, and adds dSᵀ·Q into dK. One 64 × H f32 accumulator a consumer, one
  hand-off a step, one way: consumer 0 may run a step ahead
  (benchmarks/NOTES.md B29-B31)."""
  b, n, t_pad, h, kh, s_pad = dims
  g = n // kh
  bq, stages = tiling.block_q, tiling.num_stages
  num_q_blocks = t_pad // bq
  dtype = q.dtype
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  order = tiling.unmasked_first

  def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, ql_ref, kl_ref,
             dk_ref, dv_ref, scratch):
    (k_smem, v_smem, q_smem, do_smem, lse_smem, dl_smem, pt_smem) = scratch[0]
    (kv_bar, in_bar, free, pt_ready, pt_free) = scratch[1]
    kv_head = lax.axis_index("kv_heads")
    kt = lax.axis_index("kv_tiles")
    batch = lax.axis_index("batch")
    wg = lax.axis_index("wg")
    q_len, kv_len = ql_ref[batch], kl_ref[batch]
    k0 = kt * ROWS
    blocks = query_blocks(spec, k0, ROWS, q_len, kv_len, bq, num_q_blocks,
                          False)
    per_head = blocks[3] - blocks[0]

    def consumer(c_: int):
      plgpu.set_max_registers(tiling.consumer_registers, action="increase")
      own_ref, own_smem = ((k_ref, k_smem), (v_ref, v_smem))[c_]
      plgpu.copy_gmem_to_smem(
          tile_rows(own_ref, layout, batch, kv_head, k0, ROWS), own_smem,
          kv_bar.at[c_])
      plgpu.barrier_wait(kv_bar.at[c_])

      def step(i, acc, masked: bool, gi):
        n_step = gi * per_head + visit_position(blocks, i, order)
        slot = lax.rem(n_step, jnp.int32(stages))
        buf = lax.rem(n_step, jnp.int32(2))
        plgpu.barrier_wait(in_bar.at[slot])
        zeros = _zeros(ROWS, bq)
        if c_ == 0:  # Sᵀ = K·Qᵀ, Pᵀ; dV += Pᵀ·dO
          s_t = _product(zeros, lambda: (
              k_smem, q_smem.at[slot].transpose((1, 0))))
          lse = lax.broadcast_in_dim(load_all(lse_smem.at[slot], col_layout),
                                     (ROWS, bq), [1])
          p_t, slope = _probabilities(
              s_t, c, lse, soft_cap,
              (lambda: _visible(spec, i * bq, k0, (ROWS, bq), q_len,
                                kv_len, keys_on_rows=True))
              if masked else None)
          p16 = p_t.astype(dtype)
          # Consumer 1's dSᵀ = this ∘ (dPᵀ − δ): capped, Pᵀ ∘ slope.
          _hand_over(p16 if slope is None else (p_t * slope).astype(dtype),
                     pt_smem, pt_free, pt_ready, n_step=n_step, buf=buf)
          acc = _product(acc, lambda: (p16, do_smem.at[slot]))
        else:  # dPᵀ = V·dOᵀ, dSᵀ; dK += dSᵀ·Q
          dp_t = _product(zeros, lambda: (
              v_smem, do_smem.at[slot].transpose((1, 0))))
          dl = lax.broadcast_in_dim(load_all(dl_smem.at[slot], col_layout),
                                    (ROWS, bq), [1])
          p16 = _take_over(pt_smem, pt_ready, pt_free, buf=buf)
          ds16 = (p16.astype(jnp.float32) * (dp_t - dl)).astype(dtype)
          acc = _product(acc, lambda: (ds16, q_smem.at[slot]))
        plgpu.barrier_arrive(free.at[slot])
        return acc

      def head(gi, acc):
        return visit_blocks(blocks, functools.partial(step, gi=gi), acc,
                            unmasked_first=order)

      acc = lax.fori_loop(0, g, head, _zeros(ROWS, h))
      # Each consumer alone read its own K or V rows: store through them.
      _store_through(own_smem, acc * (1.0 if c_ == 0 else sm_scale),
                     tile_rows((dv_ref, dk_ref)[c_], layout, batch, kv_head,
                               k0, ROWS))

    for c_ in range(2):
      pl.when(wg == c_)(functools.partial(consumer, c_))

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(tiling.producer_registers, action="decrease")
      _stream_query_tiles(
          (q_ref, lse_ref, dl_ref, do_ref),
          (q_smem, lse_smem, dl_smem, do_smem), in_bar, free, stages=stages,
          kv_head=kv_head, g=g, per=jnp.maximum(per_head, 1),
          total=g * per_head, blocks=blocks, order=order, bq=bq,
          layout=layout, batch=batch)

  def entry(*refs):
    smem = (
        wgmma_smem((ROWS, h), dtype),  # K rows, then dV
        wgmma_smem((ROWS, h), dtype),  # V rows, then dK
        wgmma_smem((stages, bq, h), dtype),  # the ring: Q, dO, lse₂, δ
        wgmma_smem((stages, bq, h), dtype),
        plgpu.SMEM((stages, bq), jnp.float32),
        plgpu.SMEM((stages, bq), jnp.float32),
        wgmma_smem((2, ROWS, bq), dtype),  # Pᵀ of two steps
    )
    one = lambda: plgpu.Barrier(num_arrivals=1, num_barriers=2)
    barriers = (one(),  # K | V rows
                plgpu.Barrier(num_arrivals=4, num_barriers=stages),
                plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                one(), one())
    pl.run_scoped(lambda *scratch: kernel(*refs, scratch), smem, barriers,
                  collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct(k.shape, k.dtype),
              jax.ShapeDtypeStruct(v.shape, v.dtype))
  return plgpu.kernel(
      entry, out_type=out_type, grid=(kh, s_pad // ROWS, b),
      grid_names=("kv_heads", "kv_tiles", "batch"), num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True))(
          q, k, v, d_out, lse2, delta, q_lengths, kv_lengths)


def _dq_wide(q, k, v, d_out, lse2, delta, d_lse, k_mean, q_lengths,
             kv_lengths, *, spec: MaskSpec, c: float, sm_scale: float,
             layout: str, tiling: MosaicBackwardTiling, dims,
             soft_cap: Optional[float] = None):
  """dQ for head dims above 128, δ given, split by product: a CTA owns 64
  query rows of one head and the producer streams the 64-key K and V tiles
  they see; consumer 0 makes S = Q·Kᵀ and P and leaves P in shared memory;
  consumer 1 makes dP = dO·Vᵀ, dS and adds dS·K into dQ (64 × H f32). The
  consumers' products are unequal (1 : 2) but the tensor cores are shared,
  and the hand-off goes one way (benchmarks/NOTES.md B31). Under a soft cap
  consumer 0 hands over P as well as P ∘ slope, for the row sums of
  :func:`_capped_sums`."""
  b, n, t_pad, h, kh, s_pad = dims
  g = n // kh
  bkv, stages = tiling.block_kv, tiling.num_stages
  num_kv_blocks = s_pad // bkv
  num_q_tiles = t_pad // ROWS
  dtype = q.dtype
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  order = tiling.unmasked_first

  capped = soft_cap is not None

  def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dlse_ref, km_ref,
             ql_ref, kl_ref, dq_ref, scratch):
    (rows_smem, vec_smem, km_smem, k_smem, v_smem, p_smem) = scratch[0][:6]
    if capped:  # P itself beside P ∘ slope
      p_smem = (p_smem, scratch[0][6])
    (row_bar0, row_bar1, in_bar, free, p_ready, p_free) = scratch[1]
    head, qt, batch, wg, kv_head, q_len, kv_len = _query_cta(
        ql_ref, kl_ref, causal=spec.is_causal, num_q_tiles=num_q_tiles, g=g)
    row0 = qt * ROWS
    rows_at = pl.ds(row0, ROWS)
    blocks = key_blocks(spec, row0, ROWS, q_len, kv_len, bkv, num_kv_blocks,
                        False)

    def consumer(c_: int):
      plgpu.set_max_registers(tiling.consumer_registers, action="increase")
      bar = (row_bar0, row_bar1)[c_]
      plgpu.copy_gmem_to_smem(
          tile_rows((q_ref, do_ref)[c_], layout, batch, head, row0, ROWS),
          rows_smem.at[c_], bar)
      plgpu.copy_gmem_to_smem((lse_ref, dl_ref)[c_].at[batch, head, rows_at],
                              vec_smem.at[c_, 0], bar)
      if c_ == 1:
        plgpu.copy_gmem_to_smem(dlse_ref.at[batch, head, rows_at],
                                vec_smem.at[c_, 1], bar)
        plgpu.copy_gmem_to_smem(km_ref.at[batch, kv_head], km_smem, bar)
      plgpu.barrier_wait(bar)
      row_vec = lax.broadcast_in_dim(
          load_all(vec_smem.at[c_, 0], row_layout), (ROWS, bkv), [0])

      def step(j, dq, masked: bool):
        n_step = visit_position(blocks, j, order)
        slot = lax.rem(n_step, jnp.int32(stages))
        buf = lax.rem(n_step, jnp.int32(2))
        plgpu.barrier_wait(in_bar.at[slot])
        zeros = _zeros(ROWS, bkv)
        if c_ == 0:  # S = Q·Kᵀ, P
          s = _product(zeros, lambda: (
              rows_smem.at[0], k_smem.at[slot].transpose((1, 0))))
          p, slope = _probabilities(
              s, c, row_vec, soft_cap,
              (lambda: _visible(spec, row0, j * bkv, (ROWS, bkv), q_len,
                                kv_len, keys_on_rows=False))
              if masked else None)
          tile = p.astype(dtype)
          if slope is not None:  # consumer 1's dS = this ∘ (dP − δ)
            tile = ((p * slope).astype(dtype), tile)
          _hand_over(tile, p_smem, p_free, p_ready, n_step=n_step, buf=buf)
        else:  # dP = dO·Vᵀ, dS, dQ += dS·K
          dp = _product(zeros, lambda: (
              rows_smem.at[1], v_smem.at[slot].transpose((1, 0))))
          p = _take_over(p_smem, p_ready, p_free, buf=buf)
          if capped:  # (P ∘ slope, P): dS from the first, D from both
            dq, lam, d_sum = dq
            (p, p_plain), dp_rel = p, dp - row_vec
            lam, d_sum = _capped_sums(lam, d_sum, p.astype(jnp.float32),
                                      p_plain.astype(jnp.float32) * dp_rel)
          ds = (p.astype(jnp.float32) * (dp - row_vec)).astype(dtype)
          dq = _product(dq, lambda: (ds, k_smem.at[slot]))
          if capped:
            dq = (dq, lam, d_sum)
        plgpu.barrier_arrive(free.at[slot])
        return dq

      if c_ == 0:
        visit_blocks(blocks, step, (), unmasked_first=order)
        return
      init = _zeros(ROWS, h)
      if capped:
        rows0 = _zeros(ROWS, layout=row_layout)
        init = (init, rows0, rows0)
      dq = visit_blocks(blocks, step, init, unmasked_first=order)
      coef = load_all(vec_smem.at[1, 1], row_layout)  # dLSE
      if capped:
        dq, lam, d_sum = dq
        coef = quant.capped_dq_shift(lam, d_sum, coef)
      dq = dq + (lax.broadcast_in_dim(coef, (ROWS, h), [0])
                 * lax.broadcast_in_dim(load_all(km_smem, col_layout),
                                        (ROWS, h), [1]))
      # Through dO's rows: this consumer alone read them.
      _store_through(rows_smem.at[1], dq * sm_scale,
                     tile_rows(dq_ref, layout, batch, head, row0, ROWS))

    for c_ in range(2):
      pl.when(wg == c_)(functools.partial(consumer, c_))

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(tiling.producer_registers, action="decrease")

      @pl.loop(0, blocks[3] - blocks[0])
      def _(step):
        slot = lax.rem(step, jnp.int32(stages))
        k0 = visit_block(blocks, step, order) * bkv

        @pl.when(step >= stages)
        def _():
          plgpu.barrier_wait(free.at[slot])

        bar = in_bar.at[slot]
        plgpu.copy_gmem_to_smem(
            tile_rows(k_ref, layout, batch, kv_head, k0, bkv),
            k_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(
            tile_rows(v_ref, layout, batch, kv_head, k0, bkv),
            v_smem.at[slot], bar)

  def entry(*refs):
    smem = (
        wgmma_smem((2, ROWS, h), dtype),  # Q rows; dO rows, then dQ
        plgpu.SMEM((2, 2, ROWS), jnp.float32),  # lse₂ | δ, dLSE
        plgpu.SMEM((h,), jnp.float32),  # k̄
        wgmma_smem((stages, bkv, h), dtype),  # the ring: K, V
        wgmma_smem((stages, bkv, h), dtype),
        wgmma_smem((2, ROWS, bkv), dtype),  # P (∘ slope) of two steps
    )
    if capped:  # and P itself
      smem += (wgmma_smem((2, ROWS, bkv), dtype),)
    one = lambda: plgpu.Barrier(num_arrivals=1, num_barriers=2)
    barriers = (plgpu.Barrier(num_arrivals=2),  # Q, lse₂
                plgpu.Barrier(num_arrivals=4),  # dO, δ, dLSE, k̄
                plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                one(), one())
    pl.run_scoped(lambda *scratch: kernel(*refs, scratch), smem, barriers,
                  collective_axes="wg")

  # The row sums reduce within warps: none of Mosaic's reduction scratch,
  # whose 2 KB the capped kernel's shared memory would not leave.
  params = (plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0)
            if capped else plgpu.CompilerParams(approx_math=True))
  return plgpu.kernel(
      entry, out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(n, num_q_tiles, b), grid_names=("heads", "q_tiles", "batch"),
      num_threads=3, thread_name="wg", compiler_params=params)(
          q, k, v, d_out, lse2, delta, d_lse, k_mean.astype(jnp.float32),
          q_lengths, kv_lengths)


def _dq(q, k, v, d_out, lse2, delta, d_lse, k_mean, q_lengths, kv_lengths,
        *, spec: MaskSpec, c: float, sm_scale: float, layout: str,
        tiling: MosaicBackwardTiling, dims, soft_cap: Optional[float] = None,
        stats_only: bool = False):
  """dQ; with ``delta=None`` also the exact (lse₂, δ): ``lse2`` is then an
  estimate (e.g. the quantized forward's) that the row sums correct.
  ``stats_only``: (lse₂, δ) alone (two products per tile, no dQ). Under a
  soft cap with δ given, dQ gains −λ(D − dLSE)·k̄ from its row sums
  (:func:`sagejax.quant.capped_dq_shift`; ``k_mean`` is then k̄, K's
  mean, and ``k`` K itself); recomputing, no k̄ term."""
  b, n, t_pad, h, kh, s_pad = dims
  g = n // kh
  bkv, stages = tiling.block_kv, tiling.num_stages
  num_kv_blocks = s_pad // bkv
  num_q_tiles = t_pad // (2 * ROWS)
  dtype = q.dtype
  exact = delta is None
  if stats_only and not exact:
    raise ValueError("stats_only needs delta=None")
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  capped_sums = soft_cap is not None and not exact

  def kernel(*refs):
    if stats_only:
      (q_ref, k_ref, v_ref, do_ref, lse_ref, dlse_ref, km_ref, ql_ref,
       kl_ref, lse_out, dl_out, scratch) = refs
      dl_ref = None
    elif exact:
      (q_ref, k_ref, v_ref, do_ref, lse_ref, dlse_ref, km_ref, ql_ref,
       kl_ref, dq_ref, lse_out, dl_out, scratch) = refs
      dl_ref = None
    else:
      (q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dlse_ref, km_ref,
       ql_ref, kl_ref, dq_ref, scratch) = refs
    (q_smem, do_smem, lse_smem, dl_smem, dlse_smem, km_smem, k_smem,
     v_smem) = scratch[0]
    q_bar, in_bar, free = scratch[1]
    head, qt, batch, wg, kv_head, q_len, kv_len = _query_cta(
        ql_ref, kl_ref, causal=spec.is_causal, num_q_tiles=num_q_tiles, g=g)
    cta_first = qt * (2 * ROWS)
    blocks = key_blocks(spec, cta_first, 2 * ROWS, q_len, kv_len, bkv,
                        num_kv_blocks, False)
    lo, hi = blocks[0], blocks[3]

    @pl.when(wg < 2)
    def _consumer():
      plgpu.set_max_registers(tiling.consumer_registers, action="increase")
      row0 = cta_first + wg * ROWS
      rows_at = pl.ds(row0, ROWS)
      bar = q_bar.at[wg]
      plgpu.copy_gmem_to_smem(tile_rows(q_ref, layout, batch, head, row0,
                                        ROWS), q_smem.at[wg], bar)
      plgpu.copy_gmem_to_smem(tile_rows(do_ref, layout, batch, head, row0,
                                        ROWS), do_smem.at[wg], bar)
      plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows_at],
                              lse_smem.at[wg], bar)
      if dl_ref is not None:
        plgpu.copy_gmem_to_smem(dl_ref.at[batch, head, rows_at],
                                dl_smem.at[wg], bar)
      plgpu.copy_gmem_to_smem(dlse_ref.at[batch, head, rows_at],
                              dlse_smem.at[wg], bar)
      plgpu.copy_gmem_to_smem(km_ref.at[batch, kv_head], km_smem.at[wg], bar)
      plgpu.barrier_wait(bar)
      lse = load_all(lse_smem.at[wg], row_layout)
      rows_of = lambda x: lax.broadcast_in_dim(x, (ROWS, bkv), [0])
      zero_rows = _zeros(ROWS, layout=row_layout)
      dl = None if exact else load_all(dl_smem.at[wg], row_layout)

      def step(j, carry, masked: bool):
        slot = lax.rem(j - lo, jnp.int32(stages))
        plgpu.barrier_wait(in_bar.at[slot])

        s, dp = _two_products(  # S = Q·Kᵀ, dP = dO·Vᵀ
            (q_smem.at[wg], k_smem.at[slot].transpose((1, 0))),
            (do_smem.at[wg], v_smem.at[slot].transpose((1, 0))),
            bkv)
        p, slope = _probabilities(
            s, c, lambda: rows_of(lse), soft_cap,
            (lambda: _visible(spec, row0, j * bkv, (ROWS, bkv), q_len,
                              kv_len, keys_on_rows=False))
            if masked else None)
        # dX = P̂ (dP − δ) ∘ slope: capped, the products weigh P̂ by it.
        pw = p if slope is None else p * slope
        if stats_only:  # the row sums of P̂ and P̂·dP
          l, pdp_sum = carry
          carry = (l + p.sum(axis=1), pdp_sum + (p * dp).sum(axis=1))
        elif exact:  # Σ P̂·dP·K and Σ P̂·K, with the row sums of P̂ and P̂·dP
          dq, pk, l, pdp_sum = carry
          pdp = p * dp
          pwdp = pdp if slope is None else pw * dp

          def grad(refs):
            dq_ref_, pk_ref = refs
            plgpu.wgmma(dq_ref_, pwdp.astype(dtype), k_smem.at[slot])
            plgpu.wgmma(pk_ref, pw.astype(dtype), k_smem.at[slot])

          l = l + p.sum(axis=1)
          pdp_sum = pdp_sum + pdp.sum(axis=1)
          dq, pk = pl.run_state(grad)((plgpu.ACC.init(dq),
                                       plgpu.ACC.init(pk)))
          carry = (dq, pk, l, pdp_sum)
        elif capped_sums:  # dQ += dS·K; λ and D
          dq, lam, d_sum = carry
          ds = p * (dp - rows_of(dl))
          lam, d_sum = _capped_sums(lam, d_sum, pw, ds)
          ds = ds * slope

          def grad(acc_ref):
            plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem.at[slot])

          carry = (pl.run_state(grad)(plgpu.ACC.init(dq)), lam, d_sum)
        else:  # dQ += dS·K
          ds = pw * (dp - rows_of(dl))

          def grad(acc_ref):
            plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem.at[slot])

          carry = pl.run_state(grad)(plgpu.ACC.init(carry))
        plgpu.barrier_arrive(free.at[slot])
        return carry

      dlse = load_all(dlse_smem.at[wg], row_layout)
      if exact:
        if stats_only:
          l, pdp_sum = visit_blocks(blocks, step, (zero_rows, zero_rows))
        else:
          dq, pk, l, pdp_sum = visit_blocks(
              blocks, step,
              (_zeros(ROWS, h), _zeros(ROWS, h), zero_rows, zero_rows))
        # P = P̂ / l exactly; δ = rowsum(P·dP) − dLSE; dQ = Σ P (dP − δ) K.
        seen = l != 0  # a NaN sum is seen
        inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
        delta_row = jnp.where(seen, pdp_sum * inv_l - dlse, 0.0)
        if not stats_only:
          bcast = lambda x: lax.broadcast_in_dim(x, (ROWS, h), [0])
          dq = (dq - pk * bcast(delta_row)) * bcast(inv_l)
        lse_smem.at[wg][...] = jnp.where(
            seen, lse + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf)
        dl_smem.at[wg][...] = delta_row
      elif capped_sums:
        dq, lam, d_sum = visit_blocks(blocks, step,
                                      (_zeros(ROWS, h), zero_rows, zero_rows))
      else:
        dq = visit_blocks(blocks, step, _zeros(ROWS, h))
      # Σ_j dS_ij = dLSE_i: the K mean's share of dQ (capped: see above).
      coef = None if soft_cap is not None and exact else dlse
      if capped_sums:
        coef = quant.capped_dq_shift(lam, d_sum, dlse)
      if coef is not None and not stats_only:
        dq = dq + (lax.broadcast_in_dim(coef, (ROWS, h), [0])
                   * lax.broadcast_in_dim(
                       load_all(km_smem.at[wg], col_layout), (ROWS, h), [1]))
      if not stats_only:
        q_smem.at[wg][...] = (dq * sm_scale).astype(dtype)  # Q is done with
      plgpu.commit_smem()
      if not stats_only:
        plgpu.copy_smem_to_gmem(
            q_smem.at[wg], tile_rows(dq_ref, layout, batch, head, row0, ROWS))
      if exact:
        plgpu.copy_smem_to_gmem(lse_smem.at[wg],
                                lse_out.at[batch, head, rows_at])
        plgpu.copy_smem_to_gmem(dl_smem.at[wg],
                                dl_out.at[batch, head, rows_at])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(tiling.producer_registers, action="decrease")

      @pl.loop(lo, hi)
      def _(j):
        slot = lax.rem(j - lo, jnp.int32(stages))

        @pl.when(j - lo >= stages)
        def _():
          plgpu.barrier_wait(free.at[slot])

        bar = in_bar.at[slot]
        plgpu.copy_gmem_to_smem(
            tile_rows(k_ref, layout, batch, kv_head, j * bkv, bkv),
            k_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(
            tile_rows(v_ref, layout, batch, kv_head, j * bkv, bkv),
            v_smem.at[slot], bar)

  def entry(*refs):
    smem = (
        wgmma_smem((2, ROWS, h), dtype),
        wgmma_smem((2, ROWS, h), dtype),
        plgpu.SMEM((2, ROWS), jnp.float32),
        plgpu.SMEM((2, ROWS), jnp.float32),
        plgpu.SMEM((2, ROWS), jnp.float32),
        plgpu.SMEM((2, h), jnp.float32),
        wgmma_smem((stages, bkv, h), dtype),
        wgmma_smem((stages, bkv, h), dtype),
    )
    pl.run_scoped(
        lambda *scratch: kernel(*refs, scratch), smem,
        (plgpu.Barrier(num_arrivals=5 if exact else 6, num_barriers=2),
         plgpu.Barrier(num_arrivals=2, num_barriers=stages),
         plgpu.Barrier(num_arrivals=2, num_barriers=stages)),
        collective_axes="wg")

  dq_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
  vec_type = jax.ShapeDtypeStruct((b, n, t_pad), jnp.float32)
  inputs = [q, k, v, d_out, lse2] + ([] if exact else [delta]) + [
      d_lse, k_mean.astype(jnp.float32), q_lengths, kv_lengths]
  return plgpu.kernel(
      entry,
      out_type=((vec_type, vec_type) if stats_only else
                (dq_type, vec_type, vec_type) if exact else dq_type),
      grid=(n, num_q_tiles, b),
      grid_names=("heads", "q_tiles", "batch"),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(*inputs)

"""The ``"mosaic"`` backend: a Pallas Mosaic GPU kernel for Hopper (sm90).

The attention kernel (:mod:`sagejax.kernels.mosaic_attention`) runs INT8
Q·Kᵀ and FP8 P·V on Hopper's ``wgmma`` tensor cores with TMA loads and
warp-specialised, ping-ponged consumer warpgroups. Inputs are quantized by
the Pallas quantization kernels of the ``"pallas"`` backend, with V stored
transposed and in the kernel's key order; with
``MosaicTiling(quantize_q=True)`` the kernel quantizes Q itself where the
config's groups allow (:func:`quantize_q_in_kernel`): by default only in a
16-bit P·V kernel off the persistent grid (the training forward; slower
with FP8 P·V).

Calls it does not serve (``unsupported`` says why, and ``implementation=None``
then picks the ``"pallas"`` backend): ``mask`` and ``bias`` arrays above
H=128, ``bias`` arrays at H <= 64 (faster there in Triton), head dims
above 128 with FP32 inputs, a negative ``scale``. A
``logits_soft_cap`` is applied in the kernel (Q then quantized by the pass,
for its row shifts), and by its backward; a ``mask`` or ``bias`` array
streams to it in tiles beside K (a bias as f16, with a mask folded into it
as −inf: :func:`bias_tiles`).

Its backward (:mod:`sagejax.kernels.mosaic_backward`, 16-bit ``wgmma``)
takes δ from the forward's saved output (``backward_stats="saved"``, and
``"auto"``, whose differentiated forward runs P·V in 16 bits) and accumulates
dQ in the dK/dV kernel by TMA reduce-add; or computes the exact softmax
statistics in its dQ kernel from the saved LSE as an estimate
(``"recompute"``; the forward is run for it when no LSE is given). Head
dims above 128 (up to 256) run kernels whose consumers split the work by
product, with saved statistics only. Calls it does not serve
(``backward_unsupported``: FP32 inputs, the 8-bit backward, head dims
above 128 recomputing the statistics, mask arrays other than at head dims
65-128 with the forward's statistics, bias arrays) take the ``"pallas"``
backward kernels. With a soft cap the backward kernels take K unsmoothed
and the LSE of the capped logits, and saved statistics take the dQ kernel
beside dK/dV (not the fused one): its row sums correct dQ
(:func:`sagejax.quant.capped_dq_shift`, K's sampled mean as k̄); a mask
array streams, transposed, to the fused kernel beside Q (uncapped).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from sagejax import quant
from sagejax._inputs import ParsedCall
from sagejax.backends._device import is_hopper, sm_count
from sagejax.backends.pallas_triton import (Prepared, pad_axis, pairwise,
                                            quantize_inputs, smoothed,
                                            v_read_in_place)
from sagejax.config import SageConfig
from sagejax.kernels import mosaic_backward, triton_backward
from sagejax.kernels._common import next_pow2
from sagejax.kernels.mosaic_attention import (MosaicTiling, QuantizeQ,
                                              attention_forward,
                                              uses_group_key_scales)
from sagejax.kernels.mosaic_backward import MosaicBackwardTiling

# Above this head dim the forward runs FP8 P·V in column parts only (a
# 16-bit V tile or an f32 output tile does not fit shared memory).
PARTS_ABOVE_HEAD_DIM = 128
PERSISTENT_MAX_KEYS = 4096  # longer calls: the grid (NOTES, Mosaic section 11)
# From so many keys, non-causal FP8 calls run three consumers in three
# phases on the persistent grid (NOTES, Mosaic section 37) ...
THREE_PHASE_MIN_KEYS = 2048
# ... and causal ones from this many (section 40, H200, kernel alone:
# +12-13% at 8k and 16k over two consumers on the hardware's grid; equal
# to two consumers on the persistent grid at 4096).
THREE_PHASE_MIN_KEYS_CAUSAL = 8192
# ... where their 192-row tiles, each taking this many times a 128-row
# tile of two consumers (measured 1.29-1.34 at 256-512 queries), cost no
# more than two consumers' tiles: see :func:`three_consumers_pay`.
THREE_CONSUMER_TILE_COST = 1.3
# Q's pass in programs of at most so many rows where Q's groups allow
# (section 52, H200: the first launch 11-12% faster than with 128 rows at
# H=64 and 128, 1k end to end -3%, 4k -2%).
Q_PASS_ROWS = 64
# V's pass (transposed FP8 V in the kernel's key order) in programs of so
# many values on so many warps (section 52, H200: the pass 7% faster at
# H=128 than 64 tokens on 4 warps, 15% at H=64).
V_PASS_VALUES, V_PASS_WARPS = 8192, 8


def three_consumers_pay(queries: int) -> bool:
  """Whether ``queries`` rows run faster in 192-row tiles of three
  consumers than in 128-row tiles of two: 1.3 · ⌈T/192⌉ ≤ ⌈T/128⌉ (NOTES,
  Mosaic section 37, H200, 4096 keys: T=256 two consumers 25% faster, T=512
  three 4% faster, T=1000 equal). False at T ≤ 128, 193-256 and 577-640."""
  return THREE_CONSUMER_TILE_COST * -(-queries // 192) <= -(-queries // 128)


def default_tiling(head_dim: int, config: SageConfig,
                   call: Optional[ParsedCall] = None) -> MosaicTiling:
  """Kernel tiles by head dim and P·V dtype (benchmarks/NOTES.md, Mosaic
  section 5): at H=64 with FP8 P·V, where the three-phase rule below does
  not apply, 256-key steps with the consumers taking turns around their
  exponentials (+10-12% over 128-key steps meeting around the products);
  16-bit P·V (``sage1``, the training forward) keeps
  128-key steps (256 were not measured there). At H ≤ 128, a non-causal
  ``call`` of at least 2048 keys whose tiles all do the same work
  (:func:`ordered_tiles`) with FP8 P·V and grouped K scales (no soft cap,
  no smoothed Q), and enough queries (:func:`three_consumers_pay`), runs
  three 64-row consumers taking turns around their exponentials in three
  phases, on the persistent grid (section 37, H200, kernel alone: +4-5%
  at 16k over three consumers without turns on the hardware's grid,
  +8-11% at 4k over two on the persistent grid), and so does a causal one
  from 8192 keys (section 40: once the masked steps stopped spilling,
  +12-13% at 8k and 16k over two consumers on the hardware's grid;
  section 42, H=64: +4-8% over its 256-key steps at 4k-16k, +3% at 16k
  causal); above H=64 with ``alpha_hint`` (section 55: kernel −1.5 to
  −2.8% at 4k and 16k, −1% at 16k causal; slower at H=64). Other calls
  of at most 4096 keys whose tiles' work the kernel knows run the
  persistent grid with two consumers at 240/24 registers (section 11,
  H100: FP8 P·V kernel +10% at 1k, +2% at 4k, −1% at 16k; 16-bit P·V
  +8% at 2k, +3% at 4k; section 15: causal tiles dealt heaviest first,
  back and forth, +3-6% at 4k, equal at 16k), Q quantized by the pass.
  Off the persistent grid, a 16-bit P·V kernel quantizes Q itself where
  :func:`quantize_q_in_kernel` allows (B21; on the persistent grid that
  measured 5-15% slower, section 15). Above H=128, FP8 P·V and its
  two-level accumulation run in parts of 32 output columns (section 18,
  H100, H=256: kernel +11-13% over parts of 64, +60-80% over 128; the
  fewest registers spilled); 16-bit P·V in 64-key steps (a 16-bit V tile
  of 128 keys does not fit shared memory beside K's) and parts of 128
  columns (section 20, H100: +4% over 64, 3 stages no better). With a
  logit soft cap (a second MUFU op per score) or a mask array, H=64 keeps
  128-key steps (section 29: capped +8% at 16k causal, equal at 4k;
  section 30: masked, 256-key steps ran 0.65x the Triton kernel)."""
  if head_dim > PARTS_ABOVE_HEAD_DIM:
    if config.pv_dtype != "fp8_e4m3":  # a 16-bit V tile: 64-key steps
      return MosaicTiling(block_kv=64, num_stages=2, consumer_registers=240,
                          producer_registers=24, pv_part_cols=128)
    return MosaicTiling(block_kv=128, num_stages=2, consumer_registers=240,
                        producer_registers=24, pv_part_cols=32)
  if (call is not None and config.pv_dtype == "fp8_e4m3"
      and ordered_tiles(call)
      and call.logits_soft_cap is None and k_scale_grouped(config)
      and not config.smooth_q
      and call.dims[5] >= (THREE_PHASE_MIN_KEYS_CAUSAL if call.spec.is_causal
                           else THREE_PHASE_MIN_KEYS)
      and three_consumers_pay(call.dims[2])):
    return MosaicTiling(block_kv=128, num_stages=2, num_consumers=3,
                        consumer_registers=160, producer_registers=32,
                        schedule_exp=True, persistent=True,
                        alpha_hint=head_dim > 64)
  if head_dim <= 64:
    # A soft cap or a mask array: every step per key (no grouped softmax).
    per_key = call is not None and (call.logits_soft_cap is not None
                                    or call.mask is not None
                                    or call.bias is not None)
    if config.pv_dtype == "fp8_e4m3" and not per_key:
      return MosaicTiling(block_kv=256, num_stages=2, schedule_exp=True)
    return MosaicTiling(block_kv=128, num_stages=3)
  if (call is not None and call.dims[5] <= PERSISTENT_MAX_KEYS
      and ordered_tiles(call)):
    return MosaicTiling(block_kv=128, num_stages=2, persistent=True,
                        consumer_registers=240, producer_registers=24)
  # 16-bit P·V (the training forward): Q quantized in the prologue where
  # its groups allow (NOTES B21: +2-4% end to end; the FP8 kernel lost
  # 3-5% with it, section 6).
  return MosaicTiling(block_kv=128, num_stages=2, quantize_q=(
      config.pv_dtype != "fp8_e4m3" and call is not None
      and quantize_q_in_kernel(call, config) is not None))


F16_MAX = float(jnp.finfo(jnp.float16).max)


def bias_tiles(bias: Optional[jax.Array], mask: Optional[jax.Array],
               soft_cap: Optional[float] = None) -> Optional[jax.Array]:
  """The kernel's bias array from the caller's (padded) ``[B|1, N|1, T_pad,
  S_pad]``: a 16-bit one as it is (no pass over it); else, or with a mask
  (nonzero = attend) folded in as −inf (which the kernel then selects as
  it does a mask's False: ``bias_has_mask``), or a soft cap, in f16 (11
  significant bits; finite values clipped to ±65504, where their
  exponentials are 0 or the row's maximum anyway). Under a cap the
  caller's ±inf are clipped too: the cap makes them ±cap, as in exact
  attention, not a mask. None without a bias."""
  if bias is None:
    return None
  if mask is None and soft_cap is None and bias.dtype in (jnp.bfloat16,
                                                          jnp.float16):
    return bias
  bias = bias.astype(jnp.float32)
  clipped = jnp.clip(bias, -F16_MAX, F16_MAX)
  if soft_cap is None:
    clipped = jnp.where(jnp.isfinite(bias), clipped, bias)
  if mask is not None:
    clipped = jnp.where(mask != 0, clipped, -jnp.inf)
  return clipped.astype(jnp.float16)


def ordered_tiles(call: ParsedCall) -> bool:
  """Whether the persistent grid's static order can even out ``call``'s
  tiles: all do the same work, or a causal mask alone makes it fall with
  the query tile (dealt heaviest first, back and forth:
  :func:`sagejax.kernels.mosaic_attention.persistent_index`). Not with a
  window, lengths, mask or bias array."""
  return (call.spec.window is None and call.q_lengths is None
          and call.kv_lengths is None and call.mask is None
          and call.bias is None)


def default_backward_tiling(head_dim: int, fused_dq: bool = False
                            ) -> MosaicBackwardTiling:
  """Backward tiles by head dim (benchmarks/NOTES.md, B5 and B7); with
  ``fused_dq`` the dK/dV kernel's query tile is 8192 / H rows (each
  consumer owns a 64 x 64 half of the dQ tile), and at H=64 the consumers
  take turns making dQ (``dq_turns``; B15, H100 training step: −5% at 4k
  and 16k, −6% causal, −1-2% GQA 32/8; at H=128 it measured 0 to +6%, +9-17%
  causal, so not there); above H=64 each consumer has its own copy of the
  code (``static_consumers``; B16, H100 training step, timed in rotated
  order: −1.5% at 4k, −2% 4k causal, −3% GQA 32/8, −6% at 16k; slower with
  turns, so not at H=64), and the unmasked query blocks are visited first,
  the masked ones after them in one loop (``unmasked_first``; B27, H100
  training step: −3% at 4k causal, −6% at 8k and 16k causal, the unmasked
  loop's spills gone; 0 to +1.5% at H=64, so not there); where every tile
  does the same work the last round of tiles is split in parts
  (``split_last_round``; B35, H100 training step: −1.8% at 4k; not with
  the turns of H=64)."""
  if head_dim > mosaic_backward.WIDE_ABOVE_HEAD_DIM:
    return MosaicBackwardTiling(unmasked_first=True)
  if fused_dq:
    return MosaicBackwardTiling(block_q=8192 // head_dim, fused_dq=True,
                                dq_turns=head_dim <= 64,
                                static_consumers=head_dim > 64,
                                unmasked_first=head_dim > 64,
                                split_last_round=head_dim > 64)
  return MosaicBackwardTiling()


def quantize_q_in_kernel(call: ParsedCall, config: SageConfig
                         ) -> Optional[QuantizeQ]:
  """How the attention kernel quantizes Q itself (:class:`QuantizeQ`), or
  None where a Pallas pass must. The kernel makes groups that lie inside
  one ``wgmma`` warp of 16 rows: per token, or per thread / per warp with
  ``config.block_q // config.num_warps == 16`` (e.g. ``num_warps=8`` with
  ``block_q=128``, SageAttention2's sm90 geometry; the presets' 32-row
  warps span two). Smoothed Q (block means and ΔS), per-block groups,
  inputs that are not 16-bit, a soft cap (its row shifts) and a mask or
  bias array (its tiles take the shared memory of the 16-bit Q tile) need
  the pass."""
  if (config.smooth_q or jnp.dtype(call.q.dtype).itemsize != 2
      or call.logits_soft_cap is not None or call.mask is not None
      or call.bias is not None):
    return None
  rows = {"per_token": 1}
  if config.rows_per_warp == 16:
    rows.update(per_thread=2, per_warp=16)
  if config.qk_granularity not in rows:
    return None
  return QuantizeQ(qmax=config.qmax,
                   rows_per_group=rows[config.qk_granularity],
                   scale_mult=call.sm_scale * quant.LOG2E,
                   shift_mult=call.sm_scale)


def k_scale_grouped(config: SageConfig) -> bool:
  """Whether K's scales are one per 64 keys and key index mod 8 // 2 (the
  kernel's per-thread key scales, ``attention_forward(k_scale_grouped=)``):
  per-thread groups, or per-block ones, in blocks of a multiple of 64."""
  return (config.qk_granularity in ("per_thread", "per_block", "per_warp")
          and config.block_k % 64 == 0)


class _MosaicBackend:
  name = "mosaic"
  platform = "cuda"
  min_compute_capability = 9.0  # sm90 only (an export without a GPU: pallas)
  custom_call_targets = ("mosaic_gpu_v2",)  # for jax.export
  # config=None / "auto". Measured on an H200 (B=4, N=32, H=128, end to end;
  # benchmarks/NOTES.md): sage2-8b 594-611 TOPS at 4k and 722-766 at 16k,
  # sage1 545 and 624 (more accurate: relative L1 0.013 vs 0.038); sage2-4b
  # runs the INT8 path (no 4-bit tensor cores) with more error. No preset
  # beats sage2-8b on both; it is the one that beats cuDNN.
  default_preset = "sage2-8b"

  def available(self) -> bool:
    return is_hopper()

  def unsupported(self, call: ParsedCall, config: SageConfig
                  ) -> Optional[str]:
    _, _, _, h, _, _ = call.dims
    if call.mask is not None and h > PARTS_ABOVE_HEAD_DIM:
      return (f"mask arrays above H={PARTS_ABOVE_HEAD_DIM} are read by the "
              "'pallas' backend (shared memory); pass is_causal/"
              "local_window_size/*_seq_lengths where they express the mask")
    if call.bias is not None and h > PARTS_ABOVE_HEAD_DIM:
      return (f"bias arrays above H={PARTS_ABOVE_HEAD_DIM} are read by the "
              "'pallas' backend (shared memory)")
    if call.bias is not None and h <= 64:
      return ("bias arrays at head dims up to 64 run faster in the 'pallas' "
              "kernel (benchmarks/NOTES.md, Mosaic section 31)")
    if call.sm_scale <= 0:
      return "the kernel needs a positive scale"
    if h > PARTS_ABOVE_HEAD_DIM and jnp.dtype(call.q.dtype).itemsize != 2:
      return (f"head dims above {PARTS_ABOVE_HEAD_DIM} run with 16-bit "
              "inputs only (an f32 output tile does not fit shared "
              "memory); the 'pallas' backend serves the others")
    if config.smooth_q and config.block_q % 128:
      return "smoothed Q needs SageConfig.block_q a multiple of 128"
    return None

  def prepare(self, call: ParsedCall, config: SageConfig,
              tiling: Optional[MosaicTiling] = None,
              centre_k: bool = False) -> Prepared:
    """Quantizes K, V (and Q, unless the kernel does:
    :func:`quantize_q_in_kernel`) for the kernel (INT4 unpacked to INT8
    values: Hopper has no 4-bit tensor cores); ``centre_k``: also K − k̄
    (``Prepared.centred_k``, :meth:`centres_k`). Where the kernel takes
    grouped K scales, the K pass writes them (``Prepared.k_group_scales``:
    no XLA kernels for them between the passes and the kernel)."""
    _, _, _, h, _, _ = call.dims
    hp = max(64, next_pow2(h))
    tiling = tiling or default_tiling(hp, config, call)
    fp8 = config.pv_dtype == "fp8_e4m3"
    s_multiple = max(config.block_k, tiling.block_kv)
    grouped = (uses_group_key_scales(
        tiling, k_scale_grouped=k_scale_grouped(config),
        smoothed_q=config.smooth_q, logits_soft_cap=call.logits_soft_cap,
        mask_or_bias=call.mask is not None or call.bias is not None)
        and tiling.block_kv % math.lcm(64, config.block_k) == 0)
    prepared = quantize_inputs(
        call, config, head_dim=hp,
        # Q's rows to whole Q-pass programs and consumer tiles, not to whole
        # CTAs: the kernel's last tile may reach past them (NOTES Mosaic
        # section 36: a copy of Q and one of the output saved at 16k).
        t_multiple=math.lcm(config.block_q, tiling.block_q),
        s_multiple=s_multiple, v_transposed=fp8, v_wgmma_key_order=fp8,
        quantize_q=(not tiling.quantize_q
                    or quantize_q_in_kernel(call, config) is None),
        v_in_place=v_read_in_place(call, config, hp, s_multiple),
        centre_k=centre_k,
        group_scale_keys=tiling.block_kv if grouped else None,
        q_pass_rows=Q_PASS_ROWS,
        v_pass=(V_PASS_VALUES, V_PASS_WARPS) if fp8 else None)
    if config.qk_dtype == "int4":
      qkv = prepared.qkv
      q = qkv.q if qkv.q is None else quant.unpack_int4(qkv.q)
      prepared = dataclasses.replace(prepared, qkv=dataclasses.replace(
          qkv, q=q, k=quant.unpack_int4(qkv.k)))
    return prepared

  def kernel(self, prepared: Prepared, call: ParsedCall, config: SageConfig,
             tiling: Optional[MosaicTiling] = None,
             profile_dir: Optional[str] = None, smoothed_lse: bool = False):
    """The attention kernel alone on prepared inputs: (output, lse), and
    with ``smoothed_lse`` the LSE of the logits of K smoothed by
    ``prepared``'s k̄ (the LSE less its row shift q·k̄·scale);
    ``profile_dir``: see :func:`attention_forward`."""
    b, n, t, h, _, _ = call.dims
    qkv = prepared.qkv
    tiling = tiling or default_tiling(qkv.k.shape[-1], config, call)
    if prepared.q_raw is None:  # quantized by a pass (or by the caller)
      q, q_layout, quantize_q = qkv.q, "BNTH", None
    else:
      q, q_layout = prepared.q_raw, call.layout
      quantize_q = quantize_q_in_kernel(call, config)
    cap, shift = call.logits_soft_cap, qkv.lse_shift
    row_shift = None  # with a cap, K smoothing's shift goes in before it
    if cap is not None and shift is not None:
      row_shift = pad_axis(shift, 2, qkv.q.shape[2])  # Q by the pass
    out, lse, lse_smoothed = attention_forward(
        q, qkv.q_scale, qkv.k, qkv.k_scale, qkv.v, qkv.v_scale,
        qkv.v_mean, qkv.delta_s, call.spec, q_lengths=prepared.q_lengths,
        kv_lengths=prepared.kv_lengths, config_block_q=config.block_q,
        out_dtype=call.q.dtype, out_layout=call.layout,
        pv_two_level=config.pv_accumulation == "fp32+fp32",
        k_scale_grouped=k_scale_grouped(config), quantize_q=quantize_q,
        k_mean=prepared.k_mean, q_layout=q_layout,
        v_layout=prepared.v_layout, tiling=tiling,
        profile_dir=profile_dir, return_smoothed_lse=True,
        logits_soft_cap=cap, row_shift=row_shift,
        mask=(None if prepared.mask is None or prepared.bias is not None
              else (prepared.mask != 0).astype(jnp.bfloat16)),
        bias=bias_tiles(prepared.bias, prepared.mask, cap),
        bias_has_mask=prepared.bias is not None and prepared.mask is not None,
        k_group_scales=prepared.k_group_scales)
    if call.layout == "BTNH":
      out = out[:, :t, :, :h]
    else:
      out = out[:, :, :t, :h]
    lse, lse_smoothed = lse[:, :, :t], lse_smoothed[:, :, :t]
    if shift is not None and cap is None:  # (capped: the kernel's LSE is)
      lse = lse + shift
    return (out, lse, lse_smoothed) if smoothed_lse else (out, lse)

  def forward(self, call: ParsedCall, config: SageConfig
              ) -> tuple[jax.Array, jax.Array]:
    return self.kernel(self.prepare(call, config), call, config)

  def saves_lse2(self, call: ParsedCall, config: SageConfig) -> bool:
    """Whether the forward under ``jax.grad`` keeps lse₂ for this backend's
    backward instead of the LSE (:meth:`forward_residual`): with saved
    statistics and K smoothed by the k̄ the backward takes out too
    (:func:`sagejax.quant.sampled_mean` of the same tokens)."""
    return (config.saved_stats and config.smooth_k
            and call.logits_soft_cap is None
            and self.backward_unsupported(call, config) is None)

  def centres_k(self, call: ParsedCall, config: SageConfig) -> bool:
    """Whether the forward under ``jax.grad`` also hands the backward
    K − k̄ (:meth:`forward_residual`'s ``centre_k``): with lse₂ saved
    (:meth:`saves_lse2`) and K's shape unpadded by either pass (head dim a
    power of two from 64, keys a multiple of both passes' tiles). The
    K pass writes it where the backward's XLA copy would read K again."""
    _, _, _, h, _, s = call.dims
    hp = max(64, next_pow2(h))
    s_multiple = max(config.block_k,
                     default_tiling(hp, config, call).block_kv)
    return (self.saves_lse2(call, config) and h == hp
            and s % math.lcm(s_multiple, 2 * mosaic_backward.ROWS) == 0)

  def forward_residual(self, call: ParsedCall, config: SageConfig,
                       centre_k: bool = False):
    """(output, LSE, lse₂[, (K − k̄, k̄)]): lse₂ f32 ``[B, N, T]`` is the
    base-2 LSE of the logits of smoothed K (+inf for a row that sees no
    key, NaN kept), what the backward's kernels take, so that the backward
    need not read Q for it (NOTES B23); with ``centre_k`` (where
    :meth:`centres_k`), K − k̄ in K's dtype and layout and k̄ f32
    ``[B, K, H]``, for :meth:`backward`'s ``k_bar``."""
    prepared = self.prepare(call, config, centre_k=centre_k)
    out, lse, smoothed_lse = self.kernel(prepared, call, config,
                                         smoothed_lse=True)
    lse2 = _base2_lse(smoothed_lse)
    return (out, lse, lse2) + ((prepared.centred_k,) if centre_k else ())

  backward_tiling: Optional[MosaicBackwardTiling] = None

  def backward_unsupported(self, call: ParsedCall, config: SageConfig
                           ) -> Optional[str]:
    reason = self.unsupported(call, config)
    if reason is not None:
      return reason
    dtypes = {jnp.dtype(x.dtype) for x in (call.q, call.k, call.v)}
    if len(dtypes) != 1 or dtypes.pop().itemsize != 2:
      return ("the Hopper backward takes Q, K, V of one 16-bit dtype; the "
              "'pallas' backward serves others")
    if config.backward_int8:
      return "the 8-bit backward (backward_int8) runs in the 'pallas' kernels"
    if call.bias is not None:
      return ("the Hopper backward takes no bias array; the 'pallas' "
              "backward makes its gradient")
    if call.mask is not None and not (
        max(64, next_pow2(call.dims[3])) == 2 * mosaic_backward.ROWS
        and config.saved_stats and call.logits_soft_cap is None
        and self.backward_tiling is None):
      return (f"the Hopper backward takes a mask array at head dims 65-"
              f"{2 * mosaic_backward.ROWS} with the forward's statistics "
              "(backward_stats 'saved' or 'auto') and no soft cap, in its "
              "fused kernel; the 'pallas' backward takes other mask calls")
    if (call.dims[3] > mosaic_backward.WIDE_ABOVE_HEAD_DIM
        and not config.saved_stats):
      return (f"above H={mosaic_backward.WIDE_ABOVE_HEAD_DIM} the Hopper "
              "backward takes δ from the saved output "
              "(backward_stats='saved'); the 'pallas' backward recomputes")
    return None

  def backward(self, call: ParsedCall, config: SageConfig, d_out: jax.Array,
               d_lse: Optional[jax.Array],
               saved: Optional[tuple[jax.Array, jax.Array]],
               tiling: Optional[MosaicBackwardTiling] = None,
               saved_lse2: bool = False, k_bar: Optional[jax.Array] = None):
    """Gradients of exact attention by the Mosaic backward kernels; see
    :class:`sagejax.backends.BackwardBackend`. ``saved_lse2``: ``saved``
    holds lse₂ of :meth:`forward_residual` in place of the LSE (where
    :meth:`saves_lse2`). ``k_bar``: ``call.k`` is K − k̄ already and this
    is k̄ (:meth:`forward_residual`'s ``centre_k``)."""
    b, n, t, h, kh, s = call.dims
    hp = max(64, next_pow2(h))
    out, lse = (None, None) if saved is None else saved
    cap = call.logits_soft_cap
    # δ from the saved output: dQ is accumulated in the dK/dV kernel (one
    # kernel of 5 products); else the dQ kernel also makes the statistics.
    # Under a soft cap the saved statistics need the dQ kernel's row sums.
    tiling = tiling or self.backward_tiling or default_backward_tiling(
        hp, fused_dq=out is not None and cap is None)
    unit = 2 * mosaic_backward.ROWS  # a multiple of every tile
    t_pad, s_pad = -(-t // unit) * unit, -(-s // unit) * unit
    layout = call.layout
    t_ax = 1 if layout == "BTNH" else 2
    f32 = jnp.float32

    def vec(x, value=0.0):  # [B, N, T] -> [B, N, T_pad]
      return pad_axis(x.astype(f32), 2, t_pad, value)

    def pad(x, size=t_pad):  # head dim and tokens, in the call's layout
      return pad_axis(pad_axis(x, 3, hp), t_ax, size)

    q_lengths = quant.valid_lengths(call.q_lengths, b, t)
    kv_lengths = quant.valid_lengths(call.kv_lengths, b, s)
    # K smoothed: dQ never multiplies a large mean (any fixed k̄ gives the
    # same gradient: a sampled one, no pass over K); with a soft cap, which
    # is not shift invariant, K as it is, and the sampled k̄ is where the
    # saved statistics' dQ correction goes (quant.capped_dq_shift). V
    # smoothed when the dQ kernel makes the statistics: dP − δ is
    # unchanged, but its sums do not cancel a large V mean.
    if cap is not None:
      if k_bar is not None or saved_lse2:
        raise ValueError("a soft-capped call's backward takes K and the "
                         "LSE, not K − k̄ or lse₂.")
      kc = pad(call.k, s_pad)
      k_mean = quant.sampled_mean(kc, call.kv_lengths, token_axis=t_ax,
                                  tokens=s)
    elif k_bar is not None:  # the forward's K pass made K − k̄
      if not saved_lse2:
        raise ValueError("k_bar (K centred by the forward) goes with "
                         "saved_lse2.")
      kc, k_mean = pad(call.k, s_pad), k_bar
    else:
      kc, k_mean = smoothed(call.k, call.kv_lengths, layout, hp, s_pad)
    if out is None:
      vc, _ = smoothed(call.v, call.kv_lengths, layout, hp, s_pad)
    else:
      vc = pad(call.v, s_pad)
    q, do = pad(call.q), pad(d_out)
    if saved_lse2 and (out is None or lse is None):
      raise ValueError("saved_lse2 needs the saved output and lse₂.")
    if lse is None:  # the estimate jax.grad keeps: the quantized forward's
      lse = self.forward(call, config)[1]
    if cap is not None:  # lse₂ of the capped logits of K itself; δ from O
      lse2 = vec(_base2_lse(lse), jnp.inf)
      delta = None if out is None else triton_backward.saved_statistics(
          None, lse2, None, q_lengths=q_lengths, sm_scale=call.sm_scale,
          layout=layout, out=pad(out), d_out=do,
          d_lse=None if d_lse is None else vec(d_lse))[1]
    else:
      # One pass over O, dO (and Q unless the forward kept lse₂): lse₂ of
      # the smoothed logits (the LSE minus the row shift q·k̄) and δ =
      # rowsum(dO ∘ O) − dLSE.
      lse2, delta = triton_backward.saved_statistics(
          None if saved_lse2 else q,
          vec(lse, jnp.inf if saved_lse2 else -jnp.inf),
          None if saved_lse2 else k_mean, q_lengths=q_lengths,
          sm_scale=call.sm_scale, layout=layout,
          out=None if out is None else pad(out), d_out=do,
          d_lse=None if d_lse is None else vec(d_lse))
    dl = jnp.zeros_like(lse2) if d_lse is None else jnp.where(
        lse2 != jnp.inf, vec(d_lse), 0.0)  # a seen row (NaN kept)
    mask = None
    if call.mask is not None:  # transposed: keys on the kernel's rows
      mask = jnp.swapaxes(pairwise(call.mask, t_pad, s_pad, jnp.bfloat16),
                          2, 3)
    dq, dk, dv = mosaic_backward.attention_backward(
        q, kc, vc, do, lse2, delta, dl, k_mean, call.spec,
        sm_scale=call.sm_scale, layout=layout, q_lengths=q_lengths,
        kv_lengths=kv_lengths, tiling=tiling,
        uniform_tiles=call.q_lengths is None and call.kv_lengths is None,
        num_sms=sm_count(), logits_soft_cap=cap, mask=mask)
    if layout == "BTNH":
      dq, dk, dv = dq[:, :t, :, :h], dk[:, :s, :, :h], dv[:, :s, :, :h]
    else:
      dq, dk, dv = dq[:, :, :t, :h], dk[:, :, :s, :h], dv[:, :, :s, :h]
    return dq, dk, dv, None


def _base2_lse(lse: jax.Array) -> jax.Array:
  """A natural-log LSE in base 2, +inf (not −inf) where a row sees no key
  (the backward kernels' lse₂ convention; NaN kept)."""
  return jnp.where(lse == -jnp.inf, jnp.inf, lse * quant.LOG2E)


BACKEND = _MosaicBackend()

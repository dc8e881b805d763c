"""The ``"pallas"`` backend: Pallas kernels lowered through Triton (sm80+).

Quantization kernels (:mod:`sagejax.kernels.triton_quantize`) read Q, K and V
in the caller's layout: one pass makes the reductions over all tokens (K's
mean, V's mean and per-channel max), then one kernel per tensor writes the
quantized values (the Q kernel also the LSE's row shift q·k̄); XLA computes
ΔS for smoothed Q. The fused attention kernel
(:mod:`sagejax.kernels.triton_attention`) writes the output straight into the
caller's layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from sagejax import quant
from sagejax._inputs import ParsedCall, to_canonical
from sagejax.backends._device import gpu_compute_capability
from sagejax.config import SageConfig
from sagejax.kernels import triton_attention, triton_backward, triton_quantize
from sagejax.kernels._common import next_pow2
from sagejax.kernels.triton_attention import KernelTiling
from sagejax.kernels.triton_backward import BackwardTiling


def default_tiling(head_dim: int, config: SageConfig) -> KernelTiling:
  """Kernel tiles by head dim (measured on H100/H200; benchmarks/NOTES.md)."""
  if head_dim <= 64:
    return KernelTiling(block_q=128, block_k=64, num_warps=4, num_stages=4)
  if head_dim <= 128:
    return KernelTiling(block_q=128, block_k=128, num_warps=8, num_stages=3)
  return KernelTiling(block_q=64, block_k=32, num_warps=4, num_stages=2)


def default_backward_tiling(head_dim: int, int8: bool = False,
                            itemsize: int = 2) -> BackwardTiling:
  """Backward kernel tiles by head dim (benchmarks/train_check.py sweeps).

  FP32 inputs (IEEE FP32 products) take the smallest tiles: their K/V and
  Q/dO tiles need twice the shared memory. Above H=128, 32 keys a dK/dV
  program (its dK and dV accumulators: 2·32·256 f32 over 128 threads) and
  2 stages (NOTES.md B26, H100, H=256 4k training step: 35.0 -> 14.2 ms,
  causal 17.9 -> 7.8, against the FP32 tiles); there the blocks every row
  sees come first (``unmasked_first``; B28: causal step -4%).
  """
  del int8  # same tiles (INT8 dots need tiles >= 32, which these are)
  if itemsize > 2:
    return BackwardTiling(block_q=32, block_k=64, block_q_dq=64,
                          block_k_dq=32, num_warps=4, num_stages=1,
                          num_warps_dq=4, num_stages_dq=1)
  if head_dim > 128:
    return BackwardTiling(block_q=64, block_k=32, block_q_dq=64,
                          block_k_dq=64, num_warps=4, num_stages=2,
                          num_warps_dq=4, num_stages_dq=2,
                          unmasked_first=True)
  if head_dim <= 64:
    return BackwardTiling(block_q=64, block_k=128, block_q_dq=128,
                          block_k_dq=64, num_warps=4, num_stages=3,
                          num_warps_dq=4, num_stages_dq=3)
  return BackwardTiling(block_q=64, block_k=128, block_q_dq=128,
                        block_k_dq=64, num_warps=8, num_stages=2,
                        num_warps_dq=8, num_stages_dq=2)


def _fit_tiling(tiling: BackwardTiling, t: int, s: int, floor: int
                ) -> BackwardTiling:
  """Tiles no larger than the (power-of-two) lengths need, at least ``floor``."""
  tq, tk = max(floor, next_pow2(t)), max(floor, next_pow2(s))
  return dataclasses.replace(
      tiling, block_q=max(floor, min(tiling.block_q, tq)),
      block_k=max(floor, min(tiling.block_k, tk)),
      block_q_dq=max(floor, min(tiling.block_q_dq, tq)),
      block_k_dq=max(floor, min(tiling.block_k_dq, tk)))


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
  """``x`` padded with ``value`` along ``axis`` to ``size``."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def smoothed(x: jax.Array, lengths: Optional[jax.Array], layout: str,
             head_dim: int, size: int) -> tuple[jax.Array, jax.Array]:
  """K or V minus a mean of its valid tokens (:func:`sagejax.quant.
  sampled_mean`: the backward is exact for any fixed vector, and this one
  reads a few tokens), in its dtype and layout, padded to ``head_dim`` and
  ``size`` tokens; and the f32 mean ``[B, K, head_dim]``. ``lengths``: the
  call's (None: all tokens)."""
  t_ax = 1 if layout == "BTNH" else 2
  tokens = x.shape[t_ax]
  x = pad_axis(pad_axis(x, 3, head_dim), t_ax, size)
  mean = quant.sampled_mean(x, lengths, token_axis=t_ax, tokens=tokens)
  bcast = mean[:, None] if layout == "BTNH" else mean[:, :, None]
  return (x.astype(jnp.float32) - bcast).astype(x.dtype), mean


def pairwise(x: Optional[jax.Array], t_pad: int, s_pad: int, dtype
              ) -> Optional[jax.Array]:
  """A ``[B|1, N|1, T|1, S|1]`` mask/bias → ``[B|1, N|1, T_pad, S_pad]``.

  Padding is False / 0 (padded keys and rows are cut by the lengths anyway).
  """
  if x is None:
    return None
  b, n, t, s = x.shape
  x = jnp.broadcast_to(x, (b, n, t_pad if t == 1 else t,
                           s_pad if s == 1 else s))
  x = pad_axis(pad_axis(x, 2, t_pad), 3, s_pad)
  return x if dtype is None else x.astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prepared:
  """Quantized inputs plus what the attention kernel needs to run on them.

  ``mask`` (int8) and ``bias`` are the caller's, ``[B|1, N|1, T_pad, S_pad]``.
  ``q_raw``: Q as given (16-bit, the call's layout, padded) when the
  attention kernel quantizes it itself; ``qkv.q``, ``qkv.q_scale`` and
  ``qkv.lse_shift`` are then None and ``k_mean`` (f32 ``[B, K, H]``, or None
  without K smoothing) is what the kernel's LSE shift needs. ``v_layout``:
  ``qkv.v``'s layout when 16-bit (``"BTNH"``: the caller's V, read in place).
  ``centred_k``: (K − k̄ in the call's layout, padded as the K pass read it;
  k̄ f32 ``[B, K, H]``) where :func:`quantize_inputs` was asked for them.
  ``k_group_scales``: the Mosaic kernel's grouped K scales, written by the
  K pass where :func:`quantize_inputs` was asked for them.
  """
  qkv: quant.QuantizedQKV
  q_lengths: jax.Array
  kv_lengths: jax.Array
  mask: Optional[jax.Array] = None
  bias: Optional[jax.Array] = None
  q_raw: Optional[jax.Array] = None
  k_mean: Optional[jax.Array] = None
  v_layout: str = dataclasses.field(default="BNTH",
                                    metadata=dict(static=True))
  centred_k: Optional[tuple[jax.Array, jax.Array]] = None
  k_group_scales: Optional[jax.Array] = None


def v_read_in_place(call: ParsedCall, config: SageConfig, head_dim: int,
                    s_multiple: int) -> bool:
  """Whether a kernel may read the caller's V in place (16-bit P·V, e.g.
  the Mosaic forward under ``jax.grad``; benchmarks/NOTES.md B19): V
  already in the P·V dtype, unsmoothed, unpadded (``head_dim`` and a
  multiple of ``s_multiple`` keys) and without ``key_value_seq_lengths``
  (a masked key's NaN would reach the product). Else a pass copies it."""
  _, _, _, h, _, s = call.dims
  pv = quant.PV_OPERAND_DTYPES[config.pv_dtype]
  return (config.pv_dtype != "fp8_e4m3" and jnp.dtype(call.v.dtype) == pv
          and not config.smooth_v and call.kv_lengths is None
          and h == head_dim and s % s_multiple == 0)


def quantize_inputs(call: ParsedCall, config: SageConfig, *, head_dim: int,
                    t_multiple: int, s_multiple: int, v_transposed: bool,
                    v_store_dtype=None, v_wgmma_key_order: bool = False,
                    quantize_q: bool = True, v_in_place: bool = False,
                    centre_k: bool = False,
                    group_scale_keys: Optional[int] = None,
                    q_pass_rows: Optional[int] = None,
                    v_pass: Optional[tuple[int, int]] = None,
                    interpret: bool = False) -> Prepared:
  """Smooths and quantizes Q, K, V with the Pallas (Triton) kernels.

  The token axes are padded to multiples of ``t_multiple`` / ``s_multiple``
  (powers of two, at least the config's blocks) and the head dim to
  ``head_dim``. V is ``[B, K, S_pad, H]``, or ``[B, K, H, S_pad]`` with
  ``v_transposed`` (keys in the Mosaic kernel's order with
  ``v_wgmma_key_order``), stored as ``v_store_dtype`` (default: the config's
  P·V operand type). K's smoothing mean is sampled
  (:func:`sagejax.quant.sampled_mean`); V's reductions are one pass over V.
  ``quantize_q=False`` leaves Q to the attention kernel (``Prepared.q_raw``).
  ``v_in_place``: V as given (the call's layout: ``Prepared.v_layout``)
  instead of a copy, one read of V finding its non-finite channels; only
  where :func:`v_read_in_place` allows. ``centre_k``: the K pass also
  writes K − k̄ (``Prepared.centred_k``; K smoothing only), what the
  backward multiplies. ``group_scale_keys``: the K pass also writes the
  Mosaic kernel's grouped K scales for its steps of so many keys
  (``Prepared.k_group_scales``; :func:`triton_quantize.quantize_qk_pass`).
  ``q_pass_rows``: the most rows a program of the Q pass holds where Q's
  groups allow (:func:`triton_quantize.q_rows`; default ``block_q``).
  ``v_pass``: (values, warps) of a program of V's pass: ``values / head_dim``
  tokens (at least ``block_k``, dividing the padded keys; default
  ``block_k`` tokens on 4 warps).
  """
  b, n, t, h, kh, s = call.dims
  layout = call.layout
  t_ax, s_ax = (1, 1) if layout == "BTNH" else (2, 2)
  t_pad = -(-t // t_multiple) * t_multiple
  s_pad = -(-s // s_multiple) * s_multiple
  q = pad_axis(pad_axis(call.q, 3, head_dim), t_ax, t_pad)
  k = pad_axis(pad_axis(call.k, 3, head_dim), s_ax, s_pad)
  v = pad_axis(pad_axis(call.v, 3, head_dim), s_ax, s_pad)
  q_lengths = quant.valid_lengths(call.q_lengths, b, t)
  kv_lengths = quant.valid_lengths(call.kv_lengths, b, s)

  # K's smoothing mean from sampled tokens (quant.sampled_mean, XLA); V's
  # reductions over all tokens in one pass over V (V's max of the centred
  # values needs V's mean first: XLA then). V read in place: its
  # non-finite channels from the K pass, which reads V beside K (NOTES
  # B24: -0.6% on a 4k causal training step; the FP8 forward's maxima the
  # same way measured 0.3-0.9% slower end to end, so not there).
  fp8 = config.pv_dtype == "fp8_e4m3"
  k_mean = v_mean = v_amax = None
  if config.smooth_k:
    k_mean = quant.sampled_mean(k, call.kv_lengths, token_axis=s_ax,
                                tokens=s)
  if v_in_place and (v_transposed or v_store_dtype is not None
                     or not v_read_in_place(call, config, head_dim,
                                            s_multiple)):
    raise ValueError("v_in_place needs a 16-bit P·V in V's own dtype, "
                     "unpadded, unsmoothed, untransposed V and no "
                     "key_value_seq_lengths; pass v_in_place=False.")
  if centre_k and k_mean is None:
    raise ValueError("centre_k needs K smoothing (SageConfig.smooth_k).")
  # The K pass, the Q pass and V's statistics need only k̄: one launch
  # (triton_quantize.run_passes; NOTES Mosaic section 27), V's statistics
  # last, so that V's pass after it finds a short sequence's V in L2.
  passes = [triton_quantize.quantize_qk_pass(
      k, kv_lengths, k_mean, role="k", config=config, layout=layout,
      v=v if v_in_place else None, centred=centre_k,
      group_scale_keys=group_scale_keys, interpret=interpret)]
  # The Q pass also makes the LSE shift q·k̄ (no second read of Q).
  if quantize_q:
    passes.append(triton_quantize.quantize_qk_pass(
        q, q_lengths, None, role="q", config=config, layout=layout,
        scale_mult=call.sm_scale * quant.LOG2E, k_mean=k_mean,
        shift_mult=call.sm_scale,
        rows=triton_quantize.q_rows(config, head_dim, q_pass_rows),
        interpret=interpret))
  statistics = config.smooth_v or fp8
  if statistics:
    passes.append(triton_quantize.token_statistics_pass(
        k, v, kv_lengths, layout=layout, k_mean=False,
        v_mean=config.smooth_v, v_amax=fp8 and not config.smooth_v))
  results = triton_quantize.run_passes(passes, interpret)
  k_vals, k_scale, _, _, v_amax, k_centred, k_grouped = results[0]
  if statistics:
    _, v_mean, v_amax = results[-1]
  if fp8:
    if v_amax is None:
      centred = to_canonical(v, layout).astype(jnp.float32)
      centred = centred - v_mean[..., None, :]
      v_amax = quant.abs_max(quant.zero_padding(centred, kv_lengths),
                             axis=-2)
    v_scale = quant.scale_from_amax(v_amax, quant.FP8_MAX)
  else:  # ones, NaN for a non-finite channel (from the V kernel below)
    v_scale = jnp.ones((b, kh, head_dim), jnp.float32)

  q_vals = q_scale = q_bmean = lse_shift = None
  if quantize_q:
    q_vals, q_scale, q_bmean, lse_shift, *_ = results[1]
  if v_in_place:  # V as given; +inf max |V| marks a non-finite channel
    v_vals = v
    v_scale = jnp.where(v_amax < jnp.inf, v_scale, jnp.nan)
  else:
    v_block, v_warps = config.block_k, 4
    if v_pass is not None:
      v_block = math.gcd(max(v_block, v_pass[0] // head_dim), s_pad)
      v_warps = v_pass[1]
    v_vals = triton_quantize.quantize_v(
        v, kv_lengths, v_mean, v_scale, config=config, layout=layout,
        transpose=v_transposed, store_dtype=v_store_dtype,
        wgmma_key_order=v_wgmma_key_order, interpret=interpret,
        return_nonfinite=not fp8, block=v_block, num_warps=v_warps)
    if not fp8:
      v_vals, nonfinite = v_vals
      v_scale = jnp.where(jnp.max(nonfinite, axis=2) > 0, jnp.nan, v_scale)
  delta_s = None
  if q_bmean is not None:
    k_smoothed = to_canonical(k, layout).astype(jnp.float32)
    if k_mean is not None:
      k_smoothed = k_smoothed - k_mean[..., None, :]
    delta_s = quant.delta_scores(
        q_bmean, quant.zero_padding(k_smoothed, kv_lengths), call.sm_scale)
  if lse_shift is not None:
    lse_shift = lse_shift[:, :, :t]
  qkv = quant.QuantizedQKV(q=q_vals, q_scale=q_scale, k=k_vals,
                           k_scale=k_scale, v=v_vals, v_scale=v_scale,
                           v_mean=v_mean, delta_s=delta_s, lse_shift=lse_shift)
  return Prepared(qkv=qkv, q_lengths=q_lengths, kv_lengths=kv_lengths,
                  mask=pairwise(call.mask, t_pad, s_pad, jnp.int8),
                  bias=pairwise(call.bias, t_pad, s_pad, None),
                  q_raw=None if quantize_q else q,
                  k_mean=None if quantize_q else k_mean,
                  v_layout=layout if v_in_place else "BNTH",
                  centred_k=(k_centred, k_mean) if centre_k else None,
                  k_group_scales=k_grouped)


class _PallasTritonBackend:
  name = "pallas"
  platform = "cuda"
  min_compute_capability = 8.0
  custom_call_targets = ("__gpu$xla.gpu.triton",)  # for jax.export
  # config=None / "auto" (README, "Default preset"). On an H200 sage1 is both
  # faster than sage2-8b (412 vs 397 TOPS end to end, S=4k, H=128, issue 12:
  # the FP8 P̃·V runs on FP16 tensor cores here, so FP8 buys no speed) and
  # more accurate (relative L1 0.013 vs 0.038 on normal data, 0.00020 vs
  # 0.00154 channel bias; RESULTS.md). sage2-4b is less accurate than both.
  # benchmarks/preset_sweep.py re-measures it (4k and 16k).
  default_preset = "sage1"

  def __init__(self, interpret: bool = False, fp8_on_fp16_mma: bool = True,
               backward_tiling: Optional[BackwardTiling] = None):
    """``fp8_on_fp16_mma``: keep FP8-quantized P̃ and V but multiply them on
    FP16 tensor cores (exact: e4m3 ⊂ fp16). Triton's 8-bit operand path moves
    P̃ through shared memory every block; this is faster (benchmarks/NOTES.md).
    ``backward_tiling``: backward kernel tiles instead of
    :func:`default_backward_tiling` (for measurement).
    """
    self.interpret = interpret
    self.fp8_on_fp16_mma = fp8_on_fp16_mma
    self.backward_tiling = backward_tiling

  def available(self) -> bool:
    if self.interpret:
      return True
    cc = gpu_compute_capability()
    return cc is not None and not cc < 8.0  # a GPU that does not say: try

  def unsupported(self, call: ParsedCall, config: SageConfig
                  ) -> Optional[str]:
    _, _, _, h, _, _ = call.dims
    if call.sm_scale <= 0:
      return "the kernel needs a positive scale"
    if config.pv_dtype == "fp8_e4m3" and config.pv_accumulation == "fp32":
      return ("Triton dots start each block from a fresh accumulator, so the "
              "kernel always accumulates fp32+fp32; pass "
              "pv_accumulation='fp32+fp32'")
    if config.qk_dtype == "int4" and next_pow2(h) < 64:
      return ("INT4 needs head dim >= 33 (each packed half is an INT8 dot "
              "whose contraction must be >= 32 on the GPU)")
    if next_pow2(h) < 32:
      return "head dims below 17 are padded to 32 only by the 'xla' path"
    return None

  def prepare(self, call: ParsedCall, config: SageConfig,
              tiling: Optional[KernelTiling] = None) -> Prepared:
    """Smooths and quantizes Q, K, V with the Pallas quantization kernels.

    Token axes are padded to multiples of both the config's blocks and the
    kernel's tiles (all powers of two).
    """
    _, _, t, h, _, s = call.dims
    hp = max(32, next_pow2(h))
    tiling = tiling or default_tiling(hp, config)
    fp8_mma = config.pv_dtype == "fp8_e4m3" and not self.fp8_on_fp16_mma
    return quantize_inputs(
        call, config, head_dim=hp,
        t_multiple=max(config.block_q, min(tiling.block_q, next_pow2(t))),
        s_multiple=max(config.block_k, min(tiling.block_k, next_pow2(s))),
        v_transposed=fp8_mma,
        v_store_dtype=(jnp.float16 if config.pv_dtype == "fp8_e4m3"
                       and not fp8_mma else None),
        interpret=self.interpret)

  def kernel(self, prepared: Prepared, call: ParsedCall, config: SageConfig,
             tiling: Optional[KernelTiling] = None):
    """The attention kernel alone on prepared inputs: (output, lse)."""
    b, n, t, h, kh, s = call.dims
    if tiling is None:
      tiling = default_tiling(max(32, next_pow2(h)), config)
      if call.spec.is_causal and -(-t // tiling.block_q) <= 32:
        # Short causal: launch each head's blocks together, longest first
        # (1k: +8% at H=128, +23% at H=64; neutral to -3% at 16k).
        tiling = dataclasses.replace(tiling, heads_outer=True,
                                     heavy_first=True)
      if prepared.mask is not None or prepared.bias is not None:
        # Mask/bias tiles share the pipeline's shared memory (an f32 bias
        # tile is 4x a K tile): 128x128 with 3 stages needs 257 KiB > 227.
        tiling = dataclasses.replace(
            tiling, block_k=min(tiling.block_k, 64), num_stages=2)
    if prepared.qkv.delta_s is not None:
      tiling = dataclasses.replace(
          tiling, block_q=min(tiling.block_q, config.block_q))
    cap, shift = call.logits_soft_cap, prepared.qkv.lse_shift
    row_shift = None
    if cap is not None and shift is not None:  # added before the cap
      row_shift = pad_axis(shift, 2, prepared.qkv.q.shape[2])
    out, lse = triton_attention.attention_forward(
        prepared.qkv, call.spec, q_lengths=prepared.q_lengths,
        kv_lengths=prepared.kv_lengths, config_block_q=config.block_q,
        out_dtype=call.q.dtype, out_layout=call.layout,
        v_transposed=prepared.qkv.v.dtype == quant.FP8_DTYPE,
        p_fp8=config.pv_dtype == "fp8_e4m3",
        int4=config.qk_dtype == "int4", tiling=tiling, mask=prepared.mask,
        bias=prepared.bias, logits_soft_cap=cap, row_shift=row_shift,
        interpret=self.interpret)
    if call.layout == "BTNH":
      out = out[:, :t, :, :h]
    else:
      out = out[:, :, :t, :h]
    lse = lse[:, :, :t]
    if shift is not None and cap is None:
      lse = lse + shift
    return out, lse

  def forward(self, call: ParsedCall, config: SageConfig
              ) -> tuple[jax.Array, jax.Array]:
    return self.kernel(self.prepare(call, config), call, config)

  def backward_unsupported(self, call: ParsedCall, config: SageConfig
                           ) -> Optional[str]:
    del call, config
    return None

  def backward(self, call: ParsedCall, config: SageConfig, d_out: jax.Array,
               d_lse: Optional[jax.Array],
               saved: Optional[tuple[jax.Array, jax.Array]],
               tiling: Optional[BackwardTiling] = None):
    """Gradients of exact attention by the backward kernels
    (:mod:`sagejax.kernels.triton_backward`); see
    :class:`sagejax.backends.BackwardBackend`."""
    b, n, t, h, kh, s = call.dims
    hp = max(32, next_pow2(h))
    int8 = config.backward_int8
    tiling = tiling or self.backward_tiling or default_backward_tiling(
        hp, int8, jnp.dtype(call.q.dtype).itemsize)
    tiling = _fit_tiling(tiling, t, s, 32 if int8 else 16)
    bq = max(tiling.block_q, tiling.block_q_dq)
    bk = max(tiling.block_k, tiling.block_k_dq)
    t_pad, s_pad = -(-t // bq) * bq, -(-s // bk) * bk
    layout = call.layout
    t_ax = 1 if layout == "BTNH" else 2

    def pad(x, size):
      return pad_axis(pad_axis(x, 3, hp), t_ax, size)

    q_lengths = quant.valid_lengths(call.q_lengths, b, t)
    kv_lengths = quant.valid_lengths(call.kv_lengths, b, s)
    cap = call.logits_soft_cap
    if cap is None:  # K smoothed (K − k̄) in its dtype; lse₂ of its logits
      kc, k_mean = smoothed(call.k, call.kv_lengths, layout, hp, s_pad)
      shift = quant.lse_shift(
          quant.zero_padding(to_canonical(call.q, layout), call.q_lengths),
          k_mean[..., :h], call.sm_scale)
    else:  # capped logits are not shift invariant: K as it is (k̄ for
      # the saved statistics' dQ correction only: quant.capped_dq_shift)
      kc = pad(call.k, s_pad)
      k_mean = quant.sampled_mean(kc, call.kv_lengths, token_axis=t_ax,
                                  tokens=s)
      shift = jnp.zeros((b, n, t), jnp.float32)
    q, v, do = pad(call.q, t_pad), pad(call.v, s_pad), pad(d_out, t_pad)
    vec = lambda x, value=0.0: pad_axis(x.astype(jnp.float32), 2, t_pad,
                                         value)
    out = lse = None
    if saved is not None and saved[0] is not None:  # else recompute
      out, lse = pad(saved[0].astype(q.dtype), t_pad), vec(saved[1], -jnp.inf)
    int8_ops = None
    if int8:  # (capped: K unsmoothed)
      int8_ops = self._int8_operands(
          q, pad(call.k, s_pad), do,
          k_mean if cap is None else jnp.zeros_like(k_mean), q_lengths,
          kv_lengths, layout, tiling)
    dbias_shape = None
    if call.bias is not None:
      bb, bn, bt, bs = call.bias.shape
      dbias_shape = (bb, bn, t_pad if bt > 1 else 1, s_pad if bs > 1 else 1)
    dq, dk, dv, dbias = triton_backward.attention_backward(
        q, kc, v, do, k_mean=k_mean, lse_shift=vec(shift),
        q_lengths=q_lengths, kv_lengths=kv_lengths, spec=call.spec,
        sm_scale=call.sm_scale, layout=layout, out=out, lse=lse,
        d_lse=None if d_lse is None else vec(d_lse),
        mask=pairwise(call.mask, t_pad, s_pad, jnp.int8),
        bias=pairwise(call.bias, t_pad, s_pad, None),
        dbias_shape=dbias_shape, int8=int8_ops, tiling=tiling,
        interpret=self.interpret, logits_soft_cap=cap)
    if layout == "BTNH":
      dq, dk, dv = dq[:, :t, :, :h], dk[:, :s, :, :h], dv[:, :s, :, :h]
    else:
      dq, dk, dv = dq[:, :, :t, :h], dk[:, :, :s, :h], dv[:, :, :s, :h]
    if dbias is not None:
      bt, bs = call.bias.shape[2:]
      dbias = dbias[:, :, :bt, :bs].astype(call.bias.dtype)
    return dq, dk.astype(call.k.dtype), dv, dbias

  def _int8_operands(self, q, k, do, k_mean, q_lengths, kv_lengths, layout,
                     tiling: BackwardTiling) -> triton_backward.Int8Operands:
    """SageBwd's INT8 Q, smoothed K and dO, per block of the tile that
    contracts each (Q, dO: the dK/dV kernel's query tile; K: the tile of dS·K)."""
    block_k = tiling.block_k if tiling.dq_atomic else tiling.block_k_dq
    per_block = SageConfig(qk_granularity="per_block", block_q=tiling.block_q,
                           block_k=block_k, num_warps=1, pv_dtype="fp16",
                           pv_accumulation="fp32")
    quantize = functools.partial(triton_quantize.quantize_qk,
                                 config=per_block, layout=layout,
                                 interpret=self.interpret)
    q8, qs = quantize(q, q_lengths, None, role="q")[:2]
    k8, ks = quantize(k, kv_lengths, k_mean, role="k")[:2]
    do8, dos = quantize(do, q_lengths, None, role="q")[:2]
    return triton_backward.Int8Operands(q=q8, q_scale=qs, k=k8, k_scale=ks,
                                        do=do8, do_scale=dos)


BACKEND = _PallasTritonBackend()
# Same kernels run by the Pallas interpreter: for CPU tests, not for users.
INTERPRET_BACKEND = _PallasTritonBackend(interpret=True)

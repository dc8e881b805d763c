"""The ``"pallas"`` backend: Pallas kernels lowered through Triton (sm80+).

Three quantization kernels (:mod:`sagejax.kernels.triton_quantize`) read Q, K
and V in the caller's layout and write the quantized tensors; XLA computes the
few reductions over all tokens (K's mean, V's mean and per-channel max) and,
for smoothed Q, ΔS. The fused attention kernel
(:mod:`sagejax.kernels.triton_attention`) writes the output straight into the
caller's layout.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from sagejax import quant
from sagejax._inputs import ParsedCall, to_canonical
from sagejax.config import SageConfig
from sagejax.kernels import triton_attention, triton_quantize
from sagejax.kernels._common import next_pow2
from sagejax.kernels.triton_attention import KernelTiling


def default_tiling(head_dim: int, config: SageConfig) -> KernelTiling:
  """Kernel tiles by head dim (measured on H100/H200; benchmarks/NOTES.md)."""
  if head_dim <= 64:
    return KernelTiling(block_q=128, block_k=64, num_warps=4, num_stages=4)
  if head_dim <= 128:
    return KernelTiling(block_q=128, block_k=128, num_warps=8, num_stages=3)
  return KernelTiling(block_q=64, block_k=32, num_warps=4, num_stages=2)


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def _pairwise(x: Optional[jax.Array], t_pad: int, s_pad: int, dtype
              ) -> Optional[jax.Array]:
  """A ``[B|1, N|1, T|1, S|1]`` mask/bias → ``[B|1, N|1, T_pad, S_pad]``.

  Padding is False / 0 (padded keys and rows are cut by the lengths anyway).
  """
  if x is None:
    return None
  b, n, t, s = x.shape
  x = jnp.broadcast_to(x, (b, n, t_pad if t == 1 else t,
                           s_pad if s == 1 else s))
  x = _pad_axis(_pad_axis(x, 2, t_pad), 3, s_pad)
  return x if dtype is None else x.astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prepared:
  """Quantized inputs plus what the attention kernel needs to run on them.

  ``mask`` (int8) and ``bias`` are the caller's, ``[B|1, N|1, T_pad, S_pad]``.
  """
  qkv: quant.QuantizedQKV
  q_lengths: jax.Array
  kv_lengths: jax.Array
  mask: Optional[jax.Array] = None
  bias: Optional[jax.Array] = None


def quantize_inputs(call: ParsedCall, config: SageConfig, *, head_dim: int,
                    t_multiple: int, s_multiple: int, v_transposed: bool,
                    v_store_dtype=None, v_wgmma_key_order: bool = False,
                    interpret: bool = False) -> Prepared:
  """Smooths and quantizes Q, K, V with the Pallas (Triton) kernels.

  The token axes are padded to multiples of ``t_multiple`` / ``s_multiple``
  (powers of two, at least the config's blocks) and the head dim to
  ``head_dim``. V is ``[B, K, S_pad, H]``, or ``[B, K, H, S_pad]`` with
  ``v_transposed`` (keys in the Mosaic kernel's order with
  ``v_wgmma_key_order``), stored as ``v_store_dtype`` (default: the config's
  P·V operand type). XLA computes the reductions over all tokens.
  """
  b, n, t, h, kh, s = call.dims
  layout = call.layout
  t_ax, s_ax = (1, 1) if layout == "BTNH" else (2, 2)
  t_pad = -(-t // t_multiple) * t_multiple
  s_pad = -(-s // s_multiple) * s_multiple
  q = _pad_axis(_pad_axis(call.q, 3, head_dim), t_ax, t_pad)
  k = _pad_axis(_pad_axis(call.k, 3, head_dim), s_ax, s_pad)
  v = _pad_axis(_pad_axis(call.v, 3, head_dim), s_ax, s_pad)
  q_lengths = quant.valid_lengths(call.q_lengths, b, t)
  kv_lengths = quant.valid_lengths(call.kv_lengths, b, s)

  # Reductions over all tokens (XLA, fused with the transposes).
  k_mean = None
  k_canon = to_canonical(k, layout)
  if config.smooth_k:
    k_mean = quant.token_mean(k_canon, kv_lengths)
  v_canon = to_canonical(v, layout)
  v_mean = quant.token_mean(v_canon, kv_lengths) if config.smooth_v else None
  if config.pv_dtype == "fp8_e4m3":
    centred = v_canon.astype(jnp.float32)
    if v_mean is not None:
      centred = centred - v_mean[..., None, :]
    v_scale = quant.scale_from_amax(
        jnp.max(jnp.abs(quant.zero_padding(centred, kv_lengths)), axis=-2),
        quant.FP8_MAX)
  else:
    v_scale = jnp.ones((b, kh, head_dim), jnp.float32)

  q_vals, q_scale, q_bmean = triton_quantize.quantize_qk(
      q, q_lengths, None, role="q", config=config, layout=layout,
      scale_mult=call.sm_scale * quant.LOG2E, interpret=interpret)
  k_vals, k_scale, _ = triton_quantize.quantize_qk(
      k, kv_lengths, k_mean, role="k", config=config, layout=layout,
      interpret=interpret)
  v_vals = triton_quantize.quantize_v(
      v, kv_lengths, v_mean, v_scale, config=config, layout=layout,
      transpose=v_transposed, store_dtype=v_store_dtype,
      wgmma_key_order=v_wgmma_key_order, interpret=interpret)
  delta_s = None
  if q_bmean is not None:
    k_smoothed = k_canon.astype(jnp.float32)
    if k_mean is not None:
      k_smoothed = k_smoothed - k_mean[..., None, :]
    delta_s = quant.delta_scores(
        q_bmean, quant.zero_padding(k_smoothed, kv_lengths), call.sm_scale)
  lse_shift = None
  if k_mean is not None:
    lse_shift = quant.lse_shift(to_canonical(call.q, layout), k_mean,
                                call.sm_scale)
  qkv = quant.QuantizedQKV(q=q_vals, q_scale=q_scale, k=k_vals,
                           k_scale=k_scale, v=v_vals, v_scale=v_scale,
                           v_mean=v_mean, delta_s=delta_s, lse_shift=lse_shift)
  return Prepared(qkv=qkv, q_lengths=q_lengths, kv_lengths=kv_lengths,
                  mask=_pairwise(call.mask, t_pad, s_pad, jnp.int8),
                  bias=_pairwise(call.bias, t_pad, s_pad, None))


class _PallasTritonBackend:
  name = "pallas"

  def __init__(self, interpret: bool = False, fp8_on_fp16_mma: bool = True):
    """``fp8_on_fp16_mma``: keep FP8-quantized P̃ and V but multiply them on
    FP16 tensor cores (exact: e4m3 ⊂ fp16). Triton's 8-bit operand path moves
    P̃ through shared memory every block; this is faster (benchmarks/NOTES.md).
    """
    self.interpret = interpret
    self.fp8_on_fp16_mma = fp8_on_fp16_mma

  def available(self) -> bool:
    if self.interpret:
      return True
    try:
      device = jax.devices()[0]
    except RuntimeError:
      return False
    if device.platform != "gpu":
      return False
    cc = getattr(device, "compute_capability", None)
    try:
      return cc is None or float(cc) >= 8.0
    except (TypeError, ValueError):
      return True

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
    out, lse = triton_attention.attention_forward(
        prepared.qkv, call.spec, q_lengths=prepared.q_lengths,
        kv_lengths=prepared.kv_lengths, config_block_q=config.block_q,
        out_dtype=call.q.dtype, out_layout=call.layout,
        v_transposed=prepared.qkv.v.dtype == quant.FP8_DTYPE,
        p_fp8=config.pv_dtype == "fp8_e4m3",
        int4=config.qk_dtype == "int4", tiling=tiling, mask=prepared.mask,
        bias=prepared.bias, interpret=self.interpret)
    if call.layout == "BTNH":
      out = out[:, :t, :, :h]
    else:
      out = out[:, :, :t, :h]
    lse = lse[:, :, :t]
    if prepared.qkv.lse_shift is not None:
      lse = lse + prepared.qkv.lse_shift
    return out, lse

  def forward(self, call: ParsedCall, config: SageConfig
              ) -> tuple[jax.Array, jax.Array]:
    return self.kernel(self.prepare(call, config), call, config)


BACKEND = _PallasTritonBackend()
# Same kernels run by the Pallas interpreter: for CPU tests, not for users.
INTERPRET_BACKEND = _PallasTritonBackend(interpret=True)

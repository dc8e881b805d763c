"""The ``"mosaic"`` backend: a Pallas Mosaic GPU kernel for Hopper (sm90).

The attention kernel (:mod:`sagejax.kernels.mosaic_attention`) runs INT8
Q·Kᵀ and FP8 P·V on Hopper's ``wgmma`` tensor cores with TMA loads and
warp-specialised, ping-ponged consumer warpgroups. Inputs are quantized by
the Pallas quantization kernels of the ``"pallas"`` backend, with V stored
transposed and in the kernel's key order.

Calls it does not serve (``unsupported`` says why, and ``implementation=None``
then picks the ``"pallas"`` backend): user ``mask``/``bias`` arrays, head dims
above 128, a negative ``scale``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from sagejax import quant
from sagejax._inputs import ParsedCall
from sagejax.backends._device import gpu_compute_capability
from sagejax.backends.pallas_triton import Prepared, quantize_inputs
from sagejax.config import SageConfig
from sagejax.kernels._common import next_pow2
from sagejax.kernels.mosaic_attention import MosaicTiling, attention_forward

MAX_HEAD_DIM = 128


def default_tiling(head_dim: int, config: SageConfig) -> MosaicTiling:
  """Kernel tiles by head dim (benchmarks/NOTES.md)."""
  del config
  if head_dim <= 64:
    return MosaicTiling(block_kv=128, num_stages=3)
  return MosaicTiling(block_kv=128, num_stages=2)


def _is_hopper() -> bool:
  cc = gpu_compute_capability()
  return cc is not None and 9.0 <= cc < 10.0  # NaN (unknown): not Hopper


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
    return _is_hopper()

  def unsupported(self, call: ParsedCall, config: SageConfig
                  ) -> Optional[str]:
    _, _, _, h, _, _ = call.dims
    if call.mask is not None or call.bias is not None:
      return ("user mask/bias arrays are read in tiles by the 'pallas' "
              "backend only; pass is_causal/local_window_size/*_seq_lengths "
              "where they express the mask")
    if call.sm_scale <= 0:
      return "the kernel needs a positive scale"
    if call.logits_soft_cap is not None:
      return "logits_soft_cap is applied by the 'pallas' backend only"
    if h > MAX_HEAD_DIM:
      return (f"head dims above {MAX_HEAD_DIM} do not fit the kernel's "
              "registers and shared memory; the 'pallas' backend serves them")
    if config.smooth_q and config.block_q % 128:
      return "smoothed Q needs SageConfig.block_q a multiple of 128"
    return None

  def prepare(self, call: ParsedCall, config: SageConfig,
              tiling: Optional[MosaicTiling] = None) -> Prepared:
    """Quantizes Q, K, V for the kernel (INT4 unpacked to INT8 values:
    Hopper has no 4-bit tensor cores)."""
    _, _, _, h, _, _ = call.dims
    hp = max(64, next_pow2(h))
    tiling = tiling or default_tiling(hp, config)
    fp8 = config.pv_dtype == "fp8_e4m3"
    prepared = quantize_inputs(
        call, config, head_dim=hp,
        t_multiple=max(config.block_q, 2 * tiling.block_q),
        s_multiple=max(config.block_k, tiling.block_kv),
        v_transposed=fp8, v_wgmma_key_order=fp8)
    if config.qk_dtype == "int4":
      qkv = prepared.qkv
      prepared = dataclasses.replace(prepared, qkv=dataclasses.replace(
          qkv, q=quant.unpack_int4(qkv.q), k=quant.unpack_int4(qkv.k)))
    return prepared

  def kernel(self, prepared: Prepared, call: ParsedCall, config: SageConfig,
             tiling: Optional[MosaicTiling] = None):
    """The attention kernel alone on prepared inputs: (output, lse)."""
    b, n, t, h, _, _ = call.dims
    qkv = prepared.qkv
    tiling = tiling or default_tiling(qkv.q.shape[-1], config)
    out, lse = attention_forward(
        qkv.q, qkv.q_scale, qkv.k, qkv.k_scale, qkv.v, qkv.v_scale,
        qkv.v_mean, qkv.delta_s, call.spec, q_lengths=prepared.q_lengths,
        kv_lengths=prepared.kv_lengths, config_block_q=config.block_q,
        out_dtype=call.q.dtype, out_layout=call.layout,
        pv_two_level=config.pv_accumulation == "fp32+fp32", tiling=tiling)
    if call.layout == "BTNH":
      out = out[:, :t, :, :h]
    else:
      out = out[:, :, :t, :h]
    lse = lse[:, :, :t]
    if qkv.lse_shift is not None:
      lse = lse + qkv.lse_shift
    return out, lse

  def forward(self, call: ParsedCall, config: SageConfig
              ) -> tuple[jax.Array, jax.Array]:
    return self.kernel(self.prepare(call, config), call, config)


BACKEND = _MosaicBackend()

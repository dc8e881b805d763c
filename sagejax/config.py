"""Quantization configuration: what is quantized, how, and at what granularity.

A :class:`SageConfig` fixes the *math* of one SageAttention variant. It is
frozen and hashable, so it can be passed as a static argument under
``jax.jit``. Kernel tuning (tile sizes, warps, pipelining) lives with each
backend, not here; ``block_q``, ``block_k`` and ``num_warps`` are part of the
math because they define the quantization groups and the granularity of the
two-level P·V accumulation.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Union

import jax.numpy as jnp

QKDtype = Literal["int8", "int4"]
Granularity = Literal["per_block", "per_warp", "per_thread", "per_token"]
PVDtype = Literal["fp8_e4m3", "fp16", "bf16"]
PVAccumulation = Literal["fp32+fp32", "fp32"]
BackwardStats = Literal["auto", "saved", "recompute"]

QK_DTYPES = ("int8", "int4")
GRANULARITIES = ("per_block", "per_warp", "per_thread", "per_token")
PV_DTYPES = ("fp8_e4m3", "fp16", "bf16")
PV_ACCUMULATIONS = ("fp32+fp32", "fp32")
BACKWARD_STATS = ("auto", "saved", "recompute")

# Rows of a Q block that share a per-thread scale are those with the same
# index mod THREAD_ROW_GROUPS inside a warp's rows (SageAttention2, A.6).
THREAD_ROW_GROUPS = 8
# Keys of a K block that share a per-thread scale: same (index mod 8) // 2.
THREAD_KEY_PERIOD = 8
THREAD_KEY_GROUPS = 4


def _is_pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class SageConfig:
  """The quantization scheme of one SageAttention variant.

  Attributes:
    qk_dtype: integer type of the quantized Q and K: ``"int8"`` (±127) or
      ``"int4"`` (±7, stored two values per byte).
    qk_granularity: which tokens share a Q/K scale. ``"per_block"``: one scale
      per Q block of ``block_q`` rows and per K block of ``block_k`` rows.
      ``"per_warp"``: one per ``block_q // num_warps`` rows of a Q block (K stays
      per block). ``"per_thread"``: SageAttention2 appendix A.6 groups, see
      :func:`sagejax.quant.token_groups`. ``"per_token"``: one per row.
    pv_dtype: operand type of the P·V product: ``"fp8_e4m3"`` (P with the static
      scale 448, V per channel), ``"fp16"`` or ``"bf16"``.
    pv_accumulation: ``"fp32+fp32"``: each KV block's P·V is computed on its own
      and added into an FP32 accumulator (two-level); ``"fp32"``: the running
      accumulator is fed to the block product directly. With FP8 operands the
      Hopper/Ada MMA keeps only ~22 bits of it, which the ``"xla"`` oracle
      emulates (13 mantissa bits, truncated, after each block).
    smooth_k: subtract K's mean over tokens (exact: softmax is shift invariant).
    smooth_q: subtract each Q block's mean; the correction ΔS = q̄·γ(K)ᵀ is
      added back to the scores in full precision.
    smooth_v: subtract V's mean over tokens; added back to the output.
    block_q: rows of a Q block (quantization groups, kernel tile).
    block_k: rows of a K block (quantization groups, accumulation block).
    num_warps: warps that share a Q block (per-warp and per-thread groups).
    backward_stats: where a kernel backward (``jax.grad``) takes the softmax
      statistics from. ``"recompute"``: exact LSE and δ = rowsum(dO ∘ O)
      from a 16-bit forward pass run by the backward (the cost of one more
      forward). ``"saved"``: the quantized forward's own output and LSE, as
      FlashAttention does: no extra pass, but the forward's error enters δ.
      ``"auto"`` (default): ``"saved"`` where that was measured to keep the
      gradients at cos ≥ 0.999 of exact ones on normal and channel-outlier
      data (INT8 Q·Kᵀ with 16-bit P·V), else ``"recompute"``; and a config
      with INT8 Q·Kᵀ and FP8 P·V (``sage2-8b``) runs its P·V in 16 bits in
      a forward that a kernel backward follows (:meth:`differentiated`), so
      that it too takes the saved statistics (benchmarks/NOTES.md, B1 and
      B7). Under a logit soft cap the rows of dS ∘ (1 − tanh²) do not sum
      to dLSE, so δ's error would reach dQ times K's mean (cos 0.996 on
      channel-outlier K; NOTES.md B37): saved statistics then take two row
      sums more, which cancel it (:func:`sagejax.quant.capped_dq_shift`;
      cos ≥ 0.99999, NOTES.md B39). The ``"xla"`` backward always
      recomputes exactly.
    backward_int8: SageBwd's 8-bit backward (SageAttention3, arXiv
      2505.11594): the kernel backward's Q·Kᵀ recomputation and its Pᵀ·dO,
      dSᵀ·Q and dS·K products in INT8 with per-block scales (Q, K smoothed,
      dO per block of rows; P and dS per tile), dO·Vᵀ in 16 bits. Off by
      default; its gradient error is measured in benchmarks/NOTES.md.
  """

  qk_dtype: QKDtype = "int8"
  qk_granularity: Granularity = "per_thread"
  pv_dtype: PVDtype = "fp8_e4m3"
  pv_accumulation: PVAccumulation = "fp32+fp32"
  smooth_k: bool = True
  smooth_q: bool = False
  smooth_v: bool = False
  block_q: int = 128
  block_k: int = 64
  num_warps: int = 4
  backward_stats: BackwardStats = "auto"
  backward_int8: bool = False

  def __post_init__(self):
    def check(field, value, allowed):
      if value not in allowed:
        raise ValueError(
            f"SageConfig.{field} must be one of {allowed}, got {value!r}.")

    check("qk_dtype", self.qk_dtype, QK_DTYPES)
    check("qk_granularity", self.qk_granularity, GRANULARITIES)
    check("pv_dtype", self.pv_dtype, PV_DTYPES)
    check("pv_accumulation", self.pv_accumulation, PV_ACCUMULATIONS)
    check("backward_stats", self.backward_stats, BACKWARD_STATS)
    for field in ("smooth_k", "smooth_q", "smooth_v", "backward_int8"):
      if not isinstance(getattr(self, field), bool):
        raise ValueError(
            f"SageConfig.{field} must be True or False, got "
            f"{getattr(self, field)!r}.")
    for field in ("block_q", "block_k", "num_warps"):
      value = getattr(self, field)
      if not isinstance(value, int) or not _is_pow2(value):
        raise ValueError(
            f"SageConfig.{field} must be a power of two, got {value!r}.")
    if self.num_warps > 8:
      raise ValueError(
          f"SageConfig.num_warps must be one of (1, 2, 4, 8), got "
          f"{self.num_warps}.")
    if self.block_q < 16 or self.block_k < 16:
      raise ValueError(
          "SageConfig.block_q and block_k must be at least 16, got "
          f"block_q={self.block_q}, block_k={self.block_k}.")
    if self.block_q % (self.num_warps * THREAD_ROW_GROUPS):
      raise ValueError(
          f"SageConfig.block_q={self.block_q} must be a multiple of "
          f"num_warps * {THREAD_ROW_GROUPS} = "
          f"{self.num_warps * THREAD_ROW_GROUPS} so that every warp owns whole "
          "per-thread groups; pass a larger block_q or fewer num_warps.")

  @property
  def qmax(self) -> int:
    """Largest magnitude of the symmetric integer grid (127 or 7)."""
    return 127 if self.qk_dtype == "int8" else 7

  @property
  def saved_stats(self) -> bool:
    """Whether a kernel backward uses the forward's output and LSE
    (``backward_stats`` with ``"auto"`` resolved)."""
    if self.backward_stats != "auto":
      return self.backward_stats == "saved"
    return self.qk_dtype == "int8" and (self.pv_dtype != "fp8_e4m3"
                                        or self.smooth_v)

  def differentiated(self, dtype=None) -> "SageConfig":
    """The config of a forward under ``jax.grad`` that a kernel backward
    follows, for inputs of ``dtype``.

    With ``backward_stats="auto"``, INT8 Q·Kᵀ and FP8 P·V, the P·V product
    runs in 16 bits (FP16 for float16 inputs, else BF16, so that V never
    overflows where the input does not; FP32 accumulation, as ``sage1``):
    the FP8 rounding of P̃ and V would otherwise enter δ = rowsum(dO ∘ O)
    through the saved output (gradient cos down to 0.994 on outlier data),
    and exact statistics cost the backward a pass of two more products. The
    output then differs from the plain forward's by quantization noise
    only, and is more accurate. Per-thread and per-warp Q groups then span
    16-row warps (``num_warps = block_q // 16``, SageAttention2's own sm90
    geometry; finer groups, no less accurate), which the Hopper kernel
    quantizes in its prologue instead of a pass over Q (benchmarks/NOTES.md,
    B21). Other configs are unchanged.
    """
    if (self.backward_stats == "auto" and self.qk_dtype == "int8"
        and self.pv_dtype == "fp8_e4m3"):
      fp16 = dtype is not None and jnp.dtype(dtype) == jnp.float16
      changes = dict(pv_dtype="fp16" if fp16 else "bf16",
                     pv_accumulation="fp32")
      warps = self.block_q // 16
      if (self.qk_granularity in ("per_thread", "per_warp")
          and self.block_q % 16 == 0 and warps in (1, 2, 4, 8)):
        changes["num_warps"] = warps
      return self.replace(**changes)
    return self

  @property
  def rows_per_warp(self) -> int:
    return self.block_q // self.num_warps

  def replace(self, **changes) -> "SageConfig":
    return dataclasses.replace(self, **changes)


PRESETS: dict[str, SageConfig] = {
    # SageAttention: INT8 per-block Q·Kᵀ, smoothed K, FP16 P·V.
    "sage1": SageConfig(
        qk_dtype="int8", qk_granularity="per_block", pv_dtype="fp16",
        pv_accumulation="fp32", smooth_k=True),
    # SageAttention2, 8-bit: INT8 per-thread Q·Kᵀ, FP8 P·V, two-level accum.
    "sage2-8b": SageConfig(
        qk_dtype="int8", qk_granularity="per_thread", pv_dtype="fp8_e4m3",
        pv_accumulation="fp32+fp32", smooth_k=True),
    # SageAttention2, 4-bit: INT4 per-thread Q·Kᵀ with smoothed Q and K.
    "sage2-4b": SageConfig(
        qk_dtype="int4", qk_granularity="per_thread", pv_dtype="fp8_e4m3",
        pv_accumulation="fp32+fp32", smooth_k=True, smooth_q=True),
}

# config=None or "auto": each backend's own default preset (the one no other
# preset beats on both speed and accuracy there; sagejax.backends).
AUTO = "auto"

ConfigLike = Union[SageConfig, str]


def resolve_config(config: ConfigLike | None = None, backend=None
                   ) -> SageConfig:
  """Returns the :class:`SageConfig` for a config or preset name.

  ``None`` or ``"auto"`` means the default preset of ``backend`` (a backend
  object or its name, e.g. ``"pallas"``; None: the first backend available on
  this machine), see :func:`sagejax.backends.default_preset`. Named presets
  mean the same on every backend.
  """
  if config is None or (isinstance(config, str) and config == AUTO):
    from sagejax import backends  # pylint: disable=import-outside-toplevel
    return PRESETS[backends.default_preset(backend)]
  if isinstance(config, SageConfig):
    return config
  if isinstance(config, str):
    try:
      return PRESETS[config]
    except KeyError:
      raise ValueError(
          f"Unknown config {config!r}: pass a SageConfig, one of the presets "
          f"{tuple(PRESETS)} or 'auto' / None (the backend's default)."
      ) from None
  raise TypeError(
      f"config must be a SageConfig or a preset name {tuple(PRESETS)} (or "
      f"'auto' / None: the backend's default), got {type(config).__name__}.")

"""What the local accelerator is, for the backends' ``available()``."""

from __future__ import annotations

import math

import jax


def gpu_compute_capability() -> float | None:
  """The first device's compute capability if it is a GPU, else None.

  NaN for a GPU that does not report one (or reports something unparsable).
  """
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return None
  if device.platform != "gpu":
    return None
  try:
    return float(getattr(device, "compute_capability", "nan"))
  except (TypeError, ValueError):
    return math.nan


def is_hopper() -> bool:
  """Whether the first device is an sm90 GPU (NaN, unknown: not Hopper)."""
  cc = gpu_compute_capability()
  return cc is not None and 9.0 <= cc < 10.0


def sm_count(default: int = 132) -> int:
  """Streaming multiprocessors of the first device (its ``core_count``), or
  ``default`` (an H100's or H200's 132) when it reports none."""
  try:
    sms = int(getattr(jax.devices()[0], "core_count", 0) or 0)
  except (RuntimeError, TypeError, ValueError):
    sms = 0
  return sms if sms > 1 else default

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

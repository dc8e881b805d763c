"""The machine a benchmark runs on: its name, memory and cache size."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from typing import Any, Optional

import jax

import sagejax

# L2 cache per GPU (MiB), rounded up: rotating inputs must not stay in it.
_L2_MIB = (("h200", 60), ("h100", 60), ("h800", 60), ("gh200", 60),
           ("b200", 128), ("b100", 128), ("a100", 40), ("l40", 96),
           ("l4", 48), ("a10", 6))
_DEFAULT_GPU_L2_MIB = 64
_CPU_CACHE_MIB = 32


def device() -> jax.Device:
  return jax.devices()[0]


def is_gpu() -> bool:
  return device().platform == "gpu"


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown CPU"


def device_name() -> str:
  """A human-readable name of the first device, e.g. ``NVIDIA H200``."""
  d = device()
  if d.platform == "cpu":
    return f"{_cpu_model()} (CPU, {os.cpu_count()} cores)"
  return d.device_kind


def _memory_stats() -> Optional[dict[str, Any]]:
  try:
    return device().memory_stats()
  except Exception:  # pylint: disable=broad-except  # not every client has it
    return None


def _available_ram() -> Optional[int]:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def memory_limit() -> Optional[int]:
  """Bytes the device may allocate (host RAM available on CPU), or None."""
  stats = _memory_stats()
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  if device().platform == "cpu":
    return _available_ram()
  return None


def peak_bytes_in_use() -> Optional[int]:
  """The process-wide peak of device memory so far (GPU), or None."""
  stats = _memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"])
  return None


def bytes_in_use() -> Optional[int]:
  stats = _memory_stats()
  if stats and "bytes_in_use" in stats:
    return int(stats["bytes_in_use"])
  return None


def l2_bytes() -> int:
  """L2 size of the device (an upper bound from a table), or a CPU default."""
  d = device()
  if d.platform == "cpu":
    return _CPU_CACHE_MIB * 2**20
  kind = d.device_kind.lower()
  for name, mib in _L2_MIB:
    if name in kind:
      return mib * 2**20
  return _DEFAULT_GPU_L2_MIB * 2**20


def run_info(argv: list[str]) -> dict[str, Any]:
  """What a result is worth nothing without: device, versions, date."""
  import jaxlib  # pylint: disable=import-outside-toplevel
  d = device()
  return {
      "device": device_name(),
      "platform": d.platform,
      "device_kind": d.device_kind,
      "device_count": jax.device_count(),
      "memory_limit_bytes": memory_limit(),
      "l2_bytes": l2_bytes(),
      "jax_version": jax.__version__,
      "jaxlib_version": getattr(jaxlib, "__version__", "unknown"),
      "sagejax_version": sagejax.__version__,
      "python": sys.version.split()[0],
      "date": datetime.datetime.now(datetime.timezone.utc).strftime(
          "%Y-%m-%d %H:%M UTC"),
      "command": "sagejax-bench " + " ".join(argv),
  }


def fmt_bytes(n: Optional[float]) -> str:
  """``1536`` → ``'1.5 KiB'``; None → ``'–'``."""
  if n is None:
    return "–"
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} TiB"

"""Timing compiled JAX functions without fooling oneself.

* Compilation and a first call happen before any clock starts.
* Each repeat enqueues ``calls`` back-to-back dispatches on rotating input
  sets (together more than ~2× the L2 cache, so no call finds its inputs
  cached by the previous one), then blocks once; the device executes a
  stream in order, so the last result being ready means all are.
* The figure is the median over repeats of (repeat time / calls).
* ``clock="device"`` takes a repeat's time from a profiler trace instead
  (:mod:`sagejax.bench.device_time`): the device's span of the repeat's
  kernels, without the host's dispatch latency and wait (GPU only).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Sequence

import jax

from sagejax.bench import device_time


@dataclasses.dataclass(frozen=True)
class TimingConfig:
  """How long and how often to measure.

  Attributes:
    repeats: repeats whose median is reported.
    target_s: wall time one repeat should take (sets ``calls``).
    min_calls, max_calls: bounds on dispatches per repeat.
    l2_bytes: cache size the rotating inputs must exceed (twice).
    max_sets: bound on the number of rotating input sets.
    sync_each_output: block on every output, not only the last (for
      clients that may run dispatches concurrently, like the CPU).
    clock: ``"wall"`` (host clock around each repeat) or ``"device"``
      (each repeat's device span in one profiler trace; GPU only).
  """
  repeats: int = 5
  target_s: float = 0.1
  min_calls: int = 10
  max_calls: int = 200
  l2_bytes: int = 64 * 2**20
  max_sets: int = 16
  sync_each_output: bool = False
  clock: str = "wall"

  def __post_init__(self):
    if self.clock not in ("wall", "device"):
      raise ValueError(f"clock={self.clock!r}: pass 'wall' or 'device'.")


@dataclasses.dataclass(frozen=True)
class Timing:
  median_s: float
  min_s: float
  calls: int
  repeats: int
  input_sets: int


def tree_bytes(tree: Any) -> int:
  """Total bytes of the arrays (or ShapeDtypeStructs) in a pytree."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      total += math.prod(leaf.shape) * leaf.dtype.itemsize
  return total


def rotating_sets(set_bytes: int, config: TimingConfig) -> int:
  """Input sets so that together they exceed twice the L2 (at least 1)."""
  if set_bytes <= 0:
    return 1
  sets = math.ceil(2 * config.l2_bytes / set_bytes)
  return max(1, min(config.max_sets, sets))


def time_calls(fn: Callable[..., Any], arg_sets: Sequence[tuple],
               config: TimingConfig) -> Timing:
  """Median seconds per call of ``fn(*arg_sets[i % len(arg_sets)])``.

  ``fn`` should be compiled already (``jax.jit(f).lower(...).compile()``);
  it is called once more on each set as a warm-up.
  """
  n = len(arg_sets)
  for args in arg_sets:
    jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  jax.block_until_ready(fn(*arg_sets[0]))
  single = max(time.perf_counter() - start, 1e-7)
  calls = math.ceil(config.target_s / single)
  calls = max(config.min_calls, n, min(config.max_calls, calls))
  if config.clock == "device":
    per_call = device_time.interleaved({"fn": fn}, arg_sets, config.repeats,
                                       calls)["fn"]
    return Timing(median_s=statistics.median(per_call), min_s=min(per_call),
                  calls=calls, repeats=config.repeats, input_sets=n)
  per_call = []
  for _ in range(config.repeats):
    outs = []
    start = time.perf_counter()
    for i in range(calls):
      out = fn(*arg_sets[i % n])
      if config.sync_each_output:
        outs.append(out)
    jax.block_until_ready(outs if config.sync_each_output else out)
    per_call.append((time.perf_counter() - start) / calls)
  return Timing(median_s=statistics.median(per_call), min_s=min(per_call),
                calls=calls, repeats=config.repeats, input_sets=n)

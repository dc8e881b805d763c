"""Memory: device memory each method needs at one long sequence.

Reported two ways: XLA's compiled memory analysis (arguments + outputs +
temporaries − aliases: the planned peak, on every platform that has it) and,
on a GPU, the measured rise of ``peak_bytes_in_use`` over the memory in use
before the call. That peak is process-wide and never resets, so methods run
in increasing order of planned memory; a method whose peak stays below an
earlier one's gets no measured figure.
"""

from __future__ import annotations

from typing import Any

import jax

from sagejax.bench import env
from sagejax.bench.methods import Method, Skip, one_line
from sagejax.bench.progress import Task
from sagejax.bench.settings import Settings
from sagejax.bench.speed import (InputPool, base_row, check_fits,
                                 compile_method, compiled_memory)


def _plan(method: Method, pool: InputPool, settings: Settings,
          compiled: dict[str, Any]) -> list[dict[str, Any]]:
  shape = settings.memory_shape
  row = base_row(method, shape)
  row.update(status="ok", note=None)
  try:
    fn, _, args = compile_method(method, shape, pool)
    mem = compiled_memory(fn)
    if mem is None:
      raise Skip("no compiled memory analysis on this platform")
    row.update(mem)
    check_fits(mem["total_bytes"], settings.memory_limit, method.label)
    compiled[method.key] = (mem["total_bytes"], fn, args, row)
  except Skip as e:
    row.update(status="skipped", note=str(e))
  except Exception as e:  # pylint: disable=broad-except  # one line, go on
    row.update(status="error", note=one_line(e))
  return [row]


def _measure_peaks(compiled: dict[str, Any]) -> list[dict[str, Any]]:
  """Runs the planned methods, smallest first, and records peak rises."""
  if env.peak_bytes_in_use() is None:
    compiled.clear()
    return []
  for _, fn, args, row in sorted(compiled.values(), key=lambda x: x[0]):
    before_peak = env.peak_bytes_in_use()
    in_use = env.bytes_in_use() or 0
    try:
      jax.block_until_ready(fn(*args))
    except Exception as e:  # pylint: disable=broad-except
      row.update(status="error", note=one_line(e))
      continue
    after = env.peak_bytes_in_use()
    if after is not None and before_peak is not None and after > before_peak:
      row["measured_peak_bytes"] = after - in_use
    else:
      row["note"] = "peak below an earlier method's; not measured"
  compiled.clear()
  return []


def tasks(settings: Settings, methods: list[Method]) -> list[Task]:
  """Plan every end-to-end method, then measure the peaks (GPU)."""
  pool = InputPool(settings.seed)
  compiled: dict[str, Any] = {}
  out = [Task("memory", f"memory {m.label} S={settings.memory_shape.seq}",
              lambda m=m: _plan(m, pool, settings, compiled))
         for m in methods if m.mode == "end_to_end"]
  out.append(Task("memory", "memory: measure peaks",
                  lambda: _measure_peaks(compiled)))
  out.append(Task("memory", "memory: free inputs",
                  lambda: (pool.clear(), [])[1]))
  return out

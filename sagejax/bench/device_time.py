"""Seconds per call measured on the device, from a JAX profiler trace.

Wall-clock timing of a block of calls adds what the host does around the
device's work: the first dispatch's latency, the final wait, and any gap a
slow dispatch leaves. Here each block of back-to-back calls is followed by
a wait and an idle gap, the whole run is traced once, and a block's time
is its device span: from its first kernel's start to its last kernel's
end, gaps between its kernels included.

The device's clock depends on its power draw: on an H100 at its 700 W
cap, cuDNN's dense bf16 attention ran at ~1.5-1.67 GHz in blocks of 200
calls and near 1.98 GHz in blocks of 20 with idle between
(benchmarks/NOTES.md, Mosaic §25). Short blocks measure speed at full
clocks; long ones, sustained throughput.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

Event = tuple[str, float, float]  # (name, start µs, duration µs)


def _gpu_records(trace_dir: str) -> list[dict]:
  """The raw trace events of :func:`gpu_events`, by start time."""
  paths = sorted(
      glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"),
                recursive=True) +
      glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                recursive=True))
  if not paths:
    return []
  with gzip.open(paths[-1], "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  gpu_pids = set()
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      name = str(e.get("args", {}).get("name", ""))
      if re.search(r"GPU|gpu|/device:", name) and "host" not in name.lower():
        gpu_pids.add(e["pid"])
  out = []
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e:
      name = str(e.get("name", "?"))
      if name.startswith("$") or "Stream" in name or (
          "Memcpy" in name and "DtoD" not in name):
        continue
      out.append(e)
  return sorted(out, key=lambda e: float(e.get("ts", 0)))


def gpu_events(trace_dir: str) -> list[Event]:
  """The GPU kernels and device-to-device copies of the newest trace under
  ``trace_dir`` (``jax.profiler.trace(..., create_perfetto_trace=True)``),
  by start time."""
  return [(str(e.get("name", "?")), float(e.get("ts", 0)), float(e["dur"]))
          for e in _gpu_records(trace_dir)]


def _gap_groups(events: Sequence[tuple], gap_us: float) -> list[list]:
  """``events`` (``(name, start µs, duration µs, ...)``, by start time) in
  groups that idle gaps longer than ``gap_us`` separate."""
  groups: list[list] = []
  end = None
  for event in events:
    ts, dur = event[1], event[2]
    if end is None or ts - end > gap_us:
      groups.append([])
      end = ts + dur
    groups[-1].append(event)
    end = max(end, ts + dur)
  return groups


def module_blocks(trace_dir: str, gap_us: float
                  ) -> list[dict[str, dict[str, float]]]:
  """Per group of GPU events that idle gaps longer than ``gap_us`` separate
  (a block of calls, as in :func:`block_spans`): µs of kernel time by XLA
  module (the trace's ``hlo_module``, e.g. ``jit_attend``) and kernel name,
  ``{module: {kernel: µs}}``. Where one jitted function's kernels run among
  others' (a model's layers), this is that function's own device time."""
  events = [(str(r.get("name", "?")), float(r.get("ts", 0)), float(r["dur"]),
             str(r.get("args", {}).get("hlo_module", "?")))
            for r in _gpu_records(trace_dir)]
  blocks = []
  for group in _gap_groups(events, gap_us):
    kernels: dict[str, dict[str, float]] = {}
    for name, _, dur, module in group:
      per_module = kernels.setdefault(module, {})
      per_module[name] = per_module.get(name, 0.0) + dur
    blocks.append(kernels)
  return blocks


def block_spans(events: Sequence[Event], gap_us: float
                ) -> list[tuple[float, int]]:
  """(span in µs from first start to last end, event count) of each group
  of ``events`` that idle gaps longer than ``gap_us`` separate."""
  return [(max(ts + dur for _, ts, dur in group) - group[0][1], len(group))
          for group in _gap_groups(events, gap_us)]


def round_orders(names: Sequence[str], rounds: int, seed: int = 0
                 ) -> list[list[str]]:
  """The order of ``names`` in each of ``rounds`` rounds: a seeded random
  permutation each, so that no function always follows the same one.

  (A rotation, the order before, keeps the cyclic order: one function then
  follows the same other in almost every round. On an H200 a forward timed
  right after cuDNN's, whose power draw lowers the clocks for longer than
  the 30 ms gap, read 2-7% slower at 4k and H=64 16k: benchmarks/NOTES.md,
  Mosaic section 52.)"""
  rng = np.random.default_rng(seed)
  return [[names[i] for i in rng.permutation(len(names))]
          for _ in range(rounds)]


def interleaved(fns: Mapping[str, Callable[..., Any]],
                arg_sets: Sequence[tuple], rounds: int, calls: int,
                gap_s: float = 0.03) -> dict[str, list[float]]:
  """Device seconds per call of each of ``fns`` (compiled and warmed up),
  one value per round: ``rounds`` rounds of a block of ``calls`` calls of
  each function in turn (in each round's order of :func:`round_orders`),
  call ``i`` of a block on ``arg_sets[i % len(arg_sets)]``, each block
  waited for and followed by ``gap_s`` of idle, all in one profiler trace.
  A drift of the device's clocks, and what one function's blocks leave of
  it for the next, then fall on every function alike.

  Raises RuntimeError where the trace holds no GPU kernels (a CPU backend),
  or where its idle gaps do not split it into the blocks that ran.
  """
  names = list(fns)
  order = []
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for round_order in round_orders(names, rounds):
        for name in round_order:
          out = None
          for i in range(calls):
            out = fns[name](*arg_sets[i % len(arg_sets)])
          jax.block_until_ready(out)
          time.sleep(gap_s)
          order.append(name)
    events = gpu_events(d)
  if not events:
    raise RuntimeError("the profiler trace holds no GPU kernels: device "
                       "time needs a GPU; time with clock='wall' instead.")
  # Fewer events than calls is not a block: a stray event (the profiler's
  # own copies) in a gap.
  blocks = [span for span, count in block_spans(events, gap_s * 1e6 / 3)
            if count >= calls]
  if len(blocks) != len(order):
    raise RuntimeError(f"{len(blocks)} blocks of kernels in the trace for "
                       f"{len(order)} timed: a call idles the device for "
                       f"more than {gap_s / 3:.3f} s; pass a larger gap_s.")
  per_call: dict[str, list[float]] = {name: [] for name in names}
  for name, span_us in zip(order, blocks):
    per_call[name].append(span_us * 1e-6 / calls)
  return per_call

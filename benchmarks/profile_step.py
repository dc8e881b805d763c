"""Where a step's device time goes: per-kernel times from the JAX profiler.

  PYTHONPATH=$PWD python benchmarks/profile_step.py --out $OUT \
      [--shapes "B,S,N,H,causal;..."] [--steps train,forward,cudnn-train,...]

For each shape and step (``train``: ``value_and_grad`` through
``sagejax.attention``, default config and implementation; ``forward``: the
forward alone; ``cudnn-train`` / ``cudnn-forward``: the same through
``jax.nn.dot_product_attention(implementation="cudnn")``), compiles and warms
up, then runs ``--calls`` back-to-back calls under ``jax.profiler.trace``
and sums the GPU kernels' durations by name (from the Perfetto trace).
Prints one table per step (ms per call, share of the step) and writes the
rows to ``profile_step.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp

import sagejax
from sagejax import testing


def step_fn(kind: str, causal: bool):
  cudnn = kind.startswith("cudnn")

  def attend(q, k, v):
    if cudnn:
      return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                          implementation="cudnn")
    return sagejax.attention(q, k, v, is_causal=causal)

  if kind.endswith("forward"):
    return jax.jit(lambda q, k, v, do: attend(q, k, v))

  def loss(q, k, v, do):
    out = attend(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

  return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


def kernel_times(trace_dir: str, calls: int
                 ) -> dict[str, tuple[float, int]]:
  """{kernel name: (total µs, count)} of the GPU events in the trace; a
  kernel launched k times per call is split into its k launches (#1..#k)."""
  path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"),
                          recursive=True) +
                glob.glob(os.path.join(trace_dir, "**",
                                       "perfetto_trace.json.gz"),
                          recursive=True))[-1]
  with gzip.open(path, "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  gpu_pids = set()
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      name = str(e.get("args", {}).get("name", ""))
      if re.search(r"GPU|gpu|/device:", name) and "host" not in name.lower():
        gpu_pids.add(e["pid"])
  if not gpu_pids:
    print("no GPU process in the trace; processes:",
          sorted({str(e.get("args", {}).get("name")) for e in events
                  if e.get("name") == "process_name"})[:20])
  runs: dict[str, list] = collections.defaultdict(list)  # (ts, dur)
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e:
      name = str(e.get("name", "?"))
      if name.startswith("$") or "Stream" in name or (
          "Memcpy" in name and "DtoD" not in name):
        continue
      runs[name].append((float(e.get("ts", 0)), float(e["dur"])))
  totals = {}
  for name, items in runs.items():
    items.sort()
    per_call = max(1, round(len(items) / calls))
    if per_call == 1 or len(items) % per_call:
      totals[name] = (sum(d for _, d in items), len(items))
      continue
    for i in range(per_call):  # the i-th launch of this kernel in a call
      ds = [d for _, d in items[i::per_call]]
      totals[f"{name} #{i + 1}"] = (sum(ds), len(ds))
  return totals


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="profile_out")
  p.add_argument("--shapes", default="2,4096,32,128,0")
  p.add_argument("--steps", default="train,cudnn-train,forward,cudnn-forward")
  p.add_argument("--calls", type=int, default=10)
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  rows = []
  for shape in args.shapes.split(";"):
    b, s, n, h, causal = (int(x) for x in shape.split(","))
    q, k, v = testing.make_qkv(jax.random.PRNGKey(0), b, s, s, n, n, h,
                               "normal", jnp.bfloat16)
    do = jax.random.normal(jax.random.PRNGKey(1), q.shape, jnp.bfloat16)
    for kind in args.steps.split(","):
      fn = step_fn(kind, bool(causal))
      try:
        jax.block_until_ready(fn(q, k, v, do))
        jax.block_until_ready(fn(q, k, v, do))
        t0 = time.perf_counter()
        for _ in range(args.calls):
          r = fn(q, k, v, do)
        jax.block_until_ready(r)
        wall_ms = (time.perf_counter() - t0) / args.calls * 1e3
        with tempfile.TemporaryDirectory() as d:
          with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(args.calls):
              r = fn(q, k, v, do)
            jax.block_until_ready(r)
          times = kernel_times(d, args.calls)
      except Exception as e:  # pylint: disable=broad-except
        print(f"{kind} {shape}: {type(e).__name__}: {e}"[:400], flush=True)
        continue
      total = sum(t for t, _ in times.values()) / args.calls / 1e3
      print(f"\n## {kind}  B,S,N,H,causal={shape}: wall {wall_ms:.3f} ms, "
            f"kernels {total:.3f} ms per call", flush=True)
      for name, (t, c) in sorted(times.items(), key=lambda x: -x[1][0]):
        ms = t / args.calls / 1e3
        if ms < 0.002:
          continue
        print(f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  x{max(1, c // args.calls):<3d}"
              f" {name[:110]}")
        rows.append(dict(kind=kind, shape=shape, kernel=name, ms=ms,
                         count=c / args.calls, wall_ms=wall_ms))
  with open(os.path.join(args.out, "profile_step.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f,
              indent=1)


if __name__ == "__main__":
  main()

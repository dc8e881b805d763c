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
rows to ``profile_step.json`` under ``--out``. With ``--rounds R``, then
times the shape's steps against each other by device time
(:func:`sagejax.bench.device_time.interleaved`: one trace, R rounds of blocks of
``--calls`` calls, the steps in turn; host dispatch and synchronization
stay out) and prints each step's median ms per call, with the ratio to its
cuDNN counterpart. ``--soft-cap C`` caps the logits of the sagejax steps
(cuDNN's have no cap); a step named ``...-uncapped`` (``train-uncapped``)
is the sagejax step without it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import sagejax
from sagejax import testing
from sagejax.bench import device_time


def step_fn(kind: str, causal: bool, soft_cap: float | None = None):
  cudnn = kind.startswith("cudnn")
  if kind.endswith("-uncapped"):
    kind, soft_cap = kind[:-len("-uncapped")], None

  def attend(q, k, v):
    if cudnn:
      return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                          implementation="cudnn")
    return sagejax.attention(q, k, v, is_causal=causal,
                             logits_soft_cap=soft_cap)

  if kind.endswith("forward"):
    return jax.jit(lambda q, k, v, do: attend(q, k, v))

  def loss(q, k, v, do):
    out = attend(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

  return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


def kernel_times(trace_dir: str, calls: int
                 ) -> tuple[dict[str, tuple[float, int]], float]:
  """{kernel name: (total µs, count)} of the GPU events in the trace (a
  kernel launched k times per call is split into its k launches, #1..#k),
  and the µs from the first event's start to the last one's end (the
  kernels' sum and this span differ by the device's idle gaps)."""
  events = device_time.gpu_events(trace_dir)
  runs: dict[str, list] = collections.defaultdict(list)  # (ts, dur)
  for name, ts, dur in events:
    runs[name].append((ts, dur))
  span = (max(ts + d for _, ts, d in events) - events[0][1]) if events else 0.0
  totals = {}
  for name, items in runs.items():
    per_call = max(1, round(len(items) / calls))
    if per_call == 1 or len(items) % per_call:
      totals[name] = (sum(d for _, d in items), len(items))
      continue
    for i in range(per_call):  # the i-th launch of this kernel in a call
      ds = [d for _, d in items[i::per_call]]
      totals[f"{name} #{i + 1}"] = (sum(ds), len(ds))
  return totals, span


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="profile_out")
  p.add_argument("--shapes", default="2,4096,32,128,0")
  p.add_argument("--steps", default="train,cudnn-train,forward,cudnn-forward")
  p.add_argument("--calls", type=int, default=10)
  p.add_argument("--rounds", type=int, default=0,
                 help="then time the steps by device span, interleaved: "
                      "this many rounds of --calls calls a step")
  p.add_argument("--no-kernels", action="store_true",
                 help="skip the per-kernel tables")
  p.add_argument("--soft-cap", type=float, default=None,
                 help="logits_soft_cap of the sagejax steps")
  p.add_argument("--min-ms", type=float, default=0.002,
                 help="list kernels taking at least this long a call")
  p.add_argument("--hlo", action="store_true",
                 help="also write each step's optimized HLO under --out")
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  rows, spans = [], []
  for shape in args.shapes.split(";"):
    b, s, n, h, causal = (int(x) for x in shape.split(","))
    q, k, v = testing.make_qkv(jax.random.PRNGKey(0), b, s, s, n, n, h,
                               "normal", jnp.bfloat16)
    do = jax.random.normal(jax.random.PRNGKey(1), q.shape, jnp.bfloat16)
    fns = {}
    for kind in args.steps.split(","):
      fn = step_fn(kind, bool(causal), args.soft_cap)
      try:
        jax.block_until_ready(fn(q, k, v, do))
        jax.block_until_ready(fn(q, k, v, do))
      except Exception as e:  # pylint: disable=broad-except
        print(f"{kind} {shape}: {type(e).__name__}: {e}"[:400], flush=True)
        continue
      fns[kind] = fn
      if args.hlo:
        name = f"{kind}_{shape.replace(',', '_')}.hlo.txt"
        with open(os.path.join(args.out, name), "w") as f:
          f.write(fn.lower(q, k, v, do).compile().as_text())
      if args.no_kernels:
        continue
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
        times, span = kernel_times(d, args.calls)
      total = sum(t for t, _ in times.values()) / args.calls / 1e3
      span_ms = span / args.calls / 1e3
      print(f"\n## {kind}  B,S,N,H,causal={shape}: wall {wall_ms:.3f} ms, "
            f"kernels {total:.3f} ms per call, device span {span_ms:.3f} ms "
            f"(idle {span_ms - total:.3f})", flush=True)
      for name, (t, c) in sorted(times.items(), key=lambda x: -x[1][0]):
        ms = t / args.calls / 1e3
        if ms < args.min_ms:
          continue
        print(f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  x{max(1, c // args.calls):<3d}"
              f" {name[:110]}")
        rows.append(dict(kind=kind, shape=shape, kernel=name, ms=ms,
                         count=c / args.calls, wall_ms=wall_ms,
                         span_ms=span_ms))
    if args.rounds and fns:
      per_call = {kind: [t * 1e3 for t in ts] for kind, ts in
                  device_time.interleaved(fns, [(q, k, v, do)], args.rounds,
                                          args.calls).items()}
      med = {kind: float(np.median(ts)) for kind, ts in per_call.items()}
      line = "  ".join(
          f"{kind} {ms:.3f}" + (f" ({med['cudnn-' + kind] / ms:.3f}x cuDNN)"
                                if "cudnn-" + kind in med else "")
          for kind, ms in med.items())
      print(f"\n## device ms per call, interleaved, median of {args.rounds} "
            f"blocks of {args.calls}, B,S,N,H,causal={shape}: {line}",
            flush=True)
      spans.append(dict(shape=shape, per_call_ms=per_call, median_ms=med))
  with open(os.path.join(args.out, "profile_step.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows,
                   interleaved=spans, soft_cap=args.soft_cap), f, indent=1)


if __name__ == "__main__":
  main()

"""Where a Mosaic attention kernel's KV step goes, per warpgroup, in clocks.

    PYTHONPATH=$PWD python benchmarks/kernel_profile.py --out $OUT \
        [--shapes "1,1,16384,128,0"] [--kernel-variants "bkv=256;overlap=1"]

Runs the kernel once with Mosaic GPU's on-device profiler
(``attention_forward(profile_dir=)``: ``%clock`` stamps around the named
regions of the consumer step — ``qk``, ``softmax`` (its phases nested),
``wait_v``, ``pv`` (with ``wait_k`` inside), ``accumulate``; once a query
tile ``wait_q``, ``epilogue`` and, persistent with turns,
``epilogue_meeting`` — and the producer's ``wait_*_free``) on
a grid of about one wave, and prints the mean clocks per KV step of each
region and warpgroup, beside the unprofiled kernel's time on the same shape
(the stamps constrain ptxas's schedule, so the profiled step is slower),
and each consumer's step period by position in its query tile. Writes
``kernel_profile.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from sagejax import _inputs, testing
from sagejax.backends import mosaic
from sagejax.bench import timing

import mosaic_check  # noqa: E402  (benchmarks/ is the script's directory)

# Regions entered once per query tile (persistent kernels: several a CTA).
TILE_REGIONS = ("wait_q", "epilogue", "epilogue_meeting")


def _warpgroup_events(trace_path: str, consumers: int):
  """(role, its events in time order) per warpgroup of every CTA in a
  trace: tid 1 + warpgroup + (consumers + 1) · CTA, ``consumers`` consumer
  warpgroups then the producer."""
  names = [f"consumer {i}" for i in range(consumers)] + ["producer"]
  with open(trace_path) as f:
    events = json.load(f)["traceEvents"]
  per_tid = collections.defaultdict(list)
  for e in events:
    per_tid[e["tid"]].append(e)
  return [(names[(tid - 1) % len(names)], evs)
          for tid, evs in per_tid.items()]


def region_clocks(trace_path: str, consumers: int = 2) -> dict:
  """Per warpgroup role (``consumers`` consumer warpgroups and a producer
  per CTA): mean clocks per CTA spent in each region (nested regions
  counted in themselves and their parent), the mean CTA span, and the
  number of region entries per CTA."""
  totals = collections.defaultdict(lambda: collections.defaultdict(float))
  counts = collections.defaultdict(lambda: collections.defaultdict(int))
  spans = collections.defaultdict(list)
  for role, evs in _warpgroup_events(trace_path, consumers):
    stack = []
    for e in evs:  # in time order, ts in µs of %clock cycles (1e3 / µs)
      if e["ph"] == "B":
        stack.append(e)
      else:
        b = stack.pop()
        totals[role][e["name"]] += (e["ts"] - b["ts"]) * 1e3
        counts[role][e["name"]] += 1
    spans[role].append((evs[-1]["ts"] - evs[0]["ts"]) * 1e3)
  n_ctas = {r: len(v) for r, v in spans.items()}
  return {role: dict(span=float(np.mean(spans[role])),
                     regions={k: v / n_ctas[role] for k, v in regs.items()},
                     entries={k: v / n_ctas[role]
                              for k, v in counts[role].items()})
          for role, regs in totals.items()}


def step_periods(trace_path: str, consumers: int, steps: int) -> dict:
  """Per consumer role: the mean clocks from one KV step's ``qk`` stamp to
  the next, by the later step's position in its query tile (``steps`` a
  tile; position 0 spans a tile end: the epilogue and the next tile's
  start). Persistent grids with several tiles a CTA show what a tile end
  costs beside a steady step (benchmarks/NOTES.md, Mosaic section 48)."""
  periods = collections.defaultdict(lambda: collections.defaultdict(list))
  for role, evs in _warpgroup_events(trace_path, consumers):
    ts = [e["ts"] * 1e3 for e in evs if e["name"] == "qk" and e["ph"] == "B"]
    for i in range(1, len(ts)):
      periods[role][i % steps].append(ts[i] - ts[i - 1])
  return {role: [float(np.mean(by[p])) if by[p] else None
                 for p in range(steps)]
          for role, by in sorted(periods.items())}


def profile_case(shape, tiling_spec: str, key, cfg) -> dict:
  b, n, s, h, causal = shape
  q, k, v = testing.make_qkv(key, b, s, s, n, n, h, "normal", jnp.bfloat16,
                             "BTNH")
  call = _inputs.parse(q, k, v, is_causal=causal)
  # No spec: the backend's choice for this call.
  tiling, config = mosaic_check.parse_variant(tiling_spec or "default")
  tiling = mosaic_check.resolve_tiling(tiling, call, config)
  backend = mosaic.BACKEND
  prepared = jax.jit(lambda q, k, v: backend.prepare(
      _inputs.parse(q, k, v, is_causal=causal), config, tiling))(q, k, v)
  plain = jax.jit(lambda p: backend.kernel(p, call, config, tiling))
  t = timing.time_calls(plain, [(prepared,)], cfg)
  steps = s // tiling.block_kv
  result = dict(shape=shape, tiling=tiling_spec or "backend default",
                kernel_ms=t.median_s * 1e3, kv_steps=steps)
  with tempfile.TemporaryDirectory() as d:
    profiled = jax.jit(lambda p: backend.kernel(p, call, config, tiling,
                                                profile_dir=d))
    out = np.asarray(profiled(prepared)[0], np.float32)  # one trace
    jax.effects_barrier()  # the trace is written by a host callback
    ref = np.asarray(plain(prepared)[0], np.float32)
    result["profiled_vs_plain_rel_l2"] = testing.error_metrics(
        out, ref)["rel_l2"]
    traces = sorted(glob.glob(os.path.join(d, "*-trace.json")))
    result["warpgroups"] = region_clocks(traces[-1], tiling.num_consumers)
    result["step_period_by_position"] = step_periods(
        traces[-1], tiling.num_consumers, steps)
  return result


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="bench_out")
  parser.add_argument("--shapes", default="1,1,16384,128,0;1,1,16384,64,0",
                      help="';'-separated B,N,S,H,causal (about one wave of "
                      "CTAs: B·N·S/128 near the SM count)")
  parser.add_argument("--kernel-variants", default="",
                      help="';'-separated tilings as mosaic_check.py takes")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  dev = jax.devices()[0]
  print(dict(jax=jax.__version__, device=dev.device_kind), flush=True)
  cfg = timing.TimingConfig(repeats=5, target_s=0.05)
  key = jax.random.key(int(time.time()))
  shapes = [tuple(int(x) for x in sh.split(",")) for sh in
            args.shapes.split(";")]
  variants = [""] + list(filter(None, args.kernel_variants.split(";")))
  results = []
  for b, n, s, h, c in shapes:
    for spec in variants:
      key, sub = jax.random.split(key)
      r = profile_case((b, n, s, h, bool(c)), spec, sub, cfg)
      results.append(r)
      print(json.dumps(r), flush=True)
  with open(os.path.join(args.out, "kernel_profile.json"), "w") as f:
    json.dump(dict(device=dev.device_kind, results=results), f, indent=1)
  names = ("qk", "softmax", "convert", "logits", "row_max", "exp", "row_sum",
           "pack", "issue_qk", "wait_v", "pv", "wait_k", "accumulate",
           "wait_k_free", "wait_v_free")
  print("\nclocks per KV step (mean over CTAs; profiled run)")
  print("| shape | tiling | kernel ms | wg | span/step | " +
        " | ".join(names) + " |")
  for r in results:
    for role, d in r["warpgroups"].items():
      per = lambda x: x / r["kv_steps"]
      cells = [f"{per(d['regions'].get(nm, 0.0)):.0f}" for nm in names]
      print(f"| {r['shape']} | {r['tiling']} | {r['kernel_ms']:.3f} | "
            f"{role} | {per(d['span']):.0f} | " + " | ".join(cells) + " |")
  print("\nclocks from a step's qk to the next, by position in the tile "
        "(0: across a tile end; persistent grids with several tiles a CTA)")
  for r in results:
    for role, per_pos in r["step_period_by_position"].items():
      cells = " ".join("-" if x is None else f"{x:.0f}" for x in per_pos)
      print(f"| {r['shape']} | {r['tiling']} | {role} | {cells} |")
  print("\nclocks per entry of the per-tile regions (entries per CTA)")
  print("| shape | tiling | wg | " + " | ".join(TILE_REGIONS) + " |")
  for r in results:
    for role, d in r["warpgroups"].items():
      cells = [f"{d['regions'][nm] / d['entries'][nm]:.0f} "
               f"({d['entries'][nm]:.1f})" if d["entries"].get(nm) else "-"
               for nm in TILE_REGIONS]
      print(f"| {r['shape']} | {r['tiling']} | {role} | "
            + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()

"""A Mosaic tiling's cost per KV step and per query tile, by a fit (GPU only).

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/tile_overhead.py \
        --out $OUT [--t 4096] [--lengths 2048,4096,8192] [--h 128] \
        [--base "nc=3,bkv=128,regs=160/32,expturn=1,persist=1"] \
        [--variants ";sched=0;idle=0"]

Times the kernel alone (device clock, B=4, N=32, bf16 inputs quantized by
the backend's passes) at a fixed query length ``--t`` over several key
lengths, for the base tiling and each variant (``mosaic_check.py``'s
fields, appended to ``--base``; the empty variant is the base itself), and
fits time = intercept + slope × KV steps: the slope is a step of all the
grid's tiles, the intercept what the kernel spends once per tile (tile
ends, prologues) and once per call. Prints each variant's rel_l2 against
the first and writes ``tile_overhead.json`` (benchmarks/NOTES.md, Mosaic
sections 47-48).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from sagejax import _inputs, testing
from sagejax.bench import timing

import mosaic_check  # noqa: E402  (benchmarks/ is the script's directory)


def fit_steps(lengths, ms, block_kv: int) -> tuple[float, float]:
  """(µs per KV step of all tiles, intercept µs) of the least-squares line
  through kernel times ``ms`` at key ``lengths``."""
  steps = np.array([s // block_kv for s in lengths], np.float64)
  slope, intercept = np.polyfit(steps, np.asarray(ms, np.float64), 1)
  return float(slope * 1e3), float(intercept * 1e3)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
  parser.add_argument("--t", type=int, default=4096)
  parser.add_argument("--lengths", default="2048,4096,8192")
  parser.add_argument("--h", type=int, default=128)
  parser.add_argument("--base",
                      default="nc=3,bkv=128,regs=160/32,expturn=1,persist=1")
  parser.add_argument("--variants", default="",
                      help="';'-separated fields appended to --base")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  b, n, t, h = 4, 32, args.t, args.h
  lengths = [int(x) for x in args.lengths.split(",")]
  variants = args.variants.split(";")
  cfg = timing.TimingConfig(repeats=5, target_s=0.05, clock="device")
  report = {}
  key = jax.random.key(7)
  for s in lengths:
    key, sub = jax.random.split(key)
    qkv = testing.make_qkv(sub, b, t, s, n, n, h, "normal", jnp.bfloat16,
                           "BTNH")
    first = None
    for extra in variants:
      tiling, config = mosaic_check.parse_variant(
          args.base + ("," + extra if extra else ""))
      f, prepare = mosaic_check.kernel_alone(tiling, config, causal=False)
      prepared = prepare(*qkv)
      out = np.asarray(f(*prepared)[0], np.float32)
      first = out if first is None else first
      err = testing.error_metrics(out, first)["rel_l2"]
      ms = timing.time_calls(f, [prepared], cfg).median_s * 1e3
      report.setdefault(extra or "base", {})[s] = dict(ms=ms, rel_l2=err)
      print(f"T={t} S={s} {extra or 'base':40s} {ms:.4f} ms "
            f"rel_l2 {err:.2e}", flush=True)
  base, config = mosaic_check.parse_variant(args.base)
  bkv = mosaic_check.resolve_tiling(base, _inputs.parse(*qkv),
                                    config).block_kv
  print("\n| variant | " + " | ".join(f"S={s} ms" for s in lengths)
        + " | per step of all tiles, µs | intercept, µs |")
  for name, by_s in report.items():
    slope, intercept = fit_steps(lengths, [by_s[s]["ms"] for s in lengths],
                                 bkv)
    by_s["fit"] = dict(per_step_us=slope, intercept_us=intercept)
    print(f"| {name} | " + " | ".join(f"{by_s[s]['ms']:.4f}" for s in lengths)
          + f" | {slope:.2f} | {intercept:.1f} |")
  with open(os.path.join(args.out, "tile_overhead.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, t=t, h=h,
                   base=args.base, results=report), f, indent=1, default=str)


if __name__ == "__main__":
  main()

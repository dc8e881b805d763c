"""SM clock and power draw while a forward runs back to back (GPU only).

    PYTHONPATH=$PWD python benchmarks/sm_clocks.py [--seconds 4] [--heads 64,128]

For each head dim, runs sagejax's Mosaic forward, cuDNN's bf16 forward and
ours again (B=4, S=16k, N=32, bf16, end to end) back to back for
``--seconds`` each while ``nvidia-smi`` samples the SM clock and the power
draw every 100 ms; prints ms per call, the median and lowest clock and the
median power, and writes ``sm_clocks.json`` under ``$OUT``. Whether a kernel
runs at the full clock or at the power cap says whether its ratio to cuDNN
depends on how long it runs (benchmarks/NOTES.md, Mosaic sections 25 and 45).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp

import sagejax


def sample(tag: str, fn, args, seconds: float) -> dict:
  """Runs ``fn(*args)`` in blocks of 10 calls for ``seconds`` while
  ``nvidia-smi`` samples; the first 5 and last 2 samples are dropped."""
  fn(*args).block_until_ready()
  smi = subprocess.Popen(
      ["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
       "--format=csv,noheader,nounits", "-lms", "100"],
      stdout=subprocess.PIPE, text=True)
  start, calls = time.time(), 0
  while time.time() - start < seconds:
    for _ in range(10):
      out = fn(*args)
    out.block_until_ready()
    calls += 10
  elapsed = time.time() - start
  smi.terminate()
  lines = smi.communicate()[0].strip().splitlines()[5:-2]
  samples = [tuple(map(float, line.split(","))) for line in lines
             if line.count(",") == 1]
  if not samples:
    raise SystemExit(f"nvidia-smi gave no samples: {lines[:3]}")
  clocks, watts = zip(*samples)
  return dict(tag=tag, calls=calls, ms_per_call=elapsed / calls * 1e3,
              sm_clock_mhz_median=statistics.median(clocks),
              sm_clock_mhz_min=min(clocks),
              power_w_median=statistics.median(watts))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seconds", type=float, default=4.0)
  p.add_argument("--heads", default="64,128", help="head dims")
  args = p.parse_args()
  ours = jax.jit(lambda q, k, v: sagejax.attention(
      q, k, v, implementation="mosaic"))
  cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, implementation="cudnn"))
  rows = []
  for h in map(int, args.heads.split(",")):
    q, k, v = (jax.random.normal(key, (4, 16384, 32, h), jnp.bfloat16)
               for key in jax.random.split(jax.random.key(h), 3))
    for tag, fn in ((f"ours H={h}", ours), (f"cudnn H={h}", cudnn),
                    (f"ours H={h} again", ours)):
      rows.append(sample(tag, fn, (q, k, v), args.seconds))
      print(json.dumps(rows[-1]), flush=True)
  with open(os.path.join(os.environ.get("OUT", "."), "sm_clocks.json"),
            "w") as f:
    json.dump(rows, f, indent=1)
  print("| run | ms a call | SM clock, median (min) | power |\n|---|---|---|---|")
  for r in rows:
    print(f"| {r['tag']} | {r['ms_per_call']:.2f} | "
          f"{r['sm_clock_mhz_median']:.0f} ({r['sm_clock_mhz_min']:.0f}) MHz "
          f"| {r['power_w_median']:.0f} W |")


if __name__ == "__main__":
  main()

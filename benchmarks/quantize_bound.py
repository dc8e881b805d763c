"""The quantization's cost against what its bytes cost any kernel (GPU only).

    PYTHONPATH=$PWD python benchmarks/quantize_bound.py [--lengths 1024,4096]

For B=4, N=32, H=128, bf16 inputs in BTNH and each length T=S: cuDNN's
forward, sagejax's Mosaic forward end to end (sage2-8b), its quantization
alone (``MosaicBackend.prepare``: every pass and XLA op before the kernel),
and three XLA programs that move the least bytes a quantization can: Q, K
and V read once (their max |x|), read and cast to INT8 / INT8 / FP8 (the
quantized operands' bytes written, no statistics), and copied (``x + 1``).
Each by the profiler's device span and by the wall clock; writes
``quantize_bound.json`` under ``--out``. What a forward with passes before
its kernel can reach is its kernel plus the cast's time (benchmarks/NOTES.md,
Mosaic section 46).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import sagejax
from sagejax import PRESETS, _inputs, testing
from sagejax.backends import mosaic
from sagejax.bench import timing


def programs(config) -> dict:
  """name -> jitted f(q, k, v)."""
  parse = lambda q, k, v: _inputs.parse(q, k, v)
  return {
      "cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, implementation="cudnn")),
      "sagejax end to end": jax.jit(lambda q, k, v: sagejax.attention(
          q, k, v, config=config, implementation="mosaic")),
      "sagejax quantization": jax.jit(
          lambda q, k, v: mosaic.BACKEND.prepare(parse(q, k, v), config)),
      "read (max |x|)": jax.jit(lambda q, k, v: tuple(
          jnp.abs(x).max(axis=1) for x in (q, k, v))),
      "read, cast to i8/i8/f8": jax.jit(lambda q, k, v: (
          (q * 3).astype(jnp.int8), (k * 3).astype(jnp.int8),
          (v * 3).astype(jnp.float8_e4m3fn))),
      "copy (x + 1)": jax.jit(lambda q, k, v: (q + 1, k + 1, v + 1)),
  }


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
  parser.add_argument("--lengths", default="1024,4096")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  fns = programs(PRESETS["sage2-8b"])
  report = {}
  for s in (int(x) for x in args.lengths.split(",")):
    key = jax.random.key(s)
    sets = []
    for _ in range(4):
      key, sub = jax.random.split(key)
      sets.append(testing.make_qkv(sub, 4, s, s, 32, 32, 128, "normal",
                                   jnp.bfloat16, "BTNH"))
    row = report[s] = {}
    for clock in ("device", "wall"):
      config = timing.TimingConfig(repeats=5, target_s=0.05, clock=clock)
      for name, fn in fns.items():
        ms = timing.time_calls(fn, sets, config).median_s * 1e3
        row[f"{name} [{clock}]"] = ms
        print(f"S={s:5d} {clock:6s} {name:24s} {ms:.4f} ms", flush=True)
  with open(os.path.join(args.out, "quantize_bound.json"), "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()

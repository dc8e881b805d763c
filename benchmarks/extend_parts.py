"""Where the Mosaic extend's time goes (one GPU run, Hopper).

  PYTHONPATH=$PWD python benchmarks/extend_parts.py --out $OUT

A 4096-token chunk (B=2, GQA 32/8, H=128, bf16 q, pages of 16) on 8k and
32k cached tokens; µs of:

* the whole ``extend_attention`` call (FP8 P̃, the default, and FP16 P̃);
* its two parts: ``mosaic_paged.prepare`` (page gather, Q quantization) and
  ``mosaic_paged.kernel`` on prepared operands;
* the kernel without the per-key V factor (``v_key_scale=None``: what the
  per-token V scales cost);
* the dense forward, ``sagejax.attention(implementation="mosaic")``
  (sage2-8b, bottom-right causal) on contiguous bf16 Q, K, V of the same
  shape, end to end;
* cuDNN on the dense bf16 cache (non-causal: no bottom-right mask in
  jax.nn's cuDNN path).

TOPS count the causal work. Timing: sagejax.bench.timing (warm-up, back to
back dispatches, median of 5). JSON to ``--out``; the table prints last.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import sagejax
from sagejax import quant, serving
from sagejax.bench.timing import TimingConfig, time_calls
from sagejax.serving import mosaic_paged
from sagejax.serving.reference import PagedMath

B, T, N, K, H, PS = 2, 4096, 32, 8, 128, 16
TIMING = TimingConfig(repeats=5, target_s=0.05, min_calls=10, max_calls=100)


def seconds(fn, *args):
  compiled = jax.jit(fn).lower(*args).compile()
  return time_calls(compiled, [args], TIMING).median_s


def case(prefix: int) -> dict:
  s = prefix + T
  pages = B * s // PS
  keys = jax.random.split(jax.random.key(prefix), 8)
  cache = serving.PagedKVCache(
      jax.random.randint(keys[0], (K, pages, PS, H), -127, 128, jnp.int8),
      (jax.random.normal(keys[1], (K, pages, H, PS)) * 100).astype(
          quant.FP8_DTYPE),
      jax.random.uniform(keys[2], (K, pages, PS), minval=0.004, maxval=0.02),
      jax.random.uniform(keys[3], (K, pages, PS), minval=0.004, maxval=0.02),
      jnp.zeros((K, H)), jnp.zeros((K, H)), jnp.ones((), bool),
      v_transposed=True)
  table = jnp.asarray(np.random.RandomState(1).permutation(pages).reshape(
      B, s // PS).astype(np.int32))
  lengths = jnp.full((B,), s, jnp.int32)
  q_len = jnp.full((B,), T, jnp.int32)
  q = jax.random.normal(keys[4], (B, T, N, H), jnp.bfloat16)
  kd = jax.random.normal(keys[5], (B, s, K, H), jnp.bfloat16)
  vd = jax.random.normal(keys[6], (B, s, K, H), jnp.bfloat16)
  work = 4 * B * N * H * (T * prefix + T * (T + 1) / 2)
  us = {}

  def record(name, fn, *args):
    try:
      us[name] = seconds(fn, *args) * 1e6
    except Exception as e:  # pylint: disable=broad-except
      print(f"!! {name}: {type(e).__name__}: {e}"[:500])

  for pv in ("fp8_e4m3", "fp16"):
    config = serving.SERVING_CONFIG.replace(pv_dtype=pv)
    record(f"extend_attention P={pv}",
           lambda q, c: serving.extend_attention(q, c, table, lengths,
                                                 config=config), q, cache)
  tiling = mosaic_paged.default_tiling(H)
  math = PagedMath(sm_scale=H ** -0.5, pv_dtype="fp8_e4m3",
                   block_k=mosaic_paged.normalization_block(table, cache))
  prep = lambda q, c: mosaic_paged.prepare(q, q_len, lengths, c, table,  # noqa: E731
                                           math, tiling)
  record("prepare (gather, quantize Q)", prep, q, cache)
  ops = jax.jit(prep)(q, cache)
  record("kernel alone",
         lambda o: mosaic_paged.kernel(o, math, jnp.bfloat16, tiling), ops)
  no_factor = dict(ops, v_key_scale=None)
  record("kernel alone, no per-key V factor",
         lambda o: mosaic_paged.kernel(o, math, jnp.bfloat16, tiling),
         no_factor)
  record("dense sagejax mosaic sage2-8b (bottom-right causal)",
         lambda q, k, v: sagejax.attention(
             q, k, v, is_causal=True, causal_alignment="bottom_right",
             implementation="mosaic"), q, kd, vd)
  record("cudnn dense bf16 (non-causal)",
         lambda q, k, v: jax.nn.dot_product_attention(
             q, k, v, implementation="cudnn"), q, kd, vd)
  return dict(prefix=prefix, us=us,
              tops={k: work / v / 1e6 for k, v in us.items()})


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  rows = []
  for prefix in (8192, 32768):
    rows.append(case(prefix))
    with open(os.path.join(args.out, "extend_parts.json"), "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind,
                     jax=jax.__version__, rows=rows), f, indent=1)
  for r in rows:
    print(f"\nprefix {r['prefix']} (B={B}, chunk {T}):")
    for name, us in r["us"].items():
      print(f"  {us:8.0f} us  {r['tops'][name]:6.0f} TOPS  {name}")


if __name__ == "__main__":
  main()

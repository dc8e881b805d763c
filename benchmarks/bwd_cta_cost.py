"""The fused backward kernel's fixed cost per CTA, from its time at several
query lengths (NOTES B17's question).

  PYTHONPATH=$PWD python benchmarks/bwd_cta_cost.py [--out DIR] \
      [--lengths 256,512,1024,2048,4096] [--tilings "default;nosc"]

The dK/dV kernel with dQ fused (``mosaic_backward.attention_backward``, the
kernel alone: no forward, no glue) on B=2, N=K=32, S=4096, H=128, bf16,
BTNH, no mask: 2048 CTAs (15.5 per SM of an H100) whatever T is, each
visiting T / 64 query blocks. So the kernel time is about
``CTAs / SMs · (a + steps · b)``: a least-squares line through the times
gives ``b`` (a step) and ``a`` (a CTA's prologue, epilogue and launch, with
the last wave's tail). The call also zeroes and converts the FP32 dQ
(XLA, linear in T: it adds ~0.1 µs to ``b``, nothing to ``a``).
``--lower-only`` lowers each case for CUDA and stops (no GPU needed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from sagejax import quant
from sagejax.backends import mosaic
from sagejax.bench.timing import TimingConfig, time_calls
from sagejax.kernels import mosaic_backward
from sagejax.masks import MaskSpec

B, N, S, H = 2, 32, 4096, 128
SMS = 132


def tiling_for(item: str) -> mosaic_backward.MosaicBackwardTiling:
  """``default``, ``nosc``, or ``name:field=int,...`` (fields replaced in
  the default)."""
  base = mosaic.default_backward_tiling(H, fused_dq=True)
  name, _, fields = item.partition(":")
  if name == "nosc" and not fields:
    return dataclasses.replace(base, static_consumers=False)
  if name != "default" and not fields:
    raise ValueError(f"unknown tiling {name!r}: default, nosc or "
                     "name:field=value,...")
  return dataclasses.replace(base, **{
      k: int(v) for k, v in (f.split("=") for f in fields.split(",") if f)})


def kernel_call(t: int, tiling):
  """A jitted call of the fused backward kernel on [B, t, N, H] queries,
  and its arguments (realistic lse₂: the row's log2-sum of S logits of
  variance ~1)."""
  keys = jax.random.split(jax.random.key(t), 4)
  q = jax.random.normal(keys[0], (B, t, N, H), jnp.bfloat16)
  k = jax.random.normal(keys[1], (B, S, N, H), jnp.bfloat16)
  v = jax.random.normal(keys[2], (B, S, N, H), jnp.bfloat16)
  do = jax.random.normal(keys[3], (B, t, N, H), jnp.bfloat16)
  lse2 = jnp.full((B, N, t), (np.log(S) + 0.5) * quant.LOG2E, jnp.float32)
  delta = jnp.zeros((B, N, t), jnp.float32)
  k_mean = jnp.zeros((B, N, H), jnp.float32)
  lengths = (jnp.full((B,), t, jnp.int32), jnp.full((B,), S, jnp.int32))
  spec = MaskSpec(is_causal=False, causal_alignment="top_left", window=None,
                  q_len=t, kv_len=S)

  def f(q, k, v, do, lse2, delta):
    return mosaic_backward.attention_backward(
        q, k, v, do, lse2, delta, delta, k_mean, spec,
        sm_scale=H ** -0.5, layout="BTNH", q_lengths=lengths[0],
        kv_lengths=lengths[1], tiling=tiling)

  return jax.jit(f), (q, k, v, do, lse2, delta)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  p.add_argument("--lengths", default="256,512,1024,2048,4096")
  p.add_argument("--tilings", default="default;nosc",
                 help='";"-separated: default, nosc, name:field=1,...')
  p.add_argument("--lower-only", action="store_true")
  args = p.parse_args()
  lengths = [int(x) for x in args.lengths.split(",")]
  ctas = B * N * (S // (2 * mosaic_backward.ROWS))
  rows = []
  for item in filter(None, args.tilings.split(";")):
    name = item.partition(":")[0]
    tiling = tiling_for(item)
    times = []
    for t in lengths:
      fn, call_args = kernel_call(t, tiling)
      if args.lower_only:
        fn.trace(*call_args).lower(lowering_platforms=("cuda",))
        print(f"lowered {name} T={t}", flush=True)
        continue
      compiled = fn.lower(*call_args).compile()
      timing = time_calls(compiled, [call_args],
                          TimingConfig(target_s=0.05, repeats=9))
      ms = timing.median_s * 1e3
      steps = t // tiling.block_q
      times.append((steps, ms))
      rows.append(dict(tiling=name, T=t, steps=steps, ms=ms))
      print(f"{name:8s} T={t:5d} steps/CTA={steps:3d} {ms:8.3f} ms", flush=True)
    if len(times) >= 2:
      steps, ms = np.array(times, dtype=np.float64).T
      per_cta_us = ms * 1e3 / (ctas / SMS)  # µs per CTA an SM runs
      b, a = np.polyfit(steps, per_cta_us, 1)
      print(f"{name}: {ctas} CTAs ({ctas / SMS:.2f} per SM): "
            f"a = {a:.1f} µs per CTA, b = {b:.3f} µs per step", flush=True)
      rows.append(dict(tiling=name, fit_a_us=a, fit_b_us=b))
  if not args.lower_only:
    with open(os.path.join(args.out, "bwd_cta_cost.json"), "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()

"""How fast a quantization pass could run: the K pass beside plain casts.

Times, at one K-shaped input (default the 4k forward's: ``[4, 4096, 32, 128]``
bf16, BTNH), the Triton K pass (sage2-8b: k̄ subtracted, per-thread groups),
XLA's cast and multiply, torch's multiply (a device-to-device copy's rate),
and a prototype Mosaic GPU pass: one CTA per head streaming ``[rows, H]``
tiles through a TMA ring (``plgpu.emit_pipeline``), each tile cast to INT8
by its rows' maxima (no groups, no k̄, truncating: a bandwidth probe, not a
quantization). Each function runs back to back (``--reps`` calls, the best
of three rounds, wall clock), so the GPU's clocks stay up; benchmarks/NOTES.md,
Mosaic section 50, explains why that matters here. Bytes: bf16 read plus
INT8 written (the copies: bf16 both ways). Needs a Hopper GPU::

  PYTHONPATH=$PWD python benchmarks/pass_bandwidth.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sagejax.config import PRESETS
from sagejax.kernels import triton_quantize
from sagejax.kernels.mosaic_attention import load_all, wgmma_smem


def mosaic_row_cast(shape, rows: int, stages: int):
  """The probe: ``[B, T, N, H]`` bf16 → ``[B, N, T, H]`` INT8, tiles of
  ``rows`` tokens through a ring of ``stages`` TMA slots, one CTA a head."""
  b, t, n, h = shape
  # The tiling and swizzle a WGMMA-layout tile needs (the attention kernel's).
  to_wgmma = lambda dtype: wgmma_smem((rows, h), dtype).transforms

  def kernel(x_ref, o_ref):
    head = lax.axis_index("heads")

    def tile(_, x_smem, o_smem):
      v = load_all(x_smem, plgpu.Layout.WGMMA).astype(jnp.float32)
      amax = jnp.max(jnp.abs(v), axis=1)
      o_smem[...] = (v * lax.broadcast_in_dim(127.0 / amax, v.shape, [0])
                     ).astype(jnp.int8)

    plgpu.emit_pipeline(
        tile, grid=(t // rows,),
        in_specs=[plgpu.BlockSpec((rows, h), lambda i: (i, 0),
                                  transforms=to_wgmma(jnp.bfloat16))],
        out_specs=[plgpu.BlockSpec((rows, h), lambda i: (i, 0),
                                   transforms=to_wgmma(jnp.int8))],
        max_concurrent_steps=stages)(x_ref.at[head // n, :, head % n, :],
                                     o_ref.at[head // n, head % n])

  return jax.jit(plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((b, n, t, h), jnp.int8),
      grid=(b * n,), grid_names=("heads",)))


def best_wall(f, x, reps: int, rounds: int = 3,
              sync=jax.block_until_ready) -> float:
  """Seconds a call: the best of ``rounds`` rounds of ``reps`` calls back
  to back (after 20 to warm up); ``sync(out)`` waits for the device."""
  best = float("inf")
  for _ in range(rounds):
    out = None
    for _ in range(20):
      out = f(x)
    sync(out)
    t0 = time.perf_counter()
    for _ in range(reps):
      out = f(x)
    sync(out)
    best = min(best, (time.perf_counter() - t0) / reps)
  return best


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shape", default="4,4096,32,128")
  parser.add_argument("--reps", type=int, default=300)
  parser.add_argument("--out", default="bench_out")
  args = parser.parse_args()
  b, t, n, h = shape = tuple(int(d) for d in args.shape.split(","))
  x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
  config = PRESETS["sage2-8b"]
  lengths = jnp.full((b,), t, jnp.int32)
  mean = jnp.zeros((b, n, h), jnp.float32)
  cast_bytes, copy_bytes = x.size * 3, x.size * 4
  fns = {
      "K pass (Triton, sage2-8b)": (jax.jit(lambda x: triton_quantize.quantize_qk(
          x, lengths, mean, role="k", config=config, layout="BTNH")[:2]),
          cast_bytes),
      "XLA cast to INT8 (BNTH)": (jax.jit(lambda x: (jnp.swapaxes(
          x, 1, 2).astype(jnp.float32) * 0.5).astype(jnp.int8)), cast_bytes),
      "XLA x * 0.5 (bf16)": (jax.jit(lambda x: x * 0.5), copy_bytes),
  }
  for rows, stages in [(64, 2), (64, 4), (128, 3)]:
    fns[f"Mosaic GPU probe, {rows} rows, {stages} slots"] = (
        mosaic_row_cast(shape, rows, stages), cast_bytes)
  results = {}
  for name, (f, nbytes) in fns.items():
    sec = best_wall(f, x, args.reps)
    results[name] = dict(ms=sec * 1e3, tb_s=nbytes / sec / 1e12)
  try:
    import torch  # the copy rate without JAX
    tx = torch.randn(x.size, device="cuda", dtype=torch.bfloat16)
    ty = torch.empty_like(tx)
    best = best_wall(lambda _: torch.mul(tx, 0.5, out=ty), None, args.reps,
                     sync=lambda _: torch.cuda.synchronize())
    results["torch x * 0.5 (bf16)"] = dict(ms=best * 1e3,
                                          tb_s=copy_bytes / best / 1e12)
  except ImportError:
    pass
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "pass_bandwidth.json"), "w") as f:
    json.dump(dict(shape=shape, device=str(jax.devices()[0]),
                   jax=jax.__version__, results=results), f, indent=1)
  print(f"| {args.shape} | ms | TB/s |\n|---|---|---|")
  for name, r in results.items():
    print(f"| {name} | {r['ms']:.3f} | {r['tb_s']:.2f} |")


if __name__ == "__main__":
  main()

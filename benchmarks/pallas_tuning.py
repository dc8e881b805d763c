"""One device run: check the Pallas backend, then time it beside cuDNN.

  PYTHONPATH=$PWD python benchmarks/pallas_tuning.py --out $OUT [--quick]

Times end to end (quantization included) and the attention kernel alone, for
several kernel tilings, beside ``jax.nn.dot_product_attention(cudnn)`` in bf16
in the same process; measures copy bandwidth and the quantization kernels'
achieved bandwidth. TOPS = 4·B·N·T·S·H / t (halved when causal). Timing: warm
up, then per repeat many dispatches over rotating input sets (> 2× L2) and
one block_until_ready; the median over repeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp

import sagejax
from sagejax import PRESETS, _inputs, testing
from sagejax.backends import pallas_triton

L2_BYTES = 60 << 20


def timeit(fn, arg_sets, iters=20, reps=5):
  """Median seconds per call of jitted ``fn`` over rotating ``arg_sets``."""
  for a in arg_sets:
    jax.block_until_ready(fn(*a))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for i in range(iters):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters)
  return statistics.median(times)


def input_sets(b, s, n, h, kind="normal"):
  one = 3 * b * s * n * h * 2
  count = max(1, math.ceil(2 * L2_BYTES / one))
  return [testing.make_qkv(jax.random.PRNGKey(i), b, s, s, n, n, h, kind,
                           jnp.bfloat16) for i in range(count)]


def quant_parts(sets, config, causal):
  """ms of each quantization step alone, and of XLA's token reductions."""
  from sagejax.kernels import triton_quantize
  parts = {}
  lengths = jnp.full((sets[0][0].shape[0],), sets[0][0].shape[1], jnp.int32)
  q_only = jax.jit(lambda q, k, v: triton_quantize.quantize_qk(
      q, lengths, None, role="q", config=config, layout="BTNH")[:2])
  parts["q_kernel"] = q_only
  means = jax.jit(lambda q, k, v: (
      jnp.mean(k.astype(jnp.float32), axis=1),
      jnp.max(jnp.abs(v.astype(jnp.float32)), axis=1)))
  parts["k_mean+v_amax (xla)"] = means
  def k_only(q, k, v):
    return triton_quantize.quantize_qk(k, lengths, jnp.zeros(
        (k.shape[0], k.shape[2], k.shape[3]), jnp.float32), role="k",
        config=config, layout="BTNH")[:2]
  parts["k_kernel"] = jax.jit(k_only)
  parts["v_kernel"] = jax.jit(lambda q, k, v: triton_quantize.quantize_v(
      v, lengths, None, jnp.ones((v.shape[0], v.shape[2], v.shape[3]),
                                 jnp.float32), config=config, layout="BTNH",
      transpose=True))
  return {name: timeit(fn, sets) * 1e3 for name, fn in parts.items()}


def kernel_seconds(backend, config, sets, causal, call):
  """Median seconds of ``backend.kernel`` alone on its own prepared inputs."""
  prep = jax.jit(lambda q, k, v: backend.prepare(
      _inputs.parse(q, k, v, is_causal=causal), config))
  prepared = [(prep(*a),) for a in sets]
  return timeit(jax.jit(lambda p: backend.kernel(p, call, config)), prepared)


def tops(b, n, s, h, causal, sec):
  return 4 * b * n * s * s * h / sec / (2 if causal else 1) / 1e12


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="out")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
  ap.add_argument("--tilings", action="store_true",
                  help="also time kernel tiling variants")
  ap.add_argument("--ablations", action="store_true",
                  help="also time FP16 P·V (sage1) and FP8 tensor-core P·V kernels")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  dev = jax.devices()[0]
  print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)
  rows = []

  # Copy bandwidth (read + write).
  x = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB
  copy = jax.jit(lambda x: x + 1.0)
  sec = timeit(copy, [(x,)], iters=10)
  copy_bw = 2 * x.nbytes / sec / 1e9
  print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
  del x

  b, n = 4, 32
  seqs = [int(s) for s in args.seqs.split(",")]
  config = PRESETS["sage2-8b"]
  for h in (128, 64):
    for s in seqs:
      sets = input_sets(b, s, n, h)
      for causal in (False, True):
        cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"))
        e2e = jax.jit(lambda q, k, v: sagejax.attention(
            q, k, v, is_causal=causal, implementation="pallas"))
        call0 = _inputs.parse(*sets[0], is_causal=causal)
        backend = pallas_triton.BACKEND
        prep = jax.jit(lambda q, k, v: backend.prepare(
            _inputs.parse(q, k, v, is_causal=causal), config))
        prepared = [(prep(*a),) for a in sets]
        tilings = [None]
        if args.tilings:
          base = pallas_triton.default_tiling(h, config)
          rep = dataclasses.replace
          tilings += [rep(base, heads_outer=True, heavy_first=True),
                      rep(base, heads_outer=True),
                      rep(base, heavy_first=True)]
        if args.ablations:
          # The same kernel with FP16 P·V (sage1 arithmetic), and the FP8
          # P·V on 8-bit tensor cores (V as FP8 [H, S]) instead of FP8 values
          # on FP16 tensor cores (the default).
          t_sage1 = kernel_seconds(backend, PRESETS["sage1"], sets, causal,
                                   call0)
          t_fp8mma = kernel_seconds(
              pallas_triton._PallasTritonBackend(fp8_on_fp16_mma=False),
              config, sets, causal, call0)
        t_cudnn = timeit(cudnn, sets)
        t_e2e = timeit(e2e, sets)
        t_prep = timeit(prep, sets)
        row = dict(h=h, s=s, causal=causal,
                   cudnn=tops(b, n, s, h, causal, t_cudnn),
                   pallas_e2e=tops(b, n, s, h, causal, t_e2e),
                   quant_ms=t_prep * 1e3)
        if args.ablations:
          row["kernel sage1 (fp16 PV)"] = tops(b, n, s, h, causal, t_sage1)
          row["kernel fp8 MMA"] = tops(b, n, s, h, causal, t_fp8mma)
        for tiling in tilings:
          kern = jax.jit(lambda p, tiling=tiling: backend.kernel(
              p, call0, config, tiling))
          try:
            t_k = timeit(kern, prepared)
            row[f"kernel {tiling or 'default'}"] = tops(b, n, s, h, causal,
                                                        t_k)
          except Exception as e:  # a tiling that does not compile
            row[f"kernel {tiling or 'default'}"] = f"error: {str(e)[:200]}"
        # Quantization bandwidth: bf16 Q, K, V read once; int8 Q, K and fp8 V
        # written; scales (4 B per token) written.
        elems = b * s * n * h
        qbytes = 3 * elems * 2 + 3 * elems + 2 * b * s * n * 4
        row["quant_GBps"] = qbytes / t_prep / 1e9
        if causal:  # Where the quantization time goes (same for both).
          row["quant_parts_ms"] = quant_parts(sets, config, causal)
        row["quant_frac_copy"] = row["quant_GBps"] / copy_bw
        rows.append(row)
        print(json.dumps(row), flush=True)
      del sets, prepared
  meta = dict(device=dev.device_kind, jax=jax.__version__,
              date=datetime.date.today().isoformat(), copy_GBps=copy_bw,
              batch=b, heads=n, config="sage2-8b")
  with open(os.path.join(args.out, "pallas_tuning.json"), "w") as f:
    json.dump(dict(meta=meta, rows=rows), f, indent=1)
  print(f"\n{meta}")
  print(f"{'H':>4} {'S':>6} {'causal':>6} {'cuDNN':>7} {'sage e2e':>8} "
        f"{'kernel':>7} {'quant GB/s':>10} {'%copy':>6}")
  for r in rows:
    k = r["kernel default"]
    k = f"{k:7.0f}" if isinstance(k, float) else "   err"
    print(f"{r['h']:>4} {r['s']:>6} {str(r['causal']):>6} {r['cudnn']:7.0f} "
          f"{r['pallas_e2e']:8.0f} {k} {r['quant_GBps']:10.0f} "
          f"{100 * r['quant_frac_copy']:5.0f}%")


if __name__ == "__main__":
  main()

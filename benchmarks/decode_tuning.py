"""Decode tiling search on a GPU: where the paged decode kernel's time goes.

  PYTHONPATH=$PWD python benchmarks/decode_tuning.py --out $OUT \
      [--shapes "32,4096;32,16384;8,32768"] [--kinds int8-p16,bf16-p16] \
      [--grid "64,128;2,4;3,5"] [--splits "1,2,4,8"]

For each shape (batch × cached tokens; GQA 32/8, H=128, bf16 q) and page
kind (``int8-p16``, ``bf16-p64``, ``int8-p16-fp8`` for FP8 P̃), a grid over
:class:`sagejax.serving.PagedTiling`'s ``block_k`` × ``num_warps`` ×
``num_stages``, then split counts for the grid's best, beside dense cuDNN
decode and the copy and read bandwidths measured in the same process. The
best tiling per shape is then profiled (kernel alone vs the split merge).
Prints a table last and writes ``decode_tuning.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import profile_step
import serving_check as sc
from sagejax import serving

# A grid over the tiles, then the split count of the grid's best.
GRIDS = {"int8": dict(block_k=(32, 64, 128), num_warps=(1, 2, 4),
                      num_stages=(3, 5, 7)),
         "bf16": dict(block_k=(64, 128), num_warps=(1, 2, 4),
                      num_stages=(3, 5))}
SPLITS = (None, 1, 2, 4, 8, 12, 16)


def read_bandwidth(smoke: bool) -> float:
  x = jnp.ones((1 << (20 if smoke else 30),), jnp.bfloat16)  # 2 GiB on a GPU
  t = sc.seconds(lambda x: jnp.sum(x, dtype=jnp.float32), (x,))
  return 2 * x.size / t / 1e12


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True)
  p.add_argument("--shapes", default="32,4096;32,16384;8,32768")
  p.add_argument("--kinds", default="int8-p16,bf16-p16")
  p.add_argument("--smoke", action="store_true",
                 help="CPU check of the script: interpreted kernels, XLA "
                 "for cuDNN, two tilings")
  p.add_argument("--grid", default=None,
                 help='one grid for every kind, e.g. "32,64;1,2;5,7" '
                 "(block_k; num_warps; num_stages)")
  p.add_argument("--splits", default=None,
                 help='split counts tried after the grid, e.g. "4,8" '
                 "('none': only the automatic count)")
  p.add_argument("--budget-s", type=float, default=480)
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  start = time.time()
  run = sc.Run(args.out, args.smoke)
  grids, splits = GRIDS, SPLITS
  if args.splits:
    splits = () if args.splits == "none" else tuple(
        int(x) for x in args.splits.split(","))
  if args.grid:
    axes = [tuple(int(x) for x in part.split(",")) for part in
            args.grid.split(";")]
    grids = {k: dict(zip(("block_k", "num_warps", "num_stages"), axes))
             for k in GRIDS}
  if args.smoke:
    args.shapes, splits = "2,256", (2,)
    grids = {k: dict(block_k=(64,), num_warps=(4,), num_stages=(2,))
             for k in GRIDS}
  data = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
          "rows": []}
  data["copy_tb_s"] = sc.copy_bandwidth(run)
  data["read_tb_s"] = read_bandwidth(args.smoke)
  print(f"read bandwidth {data['read_tb_s']:.2f} TB/s", flush=True)

  def save():
    with open(os.path.join(args.out, "decode_tuning.json"), "w") as f:
      json.dump(data, f, indent=1, default=str)

  summary = []
  shapes = args.shapes.split(";")
  for i_shape, shape in enumerate(shapes):
    deadline = start + args.budget_s * (i_shape + 1) / len(shapes)
    b, s = (int(x) for x in shape.split(","))
    pools = sc.random_pages(jax.random.key(b + s), b * s // 16, 16, True, b)
    qs = [jax.random.normal(jax.random.key(i), (b, sc.N, sc.H), jnp.bfloat16)
          for i in range(2)]
    lengths = jnp.full((b,), s, jnp.int32)
    k_dense, v_dense = pools["dense"]
    cudnn = sc.seconds(
        lambda q, k, v: jax.nn.dot_product_attention(
            q[:, None], k, v,
            implementation="xla" if args.smoke else "cudnn")[:, 0],
        *[(q, k_dense, v_dense) for q in qs])
    bf16_bytes = b * s * sc.K * 4 * sc.H
    print(f"\nB={b} S={s}: cuDNN dense {cudnn * 1e6:.1f} us "
          f"({bf16_bytes / cudnn / 1e12:.2f} TB/s)", flush=True)
    kinds = args.kinds.split(",")
    for kind in kinds:
      # int8-p16, bf16-p64, int8-p16-fp8 (FP8 P̃; default: the serving
      # config's P·V dtype).
      quantized = kind.startswith("int8")
      ps = int(kind.split("-")[1][1:])
      config = (serving.SERVING_CONFIG.replace(pv_dtype="fp8_e4m3")
                if kind.endswith("-fp8") else None)
      table = jnp.asarray(np.random.RandomState(ps).permutation(
          b * s // ps).reshape(b, s // ps).astype(np.int32))
      nbytes = b * s * sc.K * ((2 * sc.H + 8) if quantized else 4 * sc.H)
      cache = sc._cache(pools, quantized, ps)  # pylint: disable=protected-access

      def fn(tiling):
        return lambda q, cache, table, lengths: serving.decode_attention(
            q, cache, table, lengths, implementation="pallas", tiling=tiling,
            config=config,
            interpret=args.smoke)

      seen = {}

      def measure(tiling):
        if tiling in seen:
          return seen[tiling]
        try:
          t = sc.seconds(fn(tiling), *[(q, cache, table, lengths) for q in qs])
        except Exception as e:  # pylint: disable=broad-except
          print(f"  {kind} {tiling}: {type(e).__name__}: {str(e)[:200]}")
          t = None
        seen[tiling] = t
        row = dict(batch=b, tokens=s, kind=kind, tiling=str(tiling),
                   us=None if t is None else t * 1e6,
                   tb_s=None if t is None else nbytes / t / 1e12)
        data["rows"].append(row)
        if t is not None:
          print(f"  {kind} bk={tiling.block_k} w={tiling.num_warps} "
                f"st={tiling.num_stages} sp={tiling.num_splits}: "
                f"{t * 1e6:7.1f} us {nbytes / t / 1e12:5.2f} TB/s", flush=True)
        save()
        return t

      grid = grids["int8" if quantized else "bf16"]
      kind_deadline = time.time() + (deadline - time.time()) / (
          len(kinds) - kinds.index(kind))

      def fastest(cands, best=None, best_t=None):
        for cand in cands:
          if time.time() > kind_deadline:
            break
          t = measure(cand)
          if t is not None and (best_t is None or t < best_t):
            best, best_t = cand, t
        return best, best_t

      best, best_t = fastest(
          serving.PagedTiling(block_q=1, block_k=max(bk, ps), num_warps=w,
                              num_stages=st)
          for bk, w, st in itertools.product(*grid.values()))
      if best is not None:
        best, best_t = fastest(
            (dataclasses.replace(best, num_splits=sp) for sp in splits),
            best, best_t)
      prof = {}
      if best_t is not None and not args.smoke:
        f = jax.jit(fn(best))
        call = (qs[0], cache, table, lengths)
        jax.block_until_ready(f(*call))
        with tempfile.TemporaryDirectory() as d:
          with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(10):
              r = f(*call)
            jax.block_until_ready(r)
          prof = {k: v[0] / 10 for k, v in
                  profile_step.kernel_times(d, 10)[0].items()}
      summary.append(dict(batch=b, tokens=s, kind=kind, tiling=str(best),
                          us=best_t and best_t * 1e6,
                          tb_s=best_t and nbytes / best_t / 1e12,
                          cudnn_us=cudnn * 1e6, kernels_us=prof))
      data["summary"] = summary
      save()
    del pools, k_dense, v_dense

  print(f"\ncopy {data['copy_tb_s']:.2f} TB/s, read {data['read_tb_s']:.2f} "
        f"TB/s ({data['device']})")
  print("| B x tokens | kind | best tiling | us | TB/s | % read BW | "
        "x cuDNN | kernels (us) |")
  print("|---|---|---|---|---|---|---|---|")
  for r in summary:
    if r["us"] is None:
      continue
    ks = ", ".join(f"{k[:40]} {v:.1f}" for k, v in
                   sorted(r["kernels_us"].items(), key=lambda x: -x[1])[:3])
    print(f"| {r['batch']} x {r['tokens'] // 1024}k | {r['kind']} | "
          f"{r['tiling'].replace('PagedTiling', '')} | {r['us']:.1f} | "
          f"{r['tb_s']:.2f} | {100 * r['tb_s'] / data['read_tb_s']:.0f}% | "
          f"{r['cudnn_us'] / r['us']:.2f} | {ks} |")


if __name__ == "__main__":
  main()

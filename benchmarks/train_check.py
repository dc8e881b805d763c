"""One device run: check the backward kernels, then time training steps.

  PYTHONPATH=$PWD python benchmarks/train_check.py --out $OUT [--quick]

1. Correctness: the compiled backward kernels (``"mosaic"`` on Hopper with
   recomputed or saved statistics, ``"pallas"``) against the exact
   FP32 ``"xla"`` backward, bf16 inputs, device memory poisoned with NaN
   before each run (an output element a kernel forgets to write shows as
   NaN): cosine and relative L2 of dQ, dK, dV for the default backward, saved
   statistics, INT8 (SageBwd) and FP32-atomic dQ, on normal and
   channel-outlier data, S up to 8k.
2. Speed: ``jax.value_and_grad`` of sum(out·dO) w.r.t. q, k, v (B=2, N=32,
   bf16), sagejax's backward variants (``"pallas"`` forward; and
   ``implementation=None``: the fastest forward, e.g. ``"mosaic"``, with the
   kernel backward it borrows) beside cuDNN
   (``jax.nn.dot_product_attention(implementation="cudnn")``) in the same
   process; TFLOPS = 3.5 × 4·B·N·T·S·H / t (halved when causal). Timing:
   compile, warm up, then per repeat back-to-back dispatches and one
   block_until_ready; the median over repeats. Also the forward alone and the
   planned device memory (XLA's memory analysis) of each step.
3. If time is left: a tile sweep of the backward kernels.

``--mosaic-parts "block_q,block_kv,stages,regs_c,regs_p;..."`` instead times
the Mosaic backward's pieces (the quantized forward, dK/dV, dQ with and
without the exact statistics, the statistics alone, dK/dV with dQ fused,
the whole recomputing backward) under each tiling, then exits.
``--variants``, ``--shapes`` and ``--check-variants`` narrow a run.

Every variant runs under try/except (a failure is printed and recorded);
a time budget keeps the run under ~6.5 minutes (what is cut is recorded).
Writes ``train_check.json`` under ``--out``; prints the speed table last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import sagejax
from sagejax import PRESETS, _inputs, quant, testing
from sagejax.backends import mosaic, pallas_triton
from sagejax.kernels import mosaic_backward as mb
from sagejax.kernels.mosaic_backward import MosaicBackwardTiling
from sagejax.bench.timing import TimingConfig, time_calls
from sagejax.kernels.triton_backward import BackwardTiling

START = time.perf_counter()
BUDGET_S = float(os.environ.get("SAGEJAX_BUDGET_S", 360.0))  # < 7 min in all
SAGE = PRESETS["sage2-8b"]
TIMING = TimingConfig(repeats=5, target_s=0.12, min_calls=3, max_calls=40)


def elapsed() -> float:
  return time.perf_counter() - START


def log(*a):
  print(f"[{elapsed():6.1f}s]", *a, file=sys.stderr, flush=True)


def poison(nbytes: int = 4 << 30):
  """Fills freed device memory with NaN (XLA reuses freed buffers)."""
  try:
    x = jnp.full((nbytes // 4,), jnp.nan, jnp.float32)
    x.block_until_ready()
    del x
  except Exception:  # pylint: disable=broad-except  # smaller device
    poison(nbytes // 4) if nbytes > 1 << 28 else None


@contextlib.contextmanager
def backward_tiling(tiling):
  """Backward tiles of the registered backend they belong to, while
  tracing."""
  backend = (mosaic.BACKEND if isinstance(tiling, MosaicBackwardTiling)
             else pallas_triton.BACKEND)
  old = backend.backward_tiling
  backend.backward_tiling = tiling
  try:
    yield
  finally:
    backend.backward_tiling = old


def default_tiling(h, impl="pallas", **changes):
  """The backend's default backward tiling with ``changes``."""
  if impl == "mosaic":
    return dataclasses.replace(mosaic.default_backward_tiling(
        max(64, 1 << (h - 1).bit_length()), changes.pop("fused_dq", False)),
                               **changes)
  return dataclasses.replace(pallas_triton.default_backward_tiling(h),
                             **changes)


# name: (config, "pallas" backward tiling changes[, implementation]).
VARIANTS = {
    "mosaic": (SAGE, {}, "mosaic"),
    "mosaic+saved": (SAGE.replace(backward_stats="saved"), {}, "mosaic"),
    "mosaic+recompute": (SAGE.replace(backward_stats="recompute"), {},
                         "mosaic"),
    "mosaic+smooth_v+saved": (SAGE.replace(smooth_v=True,
                                           backward_stats="saved"), {},
                              "mosaic"),
    "mosaic+recompute+fused-dq": (SAGE.replace(backward_stats="recompute"),
                                  {"fused_dq": True}, "mosaic"),
    "mosaic+saved+unfused-dq": (SAGE.replace(backward_stats="saved"),
                                {"fused_dq": False}, "mosaic"),
    "mosaic+unfused-dq": (SAGE, {"fused_dq": False}, "mosaic"),
    "default": (SAGE, {}),
    "saved": (SAGE.replace(backward_stats="saved"), {}),
    "recompute": (SAGE.replace(backward_stats="recompute"), {}),
    "int8": (SAGE.replace(backward_int8=True), {}),
    "int8+saved": (SAGE.replace(backward_int8=True, backward_stats="saved"),
                   {}),
    "atomic-dq": (SAGE, {"dq_atomic": True}),
    "saved+atomic-dq": (SAGE.replace(backward_stats="saved"),
                        {"dq_atomic": True}),
    "int8+saved+atomic-dq": (SAGE.replace(backward_int8=True,
                                          backward_stats="saved"),
                             {"dq_atomic": True}),
}


def sage_step(config, causal, impl="pallas", **kw):
  def step(q, k, v, do):
    def loss(q, k, v):
      out = sagejax.attention(q, k, v, is_causal=causal, config=config,
                              implementation=impl, **kw)
      return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
    return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)
  return step


def cudnn_step(causal):
  def step(q, k, v, do):
    def loss(q, k, v):
      out = jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                         implementation="cudnn")
      return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
    return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)
  return step


def inputs(b, s, n, kh, h, kind="normal", seed=0):
  q, k, v = testing.make_qkv(jax.random.PRNGKey(seed), b, s, s, n, kh, h,
                             kind, jnp.bfloat16)
  do = jax.random.normal(jax.random.PRNGKey(seed + 1), q.shape, jnp.bfloat16)
  return q, k, v, do


# ----------------------------------------------------------------------------
# 1. Correctness.
# ----------------------------------------------------------------------------

# (B, S, N, K, H, causal, extra attention kwargs)
CHECK_SHAPES = [
    (1, 4096, 8, 2, 128, True, {}),
    (1, 8192, 4, 4, 128, False, {}),
    (1, 4096, 8, 8, 64, False, {}),
    (1, 3000, 4, 1, 96, True, {"causal_alignment": "bottom_right",
                               "key_value_seq_lengths": (2900,)}),
]
CHECK_VARIANTS = ["mosaic", "mosaic+recompute", "mosaic+saved", "default",
                  "saved", "int8", "int8+saved", "atomic-dq"]


def variant(name):
  """(config, "pallas" tiling changes, implementation) of a variant."""
  config, tiles, *impl = VARIANTS[name]
  return config, tiles, (impl or ["pallas"])[0]


def check(results, quick):
  shapes = CHECK_SHAPES[:1] if quick else CHECK_SHAPES
  for b, s, n, kh, h, causal, extra in shapes:
    kw = {a: (jnp.array(x, jnp.int32) if "lengths" in a else x)
          for a, x in extra.items()}
    for kind in ("normal", "qkv_channel_bias"):
      if elapsed() > BUDGET_S * 0.35:
        results.append({"shape": [b, s, n, kh, h, causal], "data": kind,
                        "status": "skipped: time budget"})
        continue
      q, k, v, do = inputs(b, s, n, kh, h, kind, seed=s + h)
      ref = jax.jit(sage_step(SAGE, causal, impl="xla", **kw))
      _, want = ref(q, k, v, do)
      for name in CHECK_VARIANTS:
        config, tiles, impl = variant(name)
        row = {"shape": [b, s, n, kh, h, causal], "extra": extra,
               "data": kind, "variant": name}
        if elapsed() > BUDGET_S * 0.4:
          row["status"] = "skipped: time budget"
          results.append(row)
          continue
        try:
          with backward_tiling(default_tiling(h, impl, **tiles)
                               if tiles else None):
            fn = jax.jit(sage_step(config, causal, impl=impl, **kw))
            fn = fn.lower(q, k, v, do).compile()
          poison()
          _, got = fn(q, k, v, do)
          row["finite"] = bool(all(np.all(np.isfinite(np.asarray(
              g, np.float32))) for g in got))
          for g_name, g, w in zip(("dq", "dk", "dv"), got, want):
            m = testing.error_metrics(g, w)
            row[g_name] = {"cos": m["cos_sim"], "rel_l2": m["rel_l2"]}
          cos = min(row[g]["cos"] for g in ("dq", "dk", "dv"))
          # The default backward (and its atomic-dQ form) must keep cos >=
          # 0.999; the options are measured (their bounds: NOTES.md).
          bound = 0.999 if name in ("default", "atomic-dq", "mosaic",
                                    "mosaic+recompute",
                                    "mosaic+recompute+fused-dq",
                                    "mosaic+unfused-dq") else 0.95
          row["status"] = ("ok" if row["finite"] and cos >= bound
                           else f"FAIL (min cos {cos:.6f} < {bound})")
        except Exception as e:  # pylint: disable=broad-except
          traceback.print_exc()
          row["status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
        log("check", row["shape"], kind, name, row["status"],
            {g: round(row[g]["cos"], 6) for g in ("dq", "dk", "dv")
             if g in row})
        results.append(row)


# ----------------------------------------------------------------------------
# 2. Speed.
# ----------------------------------------------------------------------------

TIME_SHAPES = [  # (H, S, causal), B=2, N=32
    (128, 4096, False), (128, 4096, True), (128, 8192, False),
    (128, 8192, True), (128, 16384, False), (128, 16384, True),
    (64, 4096, False), (64, 4096, True), (64, 16384, False),
    (64, 16384, True),
]
QUICK_SHAPES = [(128, 4096, False), (128, 4096, True), (64, 4096, False)]
CORE = ["cudnn", "mosaic", "mosaic+recompute", "mosaic+saved", "default",
        "saved", "implementation=None"]
EXTRA = ["mosaic+unfused-dq", "mosaic+recompute+fused-dq", "int8+saved",
         "recompute", "int8", "atomic-dq", "saved+atomic-dq",
         "int8+saved+atomic-dq", "fwd:cudnn", "fwd:sage2-8b"]


def flops(b, n, s, h, causal):
  f = 3.5 * 4.0 * b * n * s * s * h
  return f / 2 if causal else f


def build(name, h, causal):
  if name == "implementation=None":  # what users get: the fastest forward
    return jax.jit(sage_step(SAGE, causal, impl=None)), None
  if name == "cudnn":
    return jax.jit(cudnn_step(causal)), None
  if name == "fwd:cudnn":
    return jax.jit(lambda q, k, v, do: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn")), None
  if name == "fwd:sage2-8b":
    return jax.jit(lambda q, k, v, do: sagejax.attention(
        q, k, v, is_causal=causal, implementation="pallas")), None
  config, tiles, impl = variant(name)
  return jax.jit(sage_step(config, causal, impl=impl)), (
      default_tiling(h, impl, **tiles) if tiles else None)


def time_one(name, fn, tiling, args, b, n, s, h, causal):
  row = {"variant": name, "H": h, "S": s, "causal": causal, "B": b, "N": n}
  try:
    t0 = time.perf_counter()
    with backward_tiling(tiling):
      compiled = fn.lower(*args).compile()
    row["compile_s"] = round(time.perf_counter() - t0, 1)
    try:
      ma = compiled.memory_analysis()
      row["temp_bytes"] = int(ma.temp_size_in_bytes)
    except Exception:  # pylint: disable=broad-except
      pass
    t = time_calls(compiled, [args], TIMING)
    row["ms"] = t.median_s * 1e3
    if not name.startswith("fwd:"):
      row["tflops"] = flops(b, n, s, h, causal) / t.median_s / 1e12
    row["status"] = "ok"
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    row["status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
  log("time", name, h, s, "causal" if causal else "", row.get("ms"),
      row["status"])
  return row


def speed(results, quick, shapes=None, variants=None):
  shapes = shapes or (QUICK_SHAPES if quick else TIME_SHAPES)
  extra = ["atomic-dq", "fwd:cudnn", "fwd:sage2-8b"] if quick else EXTRA
  core = CORE
  if variants:
    core, extra = variants, []
  b, n = 2, 32
  for group in (core, extra):
    for h, s, causal in shapes:
      if elapsed() > BUDGET_S * (0.8 if group is core else 0.9):
        results.extend({"variant": v, "H": h, "S": s, "causal": causal,
                        "status": "skipped: time budget"} for v in group)
        continue
      args = inputs(b, s, n, n, h)
      for name in group:
        if elapsed() > BUDGET_S:
          results.append({"variant": name, "H": h, "S": s, "causal": causal,
                          "status": "skipped: time budget"})
          continue
        fn, tiling = build(name, h, causal)
        results.append(time_one(name, fn, tiling, args, b, n, s, h, causal))
      del args


def mosaic_parts(results, shapes, tilings, parts=None):
  """The Mosaic backward's pieces alone (BTNH, B=2, N=32): the quantized
  forward, the dK/dV and dQ kernels under each tiling, and the whole backward
  as the custom VJP runs it (the forward's LSE as the statistics' estimate);
  ``parts``: the part names to time (default all)."""
  b, n = 2, 32
  f32 = jnp.float32
  for h, s, causal in shapes:
    q, k, v, do = inputs(b, s, n, n, h)
    lens = jnp.full((b,), s, jnp.int32)
    sm_scale = h ** -0.5
    c = sm_scale * quant.LOG2E
    forward = jax.jit(lambda q, k, v: mosaic.BACKEND.forward(
        _inputs.parse(q, k, v, is_causal=causal), SAGE))
    out, lse = forward(q, k, v)
    # Kernel inputs of realistic size and range (K, V not smoothed here).
    lse2 = lse * quant.LOG2E
    delta = jnp.swapaxes(jnp.sum(do.astype(f32) * out.astype(f32), -1), 1, 2)
    zeros, km = jnp.zeros_like(lse2), jnp.zeros((b, n, h), f32)
    common = dict(spec=_inputs.parse(q, k, v, is_causal=causal).spec, c=c,
                  sm_scale=sm_scale, layout="BTNH", dims=(b, n, s, h, n, s))
    fns = {"sage fwd": (forward, (q, k, v)),
           "backward": (jax.jit(lambda q, k, v, do, lse: (
               mosaic.BACKEND.backward(
                   _inputs.parse(q, k, v, is_causal=causal), SAGE, do,
                   jnp.zeros((b, n, s)), (None, lse))[:3])),
                        (q, k, v, do, lse))}
    for tiling in tilings:
      tag = (f"q{tiling.block_q} kv{tiling.block_kv} s{tiling.num_stages} "
             f"r{tiling.consumer_registers}/{tiling.producer_registers}")
      # pylint: disable=protected-access
      fns["dkdv " + tag] = (jax.jit(lambda *a, t=tiling: mb._dkdv(
          *a, lens, lens, tiling=t, **common)), (q, k, v, do, lse2, delta))
      fns["dq " + tag] = (jax.jit(lambda *a, t=tiling: mb._dq(
          *a, lens, lens, tiling=t, **common)),
                          (q, k, v, do, lse2, delta, zeros, km))
      fns["dq+stats " + tag] = (jax.jit(lambda q, k, v, do, lse2, t=tiling: (
          mb._dq(q, k, v, do, lse2, None, zeros, km, lens, lens,
                 tiling=t, **common))), (q, k, v, do, lse2 + 0.01))
      fns["stats " + tag] = (jax.jit(lambda q, k, v, do, lse2, t=tiling: (
          mb._dq(q, k, v, do, lse2, None, zeros, km, lens, lens,
                 tiling=t, stats_only=True, **common))),
                             (q, k, v, do, lse2 + 0.01))
      if tiling.block_q * h == 2 * mb.ROWS * mb.ROWS:

        def fused(q, k, v, do, lse2, delta, t=tiling):
          acc = jax.new_ref(jnp.zeros(q.shape, f32))
          dk, dv = mb._dkdv(q, k, v, do, lse2, delta, lens, lens, acc,
                            tiling=t, **common)
          return acc[...], dk, dv

        fns["dkdv+dq " + tag] = (jax.jit(fused), (q, k, v, do, lse2, delta))
      # pylint: enable=protected-access
    fl = 4.0 * b * n * s * s * h / (2 if causal else 1)
    for name, (fn, args) in fns.items():
      if parts is not None and name.split()[0] not in parts:
        continue
      if elapsed() > BUDGET_S:
        results.append({"part": name, "status": "skipped: time budget"})
        continue
      row = {"part": name, "H": h, "S": s, "causal": causal}
      try:
        t = time_calls(fn.lower(*args).compile(), [args], TIMING)
        row["ms"] = t.median_s * 1e3
        # matmuls (each 2·T·S·H): fwd 2, dK/dV 4, dQ 3, backward 9
        mm = {"sage": 2, "dkdv": 4, "dq": 3, "dq+stats": 4, "stats": 2,
              "dkdv+dq": 5, "backward": 7}[name.split()[0]]
        row["tflops"] = fl / 2 * mm / t.median_s / 1e12
        row["status"] = "ok"
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()
        row["status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
      log("part", name, h, s, causal, row.get("ms"), row.get("tflops"),
          row["status"])
      results.append(row)


SWEEP = {
    128: [(64, 128, 128, 64, 8, 2), (64, 64, 64, 64, 4, 2),
          (32, 128, 128, 32, 4, 3), (64, 128, 128, 64, 8, 1),
          (128, 64, 64, 128, 8, 2), (32, 64, 64, 32, 4, 3)],
    64: [(64, 128, 128, 64, 4, 3), (32, 128, 128, 32, 4, 3),
         (64, 64, 64, 64, 4, 3), (128, 128, 128, 128, 8, 2)],
    # Above H=128 (--sweep-h 256; NOTES B26): the default first, then its
    # nearest rivals and the FP32 inputs' tiles; dK and dV of block_k keys
    # take 2·block_k·256 f32 over the program's threads.
    256: [(64, 32, 64, 64, 4, 2), (64, 32, 64, 32, 4, 2),
          (32, 32, 64, 64, 4, 2), (64, 64, 64, 64, 8, 2),
          (32, 64, 64, 32, 4, 1)],
}
SWEEP_HEAD_DIMS = [128, 64]  # --sweep-h


def sweep(results, quick):
  if quick:
    return
  b, n, s = 2, 32, 4096
  for h in SWEEP_HEAD_DIMS:
    tiles = SWEEP[h]
    for causal in (False, True):
      args = inputs(b, s, n, n, h)
      for bq, bk, bq2, bk2, warps, stages in tiles:
        if elapsed() > BUDGET_S:
          return
        tiling = BackwardTiling(
            block_q=bq, block_k=bk, block_q_dq=bq2, block_k_dq=bk2,
            num_warps=warps, num_stages=stages, num_warps_dq=warps,
            num_stages_dq=stages)
        row = time_one("saved", jax.jit(sage_step(variant("saved")[0],
                                                  causal)), tiling, args, b,
                       n, s, h, causal)
        row["tiling"] = dataclasses.asdict(tiling)
        results.append(row)


# ----------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------


def table(rows):
  ok = [r for r in rows if r.get("status") == "ok"]
  ref = {(r["H"], r["S"], r["causal"]): r["ms"] for r in ok
         if r["variant"] == "cudnn"}
  fwd = {(r["variant"], r["H"], r["S"], r["causal"]): r["ms"] for r in ok
         if r["variant"].startswith("fwd:")}
  names = [v for v in CORE + EXTRA if not v.startswith("fwd:")]
  lines = ["train step ms (cuDNN: its TFLOPS; others: × cuDNN's speed); "
           "B=2 N=32 bf16; fwd = forward alone, ms"]
  header = ["H", "S", "causal"] + names + ["fwd cudnn", "fwd sage"]
  lines.append(" | ".join(header))
  keys = sorted({(r["H"], r["S"], r["causal"]) for r in rows if "H" in r},
                key=lambda x: (-x[0], x[1], x[2]))
  for key in keys:
    cells = [str(key[0]), f"{key[1] // 1024}k", "yes" if key[2] else "no"]
    for name in names:
      r = next((r for r in ok if r["variant"] == name and
                (r["H"], r["S"], r["causal"]) == key and "tiling" not in r),
               None)
      if r is None:
        cells.append("–")
        continue
      if name == "cudnn":
        cells.append(f"{r['ms']:.2f} ({r['tflops']:.0f} TF)")
        continue
      ratio = ref[key] / r["ms"] if key in ref else float("nan")
      cells.append(f"{r['ms']:.2f} ({ratio:.2f}x)")
    for f in ("fwd:cudnn", "fwd:sage2-8b"):
      v = fwd.get((f,) + key)
      cells.append("–" if v is None else f"{v:.2f}")
    lines.append(" | ".join(cells))
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="train_check_out")
  p.add_argument("--quick", action="store_true")
  p.add_argument("--skip-check", action="store_true")
  p.add_argument("--check-variants", default=None,
                 help="comma-separated backward variants to check")
  p.add_argument("--variants", default=None,
                 help="comma-separated variants to time (replaces the lists)")
  p.add_argument("--shapes", default=None,
                 help='shapes to time, "H,S,causal;..." (B=2, N=32)')
  p.add_argument("--no-sweep", action="store_true")
  p.add_argument("--sweep-h", default=None,
                 help="comma-separated head dims to sweep (of SWEEP's)")
  p.add_argument("--mosaic-parts", default=None,
                 help='time the Mosaic backward\'s pieces under tilings '
                 '"block_q,block_kv,stages,regs_c,regs_p;..." (then exit)')
  p.add_argument("--parts", default=None,
                 help="with --mosaic-parts: comma-separated part names to "
                 'time (e.g. "dkdv+dq,backward"; default all)')
  args = p.parse_args()
  if args.check_variants:
    CHECK_VARIANTS[:] = args.check_variants.split(",")
  if args.sweep_h:
    SWEEP_HEAD_DIMS[:] = [int(h) for h in args.sweep_h.split(",")]
  shapes = None
  if args.shapes:
    shapes = [(int(h), int(s), c in ("1", "True", "true", "causal"))
              for h, s, c in (x.split(",") for x in args.shapes.split(";"))]
  variants = args.variants.split(",") if args.variants else None
  os.makedirs(args.out, exist_ok=True)
  report = {"device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "quick": args.quick, "check": [], "speed": [], "sweep": []}
  path = os.path.join(args.out, "train_check.json")

  def save():
    with open(path, "w") as f:
      json.dump(report, f, indent=1, default=str)

  if args.mosaic_parts is not None:
    tilings = [MosaicBackwardTiling(*map(int, x.split(",")))
               for x in args.mosaic_parts.split(";") if x]
    report["parts"] = []
    mosaic_parts(report["parts"], shapes or QUICK_SHAPES,
                 tilings or [MosaicBackwardTiling()],
                 args.parts.split(",") if args.parts else None)
    save()
    for r in report["parts"]:
      if r.get("status") == "ok":
        mode = "causal" if r["causal"] else ""
        print(f"{r['H']:4d} {r['S'] // 1024:3d}k {mode:6s} {r['part']:32s} "
              f"{r['ms']:8.3f} ms {r['tflops']:6.0f} TF")
      else:
        print(r.get("part"), r.get("status"))
    return
  sections = (("check", check),
              ("speed", lambda rows, quick: speed(rows, quick, shapes,
                                                  variants)),
              ("sweep", sweep))
  for section, fn in sections:
    if (section == "check" and args.skip_check) or (
        section == "sweep" and args.no_sweep):
      continue
    try:
      fn(report[section], args.quick)
    except Exception:  # pylint: disable=broad-except
      traceback.print_exc()
    save()
  report["seconds"] = round(elapsed(), 1)
  save()
  print(f"device {report['device']}, JAX {report['jax']}, "
        f"{report['seconds']} s; wrote {path}")
  for r in report["check"]:
    if r.get("status") != "ok":
      print("check:", r.get("shape"), r.get("data"), r.get("variant"),
            r.get("status"))
  bad = [r for r in report["check"] if r.get("status") != "ok"]
  print(f"check: {len(report['check']) - len(bad)}/{len(report['check'])} ok;"
        " min cos per variant: " + ", ".join(
            f"{v} {min(min(r[g]['cos'] for g in ('dq', 'dk', 'dv')) for r in report['check'] if r.get('variant') == v and 'dq' in r):.5f}"  # noqa: E501
            for v in CHECK_VARIANTS
            if any(r.get("variant") == v and "dq" in r
                   for r in report["check"])))
  sw = [r for r in report["sweep"] if r.get("status") == "ok"]
  for r in sorted(sw, key=lambda r: (r["H"], r["causal"], r["ms"])):
    t = r["tiling"]
    print(f"sweep H={r['H']} causal={r['causal']}: {r['ms']:.2f} ms "
          f"({t['block_q']},{t['block_k']},{t['block_q_dq']},"
          f"{t['block_k_dq']}) w{t['num_warps']} s{t['num_stages']}")
  mem = [r for r in report["speed"] if r.get("S") == max(
      (x.get("S", 0) for x in report["speed"]), default=0)
         and "temp_bytes" in r and r.get("H") == 128 and not r["causal"]]
  for r in mem:
    print(f"planned temp memory {r['variant']} S={r['S']}: "
          f"{r['temp_bytes'] / 2**20:.0f} MiB")
  print(table(report["speed"]))


if __name__ == "__main__":
  main()

"""Which preset should ``config=None`` / ``"auto"`` mean on each backend?

  PYTHONPATH=$PWD python benchmarks/preset_sweep.py --out $OUT [--quick]

For every backend available here (``sagejax.backends.registry()``; on a GPU
its kernel backends, ``--backends`` to choose) and every preset, in ONE
process:

1. checks: the backend's output against the ``"xla"`` oracle and exact
   attention on a small call (finite, close), and that a NaN in Q shows as a
   NaN row (issue 12's rule);
2. accuracy: relative L1 against exact FP32 attention on ``normal`` and
   ``channel_bias`` data (``sagejax.testing.make_qkv``; B=2, N=8, T=S=4096,
   H=128, fp16: the README's accuracy setting);
3. speed: TOPS = 4·B·N·T·S·H / t end to end (quantization included), B=4,
   N=32, H=128, bf16, non-causal, S in ``--seqs`` (4k and 16k), beside
   ``jax.nn.dot_product_attention(implementation="cudnn")`` timed in the same
   process. Timing: compile, warm up, then per repeat many dispatches over
   rotating input sets (> 2x L2) and one block_until_ready; median of
   repeats (``sagejax.bench.timing``).

Then, per backend, the presets no other preset beats on both speed (every S)
and accuracy (both data kinds): the candidates for the backend's
``default_preset``. Writes ``preset_sweep.json`` under ``--out`` and prints
the table last. Each measurement is wrapped so one failure does not lose the
run. ``--quick``: S=4k only, fewer repeats (about 2 minutes on an H200).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import sagejax
from sagejax import PRESETS, backends, testing
from sagejax.bench import env
from sagejax.bench.timing import (TimingConfig, rotating_sets, time_calls,
                                  tree_bytes)

DATA = ("normal", "channel_bias")


def _tops(b, n, s, h, sec):
  return 4.0 * b * n * s * s * h / sec / 1e12


def _fail(what, e):
  msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}" if str(
      e).strip() else type(e).__name__
  print(f"  FAILED {what}: {msg}", flush=True)
  traceback.print_exc(limit=3)
  return msg


def check(name, preset):
  """Small-call correctness: vs xla and exact, and NaN propagation."""
  q, k, v = testing.make_qkv(jax.random.key(7), 2, 300, 300, 8, 2, 128,
                             "channel_bias", jnp.bfloat16)
  run = jax.jit(lambda q, k, v, impl: sagejax.attention(
      q, k, v, is_causal=True, config=preset, implementation=impl),
      static_argnums=3)
  got = run(q, k, v, name)
  want = run(q, k, v, "xla")
  exact = sagejax.exact_attention(q, k, v, is_causal=True)
  vs_xla = testing.error_metrics(got, want)["rel_l2"]
  vs_exact = testing.error_metrics(want, exact)["rel_l2"]
  ok = bool(np.all(np.isfinite(np.asarray(got, np.float32)))
            and vs_xla < 0.3 * vs_exact + 2e-3)
  bad = run(q.at[1, 100, 3, 5].set(jnp.nan), k, v, name)
  bad = ~np.isfinite(np.asarray(bad, np.float32))
  nan_ok = bool(bad[1, 100, 3].all() and bad.sum() == bad.shape[-1])
  return dict(vs_xla_rel_l2=vs_xla, xla_vs_exact_rel_l2=vs_exact,
              close=ok, nan_row=nan_ok)


def accuracy(name, preset, shape):
  b, n, s, h = shape
  out = {}
  for kind in DATA:
    q, k, v = testing.make_qkv(jax.random.key(11), b, s, s, n, n, h, kind,
                               jnp.float16)
    got = jax.jit(lambda q, k, v: sagejax.attention(
        q, k, v, config=preset, implementation=name))(q, k, v)
    exact = jax.jit(sagejax.exact_attention)(q, k, v)
    out[kind] = testing.error_metrics(got, exact)["rel_l1"]
  return out


def speed(fn, b, n, s, h, timing):
  q0 = testing.make_qkv(jax.random.key(0), b, s, s, n, n, h, "normal",
                        jnp.bfloat16)
  sets = [q0] + [testing.make_qkv(jax.random.key(i), b, s, s, n, n, h,
                                  "normal", jnp.bfloat16)
                 for i in range(1, rotating_sets(tree_bytes(q0), timing))]
  compiled = jax.jit(fn).lower(*q0).compile()
  t = time_calls(compiled, sets, timing)
  del sets
  return _tops(b, n, s, h, t.median_s)


def pareto(rows):
  """Presets no other preset beats on both speed (every S) and accuracy
  (every data kind); ``rows`` maps preset -> {"tops": {S: x}, "rel_l1": ...}.
  """
  def ge(a, b):  # a at least as good as b everywhere, better somewhere
    fast = [a["tops"][s] >= b["tops"][s] for s in b["tops"]]
    acc = [a["rel_l1"][d] <= b["rel_l1"][d] for d in b["rel_l1"]]
    strict = (any(a["tops"][s] > b["tops"][s] for s in b["tops"])
              or any(a["rel_l1"][d] < b["rel_l1"][d] for d in b["rel_l1"]))
    return all(fast) and all(acc) and strict

  complete = {p: r for p, r in rows.items()
              if r["tops"] and r["rel_l1"]
              and all(isinstance(x, float) for x in r["tops"].values())
              and all(isinstance(x, float) for x in r["rel_l1"].values())}
  return sorted(p for p, r in complete.items()
                if not any(ge(o, r) for q, o in complete.items() if q != p))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="out")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--seqs", default="4096,16384")
  ap.add_argument("--backends", default=None,
                  help="comma list; default: the available GPU backends on "
                       "a GPU (add xla to time the oracle there too), every "
                       "available backend elsewhere")
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--heads", type=int, default=32)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--acc-shape", default="2,8,4096,128",
                  help="B,N,S,H of the accuracy runs")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  seqs = [int(s) for s in args.seqs.split(",")]
  if args.quick:
    seqs = seqs[:1]
  timing = TimingConfig(repeats=3 if args.quick else 5,
                        target_s=0.05 if args.quick else 0.1,
                        l2_bytes=env.l2_bytes())
  acc_shape = tuple(int(x) for x in args.acc_shape.split(","))
  b, n, h = args.batch, args.heads, args.head_dim
  gpu = jax.devices()[0].platform == "gpu"
  names = args.backends.split(",") if args.backends else [
      k for k, be in backends.registry().items() if be.available()
      and (not gpu or be.platform is not None)]  # on a GPU: its kernels
  meta = dict(device=env.device_name(), jax=jax.__version__,
              date=datetime.date.today().isoformat(), batch=b, heads=n,
              head_dim=h, seqs=seqs, acc_shape=acc_shape,
              defaults={k: backends.default_preset(k) for k in names})
  print(f"{meta}", flush=True)
  start = time.perf_counter()
  result = {"meta": meta, "cudnn_tops": {}, "backends": {}}

  if gpu:
    for s in seqs:
      try:
        result["cudnn_tops"][s] = speed(
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, implementation="cudnn"), b, n, s, h, timing)
      except Exception as e:  # pylint: disable=broad-except
        result["cudnn_tops"][s] = _fail(f"cudnn S={s}", e)
      print(f"cudnn S={s}: {result['cudnn_tops'][s]}", flush=True)

  for name in names:
    rows = result["backends"].setdefault(name, {})
    for preset in PRESETS:
      row = rows.setdefault(preset, {"tops": {}, "rel_l1": {}})
      try:
        row["check"] = check(name, preset)
      except Exception as e:  # pylint: disable=broad-except
        row["check"] = _fail(f"{name} {preset} check", e)
      try:
        row["rel_l1"] = accuracy(name, preset, acc_shape)
      except Exception as e:  # pylint: disable=broad-except
        row["rel_l1"] = {"error": _fail(f"{name} {preset} accuracy", e)}
      for s in seqs:
        fn = (lambda q, k, v, name=name, preset=preset: sagejax.attention(
            q, k, v, config=preset, implementation=name))
        try:
          row["tops"][s] = speed(fn, b, n, s, h, timing)
        except Exception as e:  # pylint: disable=broad-except
          row["tops"][s] = _fail(f"{name} {preset} S={s}", e)
      print(f"{name} {preset}: {json.dumps(row)}  "
            f"[{time.perf_counter() - start:.0f}s]", flush=True)
    result.setdefault("pareto", {})[name] = pareto(rows)

  with open(os.path.join(args.out, "preset_sweep.json"), "w") as f:
    json.dump(result, f, indent=1, default=str)

  def cell(x, width, fmt):
    if not isinstance(x, float):
      return f"{'err':>{width}}"
    return format(x, f"{width}{fmt if x >= 10 else '.3g'}")

  def size(s):
    return f"{s // 1024}k" if s % 1024 == 0 else str(s)

  print(f"\n{meta['device']}, jax {meta['jax']}; TOPS end to end, B={b} "
        f"N={n} H={h} bf16; rel L1 vs exact, B,N,S,H={acc_shape} fp16")
  head = (f"{'backend':<8} {'preset':<9}"
          + "".join(f" {'TOPS ' + size(s):>9}" for s in seqs)
          + "".join(f" {'L1 ' + d:>16}" for d in DATA)
          + f" {'check':>6} {'NaN':>4}")
  print(head)
  if result["cudnn_tops"]:
    print(f"{'cuDNN':<8} {'bf16':<9}" + "".join(
        f" {cell(result['cudnn_tops'][s], 9, '.0f')}" for s in seqs))
  for name, rows in result["backends"].items():
    for preset, row in rows.items():
      chk = row.get("check")
      ok = chk.get("close") if isinstance(chk, dict) else None
      nan = chk.get("nan_row") if isinstance(chk, dict) else None
      print(f"{name:<8} {preset:<9}"
            + "".join(f" {cell(row['tops'].get(s), 9, '.0f')}" for s in seqs)
            + "".join(f" {cell(row['rel_l1'].get(d), 16, '.5f')}"
                      for d in DATA)
            + f" {str(ok):>6} {str(nan):>4}")
    print(f"  {name}: not beaten on both: {result['pareto'][name]}; "
          f"declared default_preset: {meta['defaults'][name]}")
  print(f"total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
  main()

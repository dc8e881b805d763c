"""One call of a step, bracketed for Nsight Compute (``ncu``).

  ncu --profile-from-start off -k regex:entry_mosaic --set full -o r \
      python benchmarks/ncu_step.py --step train --shape 2,4096,32,128,0

Compiles and runs the step (``profile_step.step_fn``: ``train``,
``forward``, ``cudnn-train``, ``cudnn-forward``) ``--warmup`` times, then
runs it once more between ``cuProfilerStart`` and ``cuProfilerStop`` (the
CUDA driver's), so that ``ncu --profile-from-start off`` sees only that
call's kernels. Reading the reports:

* ``--summarize SRC.csv`` (``ncu --import R --page source --print-source
  sass --csv``): stall samples per opcode and reason, and the top
  instructions;
* ``--phases SRC.csv --count N --cuts 0x2e30,0x3b20``: the instructions
  executed N times (a loop body: N = CTAs x warps x trips), split at the
  given offsets from the kernel's first instruction, with each part's share
  of the loop's stall samples by reason;
* ``--details DETAILS.csv --pick 0,3``: ``ncu --page details --csv`` of
  several reports side by side (the kernels listed first, then the metrics
  of the picked ones).
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import sys


def run_step(step: str, shape: str, warmup: int) -> None:
  import jax
  import jax.numpy as jnp

  sys.path.insert(0, __file__.rsplit("/", 1)[0])
  from profile_step import step_fn  # pylint: disable=import-outside-toplevel
  from sagejax import testing

  b, s, n, h, causal = (int(x) for x in shape.split(","))
  q, k, v = testing.make_qkv(jax.random.PRNGKey(0), b, s, s, n, n, h,
                             "normal", jnp.bfloat16)
  do = jax.random.normal(jax.random.PRNGKey(1), q.shape, jnp.bfloat16)
  fn = step_fn(step, bool(causal))
  for _ in range(warmup):
    jax.block_until_ready(fn(q, k, v, do))
  cuda = ctypes.CDLL("libcuda.so.1")
  cuda.cuProfilerStart()
  jax.block_until_ready(fn(q, k, v, do))
  cuda.cuProfilerStop()


def _number(x: str) -> float:
  try:
    return float(x.replace(",", ""))
  except ValueError:
    return 0.0


def _source_rows(path: str):
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  header_at = next(i for i, r in enumerate(rows) if "Source" in r)
  header = rows[header_at]
  body = [r for r in rows[header_at + 1:] if len(r) == len(header)]
  return header, body


def summarize(path: str, top: int = 40) -> None:
  """Stall samples by opcode and by reason, and the top instructions, from
  ``ncu --import R --page source --print-source sass --csv``."""
  header, body = _source_rows(path)
  col = {name: i for i, name in enumerate(header)}
  samples = next(c for c in header if c.startswith("Warp Stall Sampling (All"))
  reasons = [c for c in header if c.startswith("stall_") or
             c.startswith("Stall ")]
  print(f"{len(body)} instructions; columns: {len(header)}")
  total = sum(_number(r[col[samples]]) for r in body) or 1.0
  by_op = collections.Counter()
  by_reason = collections.Counter()
  for r in body:
    op = r[col["Source"]].split()[0] if r[col["Source"]].split() else "?"
    if op.startswith("@"):
      op = r[col["Source"]].split()[1]
    by_op[op.split(".")[0]] += _number(r[col[samples]])
    for c in reasons:
      by_reason[c] += _number(r[col[c]])
  print(f"\nsamples {total:.0f}; by opcode (share of all samples):")
  for op, n in by_op.most_common(25):
    print(f"  {op:16s} {100 * n / total:5.1f}%")
  print("\nby stall reason:")
  for c, n in by_reason.most_common(20):
    print(f"  {c:40s} {100 * n / total:5.1f}%")
  print(f"\ntop {top} instructions:")
  ranked = sorted(body, key=lambda r: -_number(r[col[samples]]))[:top]
  for r in ranked:
    worst = sorted(((c, _number(r[col[c]])) for c in reasons),
                   key=lambda x: -x[1])[:3]
    why = ", ".join(f"{c.replace('stall_', '')} {n:.0f}" for c, n in worst
                    if n)
    print(f"  {r[col.get('Address', 0)]:>6s} {100 * _number(r[col[samples]]) / total:5.1f}%"
          f"  {r[col['Source']][:60]:60s} {why}")


def phases(path: str, count: int, cuts: list[int]) -> None:
  """Stall samples of a loop body (instructions executed ``count`` times),
  split at ``cuts`` (byte offsets from the first instruction)."""
  header, body = _source_rows(path)
  col = {name: i for i, name in enumerate(header)}
  reasons = [c for c in header
             if c.startswith("stall_") and "Not Issued" not in c]
  base = int(body[0][col["Address"]], 16)
  parts = collections.defaultdict(collections.Counter)
  sizes = collections.Counter()
  for r in body:
    if _number(r[col["Instructions Executed"]]) != count:
      continue
    offset = int(r[col["Address"]], 16) - base
    part = sum(offset >= c for c in cuts)
    sizes[part] += 1
    for c in reasons:
      parts[part][c] += _number(r[col[c]])
  total = sum(sum(p.values()) for p in parts.values()) or 1.0
  for part in sorted(parts):
    top = ", ".join(f"{c[6:]} {100 * n / total:.1f}"
                    for c, n in parts[part].most_common(6))
    print(f"part {part} ({sizes[part]} instructions): "
          f"{100 * sum(parts[part].values()) / total:5.1f}%  {top}")


def details(path: str, pick: list[int]) -> None:
  """Metrics of the picked kernels of a details-page CSV, side by side."""
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  header, report, kernels, order = None, -1, {}, []
  for r in rows:
    if r and r[0] == "ID":
      header, report = r, report + 1
      continue
    if header is None or len(r) < 15:
      continue
    d = dict(zip(header, r))
    key = (report, d["ID"], d["Kernel Name"][:40], d["Grid Size"])
    metrics = kernels.setdefault(key, {})
    if d["Metric Name"]:
      name = (d["Section Name"], d["Metric Name"])
      metrics[name] = d["Metric Value"] + d["Metric Unit"][:6]
      if name not in order:
        order.append(name)
  keys = list(kernels)
  for i, key in enumerate(keys):
    print(i, key)
  chosen = [keys[i] for i in pick]
  for name in order:
    values = [kernels[k].get(name, "") for k in chosen]
    if any(values):
      print(f"{name[0][:18]:18s} {name[1][:42]:42s} "
            + " | ".join(f"{v:>16s}" for v in values))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--step", default="train")
  p.add_argument("--shape", default="2,4096,32,128,0")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--summarize", default=None,
                 help="a source-page CSV to summarize instead of running")
  p.add_argument("--phases", default=None, help="a source-page CSV")
  p.add_argument("--count", type=int, default=0)
  p.add_argument("--cuts", default="")
  p.add_argument("--details", default=None, help="a details-page CSV")
  p.add_argument("--pick", default="0")
  args = p.parse_args()
  if args.summarize:
    summarize(args.summarize)
  elif args.phases:
    phases(args.phases, args.count,
           [int(x, 16) for x in args.cuts.split(",") if x])
  elif args.details:
    details(args.details, [int(x) for x in args.pick.split(",")])
  else:
    run_step(args.step, args.shape, args.warmup)


if __name__ == "__main__":
  main()

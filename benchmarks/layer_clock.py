"""Attention's device time inside a transformer layer's loop (GPU only).

    PYTHONPATH=$PWD python benchmarks/layer_clock.py [--shapes "B,S,N,H;..."]
        [--layers 8] [--rounds 5] [--without-matmuls] [--clock-probe]
        [--out DIR]

Timed alone, attention runs at clocks set by its own power draw: in short
blocks near the device's top clock, back to back at its power cap, and cuDNN
and sagejax throttle differently (benchmarks/NOTES.md, Mosaic sections 45
and 52). In a model it runs between projections and an MLP, whose matmuls
set the clocks. Here each layer is an RMS norm and a QKV projection
(``jit_project``), attention (``jit_attend``: sagejax's default, cuDNN's bf16,
or ``none``, a cheap stand-in), and an output projection with a 4x GELU MLP
(``jit_mlp``), d_model = N·H. For each shape, blocks of ``--layers`` layers
run back to back under one profiler trace, the three variants in a shuffled
order each of ``--rounds`` rounds; attention's time is the sum of its own
module's kernels per layer (gaps between them not counted), its median over
the rounds. Attention alone, in shuffled device-time rounds, is timed in the
same process beside it. ``--without-matmuls`` also times layers whose
projections and MLP are elementwise ops of the same shapes: whether what
changes attention's time in layers is the matmuls (section 53: it is).
``--clock-probe`` runs a kernel of a fixed count of clocks right before and
after attention in every layer and reads the SM clock there from its
duration. Prints a table; writes ``layer_clock.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import numpy as np

import sagejax
from sagejax import testing
from sagejax.bench import device_time

VARIANTS = ("sagejax", "cudnn", "none")
PROBE_FMAS = 4096  # ~10 µs of one warp's dependent multiply-adds
TOP_CLOCK_MHZ = 1980  # the H100's and H200's highest SM clock


def _probe_kernel(x_ref, o_ref):
  o_ref[...] = lax.fori_loop(0, PROBE_FMAS,
                             lambda _, a: a * 0.999999 + 1e-6, x_ref[...])


def clock_probe(name: str):
  """A jitted ``f(x: f32[32]) -> f32[32]`` (module ``jit_<name>``): one
  program of one warp running a chain of ``PROBE_FMAS`` dependent
  multiply-adds, a fixed count of clocks, so that its duration reads the SM
  clock at that point of a stream (interpreted off the GPU)."""
  call = pl.pallas_call(
      _probe_kernel, out_shape=jax.ShapeDtypeStruct((32,), jnp.float32),
      interpret=jax.default_backend() != "gpu",
      compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
      name=name)

  def probe(x):
    return call(x)

  probe.__name__ = name
  return jax.jit(probe)


def attention_fn(variant: str):
  """``(q, k, v) -> out``, ``[B, T, N, H]``, for one variant."""
  if variant == "sagejax":
    return lambda q, k, v: sagejax.attention(q, k, v)
  if variant == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="cudnn")
  if variant == "none":  # an elementwise stand-in of attention's shape
    return lambda q, k, v: q + v
  raise ValueError(f"variant {variant!r}: pass one of {VARIANTS}.")


def layer_stack(b: int, t: int, n: int, h: int, variant: str,
                matmuls: bool = True, probes: bool = False):
  """``(run(x, layers) -> x, x)``: ``layers`` transformer layers on
  ``x [B, T, N·H]`` bf16, attention by ``variant``, one weight set shared by
  all layers (what is timed is the kernels, not the weights' values).
  ``matmuls=False``: the projections and the MLP become elementwise ops of
  the same shapes (a control: attention's neighbours without their power
  draw). ``probes``: a :func:`clock_probe` right before attention
  (``jit_probe_before``) and right after it (``jit_probe_after``)."""
  d = n * h
  keys = jax.random.split(jax.random.PRNGKey(0), 5)

  def weight(key, rows, cols):
    w = jax.random.normal(key, (rows, cols), jnp.float32) / np.sqrt(rows)
    return w.astype(jnp.bfloat16)

  w_qkv, w_out = weight(keys[0], d, 3 * d), weight(keys[1], d, d)
  w_up, w_down = weight(keys[2], d, 4 * d), weight(keys[3], 4 * d, d)

  def project(x):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)
    xb = xf.astype(jnp.bfloat16)
    if not matmuls:
      return tuple((xb * c).reshape(b, t, n, h) for c in (1.0, 0.5, 0.25))
    y = (xb @ w_qkv).reshape(b, t, 3, n, h)
    return y[:, :, 0], y[:, :, 1], y[:, :, 2]

  def attend(q, k, v):
    return attention_fn(variant)(q, k, v)

  def mlp(o, x):
    if not matmuls:
      return (x + o.reshape(b, t, d)) * 0.5
    x = x + o.reshape(b, t, d) @ w_out
    return (x + jax.nn.gelu(x @ w_up) @ w_down) * 0.5

  project, attend, mlp = jax.jit(project), jax.jit(attend), jax.jit(mlp)
  probe_x = jnp.ones((32,), jnp.float32)
  before, after = ((clock_probe("probe_before"), clock_probe("probe_after"))
                   if probes else (None, None))

  def run(x, layers: int):
    for _ in range(layers):
      q, k, v = project(x)
      if probes:  # the stream runs it between the projection and attention
        before(probe_x)
      o = attend(q, k, v)
      if probes:
        after(probe_x)
      x = mlp(o, x)
    return x

  x = jax.random.normal(keys[4], (b, t, d), jnp.bfloat16)
  return run, x


def attention_in_layers(shape, layers: int, rounds: int,
                        gap_s: float = 0.05, matmuls: bool = True,
                        probes: bool = False) -> dict:
  """Per variant: attention's kernels' µs per layer (one value a round)
  and each of its kernels' µs per layer by name (medians); with
  ``probes``, the clock probes' µs before and after attention (one value a
  round, the mean over its layers)."""
  runs = {}
  for variant in VARIANTS:
    run, x = layer_stack(*shape, variant, matmuls, probes)
    jax.block_until_ready(run(x, 2))
    runs[variant] = (run, x)
  order = []
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for round_order in device_time.round_orders(VARIANTS, rounds):
        for variant in round_order:
          run, x = runs[variant]
          jax.block_until_ready(run(x, layers))
          time.sleep(gap_s)
          order.append(variant)
    # A stray event in a gap (the profiler's own copies) is no block.
    blocks = [blk for blk in device_time.module_blocks(d, gap_s * 1e6 / 3)
              if "jit_attend" in blk]
  if len(blocks) != len(order):
    raise RuntimeError(f"{len(blocks)} blocks of kernels in the trace for "
                       f"{len(order)} run")
  out = {v: {"attention_us": [], "kernels": {}, "probe_before_us": [],
             "probe_after_us": []} for v in VARIANTS}
  for variant, blk in zip(order, blocks):
    kernels = blk.get("jit_attend", {})
    out[variant]["attention_us"].append(sum(kernels.values()) / layers)
    for where in ("before", "after") if probes else ():
      probe = blk.get(f"jit_probe_{where}", {})
      out[variant][f"probe_{where}_us"].append(sum(probe.values()) / layers)
    for name, us in kernels.items():
      out[variant]["kernels"].setdefault(name, []).append(us / layers)
  for v in VARIANTS:
    out[v]["kernels"] = {k: float(np.median(x))
                         for k, x in out[v]["kernels"].items()}
  return out


def attention_alone(shape, rounds: int) -> dict[str, float]:
  """µs per call of sagejax's and cuDNN's attention alone (device time,
  shuffled rounds, :func:`sagejax.bench.device_time.interleaved`)."""
  b, t, n, h = shape
  q, k, v = testing.make_qkv(jax.random.PRNGKey(1), b, t, t, n, n, h,
                             "normal", jnp.bfloat16)
  fns = {name: jax.jit(attention_fn(name)) for name in ("sagejax", "cudnn")}
  for f in fns.values():
    jax.block_until_ready(f(q, k, v))
  calls = 20 if t <= 4096 else 5
  per_call = device_time.interleaved(fns, [(q, k, v)], rounds, calls)
  return {name: float(np.median(x)) * 1e6 for name, x in per_call.items()}


def probe_clocks(row: dict) -> dict[str, dict[str, float]]:
  """``{"<mode> <variant>": {"before": MHz, "after": MHz}}`` of one shape's
  probes (medians over rounds), taking the shortest probe of the shape as
  run at ``TOP_CLOCK_MHZ`` (the clock is then at most that)."""
  medians = {}
  for mode in ("in_layers", "without_matmuls"):
    for variant, res in (row.get(mode) or {}).items():
      for where in ("before", "after"):
        values = res.get(f"probe_{where}_us") or []
        if values:
          medians.setdefault(f"{mode} {variant}", {})[where] = float(
              np.median(values))
  if not medians:
    return {}
  shortest = min(min(x.values()) for x in medians.values())
  return {key: {where: TOP_CLOCK_MHZ * shortest / us
                for where, us in x.items()} for key, x in medians.items()}


def print_probes(rows: list[dict]) -> None:
  print("\n| B,S,N,H | layers, attention | SM clock before attention, MHz "
        "| after |")
  print("|---|---|---|---|")
  for row in rows:
    for key, mhz in probe_clocks(row).items():
      print(f"| {','.join(map(str, row['shape']))} | {key} | "
            f"{mhz['before']:.0f} | {mhz['after']:.0f} |")


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default="4,1024,32,128;4,4096,32,128;"
                 "4,16384,32,128;4,16384,32,64")
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--out", default=os.environ.get("OUT", "layer_clock_out"))
  p.add_argument("--without-matmuls", action="store_true",
                 help="also time layers whose projections and MLP are "
                      "elementwise ops (is it the matmuls' clocks?)")
  p.add_argument("--clock-probe", action="store_true",
                 help="run a fixed-clock-count probe kernel right before "
                      "and after attention in every layer; its duration "
                      "reads the SM clock there")
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  rows = []
  for text in args.shapes.split(";"):
    shape = tuple(int(x) for x in text.split(","))
    layers = args.layers * max(1, 4096 // shape[1])  # blocks of ≥ ~10 ms
    in_layers = attention_in_layers(shape, layers, args.rounds,
                                    probes=args.clock_probe)
    light = (attention_in_layers(shape, layers, args.rounds, matmuls=False,
                                 probes=args.clock_probe)
             if args.without_matmuls else None)
    alone = attention_alone(shape, max(args.rounds, 6))
    rows.append(dict(shape=shape, layers=layers, in_layers=in_layers,
                     without_matmuls=light, alone_us=alone))
    with open(os.path.join(args.out, "layer_clock.json"), "w") as f:
      json.dump(rows, f, indent=1)
  print("\n| B,S,N,H | in layers: sagejax µs | cuDNN µs | × cuDNN "
        "| alone: sagejax µs | cuDNN µs | × cuDNN |")
  print("|---|---|---|---|---|---|---|")
  for row in rows:
    med = {v: float(np.median(row["in_layers"][v]["attention_us"]))
           for v in ("sagejax", "cudnn")}
    alone = row["alone_us"]
    print(f"| {','.join(map(str, row['shape']))} | {med['sagejax']:.1f} | "
          f"{med['cudnn']:.1f} | {med['cudnn'] / med['sagejax']:.3f} | "
          f"{alone['sagejax']:.1f} | {alone['cudnn']:.1f} | "
          f"{alone['cudnn'] / alone['sagejax']:.3f} |")
  for row in rows:
    if row["without_matmuls"]:
      med = {v: float(np.median(row["without_matmuls"][v]["attention_us"]))
             for v in ("sagejax", "cudnn")}
      print(",".join(map(str, row["shape"])), "in layers without matmuls, "
            f"µs: sagejax {med['sagejax']:.1f}, cuDNN {med['cudnn']:.1f}, "
            f"× cuDNN {med['cudnn'] / med['sagejax']:.3f}")
  if args.clock_probe:
    print_probes(rows)
  for row in rows:
    kernels = row["in_layers"]["sagejax"]["kernels"]
    top = sorted(kernels.items(), key=lambda x: -x[1])[:4]
    print(",".join(map(str, row["shape"])), "sagejax's kernels in layers, "
          "µs:", {name[:48]: round(us, 1) for name, us in top})


if __name__ == "__main__":
  main()

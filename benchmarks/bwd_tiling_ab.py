"""Mosaic backward tilings side by side in one process.

  PYTHONPATH=$PWD python benchmarks/bwd_tiling_ab.py \
      --variants "turns:dq_turns=1;..." [--out DIR]

Each variant replaces fields of the default fused backward tiling
(``mosaic.default_backward_tiling(h, fused_dq=True)``; "base" is the
default itself); with ``--triton``, of the Triton backward's
(``pallas_triton.default_backward_tiling(h)``, e.g. ``--triton --shapes
"256,4096,1,32" --variants "uf:unmasked_first=1"``), the step then run
with ``implementation="pallas"``. First the gradients of
``sagejax.attention`` under each variant against exact FP32 attention
(cosine of dQ, dK, dV; fresh data),
then training steps (``value_and_grad`` of sum(out·dO), B=2, N=32, bf16)
beside cuDNN's (each variant's gradients on the timed inputs first
compared with cuDNN's), in short blocks of calls, the variants in turn, each round
starting at another one (median ms per call over the blocks).
"""
import argparse
import dataclasses, json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
import sagejax
from sagejax import testing
from sagejax.backends import mosaic, pallas_triton

OUT = os.environ.get("OUT", ".")
VARIANTS = {"base": {}}
SPEED_SHAPES = [(128, 4096, False, 32), (128, 8192, False, 32),
                (128, 16384, False, 32), (64, 4096, False, 32),
                (64, 16384, False, 32), (128, 4096, False, 8)]
NO_ACCURACY = False
BACKEND = mosaic.BACKEND  # --triton: pallas_triton.BACKEND

def tiling_for(h, name):
  if BACKEND is mosaic.BACKEND:
    base = mosaic.default_backward_tiling(h, fused_dq=True)
  else:
    base = pallas_triton.default_backward_tiling(h)
  fields = {k: bool(v) if isinstance(getattr(base, k), bool) else v
            for k, v in VARIANTS[name].items()}
  return dataclasses.replace(base, **fields)

def make_step(h, name, causal):
  def loss(q, k, v, do):
    impl = "pallas" if BACKEND is pallas_triton.BACKEND else None
    o = sagejax.attention(q, k, v, is_causal=causal, implementation=impl)
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
  return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))

def cudnn_step(causal):
  def loss(q, k, v, do):
    o = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
  return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))

def exact_grads(q, k, v, do, causal):
  def loss(q, k, v):
    o = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                     v.astype(jnp.float32), is_causal=causal)
    return jnp.sum(o * do.astype(jnp.float32))
  return jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)

def cos(a, b):
  a = np.asarray(a, np.float64).ravel(); b = np.asarray(b, np.float64).ravel()
  return float(a @ b / np.sqrt((a @ a) * (b @ b)))

def compiled(h, name, causal, args):
  old = BACKEND.backward_tiling
  BACKEND.backward_tiling = tiling_for(h, name)
  try:
    f = make_step(h, name, causal)
    jax.block_until_ready(f(*args))
  finally:
    BACKEND.backward_tiling = old
  return f

def main():
  rows = []
  # 1. accuracy vs exact (fresh data per case), each variant
  cases = ([("normal", True, (1, 2048, 8, 2, 256)),
            ("qkv_channel_bias", True, (1, 1000, 8, 8, 256)),
            ("channel_bias", False, (2, 1000, 8, 2, 256))]
           if BACKEND is pallas_triton.BACKEND else
           [("normal", False, (1, 2048, 8, 8, 128)), ("qkv_channel_bias", False, (1, 2048, 8, 8, 128)),
            ("channel_bias", False, (2, 1000, 8, 2, 128)), ("normal", False, (1, 1000, 4, 4, 64)),
            ("qkv_channel_bias", True, (1, 2048, 8, 8, 128)),
            # the last round's tiles split (split_last_round, NOTES B35)
            ("qkv_channel_bias", False, (2, 1024, 20, 10, 128))])
  for kind, causal, shape in [] if NO_ACCURACY else cases:
    b, t, n, kh, h = shape
    q, k, v = testing.make_qkv(jax.random.key(int(time.time()) % 1000), b, t, t, n, kh, h, kind, jnp.bfloat16)
    do = jax.random.normal(jax.random.key(7), q.shape, jnp.bfloat16)
    ref = exact_grads(q, k, v, do, causal)
    for name in VARIANTS:
      try:
        g = compiled(h, name, causal, (q, k, v, do))(q, k, v, do)[1]
        cs = [cos(x, y) for x, y in zip(g, ref)]
        nan = any(bool(jnp.isnan(x).any()) for x in g)
        print(f"acc {kind:16s} causal={causal} {shape} {name:6s} cos dq/dk/dv {cs[0]:.6f} {cs[1]:.6f} {cs[2]:.6f} nan={nan}", flush=True)
        rows.append(dict(what="acc", kind=kind, causal=causal, shape=shape, variant=name, cos=cs, nan=nan))
      except Exception as e:
        print("acc", name, type(e).__name__, str(e)[:300], flush=True)

  # 2. speed, alternating
  def timeit(f, args, n):  # the previous block has been waited for
    t0 = time.perf_counter()
    for _ in range(n):
      r = f(*args)
    jax.block_until_ready(r)
    return (time.perf_counter() - t0) / n * 1e3

  for h, s, causal, kh in SPEED_SHAPES:
    b, n = 2, 32
    q, k, v = testing.make_qkv(jax.random.key(1), b, s, s, n, kh, h, "normal", jnp.bfloat16)
    do = jax.random.normal(jax.random.key(2), q.shape, jnp.bfloat16)
    args = (q, k, v, do)
    fns = {"cudnn": cudnn_step(causal)}
    for name in VARIANTS:
      print(f"compile H={h} S={s} causal={causal} {name}", flush=True)
      try:
        fns[name] = compiled(h, name, causal, args)
      except Exception as e:
        print("compile", name, type(e).__name__, str(e)[:300], flush=True)
    for f in fns.values():  # warm
      jax.block_until_ready(f(*args))
    # Check what is timed: each variant's gradients on these inputs against
    # cuDNN's (a kernel that skips work can be fast; NOTES B35).
    ref = fns["cudnn"](*args)[1]
    for name in (name for name in fns if name != "cudnn"):
      cs = [cos(x, y) for x, y in zip(fns[name](*args)[1], ref)]
      print(f"check H={h} S={s} causal={causal} {name}: cos vs cudnn "
            f"dq/dk/dv {cs[0]:.6f} {cs[1]:.6f} {cs[2]:.6f}", flush=True)
      rows.append(dict(what="check", h=h, s=s, causal=causal, variant=name,
                       cos_vs_cudnn=cs))
    times = {name: [] for name in fns}
    names = list(fns)
    # Short blocks of calls, the variants in turn, each round starting at
    # another: with long blocks in a fixed order, a step timed right after
    # cuDNN's, or last in a cycle, measured slow (NOTES B16); short rotated
    # blocks spread what came before over every variant (not yet run).
    rounds, calls = (10, 3) if s > 8192 else (20, 5)
    for rep in range(rounds):
      for name in names[rep % len(names):] + names[:rep % len(names)]:
        times[name].append(timeit(fns[name], args, calls))
    med = {name: float(np.median(ts)) for name, ts in times.items()}
    line = " ".join(f"{name} {ms:.3f} ms ({med['cudnn'] / ms:.3f}x)" for name, ms in med.items())
    print(f"speed H={h} S={s} causal={causal} kv_heads={kh}: {line}", flush=True)
    rows.append(dict(what="speed", h=h, s=s, causal=causal, times=times, median=med))
  json.dump(rows, open(f"{OUT}/bwd_ab.json", "w"), indent=1)


if __name__ == "__main__":
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--variants", default="turns:dq_turns=1")
  p.add_argument("--out", default=OUT)
  p.add_argument("--shapes", default=None,
                 help='"H,S,causal,kv_heads;..." to time (B=2, N=32)')
  p.add_argument("--no-accuracy", action="store_true")
  p.add_argument("--triton", action="store_true",
                 help="variants of the Triton backward's tiling instead")
  args = p.parse_args()
  OUT = args.out
  NO_ACCURACY = args.no_accuracy
  if args.triton:
    BACKEND = pallas_triton.BACKEND
  if args.shapes:
    SPEED_SHAPES = [tuple(int(x) for x in item.split(","))
                    for item in args.shapes.split(";") if item]
  for item in filter(None, args.variants.split(";")):
    name, _, fields = item.partition(":")
    VARIANTS[name] = {k: int(v) for k, v in
                      (f.split("=") for f in fields.split(",") if f)}
  main()

"""Many GPUs: check and time ring attention and sharded sagejax.attention.

  PYTHONPATH=$PWD python benchmarks/multi_gpu_check.py --out $OUT [--quick]

Runs on any number P >= 1 of GPUs of one host (written for 2 or 4 H200s),
in one process:

1. Correctness (poisoned outputs: NaN buffers of the output's size are freed
   just before each checked call, so an unwritten row shows): ring attention
   (non-causal, causal contiguous, causal zig-zag) vs single-device
   ``sagejax.attention`` and exact FP32 attention; ring gradients vs exact
   gradients; sharded-batch/heads ``jit`` vs unsharded, and no all-gather in
   its compiled program.
2. Ring throughput at S = 64k..256k total, B=1, N=32, H=128, bf16, as a
   fraction of P × the single-GPU ``sagejax.attention`` throughput at the
   per-device length S/P (same backend, same causality; target >= 0.9).
   TOPS = 4·B·N·S²·H / t (halved when causal). Zig-zag is timed on data kept
   in zig-zag order (``ring_attention(order="zigzag")`` in a ``shard_map``).
3. Bytes on the ring per step (INT8 K + FP8 V + scales) vs a bf16 ring, and
   the time of one step's transfer alone beside the time of one step's
   compute (the transfer is hidden when it is shorter).
4. Sharded batch / heads scaling: P devices on P× the batch (or heads) vs
   one device on one share (target >= 0.95 of linear).

Both ``implementation="pallas"`` and whatever ``implementation=None`` picks
are run (the latter fully only where it resolves to another backend).
NCCL_NVLS_ENABLE=0 is set (this machine forbids NVLink multicast), and XLA's
latency-hiding scheduler is on. Each variant is wrapped in try/except; the
ring timings run last and stop at a time budget (< 7 min in all); the table
is printed last; JSON goes to ``--out``.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                           "--xla_gpu_enable_latency_hiding_scheduler=true"
                           ).strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import sagejax  # noqa: E402
from sagejax import _inputs, backends, resolve_config, ring, testing  # noqa: E402

SEQ = P(None, "seq")


def timeit(fn, args, reps=3, target_s=0.4):
  """Median seconds per call: warm up, then per repeat several dispatches
  and one block_until_ready."""
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  one = time.perf_counter() - t0
  iters = int(max(1, min(20, round(target_s / max(one, 1e-6)))))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters)
  return statistics.median(times)


def tops(b, n, s, h, causal, sec):
  return 4 * b * n * s * s * h / sec / (2 if causal else 1) / 1e12


def poison(shape, sharding):
  """NaN buffers of the output's size on every device, freed at once."""
  x = jax.device_put(jnp.full(shape, jnp.nan, jnp.float32), sharding)
  jax.block_until_ready(x)
  del x


def qkv(s, n, h, dtype=jnp.bfloat16, kind="normal", b=1, kh=None, seed=0):
  return testing.make_qkv(jax.random.PRNGKey(seed), b, s, s, n, kh or n, h,
                          kind, dtype)


def rel_l2(a, b):
  return testing.error_metrics(a, b)["rel_l2"]


START = time.perf_counter()
BUDGET_S = float(os.environ.get("SAGEJAX_BUDGET_S", 400.0))  # then skip (< 7 min)


def run_variant(rows, name, fn):
  """Runs ``fn() -> dict``; records the row or the error (and goes on)."""
  t0 = time.perf_counter()
  if t0 - START > BUDGET_S:
    row = {"name": name, "error": "skipped: time budget spent"}
    rows.append(row)
    print(json.dumps(row), flush=True)
    return row
  try:
    row = fn()
  except Exception as e:  # noqa: BLE001 - one failure must not lose the run
    traceback.print_exc()
    row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
  row = {"name": name, **row, "wall_s": round(time.perf_counter() - t0, 1)}
  rows.append(row)
  print(json.dumps(row, default=str), flush=True)
  return row


def ring_on_mesh(mesh, causal, impl, balance=True):
  return jax.jit(lambda q, k, v: sagejax.ring_attention_on_mesh(
      q, k, v, mesh, seq_axis="seq", is_causal=causal, load_balance=balance,
      implementation=impl))


def ring_in_shard_map(mesh, causal, order, impl):
  return jax.jit(jax.shard_map(
      lambda q, k, v: sagejax.ring_attention(
          q, k, v, axis_name="seq", is_causal=causal, order=order,
          implementation=impl),
      mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ, check_vma=False))


# ----------------------------------------------------------------------------
# 1. Correctness.
# ----------------------------------------------------------------------------


def check_ring(mesh, s, impl, variant):
  n, h = 8, 128
  q, k, v = qkv(s, n, h, kind="channel_bias", seed=1)
  causal = variant != "non-causal"
  fn = ring_on_mesh(mesh, causal, impl, balance=variant == "causal zig-zag")
  poison((1, s, n, h), NamedSharding(mesh, SEQ))
  out = fn(q, k, v)
  single = jax.jit(lambda *a: sagejax.attention(
      *a, is_causal=causal, implementation=impl, config="sage2-8b"))(q, k, v)
  exact = jax.jit(lambda *a: sagejax.exact_attention(
      *a, is_causal=causal))(q, k, v)
  finite = bool(jnp.all(jnp.isfinite(out)))
  ring_err, single_err = rel_l2(out, exact), rel_l2(single, exact)
  return dict(s=s, finite=finite, ring_vs_exact=ring_err,
              single_vs_exact=single_err, ring_vs_single=rel_l2(out, single),
              ok=finite and ring_err < 1.3 * single_err + 1e-3)


def check_ring_grads(mesh, s, impl):
  n, h = 4, 128
  q, k, v = qkv(s, n, h, dtype=jnp.float32, kind="channel_bias", seed=2)
  w = jax.random.normal(jax.random.PRNGKey(3), q.shape)
  loss = lambda fn: (lambda *a: jnp.sum(fn(*a) * w))  # noqa: E731
  ring_fn = lambda *a: sagejax.ring_attention_on_mesh(  # noqa: E731
      *a, mesh, seq_axis="seq", is_causal=True, implementation=impl)
  got = jax.jit(jax.grad(loss(ring_fn), (0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(functools.partial(
      sagejax.exact_attention, is_causal=True)), (0, 1, 2)))(q, k, v)
  errs = [rel_l2(g, r) for g, r in zip(got, want)]
  return dict(s=s, dq=errs[0], dk=errs[1], dv=errs[2], ok=max(errs) < 1e-4)


def check_sharded(devices, impl, axis, s):
  """sagejax.attention under jit with batch or heads over all devices."""
  p = len(devices)
  mesh = Mesh(np.array(devices), ("x",))
  b, n = (2 * p, 8) if axis == "batch" else (2, 8 * p)
  q, k, v = qkv(s, n, 128, b=b, kh=n // 2, seed=4)
  spec = P("x") if axis == "batch" else P(None, None, "x")
  sharded = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
  fn = jax.jit(lambda *a: sagejax.attention(*a, is_causal=True,
                                            implementation=impl))
  compiled = fn.lower(*sharded).compile()
  poison(q.shape, NamedSharding(mesh, spec))
  got = compiled(*sharded)
  want = fn(q, k, v)
  text = compiled.as_text()
  gathers = text.count("all-gather")
  err = rel_l2(got, want)
  return dict(axis=axis, rel_l2_vs_unsharded=err, all_gathers=gathers,
              out_sharding=str(got.sharding.spec),
              ok=err < 1e-3 and gathers == 0)


# ----------------------------------------------------------------------------
# 2.-4. Timing.
# ----------------------------------------------------------------------------


def time_ring(mesh, s, impl, variant, single_cache):
  p = mesh.shape["seq"]
  n, h = 32, 128
  q, k, v = (jax.device_put(x, NamedSharding(mesh, SEQ))
             for x in qkv(s, n, h, seed=5))
  causal = variant != "non-causal"
  if variant == "causal zig-zag (wrapper)":
    fn = ring_on_mesh(mesh, True, impl, balance=True)
  else:
    order = "zigzag" if variant == "causal zig-zag" else "contiguous"
    fn = ring_in_shard_map(mesh, causal, order, impl)
  t_ring = timeit(fn, (q, k, v))
  del q, k, v
  key = (s // p, causal, impl)
  if key not in single_cache:
    dev = mesh.devices.flat[0]
    ql, kl, vl = (jax.device_put(x, dev) for x in qkv(s // p, n, h, seed=6))
    single = jax.jit(lambda *a: sagejax.attention(
        *a, is_causal=causal, implementation=impl, config="sage2-8b"))
    single_cache[key] = timeit(single, (ql, kl, vl))
    del ql, kl, vl
  t_one = single_cache[key]
  ring_tops = tops(1, n, s, h, causal, t_ring)
  one_tops = tops(1, n, s // p, h, causal, t_one)
  return dict(s=s, devices=p, ms=t_ring * 1e3, tops=ring_tops,
              single_ms_at_s_over_p=t_one * 1e3, single_tops=one_tops,
              efficiency=ring_tops / (p * one_tops),
              step_compute_ms=t_ring * 1e3 / p)


def time_exchange(mesh, s):
  """One ring step's transfer alone: quantized payload vs bf16 K/V."""
  p = mesh.shape["seq"]
  n, h = 32, 128
  cfg = resolve_config("sage2-8b")
  _, k, v = (jax.device_put(x, NamedSharding(mesh, SEQ))
             for x in qkv(s, n, h, seed=7))
  perm = [(j, (j + 1) % p) for j in range(p)]
  everywhere = P("seq")

  def payload(k, v):
    kc, vc = (_inputs.to_canonical(x, "BTNH").astype(jnp.float32)
              for x in (k, v))
    sl = kc.shape[2]
    return ring._kv_payload(kc, vc, cfg, jnp.full((1,), sl, jnp.int32))  # noqa: SLF001

  quantized = jax.jit(jax.shard_map(payload, mesh=mesh, in_specs=(SEQ, SEQ),
                                    out_specs=everywhere, check_vma=False))(
                                        k, v)
  send = jax.jit(jax.shard_map(
      lambda *x: jax.lax.ppermute(x, "seq", perm), mesh=mesh,
      in_specs=everywhere, out_specs=everywhere, check_vma=False))
  kv_bf16 = tuple(jax.device_put(
      x.reshape(p, 1, s // p, n, h),
      NamedSharding(mesh, everywhere)) for x in (k, v))
  t_q = timeit(send, tuple(quantized))
  t_b = timeit(send, kv_bf16)
  q_bytes, b_bytes = ring.exchange_bytes((1, s // p, n, h))
  return dict(s=s, bytes_quantized=q_bytes, bytes_bf16=b_bytes,
              ratio=q_bytes / b_bytes, quantized_ms=t_q * 1e3,
              bf16_ms=t_b * 1e3, quantized_GBps=q_bytes / t_q / 1e9)


def time_scaling(devices, impl, axis, s):
  p = len(devices)
  mesh = Mesh(np.array(devices), ("x",))
  n, h = 32, 128
  fn = jax.jit(lambda *a: sagejax.attention(*a, implementation=impl,
                                            config="sage2-8b"))
  one = [jax.device_put(x, devices[0]) for x in qkv(s, n, h, seed=8)]
  t_one = timeit(fn, one)
  b, nn = (p, n) if axis == "batch" else (1, n * p)
  spec = P("x") if axis == "batch" else P(None, None, "x")
  many = [jax.device_put(x, NamedSharding(mesh, spec))
          for x in qkv(s, nn, h, b=b, seed=9)]
  t_many = timeit(fn, many)
  return dict(axis=axis, s=s, devices=p, single_ms=t_one * 1e3,
              sharded_ms=t_many * 1e3, efficiency=t_one / t_many)


# ----------------------------------------------------------------------------


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="out")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--seqs", default=None,
                  help="total sequence lengths to time, e.g. 65536,131072")
  ap.add_argument("--tiny", action="store_true",
                  help="CPU smoke test of this script (Pallas interpreted); "
                  "run with XLA_FLAGS=--xla_force_host_platform_device_count"
                  "=2 JAX_PLATFORMS=cpu")
  args = ap.parse_args()
  if args.tiny:
    from sagejax.backends import pallas_triton
    backends.registry()["pallas"] = pallas_triton.INTERPRET_BACKEND
  os.makedirs(args.out, exist_ok=True)
  devices = jax.devices()
  p = len(devices)
  mesh = Mesh(np.array(devices), ("seq",))
  print(f"{p} x {devices[0].device_kind}, jax {jax.__version__}, "
        f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}", flush=True)
  probe = _inputs.parse(*qkv(256, 4, 128))
  auto = ring._select_backend(  # noqa: SLF001
      None, probe, resolve_config("sage2-8b")).name
  impls = ["pallas"] + ([None] if auto != "pallas" else [])
  print(f"implementation=None picks {auto!r} for the ring", flush=True)
  seqs = [16384, 32768] if args.quick else [65536, 131072, 262144]
  s_check = 4096 if args.quick else 8192
  s_grad, s_shard, s_scale = 2048, 2048, 4096 if args.quick else 16384
  if args.tiny:
    seqs, s_check, s_grad, s_shard, s_scale = [512], 256, 256, 256, 256
  if args.seqs:
    seqs = [int(x) for x in args.seqs.split(",")]
  checks, timings = [], []

  # 1. Correctness.
  for impl in ["pallas", None]:
    for variant in ("non-causal", "causal contiguous", "causal zig-zag"):
      run_variant(checks, f"ring {variant} [{impl}]",
                  lambda: check_ring(mesh, s_check, impl, variant))
  run_variant(checks, "ring grads causal zig-zag [pallas fwd]",
              lambda: check_ring_grads(mesh, s_grad, "pallas"))
  for axis in ("batch", "heads"):
    run_variant(checks, f"sharded jit over {axis} [pallas]",
                lambda: check_sharded(devices, "pallas", axis, s_shard))

  # 3. Bytes and transfer time per step.
  exchange = []
  for s in seqs:
    run_variant(exchange, "exchange per step", lambda: time_exchange(mesh, s))

  # 4. Sharded batch / heads scaling.
  scaling = []
  for impl in impls:
    for axis in ("batch", "heads"):
      run_variant(scaling, f"sharded {axis} [{impl}]",
                  lambda: time_scaling(devices, impl, axis, s_scale))

  # 2. Ring throughput vs P x single GPU at S/P.
  single_cache: dict = {}
  for s in seqs:
    for impl in impls:
      for variant in ("non-causal", "causal zig-zag"):
        run_variant(timings, f"ring {variant} [{impl}]",
                    lambda: time_ring(mesh, s, impl, variant, single_cache))
  # implementation=None at one length even when it is the same backend.
  if None not in impls:
    run_variant(timings, "ring causal zig-zag [None]",
                lambda: time_ring(mesh, seqs[0], None, "causal zig-zag",
                                  single_cache))
  mid = seqs[len(seqs) // 2]
  for impl in impls:
    run_variant(timings, f"ring causal contiguous [{impl}]",
                lambda: time_ring(mesh, mid, impl, "causal contiguous",
                                  single_cache))
  run_variant(timings, "ring causal zig-zag (wrapper reorders) [pallas]",
              lambda: time_ring(mesh, mid, "pallas",
                                "causal zig-zag (wrapper)", single_cache))
  ring.UNROLL_STEPS = True  # A/B: every step visible to the scheduler
  for variant in ("non-causal", "causal zig-zag"):
    run_variant(timings, f"ring {variant} unrolled [pallas]",
                lambda: time_ring(mesh, mid, "pallas", variant,
                                  single_cache))
  ring.UNROLL_STEPS = False

  meta = dict(devices=p, device=devices[0].device_kind, jax=jax.__version__,
              date=datetime.date.today().isoformat(), auto_backend=auto,
              xla_flags=os.environ["XLA_FLAGS"], batch=1, heads=32,
              head_dim=128, dtype="bfloat16", config="sage2-8b")
  with open(os.path.join(args.out, "multi_gpu_check.json"), "w") as f:
    json.dump(dict(meta=meta, checks=checks, timings=timings,
                   exchange=exchange, scaling=scaling), f, indent=1,
              default=str)

  print(f"\n{meta}")
  print("\nchecks")
  for r in checks:
    status = "ERROR " + r["error"] if "error" in r else (
        "ok" if r.get("ok") else "FAIL")
    detail = {k: (f"{v:.2e}" if isinstance(v, float) else v)
              for k, v in r.items() if k not in ("name", "ok", "wall_s")}
    print(f"  {r['name']:<44} {status:<5} {detail}")
  print(f"\nring, B=1 N=32 H=128 bf16, {p} devices: TOPS, and efficiency ="
        " ring TOPS / (P x single-GPU TOPS at S/P)")
  print(f"  {'variant':<48} {'S':>7} {'ms':>9} {'TOPS':>7} {'1-GPU':>7} "
        f"{'eff':>6}")
  for r in timings:
    if "error" in r:
      print(f"  {r['name']:<48} ERROR {r['error'][:60]}")
      continue
    print(f"  {r['name']:<48} {r['s']:>7} {r['ms']:9.1f} {r['tops']:7.0f} "
          f"{r['single_tops']:7.0f} {r['efficiency']:6.3f}")
  print("\nexchange per step (one device's K/V shard)")
  for r in exchange:
    if "error" in r:
      print(f"  ERROR {r['error'][:80]}")
      continue
    print(f"  S={r['s']:>7}: {r['bytes_quantized'] / 2**20:8.1f} MiB vs bf16 "
          f"{r['bytes_bf16'] / 2**20:8.1f} MiB (x{r['ratio']:.3f}); "
          f"{r['quantized_ms']:.2f} ms vs {r['bf16_ms']:.2f} ms "
          f"({r['quantized_GBps']:.0f} GB/s)")
  print("\nsharded sagejax.attention scaling (efficiency = 1-device time on one"
        " share / P-device time on P shares)")
  for r in scaling:
    if "error" in r:
      print(f"  {r['name']:<28} ERROR {r['error'][:60]}")
      continue
    print(f"  {r['name']:<28} S={r['s']}: {r['single_ms']:.2f} ms vs "
          f"{r['sharded_ms']:.2f} ms, efficiency {r['efficiency']:.3f}")


if __name__ == "__main__":
  main()

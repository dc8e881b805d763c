"""One GPU run for sagejax.serving: correctness, then decode and extend speed.

  PYTHONPATH=$PWD python benchmarks/serving_check.py --out $OUT [--quick]
  PYTHONPATH=$PWD python benchmarks/serving_check.py --smoke --out /tmp/s  # CPU

1. Correctness: the Pallas kernel with its outputs poisoned (NaN before it
   runs) against the ``"xla"`` reference and dense f32 attention over the
   same tokens; decode (lengths 1 … 4100, split-KV) and extend (prefix +
   chunk, padded), INT8/FP8 and bf16 pages, pages of 16 and 64, soft-cap and
   window, and a sequence with a bad page table (NaN there only).
2. Copy bandwidth: a device-to-device copy of 2 GiB (bytes read + written).
3. Decode tiling sweep (B=32, 16k tokens; not with ``--quick``, whose
   decode uses the default tilings), then decode at batch 8-64 × 4k-32k
   cached tokens, GQA 32/8, H=128, bf16 q: sagejax INT8 K / FP8 V pages and
   bf16 pages (pages of 16 and 64), JAX's ``pallas.ops.gpu.paged_attention``
   (bf16 pages, best of k_splits 8/16; int8 pages with per-token scales),
   dense cuDNN (T=1, contiguous bf16 cache). µs, TB/s of cache bytes read,
   and the ratios the issue targets.
4. Extend: a 4096-token chunk on 8k-32k cached tokens (B=2): the Mosaic
   extend and the Triton kernel (INT8/FP8 with FP16 or FP8 P', bf16 pages)
   beside cuDNN on a dense bf16 cache, non-causal over all keys (jax.nn's
   cuDNN path has no bottom-right causal mask: cuDNN does 1.2x the work at
   8k, 1.06x at 32k) and with a bottom-right boolean mask array; TOPS count
   the causal work for all. Then chunks of 64-1024 tokens on an 8k prefix
   (B=8), Mosaic vs Triton.

Timing: compiled functions, warm-up, then per repeat many back-to-back
dispatches and one block_until_ready; the median of 5 repeats
(sagejax.bench.timing). Every variant is wrapped so one failure does not
lose the run. JSON goes to ``--out`` after every section; the table prints
last.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import math
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from sagejax import quant, serving, testing
from sagejax.bench import serving as bench_serving
from sagejax.bench.timing import TimingConfig, time_calls
from sagejax.serving import attention as serving_attention
from sagejax.serving import cache as cache_lib

N, K, H = 32, 8, 128
MOSAIC_PAGES = (32, 64, 128)
DEADLINE_S = float(os.environ.get("SAGEJAX_BUDGET_S", 6.3 * 60))
TIMING = TimingConfig(repeats=5, target_s=0.05, min_calls=10, max_calls=100)


class Run:
  """Results, saved after each section; one failure never loses the run."""

  def __init__(self, out: str, smoke: bool):
    self.out, self.smoke, self.start = out, smoke, time.time()
    os.makedirs(out, exist_ok=True)
    dev = jax.devices()[0]
    self.data = {"device": dev.device_kind, "platform": dev.platform,
                 "jax": jax.__version__, "smoke": smoke,
                 "date": datetime.datetime.now().isoformat(timespec="seconds")}

  def late(self) -> bool:
    return time.time() - self.start > DEADLINE_S

  def save(self):
    with open(os.path.join(self.out, "serving_check.json"), "w") as f:
      json.dump(self.data, f, indent=1, default=str)

  def record(self, key: str, rows: list, row: dict, line: str):
    """Appends a finished config, prints it, saves, frees its arrays."""
    rows.append(row)
    print(line)
    self.data[key] = rows
    self.save()
    gc.collect()

  def guard(self, name, fn, *args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      print(f"!! {name}: {type(e).__name__}: {e}")
      traceback.print_exc()
      self.data.setdefault("errors", []).append(f"{name}: {e!r}"[:2000])
      return None


def seconds(fn, *arg_sets):
  """Median seconds per call of jitted ``fn`` over the argument sets."""
  compiled = jax.jit(fn).lower(*arg_sets[0]).compile()
  return time_calls(compiled, list(arg_sets), TIMING).median_s


def rel_l2(a, b, valid=None):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  if valid is not None:
    a, b = np.where(valid, a, 0.0), np.where(valid, b, 0.0)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ----------------------------------------------------------------------------
# 1. Correctness.
# ----------------------------------------------------------------------------


def build(seed, kv_len, q_len, *, ps, quantized, kh=K, n=N, h=H):
  """A cache holding random channel-bias tokens, appended in two steps
  (prefix, then the last q_len tokens), shuffled pages, sequence 1 sharing
  sequence 0's first page; plus the tokens themselves."""
  kv_len, q_len = np.asarray(kv_len), np.asarray(q_len)
  b = len(kv_len)
  max_pages = -(-int(kv_len.max()) // ps)
  s = max_pages * ps
  q, k, v = testing.make_qkv(jax.random.key(seed), b, int(q_len.max()), s, n,
                             kh, h, "channel_bias", jnp.float32)
  k, v = np.array(k), np.array(v)
  pool = b * max_pages + 2
  table = np.random.RandomState(seed).permutation(pool)[:b * max_pages]
  table = table.reshape(b, max_pages).astype(np.int32)
  prefix = kv_len - q_len
  start = np.zeros(b, np.int64)
  if b > 1 and min(prefix[:2]) >= ps:
    table[1, 0] = table[0, 0]
    k[1, :ps], v[1, :ps] = k[0, :ps], v[0, :ps]
    start[1] = ps
  cache = serving.PagedKVCache.create(num_pages=pool, page_size=ps,
                                      num_kv_heads=kh, head_dim=h,
                                      quantized=quantized)
  for lo, hi in ((np.minimum(start, prefix), prefix), (prefix, kv_len)):
    width = max(1, int((hi - lo).max()))
    idx = np.minimum(lo[:, None] + np.arange(width)[None], s - 1)
    rows = np.arange(b)[:, None]
    cache = serving.append(cache, jnp.asarray(k[rows, idx], jnp.bfloat16),
                           jnp.asarray(v[rows, idx], jnp.bfloat16),
                           jnp.asarray(table), jnp.asarray(lo, jnp.int32),
                           num_new=jnp.asarray(hi - lo, jnp.int32))
  return dict(q=q.astype(jnp.bfloat16), k=k, v=v, cache=cache,
              table=jnp.asarray(table), kv_len=jnp.asarray(kv_len, jnp.int32),
              q_len=jnp.asarray(q_len, jnp.int32))


def dense(q, k, v, q_len, kv_len, window=None, cap=None):
  """f32 causal (bottom-right) attention, numpy: q [B, T, N, H]."""
  q = np.asarray(q, np.float32)
  b, t, n, h = q.shape
  kh = k.shape[2]
  out = np.zeros((b, t, n, h), np.float32)
  for i in range(b):
    ql, kl = int(q_len[i]), int(kv_len[i])
    qq = q[i, :ql].reshape(ql, kh, n // kh, h)
    logits = np.einsum("tkgh,skh->kgts", qq, k[i, :kl]) / math.sqrt(h)
    if cap is not None:
      logits = cap * np.tanh(logits / cap)
    pos = np.arange(ql)[:, None] + kl - ql
    j = np.arange(kl)[None]
    visible = j <= pos
    if window is not None:
      visible &= j >= pos - window
    logits = np.where(visible, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[i, :ql] = np.einsum("kgts,skh->tkgh", p, v[i, :kl]).reshape(ql, n, h)
  return out


def attend(sc, *, decode, impl, poison=False, interpret=False, **kw):
  """decode_attention / extend_attention, with the kernel's outputs
  optionally poisoned (private entry point)."""
  q = sc["q"][:, :1] if decode else sc["q"]
  out = serving_attention._attend(  # pylint: disable=protected-access
      q, sc["cache"], sc["table"], sc["kv_len"],
      None if decode else sc["q_len"], None, decode=decode, t_cap=q.shape[1],
      packed=False, scale=None, local_window_size=kw.get("window"),
      logits_soft_cap=kw.get("cap"), config=kw.get("config"),
      implementation=impl, tiling=kw.get("tiling"), interpret=interpret,
      poison=poison)
  return out[:, 0] if decode else out


def correctness(run: Run):
  smoke = run.smoke
  rows = []
  decode_lens = [300, 100, 17, 16, 1] if smoke else [4100, 1000, 17, 16, 1]
  extend = (([90, 60, 40], [30, 20, 40]) if smoke
            else ([3000, 1500, 700], [512, 300, 700]))
  kh, n, h = (2, 8, 64) if smoke else (K, N, H)
  cases = [(quantized, ps, mode, False) for quantized in (True, False)
           for ps in (16, 64) for mode in ("decode", "extend")]
  cases += [(True, 16, "decode", True), (True, 16, "extend", True)]
  if smoke:
    cases = cases[:2] + cases[-1:]
  for quantized, ps, mode, capped in cases:
    kv_len, q_len = ((decode_lens, [1] * len(decode_lens))
                     if mode == "decode" else extend)
    window, cap = (200, 20.0) if capped else (None, None)
    name = (f"{mode} {'int8/fp8' if quantized else 'bf16'} p{ps}"
            f"{' window+cap' if capped else ''}")

    def check():
      sc = build(len(rows), kv_len, q_len, ps=ps, quantized=quantized,
                 kh=kh, n=n, h=h)
      decode = mode == "decode"
      got = attend(sc, decode=decode, impl="pallas", poison=True,
                   interpret=smoke, window=window, cap=cap)
      want = attend(sc, decode=decode, impl="xla", window=window, cap=cap)
      ql = np.asarray(sc["q_len"])
      exact = dense(sc["q"], sc["k"], sc["v"], ql, np.asarray(kv_len),
                    window, cap)
      got, want = (np.asarray(x, np.float32) for x in (got, want))
      if decode:
        exact = exact[:, 0]
        valid = np.ones(got.shape, bool)
      else:
        valid = np.broadcast_to(
            (np.arange(got.shape[1])[None] < ql[:, None])[..., None, None],
            got.shape)
      row = dict(name=name, finite=bool(np.isfinite(got).all()),
                 padding_zero=bool(np.all(got[~valid] == 0)),
                 vs_xla=rel_l2(got, want, valid),
                 xla_vs_exact=rel_l2(want, exact, valid),
                 vs_exact=rel_l2(got, exact, valid))
      row["ok"] = (row["finite"] and row["padding_zero"]
                   and row["vs_xla"] < 1e-2 and row["vs_exact"] < 2e-2)
      return row

    row = run.guard(name, check) or dict(name=name, ok=False, error=True)
    rows.append(row)
    print(f"  {name}: {row}")
  # A bad page-table entry: NaN for that sequence only.
  def bad():
    sc = build(99, [200, 200, 200], [1, 1, 1], ps=16, quantized=True, kh=kh,
               n=n, h=h)
    good = np.asarray(attend(sc, decode=True, impl="pallas",
                             interpret=smoke), np.float32)
    sc["table"] = sc["table"].at[1, 3].set(10**6)
    out = np.asarray(attend(sc, decode=True, impl="pallas", interpret=smoke),
                     np.float32)
    return dict(name="bad page table -> NaN for that sequence only",
                ok=bool(np.isnan(out[1]).all() and np.array_equal(
                    out[[0, 2]], good[[0, 2]])))
  rows.append(run.guard("bad table", bad) or dict(name="bad table", ok=False))
  run.data["correctness"] = rows


def cache_error(run: Run):
  """Error of cache quantization schemes vs exact f32 attention (decode, one
  query per sequence; B=4, 4096 cached tokens, GQA 32/8, H=128): the cache
  alone (exact attention over its dequantized tokens) and end to end (the
  ``"xla"`` paged attention, INT8 Q and FP16 P' included)."""
  b, s = (2, 512) if run.smoke else (4, 4096)
  rows = []
  for kind in ("normal", "channel_bias"):
    q, k, v = testing.make_qkv(jax.random.key(7), b, 1, s, N, K, H, kind,
                               jnp.float32)
    table = jnp.arange(b * s // 16, dtype=jnp.int32).reshape(b, -1)
    lens = jnp.full((b,), s, jnp.int32)
    exact = dense(q, np.asarray(k), np.asarray(v), np.ones(b, int),
                  np.full(b, s))

    def metrics(out):
      m = testing.error_metrics(np.asarray(out).reshape(exact.shape), exact)
      return {key: m[key] for key in ("cos_sim", "rel_l1", "rmse")}

    first = 64   # the first append: the first 64 tokens of each sequence

    def emulated(k_smooth, v_smooth, v_per_channel=False):
      """Exact attention over tokens quantized with these smoothing vectors
      (broadcast against [B, S, K, H]); ``v_per_channel``: V scales per
      (head, channel), fixed by the first append's max (later tokens clip)."""
      kq = cache_lib.dequantize_keys(*cache_lib.quantize_keys(k, k_smooth),
                                     k_smooth)
      if v_per_channel:
        centred = v - v_smooth
        scale = quant.scale_from_amax(
            jnp.max(jnp.abs(centred[:, :first]), axis=(0, 1)), quant.FP8_MAX)
        v8 = jnp.clip(centred / scale, -quant.FP8_MAX, quant.FP8_MAX)
        vq = v8.astype(quant.FP8_DTYPE).astype(jnp.float32) * scale + v_smooth
      else:
        vq = cache_lib.dequantize_values(
            *cache_lib.quantize_values(v, v_smooth), v_smooth)
      return dense(q, np.asarray(kq), np.asarray(vq), np.ones(b, int),
                   np.full(b, s))

    seq_k = jnp.mean(k[:, :first], axis=1, keepdims=True)
    seq_v = jnp.mean(v[:, :first], axis=1, keepdims=True)
    schemes = {
        "bf16": emulated_bf16(q, k, v, b, s),
        "int8/fp8, no smoothing": emulated(None, None),
        "int8/fp8, K smoothing only (global)": emulated(
            jnp.mean(k[:, :first], axis=(0, 1)), None),
        "int8/fp8, per-sequence means of the first 64 tokens": emulated(
            seq_k, seq_v),
        "int8/fp8, global means, V scales per channel (first append)":
            emulated(jnp.mean(k[:, :first], axis=(0, 1)),
                     jnp.mean(v[:, :first], axis=(0, 1)), True),
    }
    for name, out in schemes.items():
      rows.append(dict(data=kind, scheme=name, part="cache alone",
                       **metrics(out)))
    for name, quantized in (("bf16", False), ("int8/fp8 (default: global "
                                               "means of the first append)",
                                               True)):
      cache = serving.PagedKVCache.create(num_pages=b * s // 16, page_size=16,
                                          num_kv_heads=K, head_dim=H,
                                          quantized=quantized)
      cache = serving.append(cache, k[:, :first], v[:, :first], table,
                             jnp.zeros(b, jnp.int32))
      cache = serving.append(cache, k[:, first:], v[:, first:], table,
                             jnp.full(b, first, jnp.int32))
      if quantized:
        pages = table
        kq = cache_lib.dequantize_keys(cache.gather("k_pages", pages),
                                       cache.gather("k_scales", pages),
                                       cache.k_smooth)
        vq = cache_lib.dequantize_values(cache.gather("v_pages", pages),
                                         cache.gather("v_scales", pages),
                                         cache.v_smooth)
        rows.append(dict(data=kind, scheme=name, part="cache alone",
                         **metrics(dense(q, np.asarray(kq), np.asarray(vq),
                                         np.ones(b, int), np.full(b, s)))))
      out = serving.decode_attention(q[:, 0].astype(jnp.bfloat16), cache,
                                     table, lens, implementation="xla")
      rows.append(dict(data=kind, scheme=name, part="end to end (xla)",
                       **metrics(out)))
  run.data["cache_error"] = rows
  print("\n| data | scheme | measured | cos sim | rel. L1 | RMSE |")
  print("| --- | --- | --- | --- | --- | --- |")
  for r in rows:
    print(f"| {r['data']} | {r['scheme']} | {r['part']} | "
          f"{r['cos_sim']:.6f} | {r['rel_l1']:.5f} | {r['rmse']:.5f} |")


def emulated_bf16(q, k, v, b, s):
  return dense(q, np.asarray(k.astype(jnp.bfloat16), np.float32),
               np.asarray(v.astype(jnp.bfloat16), np.float32),
               np.ones(b, int), np.full(b, s))


# ----------------------------------------------------------------------------
# 2-4. Speed.
# ----------------------------------------------------------------------------


def copy_bandwidth(run: Run) -> float:
  n_bytes = (64 << 20) if run.smoke else (2 << 30)
  x = jnp.ones((n_bytes // 2,), jnp.bfloat16)
  t = seconds(lambda x: x + jnp.bfloat16(1), (x,))
  bw = 2 * n_bytes / t / 1e12
  run.data["copy"] = dict(bytes=n_bytes, us=t * 1e6, tb_s=bw)
  print(f"copy: {bw:.2f} TB/s (read + write of {n_bytes >> 20} MiB)")
  return bw


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def random_pages(key, pages, ps, quantized, dense_batch):
  """Random page pools (KPSH) and, for cuDNN, a dense bf16 cache."""
  ks = jax.random.split(key, 6)
  shape = (K, pages, ps, H)
  out = {"bf16": (jax.random.normal(ks[0], shape, jnp.bfloat16),
                  jax.random.normal(ks[1], shape, jnp.bfloat16))}
  if quantized:
    out["k8"] = jax.random.randint(ks[2], shape, -127, 128, jnp.int8)
    out["v8"] = (jax.random.normal(ks[3], shape) * 100).astype(
        quant.FP8_DTYPE)
    out["scales"] = jax.random.uniform(ks[4], (2,) + shape[:-1],
                                       minval=0.004, maxval=0.02)
  if dense_batch:
    # Two arrays: slicing one [2, ...] array inside the timed function made
    # XLA copy K and V before cuDNN (3x its time).
    s = pages * ps // dense_batch
    kd, vd = jax.random.split(ks[5])
    out["dense"] = tuple(jax.random.normal(x, (dense_batch, s, K, H),
                                           jnp.bfloat16) for x in (kd, vd))
  return out


def _cache(pools, quantized, ps):
  """A PagedKVCache view of the page-16 pools with pages of ``ps``."""
  def view(x, transposed=False):
    pages = x.shape[1] * x.shape[2] // ps
    if transposed:  # random data: any bytes will do
      return x.reshape(x.shape[0], pages, H, ps)
    return x.reshape((x.shape[0], pages, ps) + x.shape[3:])
  if quantized:
    return serving.PagedKVCache(
        view(pools["k8"]), view(pools["v8"], True), view(pools["scales"][0]),
        view(pools["scales"][1]), jnp.zeros((K, H)), jnp.zeros((K, H)),
        jnp.ones((), bool), v_transposed=True)
  return serving.PagedKVCache(view(pools["bf16"][0]), view(pools["bf16"][1]))


def decode_variants(b, s, pools, tilings, smoke, extra=()):
  """name -> (function of (q, pools), bytes read per call); ``extra``:
  (page size, DecodeTiling spec) pairs, timed as ``"tiling p{ps} {spec}"``
  (INT8/FP8 pages)."""
  lengths = jnp.full((b,), s, jnp.int32)
  pages16 = b * s // 16
  tables = {ps: jnp.asarray(np.random.RandomState(ps).permutation(
      pages16 * 16 // ps).reshape(b, s // ps).astype(np.int32))
            for ps in (16, 64)}
  q_bytes = b * N * H * 2
  out = {}

  def mosaic(quantized, ps, tiling):
    """The Mosaic decode (Hopper) on its own table, and its bytes read."""
    table = jnp.asarray(np.random.RandomState(ps).permutation(
        pages16 * 16 // ps).reshape(b, s // ps).astype(np.int32))
    def fm(q, pools):
      return serving.decode_attention(q, _cache(pools, quantized, ps), table,
                                      lengths, implementation="mosaic",
                                      tiling=tiling)
    per_token = 2 * H + 8 if quantized else 4 * H
    return fm, b * s * K * per_token + q_bytes

  if not smoke:
    for quantized, ps in [(True, p) for p in MOSAIC_PAGES] + [(False, 64),
                                                              (False, 128)]:
      kind = "int8/fp8" if quantized else "bf16"
      out[f"sage mosaic {kind} p{ps}"] = mosaic(
          quantized, ps, tilings.get(("mosaic", ps)) if quantized else None)
  for ps, spec in extra:
    out[f"tiling p{ps} {spec}"] = mosaic(True, ps, parse_decode_tiling(spec))
  for quantized, ps in ((True, 16), (True, 64), (False, 16)):
    if True:
      kind = "int8/fp8" if quantized else "bf16"
      tiling = tilings.get((quantized, ps))
      def f(q, pools, quantized=quantized, ps=ps, tiling=tiling):
        return serving.decode_attention(
            q, _cache(pools, quantized, ps), tables[ps], lengths,
            implementation="pallas", tiling=tiling, interpret=smoke)
      per_token = 2 * H + 8 if quantized else 4 * H
      out[f"sage {kind} p{ps}"] = (f, b * s * K * per_token + q_bytes)
  try:
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
  except ImportError as e:  # pragma: no cover
    print(f"JAX paged attention unavailable: {e}")
    jax_paged = None
  if jax_paged is not None:
    for splits in ((16,) if smoke else (8, 16)):
      def g(q, pools, splits=splits):
        k, v = pools["bf16"]
        return jax_paged.paged_attention(
            q * (H ** -0.5), k, v, tables[16], lengths, k_splits=splits,
            interpret=smoke)
      out[f"jax paged bf16 p16 k_splits={splits}"] = (g, b * s * K * 4 * H)
    def gi(q, pools):
      v8 = jax.lax.bitcast_convert_type(pools["v8"], jnp.int8)
      return jax_paged.paged_attention(
          q * (H ** -0.5), pools["k8"], v8, tables[16], lengths,
          k_scales_pages=pools["scales"][0], v_scales_pages=pools["scales"][1],
          k_splits=16, interpret=smoke)
    out["jax paged int8 p16"] = (gi, b * s * K * (2 * H + 8))
  def cudnn(q, pools):
    k, v = pools["dense"]
    return jax.nn.dot_product_attention(
        q[:, None], k, v, implementation="xla" if smoke else "cudnn")[:, 0]
  out["cudnn dense bf16"] = (cudnn, b * s * K * 4 * H)
  return out


def parse_decode_tiling(spec: str):
  """``"c=4,stages=8,splits=2,ctas=132,merge=0"`` → DecodeTiling."""
  from sagejax.kernels.mosaic_decode import DecodeTiling
  names = dict(c="num_consumers", stages="num_stages", splits="num_splits",
               ctas="num_ctas", merge="merge_splits")
  kw = {}
  for item in filter(None, spec.split(",")):
    key, _, value = item.partition("=")
    kw[names[key]] = bool(int(value)) if key == "merge" else int(value)
  return DecodeTiling(**kw)


def decode_tiling_sweep(run: Run):
  b, s = (2, 512) if run.smoke else (32, 16384)
  pools = random_pages(jax.random.key(1), b * s // 16, 16, True, 0)
  qs = [jax.random.normal(jax.random.key(i), (b, N, H), jnp.bfloat16)
        for i in range(2)]
  cands = [serving.PagedTiling(block_k=64, num_warps=4, num_stages=3)]
  few = 1
  if not run.smoke:
    few = 3
    cands += [serving.PagedTiling(block_k=64, num_warps=4, num_stages=2),
              serving.PagedTiling(block_k=64, num_warps=4, num_stages=4),
              serving.PagedTiling(block_k=128, num_warps=4, num_stages=3),
              serving.PagedTiling(block_k=128, num_warps=8, num_stages=3),
              serving.PagedTiling(block_k=64, num_warps=2, num_stages=4),
              serving.PagedTiling(block_k=64, num_warps=4, num_stages=3,
                                  num_splits=4),
              serving.PagedTiling(block_k=64, num_warps=4, num_stages=3,
                                  num_splits=8)]
  best, rows = {}, []
  lengths = jnp.full((b,), s, jnp.int32)
  for quantized, ps in ((True, 16), (False, 16), (True, 64)):
    if True:
      table = jnp.asarray(np.random.RandomState(ps).permutation(
          b * s // ps).reshape(b, s // ps).astype(np.int32))
      for tiling in (cands if ps == 16 else [c for c in cands
                                             if c.block_k >= 64][:few]):
        if run.late():
          break
        def f(q, pools, quantized=quantized, ps=ps, tiling=tiling,
              table=table):
          return serving.decode_attention(
              q, _cache(pools, quantized, ps), table, lengths,
              implementation="pallas", tiling=tiling, interpret=run.smoke)
        t = run.guard(f"tiling {tiling}", seconds, f, *[(q, pools)
                                                       for q in qs])
        rows.append(dict(quantized=quantized, ps=ps, tiling=str(tiling),
                         us=None if t is None else t * 1e6))
        print(f"  decode tiling int8={quantized} p{ps} {tiling}: "
              f"{'-' if t is None else f'{t * 1e6:.1f} us'}")
        if t is not None and t < best.get((quantized, ps), (1e9, None))[0]:
          best[(quantized, ps)] = (t, tiling)
  run.data["decode_tiling"] = rows
  return {key: tiling for key, (_, tiling) in best.items()}


def mosaic_tiling_sweep(run: Run):
  """The Mosaic decode's consumer count and splits (defaults: 2 consumers,
  :func:`mosaic_decode.choose_splits`) at three shapes; returns the best
  consumer count per page size (at 32 x 16k; splits stay automatic)."""
  from sagejax.kernels.mosaic_decode import DecodeTiling
  rows, best = [], {}
  cands = {64: [DecodeTiling(num_consumers=c) for c in (1, 2, 4)]
           + [DecodeTiling(num_splits=n) for n in (2, 4)],
           32: [DecodeTiling()],
           128: [DecodeTiling(num_consumers=c) for c in (1, 2)]
           + [DecodeTiling(num_splits=2)]}
  for b, s in ((32, 16384), (8, 32768), (32, 4096)):
    pools = run.guard("pools", random_pages, jax.random.key(b + s),
                      b * s // 16, 16, True, 0)
    if pools is None:
      continue
    qs = [jax.random.normal(jax.random.key(i), (b, N, H), jnp.bfloat16)
          for i in range(2)]
    lengths = jnp.full((b,), s, jnp.int32)
    for ps, tilings in cands.items():
      table = jnp.asarray(np.random.RandomState(ps).permutation(
          b * s // ps).reshape(b, s // ps).astype(np.int32))
      for tiling in tilings:
        if run.late():
          break
        def f(q, pools, ps=ps, tiling=tiling, table=table):
          return serving.decode_attention(
              q, _cache(pools, True, ps), table, lengths,
              implementation="mosaic", tiling=tiling)
        t = run.guard(f"mosaic {tiling}", seconds, f,
                      *[(q, pools) for q in qs])
        rows.append(dict(batch=b, tokens=s, ps=ps, tiling=str(tiling),
                         us=None if t is None else t * 1e6))
        print(f"  mosaic decode {b}x{s} p{ps} {tiling}: "
              f"{'-' if t is None else f'{t * 1e6:.1f} us'}")
        if (b == 32 and s == 16384 and t is not None
            and tiling.num_splits is None
            and t < best.get(ps, (1e9, None))[0]):
          best[ps] = (t, tiling)
    del pools
  run.data["mosaic_tiling"] = rows
  return {("mosaic", ps): tiling for ps, (_, tiling) in best.items()}


def decode_sweep(run: Run, copy_bw: float, tilings, configs=None,
                 chain: int = 1, extra=()):
  if not configs:
    if run.smoke:
      configs = [(2, 512)]
    elif run.data["quick"]:
      configs = [(32, 4096), (32, 16384), (8, 32768)]
    else:
      configs = [(b, s) for b in (8, 32, 64) for s in (4096, 16384, 32768)]
  rows = []
  for b, s in configs:
    if run.late():
      print(f"  decode B={b} S={s}: skipped (time)")
      continue
    pools = run.guard("pools", random_pages, jax.random.key(b + s),
                      b * s // 16, 16, True, b)
    if pools is None:
      continue
    qs = [jax.random.normal(jax.random.key(i), (b, N, H), jnp.bfloat16)
          for i in range(2)]
    row = dict(batch=b, tokens=s, bf16_bytes=b * s * K * 4 * H, us={},
               tb_s={})
    for name, (fn, nbytes) in decode_variants(b, s, pools, tilings,
                                              run.smoke, extra).items():
      if chain > 1:
        fn = bench_serving.chained(fn, chain)
      t = run.guard(f"{name} B={b} S={s}", seconds, fn,
                    *[(q, pools) for q in qs])
      if t is not None:
        t = t / chain
        row["us"][name] = t * 1e6
        row["tb_s"][name] = nbytes / t / 1e12
    us = row["us"]
    jax_bf16 = [v for k, v in us.items() if k.startswith("jax paged bf16")]
    if jax_bf16:
      us["jax paged bf16 p16 (best)"] = min(jax_bf16)
    sage = us.get("sage int8/fp8 p16")
    cudnn = us.get("cudnn dense bf16")
    if sage:
      row["int8_vs_cudnn"] = cudnn / sage if cudnn else None
      row["int8_vs_jax_bf16"] = (us["jax paged bf16 p16 (best)"] / sage
                                 if jax_bf16 else None)
      row["int8_copy_fraction"] = row["tb_s"]["sage int8/fp8 p16"] / copy_bw
    if us.get("sage bf16 p16") and cudnn:
      row["bf16_vs_cudnn"] = cudnn / us["sage bf16 p16"]
    mosaic = {k: v for k, v in us.items()
              if k.startswith("sage mosaic int8")}
    mosaic_bf16 = [v for k, v in us.items() if k.startswith("sage mosaic bf16")]
    if mosaic_bf16 and cudnn:
      row["mosaic_bf16_vs_cudnn"] = cudnn / min(mosaic_bf16)
    if mosaic:
      name = min(mosaic, key=mosaic.get)
      row["mosaic_best"] = name
      row["mosaic_vs_cudnn"] = cudnn / mosaic[name] if cudnn else None
      row["mosaic_vs_jax_bf16"] = (us["jax paged bf16 p16 (best)"]
                                   / mosaic[name] if jax_bf16 else None)
      row["mosaic_copy_fraction"] = row["tb_s"][name] / copy_bw
    del pools
    run.record("decode", rows, row, f"  decode B={b} S={s}: " + ", ".join(
        f"{k} {v:.1f}us" for k, v in us.items()))
  run.data["decode"] = rows


def extend_sweep(run: Run):
  """A 4096-token chunk (B=2) on cached prefixes: the Mosaic extend (FP16
  and FP8 P'), the Triton kernel (INT8/FP8 and bf16 pages), cuDNN on a dense
  bf16 cache; then chunk sizes 64-1024 on the 8k prefix (where the automatic
  choice switches from Triton to Mosaic)."""
  b, t = (1, 64) if run.smoke else (2, 4096)
  prefixes = ([128] if run.smoke else [8192] if run.data["quick"]
              else [8192, 16384, 32768])
  rows = []
  for prefix in prefixes:
    if run.late():
      print(f"  extend prefix {prefix}: skipped (time)")
      continue
    row = extend_case(run, b, t, prefix, full=True)
    if row is not None:
      run.record("extend", rows, row, f"  extend prefix {prefix}: " + ", ".join(
          f"{k} {v:.0f} TOPS" for k, v in row["tops"].items()))
  run.data["extend"] = rows
  chunks = [] if run.smoke else [64, 128, 256, 512, 1024]
  rows = []
  for chunk in chunks:
    if run.late():
      print(f"  extend chunk {chunk}: skipped (time)")
      continue
    row = extend_case(run, 8, chunk, 8192, full=False)
    if row is not None:
      run.record("extend_chunks", rows, row, f"  extend chunk {chunk}: " +
                 ", ".join(f"{k} {v:.0f} us" for k, v in row["us"].items()))
  run.data["extend_chunks"] = rows


def extend_case(run: Run, b: int, t: int, prefix: int, full: bool):
  """One extend shape: µs and TOPS (of the causal work) per variant."""
  s = prefix + t
  s = -(-s // 64) * 64
  pools = run.guard("pools", random_pages, jax.random.key(s + t), b * s // 16,
                    16, True, b)
  if pools is None:
    return None
  table = jnp.asarray(np.random.RandomState(1).permutation(
      b * s // 16).reshape(b, s // 16).astype(np.int32))
  lengths = jnp.full((b,), prefix + t, jnp.int32)
  q = jax.random.normal(jax.random.key(3), (b, t, N, H), jnp.bfloat16)
  work = 4 * b * N * H * (t * prefix + t * (t + 1) / 2)
  row = dict(batch=b, chunk=t, prefix=prefix, tops={}, us={})

  def timed(name, fn):
    if run.late():
      return None
    sec = run.guard(f"{name} prefix={prefix} chunk={t}", seconds, fn,
                    (q, pools))
    if sec is not None:
      row["us"][name] = sec * 1e6
      row["tops"][name] = work / sec / 1e12
    return sec

  def sage(quantized, pv, impl):
    def f(q, pools):
      return serving.extend_attention(
          q, _cache(pools, quantized, 16), table, lengths,
          config=serving.SERVING_CONFIG.replace(pv_dtype=pv),
          implementation=impl, interpret=run.smoke)
    return f

  if not run.smoke:
    timed("mosaic int8/fp8 P=fp16", sage(True, "fp16", "mosaic"))
  timed("triton int8/fp8 P=fp16", sage(True, "fp16", "pallas"))
  if not full:
    return row
  if not run.smoke:
    timed("mosaic int8/fp8 P=fp8", sage(True, "fp8_e4m3", "mosaic"))
  timed("triton int8/fp8 P=fp8", sage(True, "fp8_e4m3", "pallas"))
  timed("triton bf16 pages", sage(False, "fp16", "pallas"))
  impl = "xla" if run.smoke else "cudnn"

  def cudnn(q, pools):
    k, v = pools["dense"]
    return jax.nn.dot_product_attention(q, k[:, :prefix + t],
                                        v[:, :prefix + t],
                                        implementation=impl)
  timed("cudnn dense bf16 (non-causal, all keys)", cudnn)

  mask = jnp.arange(prefix + t)[None, :] <= (jnp.arange(t)[:, None] + prefix)

  def cudnn_masked(q, pools):
    k, v = pools["dense"]
    return jax.nn.dot_product_attention(q, k[:, :prefix + t],
                                        v[:, :prefix + t],
                                        mask=mask[None, None],
                                        implementation=impl)
  timed("cudnn dense bf16 (bottom-right mask array)", cudnn_masked)
  return row


# ----------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------


def report(run: Run):
  d = run.data
  print("\n== correctness ==")
  for r in d.get("correctness", []):
    extra = "" if "vs_xla" not in r else (
        f" vs_xla {r['vs_xla']:.2e} vs_exact {r['vs_exact']:.2e} "
        f"(xla vs exact {r['xla_vs_exact']:.2e})")
    print(f"{'ok  ' if r.get('ok') else 'FAIL'} {r['name']}{extra}")
  if "copy" in d:
    print(f"\ncopy bandwidth {d['copy']['tb_s']:.2f} TB/s")
  print("\n== decode (GQA 32/8, H=128, bf16 q; µs, TB/s of cache bytes "
        "read) ==")
  cols = ["sage mosaic int8/fp8 p32", "sage mosaic int8/fp8 p64",
          "sage mosaic int8/fp8 p128", "sage mosaic bf16 p64",
          "sage mosaic bf16 p128",
          "sage int8/fp8 p16", "sage int8/fp8 p64", "sage bf16 p16",
          "jax paged bf16 p16 (best)", "jax paged int8 p16",
          "cudnn dense bf16"]
  print("| B x tokens | " + " | ".join(cols) +
        " | int8 vs cuDNN (>=1.7) | int8 vs JAX bf16 (>=3) | int8 % copy "
        "(>=75) | bf16 vs cuDNN (>=0.9) |")
  print("|---" * (len(cols) + 5) + "|")
  for r in d.get("decode", []):
    cells = []
    for c in cols:
      us = r["us"].get(c)
      tb = r["tb_s"].get(c) if c in r["tb_s"] else (
          r["bf16_bytes"] / us / 1e6 if us else None)
      cells.append("-" if us is None else f"{us:.0f} ({tb:.2f})")
    fmt = lambda x, pct=False: "-" if x is None else (  # noqa: E731
        f"{100 * x:.0f}%" if pct else f"{x:.2f}x")
    print(f"| {r['batch']} x {r['tokens'] // 1024}k | " + " | ".join(cells) +
          f" | {fmt(r.get('int8_vs_cudnn'))} | {fmt(r.get('int8_vs_jax_bf16'))}"
          f" | {fmt(r.get('int8_copy_fraction'), True)} | "
          f"{fmt(r.get('bf16_vs_cudnn'))} |")
  for r in d.get("decode", []):
    cudnn = r["us"].get("cudnn dense bf16")
    for name, us in r["us"].items():
      if name.startswith("tiling ") and cudnn:
        print(f"  {r['batch']} x {r['tokens'] // 1024}k {name}: {us:.1f} us, "
              f"{cudnn / us:.2f}x cuDNN")
  print("\nMosaic decode, best page size per row: x cuDNN (>=1.7), x JAX "
        "paged bf16 (>=3), % of copy bandwidth (>=75); bf16 pages x cuDNN "
        "(>=0.9):")
  for r in d.get("decode", []):
    if r.get("mosaic_best"):
      fmt = lambda x, pct=False: "-" if x is None else (  # noqa: E731
          f"{100 * x:.0f}%" if pct else f"{x:.2f}x")
      print(f"  {r['batch']} x {r['tokens'] // 1024}k: {r['mosaic_best']} "
            f"{fmt(r.get('mosaic_vs_cudnn'))} {fmt(r.get('mosaic_vs_jax_bf16'))}"
            f" {fmt(r.get('mosaic_copy_fraction'), True)}; bf16 "
            f"{fmt(r.get('mosaic_bf16_vs_cudnn'))}")
  if d.get("mosaic_tiling"):
    print("\n== Mosaic decode tiling (µs) ==")
    for r in d["mosaic_tiling"]:
      us = "-" if r["us"] is None else f"{r['us']:.1f}"
      print(f"  {r['batch']} x {r['tokens'] // 1024}k p{r['ps']} "
            f"{r['tiling']}: {us}")
  print("\n== extend (4096-token chunk on a cached prefix, B=2; TOPS of the "
        "causal work) ==")
  for r in d.get("extend", []):
    print(f"prefix {r['prefix']}:")
    for name, tops in sorted(r["tops"].items(), key=lambda kv: -kv[1]):
      print(f"  {tops:7.1f} TOPS  {r['us'][name]:9.0f} us  {name}")
  if d.get("extend_chunks"):
    print("\n== extend chunk sizes (B=8, 8k prefix; µs) ==")
    for r in d["extend_chunks"]:
      print(f"  chunk {r['chunk']:5d}: " + ", ".join(
          f"{k} {v:.0f}" for k, v in r["us"].items()))
  if d.get("errors"):
    print(f"\n{len(d['errors'])} variant(s) failed; see errors in the JSON.")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes, kernels interpreted (CPU)")
  parser.add_argument("--decode-only", action="store_true",
                      help="copy bandwidth and the quick decode sweep only, "
                      "default tilings (no checks, no tiling sweep)")
  parser.add_argument("--extend-only", action="store_true",
                      help="the extend sweep only")
  parser.add_argument("--mosaic-sweep", action="store_true",
                      help="with --decode-only: the Mosaic decode's ring "
                      "depth and split count first")
  parser.add_argument("--configs", default=None,
                      help="with --decode-only: shapes as BxTOKENS,... "
                      "(e.g. 8x4096,64x4096)")
  parser.add_argument("--chain", type=int, default=1,
                      help="with --decode-only: time this many dependent "
                      "decode calls in one program, per call (the host's "
                      "dispatch of a single call bounds small shapes)")
  parser.add_argument("--mosaic-tilings", default="",
                      help="with --decode-only: ';'-separated PAGE:SPEC Mosaic "
                      "decode tilings timed beside the defaults, e.g. "
                      "'128:c=4;128:splits=4;64:stages=8' (SPEC: see "
                      "parse_decode_tiling)")
  parser.add_argument("--cache-error", action="store_true",
                      help="only the cache quantization error table (CPU)")
  args = parser.parse_args()
  run = Run(args.out, args.smoke)
  run.data["quick"] = args.quick
  print(f"device: {run.data['device']}, jax {jax.__version__}")
  if args.cache_error:
    cache_error(run)
    run.save()
    return
  if args.extend_only:
    run.guard("extend", extend_sweep, run)
    run.save()
    report(run)
    return
  if args.decode_only:
    run.data["quick"] = True
    copy_bw = run.guard("copy", copy_bandwidth, run) or float("nan")
    tilings = {}
    if args.mosaic_sweep:
      tilings = run.guard("mosaic tiling", mosaic_tiling_sweep, run) or {}
      run.save()
    configs = None
    if args.configs:
      configs = [tuple(int(x) for x in c.split("x"))
                 for c in args.configs.split(",")]
    run.data["chain"] = args.chain
    extra = [(int(ps), spec) for ps, _, spec in
             (x.partition(":") for x in args.mosaic_tilings.split(";") if x)]
    run.guard("decode", decode_sweep, run, copy_bw, tilings, configs,
              args.chain, extra)
    run.save()
    report(run)
    return
  run.guard("correctness", correctness, run)
  run.save()
  if not args.quick:
    run.guard("cache error", cache_error, run)
    run.save()
  copy_bw = run.guard("copy", copy_bandwidth, run) or float("nan")
  run.save()
  tilings = {} if args.quick else (
      run.guard("decode tiling", decode_tiling_sweep, run) or {})
  run.data["decode_best_tiling"] = {f"int8={k[0]} p{k[1]}": str(v)
                                    for k, v in tilings.items()}
  run.save()
  run.guard("decode", decode_sweep, run, copy_bw, tilings)
  run.save()
  run.guard("extend", extend_sweep, run)
  run.data["seconds"] = time.time() - run.start
  run.save()
  report(run)


if __name__ == "__main__":
  main()

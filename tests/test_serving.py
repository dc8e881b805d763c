"""sagejax.serving: the paged cache, decode and extend attention.

Every check builds a cache from random tokens through ``serving.append``
(shuffled pages, a prefix shared by two sequences, partly filled last pages)
and compares against dense attention over the same tokens, computed here in
f32 (``_dense``: causal bottom-right, window, soft-cap). The Pallas kernel
runs in the interpreter on small shapes and is lowered for CUDA.

Tolerances (rel-L2 over the valid rows; measured values in brackets):

* plain f32 cache, both implementations, vs dense: 1e-5 [~1e-7].
* quantized cache, kernel vs ``"xla"``: 1e-3 [~5e-6]: the same arithmetic,
  with a running max (where P' is rounded) and another f32 summation order.
* quantized cache vs dense over its *dequantized* tokens: 0.03 on N(0, 1)
  queries (INT8 Q per row, FP16 P') [~0.01], vs dense over the original
  tokens on channel-bias data: 0.01 [~2e-3].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sagejax import quant, serving, testing
from sagejax.backends._device import is_hopper
from sagejax.serving import cache as cache_lib
from sagejax.serving import reference
from sagejax.serving.reference import PagedMath

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
needs_hopper = pytest.mark.skipif(not is_hopper(), reason="needs an sm90 GPU")
IMPLS = [("xla", False), ("pallas", True)]     # (implementation, interpret)


@functools.partial(jax.jit, static_argnames=("window", "cap"))
def _dense(q, k, v, q_len, kv_len, window=None, cap=None):
  """f32 attention of q ``[B, T, N, H]`` (the last q_len of kv_len tokens,
  bottom-right causal) over k, v ``[B, S, K, H]``; padding rows zero."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  scale = h ** -0.5
  logits = jnp.einsum("btkgh,bskh->bkgts",
                      q.reshape(b, t, kh, n // kh, h).astype(jnp.float32),
                      k.astype(jnp.float32), precision="highest") * scale
  if cap is not None:
    logits = cap * jnp.tanh(logits / cap)
  i = jnp.arange(t)[None, :, None]
  j = jnp.arange(s)[None, None, :]
  pos = i + (kv_len - q_len)[:, None, None]
  visible = (j <= pos) & (j < kv_len[:, None, None]) & (
      i < q_len[:, None, None])
  if window is not None:
    visible &= j >= pos - window
  visible = visible[:, None, None]
  logits = jnp.where(visible, logits, -jnp.inf)
  m = jnp.max(logits, -1, keepdims=True)
  p = jnp.where(visible, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0)),
                0.0)
  l = jnp.sum(p, -1, keepdims=True)
  out = jnp.einsum("bkgts,bskh->btkgh", p / jnp.where(l > 0, l, 1.0),
                   v.astype(jnp.float32), precision="highest")
  return out.reshape(b, t, n, h)


def _append_range(cache, k, v, table, start, stop):
  """Appends tokens ``[start[b], stop[b])`` of each sequence of k, v (numpy
  ``[B, S, K, H]``)."""
  start, stop = np.asarray(start), np.asarray(stop)
  width = max(1, int((stop - start).max()))
  idx = np.minimum(start[:, None] + np.arange(width)[None, :], k.shape[1] - 1)
  rows = np.arange(k.shape[0])[:, None]
  return serving.append(cache, jnp.asarray(k[rows, idx]),
                        jnp.asarray(v[rows, idx]), jnp.asarray(table),
                        jnp.asarray(start, jnp.int32),
                        num_new=jnp.asarray(stop - start, jnp.int32))


def _tokens(key, b, t, s, n, kh, h, kind):
  """q ``[B, T, N, H]``, k and v ``[B, S, K, H]`` (numpy f32): N(0, 1) plus
  the per-(head, channel) offsets of ``sagejax.testing``'s data ``kind``,
  drawn by numpy from the fresh ``key`` (no compilation)."""
  rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
  out = []
  for name, shape in (("q", (b, t, n, h)), ("k", (b, s, kh, h)),
                      ("v", (b, s, kh, h))):
    x = rng.standard_normal(shape, np.float32)
    offset = testing.CHANNEL_BIAS[kind][name]
    if offset:
      x += offset * rng.standard_normal((1, 1) + shape[2:], np.float32)
    out.append(x)
  return out


def _scenario(key, kv_len, q_len, *, kh=2, g=4, h=64, ps=16, quantized=True,
              kind="channel_bias", t=None, extra_pages=3, dtype=jnp.float32):
  """Random tokens in a cache with shuffled pages; sequence 1 reuses the
  first cached pages of sequence 0 (a shared prefix: same tokens, same
  pages). The last ``q_len`` tokens of each sequence are appended in a second
  call (the new tokens of an extend step)."""
  kv_len, q_len = np.asarray(kv_len), np.asarray(q_len)
  b = len(kv_len)
  t = int(q_len.max()) if t is None else t
  max_pages = -(-int(kv_len.max()) // ps)
  s = max_pages * ps
  q, k, v = _tokens(key, b, t, s, kh * g, kh, h, kind)
  pool = b * max_pages + extra_pages
  table = np.random.RandomState(int(kv_len.sum())).permutation(pool)[
      :b * max_pages].reshape(b, max_pages).astype(np.int32)
  prefix = kv_len - q_len
  start = np.zeros(b, np.int64)
  if b > 1:
    shared = min(prefix[0], prefix[1]) // ps
    table[1, :shared] = table[0, :shared]
    k[1, :shared * ps] = k[0, :shared * ps]
    v[1, :shared * ps] = v[0, :shared * ps]
    start[1] = shared * ps   # its prefix pages are cached already
  cache = serving.PagedKVCache.create(
      num_pages=pool, page_size=ps, num_kv_heads=kh, head_dim=h,
      quantized=quantized, dtype=dtype)
  cache = _append_range(cache, k, v, table, np.minimum(start, prefix), prefix)
  cache = _append_range(cache, k, v, table, prefix, kv_len)
  return dict(q=jnp.asarray(q), k=jnp.asarray(k), v=jnp.asarray(v),
              table=jnp.asarray(table), cache=cache,
              kv_len=jnp.asarray(kv_len, jnp.int32),
              q_len=jnp.asarray(q_len, jnp.int32))


def _dequantized(sc):
  """The cache's tokens as the kernels see them, f32 ``[B, S, K, H]``."""
  c, pages = sc["cache"], sc["table"]
  if not c.quantized:
    return c.gather("k_pages", pages), c.gather("v_pages", pages)
  return (cache_lib.dequantize_keys(c.gather("k_pages", pages),
                                    c.gather("k_scales", pages), c.k_smooth),
          cache_lib.dequantize_values(c.gather("v_pages", pages),
                                      c.gather("v_scales", pages),
                                      c.v_smooth))


def _rel(out, ref, valid=None):
  if valid is not None:
    out = jnp.where(valid, out, 0.0)
    ref = jnp.where(valid, ref, 0.0)
  return testing.error_metrics(out, ref)["rel_l2"]


@pytest.mark.parametrize("quantized", [False, True])
def test_decode_matches_dense(next_key, quantized):
  """Lengths 1, 15, 16, 17, 1000 (pages of 16), GQA 8/2, shared prefix."""
  lens = [1000, 17, 16, 15, 1]
  sc = _scenario(next_key(), lens, [1] * 5, h=32, quantized=quantized,
                 kind="normal")
  k_deq, v_deq = _dequantized(sc)
  ones = jnp.ones(5, jnp.int32)
  exact = _dense(sc["q"], sc["k"], sc["v"], ones, sc["kv_len"])[:, 0]
  seen = _dense(sc["q"], k_deq, v_deq, ones, sc["kv_len"])[:, 0]
  outs = {}
  for impl, interpret in IMPLS:
    out = serving.decode_attention(sc["q"][:, 0], sc["cache"], sc["table"],
                                   sc["kv_len"], implementation=impl,
                                   interpret=interpret)
    assert out.shape == (5, 8, 32) and out.dtype == jnp.float32
    outs[impl] = out
    if quantized:
      assert _rel(out, seen) < 0.03
    else:
      assert _rel(out, exact) < 1e-5
  assert _rel(outs["pallas"], outs["xla"]) < (1e-3 if quantized else 1e-5)


@pytest.mark.parametrize("quantized,window,cap", [(False, None, None),
                                                  (True, 9, 4.0)])
def test_extend_padded_and_packed(next_key, quantized, window, cap):
  """Chunked prefill on cached prefixes: different prefix and new-token
  counts (padded with q_lengths, and packed with cu_seqlens), GQA with 3
  query heads per KV head, on channel-bias data."""
  kv_len, q_len = [70, 40, 16, 9], [12, 16, 16, 1]
  sc = _scenario(next_key(), kv_len, q_len, g=3, h=32, quantized=quantized)
  valid = (np.arange(16)[None] < np.asarray(q_len)[:, None])[..., None, None]
  exact = _dense(sc["q"], sc["k"], sc["v"], sc["q_len"], sc["kv_len"],
                 window, cap)
  k_deq, v_deq = _dequantized(sc)
  seen = _dense(sc["q"], k_deq, v_deq, sc["q_len"], sc["kv_len"], window, cap)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_len)]), jnp.int32)
  packed_q = jnp.concatenate([sc["q"][b, :n] for b, n in enumerate(q_len)])
  kw = dict(local_window_size=window, logits_soft_cap=cap,
            tiling=serving.PagedTiling(block_q=8, block_k=32))
  outs = {}
  for impl, interpret in IMPLS:
    out = serving.extend_attention(
        sc["q"], sc["cache"], sc["table"], sc["kv_len"], q_lengths=sc["q_len"],
        implementation=impl, interpret=interpret, **kw)
    assert not np.any(np.asarray(jnp.where(valid, 0.0, out)))  # padding: 0
    if quantized:
      assert _rel(out, exact, valid) < 0.01
      assert _rel(out, seen, valid) < 0.01
    else:
      assert _rel(out, exact, valid) < 1e-5
    packed = serving.extend_attention(
        packed_q, sc["cache"], sc["table"], sc["kv_len"], cu_seqlens=cu,
        max_q_len=16, implementation=impl, interpret=interpret, **kw)
    want = jnp.concatenate([out[b, :n] for b, n in enumerate(q_len)])
    assert _rel(packed, want) < 1e-6
    outs[impl] = out
  assert _rel(outs["pallas"], outs["xla"]) < (1e-3 if quantized else 1e-5)


def test_decode_window_soft_cap_and_pv_dtypes(next_key):
  """Split-KV decode with a window and soft-cap; FP8 and BF16 P'."""
  sc = _scenario(next_key(), [200, 129, 64], [1, 1, 1], kh=1, g=8, h=32,
                 ps=32, kind="qkv_channel_bias")
  ones = jnp.ones(3, jnp.int32)
  exact = _dense(sc["q"], sc["k"], sc["v"], ones, sc["kv_len"], 100,
                 3.0)[:, 0]
  for pv, tol in (("fp8_e4m3", 0.02), ("bf16", 0.01)):
    config = serving.SERVING_CONFIG.replace(pv_dtype=pv)
    outs = [serving.decode_attention(
        sc["q"][:, 0], sc["cache"], sc["table"], sc["kv_len"],
        local_window_size=100, logits_soft_cap=3.0, config=config,
        implementation=impl, interpret=interpret,
        tiling=serving.PagedTiling(block_k=32, num_splits=3))
            for impl, interpret in IMPLS]
    assert _rel(outs[0], exact) < tol
    assert _rel(outs[1], outs[0]) < 2e-3


@pytest.mark.parametrize("quantized", [False, True])
def test_append_then_decode_equals_whole_sequence(next_key, quantized):
  """Prefill 11 tokens in one append, then 6 decode steps (append one,
  attend): each step equals causal attention over the whole sequence."""
  b, kh, g, h, steps, prompt = 2, 2, 2, 32, 6, 11
  q, k, v = map(jnp.asarray, _tokens(next_key(), b, prompt + steps,
                                      prompt + steps, kh * g, kh, h,
                                      "channel_bias"))
  table = jnp.asarray([[5, 1], [2, 7]], jnp.int32)
  cache = serving.PagedKVCache.create(num_pages=8, page_size=16,
                                      num_kv_heads=kh, head_dim=h,
                                      quantized=quantized, dtype=jnp.float32)
  cache = serving.append(cache, k[:, :prompt], v[:, :prompt], table,
                         jnp.zeros(b, jnp.int32))
  full = _dense(q, k, v, jnp.full(b, prompt + steps), jnp.full(b, prompt +
                                                               steps))
  step = jax.jit(lambda c, q, k, v, t: serving.decode_attention(
      q, serving.append(c, k, v, table, jnp.full(b, t, jnp.int32)), table,
      jnp.full(b, t + 1, jnp.int32), implementation="xla"))
  for t in range(prompt, prompt + steps):
    out = step(cache, q[:, t], k[:, t:t + 1], v[:, t:t + 1], t)
    cache = serving.append(cache, k[:, t:t + 1], v[:, t:t + 1], table,
                           jnp.full(b, t, jnp.int32))
    assert _rel(out, full[:, t]) < (5e-3 if quantized else 1e-5)
  out = serving.decode_attention(q[:, -1], cache, table,
                                 jnp.full(b, prompt + steps, jnp.int32),
                                 implementation="pallas", interpret=True)
  assert _rel(out, full[:, -1]) < (5e-3 if quantized else 1e-5)


def test_smoothing_is_fixed_by_the_first_append(next_key):
  _, k, v = map(jnp.asarray, _tokens(next_key(), 2, 1, 20, 2, 2, 32,
                                      "channel_bias"))
  table = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
  cache = serving.PagedKVCache.create(num_pages=4, page_size=16,
                                      num_kv_heads=2, head_dim=32)
  assert not cache.smooth_fixed
  cache = serving.append(cache, k[:, :5], v[:, :5], table,
                         jnp.zeros(2, jnp.int32),
                         num_new=jnp.asarray([5, 3], jnp.int32))
  mean = jnp.concatenate([k[0, :5], k[1, :3]]).mean(0)
  np.testing.assert_allclose(cache.k_smooth, mean, rtol=1e-5, atol=1e-5)
  assert cache.smooth_fixed
  before = (np.asarray(cache.k_smooth), np.asarray(cache.v_smooth))
  cache = serving.append(cache, k[:, 5:], v[:, 5:], table,
                         jnp.asarray([5, 3], jnp.int32))
  np.testing.assert_array_equal(cache.k_smooth, before[0])
  np.testing.assert_array_equal(cache.v_smooth, before[1])


def test_quantized_values_are_stored_transposed(next_key):
  """FP8 V pages are [K, P, H, page_size]: token t of page p is column
  v_pages[:, p, :, t], its K and scales as in the untransposed layout."""
  _, k, v = map(jnp.asarray, _tokens(next_key(), 2, 1, 21, 2, 2, 32,
                                      "channel_bias"))
  table = jnp.asarray([[3, 0], [1, 2]], jnp.int32)
  cache = serving.PagedKVCache.create(num_pages=4, page_size=16,
                                      num_kv_heads=2, head_dim=32)
  assert cache.v_transposed and cache.v_pages.shape == (2, 4, 32, 16)
  cache = serving.append(cache, k, v, table, jnp.asarray([0, 5], jnp.int32),
                         num_new=jnp.asarray([21, 9], jnp.int32))
  v8, vs = cache_lib.quantize_values(v, cache.v_smooth)   # [B, T, K, H]
  for b, t, pos in ((0, 0, 0), (0, 20, 20), (1, 3, 8), (1, 8, 13)):
    page, slot = int(table[b, pos // 16]), pos % 16
    np.testing.assert_array_equal(
        np.asarray(cache.v_pages[:, page, :, slot], np.float32),
        np.asarray(v8[b, t], np.float32))
    np.testing.assert_array_equal(cache.v_scales[:, page, slot], vs[b, t])
  rows = cache.gather("v_pages", table)                    # [B, 32, K, H]
  np.testing.assert_array_equal(np.asarray(rows[0, :21], np.float32),
                                np.asarray(v8[0], np.float32))
  with pytest.raises(ValueError, match="KPSH"):
    dataclasses.replace(cache, layout="PSKH")


def test_quantized_cache_error_on_outlier_data(next_key):
  """The scheme's error vs a bf16 cache on channel-bias data (the README
  table has the full-size numbers): smoothing is what keeps it small."""
  b, s, kh, g, h = 2, 512, 2, 4, 128
  q, k, v = map(jnp.asarray, _tokens(next_key(), b, 1, s, kh * g, kh, h,
                                      "channel_bias"))
  table = jnp.arange(b * s // 16, dtype=jnp.int32).reshape(b, -1)
  lens = jnp.full((b,), s, jnp.int32)
  exact = _dense(q, k, v, jnp.ones(b, jnp.int32), lens)[:, 0]
  err = {}
  for name, kw in (("bf16", dict(quantized=False, dtype=jnp.bfloat16)),
                   ("int8/fp8", dict(quantized=True)),
                   ("unsmoothed", dict(quantized=True, smooth=False))):
    cache = serving.PagedKVCache.create(num_pages=b * s // 16, page_size=16,
                                        num_kv_heads=kh, head_dim=h, **kw)
    cache = serving.append(cache, k, v, table, jnp.zeros(b, jnp.int32))
    out = serving.decode_attention(q[:, 0], cache, table, lens,
                                   implementation="xla")
    err[name] = testing.error_metrics(out, exact)
  assert err["int8/fp8"]["rel_l1"] < 1e-3, err
  assert err["unsmoothed"]["rel_l1"] > 3 * err["int8/fp8"]["rel_l1"], err
  quant_bytes = 2 * (h + 4)           # INT8 K + FP8 V + two f32 scales
  assert cache.k_pages.nbytes + cache.k_scales.nbytes == (
      b * s * kh * quant_bytes // 2)


def test_packed_append_and_contiguous_layout(next_key):
  """append with cu_seqlens writes what the padded form writes; a contiguous
  [B, S, K, H] cache viewed as pages ("PSKH", Flax's) gives the paged
  layout's attention in both implementations."""
  q, k, v = map(jnp.asarray, _tokens(next_key(), 2, 1, 48, 4, 2, 32,
                                     "channel_bias"))
  counts = np.asarray([7, 3])
  table = jnp.asarray([[3, 0, 5], [1, 4, 2]], jnp.int32)
  start = jnp.asarray([16, 40], jnp.int32)
  make = lambda: serving.PagedKVCache.create(  # noqa: E731
      num_pages=6, page_size=16, num_kv_heads=2, head_dim=32)
  padded = serving.append(make(), k[:, :7], v[:, :7], table, start,
                          num_new=jnp.asarray(counts, jnp.int32))
  packed = serving.append(
      make(), jnp.concatenate([k[0, :7], k[1, :3]]),
      jnp.concatenate([v[0, :7], v[1, :3]]), table, start,
      cu_seqlens=jnp.asarray([0, 7, 10], jnp.int32))
  jax.tree.map(np.testing.assert_array_equal, padded, packed)

  contiguous = {name: jnp.zeros((2, 48, 2, 32), x.dtype)
                for name, x in (("k", padded.k_pages), ("v", padded.v_pages))}
  scales = jnp.ones((2, 48, 2))
  fresh = make()
  flat, flat_table = serving.PagedKVCache.from_contiguous(
      contiguous["k"], contiguous["v"], scales, scales, fresh.k_smooth,
      fresh.v_smooth, fresh.smooth_fixed)
  flat = serving.append(flat, k, v, flat_table, jnp.zeros(2, jnp.int32))
  paged = serving.append(make(), k, v, table, jnp.zeros(2, jnp.int32))
  lens = jnp.asarray([48, 30], jnp.int32)
  want = serving.decode_attention(q[:, 0], paged, table, lens,
                                  implementation="xla")
  for impl, interpret in IMPLS:
    got = serving.decode_attention(q[:, 0], flat, flat_table, lens,
                                   implementation=impl, interpret=interpret)
    assert _rel(got, want) < 1e-3


# ----------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------


def _small(quantized=True):
  cache = serving.PagedKVCache.create(num_pages=6, page_size=16,
                                      num_kv_heads=2, head_dim=32,
                                      quantized=quantized)
  table = jnp.asarray([[0, 1], [2, 3], [4, 5]], jnp.int32)
  return cache, table


def test_bad_inputs_raise_outside_jit():
  cache, table = _small()
  kv = jnp.ones((3, 4, 2, 32))
  q = jnp.ones((3, 8, 32))
  zeros = jnp.zeros(3, jnp.int32)
  lens = jnp.full(3, 4, jnp.int32)
  with pytest.raises(ValueError, match="power of two"):
    serving.PagedKVCache.create(num_pages=4, page_size=12, num_kv_heads=2,
                                head_dim=32)
  with pytest.raises(ValueError, match="runs past sequence 1"):
    serving.append(cache, kv, kv, table, jnp.asarray([0, 30, 0], jnp.int32))
  with pytest.raises(ValueError, match="outside the pool"):
    serving.append(cache, kv, kv, table.at[2, 0].set(6), zeros)
  with pytest.raises(ValueError, match="do not match the cache"):
    serving.append(cache, kv[..., :16], kv[..., :16], table, zeros)
  cache = serving.append(cache, kv, kv, table, zeros)
  with pytest.raises(ValueError, match="outside the pool"):
    serving.decode_attention(q, cache, table.at[1, 0].set(-1), lens)
  with pytest.raises(ValueError, match="what the page table can hold"):
    serving.decode_attention(q, cache, table, lens.at[0].set(33))
  with pytest.raises(ValueError, match="not a multiple"):
    serving.decode_attention(q[:, :3], cache, table, lens)
  with pytest.raises(ValueError, match="head dim"):
    serving.decode_attention(q[..., :16], cache, table, lens)
  with pytest.raises(ValueError, match="append its new tokens"):
    serving.extend_attention(jnp.ones((3, 5, 8, 32)), cache, table, lens)
  with pytest.raises(ValueError, match="Unknown implementation"):
    serving.decode_attention(q, cache, table, lens, implementation="cuda")
  if not ON_GPU:
    with pytest.raises(ValueError, match="not available"):
      serving.decode_attention(q, cache, table, lens, implementation="pallas")


@pytest.mark.parametrize("impl,interpret", IMPLS)
def test_bad_inputs_under_jit_spoil_only_their_sequence(next_key, impl,
                                                        interpret):
  """Under jit nothing can raise: a bad sequence gives NaN, the others are
  untouched; appends past a sequence's pages write nothing."""
  cache, table = _small()
  q, k, v = map(jnp.asarray, _tokens(next_key(), 3, 1, 20, 8, 2, 32,
                                      "normal"))
  q = q[:, 0]
  cache = serving.append(cache, k, v, table, jnp.zeros(3, jnp.int32))
  lens = jnp.asarray([20, 20, 20], jnp.int32)
  run = jax.jit(lambda c, t, l: serving.decode_attention(
      q, c, t, l, implementation=impl, interpret=interpret))
  good = run(cache, table, lens)
  assert np.all(np.isfinite(good))
  for bad_table, bad_lens in ((table.at[1, 1].set(6), lens),
                              (table.at[1, 0].set(-3), lens),
                              (table, lens.at[1].set(33)),
                              (table, lens.at[1].set(-1))):
    out = run(cache, bad_table, bad_lens)
    assert np.all(np.isnan(out[1]))
    np.testing.assert_array_equal(out[0], good[0])
    np.testing.assert_array_equal(out[2], good[2])
  # Append under jit: sequence 0 runs past its 2 pages (position 30, 4
  # tokens: 2 fit), sequence 2 names a page outside the pool (nothing
  # written), sequence 1 is fine.
  before = jax.tree.map(np.asarray, cache)
  new = jax.jit(serving.append)(
      jax.tree.map(jnp.array, cache), k[:, :4], v[:, :4],
      table.at[2, 0].set(99), jnp.asarray([30, 20, 0], jnp.int32))
  changed = np.nonzero(np.any(np.asarray(new.k_scales) != before.k_scales,
                              axis=0))
  # Sequence 0: page 1, slots 14-15; sequence 1: page 3, slots 4-7.
  assert set(zip(*changed)) == {(1, 14), (1, 15), (3, 4), (3, 5), (3, 6),
                                (3, 7)}


def test_kernel_writes_every_row_it_owns(next_key):
  """With outputs poisoned (NaN before the kernel runs), every row of every
  split is written: padding rows too (zeros, LSE −inf)."""
  from sagejax.serving import triton_paged
  sc = _scenario(next_key(), [20, 33], [3, 4], h=32, t=4)
  rows = sc["q"].reshape(8, 8, 32)
  for splits in (1, 3):
    res = triton_paged.paged_attention(
        rows, jnp.asarray([0, 4], jnp.int32), sc["q_len"],
        jnp.full(2, 4, jnp.int32), sc["kv_len"], sc["cache"], sc["table"],
        PagedMath(sm_scale=0.2, block_k=32), num_q_blocks=1,
        tiling=serving.PagedTiling(block_q=4, block_k=32),
        num_splits=splits, out_dtype=jnp.float32, interpret=True,
        poison=True)
    assert not any(np.isnan(np.asarray(r)).any() for r in res)


@pytest.mark.parametrize("layout", ["KPSH", "PSKH"])
@pytest.mark.parametrize("quantized,pv", [(False, "fp16"), (True, "fp16"),
                                          (True, "fp8_e4m3"), (True, "bf16")])
def test_lowers_for_cuda(monkeypatch, layout, quantized, pv):
  """Decode (split) and extend variants lower through Pallas's Triton path."""
  from sagejax.serving import attention as attention_lib
  monkeypatch.setattr(attention_lib, "_pallas_available", lambda: True)
  if layout == "KPSH":
    cache = serving.PagedKVCache.create(num_pages=40, page_size=16,
                                        num_kv_heads=2, head_dim=128,
                                        quantized=quantized)
    table = jnp.zeros((4, 10), jnp.int32)
  else:
    shape = (4, 160, 2, 128)
    k = jnp.zeros(shape, jnp.int8 if quantized else jnp.bfloat16)
    scales = jnp.ones(shape[:-1]) if quantized else None
    cache, table = serving.PagedKVCache.from_contiguous(
        k, k.astype(jnp.float8_e4m3fn) if quantized else k, scales, scales)
  config = serving.SERVING_CONFIG.replace(pv_dtype=pv)
  lens = jnp.full((4,), 150, jnp.int32)
  kw = dict(config=config, logits_soft_cap=30.0, local_window_size=64,
            implementation="pallas")
  for f, q in ((serving.decode_attention, jnp.zeros((4, 8, 128),
                                                    jnp.bfloat16)),
               (serving.extend_attention, jnp.zeros((4, 40, 8, 128),
                                                    jnp.bfloat16))):
    lowered = jax.jit(lambda q, c, t, l, f=f: f(q, c, t, l, **kw)).trace(
        q, cache, table, lens).lower(lowering_platforms=("cuda",))
    assert "sage_paged_attention" in lowered.as_text()


def _emulated_mosaic_forward(q, q_scale, k, k_scale, v, v_scale, v_mean,
                             delta_s, spec, *, q_lengths, kv_lengths,
                             out_dtype, out_layout, v_key_scale, tiling,
                             logits_soft_cap=None, row_shift=None):
  """``mosaic_attention.attention_forward``'s arithmetic in jnp (one global
  max instead of the running one), for checking the Mosaic extend's inputs
  on the CPU: shapes and padding as the kernel demands, V's key order undone,
  the per-key V factor applied to P̃ before it is rounded, the soft cap
  with the row shifts."""
  from sagejax.kernels.mosaic_attention import pv_key_order
  from sagejax.serving.reference import round_pv
  b, n, t, h = q.shape
  kh, s = k.shape[1], k.shape[2]
  assert delta_s is None and out_layout == "BTNH"
  assert t % (2 * tiling.block_q) == 0 and s % tiling.block_kv == 0
  assert q.dtype == k.dtype == jnp.int8 and v_key_scale.shape == (b, kh, s)
  fp8 = v.dtype == quant.FP8_DTYPE
  if fp8:     # [B, K, H, S] in the kernel's key order
    v = jnp.swapaxes(v[..., np.argsort(pv_key_order(s))], 2, 3)
  g = n // kh
  s_int = jnp.einsum("bkgth,bksh->bkgts",
                     q.reshape(b, kh, g, t, h).astype(jnp.int32),
                     k.astype(jnp.int32))
  s2 = (s_int.astype(jnp.float32) * k_scale[:, :, None, None]
        * q_scale.reshape(b, kh, g, t)[..., None])
  if logits_soft_cap is not None:
    shift = (None if row_shift is None
             else row_shift.reshape(b, kh, g, t)[..., None])
    s2 = quant.soft_cap_base2(s2, logits_soft_cap, shift)
  visible = spec.visible_at(jnp.arange(t)[:, None], jnp.arange(s)[None, :],
                            q_lengths[:, None, None, None, None],
                            kv_lengths[:, None, None, None, None])
  s2 = jnp.where(visible, s2, -jnp.inf)
  m = jnp.max(s2, axis=-1, keepdims=True)
  p = jnp.exp2(s2 - jnp.where(jnp.isfinite(m), m, 0.0))
  l = jnp.sum(p, axis=-1)[..., None]
  pv = round_pv(p * v_key_scale[:, :, None, None],
                "fp8_e4m3" if fp8 else "fp16")
  out = jnp.einsum("bkgts,bksh->bkgth", pv, v.astype(jnp.float32),
                   precision="highest")
  if fp8:
    out = out / quant.P_SCALE
  seen = l > 0
  out = jnp.where(seen, out / jnp.where(seen, l, 1.0), 0.0)
  out = out * v_scale[:, :, None, None]
  if v_mean is not None:
    out = jnp.where(seen, out + v_mean[:, :, None, None], 0.0)
  out = jnp.moveaxis(out.reshape(b, n, t, h), 1, 2)
  return out.astype(out_dtype), None


@pytest.mark.parametrize("pv,cap", [("fp16", None), ("fp8_e4m3", None),
                                    ("fp8_e4m3", 3.0)])
@pytest.mark.parametrize("layout", ["KPSH", "PSKH"])
def test_mosaic_extend_inputs(monkeypatch, next_key, pv, cap, layout):
  """The Mosaic extend's gather, key order, per-key V factor, lengths and
  bad-sequence handling, on the CPU, with the kernel replaced by its
  arithmetic in jnp: equals the ``"xla"`` reference with one P·V
  normalization block per sequence. Padded and packed queries, a window, a
  page id outside the pool (that sequence: NaN); a soft cap with K
  smoothing's row shifts."""
  from sagejax.serving import attention as attention_lib
  from sagejax.serving import mosaic_paged
  monkeypatch.setattr(attention_lib, "is_hopper", lambda: True)
  monkeypatch.setattr(attention_lib, "_mosaic_unsupported",
                      lambda cache, math, decode, interpret, groups:
                      mosaic_paged.unsupported(cache, math))
  monkeypatch.setattr(mosaic_paged, "attention_forward",
                      _emulated_mosaic_forward)
  kv_len, q_len = [300, 150, 64, 9], [130, 40, 64, 1]
  sc = _scenario(next_key(), kv_len, q_len, kh=2, g=3, h=64, t=130)
  cache, table = sc["cache"], sc["table"]
  if layout == "PSKH":   # the same tokens in a contiguous (Flax) cache
    b, s = table.shape[0], table.shape[1] * cache.page_size
    fields = {f: cache.gather(f, table) for f in
              ("k_pages", "v_pages", "k_scales", "v_scales")}
    cache, table = serving.PagedKVCache.from_contiguous(
        fields["k_pages"], fields["v_pages"], fields["k_scales"],
        fields["v_scales"], cache.k_smooth, cache.v_smooth,
        cache.smooth_fixed)
    assert table.shape == (b, s // cache.page_size)
  table = table.at[3, 0].set(cache.num_pages)           # outside the pool
  config = serving.SERVING_CONFIG.replace(pv_dtype=pv)
  kw = dict(local_window_size=100, config=config, implementation="mosaic",
            logits_soft_cap=cap)
  got = jax.jit(lambda *a: serving.extend_attention(  # jit: no value checks
      *a[:4], q_lengths=a[4], **kw))(sc["q"], cache, table, sc["kv_len"],
                                     sc["q_len"])
  math = PagedMath(sm_scale=64 ** -0.5, window=100, pv_dtype=pv,
                   block_k=table.shape[1] * cache.page_size, soft_cap=cap)
  want = jax.jit(reference.paged_attention, static_argnums=5)(
      sc["q"], sc["q_len"], cache, table, sc["kv_len"], math)
  got, want = np.asarray(got), np.asarray(want)
  assert np.all(np.isnan(got[3])) and np.all(np.isnan(want[3]))
  valid = (np.arange(130)[None] < np.asarray(q_len)[:, None])[:3]
  assert np.all(got[:3][~valid] == 0)
  assert _rel(got[:3], want[:3]) < 1e-5
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_len)]), jnp.int32)
  packed_q = jnp.concatenate([sc["q"][b, :n] for b, n in enumerate(q_len)])
  packed = jax.jit(lambda *a: serving.extend_attention(
      *a[:4], cu_seqlens=a[4], max_q_len=130, **kw))(
          packed_q, cache, table, sc["kv_len"], cu)
  np.testing.assert_array_equal(
      np.asarray(packed),
      np.concatenate([got[b, :n] for b, n in enumerate(q_len)]))


def test_mosaic_extend_selection(monkeypatch, next_key):
  """None picks the Mosaic extend on Hopper for long enough chunks of a
  quantized cache; calls it cannot serve name the reason."""
  from sagejax.kernels.mosaic_attention import MosaicTiling
  from sagejax.serving import attention as attention_lib
  monkeypatch.setattr(attention_lib, "is_hopper", lambda: True)
  monkeypatch.setattr(attention_lib, "_pallas_available", lambda: True)
  quant_cache = serving.PagedKVCache.create(num_pages=4, page_size=16,
                                            num_kv_heads=1, head_dim=64)
  plain = serving.PagedKVCache.create(num_pages=4, page_size=16,
                                      num_kv_heads=1, head_dim=64,
                                      quantized=False)
  math = PagedMath(sm_scale=0.125)
  pick = functools.partial(attention_lib._select, None, False,
                           jnp.ones((1, 1, 4, 64)))
  t = attention_lib.MOSAIC_MIN_QUERY_TOKENS
  assert pick(quant_cache, math, False, t, None) == "mosaic"
  assert pick(quant_cache, math, False, t - 1, None) == "pallas"
  assert pick(quant_cache, math, True, 1, None) == "pallas"        # decode
  assert pick(plain, math, False, t, None) == "pallas"
  assert pick(quant_cache, dataclasses.replace(math, soft_cap=5.0), False, t,
              None) == "mosaic"                                   # extend
  assert pick(quant_cache, dataclasses.replace(math, soft_cap=5.0), True, 1,
              None) == "pallas"   # decode: P̃ in FP16 here (Mosaic: FP8)
  assert pick(quant_cache, math, False, t,
              serving.PagedTiling()) == "pallas"
  assert pick(quant_cache, math, False, 1, MosaicTiling()) == "mosaic"
  # Packed rows: 4 sequences of 80 rows on average take Triton, whatever
  # max_q_len says.
  table, lens = jnp.zeros((4, 20), jnp.int32), jnp.full((4,), 300, jnp.int32)
  picked = []
  monkeypatch.setattr(attention_lib, "_paged",
                      lambda *a, implementation, **k: picked.append(
                          implementation))
  serving.extend_attention(jnp.ones((320, 4, 64)), quant_cache, table, lens,
                           cu_seqlens=jnp.arange(0, 321, 80, dtype=jnp.int32),
                           max_q_len=300)
  serving.extend_attention(jnp.ones((4, t, 4, 64)), quant_cache, table, lens)
  assert picked == ["pallas", "mosaic"]
  q = jnp.ones((1, 4, 1, 64))
  for kwargs, match in (
      (dict(implementation="pallas", tiling=MosaicTiling()), "PagedTiling"),
      (dict(implementation="mosaic", interpret=True), "interpreter")):
    with pytest.raises(ValueError, match=match):
      serving.extend_attention(q, quant_cache, jnp.zeros((1, 4), jnp.int32),
                               jnp.full((1,), 4, jnp.int32), **kwargs)
  with pytest.raises(ValueError, match="decode"):
    serving.decode_attention(q[:, 0], quant_cache,
                             jnp.zeros((1, 4), jnp.int32),
                             jnp.full((1,), 4, jnp.int32),
                             implementation="mosaic")


@pytest.mark.parametrize("pv", ["fp16", "fp8_e4m3"])
@pytest.mark.parametrize("h", [64, 128])
def test_mosaic_extend_lowers_for_cuda(monkeypatch, pv, h):
  """The Mosaic extend (padded and packed, window; soft cap with FP8 P̃)
  lowers for CUDA."""
  from sagejax.serving import attention as attention_lib
  monkeypatch.setattr(attention_lib, "is_hopper", lambda: True)
  cache = serving.PagedKVCache.create(num_pages=40, page_size=16,
                                      num_kv_heads=2, head_dim=h)
  table = jnp.zeros((4, 10), jnp.int32)
  lens = jnp.full((4,), 150, jnp.int32)
  kw = dict(config=serving.SERVING_CONFIG.replace(pv_dtype=pv),
            local_window_size=64, implementation="mosaic",
            logits_soft_cap=30.0 if pv == "fp8_e4m3" else None)
  for q, extra in ((jnp.zeros((4, 130, 8, h), jnp.bfloat16), {}),
                   (jnp.zeros((300, 8, h), jnp.bfloat16),
                    dict(cu_seqlens=jnp.asarray([0, 100, 200, 250, 300],
                                                jnp.int32), max_q_len=100))):
    lowered = jax.jit(lambda q, c, t, l, extra=extra: serving.extend_attention(
        q, c, t, l, **kw, **extra)).trace(q, cache, table, lens).lower(
            lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_mosaic_decode_selection_and_errors(monkeypatch):
  """Decode on Hopper takes the Mosaic kernel for INT8/FP8 pages of 32-128
  tokens (its default P̃ is FP8) and 16-bit pages of 64-128; other calls
  keep Triton, and a Mosaic decode asked for by name says why it cannot
  run."""
  from sagejax.kernels.mosaic_attention import MosaicTiling
  from sagejax.kernels.mosaic_decode import DecodeTiling
  from sagejax.serving import attention as attention_lib
  monkeypatch.setattr(attention_lib, "is_hopper", lambda: True)
  monkeypatch.setattr(attention_lib, "_pallas_available", lambda: True)
  make = functools.partial(serving.PagedKVCache.create, num_pages=8,
                           num_kv_heads=2, head_dim=64)
  cache64, cache16 = make(page_size=64), make(page_size=16)
  plain, plain32 = (make(page_size=64, quantized=False),
                    make(page_size=32, quantized=False))
  plain_f32 = make(page_size=64, quantized=False, dtype=jnp.float32)
  math = PagedMath(sm_scale=0.125, pv_dtype="fp8_e4m3")
  q = jnp.ones((1, 1, 8, 64))
  pick = functools.partial(attention_lib._select, None, False, q)
  assert pick(cache64, math, True, 1, None) == "mosaic"
  assert pick(cache64, math, True, 1, DecodeTiling()) == "mosaic"
  assert pick(plain, math, True, 1, None) == "mosaic"     # bf16 pages
  capped = dataclasses.replace(math, soft_cap=5.0)   # the kernel caps
  assert pick(cache64, capped, True, 1, None) == "mosaic"
  assert pick(plain, capped, True, 1, None) == "mosaic"
  for cache, m, tiling in (
      (cache16, math, None), (plain32, math, None), (plain_f32, math, None),
      (cache64, dataclasses.replace(math, pv_dtype="fp16"), None),
      (cache64, math, serving.PagedTiling())):
    assert pick(cache, m, True, 1, tiling) == "pallas"
  assert attention_lib._select(None, False, jnp.ones((1, 1, 130, 64)),
                               cache64, math, True, 1, None) == "pallas"
  # config=None means FP8 P̃ on the Mosaic kernels (MOSAIC_EXTEND_CONFIG).
  picked = []
  monkeypatch.setattr(attention_lib, "_paged",
                      lambda *a, implementation, tiling, math, **k:
                      picked.append((implementation, type(tiling), math))
                      or jnp.zeros((1, 1, 8, 64)))
  table, lens = jnp.zeros((1, 4), jnp.int32), jnp.full((1,), 60, jnp.int32)
  serving.decode_attention(q[:, 0], cache64, table, lens)
  [(impl, tiling_type, used)] = picked
  assert (impl, tiling_type) == ("mosaic", DecodeTiling)
  assert used.pv_dtype == "fp8_e4m3" and used.block_k == 64
  for cache, kwargs, match in (
      (cache16, dict(implementation="mosaic"), "page size 16"),
      (cache64, dict(implementation="mosaic", config=serving.SERVING_CONFIG),
       "pv_dtype"),
      (cache64, dict(tiling=MosaicTiling()), "DecodeTiling"),
      (cache64, dict(implementation="pallas", tiling=DecodeTiling()),
       "implementation='mosaic'")):
    with pytest.raises(ValueError, match=match):
      serving.decode_attention(q[:, 0], cache, table, lens, **kwargs)
  with pytest.raises(ValueError, match="MosaicTiling"):
    serving.extend_attention(q, cache64, table, lens, tiling=DecodeTiling())
  monkeypatch.setattr(attention_lib, "is_hopper", lambda: False)
  with pytest.raises(ValueError, match="sm90"):
    serving.decode_attention(q[:, 0], cache64, table, lens,
                             implementation="mosaic")


def test_mosaic_decode_tiling_and_splits():
  from sagejax.kernels import mosaic_decode
  for bad in (dict(num_stages=5), dict(num_stages=0), dict(num_splits=0),
              dict(consumer_registers=248),
              dict(num_consumers=3, consumer_registers=160),
              dict(num_consumers=5), dict(num_ctas=0)):
    with pytest.raises(ValueError, match="DecodeTiling"):
      mosaic_decode.DecodeTiling(**bad)
  # One wave of CTAs where the pairs fill the GPU, more splits where not.
  assert mosaic_decode.choose_splits(256, 64, 132) == 1
  assert mosaic_decode.choose_splits(64, 512, 132) == 2
  assert mosaic_decode.choose_splits(2, 512, 132) == 64
  assert mosaic_decode.choose_splits(8, 3, 132) == 1
  # The default ring fits shared memory, each consumer owning its slots,
  # and keeps 4 steps in flight where they fit.
  for ps in mosaic_decode.PAGE_SIZES:
    for h in mosaic_decode.HEAD_DIMS:
      for cons in (1, 2, 3, 4):
        if mosaic_decode._smem_bytes(ps, h, 32, cons, cons) > (227 << 10):
          continue   # no ring fits (e.g. 4 consumers of 128-key pages)
        stages = mosaic_decode.default_stages(ps, h, 32, cons)
        assert stages % cons == 0 and stages >= cons
        assert stages >= 4 or mosaic_decode._smem_bytes(
            ps, h, 32, cons, stages + cons) > (227 << 10)
        assert mosaic_decode._smem_bytes(ps, h, 32, cons, stages) <= (
            227 << 10)


def _emulated_decode_forward(q, k_pages, k_scales, v_pages, v_scales,
                             page_table, kv_len, *, sm_scale, window=None,
                             num_splits=1, v_smooth=None, out_dtype=None,
                             tiling=None, logits_soft_cap=None,
                             row_shift=None):
  """``mosaic_decode.decode_forward``'s outputs computed in jnp (f32 P, no
  FP8 rounding; a soft cap with its per-head shift as
  :func:`sagejax.quant.soft_cap_base2`): Q quantized per row (8-bit
  pages), each sequence's keys
  split in two halves; one split: the halves merged, ``v_smooth`` added,
  NaN for a bad length or (no window) a bad page id; several: the partials
  of the kernel's first two parts (``[NQ, H]``, base-2 LSE padded to 32),
  any further parts empty."""
  from sagejax.kernels import mosaic_decode
  from sagejax.serving import reference as reference_lib
  from sagejax.serving import triton_paged
  del tiling
  b, n, h = q.shape
  kh, num_pages, ps = k_pages.shape[:3]
  g = n // kh
  nq = mosaic_decode.padded_groups(g)
  quantized = k_scales is not None
  if quantized:
    q8, qs = reference_lib.quantize_query(q, sm_scale)
    q = q8.astype(jnp.float32) * qs[..., None]
  else:
    q = q.astype(jnp.float32) * (sm_scale * 1.4426950408889634)
  q = q.reshape(b, kh, g, h)
  table = jnp.clip(page_table, 0, num_pages - 1)
  def gather(x):   # [K, P, ps, ...] -> [B, K, S, ...]
    return jnp.moveaxis(x[:, table], 0, 1).reshape(
        (b, kh, -1) + x.shape[3:])
  k = gather(k_pages).astype(jnp.float32)
  if quantized:
    k = k * gather(k_scales)[..., None]
    v = gather(jnp.swapaxes(v_pages, 2, 3)).astype(jnp.float32)
    v = v * gather(v_scales)[..., None]
  else:
    v = gather(v_pages).astype(jnp.float32)
  max_pages = page_table.shape[1]
  bad_len = (kv_len < 1) | (kv_len > max_pages * ps)
  kv_len = jnp.where(bad_len, 0, kv_len)
  logits = jnp.einsum("bkgh,bksh->bkgs", q, k)
  if logits_soft_cap is not None:
    logits = quant.soft_cap_base2(
        logits, logits_soft_cap,
        None if row_shift is None else row_shift.reshape(b, kh, g)[..., None])
  s = logits.shape[-1]
  pos = jnp.arange(s)
  ok = pos[None] < kv_len[:, None]
  if window is not None:
    ok &= pos[None] >= kv_len[:, None] - 1 - window
  half = (kv_len // 2)[:, None]
  outs, lses = [], []
  for part in (pos[None] < half, pos[None] >= half):
    seen = (ok & part)[:, None, None]
    x = jnp.where(seen, logits, -jnp.inf)
    m = jnp.max(x, -1, keepdims=True)
    p = jnp.exp2(x - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, -1)
    o = jnp.einsum("bkgs,bksh->bkgh", p, jnp.where(
        (ok & part)[:, None, :, None], v, 0.0))
    outs.append(o / jnp.where(l > 0, l, 1.0)[..., None])
    lse = jnp.where(l > 0, m[..., 0] + jnp.log2(jnp.where(l > 0, l, 1.0)),
                    -jnp.inf)
    lses.append(lse)
  if num_splits == 1:
    out = triton_paged.merge_splits(
        jnp.stack(outs).reshape(2, b, n, h), jnp.stack(lses).reshape(2, b, n),
        v_smooth, out_dtype or q.dtype)
    bad = bad_len
    if window is None:
      used = jnp.arange(max_pages)[None] * ps < kv_len[:, None]
      outside = (page_table < 0) | (page_table >= num_pages)
      bad = bad | jnp.any(used & outside, axis=1)
    return jnp.where(bad[:, None, None], jnp.nan, out).astype(out.dtype), None
  pad = ((0, 0), (0, 0), (0, nq - g), (0, 0))
  outs = [jnp.pad(o, pad) for o in outs]
  lses = [jnp.pad(x, pad[:3], constant_values=-jnp.inf) for x in lses]
  lses = [jnp.pad(x, ((0, 0), (0, 0), (0, mosaic_decode.MAX_GROUPS - nq)),
                  constant_values=-jnp.inf) for x in lses]
  parts = 2 * num_splits
  empty_o = jnp.zeros_like(outs[0])
  empty_l = jnp.full_like(lses[0], -jnp.inf)
  return (jnp.stack(outs + [empty_o] * (parts - 2)),
          jnp.stack(lses + [empty_l] * (parts - 2)))


@pytest.mark.parametrize("quantized,window,splits,cap", [
    (True, None, 1, None), (True, None, 2, None), (True, 40, 1, None),
    (True, 40, 3, None), (False, None, 1, None), (False, None, 2, None),
    (True, None, 1, 2.0), (True, 40, 3, 2.0), (False, None, 2, 2.0)])
def test_mosaic_decode_inputs(monkeypatch, next_key, quantized, window,
                              splits, cap):
  """The Mosaic decode's wrapper on the CPU, with the kernel replaced by its
  arithmetic in jnp: Q in the query dtype (quantized in the kernel), one
  split (merged in the kernel, ``v_smooth`` there) or several (their LSE
  merge here), a soft cap (K smoothing's per-head shift made here, on
  8-bit pages), and NaN for a sequence whose page table names a page
  outside the pool (checked in the kernel without a window, here with
  one); against the ``"xla"`` reference (FP8 P̃ there, f32 in the
  emulation: ≤ 2e-2)."""
  from sagejax.kernels import mosaic_decode
  from sagejax.serving import attention as attention_lib
  monkeypatch.setattr(attention_lib, "is_hopper", lambda: True)
  monkeypatch.setattr(mosaic_decode, "decode_forward",
                      _emulated_decode_forward)
  lens = [300, 130, 65, 64, 1]
  sc = _scenario(next_key(), lens, [1] * len(lens), kh=2, g=3, h=64, ps=64,
                 quantized=quantized, dtype=jnp.bfloat16)
  q = sc["q"][:, 0]
  table = sc["table"].at[2, 0].set(10**6)   # sequence 2: a bad page
  run = jax.jit(lambda impl, table: serving.decode_attention(
      q, sc["cache"], table, sc["kv_len"], implementation=impl,
      local_window_size=window, logits_soft_cap=cap,
      config=serving.SERVING_CONFIG.replace(pv_dtype="fp8_e4m3"),
      tiling=(serving.DecodeTiling(num_splits=splits) if impl == "mosaic"
              else serving.PagedTiling(block_k=64))),
      static_argnums=0)
  got = np.asarray(run("mosaic", table))
  want = np.asarray(run("xla", table))
  assert np.all(np.isnan(got[2])) and np.all(np.isnan(want[2]))
  keep = np.arange(len(lens)) != 2
  assert np.all(np.isfinite(got[keep]))
  assert _rel(jnp.asarray(got[keep]), jnp.asarray(want[keep])) < 2e-2
  if not quantized:
    return
  lens2 = sc["kv_len"].at[3].set(10**6)      # sequence 3: a bad length
  got = np.asarray(jax.jit(lambda lens: serving.decode_attention(
      q, sc["cache"], sc["table"], lens, implementation="mosaic",
      local_window_size=window,
      tiling=serving.DecodeTiling(num_splits=splits)))(lens2))
  assert np.all(np.isnan(got[3]))
  assert np.all(np.isfinite(np.delete(got, 3, 0)))


@pytest.mark.parametrize("ps,h,g,window,splits,quantized,kh,cap", [
    (32, 64, 4, None, 1, True, 2, None), (32, 64, 4, None, 2, True, 2, 5.0),
    (64, 128, 4, None, 1, True, 2, None), (128, 128, 1, 300, 1, True, 2, 30.),
    (64, 64, 8, 100, 3, True, 2, None), (64, 128, 20, None, 1, True, 2, 5.0),
    (128, 64, 3, None, 1, True, 1, None), (64, 128, 4, None, 1, False, 2,
                                           None),
    (128, 64, 8, 200, 2, False, 2, 5.0)])
def test_mosaic_decode_lowers_for_cuda(monkeypatch, ps, h, g, window, splits,
                                       quantized, kh, cap):
  """The Mosaic decode kernel lowers for CUDA on the CPU (layouts, wgmma
  operands, the in-kernel Q quantization and merge, the shared-memory
  budget of its default ring): one split (merged in the kernel) or
  several (merged in a CTA cluster), 8-bit or 16-bit pages, fewer query
  heads than a ``wgmma`` N, a logit soft cap (with K smoothing's per-head
  shift on 8-bit pages). One launch and no state outside the call (no
  zeroed global buffer aliased into the kernel)."""
  from sagejax.serving import attention as attention_lib
  monkeypatch.setattr(attention_lib, "is_hopper", lambda: True)
  cache = serving.PagedKVCache.create(num_pages=40, page_size=ps,
                                      num_kv_heads=kh, head_dim=h,
                                      quantized=quantized,
                                      dtype=jnp.bfloat16)
  table = jnp.zeros((4, 10), jnp.int32)
  lens = jnp.full((4,), 150, jnp.int32)
  q = jnp.zeros((4, kh * g, h), jnp.bfloat16)
  tiling = serving.DecodeTiling(num_splits=splits)
  lowered = jax.jit(lambda q, c, t, l: serving.decode_attention(
      q, c, t, l, local_window_size=window, implementation="mosaic",
      tiling=tiling, logits_soft_cap=cap)).trace(q, cache, table, lens).lower(
          lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert text.count("mosaic_gpu") >= 1
  assert "output_operand_aliases" not in text


# ----------------------------------------------------------------------------
# GPU.
# ----------------------------------------------------------------------------


@gpu
@needs_gpu
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("ps", [16, 64])
def test_gpu_decode_and_extend_match_xla(next_key, quantized, ps):
  lens = [4100, 1000, 17, 16, 1]
  sc = _scenario(next_key(), lens, [1] * 5, kh=2, g=4, h=128, ps=ps,
                 quantized=quantized, kind="normal")
  q = sc["q"][:, 0].astype(jnp.bfloat16)
  run = jax.jit(lambda impl: serving.decode_attention(
      q, sc["cache"], sc["table"], sc["kv_len"], implementation=impl,
      logits_soft_cap=20.0), static_argnums=0)
  got, want = run("pallas"), run("xla")
  assert got.dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  assert _rel(got, want) < 1e-2
  sc = _scenario(next_key(), [600, 300, 130], [128, 40, 130], h=128, ps=ps,
                 quantized=quantized)
  run = jax.jit(lambda impl: serving.extend_attention(
      sc["q"].astype(jnp.bfloat16), sc["cache"], sc["table"], sc["kv_len"],
      q_lengths=sc["q_len"], implementation=impl), static_argnums=0)
  got, want = run("pallas"), run("xla")
  valid = (np.arange(130)[None] < np.asarray([128, 40, 130])[:, None])
  assert np.all(np.asarray(got, np.float32)[~valid] == 0)
  assert _rel(got, want, valid[..., None, None]) < 1e-2


@gpu
@needs_hopper
@pytest.mark.parametrize("pv,cap", [("fp16", None), ("fp8_e4m3", None),
                                    ("fp8_e4m3", 3.0)])
@pytest.mark.parametrize("h,ps,window", [(128, 16, None), (64, 64, 700)])
def test_gpu_mosaic_extend_matches_xla(next_key, pv, cap, h, ps, window):
  """The Mosaic extend, compiled, device memory poisoned first: odd lengths
  (chunks of 1000, 200, 257 and 1 token on prefixes of 0-3200), GQA 8/2,
  channel-bias data, against the ``"xla"`` reference and dense attention
  over the cache's dequantized tokens (both with the soft cap, if any)."""
  kv_len, q_len = [4200, 1000, 257, 130], [1000, 200, 257, 1]
  sc = _scenario(next_key(), kv_len, q_len, kh=2, g=4, h=h, ps=ps)
  q = sc["q"].astype(jnp.bfloat16)
  config = serving.SERVING_CONFIG.replace(pv_dtype=pv)
  run = jax.jit(lambda impl: serving.extend_attention(
      q, sc["cache"], sc["table"], sc["kv_len"], q_lengths=sc["q_len"],
      local_window_size=window, config=config, implementation=impl,
      logits_soft_cap=cap), static_argnums=0)
  jnp.full((64 << 20,), jnp.nan, jnp.float32).block_until_ready()  # poison
  got = run("mosaic")
  want = run("xla")
  k_deq, v_deq = _dequantized(sc)
  seen = _dense(q, k_deq, v_deq, sc["q_len"], sc["kv_len"], window, cap)
  valid = (np.arange(1000)[None] < np.asarray(q_len)[:, None])[..., None,
                                                                 None]
  out = np.asarray(got, np.float32)
  assert got.dtype == jnp.bfloat16 and got.shape == q.shape
  assert np.all(np.isfinite(out)) and not np.any(np.where(valid, 0.0, out))
  assert _rel(got, want, valid) < 1e-2
  assert _rel(got, seen, valid) < 0.03


@pytest.mark.parametrize("quantized", [False, True])
def test_non_finite_inputs_show_as_in_exact_attention(next_key, quantized):
  """A NaN key, a NaN value channel and an Inf query give NaN exactly where
  dense attention over the same tokens does; they never reach the cache's
  smoothing vectors (set by this very append) or other sequences."""
  _check_non_finite(next_key(), quantized, IMPLS, page_size=16, head_dim=32,
                    dtype=jnp.float32)


@gpu
@needs_hopper
@pytest.mark.parametrize("quantized", [False, True])
def test_gpu_mosaic_decode_non_finite_inputs(next_key, quantized):
  """The same on the Mosaic decode (pages of 64, INT8/FP8 or bf16)."""
  _check_non_finite(next_key(), quantized, [("mosaic", False)],
                    page_size=64, head_dim=64, dtype=jnp.bfloat16)


def _check_non_finite(key, quantized, impls, *, page_size, head_dim, dtype):
  q, k, v = (np.array(x) for x in _tokens(key, 3, 1, 20, 4, 2, head_dim,
                                          "channel_bias"))
  k[0, 3, 1, 5] = np.nan           # sequence 0, token 3, KV head 1
  v[1, 2, 0, 7] = np.nan           # sequence 1, token 2, KV head 0, channel 7
  q[2, 0, 3, 0] = np.inf           # sequence 2, query head 3
  per_seq = -(-20 // page_size)
  table = jnp.arange(3 * per_seq, dtype=jnp.int32).reshape(3, per_seq)
  cache = serving.PagedKVCache.create(num_pages=3 * per_seq,
                                      page_size=page_size, num_kv_heads=2,
                                      head_dim=head_dim, quantized=quantized,
                                      dtype=dtype)
  cache = serving.append(cache, jnp.asarray(k), jnp.asarray(v), table,
                         jnp.zeros(3, jnp.int32))
  if quantized:
    assert np.all(np.isfinite(cache.k_smooth))
    assert np.all(np.isfinite(cache.v_smooth))
  lens = jnp.full((3,), 20, jnp.int32)
  exact = _dense(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                 jnp.ones(3, jnp.int32), lens)[:, 0]
  want = np.isnan(np.asarray(exact)) | np.isinf(np.asarray(exact))
  assert want.any() and not want.all()
  for impl, interpret in impls:
    out = np.asarray(serving.decode_attention(
        jnp.asarray(q[:, 0]), cache, table, lens, implementation=impl,
        interpret=interpret))
    np.testing.assert_array_equal(~np.isfinite(out), want)


@gpu
@needs_hopper
@pytest.mark.parametrize("h,ps,g,window,tiling", [
    (128, 64, 4, None, {}), (128, 64, 4, None, dict(num_splits=1)),
    (128, 64, 4, None, dict(quantized=False)),
    (64, 128, 8, 700, dict(quantized=False, num_ctas=3)),
    (128, 32, 8, None, dict(num_consumers=4)),
    (64, 128, 4, 700, dict(num_consumers=3)),
    (128, 128, 1, 300, dict(num_splits=1, num_consumers=1)),
    (64, 64, 20, None, dict(num_splits=2)),
    (128, 64, 4, None, dict(num_ctas=3)),
    (128, 32, 4, 500, dict(num_ctas=2, num_splits=3, num_consumers=3)),
    (64, 64, 20, None, dict(num_splits=1, num_consumers=3)),
    (64, 128, 8, 700, dict(quantized=False, num_splits=1)),
    (128, 32, 4, None, dict(num_splits=1, num_ctas=3, q_f32=True)),
    (128, 64, 16, None, dict(num_splits=1, num_consumers=4, num_ctas=5)),
    (64, 64, 2, None, dict(num_splits=1, num_ctas=4)),
    (128, 64, 4, None, dict(num_splits=4, merge_splits=False)),
    (128, 32, 8, None, dict(num_splits=3, num_ctas=5, q_f32=True)),
    (128, 64, 4, None, dict(cap=5.0)),
    (64, 128, 8, 700, dict(quantized=False, cap=5.0)),
    (128, 32, 8, None, dict(num_splits=3, merge_splits=False, cap=30.0)),
    (64, 64, 20, None, dict(num_splits=1, num_consumers=3, cap=5.0))])
def test_gpu_mosaic_decode_matches_xla(next_key, h, ps, g, window, tiling):
  """The Mosaic decode, compiled, device memory poisoned first, on INT8/FP8
  and bf16 pages: lengths 4100, 1000, 65, 64, 63, 17 and 1 (partly filled
  last pages, a shared prefix), GQA g/2, channel-bias data, NaN in the
  stale slots past each sequence's last token; against the ``"xla"``
  reference (same FP8 P̃ and normalization blocks) and dense attention over
  the cache's dequantized tokens. Splits merged in the kernel (a cluster of
  CTAs per sequence, fewer clusters than sequences too) and by XLA
  (``merge_splits=False``); with a logit soft cap (K smoothing's per-head
  shift on 8-bit pages). A page id outside the pool, or a length out of
  range, gives NaN for its sequence only."""
  from sagejax.kernels import mosaic_decode
  from sagejax.kernels.mosaic_decode import DecodeTiling
  tiling = dict(tiling)
  quantized = tiling.pop("quantized", True)
  q_dtype = jnp.float32 if tiling.pop("q_f32", False) else jnp.bfloat16
  cap = tiling.pop("cap", None)
  lens = [4100, 1000, 65, 64, 63, 17, 1]
  sc = _scenario(next_key(), lens, [1] * len(lens), kh=2, g=g, h=h, ps=ps,
                 quantized=quantized, dtype=jnp.bfloat16)
  q = sc["q"][:, 0].astype(q_dtype)
  k_deq, v_deq = _dequantized(sc)
  ones = jnp.ones(len(lens), jnp.int32)
  seen = _dense(q[:, None], k_deq, v_deq, ones, sc["kv_len"], window,
                cap)[:, 0]
  cache = sc["cache"]
  table = np.asarray(sc["table"])
  for b, n in enumerate(lens):   # stale entries of each last page
    if n % ps:
      page = table[b, n // ps]
      if quantized:
        cache = dataclasses.replace(
            cache,
            v_pages=cache.v_pages.at[:, page, :, n % ps:].set(jnp.nan),
            v_scales=cache.v_scales.at[:, page, n % ps:].set(jnp.nan),
            k_scales=cache.k_scales.at[:, page, n % ps:].set(jnp.nan))
      else:
        cache = dataclasses.replace(
            cache, v_pages=cache.v_pages.at[:, page, n % ps:].set(jnp.nan),
            k_pages=cache.k_pages.at[:, page, n % ps:].set(jnp.nan))
  config = serving.SERVING_CONFIG.replace(pv_dtype="fp8_e4m3")
  tiling = DecodeTiling(**tiling)
  block = serving.PagedTiling(block_k=mosaic_decode.step_keys(ps))

  @functools.partial(jax.jit, static_argnums=0)
  def run(impl, table, lens=sc["kv_len"]):
    return serving.decode_attention(
        q, cache, table, lens, local_window_size=window,
        config=config, implementation=impl, logits_soft_cap=cap,
        tiling=tiling if impl == "mosaic" else block)

  jnp.full((64 << 20,), jnp.nan, jnp.float32).block_until_ready()  # poison
  got = run("mosaic", sc["table"])
  want = run("xla", sc["table"])
  out = np.asarray(got, np.float32)
  assert got.dtype == q_dtype and got.shape == q.shape
  assert np.all(np.isfinite(out))
  assert _rel(got, want) < 1e-2
  assert _rel(got, seen) < 0.03
  bad = np.asarray(run("mosaic", sc["table"].at[2, 0].set(10**6)), np.float32)
  assert np.all(np.isnan(bad[2]))
  np.testing.assert_array_equal(np.delete(bad, 2, 0), np.delete(out, 2, 0))
  lens = sc["kv_len"].at[4].set(10**6).at[5].set(0)   # lengths out of range
  bad = np.asarray(run("mosaic", sc["table"], lens), np.float32)
  assert np.all(np.isnan(bad[4:6]))
  np.testing.assert_array_equal(np.delete(bad, [4, 5], 0),
                                np.delete(out, [4, 5], 0))


@gpu
@needs_hopper
@pytest.mark.parametrize("keys,nq,ps,dtype", [
    (64, 8, 64, "fp8"), (64, 16, 32, "fp8"), (128, 8, 128, "fp8"),
    (64, 32, 64, "fp8"), (64, 8, 64, "bf16"), (128, 16, 128, "bf16")])
def test_gpu_mosaic_decode_transposed_store(keys, nq, ps, dtype):
  """The decode kernel's byte stores of P at the hardware swizzle: values
  made in registers ([keys, NQ], WGMMA layout), stored transposed into
  swizzled page tiles, copied out by TMA (which unswizzles) equal the
  transpose (outputs poisoned first)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from sagejax.kernels import mosaic_decode
  from sagejax.kernels.mosaic_attention import wgmma_smem
  pps = keys // ps
  dtype = quant.FP8_DTYPE if dtype == "fp8" else jnp.bfloat16

  def pattern(k, g):
    return ((k * 7 + g * 3) % 61).astype(jnp.float32) - 30.0

  def body(out_ref, p_smem):
    k = plgpu.broadcasted_iota(jnp.int32, (keys, nq), 0,
                               layout=plgpu.Layout.WGMMA)
    g = plgpu.broadcasted_iota(jnp.int32, (keys, nq), 1,
                               layout=plgpu.Layout.WGMMA)
    mosaic_decode._store_transposed(pattern(k, g).astype(dtype), p_smem, ps)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(p_smem, out_ref)
    plgpu.wait_smem_to_gmem(0)

  def kernel(out_ref):
    pl.run_scoped(functools.partial(body, out_ref),
                  wgmma_smem((pps, nq, ps), dtype))

  run = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((pps, nq, ps), dtype))
  jnp.full((64 << 20,), jnp.nan, jnp.float32).block_until_ready()  # poison
  got = np.asarray(jax.jit(run)().astype(jnp.float32))
  k = np.arange(keys)[:, None]
  g = np.arange(nq)[None, :]
  want = np.asarray(pattern(jnp.asarray(k), jnp.asarray(g)).astype(
      dtype).astype(jnp.float32))                       # [keys, NQ]
  want = want.reshape(pps, ps, nq).transpose(0, 2, 1)
  np.testing.assert_array_equal(got, want)

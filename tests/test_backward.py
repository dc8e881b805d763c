"""The kernel backward (sagejax.kernels.triton_backward) and its dispatch.

On CPU the backward kernels run in the Pallas interpreter on small shapes
against ``jax.grad`` of :func:`sagejax.exact_attention` and against the
``"xla"`` backward (:mod:`sagejax._vjp`), and are lowered for CUDA. FP32
inputs make the kernels' products exact FP32, so with recomputed statistics
they must match to ~1e-6; the saved-statistics and INT8 paths are checked
against their own oracles and for their measured accuracy. Tests marked
``gpu`` run the compiled kernels (outputs poisoned with NaN first).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sagejax
from sagejax import PRESETS, _inputs, _vjp, backends, testing
from sagejax.backends import pallas_triton, xla
from sagejax.kernels._common import (q_block_range, visit_block,
                                     visit_blocks, visit_position)
from sagejax.kernels.triton_backward import BackwardTiling
from sagejax.masks import MaskSpec

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")

# Small tiles keep the interpreter fast; the math is the same at any size.
TILING = BackwardTiling(block_q=16, block_k=32, block_q_dq=32, block_k_dq=16,
                        num_warps=4, num_stages=1, num_warps_dq=4,
                        num_stages_dq=1)
RECOMPUTE = PRESETS["sage2-8b"].replace(backward_stats="recompute")
INTERPRET = pallas_triton.INTERPRET_BACKEND


def _exact_grads(q, k, v, bias, do, u, kw):
  """jax.grad of exact attention (FP32) w.r.t. q, k, v (and bias)."""
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

  def loss(q, k, v, bias):
    out, lse = sagejax.exact_attention(q, k, v, bias, return_lse=True, **kw)
    return (jnp.sum(out * f32(do))
            + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * u))
  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  return jax.jit(jax.grad(loss, argnums))(f32(q), f32(k), f32(v), bias)


def _kernel_grads(call, config, do, u, tiling=TILING, backend=INTERPRET):
  """The backend's backward as the custom VJP runs it (after its forward
  when the statistics are saved); returns (grads, saved or None)."""
  saved = None
  if config.saved_stats:
    out, lse = backend.forward(call, config)
    saved = (out.astype(call.q.dtype), lse)
  return backend.backward(call, config, do, u, saved, tiling=tiling), saved


def _rel(got, want):
  return testing.error_metrics(got, want)["rel_l2"]


def _draw(key, b, t, s, n, kw):
  """Lengths, mask and bias requested by a case, drawn at random."""
  kw = dict(kw)
  k1, k2, k3, k4 = jax.random.split(key, 4)
  if kw.pop("q_lengths", False):
    kw["query_seq_lengths"] = jax.random.randint(k1, (b,), 1, t + 1)
  if kw.pop("kv_lengths", False):
    kw["key_value_seq_lengths"] = jax.random.randint(k2, (b,), 1, s + 1)
  mask = bias = None
  if "mask" in kw:
    mask = jax.random.bernoulli(k3, 0.7, kw.pop("mask"))
  if "bias" in kw:
    bias = 2.0 * jax.random.normal(k4, kw.pop("bias"))
  return mask, bias, kw


# (name, (B, T, S, N, K, H), layout, kwargs)
CASES = [
    ("plain_t17_gqa", (2, 17, 17, 4, 2, 32), "BTNH", {}),
    ("causal_t1000", (1, 1000, 1000, 1, 1, 16), "BTNH", {"is_causal": True}),
    ("bottom_right_lengths_mqa", (2, 50, 130, 3, 1, 48), "BNTH",
     {"is_causal": True, "causal_alignment": "bottom_right",
      "q_lengths": True, "kv_lengths": True}),
    ("window_mask_row_bias", (2, 64, 100, 4, 2, 16), "BTNH",
     {"local_window_size": (20, 5), "mask": (2, 1, 64, 100),
      "bias": (1, 1, 64, 1)}),
    ("decode_t1_key_bias", (2, 1, 257, 4, 2, 64), "BNTH",
     {"is_causal": True, "causal_alignment": "bottom_right",
      "bias": (1, 4, 1, 257), "kv_lengths": True}),
    ("full_bias_causal", (2, 30, 50, 4, 2, 32), "BTNH",
     {"is_causal": True, "bias": (2, 4, 30, 50)}),
]


@pytest.mark.parametrize("name,shape,layout,kw", CASES,
                         ids=[c[0] for c in CASES])
def test_kernel_backward_matches_exact(name, shape, layout, kw, qkv,
                                       next_key):
  """Recomputed statistics: dQ, dK, dV (and dbias) = jax.grad of exact
  attention and = the "xla" backward, on channel-biased FP32 data."""
  b, t, s, n, kh, h = shape
  q, k, v = qkv(b, t, s, n, kh, h, kind="qkv_channel_bias",
                dtype=jnp.float32, layout=layout)
  mask, bias, kw = _draw(next_key(), b, t, s, n, kw)
  do = jax.random.normal(next_key(), q.shape)
  u = jax.random.normal(next_key(), (b, n, t))
  arrays = {a: kw.pop(a) for a in ("query_seq_lengths",
                                    "key_value_seq_lengths") if a in kw}
  parse = lambda q, k, v, bias, mask, arrays: _inputs.parse(  # noqa: E731
      q, k, v, bias, mask, layout=layout, **kw, **arrays)
  call = parse(q, k, v, bias, mask, arrays)
  got = jax.jit(lambda *a: _kernel_grads(parse(*a[:6]), RECOMPUTE, *a[6:])[
      0])(q, k, v, bias, mask, arrays, do, u)
  kw.update(mask=mask, layout=layout, **arrays)
  want = list(_exact_grads(q, k, v, bias, do, u, kw)) + [None]
  if bias is not None or mask is not None:  # and the "xla" backward
    canon = functools.partial(_inputs.to_canonical, layout=layout)
    oracle = _vjp.attention_backward(
        canon(q), canon(k), canon(v), call.bias, call.mask, call.q_lengths,
        call.kv_lengths, canon(do), u, call.spec, call.sm_scale)
    for g, o in zip(got, [_inputs.from_canonical(x, layout)
                          for x in oracle[:3]] + [oracle[3]]):
      assert o is None or _rel(g, o) < 1e-5, _rel(g, o)
  for i, (g, w) in enumerate(zip(got, want)):
    if w is None:
      assert g is None
      continue
    assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, w.shape)
    assert np.all(np.isfinite(g))
    # Measured ~1e-7 (the FP32 sums run in another order).
    assert _rel(g, w) < 1e-5, (i, _rel(g, w))
  if "query_seq_lengths" in kw:  # padded query rows get no gradient
    rows = jnp.arange(t) >= kw["query_seq_lengths"][:, None]
    rows = rows[:, :, None, None] if layout == "BTNH" else rows[:, None, :,
                                                                 None]
    np.testing.assert_array_equal(jnp.where(rows, got[0], 0), 0)


def test_query_block_range_matches_mask_rule():
  """Visited query blocks hold every row that sees a key of the KV block;
  unmasked ones only rows that see all of its keys."""
  rng = np.random.default_rng(0)
  for _ in range(40):
    t, s = int(rng.integers(1, 700)), int(rng.integers(1, 700))
    window = (None if rng.integers(2) else
              (int(rng.integers(0, 300)), int(rng.integers(0, 300))))
    spec = MaskSpec(bool(rng.integers(2)),
                    ("top_left", "bottom_right")[int(rng.integers(2))],
                    window, t, s)
    q_len, kv_len = int(rng.integers(1, t + 1)), int(rng.integers(1, s + 1))
    bq, cols = 64, 128
    nq = -(-t // bq)
    for first in range(0, s, cols):
      lo, flo, fhi, hi = (int(x) for x in q_block_range(
          spec, first, min(first + cols, kv_len) - 1, q_len, kv_len, bq, nq))
      vis = np.asarray(spec.visible_at(np.arange(nq * bq)[:, None],
                                       np.arange(first, first + cols)[None],
                                       q_len, kv_len))
      seen = vis.reshape(nq, bq, cols).any(axis=(1, 2))
      assert not seen[:lo].any() and not seen[hi:].any()
      for blk in range(flo, fhi):
        assert vis[blk * bq:(blk + 1) * bq, :min(cols, kv_len - first)].all()


@pytest.mark.parametrize("unmasked_first", [False, True])
def test_visit_order_is_one_permutation_for_consumers_and_producer(
    unmasked_first):
  """visit_blocks visits each block of [lo, hi) once, masked exactly where
  outside [full_lo, full_hi); visit_block (a producer's load order) gives
  the same sequence and visit_position (a consumer's ring slot) inverts
  it. With unmasked_first the unmasked blocks come first."""
  rng = np.random.default_rng(1)
  for _ in range(30):
    lo, full_lo, full_hi, hi = np.sort(rng.integers(0, 12, 4))
    if rng.integers(4) == 0:  # all masked (lengths): full range empty
      full_lo = full_hi = lo
    blocks = tuple(jnp.int32(x) for x in (lo, full_lo, full_hi, hi))

    def body(j, seq, masked):
      n = seq[0]
      return (n + 1, seq[1].at[n].set(j), seq[2].at[n].set(masked))

    n, order, masked = visit_blocks(
        blocks, body, (jnp.int32(0), jnp.full(16, -1), jnp.zeros(16, bool)),
        unmasked_first=unmasked_first)
    order, masked = np.asarray(order)[:int(n)], np.asarray(masked)[:int(n)]
    assert sorted(order) == list(range(lo, hi))
    np.testing.assert_array_equal(masked,
                                  (order < full_lo) | (order >= full_hi))
    if unmasked_first:
      assert list(order[:full_hi - full_lo]) == list(range(full_lo, full_hi))
    for t, j in enumerate(order):
      assert int(visit_block(blocks, jnp.int32(t), unmasked_first)) == j
      assert int(visit_position(blocks, jnp.int32(j), unmasked_first)) == t


@pytest.mark.parametrize("field,t,s,window", [
    ("dq_atomic", 70, 90, None), ("unmasked_first", 90, 110, (40, 5))])
def test_backward_tiling_variants_match_the_default(qkv, next_key, field, t,
                                                   s, window):
  """Tiling variants of the Triton backward give the default's gradients:
  dQ accumulated by the dK/dV kernel with FP32 atomics (= the dQ kernel),
  and the unmasked blocks visited first, then the masked ones in one loop
  (= the three-loop order; a window masks a head and a tail). Causal, key
  lengths."""
  q, k, v = qkv(2, t, s, 4, 2, 32, kind="channel_bias", dtype=jnp.float32)
  do = jax.random.normal(next_key(), q.shape)
  u = jax.random.normal(next_key(), (2, 4, t))
  call = _inputs.parse(q, k, v, is_causal=True, local_window_size=window,
                       key_value_seq_lengths=jnp.array([s, s // 2]))
  got, _ = _kernel_grads(call, RECOMPUTE, do, u,
                         dataclasses.replace(TILING, **{field: True}))
  want, _ = _kernel_grads(call, RECOMPUTE, do, u)
  for g, w in zip(got[:3], want[:3]):
    assert _rel(g, w) < 1e-6


class _XlaForward(pallas_triton._PallasTritonBackend):
  """The kernel backward behind the "xla" forward (the same arithmetic as
  the kernels' forward, tested in test_pallas.py, and fast on CPU)."""

  def forward(self, call, config):
    return xla.BACKEND.forward(call, config)


FAST = _XlaForward(interpret=True)


def test_saved_statistics(qkv, next_key):
  """Saved output and LSE: = the "xla" backward given the same statistics
  (its oracle); vs exact the forward's error enters through δ (16-bit P·V
  here; sage2-8b's FP8 P·V is why "auto" recomputes for it: NOTES.md)."""
  config = PRESETS["sage1"]  # "auto" → saved
  assert config.saved_stats and not PRESETS["sage2-8b"].saved_stats
  grads = jax.jit(lambda q, k, v, do, u: _kernel_grads(
      _inputs.parse(q, k, v, is_causal=True), config, do, u, backend=FAST))
  for kind in ("normal", "channel_bias"):
    q, k, v = qkv(1, 96, 128, 4, 2, 64, kind=kind, dtype=jnp.bfloat16)
    do = jax.random.normal(next_key(), q.shape).astype(q.dtype)
    u = jax.random.normal(next_key(), (1, 4, 96))
    got, (out, lse) = grads(q, k, v, do, u)
    canon = lambda x: jnp.swapaxes(x, 1, 2).astype(jnp.float32)  # noqa: E731
    oracle = _vjp.attention_backward(
        canon(q), canon(k), canon(v), None, None, None, None, canon(do), u,
        _inputs.parse(q, k, v, is_causal=True).spec, 0.125,
        saved=(canon(out), lse))
    want = _exact_grads(q, k, v, None, do, u, {"is_causal": True})
    for g, o, w in zip(got[:3], oracle[:3], want):
      g = canon(g)
      # bf16 products in the kernel vs FP32 in the oracle: measured <= 3e-3.
      assert _rel(g, o) < 1e-2, _rel(g, o)
      assert testing.error_metrics(g, canon(w))["cos_sim"] > 0.999


@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
def test_saved_statistics_kernel(qkv, next_key, layout):
  """lse₂ and δ of the Mosaic backward's one-pass kernel (interpreted) ==
  the formulas on the forward's LSE and output: the row shift q·k̄ taken
  out, −inf rows unseen (lse₂ +inf, δ 0), a NaN LSE kept."""
  from sagejax import quant  # pylint: disable=g-import-not-at-top
  from sagejax.kernels import triton_backward  # pylint: disable=g-import-not-at-top
  b, t, n, kh, h = 2, 128, 4, 2, 64
  q, _, _ = qkv(b, t, t, n, kh, h, kind="qkv_channel_bias", layout=layout)
  out, d_out, _ = qkv(b, t, t, n, n, h, layout=layout)
  k_mean = 3.0 * jax.random.normal(next_key(), (b, kh, h), jnp.float32)
  lse = 5.0 * jax.random.normal(next_key(), (b, n, t), jnp.float32)
  lse = lse.at[0, 1, 7].set(-jnp.inf).at[1, 2, 9].set(jnp.nan)
  d_lse = jax.random.normal(next_key(), (b, n, t), jnp.float32)
  q_lengths = jnp.array([t, 100], jnp.int32)
  lse2, delta = triton_backward.saved_statistics(
      q, lse, k_mean, q_lengths=q_lengths, sm_scale=h ** -0.5,
      layout=layout, out=out, d_out=d_out, d_lse=d_lse, interpret=True)
  canon = lambda x: _inputs.to_canonical(x, layout).astype(jnp.float32)
  smoothed = lse - quant.lse_shift(quant.zero_padding(canon(q), q_lengths),
                                   k_mean, h ** -0.5)
  seen = smoothed != -jnp.inf
  want_lse2 = jnp.where(seen, smoothed * quant.LOG2E, jnp.inf)
  want_delta = jnp.where(
      seen, jnp.sum(canon(out) * canon(d_out), -1) - d_lse, 0.0)
  np.testing.assert_allclose(lse2, want_lse2, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(delta, want_delta, rtol=1e-5, atol=1e-4)
  assert lse2[0, 1, 7] == jnp.inf and delta[0, 1, 7] == 0
  assert np.isnan(lse2[1, 2, 9])  # and reaches the gradients through P
  lse2_alone, none = triton_backward.saved_statistics(
      q, lse, k_mean, q_lengths=q_lengths, sm_scale=h ** -0.5,
      layout=layout, interpret=True)
  assert none is None
  np.testing.assert_array_equal(lse2_alone, lse2)
  # lse₂ kept by the forward (mosaic.forward_residual): δ alone, no Q read.
  given, delta_alone = triton_backward.saved_statistics(
      None, lse2, None, q_lengths=q_lengths, sm_scale=h ** -0.5,
      layout=layout, out=out, d_out=d_out, d_lse=d_lse, interpret=True)
  assert given is lse2
  np.testing.assert_array_equal(delta_alone, delta)
  with pytest.raises(ValueError, match="neither"):
    triton_backward.saved_statistics(
        None, lse2, None, q_lengths=q_lengths, sm_scale=h ** -0.5,
        layout=layout, interpret=True)


class _Lse2Backend:
  """A stand-in for the Mosaic backend's lse₂ residual: the "xla" forward,
  a marked row statistic (2·LSE + 1) from ``forward_residual``, and the
  exact backward, recording what it was handed."""
  name, platform = "mosaic", "cuda"

  def __init__(self):
    self.calls = []

  def available(self):
    return True

  def unsupported(self, call, config):
    return None

  def backward_unsupported(self, call, config):
    return None

  def forward(self, call, config):
    return xla.BACKEND.forward(call, config)

  def saves_lse2(self, call, config):
    return config.saved_stats

  def forward_residual(self, call, config):
    out, lse = self.forward(call, config)
    return out, lse, 2.0 * lse + 1.0

  def backward(self, call, config, d_out, d_lse, saved, saved_lse2=False):
    out, rows = saved
    self.calls.append((saved_lse2, jax.ShapeDtypeStruct(rows.shape,
                                                        rows.dtype)))
    lse = (rows - 1.0) / 2.0 if saved_lse2 else rows
    canon = functools.partial(_inputs.to_canonical, layout=call.layout)
    grads = _vjp.attention_backward(
        canon(call.q), canon(call.k), canon(call.v), None, None, None, None,
        canon(d_out), d_lse, call.spec, call.sm_scale,
        saved=None if out is None else (canon(out), lse))
    return tuple(_inputs.from_canonical(g, call.layout)
                 for g in grads[:3]) + (None,)


def test_forward_keeps_lse2_for_its_own_backward(qkv, next_key, monkeypatch):
  """Under jax.grad a backend that ``saves_lse2`` (the Mosaic one) hands
  its backward the row statistic of its ``forward_residual``, flagged
  ``saved_lse2``, in place of the LSE; the caller still gets the natural-log
  LSE; without saved statistics the LSE is kept as before."""
  fake = _Lse2Backend()
  monkeypatch.setitem(backends.registry(), "mosaic", fake)
  q, k, v = qkv(1, 40, 60, 4, 2, 32, kind="channel_bias", dtype=jnp.float32)
  w = jax.random.normal(next_key(), q.shape)
  u = jax.random.normal(next_key(), (1, 4, 40))

  def loss(fn):
    def f(q, k, v):
      out, lse = fn(q, k, v, is_causal=True, return_lse=True)
      return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse,
                                                  0.0) * u)
    return f

  want = jax.jit(jax.grad(loss(sagejax.exact_attention), (0, 1, 2)))(q, k, v)
  _, want_lse = sagejax.exact_attention(q, k, v, is_causal=True,
                                        return_lse=True)
  for config, flagged in (("sage1", True), (RECOMPUTE, False)):
    fn = functools.partial(sagejax.attention, config=config,
                           implementation="mosaic")
    got = jax.jit(jax.grad(loss(fn), (0, 1, 2)))(q, k, v)
    (saved_lse2, rows), = fake.calls
    fake.calls.clear()
    assert saved_lse2 is flagged
    # The forward rule's LSE (jax.vjp runs it) is the natural-log one, up to
    # the quantization's error, whichever statistic it kept.
    (_, lse), _ = jax.vjp(lambda q, k, v, fn=fn: fn(
        q, k, v, is_causal=True, return_lse=True), q, k, v)
    np.testing.assert_allclose(lse, want_lse, atol=0.05)
    # The backward decodes the marker only when flagged: handed the LSE (or
    # the marker unflagged), its gradients would miss by far more.
    assert rows.shape == lse.shape
    for g, r in zip(got, want):
      assert testing.error_metrics(g, r)["cos_sim"] > 0.9999


def test_int8_backward_accuracy(qkv, next_key):
  """SageBwd's INT8 backward: within its measured error of exact."""
  config = RECOMPUTE.replace(backward_int8=True)
  tiling = dataclasses.replace(TILING, block_q=32, block_k_dq=32)
  grads = jax.jit(lambda q, k, v, do: _kernel_grads(
      _inputs.parse(q, k, v, is_causal=True), config, do,
      jnp.zeros((1, 2, 128)), tiling)[0])
  for kind in ("normal", "channel_bias"):
    q, k, v = qkv(1, 128, 128, 2, 1, 64, kind=kind, dtype=jnp.bfloat16)
    do = jax.random.normal(next_key(), q.shape).astype(q.dtype)
    got = grads(q, k, v, do)
    want = _exact_grads(q, k, v, None, do, jnp.zeros((1, 2, 128)),
                        {"is_causal": True})
    for g, w in zip(got[:3], want):
      # Measured 0.9981-0.9992 at T=S=1024 (NOTES.md, B3).
      cos = testing.error_metrics(g, w)["cos_sim"]
      assert cos > 0.997, (kind, cos)


def test_custom_vjp_uses_the_kernel_backward(qkv, next_key, monkeypatch):
  """sagejax.attention under jax.grad runs the forward backend's backward
  (here the interpreted kernels standing in for "pallas"), saving the
  forward's LSE and, only when the config says so, its output; a kernel backend
  without a backward borrows it; with no kernel backward serving the call,
  the "xla" backward runs."""
  monkeypatch.setitem(backends.registry(), "pallas", FAST)
  calls = []
  real = pallas_triton._PallasTritonBackend.backward

  def spy(self, call, config, d_out, d_lse, saved, tiling=None):
    assert saved is not None and saved[1].shape == d_lse.shape  # the LSE
    calls.append(saved[0] is not None)  # the output: δ's source
    return real(self, call, config, d_out, d_lse, saved, tiling or TILING)
  monkeypatch.setattr(pallas_triton._PallasTritonBackend, "backward", spy)
  q, k, v = qkv(1, 40, 60, 4, 2, 32, kind="channel_bias", dtype=jnp.float32)
  w = jax.random.normal(next_key(), q.shape)

  def grads(fn):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        fn(q, k, v, is_causal=True) * w), (0, 1, 2)))(q, k, v)
  want = grads(sagejax.exact_attention)
  for config, saved in ((RECOMPUTE, False), ("sage1", True)):
    got = grads(functools.partial(sagejax.attention, config=config,
                                  implementation="pallas"))
    assert calls.pop() is saved
    for g, r in zip(got, want):
      assert testing.error_metrics(g, r)["cos_sim"] > 0.9999
  # A kernel backend without a backward borrows the "pallas" one.
  forward_only = type("ForwardOnly", (), dict(
      name="mosaic", available=lambda self: True,
      unsupported=lambda self, call, config: None,
      forward=lambda self, call, config: xla.BACKEND.forward(call, config)))()
  monkeypatch.setitem(backends.registry(), "mosaic", forward_only)
  got = grads(functools.partial(sagejax.attention, config="sage1",
                                implementation="mosaic"))
  assert calls.pop() is True
  for g, r in zip(got, want):
    assert testing.error_metrics(g, r)["cos_sim"] > 0.9999
  monkeypatch.setattr(pallas_triton._PallasTritonBackend,
                      "backward_unsupported", lambda *a: "not today")
  got = grads(functools.partial(sagejax.attention, config=RECOMPUTE,
                                implementation="pallas"))
  assert not calls
  for g, r in zip(got, want):  # the "xla" backward (test_grad.py's bound)
    assert _rel(g, r) < 1e-4


def test_differentiated_forward_has_16_bit_pv(qkv, next_key, monkeypatch):
  """sage2-8b ("auto") under jax.grad with a kernel backward: the forward
  runs P·V in the inputs' 16-bit type (SageConfig.differentiated; BF16
  here), its value is that forward's
  and the backward takes δ from its output, within cos 0.999 of exact
  gradients on channel-outlier data. After the "xla" forward (no kernel
  backward) nothing changes."""
  monkeypatch.setitem(backends.registry(), "pallas", FAST)
  sage = PRESETS["sage2-8b"]
  # 16-row Q warps: groups the Hopper kernel makes in its prologue.
  fp16_pv = sage.replace(pv_dtype="fp16", pv_accumulation="fp32",
                         num_warps=8)
  bf16_pv = sage.replace(pv_dtype="bf16", pv_accumulation="fp32",
                         num_warps=8)
  assert bf16_pv.rows_per_warp == 16
  assert sage.differentiated(jnp.float16) == fp16_pv and fp16_pv.saved_stats
  assert sage.differentiated(jnp.bfloat16) == bf16_pv and bf16_pv.saved_stats
  assert sage.differentiated(jnp.float32) == bf16_pv
  assert RECOMPUTE.differentiated() == RECOMPUTE
  assert PRESETS["sage1"].differentiated() == PRESETS["sage1"]
  assert PRESETS["sage2-4b"].differentiated() == PRESETS["sage2-4b"]
  saw = []
  real = pallas_triton._PallasTritonBackend.backward

  def spy(self, call, config, d_out, d_lse, saved, tiling=None):
    saw.append((config, saved[0] is not None))
    return real(self, call, config, d_out, d_lse, saved, tiling or TILING)
  monkeypatch.setattr(pallas_triton._PallasTritonBackend, "backward", spy)
  q, k, v = qkv(1, 96, 128, 4, 2, 64, kind="qkv_channel_bias",
                dtype=jnp.bfloat16)
  w = jax.random.normal(next_key(), q.shape)

  def value_and_grads(fn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(
        fn(q, k, v, is_causal=True).astype(jnp.float32) * w), (0, 1, 2)))(
            q, k, v)

  def value(config, impl):
    return jax.jit(lambda q, k, v: jnp.sum(sagejax.attention(
        q, k, v, is_causal=True, config=config,
        implementation=impl).astype(jnp.float32) * w))(q, k, v)

  got_value, got = value_and_grads(functools.partial(
      sagejax.attention, config="sage2-8b", implementation="pallas"))
  assert saw.pop() == (bf16_pv, True)
  # The value is the BF16-P·V forward's (up to summation order), not the
  # FP8 forward's (which differs by quantization noise).
  assert abs(got_value - value(bf16_pv, "pallas")) < 0.1 * abs(
      got_value - value(sage, "pallas"))
  _, want = value_and_grads(sagejax.exact_attention)
  for g, r in zip(got, want):
    assert testing.error_metrics(g, r)["cos_sim"] > 0.999
  got_value, _ = value_and_grads(functools.partial(
      sagejax.attention, config="sage2-8b", implementation="xla"))
  assert not saw
  assert abs(got_value - value(sage, "xla")) < 0.1 * abs(
      got_value - value(bf16_pv, "xla"))


def test_triton_backward_tiles_above_head_dim_128():
  """Above H=128 16-bit inputs take 32-key dK/dV programs on 2 stages
  (NOTES B26: an H=256 training step 2.5x faster than on the FP32 tiles);
  FP32 inputs keep the smallest tiles (theirs need twice the shared
  memory)."""
  wide = pallas_triton.default_backward_tiling(256)
  assert (wide.block_q, wide.block_k, wide.num_stages) == (64, 32, 2)
  # dK and dV of a program: at most 128 f32 values a thread.
  assert 2 * wide.block_k * 256 <= 128 * 32 * wide.num_warps
  fp32 = pallas_triton.default_backward_tiling(256, itemsize=4)
  assert fp32 == pallas_triton.default_backward_tiling(128, itemsize=4)
  assert fp32.num_stages == 1


LOWER_CASES = [
    # layout, H, causal, mask/bias, config, atomic dQ
    ("BTNH", 128, True, False, RECOMPUTE, False),
    ("BNTH", 64, False, True, PRESETS["sage1"], False),
    ("BTNH", 256, True, True, RECOMPUTE, True),
    ("BTNH", 96, True, False, RECOMPUTE.replace(backward_int8=True), False),
    ("BNTH", 128, False, True, RECOMPUTE.replace(backward_int8=True), True),
]


@pytest.mark.parametrize("layout,h,causal,masked,config,atomic", LOWER_CASES)
def test_backward_lowers_for_cuda(layout, h, causal, masked, config, atomic):
  """Every backward kernel variant lowers through Pallas's Triton path."""
  q, k, v = testing.make_qkv(jax.random.key(0), 2, 200, 150, 4, 2, h,
                             dtype=jnp.bfloat16, layout=layout)
  mask = jnp.ones((2, 1, 200, 150), bool) if masked else None
  bias = jnp.zeros((1, 4, 1, 150)) if masked else None
  tiling = dataclasses.replace(pallas_triton.default_backward_tiling(h),
                               dq_atomic=atomic)

  def f(q, k, v, do):
    call = _inputs.parse(q, k, v, bias, mask, is_causal=causal, layout=layout,
                         key_value_seq_lengths=jnp.array([150, 99]))
    saved = None
    if config.saved_stats:
      saved = (do, jnp.zeros((2, 4, 200)))
    return pallas_triton.BACKEND.backward(call, config, do,
                                          jnp.zeros((2, 4, 200)), saved,
                                          tiling=tiling)

  text = jax.jit(f).trace(q, k, v, q).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "sage_attention_bwd_dkdv" in text
  assert ("sage_attention_bwd_dq" in text) != atomic
  stats = ("sage_attention_bwd_delta" if config.saved_stats
           else "sage_attention_bwd_stats")
  assert stats in text


# --------------------------------------------------------------------------
# GPU: compiled kernels.
# --------------------------------------------------------------------------


GPU_CASES = [
    # preset, causal, alignment, (B, T, S, N, K, H), lengths, kwargs
    ("sage2-8b", False, "top_left", (1, 8192, 8192, 4, 4, 128), False, {}),
    ("sage2-8b", True, "top_left", (2, 4096, 4096, 8, 2, 128), False, {}),
    ("sage2-8b", True, "bottom_right", (1, 1000, 3000, 8, 1, 64), True, {}),
    ("sage1", True, "top_left", (1, 2048, 2048, 4, 2, 64), False, {}),
    ("sage2-8b", False, "top_left", (1, 777, 1023, 4, 4, 256), True, {}),
    ("sage2-8b", True, "top_left", (1, 1000, 1000, 4, 2, 96), False,
     {"local_window_size": (256, 0)}),
    ("sage2-4b", True, "top_left", (1, 2048, 2048, 4, 4, 128), False,
     {"dq_atomic": True}),
    ("sage2-8b", True, "top_left", (1, 2048, 2048, 4, 2, 128), False,
     {"backward_int8": True}),
    ("sage2-8b", True, "bottom_right", (2, 1000, 1500, 8, 2, 256), True,
     {"dq_atomic": True}),
]


@gpu
@needs_gpu
@pytest.mark.parametrize("preset,causal,align,shape,lengths,extra", GPU_CASES)
@pytest.mark.parametrize("kind", ["normal", "qkv_channel_bias"])
def test_gpu_backward_matches_exact(preset, causal, align, shape, lengths,
                                    extra, kind):
  """Compiled backward kernels vs exact gradients (cos) and the "xla"
  backward, bf16 inputs, outputs poisoned."""
  b, t, s, n, kh, h = shape
  q, k, v = testing.make_qkv(jax.random.key(t + s + h), b, t, s, n, kh, h,
                             kind, jnp.bfloat16)
  do = jax.random.normal(jax.random.key(1), q.shape).astype(q.dtype)
  extra = dict(extra)
  tiling = None
  if extra.pop("dq_atomic", False):
    tiling = dataclasses.replace(pallas_triton.default_backward_tiling(h),
                                 dq_atomic=True)
  kw = dict(is_causal=causal, causal_alignment=align,
            local_window_size=extra.pop("local_window_size", None))
  config = PRESETS[preset].replace(**extra)  # backward_* fields
  if lengths:
    kw["query_seq_lengths"] = jnp.full((b,), max(1, t - 5), jnp.int32)
    kw["key_value_seq_lengths"] = jnp.full((b,), max(1, s - 7), jnp.int32)

  @jax.jit
  def kernel_grads(q, k, v, do):
    call = _inputs.parse(q, k, v, **kw)
    out, lse = pallas_triton.BACKEND.forward(call, config)
    saved = (out.astype(q.dtype), lse) if config.saved_stats else None
    return pallas_triton.BACKEND.backward(
        call, config, do, jnp.zeros(lse.shape), saved, tiling=tiling)[:3]

  testing.poison_device_memory(2 ** 30)
  got = kernel_grads(q, k, v, do)
  want = jax.jit(lambda q, k, v, do: jax.grad(
      lambda q, k, v: jnp.sum(sagejax.attention(
          q, k, v, implementation="xla", config=RECOMPUTE, **kw).astype(
              jnp.float32) * do.astype(jnp.float32)), (0, 1, 2))(q, k, v))(
                  q, k, v, do)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.shape == w.shape
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
    cos = testing.error_metrics(g, w)["cos_sim"]
    assert cos > (0.995 if config.backward_int8 else 0.999), cos


@gpu
@needs_gpu
@pytest.mark.parametrize("bias_shape,h", [((1, 4, 1000, 1000), 64),
                                          ((2, 1, 1, 1000), 64),
                                          ((1, 4, 1000, 1000), 256)])
def test_gpu_mask_bias_and_dbias(bias_shape, h):
  """Compiled kernels with mask and bias arrays: dQ, dK, dV and dbias vs the
  "xla" backward (outputs poisoned); H=256 with its larger shared-memory
  tiles."""
  q, k, v = testing.make_qkv(jax.random.key(7), 2, 1000, 1000, 4, 2, h,
                             "qkv_channel_bias", jnp.bfloat16)
  do = jax.random.normal(jax.random.key(8), q.shape).astype(q.dtype)
  mask = jax.random.bernoulli(jax.random.key(9), 0.8, (2, 1, 1000, 1000))
  bias = jax.random.normal(jax.random.key(10), bias_shape, jnp.float32)

  def grads(impl):
    def loss(q, k, v, bias):
      out = sagejax.attention(q, k, v, bias, mask, is_causal=True,
                              config=RECOMPUTE, implementation=impl)
      return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
    return jax.jit(jax.grad(loss, (0, 1, 2, 3)))(q, k, v, bias)
  want = grads("xla")
  testing.poison_device_memory(2 ** 30)
  got = grads("pallas")
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
    assert testing.error_metrics(g, w)["cos_sim"] > 0.999


@gpu
@needs_gpu
def test_gpu_flax_training_matches_exact():
  """A 2-layer Flax transformer trained 300 steps with sagejax attention
  (kernel forward and backward) ends within 1% of the loss with exact
  attention (same init, data and optimizer). The data are a random Markov
  chain, so the loss settles near its entropy rate, not at zero."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  import sagejax.nn  # pylint: disable=import-outside-toplevel

  vocab, seq, batch, steps = 32, 256, 16, 300
  logits = 2.5 * jax.random.normal(jax.random.key(0), (vocab, vocab))
  # Every token also copies the one 64 back half of the time: attention
  # must be sharp and long-range, not only local.
  def batch_of(key):
    k0, k1 = jax.random.split(key)
    first = jax.random.randint(k0, (batch, 64), 0, vocab)

    def step(prev, keys):
      kc, kn = keys
      nxt = jax.random.categorical(kn, logits[prev[:, -1]])
      copy = jax.random.bernoulli(kc, 0.5, (batch,))
      tok = jnp.where(copy, prev[:, 0], nxt)
      return jnp.concatenate([prev[:, 1:], tok[:, None]], 1), tok
    keys = jax.random.split(k1, 2 * (seq - 64)).reshape(seq - 64, 2)
    _, rest = jax.lax.scan(step, first, keys)
    return jnp.concatenate([first, rest.T], 1)

  class Model(nn.Module):
    attention: type

    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(vocab, 128)(tokens) + nn.Embed(seq, 128)(
          jnp.arange(seq))[None]
      mask = nn.make_causal_mask(tokens)
      for _ in range(2):
        x = x + self.attention(num_heads=2, dtype=jnp.bfloat16)(
            nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dense(128)(nn.gelu(nn.Dense(512)(nn.LayerNorm()(x))))
      return nn.Dense(vocab)(nn.LayerNorm()(x))

  def train(attention):
    model = Model(attention)
    params = Model(nn.MultiHeadDotProductAttention).init(
        jax.random.key(1), jnp.zeros((1, seq), jnp.int32))
    opt = optax.adamw(1e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state, key):
      tokens = batch_of(key)

      def loss(p):
        out = model.apply(p, tokens)[:, :-1].astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(
            out, tokens[:, 1:]).mean()
      value, grads = jax.value_and_grad(loss)(params)
      updates, state = opt.update(grads, state, params)
      return optax.apply_updates(params, updates), state, value
    losses = []
    for key in jax.random.split(jax.random.key(2), steps):
      params, state, value = step(params, state, key)
      losses.append(float(value))
    return np.array(losses)

  exact = train(nn.MultiHeadDotProductAttention)
  sage = train(sagejax.nn.MultiHeadDotProductAttention)
  assert np.all(np.isfinite(sage))
  assert exact[-20:].mean() < 0.8 * exact[:10].mean()  # it learned
  rel = abs(sage[-20:].mean() - exact[-20:].mean()) / exact[-20:].mean()
  assert rel < 0.01, (rel, sage[-20:].mean(), exact[-20:].mean())


def test_grad_hands_unserved_mosaic_branches_to_the_pallas_forward(
    qkv, monkeypatch):
  """Under ``jax.grad`` the forward runs the differentiated config (16-bit
  P·V). A per-platform branch that chose "mosaic" for a call the Mosaic
  kernel does not serve under it (FP32 inputs above H=128) runs "pallas"
  (whose backward follows anyway); 16-bit inputs stay on "mosaic" at
  H=128 and at H=256, and so does the backward (above H=128 with saved
  statistics only: recomputing them is "pallas"'s); a named "mosaic" says
  why it cannot. (The "pallas" backward counts as available, as on a
  GPU.)"""
  from sagejax import api  # pylint: disable=g-import-not-at-top
  pallas = backends.registry()["pallas"]
  monkeypatch.setattr(type(pallas), "available", lambda self: True)
  cfg = PRESETS["sage2-8b"]
  for h, dtype, want in ((256, jnp.float32, "pallas"),
                         (256, jnp.bfloat16, "mosaic"),
                         (128, jnp.bfloat16, "mosaic")):
    q, k, v = qkv(1, 64, 64, 2, 2, h, dtype=dtype)
    call = _inputs.parse(q, k, v, is_causal=True)
    static = api._Static(config=cfg, spec=call.spec, sm_scale=call.sm_scale,
                         backend="xla", layout=call.layout,
                         per_platform=(("cuda", "mosaic", cfg),))
    got = api._differentiated(static, call)
    assert got.per_platform == (("cuda", want, cfg.differentiated(dtype)),)
    assert (got.backend, got.config) == ("xla", cfg)
    named = dataclasses.replace(static, backend="mosaic", per_platform=())
    if want == "pallas":
      with pytest.raises(ValueError, match="head dims above 128"):
        api._differentiated(named, call)
    else:
      assert api._differentiated(named, call).backend == "mosaic"
      diff = got.per_platform[0][2]
      assert backends.backward_of("mosaic", call, diff).name == "mosaic"
      recompute = diff.replace(backward_stats="recompute")
      assert backends.backward_of("mosaic", call, recompute).name == (
          "mosaic" if h == 128 else "pallas")

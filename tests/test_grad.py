"""Gradients (exact backward); jit / vmap / grad / checkpoint composability."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sagejax
from sagejax.testing import error_metrics

STATIC = ("scale", "is_causal", "causal_alignment", "local_window_size",
          "layout", "return_lse")


def _loss(fn, w, u, *args, **kw):
  """Linear in the outputs: the cotangents do not depend on the forward."""
  if u is None:
    return jnp.sum(fn(*args, **kw).astype(jnp.float32) * w)
  out, lse = fn(*args, return_lse=True, **kw)
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(lse * u)


@functools.partial(jax.jit, static_argnames=("argnums", "exact", "config")
                   + STATIC[:-1])
def _grads(q, k, v, w, u, *extra, argnums, exact, config=None, **kw):
  fn = (sagejax.exact_attention if exact else
        functools.partial(sagejax.attention, config=config))
  loss = lambda *a: _loss(fn, w, u, *a, **kw)  # noqa: E731
  return jax.grad(loss, argnums)(q, k, v, *extra)


def _assert_grads_close(got, want, rtol=1e-5):
  """Each gradient matches to ``rtol`` relative (in L2 and elementwise)."""
  for g, r in zip(got, want):
    assert g.shape == r.shape and g.dtype == r.dtype
    assert np.all(np.isfinite(g))
    m = error_metrics(g, r)
    assert m["rel_l2"] < rtol, m
    scale = float(jnp.max(jnp.abs(r)))
    np.testing.assert_allclose(g, r, rtol=10 * rtol, atol=rtol * scale)


# (name, preset, (B, T, S, N, K, H), layout, kwargs) — bias/mask/lengths drawn
# in the test from the markers below.
CASES = [
    ("plain", "sage2-8b", (2, 40, 40, 2, 2, 32), "BTNH", {}),
    ("causal_gqa", "sage1", (2, 70, 90, 4, 2, 64), "BTNH", {"is_causal": True}),
    ("bottom_right_lengths_mqa", "sage2-4b", (3, 50, 130, 3, 1, 48), "BNTH",
     {"is_causal": True, "causal_alignment": "bottom_right",
      "query_seq_lengths": "q", "key_value_seq_lengths": "kv"}),
    ("window_mask", "sage2-8b", (2, 64, 100, 4, 4, 16), "BTNH",
     {"local_window_size": (20, 5), "mask": (2, 1, 64, 100)}),
    ("decode", "sage2-8b", (2, 1, 300, 4, 2, 128), "BNTH",
     {"is_causal": True, "causal_alignment": "bottom_right"}),
    ("odd_head_dim", "sage2-4b", (1, 33, 21, 2, 1, 33), "BTNH",
     {"is_causal": True}),
]


def _draw(key, shape, kw):
  b, t, s = shape[:3]
  kw = dict(kw)
  keys = jax.random.split(key, 3)
  if kw.get("query_seq_lengths") == "q":
    kw["query_seq_lengths"] = jax.random.randint(keys[0], (b,), 1, t + 1)
  if kw.get("key_value_seq_lengths") == "kv":
    kw["key_value_seq_lengths"] = jax.random.randint(keys[1], (b,), 1, s + 1)
  if "mask" in kw:
    kw["mask"] = jax.random.bernoulli(keys[2], 0.7, kw["mask"])
  return kw


# Measured rel L2 of (dQ, dK, dV) vs jax.grad of exact_attention, 2 seeds:
# normal data 0.7e-7-6.8e-7 (max elementwise error / max |grad| <= 1.2e-6);
# channel-biased data: dK, dV <= 2.2e-6, dQ 2e-6-3.8e-5 (dQ = dS·K cancels
# the large K mean in f32, in both implementations).
RTOL = {"normal": 1e-5, "channel_bias": 1e-4}


@pytest.mark.parametrize("kind,with_lse", [("normal", False),
                                           ("channel_bias", True)])
@pytest.mark.parametrize("name,preset,shape,layout,kw", CASES,
                         ids=[c[0] for c in CASES])
def test_grads_match_exact(name, preset, shape, layout, kw, kind, with_lse,
                           qkv, next_key):
  """dQ, dK, dV of sage attention = jax.grad of exact_attention."""
  q, k, v = qkv(*shape, dtype=jnp.float32, layout=layout, kind=kind)
  kw = _draw(next_key(), shape, kw)
  w = jax.random.normal(next_key(), q.shape)
  b, t, _, n = shape[:4]
  u = jax.random.normal(next_key(), (b, n, t)) if with_lse else None
  arrays = {x: kw.pop(x) for x in ("mask", "query_seq_lengths",
                                   "key_value_seq_lengths") if x in kw}
  got = _grads(q, k, v, w, u, argnums=(0, 1, 2), exact=False, config=preset,
               layout=layout, **kw, **arrays)
  want = _grads(q, k, v, w, u, argnums=(0, 1, 2), exact=True, layout=layout,
                **kw, **arrays)
  _assert_grads_close(got, want, RTOL[kind])
  if "query_seq_lengths" in arrays:  # padded query rows get no gradient
    ql = arrays["query_seq_lengths"]
    pad = jnp.arange(shape[1])[None, None, :, None] >= ql[:, None, None, None]
    np.testing.assert_array_equal(jnp.where(pad, got[0], 0), 0)


@pytest.mark.parametrize("bias_shape", [(2, 4, 30, 50), (1, 4, 1, 50),
                                        (2, 1, 1, 50)])
def test_bias_gradient(bias_shape, qkv, next_key):
  """d(bias) in the bias's own (broadcast) shape, as jax.grad of exact."""
  q, k, v = qkv(2, 30, 50, 4, 2, 32, dtype=jnp.float32)
  bias = jax.random.normal(next_key(), bias_shape)
  w = jax.random.normal(next_key(), q.shape)
  got = _grads(q, k, v, w, None, bias, argnums=(0, 1, 2, 3), exact=False,
               is_causal=True)
  want = _grads(q, k, v, w, None, bias, argnums=(0, 1, 2, 3), exact=True,
                is_causal=True)
  assert got[3].shape == bias_shape
  _assert_grads_close(got, want)


def test_gqa_grads_sum_over_the_group(qkv, next_key):
  """With K/V shared by G query heads, dK/dV equal those of repeated K/V
  summed over the group."""
  q, k, v = qkv(1, 40, 60, 6, 2, 16, dtype=jnp.float32)
  w = jax.random.normal(next_key(), q.shape)
  dq, dk, dv = _grads(q, k, v, w, None, argnums=(0, 1, 2), exact=False)
  assert dk.shape == k.shape and dv.shape == v.shape
  kr, vr = jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2)
  dq_r, dk_r, dv_r = _grads(q, kr, vr, w, None, argnums=(0, 1, 2),
                            exact=False)
  group_sum = lambda x: x.reshape(1, 60, 2, 3, 16).sum(3)  # noqa: E731
  _assert_grads_close((dq, dk, dv), (dq_r, group_sum(dk_r), group_sum(dv_r)))


def test_jit_matches_eager(qkv):
  q, k, v = qkv(2, 50, 70, 4, 2, 64, kind="channel_bias")
  kw = dict(is_causal=True, causal_alignment="bottom_right",
            key_value_seq_lengths=jnp.array([70, 33]))
  eager = sagejax.attention(q, k, v, **kw)
  jitted = jax.jit(lambda *a: sagejax.attention(*a, **kw))(q, k, v)
  np.testing.assert_allclose(np.asarray(jitted, np.float32),
                             np.asarray(eager, np.float32), rtol=2e-3,
                             atol=1e-3)
  assert error_metrics(jitted, eager)["rel_l1"] < 1e-3


def test_vmap_over_an_extra_axis(qkv, next_key):
  """vmap over a leading axis = the calls one by one (forward and grad)."""
  q, k, v = qkv(3, 40, 56, 4, 2, 32, dtype=jnp.float32)
  q, k, v = (x.reshape(3, 1, *x.shape[1:]) for x in (q, k, v))  # [V, B, ...]
  kvl = jnp.array([[56], [20], [7]])
  w = jax.random.normal(next_key(), q.shape)
  fn = lambda q, k, v, l: sagejax.attention(  # noqa: E731
      q, k, v, is_causal=True, key_value_seq_lengths=l)
  out = jax.jit(jax.vmap(fn))(q, k, v, kvl)
  for i in range(3):
    np.testing.assert_allclose(out[i], jax.jit(fn)(q[i], k[i], v[i], kvl[i]),
                               rtol=1e-5, atol=1e-6)
  loss = lambda q, k, v, l, w: jnp.sum(fn(q, k, v, l) * w)  # noqa: E731
  grads = jax.jit(jax.vmap(jax.grad(loss, (0, 1, 2))))(q, k, v, kvl, w)
  exact_loss = lambda q, k, v, l, w: jnp.sum(  # noqa: E731
      sagejax.exact_attention(q, k, v, is_causal=True,
                              key_value_seq_lengths=l) * w)
  exact_grad = jax.jit(jax.grad(exact_loss, (0, 1, 2)))
  for i in range(3):
    want = exact_grad(q[i], k[i], v[i], kvl[i], w[i])
    _assert_grads_close([g[i] for g in grads], want)


def test_checkpoint_and_value_and_grad(qkv, next_key):
  """jax.checkpoint and value_and_grad change nothing; grads stay exact."""
  q, k, v = qkv(2, 64, 64, 2, 1, 32, dtype=jnp.float32)
  w = jax.random.normal(next_key(), q.shape)

  def loss(q, k, v):
    return jnp.sum(sagejax.attention(q, k, v, is_causal=True) * w)
  value, grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)
  value_c, grads_c = jax.jit(jax.value_and_grad(jax.checkpoint(loss),
                                                (0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(value_c, value, rtol=1e-6)
  _assert_grads_close(grads_c, grads, rtol=1e-6)
  # Inside a rematerialised layer of a bigger function, too.
  layer = jax.checkpoint(lambda x: sagejax.attention(x, k, v) * 2.0)
  g = jax.jit(jax.grad(lambda x: jnp.sum(layer(jnp.tanh(x)) * w)))(q)
  g_ref = jax.jit(jax.grad(lambda x: jnp.sum(
      sagejax.exact_attention(jnp.tanh(x), k, v) * 2.0 * w)))(q)
  _assert_grads_close([g], [g_ref])
  exact = jax.jit(jax.grad(lambda *a: jnp.sum(
      sagejax.exact_attention(*a, is_causal=True) * w), (0, 1, 2)))(q, k, v)
  _assert_grads_close(grads, exact)
  np.testing.assert_allclose(value, jax.jit(loss)(q, k, v), rtol=1e-5)


def test_lse_cotangent_alone(qkv, next_key):
  """A loss on the LSE only: gradients flow through it, as for exact."""
  q, k, v = qkv(1, 30, 45, 2, 2, 16, dtype=jnp.float32)
  u = jax.random.normal(next_key(), (1, 2, 30))

  def grads(fn):
    return jax.jit(jax.grad(
        lambda *a: jnp.sum(fn(*a, return_lse=True)[1] * u), (0, 1, 2)))(q, k, v)
  got, want = grads(sagejax.attention), grads(sagejax.exact_attention)
  assert float(jnp.max(jnp.abs(got[0]))) > 0
  np.testing.assert_array_equal(got[2], 0)  # the LSE does not depend on V
  _assert_grads_close(got, want)

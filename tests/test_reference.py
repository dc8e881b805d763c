"""The oracle: exact_attention vs jax.nn.dot_product_attention and by hand."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sagejax

STATIC = ("scale", "is_causal", "causal_alignment", "local_window_size",
          "layout", "return_lse")
exact_attention = jax.jit(sagejax.exact_attention, static_argnames=STATIC)


@functools.partial(jax.jit, static_argnames=STATIC)
def _jax_sdpa(q, k, v, **kw):
  """jax.nn.dot_product_attention ("xla") in f32, K/V repeated for GQA."""
  g = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x.astype(jnp.float32), g, axis=2) for x in (k, v))
  return jax.nn.dot_product_attention(q.astype(jnp.float32), k, v,
                                      implementation="xla", **kw)


def _lengths(key, batch, n):
  return jax.random.randint(key, (batch,), 1, n + 1)


# Every option of jax.nn.dot_product_attention, alone and combined.
CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "window_int": {"local_window_size": 3},
    "window_pair": {"local_window_size": (5, 2)},
    "causal_window": {"is_causal": True, "local_window_size": (4, 0)},
    "scale": {"scale": 0.37},
    "q_lengths": {"query_seq_lengths": True},
    "kv_lengths": {"key_value_seq_lengths": True},
    "both_lengths_causal": {"query_seq_lengths": True,
                            "key_value_seq_lengths": True, "is_causal": True},
    "bias": {"bias": (2, 1, 1, 1)},  # broadcast shapes of [B, N, T, S]
    "bias_full": {"bias": (1, 1, 0, 0)},
    "mask": {"mask": (0, 1, 0, 0)},
    "mask_bias_causal": {"mask": (1, 1, 0, 0), "bias": (0, 0, 1, 0),
                         "is_causal": True},
}


SHAPES = [(9, 9), (7, 23), (23, 7)]  # (T, S)
HEADS = [(4, 4), (4, 2), (3, 1)]  # (N, K): MHA, GQA, MQA
# Each case once, rotating through shapes and head layouts (every pair of
# shape and heads is covered), plus the full cross for the causal cases.
PARAMS = sorted(
    {(c, SHAPES[i % 3], HEADS[(i + i // 3) % 3]) for i, c in enumerate(CASES)}
    | {(c, sh, hd) for c in ("causal", "both_lengths_causal")
       for sh in SHAPES for hd in HEADS})


@pytest.mark.parametrize("case,shape,heads", PARAMS)
def test_matches_jax_dot_product_attention(case, shape, heads, qkv, next_key):
  (t, s), (n, kh) = shape, heads
  b, h = 2, 16
  q, k, v = qkv(b, t, s, n, kh, h, dtype=jnp.float32)
  kw = dict(CASES[case])
  full = (b, n, t, s)
  for name in ("bias", "mask"):
    if name in kw:  # 1 = broadcast axis, 0 = full axis
      shape = tuple(1 if one else d for one, d in zip(kw[name], full))
      kw[name] = (jax.random.normal(next_key(), shape) if name == "bias" else
                  jax.random.bernoulli(next_key(), 0.7, shape))
  if "query_seq_lengths" in kw:
    kw["query_seq_lengths"] = _lengths(next_key(), b, t)
  if "key_value_seq_lengths" in kw:
    kw["key_value_seq_lengths"] = _lengths(next_key(), b, s)
  ours = exact_attention(q, k, v, **kw)
  want = _jax_sdpa(q, k, v, **kw)
  # JAX gives a fully masked (non-padding) row the mean of V; we give zeros.
  visible = _visible_rows(q, k, v, kw)
  assert ours.dtype == jnp.float32 and ours.shape == q.shape
  np.testing.assert_allclose(ours, jnp.where(visible, want, 0.0), atol=2e-6,
                             rtol=2e-5)
  if not np.all(visible):
    np.testing.assert_array_equal(jnp.where(visible, 0.0, ours), 0.0)
  if "query_seq_lengths" in kw:  # padded query rows are zero
    rows = jnp.arange(t)[None, :] >= kw["query_seq_lengths"][:, None]
    np.testing.assert_array_equal(jnp.where(rows[..., None, None], ours, 0), 0)


def _visible_rows(q, k, v, kw):
  """bool [B, T, N, 1]: rows that see at least one key (from the LSE)."""
  _, lse = exact_attention(q, k, v, return_lse=True, **kw)
  return jnp.isfinite(jnp.swapaxes(lse, 1, 2))[..., None]


def test_bnth_layout_and_unbatched(qkv):
  q, k, v = qkv(2, 11, 13, 4, 2, 8, dtype=jnp.float32)
  want = exact_attention(q, k, v, is_causal=True)
  t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
  got = exact_attention(t(q), t(k), t(v), is_causal=True, layout="BNTH")
  np.testing.assert_allclose(t(got), want, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(exact_attention(q[1], k[1], v[1], is_causal=True),
                             want[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_low_precision_inputs_are_upcast(dtype, qkv):
  q, k, v = qkv(1, 20, 30, 2, 2, 32, dtype=dtype)
  got = exact_attention(q, k, v)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, _jax_sdpa(q, k, v), rtol=2e-5, atol=2e-6)


def _numpy_attention(q, k, v, visible, scale):
  """float64 attention ``[B, T, N, H]`` with a bool ``[B, N, T, S]`` mask."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
  logits = np.where(visible, logits, -np.inf)
  m = logits.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0)
  p = np.exp(logits - m)
  l = p.sum(-1, keepdims=True)
  lse = np.where(l[..., 0] > 0, np.log(np.where(l > 0, l, 1))[..., 0]
                 + m[..., 0], -np.inf)
  out = np.einsum("bnts,bsnh->btnh", p / np.where(l > 0, l, 1), v)
  return out, lse


def _bottom_right_mask(b, n, t, s, q_lengths, kv_lengths, window=None):
  """Hand-built: query i sees keys j <= i + (S_b − T_b), inside the lengths."""
  mask = np.zeros((b, n, t, s), bool)
  for bi in range(b):
    off = kv_lengths[bi] - q_lengths[bi]
    for i in range(q_lengths[bi]):
      for j in range(kv_lengths[bi]):
        ok = j <= i + off
        if window is not None:
          ok = ok and i + off - window[0] <= j <= i + off + window[1]
        mask[bi, :, i, j] = ok
  return mask


@pytest.mark.parametrize("t,s", [(5, 12), (12, 5), (8, 8), (1, 9)])
@pytest.mark.parametrize("use_lengths", [False, True])
def test_bottom_right_causal_on_a_hand_built_mask(t, s, use_lengths, qkv):
  b, n, kh, h = 3, 2, 1, 8
  q, k, v = qkv(b, t, s, n, kh, h, dtype=jnp.float32)
  kw = {}
  ql, kl = [t] * b, [s] * b
  if use_lengths:
    ql = [t, max(1, t - 3), 1]
    kl = [max(1, s - 4), s, 2]
    kw = {"query_seq_lengths": jnp.array(ql),
          "key_value_seq_lengths": jnp.array(kl)}
  mask = _bottom_right_mask(b, n, t, s, ql, kl)
  if not use_lengths:  # the last query sees every key
    assert mask[:, :, -1].all()
  got, lse = exact_attention(q, k, v, is_causal=True,
                             causal_alignment="bottom_right", return_lse=True,
                             **kw)
  want, want_lse = _numpy_attention(q, k, v, mask, h**-0.5)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-6)
  # The same through an explicit mask, and through JAX with that mask.
  np.testing.assert_allclose(exact_attention(q, k, v, mask=jnp.asarray(mask)),
                             want, rtol=1e-5, atol=1e-6)
  visible = mask.any(-1).transpose(0, 2, 1)[..., None]
  np.testing.assert_allclose(
      jnp.where(visible, _jax_sdpa(q, k, v, mask=jnp.asarray(mask)), 0.0),
      want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,s", [(6, 15), (15, 6)])
def test_bottom_right_window(t, s, qkv):
  """local_window_size is placed around the bottom-right diagonal."""
  b, n, h = 2, 2, 8
  q, k, v = qkv(b, t, s, n, n, h, dtype=jnp.float32)
  ql, kl = [t, t - 2], [s, s - 1]
  mask = _bottom_right_mask(b, n, t, s, ql, kl, window=(3, 0))
  got = exact_attention(q, k, v, is_causal=True, local_window_size=(3, 1),
                        causal_alignment="bottom_right",
                        query_seq_lengths=jnp.array(ql),
                        key_value_seq_lengths=jnp.array(kl))
  want, _ = _numpy_attention(q, k, v, mask, h**-0.5)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_lse_and_fully_masked_rows(qkv, next_key):
  """LSE is the natural-log logsumexp; rows seeing nothing give 0 and −inf."""
  q, k, v = qkv(2, 10, 14, 2, 2, 16, dtype=jnp.float32)
  mask = jax.random.bernoulli(next_key(), 0.6, (2, 2, 10, 14))
  mask = mask.at[0, 1, 3].set(False)
  out, lse = exact_attention(q, k, v, mask=mask, return_lse=True)
  want, want_lse = _numpy_attention(q, k, v, np.asarray(mask), 0.25)
  assert lse.shape == (2, 2, 10)
  assert lse[0, 1, 3] == -jnp.inf
  np.testing.assert_array_equal(out[0, 3, 1], 0.0)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-6)

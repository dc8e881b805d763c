"""Bad inputs raise ValueError/TypeError naming the argument, in both the
quantized attention and the exact reference (they share the checks)."""

import jax
import jax.numpy as jnp
import pytest

import sagejax

B, T, S, N, K, H = 2, 12, 20, 4, 2, 16
FNS = {"attention": sagejax.attention, "exact": sagejax.exact_attention}


def _qkv(key, t=T, s=S, n=N, kh=K, h=H, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(key, 3)
  return (jax.random.normal(kq, (B, t, n, h), dtype),
          jax.random.normal(kk, (B, s, kh, h), dtype),
          jax.random.normal(kv, (B, s, kh, h), dtype))


def _bad_calls():
  """name -> (function of (q, k, v) giving (args, kwargs), error, match)."""
  i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
  return {
      "rank_2d": (lambda q, k, v: ((q[0, 0], k[0, 0], v[0, 0]), {}),
                  ValueError, "must all be 4-D"),
      "rank_5d": (lambda q, k, v: ((q[None], k[None], v[None]), {}),
                  ValueError, "must all be 4-D"),
      "rank_mixed": (lambda q, k, v: ((q, k[0], v[0]), {}), ValueError,
                     "must all be 4-D"),
      "batch_mismatch": (lambda q, k, v: ((q, k[:1], v[:1]), {}), ValueError,
                         "same batch size"),
      "head_dim_mismatch": (lambda q, k, v: ((q, k[..., :8], v[..., :8]), {}),
                            ValueError, "same head dim"),
      "kv_shape_mismatch": (lambda q, k, v: ((q, k, v[:, :10]), {}),
                            ValueError, "key and value must have the same"),
      "heads_not_multiple": (lambda q, k, v: ((q[:, :, :3], k, v), {}),
                             ValueError, "multiple of the number of key"),
      "int_query": (lambda q, k, v: ((i32(q), k, v), {}), TypeError,
                    "query must be float16, bfloat16 or float32"),
      "int_all": (lambda q, k, v: ((i32(q), i32(k), i32(v)), {}), TypeError,
                  "query must be float"),
      "complex_value": (lambda q, k, v: ((q, k, v.astype(jnp.complex64)), {}),
                        TypeError, "value must be float16"),
      "mixed_dtypes": (lambda q, k, v: ((q.astype(jnp.float16), k, v), {}),
                       TypeError, "must share a dtype"),
      "head_dim_too_big": (lambda q, k, v: (tuple(
          jnp.concatenate([x] * 17, -1) for x in (q, k, v)), {}),
          ValueError, "Head dim H=272 is not supported"),
      "empty_sequence": (lambda q, k, v: ((q[:, :0], k, v), {}), ValueError,
                         "Sequence lengths must be >= 1"),
      "mask_not_broadcastable": (lambda q, k, v: ((q, k, v), {
          "mask": jnp.ones((B, 3, T, S), bool)}), ValueError,
          r"mask of shape \(2, 3, 12, 20\) is not broadcastable"),
      "mask_wrong_rank": (lambda q, k, v: ((q, k, v), {
          "mask": jnp.ones((T, S), bool)}), ValueError, "mask must be 4-D"),
      "mask_transposed": (lambda q, k, v: ((q, k, v), {
          "mask": jnp.ones((1, 1, S, T), bool)}), ValueError,
          r"mask of shape .*\(axis 2 is 20; expected 1 or 12\)"),
      "mask_not_bool": (lambda q, k, v: ((q, k, v), {
          "mask": jnp.ones((1, 1, T, S))}), TypeError, "mask must be boolean"),
      "bias_not_broadcastable": (lambda q, k, v: ((q, k, v), {
          "bias": jnp.ones((1, N, T, S + 1))}), ValueError,
          "bias of shape .* not broadcastable"),
      "bias_int": (lambda q, k, v: ((q, k, v), {
          "bias": jnp.ones((1, 1, T, S), jnp.int32)}), TypeError,
          "bias must be floating point"),
      "lengths_shape": (lambda q, k, v: ((q, k, v), {
          "query_seq_lengths": jnp.array([T])}), ValueError,
          r"query_seq_lengths must have shape \[B\]"),
      "lengths_float": (lambda q, k, v: ((q, k, v), {
          "key_value_seq_lengths": jnp.array([1.0, 2.0])}), TypeError,
          "key_value_seq_lengths must hold integers"),
      "window_negative": (lambda q, k, v: ((q, k, v), {
          "local_window_size": (-1, 2)}), ValueError,
          "local_window_size must be >= 0"),
      "window_triple": (lambda q, k, v: ((q, k, v), {
          "local_window_size": (1, 2, 3)}), ValueError,
          "local_window_size must be an int or"),
      "unknown_layout": (lambda q, k, v: ((q, k, v), {"layout": "BHTD"}),
                         ValueError, "layout must be one of"),
      "unknown_alignment": (lambda q, k, v: ((q, k, v), {
          "is_causal": True, "causal_alignment": "bottom_left"}), ValueError,
          "causal_alignment must be one of"),
      "not_an_array": (lambda q, k, v: ((q, "key", v), {}), TypeError,
                       "key must be an array"),
  }


@pytest.mark.parametrize("fn", list(FNS))
@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_inputs(case, fn, next_key):
  make, error, match = _bad_calls()[case]
  args, kwargs = make(*_qkv(next_key()))
  with pytest.raises(error, match=match):
    FNS[fn](*args, **kwargs)


def test_bnth_layout_checks_in_its_own_order(next_key):
  """With layout="BNTH" a BTNH tensor with mismatched heads is refused."""
  q, k, v = _qkv(next_key())
  with pytest.raises(ValueError, match="multiple of the number of key"):
    sagejax.attention(q, k, v, layout="BNTH")  # N=12 vs K=20 in BNTH order


@pytest.mark.parametrize("config,error,match", [
    ("sage3", ValueError, "Unknown config 'sage3'"),
    ("SAGE1", ValueError, "Unknown config"),
    (3, TypeError, "config must be a SageConfig or a preset name"),
])
def test_unknown_config(config, error, match, next_key):
  with pytest.raises(error, match=match):
    sagejax.attention(*_qkv(next_key()), config=config)


def test_unknown_implementation(next_key):
  with pytest.raises(ValueError, match="Unknown implementation 'cuda'"):
    sagejax.attention(*_qkv(next_key()), implementation="cuda")


def test_traced_scale_is_refused(next_key):
  """The scale is folded into static quantization scales: a Python float."""
  q, k, v = _qkv(next_key())
  with pytest.raises(TypeError, match="scale must be a Python float"):
    jax.jit(lambda s: sagejax.attention(q, k, v, scale=s))(0.5)


@pytest.mark.parametrize("head_dim", [1, 256])
def test_head_dim_limits_are_accepted(head_dim, next_key):
  """1 <= H <= 256 is served (the bad-input cases above use H=272 and T=0)."""
  q, k, v = _qkv(next_key(), t=5, s=7, h=head_dim)
  out = sagejax.attention(q, k, v)
  assert out.shape == q.shape and bool(jnp.all(jnp.isfinite(out)))

"""sagejax.nn / sagejax.nnx: drop-in Flax attention modules.

Tolerances: outputs are compared with Flax's exact modules through
``sagejax.testing.error_metrics`` with the per-preset bounds of ``TOL``: about
2-3x the errors measured on these N(0, 1) inputs with head dim 8
(rel-L2 ≈ 0.01 sage1, 0.03 sage2-8b, 0.14 sage2-4b). The quantized cache
alone (with exact attention) measures rel-L2 ≈ 0.022 against the plain one.
What does not go through quantization (parameters, fallbacks, fully masked
rows) must match exactly or to float32 rounding.
"""

from __future__ import annotations

import warnings

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sagejax.nn as snn
import sagejax.nnx as snnx
from sagejax.testing import error_metrics

# preset -> (max rel-L2, min cosine similarity) against exact attention.
TOL = {"sage1": (0.03, 0.999), "sage2-8b": (0.08, 0.995),
       "sage2-4b": (0.3, 0.97)}
# The quantized cache adds its own rounding (INT8 K, FP8 V) on top.
CACHE_TOL = (0.05, 0.998)

B, T, F, HEADS = 2, 16, 32, 4


def _inputs(seed: int, *shape: int) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), shape or (B, T, F))


def _assert_close(out, ref, tol=TOL["sage2-8b"]):
  m = error_metrics(out, ref)
  assert m["rel_l2"] < tol[0] and m["cos_sim"] > tol[1], m


def _assert_same_tree(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _flat(tree) -> jax.Array:
  """All leaves as one vector (some gradients are ~0 alone: key biases)."""
  return jnp.concatenate([jnp.ravel(a) for a in jax.tree.leaves(tree)])


def _padding_causal_mask(lengths, t):
  valid = jnp.arange(t)[None, :] < jnp.asarray(lengths)[:, None]
  return nn.combine_masks(nn.make_attention_mask(valid, valid),
                          nn.make_causal_mask(valid))


def _init(module, *args, **kwargs):
  return jax.jit(module.init, static_argnames=("deterministic",))(
      jax.random.key(0), *args, **kwargs)


def _apply(module, params, *args, **kwargs):
  """``module.apply`` under jit (much faster on CPU than op-by-op)."""
  return jax.jit(module.apply, static_argnames=("mutable", "deterministic",
                                                "sow_weights"))(
      params, *args, **kwargs)


@nnx.jit(static_argnames=("is_causal",))
def _nnx_call(module, x, y=None, mask=None, is_causal=False):
  return module(x, y, mask=mask, is_causal=is_causal)


@pytest.fixture(autouse=True)
def _fresh_warnings():
  snn._WARNED.clear()  # pylint: disable=protected-access


# ----------------------------------------------------------------------------
# Linen.
# ----------------------------------------------------------------------------


def test_linen_parameters_load_both_ways_and_serialize():
  x = _inputs(1)
  kw = dict(num_heads=HEADS, qkv_features=48, out_features=24,
            normalize_qk=True)
  theirs = _init(nn.MultiHeadDotProductAttention(**kw), x)
  ours = _init(snn.SageMultiHeadAttention(**kw), x)
  _assert_same_tree(theirs, ours)  # same names, shapes, init values
  assert set(ours["params"]) == {"query", "key", "value", "out", "query_ln",
                                 "key_ln"}
  restored = flax.serialization.from_bytes(
      ours, flax.serialization.to_bytes(theirs))
  _assert_same_tree(theirs, restored)
  back = flax.serialization.from_bytes(
      theirs, flax.serialization.to_bytes(restored))
  _assert_same_tree(theirs, back)

  class Parent(nn.Module):  # auto-named submodules keep their paths
    cls: type

    @nn.compact
    def __call__(self, x):
      return self.cls(num_heads=HEADS)(x)

  for flax_cls, our_cls in ((nn.MultiHeadDotProductAttention,
                             snn.MultiHeadDotProductAttention),
                            (nn.MultiHeadAttention, snn.MultiHeadAttention)):
    a, b = _init(Parent(flax_cls), x), _init(Parent(our_cls), x)
    _assert_same_tree(a, b)


@pytest.mark.parametrize("preset", ["sage1", "sage2-8b", "sage2-4b"])
def test_linen_outputs_match_flax(preset):
  xq, xkv = _inputs(3), _inputs(4, B, 24, F)
  flax_mod = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  params = _init(flax_mod, xq, xkv)
  ours = snn.SageMultiHeadAttention(num_heads=HEADS, config=preset)
  _assert_close(_apply(ours, params, xq, xkv),
                _apply(flax_mod, params, xq, xkv),
                TOL[preset])


def test_linen_masks_and_extra_batch_dims():
  x = _inputs(5, 2, B, T, F)  # two batch axes
  flax_mod = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  params = _init(flax_mod, x)
  ours = snn.SageMultiHeadAttention(num_heads=HEADS)
  # Padding + causal, float mask as Flax's helpers make it; query rows 12..15
  # of the last sequence see no key: Flax gives the mean of V there.
  lengths = jnp.array([[16, 9], [12, 5]])
  mask = _padding_causal_mask(lengths.reshape(-1), T).reshape(2, B, 1, T, T)
  a = _apply(ours, params, x, mask=mask)
  b = _apply(flax_mod, params, x, mask=mask)
  _assert_close(a, b)
  np.testing.assert_allclose(a[1, 1, 5:], b[1, 1, 5:], rtol=1e-5, atol=1e-5)
  # A per-head boolean mask broadcast over the batch axes.
  head_mask = jax.random.bernoulli(jax.random.key(6), 0.7, (1, 1, HEADS, T, T))
  head_mask = head_mask.at[..., 0].set(True)
  _assert_close(_apply(ours, params, x, mask=head_mask),
                _apply(flax_mod, params, x, mask=head_mask))


def test_attention_fn_plugs_into_flax_modules():
  x = _inputs(7)
  fn = snn.attention_fn("sage2-8b")
  mask = _padding_causal_mask([16, 11], T)
  linen_flax = nn.MultiHeadDotProductAttention(num_heads=HEADS,
                                               attention_fn=fn)
  params = _init(linen_flax, x)
  exact = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  ours = snn.SageMultiHeadAttention(num_heads=HEADS)
  out = _apply(linen_flax, params, x, mask=mask)
  np.testing.assert_allclose(out, _apply(ours, params, x, mask=mask),
                             rtol=1e-6, atol=1e-6)
  _assert_close(out, _apply(exact, params, x, mask=mask))

  nnx_flax = nnx.MultiHeadAttention(HEADS, F, num_kv_heads=2, decode=False,
                                    attention_fn=fn, rngs=nnx.Rngs(0))
  nnx_exact = nnx.MultiHeadAttention(HEADS, F, num_kv_heads=2, decode=False,
                                     rngs=nnx.Rngs(0))
  _assert_close(_nnx_call(nnx_flax, x, mask=mask, is_causal=True),
                _nnx_call(nnx_exact, x, mask=mask, is_causal=True))


def _linen_decode(module, params, x):
  """Feeds ``x`` one token at a time through a decode=True module."""
  cache = _init(module, x)["cache"]

  @jax.jit
  def step(cache, token):
    out, updated = module.apply({**params, "cache": cache}, token,
                                mutable=["cache"])
    return updated["cache"], out

  outs = []
  for t in range(x.shape[-2]):
    cache, out = step(cache, x[..., t:t + 1, :])
    outs.append(out)
  return jnp.concatenate(outs, axis=-2), cache


@pytest.mark.parametrize("quantized", [False, True])
def test_linen_decode_matches_full_causal(quantized):
  x = _inputs(8)
  flax_mod = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  params = _init(flax_mod, x)
  full = _apply(flax_mod, params, x, mask=nn.make_causal_mask(x[..., 0]))
  ours = snn.SageMultiHeadAttention(num_heads=HEADS, decode=True,
                                    quantized_cache=quantized)
  steps, cache = _linen_decode(ours, params, x)
  _assert_close(steps, full)
  assert int(cache["cache_index"]) == T
  if quantized:
    assert cache["cached_key"].dtype == jnp.int8
    assert cache["cached_value"].dtype == jnp.float8_e4m3fn
    assert cache["cached_key_scale"].shape == (B, T, HEADS)
  else:
    flax_cache = _init(flax_mod.clone(decode=True), x)
    assert (jax.tree.map(jnp.shape, flax_cache["cache"])
            == jax.tree.map(jnp.shape, cache))


def test_quantized_cache_error_and_memory():
  """The cache's own error, isolated with Flax's exact attention_fn."""
  x = _inputs(9)
  exact = dict(num_heads=HEADS, decode=True,
               attention_fn=nn.dot_product_attention)
  params = {"params": _init(nn.MultiHeadDotProductAttention(num_heads=HEADS),
                             x)["params"]}
  plain, plain_cache = _linen_decode(snn.SageMultiHeadAttention(**exact),
                                     params, x)
  quant, quant_cache = _linen_decode(
      snn.SageMultiHeadAttention(quantized_cache=True, **exact), params, x)
  _assert_close(quant, plain, CACHE_TOL)
  nbytes = lambda c: sum(a.nbytes for a in jax.tree.leaves(c))
  head_dim, index_bytes = F // HEADS, 4
  # Per token and head: K and V of H bytes + one f32 scale each, vs 4H (f32);
  # plus the smoothing vectors (two f32 [K, H]) and their flag.
  smooth_bytes = 2 * HEADS * head_dim * 4 + 1
  assert nbytes(quant_cache) == (B * T * HEADS * 2 * (head_dim + 4)
                                 + index_bytes + smooth_bytes)
  assert nbytes(plain_cache) == B * T * HEADS * 2 * 4 * head_dim + index_bytes


def test_linen_grad_and_jit():
  x = _inputs(10)
  mask = _padding_causal_mask([16, 10], T)
  flax_mod = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  params = _init(flax_mod, x)
  ours = snn.SageMultiHeadAttention(num_heads=HEADS)

  def loss(module, p, x):
    return jnp.sum(jnp.sin(module.apply(p, x, mask=mask)))

  grad = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)
  _assert_close(_flat(grad(ours, params, x)), _flat(grad(flax_mod, params, x)),
                (0.05, 0.998))


def test_linen_fallbacks_are_exact_and_warn():
  x = _inputs(11)
  kw = dict(num_heads=HEADS, dropout_rate=0.3)
  flax_mod = nn.MultiHeadDotProductAttention(**kw)
  ours = snn.SageMultiHeadAttention(**kw)
  params = _init(flax_mod, x, deterministic=True)
  rng = jax.random.key(12)
  with pytest.warns(UserWarning, match="dropout"):
    a = _apply(ours, params, x, deterministic=False, dropout_rng=rng)
  b = _apply(flax_mod, params, x, deterministic=False, dropout_rng=rng)
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  with warnings.catch_warnings():  # deterministic: quantized path, no warning
    warnings.simplefilter("error")
    _assert_close(_apply(ours, params, x, deterministic=True),
                  _apply(flax_mod, params, x, deterministic=True))

  with pytest.warns(UserWarning, match="sow_weights"):
    a, a_sown = _apply(ours, params, x, deterministic=True, sow_weights=True,
                       mutable=("intermediates",))
  b, b_sown = _apply(flax_mod, params, x, deterministic=True,
                     sow_weights=True, mutable=("intermediates",))
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  jax.tree.map(np.testing.assert_array_equal, a_sown, b_sown)


# ----------------------------------------------------------------------------
# NNX.
# ----------------------------------------------------------------------------


def _nnx_pair(**kw):
  kw = dict(num_heads=HEADS, in_features=F, decode=False, **kw)
  return (nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0)),
          snnx.SageMultiHeadAttention(**kw, rngs=nnx.Rngs(0)))


def test_nnx_parameters_load_both_ways_and_serialize():
  theirs, ours = _nnx_pair(num_kv_heads=2, qkv_features=48, normalize_qk=True)
  params = lambda m: nnx.to_pure_dict(nnx.state(m, nnx.Param))
  _assert_same_tree(params(theirs), params(ours))
  assert ours.key.kernel.shape == (F, 2, 12)  # GQA: K heads, Flax's layout
  # Fresh weights into ours through bytes, then ours back into Flax's.
  other = nnx.MultiHeadAttention(HEADS, F, num_kv_heads=2, qkv_features=48,
                                 normalize_qk=True, decode=False,
                                 rngs=nnx.Rngs(1))
  blob = flax.serialization.to_bytes(params(other))
  state = nnx.state(ours, nnx.Param)
  nnx.replace_by_pure_dict(state, flax.serialization.from_bytes(
      params(ours), blob))
  nnx.update(ours, state)
  _assert_same_tree(params(other), params(ours))
  nnx.update(theirs, nnx.state(ours, nnx.Param))
  _assert_same_tree(params(other), params(theirs))


@pytest.mark.parametrize("num_kv_heads", [HEADS, 2])
def test_nnx_outputs_match_flax(num_kv_heads):
  theirs, ours = _nnx_pair(num_kv_heads=num_kv_heads)
  x, y = _inputs(13), _inputs(14, B, 24, F)
  _assert_close(_nnx_call(ours, x, y), _nnx_call(theirs, x, y))
  mask = _padding_causal_mask([16, 7], T)
  a, b = _nnx_call(ours, x, mask=mask), _nnx_call(theirs, x, mask=mask)
  _assert_close(a, b)
  np.testing.assert_allclose(a[1, 7:], b[1, 7:], rtol=1e-5, atol=1e-5)
  _assert_close(_nnx_call(ours, x, is_causal=True),
                _nnx_call(theirs, x, is_causal=True))


@pytest.mark.parametrize("quantized", [False, True])
def test_nnx_decode_matches_full_causal(quantized):
  theirs, _ = _nnx_pair(num_kv_heads=2)
  ours = snnx.SageMultiHeadAttention(HEADS, F, num_kv_heads=2, decode=True,
                                     quantized_cache=quantized,
                                     rngs=nnx.Rngs(0))
  x = _inputs(15)
  full = _nnx_call(theirs, x, is_causal=True)
  ours.init_cache(x.shape)

  @nnx.jit
  def step(module, token):
    return module(token)

  steps = jnp.concatenate([step(ours, x[:, t:t + 1]) for t in range(T)], 1)
  _assert_close(steps, full)
  assert int(ours.cache_index[...]) == T
  if quantized:
    assert ours.cached_key.dtype == jnp.int8
    assert ours.cached_value_scale.shape == (B, T, 2)
  else:
    assert ours.cached_key.shape == (B, T, 2, F // HEADS)
    assert ours.cached_key_scale is None


def test_nnx_grad_jit_and_dropout_fallback():
  theirs, ours = _nnx_pair(num_kv_heads=2)
  x = _inputs(16)

  def loss(module, x):
    return jnp.sum(jnp.sin(module(x, is_causal=True)))

  grad = nnx.jit(nnx.grad(loss))
  _assert_close(_flat(grad(ours, x)), _flat(grad(theirs, x)), (0.05, 0.998))

  kw = dict(num_heads=HEADS, in_features=F, num_kv_heads=2, decode=False,
            dropout_rate=0.25, deterministic=False)
  theirs = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  ours = snnx.SageMultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  with pytest.warns(UserWarning, match="dropout"):
    a = nnx.jit(lambda m: m(x, rngs=nnx.Rngs(dropout=3)))(ours)
  b = nnx.jit(lambda m: m(x, rngs=nnx.Rngs(dropout=3)))(theirs)
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

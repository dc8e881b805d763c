"""Flax decoding through sagejax.serving: a prompt in one call, then tokens.

``decode=True`` modules append T >= 1 tokens per call; with sagejax's
attention the new tokens attend to the cache through the paged kernels,
reading the quantized entries directly (``read_cache``, the dequantized copy,
is never called there). Outputs are compared with Flax's exact modules on the
whole causal sequence (tolerances as tests/test_flax.py: the plain cache is
exact attention, 1e-5; the quantized one rel-L2 < 0.05).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sagejax.nn as snn
import sagejax.nnx as snnx
from sagejax.testing import error_metrics

B, T, F, HEADS, PROMPT = 2, 16, 32, 4, 10


def _rel(a, b):
  return error_metrics(a, b)["rel_l2"]


def _no_dequantized_copy(*_):
  raise AssertionError("the direct path must not dequantize the cache")


@pytest.mark.parametrize("quantized", [False, True])
def test_linen_prompt_then_tokens(monkeypatch, quantized):
  x = jax.random.normal(jax.random.key(1), (B, T, F))
  flax_mod = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  params = jax.jit(flax_mod.init)(jax.random.key(0), x)
  full = jax.jit(flax_mod.apply)(params, x, mask=nn.make_causal_mask(x[..., 0]))
  ours = snn.SageMultiHeadAttention(num_heads=HEADS, decode=True,
                                    quantized_cache=quantized)
  cache = jax.jit(ours.init)(jax.random.key(0), x)["cache"]
  monkeypatch.setattr(snn, "read_cache", _no_dequantized_copy)

  @jax.jit
  def step(cache, tokens):
    out, new = ours.apply({**params, "cache": cache}, tokens,
                          mutable=["cache"])
    return new["cache"], out

  cache, first = step(cache, x[:, :PROMPT])
  outs = [first]
  for t in range(PROMPT, T):
    cache, out = step(cache, x[:, t:t + 1])
    outs.append(out)
  got = jnp.concatenate(outs, axis=1)
  assert int(cache["cache_index"]) == T
  assert _rel(got, full) < (0.05 if quantized else 1e-5)
  if quantized:
    assert cache["cached_key"].dtype == jnp.int8
    assert cache["cached_key_smooth"].shape == (HEADS, F // HEADS)
    assert bool(cache["cache_smooth_fixed"])


def test_mosaic_implementation_lets_serving_choose(monkeypatch):
  """An ``attention_fn`` for ``"mosaic"`` (the dense Hopper backend) reads
  the cache through serving's own choice (None): serving's decode has no
  Mosaic kernel, and its extend takes Mosaic only for long chunks."""
  from sagejax import serving
  seen = []
  for name in ("decode_attention", "extend_attention"):
    original = getattr(serving, name)

    def spy(*args, original=original, **kwargs):
      seen.append(kwargs["implementation"])
      return original(*args, **kwargs)
    monkeypatch.setattr(serving, name, spy)
  x = jax.random.normal(jax.random.key(3), (B, T, F))
  mod = snn.SageMultiHeadAttention(num_heads=HEADS, decode=True,
                                   quantized_cache=True)
  cache = mod.init(jax.random.key(0), x)["cache"]
  fn = snn.attention_fn(implementation="mosaic")
  for index, t in ((0, PROMPT), (PROMPT, 1)):
    query = jax.random.normal(jax.random.key(index),
                              (B, t, HEADS, F // HEADS))
    out = snn.paged_decode(fn, cache, jnp.int32(index), query)
    assert out.shape == query.shape
    assert np.all(np.isfinite(np.asarray(out)))
  assert seen == [None, None]


def test_linen_masked_and_foreign_attention_fn_see_the_same_cache():
  """A mask (or another attention_fn) takes the dequantized cache with
  Flax's decode mask: T > 1 tokens causal, the same attention up to the
  direct path's INT8 Q and FP8 P (sage2-8b; head dim 8: rel-L2 ~0.02)."""
  x = jax.random.normal(jax.random.key(2), (B, T, F))
  params = {"params": jax.jit(nn.MultiHeadDotProductAttention(
      num_heads=HEADS).init)(jax.random.key(0), x)["params"]}
  outs = {}
  for name, kw, mask in (
      ("direct", {}, None),
      ("masked", {}, jnp.ones((B, 1, PROMPT, T), bool)),
      ("flax_fn", dict(attention_fn=nn.dot_product_attention), None)):
    mod = snn.SageMultiHeadAttention(num_heads=HEADS, decode=True,
                                     quantized_cache=True, **kw)
    cache = jax.jit(mod.init)(jax.random.key(0), x)["cache"]
    outs[name], _ = jax.jit(lambda c, m, mod=mod: mod.apply(
        {**params, "cache": c}, x[:, :PROMPT], mask=m, mutable=["cache"]))(
            cache, mask)
  assert _rel(outs["masked"], outs["direct"]) < 0.05
  assert _rel(outs["flax_fn"], outs["direct"]) < 0.05


@pytest.mark.parametrize("quantized", [False, True])
def test_nnx_prompt_then_tokens(monkeypatch, quantized):
  kw = dict(num_heads=HEADS, in_features=F, num_kv_heads=2)
  theirs = nnx.MultiHeadAttention(**kw, decode=False, rngs=nnx.Rngs(0))
  ours = snnx.SageMultiHeadAttention(**kw, decode=True,
                                     quantized_cache=quantized,
                                     rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(3), (B, T, F))
  full = nnx.jit(lambda m, x: m(x, is_causal=True))(theirs, x)
  ours.init_cache(x.shape)
  monkeypatch.setattr(snnx, "read_cache", _no_dequantized_copy)
  step = nnx.jit(lambda m, tokens: m(tokens))
  outs = [step(ours, x[:, :PROMPT])]
  outs += [step(ours, x[:, t:t + 1]) for t in range(PROMPT, T)]
  got = jnp.concatenate(outs, axis=1)
  assert int(ours.cache_index[...]) == T
  assert _rel(got, full) < (0.05 if quantized else 1e-5)
  if quantized:
    assert ours.cached_value.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(ours.cached_key_scale.shape, (B, T, 2))

"""Logit soft cap (Gemma-2's ``c·tanh(x / c)``): forward, gradients, Flax.

The order is tokamax's: ``x = scale·q·kᵀ + bias``, capped, then masked.
Tolerances (``TOL``): each backend's error against exact attention *with* the
cap stays at its error without a cap, and far below the gap between capped
and uncapped exact attention (so a missing or misplaced cap fails).
Gradients are exact attention's.
"""

import functools

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sagejax
import sagejax.nn as snn
import sagejax.nnx as snnx
from sagejax import PRESETS, SageConfig, _inputs
from sagejax.backends import mosaic, pallas_triton, xla
from sagejax.kernels import triton_attention
from sagejax.testing import (assert_lse_near, assert_near_oracle,
                             error_metrics, poison_device_memory)

ON_GPU = jax.default_backend() == "gpu"
ON_HOPPER = ON_GPU and mosaic.is_hopper()
CAP = 3.0
TILING = triton_attention.KernelTiling(block_q=32, block_k=32, num_warps=4,
                                       num_stages=1)
# Bounds about 2x what both backends measure here: (output rel-L2, LSE max
# abs error) = (0.0003-0.0018, 0.012-0.018) sage1, (0.013, 0.024) sage2-8b,
# (0.014, 0.24) sage2-4b, vs exact attention with the cap; capping moves
# exact attention by rel-L2 0.12-0.15 (gap). Uncapped, the same calls measure
# rel-L2 0.002-0.024 and LSE errors 0.04-0.47: the cap costs no accuracy.
TOL = {"sage1": (0.005, 0.04), "sage2-8b": (0.03, 0.05),
       "sage2-4b": (0.03, 0.5)}
SMALL = {
    "sage1": PRESETS["sage1"].replace(block_q=32, block_k=32),
    "sage2-8b": PRESETS["sage2-8b"].replace(block_q=32, block_k=32),
    "sage2-4b": PRESETS["sage2-4b"].replace(block_q=32, block_k=32),
}


def test_exact_attention_caps_before_the_mask(qkv, next_key):
  q, k, v = qkv(1, 9, 11, 2, 2, 16, dtype=jnp.float32)
  bias = jax.random.normal(next_key(), (1, 2, 9, 11))
  mask = jax.random.bernoulli(next_key(), 0.7, (1, 1, 9, 11)).at[..., 0].set(
      True)
  got = sagejax.exact_attention(q, k, v, bias, mask, logits_soft_cap=CAP,
                                scale=2.0)
  x = np.einsum("btnh,bsnh->bnts", q, k) * 2.0 + np.asarray(bias)
  x = CAP * np.tanh(x / CAP)
  x = np.where(np.asarray(mask), x, -np.inf)
  p = np.exp(x - x.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want = np.einsum("bnts,bsnh->btnh", p, v)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_caps_raise(cap, qkv):
  q, k, v = qkv(1, 8, 8, 1, 1, 16, dtype=jnp.float32)
  with pytest.raises(ValueError, match="logits_soft_cap"):
    sagejax.attention(q, k, v, logits_soft_cap=cap)


def test_traced_or_odd_caps_raise(qkv):
  q, k, v = qkv(1, 8, 8, 1, 1, 16, dtype=jnp.float32)
  for cap in ("50", True):
    with pytest.raises(TypeError, match="logits_soft_cap"):
      sagejax.attention(q, k, v, logits_soft_cap=cap)
  with pytest.raises(TypeError, match="logits_soft_cap"):
    jax.jit(lambda c: sagejax.attention(q, k, v, logits_soft_cap=c))(50.0)
  assert _inputs.check_soft_cap(30) == 30.0


def _forward(backend, config, **kw):
  def f(q, k, v, bias):
    call = _inputs.parse(q, k, v, bias, **kw)
    if backend is pallas_triton.INTERPRET_BACKEND:
      return backend.kernel(backend.prepare(call, config, TILING), call,
                            config, TILING)
    return backend.forward(call, config)
  return jax.jit(f)


@pytest.mark.parametrize("backend,preset,causal", [
    ("xla", "sage1", False), ("pallas-interpret", "sage2-8b", True),
    ("pallas-interpret", "sage2-4b", False)])
def test_forward_matches_exact_with_cap(backend, preset, causal, qkv,
                                        next_key):
  """Channel-bias data (K smoothing's shift is large, so it must be restored
  before the cap), a per-head bias, and logits a cap of 3 bends hard."""
  impl = {"xla": xla.BACKEND,
          "pallas-interpret": pallas_triton.INTERPRET_BACKEND}[backend]
  config = SMALL[preset]
  b, t, s, n, kh, h = 2, 50, 70, 4, 2, 64
  q, k, v = qkv(b, t, s, n, kh, h, kind="qkv_channel_bias",
                dtype=jnp.bfloat16)
  bias = 2.0 * jax.random.normal(next_key(), (1, n, 1, s))
  exact = functools.partial(sagejax.exact_attention, q, k, v, bias,
                            is_causal=causal, return_lse=True)
  want, want_lse = exact(logits_soft_cap=CAP)
  uncapped = exact()[0]
  out, lse = _forward(impl, config, is_causal=causal,
                      logits_soft_cap=CAP)(q, k, v, bias)
  err = error_metrics(out, want)["rel_l2"]
  gap = error_metrics(uncapped, want)["rel_l2"]
  tol_out, tol_lse = TOL[preset]
  assert gap > 5 * err, (gap, err)
  assert err < tol_out, err
  np.testing.assert_allclose(lse, want_lse, atol=tol_lse)


def test_gradients_are_exact_with_cap(qkv, next_key):
  """Through the output, the LSE and the bias (the backward does not depend
  on the preset)."""
  preset, causal = "sage2-8b", True
  q, k, v = qkv(2, 40, 56, 4, 2, 32, kind="qkv_channel_bias",
                dtype=jnp.float32)
  bias = jax.random.normal(next_key(), (2, 1, 40, 56))
  w = jax.random.normal(next_key(), q.shape)
  u = jax.random.normal(next_key(), (2, 4, 40))

  def loss(fn, q, k, v, bias):
    out, lse = fn(q, k, v, bias, is_causal=causal, logits_soft_cap=CAP,
                  return_lse=True)
    return jnp.sum(out * w) + jnp.sum(lse * u)

  grad = lambda fn: jax.jit(jax.grad(functools.partial(loss, fn),  # noqa
                                     (0, 1, 2, 3)))(q, k, v, bias)
  got = grad(functools.partial(sagejax.attention, config=preset,
                               implementation="xla"))
  want = grad(sagejax.exact_attention)
  for g, r in zip(got, want):
    assert error_metrics(g, r)["rel_l2"] < 1e-5


@pytest.mark.parametrize("backend,kernel", [
    ("pallas", "sage_attention_fwd"), ("mosaic", "mosaic_gpu")])
def test_lowers_for_cuda_with_cap(qkv, backend, kernel):
  q, k, v = qkv(1, 100, 130, 4, 2, 128, dtype=jnp.bfloat16)
  impl = {"pallas": pallas_triton.BACKEND, "mosaic": mosaic.BACKEND}[backend]

  def f(q, k, v):
    call = _inputs.parse(q, k, v, is_causal=True, logits_soft_cap=50.0)
    assert impl.unsupported(call, PRESETS["sage2-8b"]) is None
    return impl.forward(call, PRESETS["sage2-8b"])

  text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)
                                         ).as_text()
  assert kernel in text


@pytest.mark.parametrize("layout,h", [("BTNH", 128), ("BNTH", 64)])
def test_mosaic_training_forward_takes_the_cap(qkv, layout, h):
  """Under jax.grad a capped call can run the Mosaic training forward (16-bit
  P·V, one Mosaic kernel, the LSE of the capped logits kept) and then the
  exact "xla" backward: the Hopper backward refuses the cap, and so does
  every other kernel backward."""
  q, k, v = qkv(2, 100, 130, 4, 2, h, dtype=jnp.bfloat16, layout=layout)
  config = PRESETS["sage2-8b"].differentiated(jnp.bfloat16)
  kwargs = dict(layout=layout, is_causal=True, logits_soft_cap=30.0)
  call = _inputs.parse(q, k, v, **kwargs)
  reason = mosaic.BACKEND.backward_unsupported(call, config)
  assert "soft cap" in reason and "'xla'" in reason
  assert pallas_triton.BACKEND.backward_unsupported(call, config)
  assert not mosaic.BACKEND.saves_lse2(call, config)

  def f(q, k, v):
    return mosaic.BACKEND.forward_residual(_inputs.parse(q, k, v, **kwargs),
                                           config)

  traced = jax.jit(f).trace(q, k, v)
  assert [x.shape for x in traced.out_info][1:] == [(2, 4, 100)] * 2
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu_v2") == 1


def test_flax_modules_take_the_cap(next_key):
  x = jax.random.normal(next_key(), (2, 16, 32))
  linen_mod = snn.MultiHeadDotProductAttention(num_heads=4,
                                               logits_soft_cap=CAP)
  params = linen_mod.init(next_key(), x)
  got = linen_mod.apply(params, x)
  plain = snn.MultiHeadDotProductAttention(num_heads=4).apply(params, x)

  def capped_fn(q, k, v, **_):
    return sagejax.exact_attention(q, k, v, logits_soft_cap=CAP)

  want = linen.MultiHeadDotProductAttention(
      num_heads=4, attention_fn=capped_fn).apply(params, x)
  assert error_metrics(got, want)["rel_l2"] < 0.08
  assert error_metrics(got, plain)["rel_l2"] > 1e-3

  nnx_mod = snnx.MultiHeadAttention(num_heads=4, in_features=32,
                                    decode=False, logits_soft_cap=CAP,
                                    rngs=nnx.Rngs(0))
  ref = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False,
                               attention_fn=capped_fn, rngs=nnx.Rngs(0))
  assert error_metrics(nnx_mod(x), ref(x))["rel_l2"] < 0.08

  with pytest.raises(ValueError, match="logits_soft_cap"):
    snn.attention_fn(logits_soft_cap=-2.0)
  fn = snn.attention_fn(logits_soft_cap=CAP)
  q = x.reshape(2, 16, 4, 8)
  with pytest.raises(ValueError, match="logits_soft_cap"):
    fn(q, q, q, dropout_rate=0.1, dropout_rng=next_key())




@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("preset", ["sage1", "sage2-8b", "sage2-4b"])
@pytest.mark.parametrize("impl", ["pallas", "mosaic"])
def test_gpu_soft_cap_matches_xla_and_exact(preset, impl, qkv, next_key):
  if impl == "mosaic" and not ON_HOPPER:
    pytest.skip("the Mosaic kernel needs an sm90 GPU")
  q, k, v = qkv(2, 1000, 1200, 8, 2, 128, kind="qkv_channel_bias",
                dtype=jnp.bfloat16)
  run = jax.jit(lambda q, k, v, impl: sagejax.attention(
      q, k, v, is_causal=True, config=preset, implementation=impl,
      logits_soft_cap=CAP, return_lse=True), static_argnums=3)
  poison_device_memory(8 * q.size * 4)
  got, got_lse = run(q, k, v, impl)
  want, want_lse = run(q, k, v, "xla")
  exact = sagejax.exact_attention(q, k, v, is_causal=True,
                                  logits_soft_cap=CAP)
  vs_xla = error_metrics(got, want)["rel_l2"]
  vs_exact = error_metrics(want, exact)["rel_l2"]
  assert vs_xla < 0.3 * vs_exact + 2e-3, (vs_xla, vs_exact)
  np.testing.assert_allclose(got_lse, want_lse, atol=2e-2)


# Mosaic cases beyond the shared test above: window and lengths, GQA, head
# dims 64 and 256, BNTH, a cap that binds hard (3) and Gemma-2's (50).
MOSAIC_CASES = [
    ("sage2-8b", (2, 777, 1030, 8, 2, 64), 50.0,
     dict(local_window_size=(200, 0), lengths=True)),
    ("sage2-8b", (1, 300, 4097, 4, 1, 128), 3.0,
     dict(is_causal=True, causal_alignment="bottom_right", layout="BNTH")),
    ("sage2-8b", (2, 1024, 1024, 4, 4, 128), 50.0, {}),
    ("sage1", (1, 500, 700, 4, 2, 256), 3.0, dict(is_causal=True)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm90 GPU")
@pytest.mark.parametrize("preset,shape,cap,kwargs", MOSAIC_CASES)
def test_gpu_mosaic_soft_cap_cases(preset, shape, cap, kwargs, qkv):
  """The Mosaic kernel with a cap against the "xla" oracle (within half
  the oracle's own error to exact attention; LSE within 0.02) and exact
  attention (the uncapped kernel's bounds); a cap of 3 moves exact
  attention far more than that (one of 50 moves it by about the
  quantization error: rel-L2 0.017 against 0.011, H100)."""
  b, t, s, n, kh, h = shape
  kwargs = dict(kwargs)
  layout = kwargs.pop("layout", "BTNH")
  if kwargs.pop("lengths", False):
    kwargs["query_seq_lengths"] = jnp.array([t, t - 77], jnp.int32)[:b]
    kwargs["key_value_seq_lengths"] = jnp.array([s - 5, s // 2], jnp.int32)[:b]
  q, k, v = qkv(b, t, s, n, kh, h, kind="qkv_channel_bias",
                dtype=jnp.bfloat16, layout=layout)
  run = jax.jit(lambda q, k, v, impl: sagejax.attention(
      q, k, v, config=preset, implementation=impl, layout=layout,
      logits_soft_cap=cap, return_lse=True, **kwargs), static_argnums=3)
  poison_device_memory(8 * q.size * 4)
  got, got_lse = run(q, k, v, "mosaic")
  want, want_lse = run(q, k, v, "xla")
  exact, exact_lse = sagejax.exact_attention(
      q, k, v, layout=layout, logits_soft_cap=cap, return_lse=True, **kwargs)
  uncapped = sagejax.exact_attention(q, k, v, layout=layout, **kwargs)
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  errors = assert_near_oracle(got, want, exact, ratio=0.5)
  if cap < 10:  # a cap that binds: a kernel without it would fail
    assert error_metrics(uncapped, exact)["rel_l2"] > 3 * errors["vs_exact"]
  assert_lse_near(got_lse, want_lse)
  np.testing.assert_array_equal(np.isfinite(np.asarray(exact_lse)),
                                np.isfinite(np.asarray(want_lse)))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm90 GPU")
def test_gpu_mosaic_soft_cap_keeps_nan_and_gradients_exact(qkv, next_key):
  """A NaN in K reaches the rows that see it (as in exact attention; the
  cap's tanh keeps NaN); gradients through the Mosaic forward and the
  "xla" backward are exact attention's."""
  q, k, v = qkv(1, 256, 384, 4, 2, 128, kind="qkv_channel_bias",
                dtype=jnp.bfloat16)
  bad = k.at[0, 100, 1, 5].set(jnp.nan)  # seen by query rows from 100
  out = jax.jit(lambda q, k, v: sagejax.attention(
      q, k, v, is_causal=True, implementation="mosaic",
      logits_soft_cap=CAP))(q, bad, v)
  want = sagejax.exact_attention(q, bad, v, is_causal=True,
                                 logits_soft_cap=CAP)
  np.testing.assert_array_equal(np.isnan(np.asarray(out, np.float32)),
                                np.isnan(np.asarray(want, np.float32)))
  assert np.isnan(np.asarray(out, np.float32)).any()
  w = jax.random.normal(next_key(), q.shape)

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v, is_causal=True,
                      logits_soft_cap=CAP).astype(jnp.float32) * w)

  got = jax.jit(jax.grad(functools.partial(loss, functools.partial(
      sagejax.attention, implementation="mosaic")), (0, 1, 2)))(q, k, v)
  ref = jax.jit(jax.grad(functools.partial(loss, sagejax.exact_attention),
                         (0, 1, 2)))(q, k, v)
  for g, r in zip(got, ref):
    assert error_metrics(g, r)["rel_l2"] < 0.02, error_metrics(g, r)

"""Logit soft cap (Gemma-2's ``c·tanh(x / c)``): forward, gradients, Flax.

The order is tokamax's: ``x = scale·q·kᵀ + bias``, capped, then masked.
Tolerances (``TOL``): each backend's error against exact attention *with* the
cap stays at its error without a cap, and far below the gap between capped
and uncapped exact attention (so a missing or misplaced cap fails).
Gradients are exact attention's.
"""

import dataclasses
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
from sagejax import PRESETS, SageConfig, _inputs, _vjp, backends
from sagejax.backends import mosaic, pallas_triton, xla
from sagejax.kernels import triton_attention, triton_backward
from sagejax.testing import (assert_lse_near, assert_near_oracle,
                             attention_grads, error_metrics,
                             poison_device_memory)

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


@pytest.mark.parametrize("cap", [3.0, 30.0])
def test_saved_statistics_under_a_cap_keep_dq_exact(cap, qkv, next_key):
  """The saved-statistics oracle under a cap (the quantized forward's
  output and LSE, 16-bit P·V as under jax.grad) against the exact
  gradients on channel-outlier data: with dQ's λ correction (NOTES B39)
  cos > 0.9999 where the plain dX·K falls below 0.9995 on these inputs;
  dK, dV need none. Fresh inputs, bottom-right causal, an LSE cotangent."""
  b, t, s, n, h = 1, 256, 384, 2, 128
  q, k, v = qkv(b, t, s, n, n, h, kind="qkv_channel_bias",
                dtype=jnp.bfloat16, layout="BNTH")
  do = jax.random.normal(next_key(), q.shape)
  u = jax.random.normal(next_key(), (b, n, t))
  kw = dict(is_causal=True, causal_alignment="bottom_right",
            logits_soft_cap=cap, layout="BNTH")
  config = PRESETS["sage2-8b"].differentiated(jnp.bfloat16)
  out, lse = sagejax.attention(q, k, v, config=config, implementation="xla",
                               return_lse=True, **kw)
  call = _inputs.parse(q, k, v, **kw)
  args = (q, k, v, None, None, None, None, do, u, call.spec, call.sm_scale)
  got = _vjp.attention_backward(*args, saved=(out, lse),
                                logits_soft_cap=cap)
  want = _vjp.attention_backward(*args, logits_soft_cap=cap)  # exact
  delta = jnp.sum(do * out.astype(jnp.float32), -1) - u
  plain = _vjp.backward_from_stats(
      q, k, v, None, None, None, None, do, lse, delta, call.spec,
      call.sm_scale, logits_soft_cap=cap)[0]
  cos = lambda a, w: error_metrics(a, w)["cos_sim"]  # noqa: E731
  assert cos(got[0], want[0]) > 0.9999, cos(got[0], want[0])
  assert cos(plain, want[0]) < 0.9995, cos(plain, want[0])
  for g, w in zip(got[1:3], want[1:3]):
    assert cos(g, w) > 0.9999


BACKWARD_TILING = triton_backward.BackwardTiling(
    block_q=16, block_k=32, block_q_dq=32, block_k_dq=16, num_warps=4,
    num_stages=1, num_warps_dq=4, num_stages_dq=1)
# (B, T, S, N, K, H), layout, kwargs: GQA, causal with a row bias; MQA,
# bottom-right causal with lengths and a full bias; a window, dQ by atomics.
BACKWARD_CASES = [
    ((2, 40, 56, 4, 2, 32), "BTNH",
     dict(is_causal=True, bias=(2, 1, 40, 1))),
    ((2, 33, 70, 3, 1, 16), "BNTH",
     dict(is_causal=True, causal_alignment="bottom_right", lengths=True,
          bias=(2, 3, 33, 70))),
    ((1, 64, 64, 2, 2, 32), "BTNH",
     dict(local_window_size=(20, 3), atomic=True)),  # (recomputing only)
]


@pytest.mark.parametrize("shape,layout,kwargs", BACKWARD_CASES)
@pytest.mark.parametrize("stats", ["recompute", "saved"])
def test_triton_backward_with_cap(shape, layout, kwargs, stats, qkv,
                                  next_key):
  """The Triton backward kernels (interpreted, FP32 inputs: exact FP32
  products) carry dS back through the cap: recomputing the statistics
  they match jax.grad of exact capped attention (measured ~1e-7); given the
  forward's output and LSE, the "xla" backward given the same. dQ, dK, dV
  and the bias gradient (saved: with dQ's λ correction, which dQ by
  atomics cannot make: that raises)."""
  b, t, s, n, kh, h = shape
  kwargs = dict(kwargs)
  tiling = dataclasses.replace(BACKWARD_TILING,
                               dq_atomic=kwargs.pop("atomic", False))
  if tiling.dq_atomic and stats == "saved":
    q, k, v = qkv(b, t, s, n, kh, h, dtype=jnp.float32, layout=layout)
    call = _inputs.parse(q, k, v, layout=layout, logits_soft_cap=CAP,
                         **kwargs)
    config = PRESETS["sage1"].replace(backward_stats="saved")
    with pytest.raises(ValueError, match="dq_atomic=False"):
      pallas_triton.INTERPRET_BACKEND.backward(
          call, config, q, None, xla.BACKEND.forward(call, config),
          tiling=tiling)
    return
  q, k, v = qkv(b, t, s, n, kh, h, kind="qkv_channel_bias",
                dtype=jnp.float32, layout=layout)
  bias = None
  if "bias" in kwargs:
    bias = 2.0 * jax.random.normal(next_key(), kwargs.pop("bias"))
  if kwargs.pop("lengths", False):
    kwargs["query_seq_lengths"] = jnp.array([t, t - 9], jnp.int32)
    kwargs["key_value_seq_lengths"] = jnp.array([s - 20, s], jnp.int32)
  do = jax.random.normal(next_key(), q.shape)
  u = jax.random.normal(next_key(), (b, n, t))
  config = PRESETS["sage1"].replace(block_q=32, block_k=32,
                                    backward_stats=stats)
  backend = pallas_triton.INTERPRET_BACKEND
  parse = lambda q, k, v, bias: _inputs.parse(  # noqa: E731
      q, k, v, bias, layout=layout, logits_soft_cap=CAP, **kwargs)

  def kernel(q, k, v, bias, do, u):
    call = parse(q, k, v, bias)
    assert backend.backward_unsupported(call, config) is None
    saved = None
    if stats == "saved":
      out, lse = xla.BACKEND.forward(call, config)
      saved = (out, lse)
    return backend.backward(call, config, do, u, saved,
                            tiling=tiling), saved

  (dq, dk, dv, dbias), saved = jax.jit(kernel)(q, k, v, bias, do, u)
  got = (dq, dk, dv, dbias)
  if stats == "recompute":
    def loss(q, k, v, bias):
      out, lse = sagejax.exact_attention(
          q, k, v, bias, layout=layout, logits_soft_cap=CAP,
          return_lse=True, **kwargs)
      return (jnp.sum(out * do)
              + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * u))
    want = list(jax.jit(jax.grad(loss, (0, 1, 2, 3)))(q, k, v, bias))
  else:
    call = parse(q, k, v, bias)
    canon = functools.partial(_inputs.to_canonical, layout=layout)
    oracle = _vjp.attention_backward(
        canon(q), canon(k), canon(v), call.bias, None, call.q_lengths,
        call.kv_lengths, canon(do), u, call.spec, call.sm_scale,
        saved=(canon(saved[0]), saved[1]), logits_soft_cap=CAP)
    want = [_inputs.from_canonical(x, layout) for x in oracle[:3]] + [
        oracle[3]]
  for i, (g, w) in enumerate(zip(got, want)):
    if bias is None and i == 3:
      assert g is None
      continue
    assert g.shape == w.shape, (i, g.shape, w.shape)
    assert np.all(np.isfinite(g)), i
    assert error_metrics(g, w)["rel_l2"] < 1e-5, (i, error_metrics(g, w))


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


# layout, H, attention kwargs, saved statistics, MosaicBackwardTiling
# fields (None: the backend's default for the head dim), Mosaic kernels in
# the program (the forward's included)
MOSAIC_BACKWARD_LOWER_CASES = [
    ("BTNH", 128, dict(is_causal=True), True, None, 3),  # dQ (λ, D), dK/dV
    ("BNTH", 64, dict(), True, None, 3),  # the same at H=64
    ("BTNH", 128, dict(local_window_size=(50, 3)), False, None,
     3),  # statistics pass, fused
    ("BNTH", 128, dict(is_causal=True), False, dict(), 3),  # dQ exact, dK/dV
    ("BTNH", 128, dict(), True, dict(), 3),  # dQ given δ, dK/dV
    ("BTNH", 256, dict(is_causal=True, causal_alignment="bottom_right"),
     True, None, 3),  # the wide kernels
]


@pytest.mark.parametrize("layout,h,masks,saved,fields,kernels",
                         MOSAIC_BACKWARD_LOWER_CASES)
def test_mosaic_backward_with_cap_lowers_for_cuda(qkv, layout, h, masks,
                                                  saved, fields, kernels):
  """Every arrangement of the Hopper backward lowers for CUDA on the CPU
  with a cap (after the forward whose LSE it takes), K unsmoothed."""
  from sagejax.kernels.mosaic_backward import MosaicBackwardTiling
  q, k, v = qkv(2, 200, 300, 4, 2, h, dtype=jnp.bfloat16, layout=layout)
  config = PRESETS["sage2-8b"].replace(
      backward_stats="saved" if saved else "recompute")
  tiling = None if fields is None else MosaicBackwardTiling(**fields)

  def f(q, k, v, do, d_lse):
    call = _inputs.parse(q, k, v, layout=layout, logits_soft_cap=30.0,
                         key_value_seq_lengths=jnp.array([300, 99]), **masks)
    assert mosaic.BACKEND.backward_unsupported(call, config) is None
    stats = mosaic.BACKEND.forward(call, config)
    return mosaic.BACKEND.backward(call, config, do, d_lse,
                                   stats if saved else (None, stats[1]),
                                   tiling)

  d_lse = jnp.ones((2, 4, 200), jnp.float32)
  text = jax.jit(f).trace(q, k, v, q, d_lse).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu_v2") == kernels, text.count("mosaic_gpu_v2")


def test_capped_saved_statistics_need_the_dq_kernels_row_sums(qkv):
  """Saved statistics under a cap take λ and D from a dQ kernel (NOTES
  B39): the Mosaic backend runs its dQ kernel beside dK/dV for them, and
  the fused kernel, which makes no row sums, refuses them."""
  q, k, v = qkv(1, 128, 128, 2, 2, 128, dtype=jnp.bfloat16)
  call = _inputs.parse(q, k, v, logits_soft_cap=30.0)
  config = PRESETS["sage2-8b"].differentiated(jnp.bfloat16)
  assert config.saved_stats  # "auto" saves them under a cap too
  out, lse = xla.BACKEND.forward(call, config)
  fused = mosaic.default_backward_tiling(128, fused_dq=True)
  with pytest.raises(ValueError, match="fused_dq=False"):  # (traced only)
    jax.jit(lambda do: mosaic.BACKEND.backward(
        call, config, do, None, (out, lse), fused)).trace(q)
  assert mosaic.BACKEND.backward_unsupported(
      _inputs.parse(q, k, v, mask=jnp.ones((1, 1, 128, 128), bool),
                    logits_soft_cap=30.0), config) is not None
  assert mosaic.BACKEND.backward_unsupported(
      _inputs.parse(q, k, v, mask=jnp.ones((1, 1, 128, 128), bool)),
      config) is None


@pytest.mark.parametrize("layout,h", [("BTNH", 128), ("BNTH", 64)])
def test_mosaic_training_forward_takes_the_cap(qkv, layout, h):
  """A 16-bit-P·V config with saved statistics (the Mosaic training
  forward: one Mosaic kernel, the LSE of the capped logits kept, not lse₂
  of smoothed logits) takes the cap, and both kernel backwards do."""
  q, k, v = qkv(2, 100, 130, 4, 2, h, dtype=jnp.bfloat16, layout=layout)
  config = PRESETS["sage2-8b"].differentiated(jnp.bfloat16)
  assert config.pv_dtype == "bf16" and config.saved_stats
  kwargs = dict(layout=layout, is_causal=True, logits_soft_cap=30.0)
  call = _inputs.parse(q, k, v, **kwargs)
  assert mosaic.BACKEND.backward_unsupported(call, config) is None
  assert pallas_triton.BACKEND.backward_unsupported(call, config) is None
  assert not mosaic.BACKEND.saves_lse2(call, config)
  assert not mosaic.BACKEND.centres_k(call, config)

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


def _capped_case(qkv, shape, kwargs, tiling, monkeypatch):
  """A GPU case's (layout, attention kwargs, q, k, v, dO, dLSE): channel-
  outlier bf16 data; ``layout`` popped from ``kwargs``, ``lengths=True``
  made valid lengths a few tokens short; ``tiling="unfused"`` puts dQ in
  the Mosaic backward's own kernel."""
  b, t, s, n, kh, h = shape
  kwargs = dict(kwargs)
  layout = kwargs.pop("layout", "BTNH")
  if kwargs.pop("lengths", False):
    kwargs["query_seq_lengths"] = jnp.full((b,), t - 5, jnp.int32)
    kwargs["key_value_seq_lengths"] = jnp.full((b,), s - 7, jnp.int32)
  if tiling == "unfused":
    monkeypatch.setattr(mosaic.BACKEND, "backward_tiling",
                        mosaic.default_backward_tiling(h, fused_dq=False))
  q, k, v = qkv(b, t, s, n, kh, h, kind="qkv_channel_bias",
                dtype=jnp.bfloat16, layout=layout)
  do = jax.random.normal(jax.random.key(t + h), q.shape, q.dtype)
  u = jax.random.normal(jax.random.key(s + h), (b, n, t))
  return layout, kwargs, q, k, v, do, u


# (B, T, S, N, K, H), attention kwargs, cap, backward_stats,
# implementations.
BACKWARD_GPU_CASES = [
    ((1, 4096, 4096, 8, 2, 128), dict(is_causal=True), 50.0, "auto",
     ("mosaic", "pallas")),
    ((2, 1024, 1024, 4, 4, 128), {}, 3.0, "auto", ("mosaic", "pallas")),
    ((1, 1000, 3000, 8, 1, 64), dict(is_causal=True, lengths=True,
                                     causal_alignment="bottom_right"),
     3.0, "auto", ("mosaic", "pallas")),
    ((1, 777, 1023, 4, 2, 96), dict(layout="BNTH", lengths=True), 30.0,
     "recompute", ("mosaic",)),
    ((2, 1000, 1000, 8, 2, 256), dict(is_causal=True), 30.0, "auto",
     ("mosaic",)),
    ((1, 2048, 2048, 4, 2, 128), dict(is_causal=True,
                                      local_window_size=(700, 0)),
     3.0, "recompute", ("mosaic",)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm90 GPU")
@pytest.mark.parametrize(
    "shape,kwargs,cap,stats,impl",
    [case[:4] + (impl,) for case in BACKWARD_GPU_CASES for impl in case[4]])
def test_gpu_kernel_backward_with_cap_matches_exact(shape, kwargs, cap,
                                                    stats, impl, qkv,
                                                    monkeypatch):
  """jax.grad of capped attention through a kernel forward and a kernel
  backward against the exact FP32 gradients, the LSE's cotangent too: cos
  > 0.999 on channel-outlier data; outputs poisoned. "auto": the 16-bit-P·V
  forward's saved statistics, dQ corrected by its row sums (NOTES B39; the
  Mosaic dQ kernel beside dK/dV, the wide kernels at H=256, the Triton
  one); "recompute": the exact statistics made by the dQ kernel."""
  h = shape[-1]
  layout, kwargs, q, k, v, do, u = _capped_case(qkv, shape, kwargs, None,
                                                monkeypatch)
  config = PRESETS["sage2-8b"].replace(backward_stats=stats)
  call = _inputs.parse(q, k, v, layout=layout, logits_soft_cap=cap, **kwargs)
  diff = config.differentiated(q.dtype)
  assert diff.saved_stats == (stats == "auto")
  want_bwd = ("pallas" if impl == "mosaic" and h > 128 and stats != "auto"
              else impl)
  assert backends.backward_of(impl, call, diff).name == want_bwd

  grads = functools.partial(attention_grads, q, k, v, do, u, config=config,
                            layout=layout, logits_soft_cap=cap, **kwargs)
  want = grads(implementation="xla")
  poison_device_memory(16 * q.size * 4)
  got = grads(implementation=impl)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.shape == w.shape
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
    cos = error_metrics(g, w)["cos_sim"]
    assert cos > 0.999, cos


# backward_stats="saved" chosen explicitly, after a 16-bit-P·V forward:
# (B, T, S, N, K, H), attention kwargs, cap, tiling, implementation.
SAVED_GPU_CASES = [
    ((1, 2048, 2048, 8, 2, 128), dict(is_causal=True), 30.0, None, "mosaic"),
    ((1, 1000, 3000, 8, 2, 64), dict(is_causal=True, lengths=True,
                                     causal_alignment="bottom_right"),
     3.0, None, "mosaic"),
    ((1, 1024, 1024, 4, 4, 128), dict(layout="BNTH"), 3.0, "unfused",
     "mosaic"),
    ((1, 1000, 1000, 8, 2, 256), dict(is_causal=True, lengths=True), 30.0,
     None, "mosaic"),
    ((1, 1024, 1024, 4, 2, 128), dict(is_causal=True), 30.0, None,
     "pallas"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm90 GPU")
@pytest.mark.parametrize("shape,kwargs,cap,tiling,impl", SAVED_GPU_CASES)
def test_gpu_kernel_backward_with_cap_from_saved_statistics(
    shape, kwargs, cap, tiling, impl, qkv, monkeypatch):
  """With the statistics saved by the forward, the kernel backward with a
  cap (the Mosaic one: its dQ kernel, row sums and all, beside dK/dV at
  H=128 and 64, the wide kernels at H=256; the Triton one) against the
  "xla" backward given the same output and LSE, the same λ correction of
  dQ included: cos > 0.999 (16-bit products against FP32); outputs
  poisoned."""
  layout, kwargs, q, k, v, do, u = _capped_case(qkv, shape, kwargs, tiling,
                                                monkeypatch)
  config = PRESETS["sage2-8b"].replace(pv_dtype="bf16",
                                       pv_accumulation="fp32",
                                       backward_stats="saved")
  backend = {"mosaic": mosaic.BACKEND, "pallas": pallas_triton.BACKEND}[impl]

  @jax.jit
  def kernel(q, k, v, do, u):
    call = _inputs.parse(q, k, v, layout=layout, logits_soft_cap=cap,
                         **kwargs)
    assert backend.backward_unsupported(call, config) is None
    out, lse = backend.forward(call, config)
    saved = (out.astype(q.dtype), lse)
    return backend.backward(call, config, do, u, saved)[:3], saved

  poison_device_memory(16 * q.size * 4)
  got, (out, lse) = kernel(q, k, v, do, u)
  call = _inputs.parse(q, k, v, layout=layout, logits_soft_cap=cap, **kwargs)
  canon = functools.partial(_inputs.to_canonical, layout=layout)
  want = jax.jit(lambda q, k, v, do, u, out, lse: _vjp.attention_backward(
      canon(q), canon(k), canon(v), None, None, call.q_lengths,
      call.kv_lengths, canon(do), u, call.spec, call.sm_scale,
      saved=(canon(out), lse), logits_soft_cap=cap))(q, k, v, do, u, out,
                                                     lse)
  for g, w in zip(got, want[:3]):
    w = _inputs.from_canonical(w, layout)
    assert g.shape == w.shape
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
    cos = error_metrics(g, w)["cos_sim"]
    assert cos > 0.999, cos


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm90 GPU")
def test_gpu_mosaic_soft_cap_keeps_nan_and_gradients_exact(qkv, next_key):
  """A NaN in K reaches the rows that see it (as in exact attention; the
  cap's tanh keeps NaN); gradients through the Mosaic forward and the
  Mosaic backward are exact attention's."""
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

"""NaN and Inf in Q, K or V show in the output as in exact attention.

One call carries every poisoning at once, one per batch element (batch
elements never mix): a single NaN or +Inf in Q, in K and in V, plus a clean
element. Each backend must give a non-finite value wherever exact attention
does, and exactly where :mod:`sagejax.quant` documents:

* Q row ``t0`` of head ``n0``: that output row (and its LSE).
* K token ``s0`` of KV head ``kv0``: every row of that head's query heads that
  may see ``s0`` (and their LSE).
* V token ``s0``, channel ``c0``: channel ``c0`` of every row of that KV
  head's query heads (the per-channel V scale is NaN, as dense exact
  attention's ``0·NaN``); the LSE stays finite.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sagejax
import sagejax.nn
from sagejax import SageConfig, _inputs, quant
from sagejax.backends import pallas_triton, xla
from sagejax.kernels import triton_attention

ON_GPU = jax.default_backend() == "gpu"

B, T, S, N, KH, H = 7, 50, 50, 4, 2, 64
T0, N0 = 12, 1            # poisoned query row and head
S0, KV0, C0 = 37, 1, 5    # poisoned key/value token, KV head, channel
POISONS = [("q", np.nan), ("q", np.inf), ("k", np.nan), ("k", np.inf),
           ("v", np.nan), ("v", np.inf)]            # batch element 6: clean

# Small blocks (fast interpreter); one config per quantizer path: per-block
# INT8 + FP16 V, per-thread INT8 + FP8 V, INT4 with smoothed Q (block means)
# and smoothed V.
CONFIGS = {
    "sage1": SageConfig(qk_granularity="per_block", pv_dtype="fp16",
                        pv_accumulation="fp32", block_q=32, block_k=32),
    "sage2-8b": SageConfig(block_q=32, block_k=32),
    "sage2-4b+smooth_v": SageConfig(qk_dtype="int4", smooth_q=True,
                                    smooth_v=True, block_q=32, block_k=32),
}
TILING = triton_attention.KernelTiling(block_q=32, block_k=32, num_warps=4,
                                       num_stages=1)


def poisoned(q, k, v):
  """Element i of the batch gets POISONS[i]; BTNH."""
  arrays = {"q": q, "k": k, "v": v}
  for b, (name, value) in enumerate(POISONS):
    x = arrays[name]
    if name == "q":
      arrays[name] = x.at[b, T0, N0, C0].set(value)
    else:
      arrays[name] = x.at[b, S0, KV0, C0].set(value)
  return arrays["q"], arrays["k"], arrays["v"]


def expected_nonfinite(causal: bool):
  """(output ``[B, T, N, H]``, LSE ``[B, N, T]``) where quant says non-finite."""
  out = np.zeros((B, T, N, H), bool)
  lse = np.zeros((B, N, T), bool)
  group = slice(KV0 * (N // KH), (KV0 + 1) * (N // KH))
  sees = np.arange(T) >= S0 if causal else np.ones(T, bool)
  for b, (name, _) in enumerate(POISONS):
    if name == "q":
      out[b, T0, N0, :] = True
      lse[b, N0, T0] = True
    elif name == "k":
      out[b, sees, group, :] = True
      lse[b, group, sees] = True
    else:
      out[b, :, group, C0] = True
  return out, lse


def _bad(x):
  return ~np.isfinite(np.asarray(x, np.float32))


def check(out, lse, exact, causal):
  want_out, want_lse = expected_nonfinite(causal)
  # Never finite where exact attention is not.
  assert not np.any(_bad(exact) & ~_bad(out)), "finite where exact is not"
  np.testing.assert_array_equal(_bad(out), want_out)
  np.testing.assert_array_equal(_bad(lse), want_lse)


def _forward(backend, config, causal):
  def f(q, k, v):
    call = _inputs.parse(q, k, v, is_causal=causal)
    if backend is pallas_triton.INTERPRET_BACKEND:
      return backend.kernel(backend.prepare(call, config, TILING), call,
                            config, TILING)
    return backend.forward(call, config)
  return jax.jit(f)


@pytest.mark.parametrize("backend,name,causal", [
    ("xla", "sage2-4b+smooth_v", True), ("pallas-interpret", "sage1", True),
    ("pallas-interpret", "sage2-8b", False),
    ("pallas-interpret", "sage2-4b+smooth_v", True)])
def test_nan_and_inf_reach_the_output(backend, name, causal, qkv):
  q, k, v = poisoned(*qkv(B, T, S, N, KH, H, kind="qkv_channel_bias",
                          dtype=jnp.bfloat16))
  impl = {"xla": xla.BACKEND,
          "pallas-interpret": pallas_triton.INTERPRET_BACKEND}[backend]
  out, lse = _forward(impl, CONFIGS[name], causal)(q, k, v)
  exact = sagejax.exact_attention(q, k, v, is_causal=causal)
  check(out, lse, exact, causal)


def test_public_api_propagates_nan(qkv):
  """sagejax.attention (default backend, jit, preset) and its LSE."""
  q, k, v = poisoned(*qkv(B, T, S, N, KH, H, dtype=jnp.float32))
  f = jax.jit(lambda q, k, v: sagejax.attention(q, k, v, is_causal=True,
                                                return_lse=True))
  out, lse = f(q, k, v)
  check(out, lse, sagejax.exact_attention(q, k, v, is_causal=True), True)


def test_quantize_kernels_match_quant_on_poisoned_inputs(qkv):
  """The Pallas quantizers give quant's NaN scales and zero values (16-bit V
  with its non-finite flags; INT4 with Q block means, smoothed FP8 V)."""
  for config in (CONFIGS["sage1"], CONFIGS["sage2-4b+smooth_v"]):
    q, k, v = poisoned(*qkv(B, 64, 64, N, KH, H, kind="qkv_channel_bias"))
    call = _inputs.parse(q, k, v)
    got = pallas_triton.INTERPRET_BACKEND.prepare(call, config, TILING).qkv
    want = quant.quantize(*call.canonical(), config, call.sm_scale)
    for field in ("q", "k"):
      np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
    for field in ("q_scale", "k_scale", "v_scale"):  # NaN == NaN here
      np.testing.assert_allclose(getattr(got, field), getattr(want, field),
                                 rtol=1e-6)
    assert np.isnan(want.q_scale[0, N0, T0]) and np.isnan(want.q_scale[1, N0,
                                                                        T0])
    assert np.isnan(want.k_scale[2, KV0, S0]) and np.isnan(want.v_scale[4, KV0,
                                                                         C0])


def test_group_scales_ignore_the_poisoned_token(next_key):
  """A non-finite token: scale NaN, values 0; its group keeps a finite scale."""
  config = SageConfig(qk_granularity="per_block", block_q=32)
  x = jax.random.normal(next_key(), (1, 1, 32, 16))
  bad = x.at[0, 0, 3, 7].set(jnp.inf).at[0, 0, 9, 0].set(jnp.nan)
  values, scale = quant.quantize_groups(bad, "q", config)
  assert np.isnan(scale[0, 0, 3]) and np.isnan(scale[0, 0, 9])
  assert not np.any(values[0, 0, 3]) and not np.any(values[0, 0, 9])
  clean = jnp.delete(jnp.arange(32), jnp.array([3, 9]))
  amax = np.max(np.abs(np.asarray(x)[0, 0, clean]))
  np.testing.assert_allclose(scale[0, 0, clean], amax / 127, rtol=1e-6)
  vq, vs = quant.quantize_v_fp8(bad)
  assert np.all(np.isnan(vs[0, 0, [0, 7]]))
  assert np.all(np.isfinite(vs[0, 0, 1:7]))
  assert not np.any(np.asarray(vq[0, 0, :, 7], np.float32))


def test_padding_is_not_an_input(qkv):
  """NaN past the valid lengths is padding: the output stays finite."""
  q, k, v = qkv(2, 40, 40, 2, 2, 64, dtype=jnp.float32)
  k = k.at[:, 35].set(jnp.nan)
  v = v.at[:, 36].set(jnp.nan)
  q = q.at[:, 38].set(jnp.nan)
  lengths = jnp.array([30, 33], jnp.int32)
  out = sagejax.attention(q, k, v, query_seq_lengths=lengths,
                          key_value_seq_lengths=lengths)
  assert np.all(np.isfinite(np.asarray(out)))


def test_flax_attention_fn_propagates_nan(qkv):
  """The Flax path with a mask (Flax's mean-of-V fill for unseen rows) keeps a
  NaN row NaN."""
  q, k, v = qkv(1, 16, 16, 2, 2, 32, dtype=jnp.float32)
  q = q.at[0, 4, 1, 0].set(jnp.nan)
  mask = jnp.ones((1, 1, 16, 16), bool).at[..., 7, :].set(False)
  out = sagejax.nn.attention_fn("sage2-8b")(q, k, v, mask=mask)
  bad = _bad(out)
  assert bad[0, 4, 1].all() and bad.sum() == 32
  np.testing.assert_allclose(out[0, 7], jnp.mean(v[0], axis=0), rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("backend", ["pallas", "mosaic"])
@pytest.mark.parametrize("preset", ["sage1", "sage2-8b", "sage2-4b"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_kernels_propagate_nan_and_inf(backend, preset, causal, qkv):
  """The compiled kernels (Triton's max ignores NaN; the rules still hold)."""
  from sagejax import backends
  if (backend not in backends.registry()
      or not backends.registry()[backend].available()):
    pytest.skip(f"{backend} is not available on this GPU")
  q, k, v = poisoned(*qkv(B, T, S, N, KH, H, kind="qkv_channel_bias",
                          dtype=jnp.bfloat16))
  f = jax.jit(lambda q, k, v: sagejax.attention(
      q, k, v, is_causal=causal, config=preset, implementation=backend,
      return_lse=True))
  out, lse = f(q, k, v)
  check(out, lse, sagejax.exact_attention(q, k, v, is_causal=causal), causal)

"""``implementation=None`` chooses per platform at lowering time: an export
made on this CPU host carries the Pallas kernels for CUDA and "xla" for the
CPU; the CPU part runs here and matches the "xla" backend."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sagejax
from sagejax import PRESETS, _inputs, backends
from sagejax.testing import error_metrics

ON_GPU = jax.default_backend() == "gpu"
try:  # jax.export serialization needs it (not a jax dependency)
  import flatbuffers  # noqa: F401  pylint: disable=unused-import
  HAVE_FLATBUFFERS = True
except ImportError:
  HAVE_FLATBUFFERS = False


def _roundtrip(exp):
  """Serialized and back when flatbuffers is installed (else in memory)."""
  if not HAVE_FLATBUFFERS:
    return exp
  return jax.export.deserialize(exp.serialize(vjp_order=1))
KERNELS = ("sage_attention_fwd", "sage_quantize_q", "sage_quantize_k",
           "sage_quantize_v")


def _export(fn, platforms, *args, **kw):
  return jax.export.export(
      jax.jit(fn), platforms=platforms,
      disabled_checks=backends.export_disabled_checks(), **kw)(*args)


@pytest.mark.skipif(ON_GPU, reason="checks the export of a CPU-only host")
def test_cuda_export_from_a_cpu_host_holds_the_kernels(qkv):
  q, k, v = qkv(2, 100, 120, 4, 2, 64, dtype=jnp.bfloat16)
  exp = _export(functools.partial(sagejax.attention, is_causal=True),
                ("cuda",), q, k, v)
  text = exp.mlir_module()
  assert exp.platforms == ("cuda",)
  assert "__gpu$xla.gpu.triton" in text
  for name in KERNELS:
    assert name in text, name
  # Without the disabled check, jax.export names the custom call it refuses.
  with pytest.raises(ValueError, match="custom calls"):
    jax.export.export(jax.jit(sagejax.attention), platforms=("cuda",))(
        q, k, v)


def test_cuda_cpu_export_runs_here_as_the_xla_backend(qkv, next_key):
  """The CPU branch of a ("cuda", "cpu") module (serialized and back, with
  flatbuffers) is the "xla" backend (same arithmetic, same default preset);
  gradients too."""
  q, k, v = qkv(2, 70, 90, 4, 2, 64, kind="channel_bias", dtype=jnp.float32)
  bias = jax.random.normal(next_key(), (1, 4, 1, 90))
  fn = functools.partial(sagejax.attention, is_causal=True, return_lse=True)
  exp = _export(fn, ("cuda", "cpu"), q, k, v, bias)
  text = exp.mlir_module()
  for name in KERNELS:
    assert name in text, name
  # The backward is chosen per platform too: the kernel backward for CUDA.
  assert "sage_attention_bwd_dkdv" in exp.vjp().mlir_module()
  exp = _roundtrip(exp)
  out, lse = exp.call(q, k, v, bias)
  want, want_lse = jax.jit(functools.partial(fn, implementation="xla"))(
      q, k, v, bias)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)

  w = jax.random.normal(next_key(), q.shape)
  loss = lambda f: (lambda *a: jnp.sum(f(*a)[0] * w))  # noqa: E731
  got = jax.grad(loss(exp.call), (0, 1, 2, 3))(q, k, v, bias)
  exact = jax.grad(loss(functools.partial(
      sagejax.exact_attention, is_causal=True, return_lse=True)),
      (0, 1, 2, 3))(q, k, v, bias)
  for g, r in zip(got, exact):  # blockwise FP32 vs dense: ~2e-5 measured
    assert error_metrics(g, r)["rel_l2"] < 1e-4


def test_explicit_implementation_keeps_its_meaning(qkv):
  q, k, v = qkv(1, 40, 40, 2, 2, 64, dtype=jnp.float32)
  exp = _export(functools.partial(sagejax.attention, implementation="xla"),
                ("cuda", "cpu"), q, k, v)
  assert "sage_attention_fwd" not in exp.mlir_module()
  if not ON_GPU:
    with pytest.raises(ValueError, match="not available"):
      _export(functools.partial(sagejax.attention, implementation="pallas"),
              ("cuda",), q, k, v)


def test_plan_per_platform(qkv):
  """The choice: per platform, default preset per backend; on a host without
  a GPU, the GPU backend that runs on the oldest GPUs (never the sm90-only
  "mosaic", ahead of "pallas" in the registry)."""
  q, k, v = qkv(1, 40, 40, 2, 2, 64, dtype=jnp.float32)
  call = _inputs.parse(q, k, v)
  plan = backends.plan(None, call, None)
  assert (plan.backend, plan.config) == ("xla", PRESETS["sage1"])
  assert backends.plan("xla", call, None).per_platform == ()
  if ON_GPU:  # a local GPU: what select() picks on it
    name = backends.select(None, call, None).name
    assert plan.per_platform[0][:2] == ("cuda", name)
    return
  assert plan.per_platform == (("cuda", "pallas", PRESETS["sage1"]),)
  named = backends.plan(None, call, "sage2-8b")
  assert named.per_platform == (("cuda", "pallas", PRESETS["sage2-8b"]),)
  # H=16: "pallas" does not serve it ("mosaic" would, on sm90 only): "xla".
  small = _inputs.parse(q[..., :16], k[..., :16], v[..., :16])
  assert backends.plan(None, small, None).per_platform == ()


def test_vmap_and_eager_with_the_plan(qkv):
  q, k, v = qkv(1, 40, 50, 4, 2, 64, dtype=jnp.float32)
  qs = jnp.stack([q, 2 * q])
  batched = jax.vmap(lambda q: sagejax.attention(q, k, v, is_causal=True))(qs)
  for i in range(2):
    one = sagejax.attention(qs[i], k, v, is_causal=True)  # eager
    np.testing.assert_allclose(batched[i], one, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
def test_gpu_runs_a_deserialized_export(qkv):
  """A ("cuda", "cpu") export (serialized and back, with flatbuffers) runs
  this GPU's kernels here, bit for bit."""
  q, k, v = qkv(2, 1000, 1000, 8, 2, 128, kind="channel_bias",
                dtype=jnp.bfloat16)
  fn = functools.partial(sagejax.attention, is_causal=True)
  got = _roundtrip(_export(fn, ("cuda", "cpu"), q, k, v)).call(q, k, v)
  local = backends.select(None, _inputs.parse(q, k, v, is_causal=True),
                          None).name  # "mosaic" on sm90, else "pallas"
  pallas = jax.jit(functools.partial(fn, implementation=local))(q, k, v)
  # The oracle at the preset the local backend ran ("auto" is per backend).
  xla_ = jax.jit(functools.partial(fn, implementation="xla",
                                   config=backends.default_preset(local)))(
                                       q, k, v)
  exact = sagejax.exact_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(np.asarray(got, np.float32),
                             np.asarray(pallas, np.float32), rtol=0, atol=0)
  assert error_metrics(got, xla_)["rel_l2"] < (
      0.3 * error_metrics(xla_, exact)["rel_l2"] + 2e-3)

"""Multi-device checks (sharded jit, ring attention) on a forced 4-device CPU.

XLA reads ``--xla_force_host_platform_device_count`` once, when JAX starts, so
the checks in ``tests/multi_device/`` run in their own pytest process with the
flag set; each file here is one test of this suite (CI runs them under
``pytest -n 2`` like the rest).
"""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sagejax
from sagejax.testing import error_metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKS = sorted(p.name for p in (ROOT / "tests" / "multi_device").glob(
    "*_checks.py"))


@pytest.mark.slow
@pytest.mark.parametrize("checks", CHECKS)
def test_on_four_cpu_devices(checks):
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=4").strip()
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("PYTEST_XDIST_WORKER", None)
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
       "-p", "no:xdist", f"tests/multi_device/{checks}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  report = proc.stdout[-6000:] + proc.stderr[-3000:]
  assert proc.returncode == 0, report
  assert " passed" in proc.stdout and " failed" not in proc.stdout, report


# On a machine with several GPUs (python -m pytest -m gpu): the compiled
# Pallas kernels, sharded and in the ring.
gpus = pytest.mark.skipif(
    jax.default_backend() != "gpu" or jax.device_count() < 2,
    reason="needs 2 or more NVIDIA GPUs")


@pytest.mark.gpu
@gpus
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_ring_attention_pallas(qkv, causal):
  mesh = Mesh(np.array(jax.devices()), ("seq",))
  q, k, v = qkv(1, 1000 * jax.device_count(), 1000 * jax.device_count(), 8,
                2, 128, kind="channel_bias", dtype=jnp.bfloat16)
  got = jax.jit(lambda *a: sagejax.ring_attention_on_mesh(
      *a, mesh, seq_axis="seq", is_causal=causal,
      implementation="pallas"))(q, k, v)
  single = jax.jit(lambda *a: sagejax.attention(
      *a, is_causal=causal, implementation="pallas"))(q, k, v)
  exact = sagejax.exact_attention(q, k, v, is_causal=causal)
  ring_err = error_metrics(got, exact)["rel_l2"]
  single_err = error_metrics(single, exact)["rel_l2"]
  assert ring_err < 1.3 * single_err + 1e-3, (ring_err, single_err)


@pytest.mark.gpu
@gpus
def test_gpu_sharded_jit_pallas(qkv):
  p = jax.device_count()
  mesh = Mesh(np.array(jax.devices()), ("x",))
  q, k, v = qkv(2 * p, 700, 700, 8, 4, 128, dtype=jnp.bfloat16)
  fn = jax.jit(lambda *a: sagejax.attention(*a, is_causal=True,
                                            implementation="pallas"))
  sharded = [jax.device_put(x, NamedSharding(mesh, P("x"))) for x in (q, k, v)]
  compiled = fn.lower(*sharded).compile()
  assert "all-gather" not in compiled.as_text()
  got = compiled(*sharded)
  np.testing.assert_allclose(np.asarray(got, np.float32),
                             np.asarray(fn(q, k, v), np.float32), atol=2e-3)

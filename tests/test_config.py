"""SageConfig: presets, validation (ValueError naming the field), resolution."""

import jax
import jax.numpy as jnp
import pytest

from sagejax import PRESETS, SageConfig, resolve_config


def test_presets_match_the_papers():
  s1, s8, s4 = PRESETS["sage1"], PRESETS["sage2-8b"], PRESETS["sage2-4b"]
  assert (s1.qk_dtype, s1.qk_granularity, s1.pv_dtype, s1.smooth_k) == (
      "int8", "per_block", "fp16", True)
  assert (s8.qk_dtype, s8.qk_granularity, s8.pv_dtype, s8.pv_accumulation,
          s8.smooth_k, s8.smooth_q) == (
              "int8", "per_thread", "fp8_e4m3", "fp32+fp32", True, False)
  assert (s4.qk_dtype, s4.qk_granularity, s4.pv_dtype, s4.smooth_k,
          s4.smooth_q) == ("int4", "per_thread", "fp8_e4m3", True, True)
  assert (s1.qmax, s8.qmax, s4.qmax) == (127, 127, 7)
  assert SageConfig() == s8


def test_resolve_config():
  assert resolve_config("sage1") is PRESETS["sage1"]
  assert resolve_config("sage2-8b", backend="pallas") is PRESETS["sage2-8b"]
  custom = SageConfig(qk_granularity="per_token", smooth_v=True)
  assert resolve_config(custom) is custom
  with pytest.raises(ValueError, match="Unknown config 'sage3'"):
    resolve_config("sage3")
  with pytest.raises(TypeError, match="config must be a SageConfig"):
    resolve_config(8)


@pytest.mark.parametrize("field,value", [
    ("qk_dtype", "int2"),
    ("qk_dtype", "fp8"),
    ("qk_granularity", "per_row"),
    ("pv_dtype", "fp32"),
    ("pv_dtype", "int8"),
    ("pv_accumulation", "fp16"),
    ("smooth_k", 1),
    ("smooth_q", "yes"),
    ("smooth_v", None),
    ("block_q", 96),
    ("block_q", 0),
    ("block_q", 128.0),
    ("block_k", 48),
    ("block_k", -64),
    ("block_k", 8),
    ("block_q", 8),
    ("num_warps", 3),
    ("num_warps", 16),
    ("num_warps", 0),
])
def test_bad_values_raise_naming_the_field(field, value):
  with pytest.raises(ValueError, match=rf"\b{field}\b"):
    SageConfig(**{field: value})


def test_block_q_must_hold_whole_per_thread_groups():
  # 4 warps x 8 row groups = 32 rows at least.
  with pytest.raises(ValueError, match=r"block_q=16 must be a multiple of"):
    SageConfig(block_q=16, num_warps=4)
  cfg = SageConfig(block_q=16, num_warps=2)
  assert cfg.rows_per_warp == 8
  with pytest.raises(ValueError, match="block_q"):
    PRESETS["sage2-8b"].replace(block_q=32, num_warps=8)


def test_frozen_hashable_and_a_jit_static():
  cfg = PRESETS["sage2-8b"]
  with pytest.raises(Exception):
    cfg.block_q = 64  # frozen
  other = cfg.replace(block_k=128)
  assert other.block_k == 128 and cfg.block_k == 64
  assert hash(cfg.replace()) == hash(cfg) and cfg.replace() == cfg
  assert len({cfg, other, cfg.replace()}) == 2
  f = jax.jit(lambda x, c: x * c.qmax, static_argnums=1)
  assert float(f(jnp.float32(1), cfg)) == 127
  assert float(f(jnp.float32(1), PRESETS["sage2-4b"])) == 7


def test_auto_is_each_backends_default_preset():
  """None / "auto" resolve per backend; named presets mean the same anywhere."""
  from sagejax import backends
  for name, backend in backends.registry().items():
    want = PRESETS[getattr(backend, "default_preset",
                           backends.FALLBACK_PRESET)]
    assert resolve_config(None, backend=name) is want
    assert resolve_config("auto", backend=backend) is want
  local = next(b for b in backends.registry().values() if b.available())
  assert resolve_config(None) is resolve_config(None, backend=local)
  assert backends.default_preset("pallas") == "sage1"  # measured, README

  class Unmeasured:  # a backend that declares no default yet (mosaic)
    name = "new"
  assert backends.default_preset(Unmeasured()) == backends.FALLBACK_PRESET


def test_attention_default_config_is_the_backends(qkv):
  import numpy as np

  import sagejax
  from sagejax import backends
  q, k, v = qkv(1, 40, 40, 2, 2, 32, dtype=jnp.float32)
  f = jax.jit(sagejax.attention, static_argnames=("config", "implementation"))
  auto = f(q, k, v, implementation="xla")
  named = f(q, k, v, config=backends.default_preset("xla"),
            implementation="xla")
  np.testing.assert_array_equal(auto, named)
  np.testing.assert_array_equal(f(q, k, v, config="auto",
                                  implementation="xla"), named)

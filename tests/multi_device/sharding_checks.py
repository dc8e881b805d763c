"""sagejax.attention under a sharded jit: each device runs its own shard.

Run by tests/test_multi_device.py with 4 CPU devices (a 2 x 2 mesh). Checks:
sharded == unsharded (forward and gradients), the output sharded like the
query, no all-gather / all-to-all / collective-permute in the compiled
program (only the all-reduce of a broadcast bias's gradient), and clear
errors for shardings the kernels cannot run with.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import sagejax
from sagejax import backends, sharding
from sagejax.backends import pallas_triton
from sagejax.testing import error_metrics

pytestmark = pytest.mark.skipif(jax.device_count() < 4,
                                reason="needs 4 devices (see the docstring)")

COMMUNICATION = ("all-gather", "all-to-all", "collective-permute",
                 "all-reduce", "reduce-scatter")


def _mesh(kind=AxisType.Auto):
  return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"),
              axis_types=(kind, kind))


@pytest.fixture
def interpreted_pallas(monkeypatch):
  """implementation="pallas" runs the Pallas kernels in the interpreter."""
  monkeypatch.setitem(backends.registry(), "pallas",
                      pallas_triton.INTERPRET_BACKEND)


def _collectives(compiled_text: str) -> set[str]:
  return {c for c in COMMUNICATION if c in compiled_text}


def _put(mesh, x, spec):
  return None if x is None else jax.device_put(x, NamedSharding(mesh, spec))


# (name, (B, T, S, N, K, H), layout, spec of q/k/v, extra) — GQA everywhere.
CASES = [
    ("batch_over_both_mesh_axes", (4, 40, 56, 4, 2, 32), "BTNH",
     P(("data", "model")), {}),
    ("heads", (2, 40, 56, 4, 2, 32), "BTNH", P(None, None, "model"), {}),
    ("batch_heads_bnth_masks", (2, 33, 47, 4, 2, 32), "BNTH",
     P("data", "model"), {"mask": True, "bias": True, "lengths": True}),
]


def _inputs(qkv, next_key, shape, layout, extra):
  b, t, s, n, kh, h = shape
  q, k, v = qkv(b, t, s, n, kh, h, kind="channel_bias", dtype=jnp.float32,
                layout=layout)
  keys = jax.random.split(next_key(), 4)
  kw = {}
  if extra.get("mask"):  # per batch and head
    kw["mask"] = jax.random.bernoulli(keys[0], 0.8, (b, n, t, s))
  if extra.get("bias"):  # broadcast over the batch: its gradient is summed
    kw["bias"] = jax.random.normal(keys[1], (1, n, t, s))
  if extra.get("lengths"):
    kw["key_value_seq_lengths"] = jax.random.randint(keys[2], (b,), 1, s + 1)
  return q, k, v, kw


def _specs(spec, layout, kw):
  """Specs of the extra arrays, consistent with the q/k/v spec."""
  entries = tuple(spec) + (None,) * (4 - len(spec))
  batch = entries[0]
  heads = entries[2] if layout == "BTNH" else entries[1]
  return {"mask": P(batch, heads), "bias": P(None, heads),
          "key_value_seq_lengths": P(batch)}


# The Pallas interpreter is slow: one case (batch, heads, masks) covers it.
RUNS = [(c, "xla") for c in CASES] + [
    (c, "pallas") for c in CASES if c[0] == "batch_heads_bnth_masks"]


@pytest.mark.parametrize("case,impl", RUNS,
                         ids=[f"{c[0]}-{i}" for c, i in RUNS])
def test_sharded_jit_equals_unsharded(qkv, next_key, interpreted_pallas, case,
                                      impl):
  name, shape, layout, spec, extra = case
  mesh = _mesh()
  q, k, v, kw = _inputs(qkv, next_key, shape, layout, extra)
  kw_specs = _specs(spec, layout, kw)
  names = sorted(kw)

  def attn(q, k, v, *extra_arrays):
    return sagejax.attention(q, k, v, is_causal=True, layout=layout,
                             implementation=impl,
                             **dict(zip(names, extra_arrays)))

  args = (q, k, v) + tuple(kw[n] for n in names)
  sharded = tuple(_put(mesh, x, spec) for x in (q, k, v)) + tuple(
      _put(mesh, kw[n], kw_specs[n]) for n in names)
  fn = jax.jit(attn)
  want = fn(*args)
  compiled = fn.lower(*sharded).compile()
  got = compiled(*sharded)  # the same arithmetic, compiled per shard
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  assert got.sharding.is_equivalent_to(sharded[0].sharding, 4)
  assert not _collectives(compiled.as_text())

  w = jax.random.normal(next_key(), q.shape)
  argnums = (0, 1, 2) + ((3 + names.index("bias"),) if "bias" in kw else ())
  grad = jax.jit(jax.grad(lambda *a: jnp.sum(attn(*a) * w), argnums))
  want_g = grad(*args)
  compiled = grad.lower(*sharded).compile()
  got_g = compiled(*sharded)
  for g, r, x in zip(got_g, want_g, sharded):
    assert error_metrics(g, r)["rel_l2"] < 5e-5  # f32 sums reassociated
    assert g.sharding.is_equivalent_to(x.sharding, 4)
  comm = _collectives(compiled.as_text())
  # Only the bias's gradient (broadcast over the sharded batch) is summed.
  assert comm <= ({"all-reduce"} if "bias" in kw and spec[0] else set()), comm


def test_explicit_mesh_uses_shard_map(qkv):
  mesh = _mesh(AxisType.Explicit)
  q, k, v = qkv(4, 40, 40, 4, 2, 32, dtype=jnp.float32)
  want = sagejax.attention(q, k, v, is_causal=True)
  with jax.set_mesh(mesh):
    spec = P("data", None, "model")
    qs, ks, vs = (_put(mesh, x, spec) for x in (q, k, v))
    fn = jax.jit(lambda q, k, v: sagejax.attention(q, k, v, is_causal=True))
    compiled = fn.lower(qs, ks, vs).compile()
    got = compiled(qs, ks, vs)
    assert jax.typeof(got).sharding.spec == P("data", None, "model", None)
    assert not _collectives(compiled.as_text())
    with pytest.raises(ValueError, match=r"axis 1 \(query sequence T\)"):
      fn(*(_put(mesh, x, P(None, "data")) for x in (q, k, v)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_eager_call_and_vmap_on_sharded_arrays(qkv):
  """Eager calls on sharded arrays are partitioned; vmap folds into batch."""
  mesh = _mesh()
  q, k, v = qkv(4, 24, 24, 2, 2, 16, dtype=jnp.float32)
  qs, ks, vs = (_put(mesh, x, P("data")) for x in (q, k, v))
  got = sagejax.attention(qs, ks, vs)
  want = sagejax.attention(q, k, v)
  # The sharded and unsharded programs compile apart: a last-bit difference
  # in a score can flip one P̃ element's 16-bit rounding (measured: 7 of
  # 3072 outputs, one row, 1.5e-3 relative); any error in the partitioning
  # would move whole batches.
  def check(got):
    close = np.isclose(got, want, rtol=1e-5, atol=1e-5)
    assert close.mean() > 0.99, close.mean()
    assert error_metrics(got, want)["rel_l2"] < 1e-4

  check(got)
  assert got.sharding.is_equivalent_to(qs.sharding, 4)
  # vmap over a leading axis of 2 x [2, ...]: the mapped axis joins the batch.
  split = lambda x: x.reshape(2, 2, *x.shape[1:])  # noqa: E731
  fn = jax.jit(jax.vmap(sagejax.attention))
  got = fn(*(_put(mesh, split(x), P(None, "data")) for x in (q, k, v)))
  check(got.reshape(q.shape))


@pytest.mark.parametrize("case", ["sequence", "head_dim", "kv_heads"])
def test_unsupported_shardings_name_the_axis(qkv, case):
  mesh = _mesh()
  q, k, v = qkv(2, 24, 24, 8, 2, 32, dtype=jnp.float32)
  spec, match = {
      "sequence": (P(None, "model"), r"query is sharded along its axis 1 "
                   r"\(query sequence T\).*sagejax\.ring_attention"),
      "head_dim": (P(None, None, None, "model"),
                   r"axis 3 \(head dim H\) over mesh axes \('model',\)"),
      "kv_heads": (P(None, None, ("data", "model")),
                   r"key has number of key/value heads 2 \(axis 2\), which "
                   r"does not split into the 4 shards.*GQA"),
  }[case]
  specs = [spec] * 3
  if case == "kv_heads":  # 8 query heads in 4 shards; K/V replicated
    specs = [spec, P(), P()]
  args = [_put(mesh, x, s) for x, s in zip((q, k, v), specs)]
  with pytest.raises(Exception, match=match):
    jax.jit(sagejax.attention)(*args)


def test_mqa_with_sharded_query_heads(qkv):
  """One KV head (MQA) is replicated while the query heads are split."""
  mesh = _mesh()
  q, k, v = qkv(2, 24, 24, 4, 1, 32, dtype=jnp.float32)
  args = [_put(mesh, q, P(None, None, "model")), k, v]
  fn = jax.jit(functools.partial(sagejax.attention, is_causal=True))
  compiled = fn.lower(*args).compile()
  np.testing.assert_allclose(compiled(*args), fn(q, k, v), rtol=1e-5,
                             atol=1e-5)
  assert not _collectives(compiled.as_text())


def test_helper_psums_outputs_of_broadcast_inputs():
  """batch_head_parallel: an output with a size-1 batch axis is summed."""
  mesh = _mesh()
  fn = sharding.batch_head_parallel(
      lambda x, w: (x * w, jnp.sum(x * w, axis=0, keepdims=True)),
      [(sharding.BATCH, "features"), (sharding.BATCH, "features")],
      [(sharding.BATCH, "features"), (sharding.BATCH, "features")],
      names=("x", "w"))
  x = jnp.arange(24.0).reshape(4, 6)
  w = jnp.linspace(0.0, 1.0, 6)[None]
  got = jax.jit(fn)(_put(mesh, x, P("data")), w)
  np.testing.assert_allclose(got[0], x * w)
  np.testing.assert_allclose(got[1], jnp.sum(x * w, axis=0, keepdims=True))
  with pytest.raises(Exception, match=r"x is sharded along its axis 1 "
                     r"\(features\)"):
    jax.jit(fn)(_put(mesh, x, P(None, "model")), w)


"""Inputs and error metrics shared by the tests, the benchmarks and the reports.

``make_qkv`` draws the two kinds of data the accuracy tables use:

* ``"normal"``: q, k, v ~ N(0, 1).
* ``"channel_bias"``: per-(head, channel) offsets like the outliers of real
  LLM and DiT activations (what smoothing is for), one offset per head and
  channel shared by every token: k += 8·N(0, 1), v += 4·N(0, 1). This is the
  data of SageAttention's own accuracy runs in ``shared/ANCHORS.md``.
* ``"qkv_channel_bias"``: the same with q += 2·N(0, 1) as well.
"""

from __future__ import annotations

from typing import Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

import sagejax

DataKind = Literal["normal", "channel_bias", "qkv_channel_bias"]
DATA_KINDS = ("normal", "channel_bias", "qkv_channel_bias")
CHANNEL_BIAS = {
    "normal": {"q": 0.0, "k": 0.0, "v": 0.0},
    "channel_bias": {"q": 0.0, "k": 8.0, "v": 4.0},
    "qkv_channel_bias": {"q": 2.0, "k": 8.0, "v": 4.0},
}


def make_qkv(key: jax.Array, batch: int, q_len: int, kv_len: int,
             num_heads: int, num_kv_heads: int, head_dim: int,
             kind: DataKind = "normal", dtype=jnp.float16,
             layout: str = "BTNH"):
  """Random (q, k, v): q ``[B, T, N, H]``, k and v ``[B, S, K, H]`` (BTNH)."""
  if kind not in DATA_KINDS:
    raise ValueError(f"kind must be one of {DATA_KINDS}, got {kind!r}.")
  shapes = {"q": (batch, q_len, num_heads, head_dim),
            "k": (batch, kv_len, num_kv_heads, head_dim),
            "v": (batch, kv_len, num_kv_heads, head_dim)}
  keys = jax.random.split(key, 6)
  out = []
  for i, name in enumerate(("q", "k", "v")):
    b, t, n, h = shapes[name]
    x = jax.random.normal(keys[i], (b, t, n, h), jnp.float32)
    offset = CHANNEL_BIAS[kind][name]
    if offset:
      x = x + offset * jax.random.normal(keys[3 + i], (1, 1, n, h))
    if layout == "BNTH":
      x = jnp.swapaxes(x, 1, 2)
    out.append(x.astype(dtype))
  return tuple(out)


def error_metrics(out, ref) -> dict[str, float]:
  """Cosine similarity, relative L1, RMSE and relative L2 of ``out`` vs ``ref``.

  Computed in float64 over all elements (the definitions of SageAttention's
  accuracy tables).
  """
  a = np.asarray(jnp.asarray(out, jnp.float32), np.float64).ravel()
  b = np.asarray(jnp.asarray(ref, jnp.float32), np.float64).ravel()
  if not (np.all(np.isfinite(a))):
    return {"cos_sim": float("nan"), "rel_l1": float("inf"),
            "rmse": float("inf"), "rel_l2": float("inf")}
  denom = np.linalg.norm(a) * np.linalg.norm(b)
  return {
      "cos_sim": float(a @ b / denom) if denom > 0 else float("nan"),
      "rel_l1": float(np.abs(a - b).sum() / max(np.abs(b).sum(), 1e-30)),
      "rmse": float(np.sqrt(np.mean((a - b) ** 2))),
      "rel_l2": float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)),
  }


def assert_near_oracle(got, oracle, exact, *, ratio: float,
                       exact_ratio: Optional[float] = 1.2,
                       slack: float = 2e-3) -> dict[str, float]:
  """Asserts a kernel's output near the ``"xla"`` oracle's for the same call.

  With ``e = rel-L2(oracle, exact)`` (the quantization error itself):
  ``rel-L2(got, oracle) < ratio·e + slack`` and, unless ``exact_ratio`` is
  None, ``rel-L2(got, exact) < exact_ratio·e + slack``; ``got`` finite
  wherever the oracle is. Returns the three errors (``vs_oracle``,
  ``vs_exact``, ``oracle_exact``).
  """
  got_f = np.asarray(jnp.asarray(got, jnp.float32))
  finite = np.isfinite(np.asarray(jnp.asarray(oracle, jnp.float32)))
  assert np.all(np.isfinite(got_f[finite])), "non-finite where the oracle is"
  errors = {"vs_oracle": error_metrics(got, oracle)["rel_l2"],
            "vs_exact": error_metrics(got, exact)["rel_l2"],
            "oracle_exact": error_metrics(oracle, exact)["rel_l2"]}
  bound = ratio * errors["oracle_exact"] + slack
  assert errors["vs_oracle"] < bound, errors
  if exact_ratio is not None:
    assert errors["vs_exact"] < exact_ratio * errors["oracle_exact"] + slack, (
        errors)
  return errors


def assert_lse_near(got_lse, want_lse, atol: float = 2e-2) -> None:
  """The same rows are finite (−inf: rows that see no key) and the finite
  ones agree within ``atol``."""
  got_lse, want_lse = np.asarray(got_lse), np.asarray(want_lse)
  finite = np.isfinite(want_lse)
  np.testing.assert_array_equal(np.isfinite(got_lse), finite)
  np.testing.assert_allclose(got_lse[finite], want_lse[finite], atol=atol)


def poison_device_memory(nbytes: int) -> None:
  """Fills ``nbytes`` of device memory with NaN and frees it (XLA reuses
  freed buffers), so that an output element a kernel forgets to write
  reads as NaN."""
  jnp.full((max(nbytes // 4, 1),), jnp.nan, jnp.float32).block_until_ready()


def attention_grads(q, k, v, d_out, d_lse, bias=None, **kwargs) -> tuple:
  """(dQ, dK, dV[, dbias]) of ``sagejax.attention(q, k, v, bias,
  return_lse=True, **kwargs)`` under ``jax.jit(jax.grad)``, for the
  cotangents ``d_out`` (the output's shape) and ``d_lse`` (f32 ``[B, N,
  T]``; rows that see no key, LSE −inf, left out); dbias with a ``bias``."""
  def loss(q, k, v, bias):
    out, lse = sagejax.attention(q, k, v, bias, return_lse=True, **kwargs)
    return (jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
            + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse))
  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  return jax.jit(jax.grad(loss, argnums))(q, k, v, bias)

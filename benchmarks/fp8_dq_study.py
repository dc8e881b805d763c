"""CPU study (benchmarks/NOTES.md, B9): the gradient error of computing
dQ = dS·(K − k̄) with FP8 e4m3 operands, as a fused Hopper kernel could,
against exact gradients; beside dS rounded to BF16 (the committed kernel).

dS is scaled per query row and 128-key block (or per block), K − k̄ per
channel and 128-key block (or per block). One head at a time, H=128,
T = S ∈ {1k, 4k}, four heads, normal and channel-bias data; minimum cosine
over the heads.

    python benchmarks/fp8_dq_study.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from sagejax import testing

FP8 = jnp.float8_e4m3fn
BLOCK = 128


def exact_parts(q, k, v, do):
  """dS and dQ of exact attention on one head ``[T, H]``, and the scale."""
  c = q.shape[-1] ** -0.5
  p = jax.nn.softmax((q @ k.T) * c, axis=-1)
  delta = jnp.sum(do * (p @ v), -1, keepdims=True)
  ds = p * (do @ v.T - delta)
  return ds, ds @ k * c, c


def fp8_round(x, scale):
  return (x * scale).astype(FP8).astype(jnp.float32) / scale


def fp8_dq(ds, k, c, ds_scale: str, k_scale: str):
  """dQ from FP8 dS and K − k̄, accumulated per 128-key block in FP32."""
  kc = k - k.mean(0, keepdims=True)
  out = jnp.zeros((ds.shape[0], k.shape[1]), jnp.float32)
  for j in range(0, ds.shape[1], BLOCK):
    dsb, kb = ds[:, j:j + BLOCK], kc[j:j + BLOCK]
    ds_amax = (jnp.max(jnp.abs(dsb), 1, keepdims=True) if ds_scale == "row"
               else jnp.max(jnp.abs(dsb)))
    k_amax = (jnp.max(jnp.abs(kb), 0, keepdims=True) if k_scale == "channel"
              else jnp.max(jnp.abs(kb)))
    ds8 = fp8_round(dsb, jnp.where(ds_amax > 0, 448.0 / ds_amax, 1.0))
    k8 = fp8_round(kb, jnp.where(k_amax > 0, 448.0 / k_amax, 1.0))
    out = out + ds8 @ k8
  return out * c


def bf16_dq(ds, k, c):
  bf16 = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  return bf16(ds) @ bf16(k - k.mean(0, keepdims=True)) * c


def cos(a, b) -> float:
  a = np.asarray(a, np.float64).ravel()
  b = np.asarray(b, np.float64).ravel()
  return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def main():
  variants = {
      "bf16 dS (committed)": lambda ds, k, c: bf16_dq(ds, k, c),
      "fp8 dS row×block, K channel×block":
          lambda ds, k, c: fp8_dq(ds, k, c, "row", "channel"),
      "fp8 dS block, K channel×block":
          lambda ds, k, c: fp8_dq(ds, k, c, "block", "channel"),
      "fp8 dS row×block, K block":
          lambda ds, k, c: fp8_dq(ds, k, c, "row", "block"),
  }
  for kind in ("normal", "qkv_channel_bias"):
    for t in (1024, 4096):
      q, k, v = testing.make_qkv(jax.random.PRNGKey(t + len(kind)), 1, t, t,
                                 4, 4, 128, kind, jnp.float32, "BTNH")
      do = jax.random.normal(jax.random.PRNGKey(7 + t), q.shape, jnp.float32)
      cosines = {}
      for head in range(4):
        args = [x[0, :, head].astype(jnp.bfloat16).astype(jnp.float32)
                for x in (q, k, v, do)]
        ds, dq, c = jax.jit(exact_parts)(*args)
        for name, f in variants.items():
          cosines.setdefault(name, []).append(cos(f(ds, args[1], c), dq))
      for name, cs in cosines.items():
        print(f"{kind:16s} T={t:5d} {name:36s} min cos over heads "
              f"{min(cs):.6f}", flush=True)


if __name__ == "__main__":
  main()

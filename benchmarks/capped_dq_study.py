"""CPU study (benchmarks/NOTES.md, B39): dQ under a logit soft cap from the
forward's saved statistics (output O and LSE of the quantized forward, the
"xla" backend's sage2-8b with 16-bit P·V as under ``jax.grad``), three ways,
against the exact gradients:

* ``plain``: dQ = dX·K (what the kernels do under a cap): δ's error, and the
  LSE's, reach dQ times K's mean through Σ_j dX_ij.
* ``dlse_split``: dQ = dX·(K − k̄) + (dLSE − Σ_j dS_ij t_ij²)·k̄ (t = tanh of
  the capped logit / c): the error scaled by Σ_j P_ij t_ij², which a small
  cap makes large.
* ``lambda``: dQ = dX·K − λ_i (D_i − dLSE_i)·k̄ with λ_i = Σ_j P_ij (1 −
  t_ij²) and D_i = Σ_j dS_ij: the first-order error of Σ_j dX_ij removed
  (exact statistics give D = dLSE, so the term vanishes there).

dX = dS ∘ (1 − t²), dS = P ∘ (dP − δ), δ = rowsum(dO ∘ O) − dLSE. One head,
T=256, S=384, H=128, bottom-right causal, bf16 inputs; caps 3, 30, 50; the
testing module's three kinds of data, two seeds each. Prints the cosine of
(dQ, dK, dV) to the exact gradients per form.

    python benchmarks/capped_dq_study.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import sagejax
from sagejax import testing
from sagejax.config import PRESETS

FORMS = ("plain", "dlse_split", "lambda")


def case(cap: float, kind: str, seed: int) -> dict:
  b, t, s, n, h = 1, 256, 384, 1, 128
  q, k, v = testing.make_qkv(jax.random.PRNGKey(seed), b, t, s, n, n, h,
                             kind, jnp.bfloat16)
  do = jax.random.normal(jax.random.PRNGKey(seed + 100), q.shape)
  dl = jax.random.normal(jax.random.PRNGKey(seed + 200), (b, n, t))
  config = PRESETS["sage2-8b"].differentiated(jnp.bfloat16)
  out, lse = sagejax.attention(
      q, k, v, is_causal=True, causal_alignment="bottom_right",
      config=config, implementation="xla", return_lse=True,
      logits_soft_cap=cap)
  scale = h ** -0.5
  qf, kf, vf = (x[0, :, 0].astype(jnp.float32) for x in (q, k, v))
  dof, dlf = do[0, :, 0], dl[0, 0]
  y = cap * jnp.tanh(qf @ kf.T * scale / cap)
  visible = jnp.arange(s)[None] <= jnp.arange(t)[:, None] + (s - t)
  lse_exact = jax.nn.logsumexp(jnp.where(visible, y, -jnp.inf), axis=-1)
  out_exact = jax.nn.softmax(jnp.where(visible, y, -jnp.inf), axis=-1) @ vf
  kbar = kf.mean(0)
  t2 = jnp.square(y / cap)

  def grads(o, l, form):
    p = jnp.where(visible, jnp.exp(y - l[:, None]), 0.0)
    delta = jnp.sum(dof * o, -1) - dlf
    ds = p * (dof @ vf.T - delta[:, None])
    dx = ds * (1.0 - t2)
    if form == "plain":
      dq = dx @ kf
    elif form == "dlse_split":
      dq = dx @ (kf - kbar) + (dlf - jnp.sum(ds * t2, -1))[:, None] * kbar
    else:
      lam = jnp.sum(p * (1.0 - t2), -1)
      dq = dx @ kf - (lam * (jnp.sum(ds, -1) - dlf))[:, None] * kbar
    return dq * scale, dx.T @ qf * scale, p.T @ dof

  want = grads(out_exact, lse_exact, "plain")
  saved = (out[0, :, 0].astype(jnp.float32), lse[0, 0])
  return {form: [testing.error_metrics(g, w)["cos_sim"]
                 for g, w in zip(grads(*saved, form), want)]
          for form in FORMS}


def main():
  print("| data | cap | seed | " + " | ".join(
      f"{f}: dQ cos" for f in FORMS) + " | dK cos | dV cos |")
  for kind in testing.DATA_KINDS:
    for cap in (3.0, 30.0, 50.0):
      for seed in (0, 1):
        r = case(cap, kind, seed)
        print(f"| {kind} | {cap:g} | {seed} | " + " | ".join(
            f"{r[f][0]:.6f}" for f in FORMS)
              + f" | {r['plain'][1]:.6f} | {r['plain'][2]:.6f} |", flush=True)


if __name__ == "__main__":
  main()

"""The backward pass: gradients of exact attention, computed flash-style.

SageAttention quantizes only the forward. Its gradient here is the gradient of
*exact* softmax attention at the same inputs, the quantizers treated as
identities (straight-through). The exact softmax statistics (LSE, and the
output for rowsum(dO ∘ O)) are recomputed in FP32 by one blockwise forward
pass, so the result does not inherit the quantized forward's error; then, as
FlashAttention-2 does:

    P = exp(S − lse),  dV = Pᵀ dO,  dP = dO Vᵀ,
    dS = P ∘ (dP − rowsum(dO ∘ O) + dLSE),  dQ = dS K·scale,  dK = dSᵀ Q·scale.

With a logit soft cap (S = c·tanh(X / c), X = Q Kᵀ·scale + bias), dS is
carried back to X by dX = dS ∘ (1 − (S / c)²) before dQ, dK and the bias.

K/V are walked in blocks with ``lax.scan``: memory is O(T · block), no S×S
matrix is built (except the bias gradient when a full bias is given, which
has the bias's own shape).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from sagejax import quant
from sagejax.masks import MaskSpec, group_heads, key_block

BLOCK_K = 128
_HIGHEST = jax.lax.Precision.HIGHEST


def _pad_keys(x: jax.Array, s_pad: int) -> jax.Array:
  return jnp.pad(x, [(0, 0), (0, 0), (0, s_pad - x.shape[2]), (0, 0)])


def attention_backward(
    q: jax.Array, k: jax.Array, v: jax.Array, bias: Optional[jax.Array],
    mask: Optional[jax.Array], q_lengths: Optional[jax.Array],
    kv_lengths: Optional[jax.Array],
    d_out: jax.Array, d_lse: Optional[jax.Array], spec: MaskSpec,
    sm_scale: float,
    saved: Optional[tuple[jax.Array, jax.Array]] = None,
    logits_soft_cap: Optional[float] = None,
) -> tuple[jax.Array, jax.Array, jax.Array, Optional[jax.Array]]:
  """Gradients of exact attention w.r.t. Q ``[B, N, T, H]``, K, V ``[B, K, S,
  H]`` and the bias (in its own broadcast shape, or None).

  ``saved``: the forward's (output ``[B, N, T, H]``, natural-log LSE ``[B, N,
  T]``) to use instead of recomputing exact ones (FlashAttention's choice:
  the quantized forward's error then enters through δ and P). dQ is then
  taken as dS·(K − k̄) + dLSE·k̄ (exact: each row of dS sums to dLSE), so
  that δ's error never multiplies a large K mean — the oracle of the kernel
  backward's saved-statistics path. Under a soft cap the rows of dX = dS ∘
  (1 − t²) do not sum to dLSE; dQ is then dX·K − λ(D − dLSE)·k̄ with λ =
  Σ_j P(1 − t²) and D = Σ_j dS (:func:`sagejax.quant.capped_dq_shift`),
  which removes δ's first-order error there (benchmarks/NOTES.md B39), k̄
  being the kernels' sampled mean (the result depends on k̄ at second
  order).
  """
  f32 = jnp.float32
  masks = (bias, mask, q_lengths, kv_lengths)
  if saved is None:
    out, lse = exact_forward(q, k, v, *masks, spec, sm_scale,
                             logits_soft_cap=logits_soft_cap)
  else:
    out, lse = saved[0].astype(f32), saved[1].astype(f32)
  delta = jnp.sum(d_out.astype(f32) * out, axis=-1)
  if d_lse is not None:
    delta = delta - d_lse.astype(f32)
  # Rows of dS sum to dLSE, not those of dX under a soft cap: no k̄ split.
  centred = saved is not None and logits_soft_cap is None
  capped_saved = saved is not None and logits_soft_cap is not None
  kbar = None
  if centred:
    kbar = quant.token_mean(k, kv_lengths)
  elif capped_saved:
    kbar = quant.sampled_mean(k, kv_lengths)
  dq, dk, dv, dbias, *sums = backward_from_stats(
      q, k, v, *masks, d_out, lse, delta, spec, sm_scale,
      k_offset=kbar if centred else None, logits_soft_cap=logits_soft_cap,
      row_sums=capped_saved)
  dl = (jnp.zeros_like(lse) if d_lse is None else
        jnp.where(jnp.isfinite(lse), d_lse.astype(f32), 0.0))
  coef = None
  if centred and d_lse is not None:
    coef = dl
  elif capped_saved:
    coef = quant.capped_dq_shift(*sums, dl)
  if coef is not None:
    b, n, t, h = q.shape
    kh = k.shape[1]
    dq = dq + (coef.reshape(b, kh, n // kh, t, 1) * kbar[:, :, None, None, :]
               ).reshape(b, n, t, h) * sm_scale
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias


def exact_forward(q, k, v, bias, mask, q_lengths, kv_lengths, spec: MaskSpec,
                  sm_scale: float, logits_soft_cap: Optional[float] = None
                  ) -> tuple[jax.Array, jax.Array]:
  """Exact FP32 output ``[B, N, T, H]`` and LSE ``[B, N, T]``, blockwise."""
  b, n, t, h = q.shape
  out, lse = _KeyBlocks(q, k, v, bias, mask, q_lengths, kv_lengths, spec,
                        sm_scale, logits_soft_cap).exact_forward()
  return out.reshape(b, n, t, h), lse.reshape(b, n, t)


def backward_from_stats(
    q, k, v, bias, mask, q_lengths, kv_lengths, d_out: jax.Array,
    lse: jax.Array, delta: jax.Array, spec: MaskSpec, sm_scale: float,
    k_offset: Optional[jax.Array] = None,
    logits_soft_cap: Optional[float] = None,
    row_sums: bool = False,
) -> tuple[jax.Array, ...]:
  """f32 (dQ, dK, dV, dbias) given the LSE ``[B, N, T]`` and ``delta =
  rowsum(dO ∘ O) − dLSE`` ``[B, N, T]`` of the whole attention.

  Linear in the keys: the gradients of attention over several key sets (ring
  attention's shards) are the sums of these calls with the global statistics.
  ``k_offset`` (f32 ``[B, K, H]``): dQ is taken as dS·(K − k_offset).
  ``row_sums``: also λ = Σ_j P·slope and D = Σ_j P(dP − δ), f32 ``[B, N,
  T]`` (slope = 1 − t² of the soft cap, else 1;
  :func:`sagejax.quant.capped_dq_shift`).
  """
  b, n, t, h = q.shape
  kh, s = k.shape[1], k.shape[2]
  g = n // kh
  f32 = jnp.float32
  blocks = _KeyBlocks(q, k, v, bias, mask, q_lengths, kv_lengths, spec,
                      sm_scale, logits_soft_cap)
  qf, bk, s_pad, gbias = blocks.qf, blocks.bk, blocks.s_pad, blocks.gbias
  do = d_out.astype(f32).reshape(b, kh, g, t, h)
  delta = delta.reshape(b, kh, g, t)
  lse = lse.reshape(b, kh, g, t)
  lse_use = jnp.where(jnp.isfinite(lse), lse, 0.0)
  k_off = 0.0 if k_offset is None else k_offset[:, :, None, :]

  def block(carry, j):
    dq, lam, d_sum = carry
    start = j * bk
    kb, vb, logits, ok = blocks.logits(start)
    p = jnp.where(ok, jnp.exp(logits - lse_use[..., None]), 0.0)
    dv = jnp.einsum("bkgts,bkgth->bksh", p, do, precision=_HIGHEST)
    dp = jnp.einsum("bkgth,bksh->bkgts", do, vb, precision=_HIGHEST)
    ds = p * (dp - delta[..., None])
    slope = None
    if logits_soft_cap is not None:  # through S = c·tanh(X / c)
      slope = 1.0 - jnp.square(logits * (1.0 / logits_soft_cap))
    if row_sums:
      d_sum = d_sum + jnp.sum(ds, axis=-1)
      lam = lam + jnp.sum(p if slope is None else p * slope, axis=-1)
    if slope is not None:
      ds = ds * slope
    dq = dq + jnp.einsum("bkgts,bksh->bkgth", ds, kb - k_off,
                         precision=_HIGHEST) * sm_scale
    dk = jnp.einsum("bkgts,bkgth->bksh", ds, qf, precision=_HIGHEST) * sm_scale
    dbias = None
    if gbias is not None:
      dbias = _reduce_to(ds, gbias.shape[:-1] + (bk if gbias.shape[-1] > 1
                                                 else 1,))
    return (dq, lam, d_sum), (dk, dv, dbias)

  rows = jnp.zeros((b, kh, g, t), f32)
  (dq, lam, d_sum), (dk, dv, dbias) = jax.lax.scan(
      block, (jnp.zeros_like(qf), rows, rows), jnp.arange(s_pad // bk))
  # [nblocks, B, K, bk, H] -> [B, K, S, H]
  def keys_back(x):
    return jnp.moveaxis(x, 0, 2).reshape(b, kh, s_pad, h)[:, :, :s]
  dk, dv = keys_back(dk), keys_back(dv)
  if dbias is not None:
    dbias = _bias_back(dbias, bias.shape)
  grads = (dq.reshape(b, n, t, h), dk, dv, dbias)
  if row_sums:
    grads += (lam.reshape(b, n, t), d_sum.reshape(b, n, t))
  return grads


class _KeyBlocks:
  """FP32 logits of Q against one block of keys at a time, masks applied."""

  def __init__(self, q, k, v, bias, mask, q_lengths, kv_lengths, spec,
               sm_scale, soft_cap=None):
    b, n, t, h = q.shape
    kh, s = k.shape[1], k.shape[2]
    self.shape = (b, kh, n // kh, t, h)
    self.bk = min(BLOCK_K, max(16, 1 << (s - 1).bit_length()))
    self.s_pad = -(-s // self.bk) * self.bk
    self.qf = q.astype(jnp.float32).reshape(self.shape)
    self.kf = _pad_keys(k.astype(jnp.float32), self.s_pad)
    self.vf = _pad_keys(v.astype(jnp.float32), self.s_pad)
    self.gmask = group_heads(mask, kh, t, self.s_pad, False)
    self.gbias = group_heads(bias, kh, t, self.s_pad, 0.0)
    self.q_lengths, self.kv_lengths = q_lengths, kv_lengths
    self.spec, self.sm_scale, self.soft_cap = spec, sm_scale, soft_cap

  def logits(self, start):
    """(K block, V block, logits ``[B, K, G, T, bk]``, visible) at ``start``;
    the logits soft-capped when a cap is set."""
    bk = self.bk
    kb = jax.lax.dynamic_slice_in_dim(self.kf, start, bk, 2)
    vb = jax.lax.dynamic_slice_in_dim(self.vf, start, bk, 2)
    logits = jnp.einsum("bkgth,bksh->bkgts", self.qf, kb,
                        precision=_HIGHEST) * self.sm_scale
    if self.gbias is not None:
      logits = logits + key_block(self.gbias, start, bk).astype(jnp.float32)
    if self.soft_cap is not None:
      logits = self.soft_cap * jnp.tanh(logits * (1.0 / self.soft_cap))
    ok = self.spec.visible(jnp.arange(self.shape[3]), start + jnp.arange(bk),
                           self.q_lengths, self.kv_lengths)[:, :, None]
    if self.gmask is not None:
      ok = ok & key_block(self.gmask, start, bk)
    return kb, vb, logits, ok

  def exact_forward(self) -> tuple[jax.Array, jax.Array]:
    """Exact FP32 output ``[B, K, G, T, H]`` and LSE ``[B, K, G, T]``."""
    def block(carry, j):
      m, l, acc = carry
      _, vb, logits, ok = self.logits(j * self.bk)
      logits = jnp.where(ok, logits, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
      m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p = jnp.exp(logits - m_use[..., None])
      alpha = jnp.exp(m - m_use)
      acc = acc * alpha[..., None] + jnp.einsum(
          "bkgts,bksh->bkgth", p, vb, precision=_HIGHEST)
      return (m_new, l * alpha + jnp.sum(p, axis=-1), acc), None

    init = (jnp.full(self.shape[:-1], -jnp.inf, jnp.float32),
            jnp.zeros(self.shape[:-1], jnp.float32),
            jnp.zeros(self.shape, jnp.float32))
    (m, l, acc), _ = jax.lax.scan(block, init,
                                  jnp.arange(self.s_pad // self.bk))
    out = acc * jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)[..., None]
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return out, lse


def _reduce_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Sums ``x`` over the axes where ``shape`` has 1 (broadcast axes)."""
  axes = tuple(a for a, (got, want) in enumerate(zip(x.shape, shape))
               if want == 1 and got != 1)
  return jnp.sum(x, axis=axes, keepdims=True)


def _bias_back(dbias: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Scan-stacked ``[nb, B|1, K|1, G|1, T|1, bk|1]`` → the bias's shape."""
  nb, bb, kk, gg, tt, kb = dbias.shape
  if kb == 1:
    dbias = jnp.sum(dbias, axis=0)
  else:
    dbias = jnp.moveaxis(dbias, 0, -2).reshape(bb, kk, gg, tt, nb * kb)
    dbias = dbias[..., : shape[-1]]
  return dbias.reshape(shape)

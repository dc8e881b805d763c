"""Exact attention in FP32: the oracle every implementation is measured against."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from sagejax import _inputs
from sagejax.masks import CausalAlignment


def exact_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: Optional[jax.Array] = None,
    mask: Optional[jax.Array] = None,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    causal_alignment: CausalAlignment = "top_left",
    query_seq_lengths: Optional[jax.Array] = None,
    key_value_seq_lengths: Optional[jax.Array] = None,
    local_window_size: int | tuple[int, int] | None = None,
    layout: str = "BTNH",
    return_lse: bool = False,
    logits_soft_cap: Optional[float] = None,
):
  """Softmax attention computed in FP32 with the full score matrix.

  Takes the arguments of :func:`sagejax.attention` (same masks, alignments,
  layouts and soft cap: ``x = scale·q·kᵀ + bias``, then ``cap·tanh(x / cap)``,
  then the masks). Rows that see no key give zeros (and LSE −inf). Memory is
  O(T·S): use it as a reference on moderate sizes.

  Returns:
    f32 output in the input layout (``[B, T, N, H]`` for ``"BTNH"``), and with
    ``return_lse`` also the natural-log LSE, f32 ``[B, N, T]``.
  """
  call = _inputs.parse(query, key, value, bias, mask, scale=scale,
                       is_causal=is_causal, causal_alignment=causal_alignment,
                       query_seq_lengths=query_seq_lengths,
                       key_value_seq_lengths=key_value_seq_lengths,
                       local_window_size=local_window_size, layout=layout,
                       logits_soft_cap=logits_soft_cap)
  q, k, v = (x.astype(jnp.float32) for x in call.canonical())
  b, n, t, h = q.shape
  kh, s = k.shape[1], k.shape[2]
  g = n // kh
  logits = jnp.einsum("bkgth,bksh->bkgts", q.reshape(b, kh, g, t, h), k,
                      precision=jax.lax.Precision.HIGHEST)
  logits = logits.reshape(b, n, t, s) * call.sm_scale
  if call.bias is not None:
    logits = logits + call.bias.astype(jnp.float32)
  if call.logits_soft_cap is not None:
    cap = call.logits_soft_cap
    logits = cap * jnp.tanh(logits / cap)
  visible = call.spec.visible(jnp.arange(t), jnp.arange(s), call.q_lengths,
                              call.kv_lengths)
  if call.mask is not None:
    visible = visible & call.mask
  logits = jnp.where(visible, logits, -jnp.inf)
  lse = jax.nn.logsumexp(logits, axis=-1)
  probs = jnp.where(visible, jnp.exp(logits - jnp.where(
      jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
  out = jnp.einsum("bkgts,bksh->bkgth", probs.reshape(b, kh, g, t, s), v,
                   precision=jax.lax.Precision.HIGHEST).reshape(b, n, t, h)
  out = call.unbatch(_inputs.from_canonical(out, call.layout))
  return (out, call.unbatch(lse)) if return_lse else out

"""Which (query, key) pairs may attend: causal, windows, padding, user masks.

Positions are absolute token indices. The *diagonal* of a causal mask or a
local window is where key ``j == i + offset`` for query ``i``:

* ``"top_left"`` (``jax.nn.dot_product_attention``'s ``is_causal``): offset 0.
  Query 0 sees key 0 only, whatever the lengths.
* ``"bottom_right"``: offset = kv_length − q_length, so the *last* query sees
  every key. This is the alignment of KV-cache decoding and chunked prefill,
  where the queries are the newest tokens of a longer sequence.

With ``query_seq_lengths`` / ``key_value_seq_lengths`` the offset uses each
batch element's own lengths.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import jax
import jax.numpy as jnp

CausalAlignment = Literal["top_left", "bottom_right"]
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of an attention mask (hashable; safe as a jit static).

  Attributes:
    is_causal: key ``j`` visible to query ``i`` only if ``j <= i + offset``.
    causal_alignment: where the diagonal sits, see the module docstring.
    window: ``(left, right)``: only keys with ``i + offset - left <= j <= i +
      offset + right`` are visible; None for no window.
    q_len: T, the (unpadded) number of queries.
    kv_len: S, the (unpadded) number of keys.
  """

  is_causal: bool
  causal_alignment: CausalAlignment
  window: Optional[tuple[int, int]]
  q_len: int
  kv_len: int

  def visible(self, q_pos: jax.Array, k_pos: jax.Array,
              q_lengths: Optional[jax.Array] = None,
              kv_lengths: Optional[jax.Array] = None) -> jax.Array:
    """bool ``[B|1, 1, Tq, Sk]``: may query ``q_pos[t]`` see key ``k_pos[s]``.

    Includes padding: queries at or past their length and keys at or past
    theirs (or past ``q_len`` / ``kv_len``) see nothing / are never seen.
    """
    kv_limit = (jnp.int32(self.kv_len) if kv_lengths is None
                else kv_lengths[:, None, None, None])
    q_limit = (jnp.int32(self.q_len) if q_lengths is None
               else q_lengths[:, None, None, None])
    return self.visible_at(q_pos[None, None, :, None],
                           k_pos[None, None, None, :], q_limit, kv_limit)

  def _diagonal(self, i: jax.Array, q_limit, kv_limit) -> jax.Array:
    """The key on query ``i``'s diagonal (see the module docstring)."""
    return i + self._diagonal_offset(q_limit, kv_limit)

  def _diagonal_offset(self, q_limit, kv_limit):
    """Key minus query along the diagonal: 0 top-left, S − T bottom-right."""
    bottom_right = self.causal_alignment == "bottom_right"
    return kv_limit - q_limit if bottom_right else 0

  def visible_at(self, i: jax.Array, j: jax.Array, q_limit, kv_limit
                 ) -> jax.Array:
    """The rule itself, on broadcastable query and key positions ``i``, ``j``
    and valid lengths ``q_limit``, ``kv_limit`` (what kernels call on their
    tile with scalar lengths)."""
    ok = (j < kv_limit) & (i < q_limit)
    if self.is_causal or self.window is not None:
      diag = self._diagonal(i, q_limit, kv_limit)
      if self.is_causal:
        ok = ok & (j <= diag)
      if self.window is not None:
        left, right = self.window
        ok = ok & (j >= diag - left) & (j <= diag + right)
    return ok

  def visible_keys(self, i: jax.Array, q_limit, kv_limit
                   ) -> tuple[jax.Array, jax.Array]:
    """:meth:`visible_at` as an interval per query: ``(first, last)``, the
    first and last key query ``i`` sees (``last < first``: none; ``first``
    0 without a window). Key ``j`` is visible iff ``first <= j <= last``."""
    first = jnp.zeros_like(i)
    last = jnp.broadcast_to(kv_limit - 1, i.shape).astype(i.dtype)
    if self.is_causal or self.window is not None:
      diag = self._diagonal(i, q_limit, kv_limit)
      if self.is_causal:
        last = jnp.minimum(last, diag)
      if self.window is not None:
        left, right = self.window
        first = jnp.maximum(first, diag - left)
        last = jnp.minimum(last, diag + right)
    return first, jnp.where(i < q_limit, last, -1)

  def visible_queries(self, j: jax.Array, q_limit, kv_limit
                      ) -> tuple[jax.Array, jax.Array]:
    """:meth:`visible_at` as an interval per key: ``(first, last)``, the
    first and last query that sees key ``j`` (``last < first``: none)."""
    first = jnp.zeros_like(j)
    last = jnp.broadcast_to(q_limit - 1, j.shape).astype(j.dtype)
    if self.is_causal or self.window is not None:
      d = j - self._diagonal_offset(q_limit, kv_limit)  # j's query
      if self.is_causal:
        first = jnp.maximum(first, d)
      if self.window is not None:
        left, right = self.window
        first = jnp.maximum(first, d - right)
        last = jnp.minimum(last, d + left)
    return first, jnp.where(j < kv_limit, last, -1)


def group_heads(x: Optional[jax.Array], kv_heads: int, t_pad: int, s_pad: int,
                fill) -> Optional[jax.Array]:
  """A user mask or bias ``[B|1, N|1, T|1, S|1]`` for blockwise GQA loops.

  Returns ``[B|1, K|1, G|1, T_pad|1, S_pad|1]``: the head axis split into
  (kv head, group), full T and S axes padded with ``fill`` to the padded
  lengths. Broadcast (size-1) axes stay size 1, so nothing is materialised.
  """
  if x is None:
    return None
  b, n, t, s = x.shape
  if n == 1:
    x = x.reshape(b, 1, 1, t, s)
  else:
    x = x.reshape(b, kv_heads, n // kv_heads, t, s)
  pads = [(0, 0)] * 3 + [(0, t_pad - t if t > 1 else 0),
                         (0, s_pad - s if s > 1 else 0)]
  if any(p for _, p in pads):
    x = jnp.pad(x, pads, constant_values=fill)
  return x


def key_block(x: Optional[jax.Array], start, size: int
              ) -> Optional[jax.Array]:
  """Keys ``[start, start + size)`` of a grouped mask/bias (see group_heads)."""
  if x is None or x.shape[-1] == 1:
    return x
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim - 1)

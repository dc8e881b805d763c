"""The ``"xla"`` implementation of paged attention: the kernels' reference.

It gathers each sequence's pages into contiguous tokens and computes, in
plain ``jax.numpy``, the arithmetic the Pallas kernel computes blockwise
(:mod:`sagejax.serving.triton_paged`):

* Queries (rows = token × head) are quantized to INT8 per row (``sm_scale ·
  log2(e)`` folded into the scale) when K is INT8; base-2 logits are
  ``(q_int8 · k_int8)·k_scale·q_scale``. With a plain cache the logits are
  ``q·k`` in the cache dtype, accumulated in f32.
* Logit soft-cap ``c·tanh(s / c)`` on the natural-log logits (with the K
  smoothing's row shift ``sm_scale·q·k̄`` added back first: tanh is not shift
  invariant); causal bottom-right with an optional window (the rule of
  :class:`sagejax.masks.MaskSpec`).
* P·V with per-token V scales: for each block of ``block_k`` keys (aligned to
  token 0), ``c = max`` of the block's V scales; ``P' = p̃ · v_scale / c ∈
  [0, 1]`` is rounded to the P·V operand type (FP8 e4m3 with the static 448,
  FP16 or BF16) and multiplied with the FP8 V values; the block's product is
  scaled by ``c``. ``v_smooth`` is added to rows that see any key.

The kernel differs only in its running (online) max, which changes where P'
is rounded, and in the order of f32 sums.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from sagejax import quant
from sagejax.kernels._common import round_half_even
from sagejax.masks import MaskSpec
from sagejax.serving.cache import PagedKVCache



@dataclasses.dataclass(frozen=True)
class PagedMath:
  """The static description of a paged attention call (hashable).

  Attributes:
    sm_scale: logit scale.
    window: keys ``[p − window, p]`` are visible to the query at position p;
      None: all keys up to p.
    soft_cap: logits ``c·tanh(s / c)`` (natural-log units), or None.
    pv_dtype: P·V operand type with a quantized cache (``"fp8_e4m3"``,
      ``"fp16"``, ``"bf16"``).
    block_k: keys per block of the P·V normalization (the kernel's block).
  """

  sm_scale: float
  window: Optional[int] = None
  soft_cap: Optional[float] = None
  pv_dtype: str = "fp16"
  block_k: int = 64

  @property
  def mask(self) -> MaskSpec:
    window = None if self.window is None else (self.window, 0)
    return MaskSpec(is_causal=True, causal_alignment="bottom_right",
                    window=window, q_len=0, kv_len=0)


def quantize_query(q: jax.Array, sm_scale: float, interpret: bool = True
                   ) -> tuple[jax.Array, jax.Array]:
  """Rows ``[..., H]`` → (int8, f32 scale ``[...]`` × sm_scale·log2(e)).

  :func:`sagejax.quant.quantize_int` per row, written with kernel-lowerable
  ops (the kernel calls it too; ``interpret=False`` rounds with PTX). A row
  with a NaN/Inf gets scale NaN, so its attention is NaN.
  """
  q = q.astype(jnp.float32)
  amax = jnp.max(jnp.abs(q), axis=-1)
  scale = quant.scale_from_amax(amax, 127.0)
  values = jnp.clip(round_half_even(q / scale[..., None], interpret), -127.0,
                    127.0).astype(jnp.int8)
  scale = jnp.where(jnp.isfinite(amax), scale, jnp.nan)
  return values, scale * (sm_scale * quant.LOG2E)


def soft_cap_logits(s2: jax.Array, shift: Optional[jax.Array], cap: float
                    ) -> jax.Array:
  """Base-2 logits ``s2`` capped as ``cap·tanh(s / cap)`` in natural units
  (``shift``: what K smoothing took out of the row, natural units)."""
  s = s2 * quant.LN2
  if shift is not None:
    s = s + shift
  return cap * jnp.tanh(s / cap) * quant.LOG2E


def round_pv(p: jax.Array, pv_dtype: str) -> jax.Array:
  """P' ∈ [0, 1] rounded to the P·V operand (FP8 as 448·P'), as f32."""
  if pv_dtype == "fp8_e4m3":
    return quant.quantize_p_fp8(p).astype(jnp.float32)
  return p.astype(quant.PV_OPERAND_DTYPES[pv_dtype]).astype(jnp.float32)


def bad_sequences(page_table: jax.Array, kv_len: jax.Array, q_len: jax.Array,
                  q_cap: jax.Array, num_pages: int, page_size: int
                  ) -> jax.Array:
  """bool ``[B]``: lengths out of range, or a page outside the pool among the
  pages holding the first ``kv_len`` tokens. Such sequences give NaN."""
  max_pages = page_table.shape[1]
  used = jnp.arange(max_pages)[None, :] * page_size < kv_len[:, None]
  outside = (page_table < 0) | (page_table >= num_pages)
  return ((kv_len < 0) | (kv_len > max_pages * page_size) | (q_len < 0)
          | (q_len > kv_len) | (q_len > q_cap)
          | jnp.any(used & outside, axis=1))


def paged_attention(q: jax.Array, q_len: jax.Array, cache: PagedKVCache,
                    page_table: jax.Array, kv_len: jax.Array,
                    math: PagedMath) -> jax.Array:
  """Attention of the last ``q_len[b]`` of ``kv_len[b]`` tokens.

  Args:
    q: ``[B, T, N, H]``; rows ``t >= q_len[b]`` are padding.
    q_len, kv_len: int32 ``[B]``.
    cache, page_table: the cache and int32 ``[B, max_pages]``.
    math: the static description.

  Returns:
    f32 ``[B, T, N, H]``: zeros on padding rows, NaN for every row of a
    sequence :func:`bad_sequences` flags.
  """
  b, t, n, h = q.shape
  kh = cache.num_kv_heads
  g = n // kh
  ps = cache.page_size
  max_pages = page_table.shape[1]
  s = max_pages * ps
  bad = bad_sequences(page_table, kv_len, q_len, jnp.full_like(q_len, t),
                      cache.num_pages, ps)
  kv_len = jnp.where(bad, 0, kv_len)
  q_len = jnp.where(bad, 0, q_len)
  pages = jnp.clip(page_table, 0, cache.num_pages - 1)
  k = cache.gather("k_pages", pages)                       # [B, S, K, H]
  v = cache.gather("v_pages", pages)
  qg = q.reshape(b, t, kh, g, h)
  key_ok = jnp.arange(s)[None, :] < kv_len[:, None]        # [B, S]

  if cache.quantized:
    q8, qs = quantize_query(qg, math.sm_scale)             # [B, T, K, G]
    s_int = jnp.einsum("btkgh,bskh->bkgts", q8.astype(jnp.int32),
                       k.astype(jnp.int32))
    ks = cache.gather("k_scales", pages)                   # [B, S, K]
    t_ = s_int.astype(jnp.float32) * jnp.moveaxis(ks, 1, 2)[:, :, None, None]
    s2 = t_ * jnp.transpose(qs, (0, 2, 3, 1))[..., None]
  else:
    s2 = jnp.einsum("btkgh,bskh->bkgts", qg.astype(k.dtype), k,
                    preferred_element_type=jnp.float32) * (
                        math.sm_scale * quant.LOG2E)
  if math.soft_cap is not None:
    shift = None
    if cache.k_smooth is not None:
      shift = jnp.einsum("btkgh,kh->bkgt", qg.astype(jnp.float32),
                         cache.k_smooth,
                         precision=jax.lax.Precision.HIGHEST) * math.sm_scale
      shift = shift[..., None]
    s2 = soft_cap_logits(s2, shift, math.soft_cap)
  rows = jnp.arange(t)[:, None]
  cols = jnp.arange(s)[None, :]
  visible = math.mask.visible_at(rows, cols, q_len[:, None, None, None, None],
                                 kv_len[:, None, None, None, None])
  s2 = jnp.where(visible, s2, -jnp.inf)
  m = jnp.max(s2, axis=-1, keepdims=True)
  p = jnp.exp2(s2 - jnp.where(jnp.isfinite(m), m, 0.0))     # 0 where masked
  l = jnp.sum(p, axis=-1)

  if cache.quantized:
    vs = jnp.where(key_ok[..., None], cache.gather("v_scales", pages), 0.0)
    bk = math.block_k
    padded = jnp.pad(vs, ((0, 0), (0, -s % bk), (0, 0)))
    c = jnp.max(padded.reshape(b, -1, bk, kh), axis=2)      # [B, S/bk, K]
    c = jnp.repeat(jnp.where(c > 0, c, 1.0), bk, axis=1)[:, :s]   # [B, S, K]
    c = jnp.moveaxis(c, 1, 2)[:, :, None, None]              # [B, K, 1, 1, S]
    pv = round_pv(p * jnp.moveaxis(vs, 1, 2)[:, :, None, None] / c,
                  math.pv_dtype)
    v = jnp.where(key_ok[..., None, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("bkgts,bskh->btkgh", pv * c, v,
                     precision=jax.lax.Precision.HIGHEST)
    if math.pv_dtype == "fp8_e4m3":
      out = out / quant.P_SCALE
  else:
    v = jnp.where(key_ok[..., None, None], v, jnp.zeros((), v.dtype))
    out = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
  l = jnp.transpose(l, (0, 3, 1, 2))[..., None]            # [B, T, K, G, 1]
  seen = ~(l <= 0)                        # a NaN row sum counts: NaN output
  out = jnp.where(seen, out / jnp.where(seen, l, 1.0), 0.0)
  if cache.v_smooth is not None:
    out = jnp.where(seen, out + cache.v_smooth[:, None, :], 0.0)
  out = out.reshape(b, t, n, h)
  return jnp.where(bad[:, None, None, None], jnp.nan, out)

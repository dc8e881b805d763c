"""Small helpers shared by the Pallas kernels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from sagejax.masks import MaskSpec

# Entries a Mosaic kernel step's grouped K scales take (mosaic_attention.
# group_key_scales; the K pass may write them): a TMA copy moves a multiple
# of 128 bytes.
GROUP_SCALES_PER_STEP = 32
# The last of them holds 1.0, which the kernel multiplies into its
# accumulator's α (``MosaicTiling.alpha_hint``); at most 16 are scales.
GROUP_SCALES_ONE = GROUP_SCALES_PER_STEP - 1


def round_half_even(x: jax.Array, interpret: bool) -> jax.Array:
  """Rounds FP32 to the nearest integer, ties to even (as ``jnp.round``).

  Pallas's Triton lowering has no ``round``: on the GPU this is PTX
  ``cvt.rni``; the interpreter uses ``jnp.round``.
  """
  if interpret:
    return jnp.round(x)
  [y] = plgpu.elementwise_inline_asm(
      "cvt.rni.f32.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return y


def next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def layout_dims(q, k, layout: str) -> tuple[int, int, int, int, int, int]:
  """``(B, N, T, H, K, S)`` of Q ``[B, T, N, H]`` and K ``[B, S, K, H]``
  (``"BTNH"``) or Q ``[B, N, T, H]`` and K ``[B, K, S, H]`` (``"BNTH"``)."""
  if layout == "BTNH":
    (b, t, n, h), (s, kh) = q.shape, k.shape[1:3]
  else:
    (b, n, t, h), (kh, s) = q.shape, k.shape[1:3]
  return b, n, t, h, kh, s


def kv_block_range(spec: MaskSpec, q_first, q_last, q_len, kv_len,
                   block_kv: int, num_kv_blocks: int):
  """KV blocks that rows ``[q_first, q_last]`` may see, and those all see.

  Returns ``(lo, full_lo, full_hi, hi)``: blocks ``[lo, hi)`` are visited;
  ``[full_lo, full_hi)`` are visible to every row (no mask needed), the rest
  straddle the causal diagonal, the window's edges or ``kv_len``.
  """
  offset = kv_len - q_len if spec.causal_alignment == "bottom_right" else 0
  lo, hi = jnp.int32(0), kv_len
  full_lo, full_hi = jnp.int32(0), kv_len
  if spec.is_causal:
    hi = jnp.minimum(hi, q_last + offset + 1)
    full_hi = jnp.minimum(full_hi, q_first + offset + 1)
  if spec.window is not None:
    left, right = spec.window
    hi = jnp.minimum(hi, q_last + offset + right + 1)
    full_hi = jnp.minimum(full_hi, q_first + offset + right + 1)
    lo = jnp.maximum(lo, q_first + offset - left)
    full_lo = jnp.maximum(full_lo, q_last + offset - left)
  return _block_range(lo, full_lo, full_hi, hi, q_first < q_len, block_kv,
                      num_kv_blocks)


def q_block_range(spec: MaskSpec, k_first, k_last, q_len, kv_len,
                  block_q: int, num_q_blocks: int):
  """Query blocks that see some of keys ``[k_first, k_last]``, and those
  whose every row sees all of them (the transpose of :func:`kv_block_range`,
  for backward kernels that own a KV block).

  Returns ``(lo, full_lo, full_hi, hi)`` in query blocks, as
  :func:`kv_block_range` does in KV blocks.
  """
  offset = kv_len - q_len if spec.causal_alignment == "bottom_right" else 0
  lo, hi = jnp.int32(0), q_len
  full_lo, full_hi = jnp.int32(0), q_len
  if spec.is_causal:  # key j is seen by rows i >= j - offset
    lo = jnp.maximum(lo, k_first - offset)
    full_lo = jnp.maximum(full_lo, k_last - offset)
  if spec.window is not None:  # i - left <= j - offset <= i + right
    left, right = spec.window
    lo = jnp.maximum(lo, k_first - offset - right)
    full_lo = jnp.maximum(full_lo, k_last - offset - right)
    hi = jnp.minimum(hi, k_last - offset + left + 1)
    full_hi = jnp.minimum(full_hi, k_first - offset + left + 1)
  return _block_range(lo, full_lo, full_hi, hi, k_first < kv_len, block_q,
                      num_q_blocks)


def _masked_only(ranges, partial):
  """No unmasked block when ``partial``: the tile straddles a length (its
  padding rows or keys must be masked) or a mask/bias array applies."""
  lo, full_lo, full_hi, hi = ranges
  full_hi = jnp.where(partial, lo, full_hi)
  return lo, jnp.minimum(full_lo, full_hi), full_hi, hi


def key_blocks(spec: MaskSpec, q_first, rows: int, q_len, kv_len,
               block_k: int, num_blocks: int, all_masked: bool):
  """Key blocks seen by query rows [q_first, q_first + rows)."""
  q_last = jnp.minimum(q_first + rows, q_len) - 1
  return _masked_only(
      kv_block_range(spec, q_first, q_last, q_len, kv_len, block_k,
                     num_blocks), (q_first + rows > q_len) | all_masked)


def query_blocks(spec: MaskSpec, k_first, cols: int, q_len, kv_len,
                 block_q: int, num_blocks: int, all_masked: bool):
  """Query blocks that see keys [k_first, k_first + cols)."""
  k_last = jnp.minimum(k_first + cols, kv_len) - 1
  return _masked_only(
      q_block_range(spec, k_first, k_last, q_len, kv_len, block_q,
                    num_blocks), (k_first + cols > kv_len) | all_masked)


def _block_range(lo, full_lo, full_hi, hi, any_seen, block: int,
                 num_blocks: int):
  """Index ranges [lo, hi) (seen by some row) and [full_lo, full_hi) (by all)
  → block ranges ``(lo, full_lo, full_hi, hi)``."""
  bk = jnp.int32(block)
  hi_b = jnp.clip(lax.div(jnp.maximum(hi, 0) + bk - 1, bk), 0, num_blocks)
  hi_b = jnp.where(any_seen, hi_b, 0)
  lo_b = jnp.clip(lax.div(jnp.maximum(lo, 0), bk), 0, hi_b)
  full_hi_b = jnp.clip(lax.div(jnp.maximum(full_hi, 0), bk), lo_b, hi_b)
  full_lo_b = jnp.clip(lax.div(jnp.maximum(full_lo, 0) + bk - 1, bk), lo_b,
                       full_hi_b)
  return lo_b, full_lo_b, full_hi_b, hi_b


def visit_blocks(blocks, body, carry, unmasked_first: bool = False):
  """``body(j, carry, masked)`` over the masked head ``[lo, full_lo)``, the
  unmasked middle ``[full_lo, full_hi)`` and the masked tail ``[full_hi,
  hi)`` of ``blocks`` (as :func:`kv_block_range` returns).

  With ``unmasked_first``: the middle first, then head and tail in one
  masked loop (one copy of the masked code, in the order of
  :func:`visit_block`).
  """
  lo, full_lo, full_hi, hi = blocks
  masked = functools.partial(body, masked=True)
  if unmasked_first:
    carry = lax.fori_loop(full_lo, full_hi,
                          functools.partial(body, masked=False), carry)
    return lax.fori_loop(
        full_hi - full_lo, hi - lo,
        lambda t, c: masked(visit_block(blocks, t, True), c), carry)
  carry = lax.fori_loop(lo, full_lo, masked, carry)
  carry = lax.fori_loop(full_lo, full_hi,
                        functools.partial(body, masked=False), carry)
  return lax.fori_loop(full_hi, hi, masked, carry)


def visit_block(blocks, t, unmasked_first: bool = False):
  """The block :func:`visit_blocks` visits ``t``-th (from 0): for a
  producer that must load blocks in the consumers' order."""
  lo, full_lo, full_hi, _ = blocks
  if not unmasked_first:
    return lo + t
  n_full, head = full_hi - full_lo, full_lo - lo
  return jnp.where(t < n_full, full_lo + t,
                   jnp.where(t < n_full + head, lo + t - n_full,
                             full_hi + t - n_full - head))


def visit_position(blocks, j, unmasked_first: bool = False):
  """Where block ``j`` comes in :func:`visit_blocks`'s order (from 0); the
  inverse of :func:`visit_block`."""
  lo, full_lo, full_hi, _ = blocks
  if not unmasked_first:
    return j - lo
  return jnp.where(j < full_lo, full_hi - full_lo + j - lo,
                   jnp.where(j < full_hi, j - full_lo, j - lo))

"""``decode_attention`` and ``extend_attention`` over a :class:`PagedKVCache`.

Both attend the newest tokens of each sequence (already appended with
:func:`sagejax.serving.append`) to all of the sequence's cached tokens,
causal with the diagonal at the bottom right (token ``i`` of a sequence sees
its tokens ``j <= i``), with GQA, an optional sliding window and logit
soft-cap. ``implementation="pallas"`` runs :mod:`sagejax.serving.triton_paged`
(NVIDIA sm80+), ``"mosaic"`` :mod:`sagejax.serving.mosaic_paged` (Hopper:
decode on pages of 32-128 tokens, extend on a quantized cache), ``"xla"``
:mod:`sagejax.serving.reference` (anywhere); None picks the Mosaic decode on
Hopper where it serves the call and the Mosaic extend for chunks of at least
:data:`MOSAIC_MIN_QUERY_TOKENS` tokens, else the Triton kernel, else
``"xla"``.
"""

from __future__ import annotations

import dataclasses
import functools
import math as _math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sagejax.backends._device import is_hopper, sm_count
from sagejax.config import ConfigLike, SageConfig, resolve_config
from sagejax.kernels import mosaic_decode
from sagejax.kernels.mosaic_attention import MosaicTiling
from sagejax.kernels.mosaic_decode import DecodeTiling
from sagejax.serving import mosaic_paged, reference, triton_paged
from sagejax.serving.cache import (
    PagedKVCache,
    _is_concrete,
    check_pages,
    token_counts,
)
from sagejax.serving.mosaic_paged import MOSAIC_EXTEND_CONFIG
from sagejax.serving.reference import PagedMath
from sagejax.serving.triton_paged import PagedTiling

IMPLEMENTATIONS = ("mosaic", "pallas", "xla")

MOSAIC_MIN_QUERY_TOKENS = 256
"""Extend chunks of at least this many query tokens per sequence (the padded
``T``; packed: the rows over the sequences, at most ``max_q_len``) take the
Mosaic kernel on Hopper. It owns 128 query rows of one head per CTA and
gathers the pages first; measured on an H100 (B=8, 8k cached tokens, GQA
32/8, H=128): Triton 372 / 663 / 1245 µs for chunks of 64 / 128 / 256
tokens, Mosaic 712 / 842 / 1083 µs (benchmarks/NOTES.md)."""

SERVING_CONFIG = SageConfig(qk_granularity="per_token", pv_dtype="fp16")
"""The default of decode and of the Triton extend: INT8 Q·Kᵀ (Q per row, K
per token), FP16 P·V with the FP8 V values (exact in FP16); FP8 P
(``pv_dtype="fp8_e4m3"``, on FP8 tensor cores against the transposed V
pages) is no faster there (H100 decode 1-3% slower, extend a third slower) and
adds P's rounding."""




@functools.cache
def _target_programs() -> int:
  """Programs the automatic split count aims at: four per SM (H100/H200: 132
  SMs; the device's own count when it reports one). Measured on an H100
  (B=8 × 32k decode): 8-16 splits ran in 0.81x the time of 5."""
  return 4 * sm_count()


def default_tiling(page_size: int, groups: int, decode: bool,
                   quantized: bool = True, head_dim: int = 128
                   ) -> PagedTiling:
  """Decode: one query token per program (rows: the GQA group padded to 16),
  keys split over programs; extend: about 128 rows (tokens × group heads)
  against 128 keys per step, as the dense kernel's best H=128 tile.

  Decode on sm90: 64 keys per step, 5 stages, 4 warps for 8-bit pages and
  2 for 16-bit ones (the best of grids over 32-256 keys, 1-8 warps and 2-7
  stages on an H100, GQA 32/8, H=128, B × tokens 32 × 4k, 32 × 16k,
  8 × 32k: decode is bound by the latency of its loads and by instructions
  per key, so a deep ring of small tiles wins;
  ``benchmarks/decode_tuning.py``, NOTES.md). Elsewhere the earlier
  tiles (4 warps, 3 stages for 8-bit pages, 2 for 16-bit: the 5-stage ring
  needs 160 KiB of shared memory with 16-bit pages). Extend: 16-bit pages
  need smaller tiles: the quantized pages' tiles ask 256 KiB of shared
  memory at H=128 on an H200, above the 227 KiB a block gets."""
  if decode:
    block_k = max(64, page_size)
    if is_hopper():
      # K and V tiles of one stage; at most ~200 KiB for the ring.
      stage = 2 * block_k * head_dim * (1 if quantized else 2)
      return PagedTiling(block_q=1, block_k=block_k,
                         num_warps=4 if quantized else 2,
                         num_stages=max(2, min(5, (200 << 10) // stage)))
    return PagedTiling(block_q=1, block_k=block_k, num_warps=4,
                       num_stages=3 if quantized else 2)
  gp = 1 << max(0, (groups - 1).bit_length())
  # 16-bit pages: 128-key tiles asked 256 KiB at 2 stages on an H200.
  return PagedTiling(block_q=max(1, 128 // gp),
                     block_k=max(128 if quantized else 64, page_size),
                     num_warps=8, num_stages=2)


def _resolve_config(config: ConfigLike | None, cache: PagedKVCache
                    ) -> SageConfig:
  config = SERVING_CONFIG if config is None else resolve_config(config)
  if cache.quantized and config.qk_dtype != "int8":
    raise ValueError(f"the cache stores INT8 K, so Q·Kᵀ runs in INT8; pass a "
                     f"config with qk_dtype='int8', not {config.qk_dtype!r}.")
  if config.smooth_q:
    raise ValueError("paged attention does not smooth Q (the cache's K "
                     "smoothing is built in); pass smooth_q=False.")
  return config


def _pallas_unsupported(q: jax.Array, cache: PagedKVCache,
                        math: PagedMath) -> Optional[str]:
  h = cache.head_dim
  if h < 32 or h & (h - 1):
    return f"head dim {h} is not a power of two >= 32"
  if math.sm_scale <= 0:
    return "the kernel needs a positive scale"
  return None


def _pallas_available() -> bool:
  from sagejax.backends import pallas_triton  # pylint: disable=g-import-not-at-top
  return pallas_triton.BACKEND.available()


def _mosaic_unsupported(cache, math, decode: bool, interpret: bool,
                        groups: int) -> Optional[str]:
  if interpret:
    return "Mosaic GPU kernels have no interpreter"
  if decode:
    return mosaic_paged.decode_unsupported(cache, math, groups)
  return mosaic_paged.unsupported(cache, math)


def _select(implementation: Optional[str], interpret: bool, q, cache, math,
            decode: bool, tokens: int, tiling, mosaic_math=None) -> str:
  """The implementation that runs the call (``tokens``: query tokens per
  sequence; ``mosaic_math``: the arithmetic the Mosaic kernels would run,
  default ``math``); raises when the one named cannot."""
  if implementation not in (None,) + IMPLEMENTATIONS:
    raise ValueError(f"Unknown implementation {implementation!r}: pass one of "
                     f"{IMPLEMENTATIONS} or None (pick automatically).")
  mosaic_reason = _mosaic_unsupported(
      cache, mosaic_math or math, decode, interpret,
      q.shape[-2] // cache.num_kv_heads)
  mosaic_tiling = DecodeTiling if decode else MosaicTiling
  if isinstance(tiling, (MosaicTiling, DecodeTiling)) and not isinstance(
      tiling, mosaic_tiling):
    raise ValueError(f"a {type(tiling).__name__} is for the Mosaic "
                     f"{'extend' if decode else 'decode'}; pass a "
                     f"{mosaic_tiling.__name__} (or a PagedTiling) here.")
  if implementation == "mosaic" or isinstance(tiling, mosaic_tiling):
    if implementation not in (None, "mosaic"):
      raise ValueError(f"a {mosaic_tiling.__name__} is for "
                       f"implementation='mosaic', not {implementation!r}; "
                       "pass a PagedTiling.")
    if mosaic_reason is not None:
      raise ValueError(f"implementation='mosaic' cannot serve this call: "
                       f"{mosaic_reason}. Pass implementation='pallas' or "
                       "None.")
    if not is_hopper():
      raise ValueError(f"implementation='mosaic' needs an sm90 (Hopper) GPU, "
                       f"not this {jax.default_backend()} device; pass "
                       "implementation=None.")
    return "mosaic"
  if (implementation is None and tiling is None and mosaic_reason is None
      and (decode or tokens >= MOSAIC_MIN_QUERY_TOKENS) and is_hopper()):
    return "mosaic"
  reason = _pallas_unsupported(q, cache, math)
  if implementation == "pallas":
    if reason is not None:
      raise ValueError(f"implementation='pallas' cannot serve this call: "
                       f"{reason}. Pass implementation='xla'.")
    if not interpret and not _pallas_available():
      raise ValueError(f"implementation='pallas' is not available on this "
                       f"machine ({jax.default_backend()}); pass "
                       "implementation=None or 'xla', or interpret=True.")
    return "pallas"
  if implementation is None and reason is None and (
      interpret or _pallas_available()):
    return "pallas"
  return "xla"


def _window(local_window_size) -> Optional[int]:
  if local_window_size is None:
    return None
  if isinstance(local_window_size, Sequence):
    local_window_size = local_window_size[0]
  if not isinstance(local_window_size, (int, np.integer)) or (
      local_window_size < 0):
    raise ValueError(f"local_window_size must be an int >= 0 (keys within "
                     f"that many positions before the query), got "
                     f"{local_window_size!r}.")
  return int(local_window_size)


def _check(q, cache: PagedKVCache, page_table, lengths, q_lengths,
           cu_seqlens, t_cap: int) -> None:
  """Shape checks always; value checks on concrete inputs."""
  if not isinstance(cache, PagedKVCache):
    raise TypeError(f"cache must be a PagedKVCache, got "
                    f"{type(cache).__name__}.")
  if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.float16),
                                jnp.dtype(jnp.bfloat16),
                                jnp.dtype(jnp.float32)):
    raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}.")
  n, h = q.shape[-2:]
  kh = cache.num_kv_heads
  if h != cache.head_dim:
    raise ValueError(f"q's head dim {h} differs from the cache's "
                     f"{cache.head_dim}.")
  if n % kh:
    raise ValueError(f"q's {n} heads are not a multiple of the cache's {kh} "
                     "KV heads.")
  if page_table.ndim != 2 or lengths.ndim != 1 or (
      page_table.shape[0] != lengths.shape[0]):
    raise ValueError(f"page_table must be int32 [B, max_pages] and lengths "
                     f"int32 [B]; got {page_table.shape}, {lengths.shape}.")
  b = lengths.shape[0]
  if cu_seqlens is None and q.shape[0] != b:
    raise ValueError(f"q has batch {q.shape[0]}, lengths {b}.")
  ql = token_counts(b, q.shape[0] if cu_seqlens is not None else t_cap,
                    q_lengths, cu_seqlens, "q_lengths")
  if ql is None or not _is_concrete(page_table, lengths):
    return
  table = np.asarray(page_table)
  kv = np.asarray(lengths).astype(np.int64)
  capacity = table.shape[1] * cache.page_size
  if np.any(kv < 0) or np.any(kv > capacity):
    raise ValueError(f"lengths must be within [0, max_pages * page_size = "
                     f"{capacity}] (what the page table can hold), got "
                     f"{kv.tolist()}.")
  if np.any(ql > t_cap):
    raise ValueError(f"a sequence has {ql.max()} query tokens, more than "
                     f"max_q_len={t_cap}.")
  over = np.nonzero(ql > kv)[0]
  if over.size:
    raise ValueError(f"sequence {over[0]} has {ql[over[0]]} query tokens but "
                     f"only {kv[over[0]]} cached tokens; append its new "
                     "tokens before attending.")
  check_pages(cache, table, np.zeros_like(kv), kv, "the cached tokens")


def _num_splits(tiling: PagedTiling, programs: int, max_pages: int,
                page_size: int) -> int:
  if tiling.num_splits is not None:
    return tiling.num_splits
  blocks = -(-max_pages * page_size // max(tiling.block_k, page_size))
  return int(max(1, min(blocks, -(-_target_programs() // max(programs, 1)))))


@functools.partial(jax.jit, static_argnames=(
    "math", "implementation", "tiling", "interpret", "t_cap", "packed",
    "poison"))
def _paged(q, cache, page_table, lengths, q_len, cu_seqlens, *,
           math: PagedMath, implementation: str,
           tiling: PagedTiling | MosaicTiling | DecodeTiling,
           interpret: bool, t_cap: int, packed: bool, poison: bool = False):
  """Core: q ``[B, T, N, H]`` (padded) or ``[rows, N, H]`` (packed)."""
  b = lengths.shape[0]
  n, h = q.shape[-2:]
  kv_len = lengths.astype(jnp.int32)
  page_table = page_table.astype(jnp.int32)
  if isinstance(tiling, DecodeTiling):   # the Mosaic decode, T = 1
    return mosaic_paged.decode_attention(
        q[:, 0], kv_len, cache, page_table, math, out_dtype=q.dtype,
        tiling=tiling)[:, None]
  if packed:
    cu = cu_seqlens.astype(jnp.int32)
    q_start, q_len = cu[:-1], cu[1:] - cu[:-1]
    q_cap = q_len
    rows = q
  else:
    q_start = jnp.arange(b, dtype=jnp.int32) * t_cap
    q_cap = jnp.full((b,), t_cap, jnp.int32)
    q_len = q_cap if q_len is None else q_len.astype(jnp.int32)
    rows = q.reshape(b * t_cap, n, h)

  if implementation in ("mosaic", "xla"):   # both take padded queries
    def attend(qp):   # [B, t_cap, N, H] -> the same, in q's dtype
      if implementation == "mosaic":
        return mosaic_paged.extend_attention(qp, q_len, kv_len, cache,
                                             page_table, math,
                                             out_dtype=q.dtype, tiling=tiling)
      return reference.paged_attention(qp, q_len, cache, page_table, kv_len,
                                       math).astype(q.dtype)
    if not packed:
      return attend(q)
    # The padded [B, t_cap] rows, then back to the packed ones.
    idx = q_start[:, None] + jnp.arange(t_cap)[None, :]
    out = attend(rows[jnp.clip(idx, 0, rows.shape[0] - 1)])
    seq, tok, valid = _packed_rows(cu, b, rows.shape[0])
    out = out[seq, jnp.clip(tok, 0, t_cap - 1)]
    return jnp.where(valid[:, None, None], out, jnp.zeros((), out.dtype))

  bt = tiling.block_q
  nq = -(-t_cap // bt)
  splits = _num_splits(tiling, b * cache.num_kv_heads * nq,
                       page_table.shape[1], cache.page_size)
  res = triton_paged.paged_attention(
      rows, q_start, q_len, q_cap, kv_len, cache, page_table, math,
      num_q_blocks=nq, tiling=tiling, num_splits=splits, out_dtype=q.dtype,
      interpret=interpret, poison=poison)
  if splits == 1:
    out = res[0]
  else:
    out = triton_paged.merge_splits(res[0], res[1], cache.v_smooth, q.dtype)
  if packed:  # rows past cu_seqlens[-1] belong to no sequence
    out = jnp.where((jnp.arange(rows.shape[0]) < cu[-1])[:, None, None], out,
                    jnp.zeros((), out.dtype))
    return out
  return out.reshape(q.shape)


def _packed_rows(cu, b, total):
  from sagejax.serving.cache import token_rows  # pylint: disable=g-import-not-at-top
  return token_rows(b, total, None, cu)


def extend_attention(
    q: jax.Array, cache: PagedKVCache, page_table: jax.Array,
    lengths: jax.Array, *, q_lengths: Optional[jax.Array] = None,
    cu_seqlens: Optional[jax.Array] = None, max_q_len: Optional[int] = None,
    scale: Optional[float] = None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: Optional[float] = None,
    config: ConfigLike | None = None, implementation: Optional[str] = None,
    tiling: PagedTiling | MosaicTiling | None = None, interpret: bool = False
) -> jax.Array:
  """Attention of each sequence's newest tokens to all its cached tokens.

  Prefix caching and chunked prefill (SGLang's *extend*): sequence b holds
  ``lengths[b]`` tokens in the cache (its new ones already appended), and its
  queries are the last ``q_lengths[b]`` of them, causal with the diagonal at
  the bottom right.

  Args:
    q: ``[B, T, N, H]`` (padded: sequence b's queries are its first
      ``q_lengths[b]`` rows, default T), or packed ``[rows, N, H]`` with
      ``cu_seqlens`` (sequence b's queries are rows ``[cu_seqlens[b],
      cu_seqlens[b + 1])``, SGLang's ``qo_indptr``).
    cache: the :class:`PagedKVCache`; N a multiple of its KV heads (GQA).
    page_table: int32 ``[B, max_pages]``.
    lengths: int32 ``[B]``, cached tokens per sequence (including the new).
    q_lengths: int32 ``[B]``, padded form only.
    cu_seqlens: int32 ``[B + 1]``, packed form only.
    max_q_len: packed form: the most query tokens of any sequence (static;
      default all rows); bounds the kernel's grid.
    scale: logit scale, default ``1/sqrt(H)``.
    local_window_size: ``w``: a query at position p sees keys ``[p − w, p]``
      (a tuple's first entry is taken; the diagonal bounds the right side).
    logits_soft_cap: ``c``: logits become ``c·tanh(logits / c)`` (after the
      scale).
    config: with a quantized cache, how Q·Kᵀ and P·V are computed
      (:class:`sagejax.SageConfig`; ``qk_dtype`` must be int8; Q is quantized
      per (token, head) row whatever the granularity; ``pv_dtype`` rounds P).
      Default :data:`MOSAIC_EXTEND_CONFIG` (FP8 P) on the Mosaic extend,
      else :data:`SERVING_CONFIG` (FP16 P). A plain cache computes in its
      dtype.
    implementation: ``"mosaic"`` (quantized cache, Hopper: the dense
      Mosaic GPU kernel on the gathered pages, :mod:`.mosaic_paged`),
      ``"pallas"`` (the Triton kernel, sm80+), ``"xla"``, or None: Mosaic on
      Hopper for chunks of :data:`MOSAIC_MIN_QUERY_TOKENS` or more (the
      padded ``T``; packed: rows per sequence) when it serves the call,
      else Triton.
    tiling: a :class:`PagedTiling` (selects the Triton kernel) or a
      :class:`~sagejax.kernels.mosaic_attention.MosaicTiling` (the Mosaic
      one); default by page size and head dim.
    interpret: run the Triton kernel in the interpreter (tests, CPU).

  Returns:
    Same shape and dtype as ``q``; padding rows are zeros. A sequence whose
    lengths are out of range or whose page table names a page outside the
    pool gives NaN (under ``jit``; concrete bad inputs raise ``ValueError``),
    reading nothing of any other sequence's result.
  """
  packed = cu_seqlens is not None
  if packed:
    if q.ndim != 3:
      raise ValueError(f"with cu_seqlens, q must be [rows, N, H], got "
                       f"{q.shape}.")
    if q_lengths is not None:
      raise ValueError("pass q_lengths (padded q) or cu_seqlens (packed q), "
                       "not both.")
    t_cap = q.shape[0] if max_q_len is None else int(max_q_len)
  else:
    if q.ndim != 4:
      raise ValueError(f"q must be [B, T, N, H] (or [rows, N, H] with "
                       f"cu_seqlens), got {q.shape}.")
    t_cap = q.shape[1]
  _check(q, cache, page_table, lengths, q_lengths, cu_seqlens, t_cap)
  return _attend(q, cache, page_table, lengths, q_lengths, cu_seqlens,
                 decode=False, t_cap=t_cap, packed=packed, scale=scale,
                 local_window_size=local_window_size,
                 logits_soft_cap=logits_soft_cap, config=config,
                 implementation=implementation, tiling=tiling,
                 interpret=interpret)


def decode_attention(
    q: jax.Array, cache: PagedKVCache, page_table: jax.Array,
    lengths: jax.Array, *, scale: Optional[float] = None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: Optional[float] = None,
    config: ConfigLike | None = None, implementation: Optional[str] = None,
    tiling: PagedTiling | DecodeTiling | None = None, interpret: bool = False
) -> jax.Array:
  """One query token per sequence against its ``lengths[b]`` cached tokens.

  ``q`` is ``[B, N, H]``: the newest token of each sequence (already
  appended, so it sees itself). Split-KV flash-decoding: several programs
  share a sequence's pages and their partial outputs are merged by LSE. On
  Hopper (``implementation=None`` or ``"mosaic"``) the Mosaic decode kernel
  serves INT8/FP8 pages of 32-128 tokens and 16-bit pages of 64-128
  (:func:`sagejax.serving.mosaic_paged.decode_unsupported` says why a call
  goes to the Triton kernel instead); ``tiling`` is then a
  :class:`DecodeTiling`. The other arguments are :func:`extend_attention`'s.
  Returns ``[B, N, H]`` in q's dtype.
  """
  if q.ndim != 3:
    raise ValueError(f"q must be [B, N, H], got {q.shape}; use "
                     "extend_attention for several tokens.")
  _check(q[:, None], cache, page_table, lengths, None, None, 1)
  out = _attend(q[:, None], cache, page_table, lengths, None, None,
                decode=True, t_cap=1, packed=False, scale=scale,
                local_window_size=local_window_size,
                logits_soft_cap=logits_soft_cap, config=config,
                implementation=implementation, tiling=tiling,
                interpret=interpret)
  return out[:, 0]


def _attend(q, cache, page_table, lengths, q_lengths, cu_seqlens, *, decode,
            t_cap, packed, scale, local_window_size, logits_soft_cap, config,
            implementation, tiling, interpret, poison=False):
  """Shared by both entry points (checks done); ``poison`` starts the
  kernel's outputs as NaN (GPU checks)."""
  default_config = config is None
  config = _resolve_config(config, cache)
  if tiling is not None and not isinstance(tiling, (PagedTiling,
                                                    MosaicTiling,
                                                    DecodeTiling)):
    raise TypeError(f"tiling must be a PagedTiling (Triton kernel), a "
                    f"MosaicTiling (Mosaic extend) or a DecodeTiling (Mosaic "
                    f"decode), got {type(tiling).__name__}.")
  sm_scale = 1.0 / _math.sqrt(cache.head_dim) if scale is None else float(
      scale)
  if logits_soft_cap is not None and not logits_soft_cap > 0:
    raise ValueError(f"logits_soft_cap must be > 0 or None, got "
                     f"{logits_soft_cap!r}.")
  math = PagedMath(
      sm_scale=sm_scale, window=_window(local_window_size),
      soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
      pv_dtype=config.pv_dtype)
  # Query tokens per sequence: packed rows are averaged over the sequences
  # (max_q_len may bound a few long ones among many short).
  tokens = min(t_cap, -(-q.shape[0] // lengths.shape[0])) if packed else t_cap
  # The Mosaic kernels' default P̃ is FP8 (MOSAIC_EXTEND_CONFIG).
  mosaic_math = (dataclasses.replace(math,
                                     pv_dtype=MOSAIC_EXTEND_CONFIG.pv_dtype)
                 if default_config else math)
  impl = _select(implementation, interpret, q, cache, math, decode, tokens,
                 tiling, mosaic_math)
  if impl == "mosaic":
    math = mosaic_math
    if decode:
      tiling = tiling or DecodeTiling()
      block_k = mosaic_decode.step_keys(cache.page_size)
    else:
      tiling = tiling or mosaic_paged.default_tiling(cache.head_dim,
                                                     math.pv_dtype)
      block_k = mosaic_paged.normalization_block(page_table, cache)
  else:
    if tiling is None:
      tiling = default_tiling(cache.page_size,
                              q.shape[-2] // cache.num_kv_heads, decode,
                              cache.quantized, cache.head_dim)
    block_k = max(tiling.block_k, cache.page_size)
  math = dataclasses.replace(math, block_k=block_k)
  return _paged(q, cache, page_table, lengths, q_lengths, cu_seqlens,
                math=math, implementation=impl, tiling=tiling,
                interpret=interpret, t_cap=t_cap, packed=packed,
                poison=poison)

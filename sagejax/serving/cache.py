"""The paged KV cache: layout, quantization of its entries, and ``append``.

Pages are laid out as JAX's own GPU paged attention lays them out
(:mod:`jax.experimental.pallas.ops.gpu.paged_attention`): ``k_pages`` and
``v_pages`` are ``[K, P, page_size, H]`` (K KV heads, P pages in the pool),
except the FP8 values of a quantized cache: ``v_pages [K, P, H, page_size]``
(``v_transposed``), each page transposed: the P·V product reads its second
operand along the token axis, which FP8 tensor cores require and from which
the kernel also widens FP8 to FP16 fastest. Transposed pages cut the decode
kernel's time by a quarter to a third on an H100 (benchmarks/NOTES.md).
A sequence owns the pages its row of a ``page_table [B, max_pages]`` names:
its token ``i`` lives in page ``page_table[b, i // page_size]``, slot
``i % page_size``. Sequences may share pages (a cached prefix).

**Quantization** (``quantized=True``), SageAttention-style and chosen by
measured error against a bf16 cache on channel-outlier data (README,
"Serving"):

* K: INT8, one scale per token and head (``k_scales [K, P, page_size]``), of
  K minus a *smoothing vector* ``k_smooth [K, H]``. A token's entry never
  changes once written, whatever arrives later.
* V: FP8 e4m3, one scale per token and head (``v_scales``), of V minus
  ``v_smooth [K, H]``. Attention adds ``v_smooth`` back to its output (rows of
  the softmax sum to one), so this is exact up to FP8 rounding.
* The smoothing vectors are the means of the (finite) tokens of the first
  append that brings any token into the cache (over all its sequences), then
  fixed (``smooth_fixed``). Softmax is invariant to any fixed shift of every key of
  a row, so K smoothing stays exact as the cache grows and as sequences come
  and go; only the rounding error depends on the vector. Channel outliers in
  LLM activations are properties of the model's channels, shared by all
  sequences: measured on the channel-bias data, one vector per head gives the
  same error as a per-sequence mean (README) without any per-page state.

Non-finite entries stay visible, as in exact attention: a key with a NaN/Inf
gets scale NaN, a NaN/Inf value entry is stored as FP8 NaN.

A :class:`PagedKVCache` is a pytree with no per-request Python state: page
tables, positions and lengths are arrays, so one jitted serving step handles
any mix of requests. :func:`append` donates the cache (updated in place).

A second layout, ``"PSKH"`` (``[P, page_size, K, H]``, scales ``[P,
page_size, K]``), is Flax's contiguous ``[batch, S, K, H]`` cache viewed as
``batch * S / page_size`` pages (:meth:`PagedKVCache.from_contiguous`); the
kernels read both.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from sagejax import quant
from sagejax.config import SageConfig

Layout = Literal["KPSH", "PSKH"]
LAYOUTS = ("KPSH", "PSKH")

# One INT8 scale per (token, head) row: quant's per-token groups reduce over
# the last (channel) axis only, so they apply to [..., K, H] rows as they are.
_PER_TOKEN = SageConfig(qk_dtype="int8", qk_granularity="per_token")


# ----------------------------------------------------------------------------
# The quantization of cache entries (rows [..., K, H]).
# ----------------------------------------------------------------------------




def quantize_keys(k: jax.Array, smooth: Optional[jax.Array]
                  ) -> tuple[jax.Array, jax.Array]:
  """K rows ``[..., K, H]`` → (int8 ``[..., K, H]``, f32 scale ``[..., K]``).

  ``smooth [K, H]`` (or None) is subtracted first.
  """
  x = k.astype(jnp.float32)
  if smooth is not None:
    x = x - smooth
  values, scale = quant.quantize_groups(x, "k", _PER_TOKEN)
  # A key with a NaN/Inf gets scale NaN (its logits are NaN, as exact
  # attention's q·k would be) and values 0.
  finite = jnp.all(jnp.isfinite(x), axis=-1)
  return (jnp.where(finite[..., None], values, jnp.int8(0)),
          jnp.where(finite, scale, jnp.nan))


def quantize_values(v: jax.Array, smooth: Optional[jax.Array]
                    ) -> tuple[jax.Array, jax.Array]:
  """V rows ``[..., K, H]`` → (FP8 e4m3 ``[..., K, H]``, f32 scale ``[..., K]``).

  One scale per (token, head) over the channels (``smooth`` subtracted
  first), so a token's entry never changes as later tokens arrive.
  """
  x = v.astype(jnp.float32)
  if smooth is not None:
    x = x - smooth
  # Scales from the finite entries; a NaN/Inf entry is stored as FP8 NaN, so
  # it reaches the output channel it would in exact attention.
  finite = jnp.isfinite(x)
  values, scale = quant.quantize_v_fp8(
      jnp.swapaxes(jnp.where(finite, x, 0.0), -1, -2))
  values = jnp.where(finite, jnp.swapaxes(values, -1, -2),
                     jnp.asarray(jnp.nan, quant.FP8_DTYPE))
  return values, scale


def dequantize_keys(values: jax.Array, scale: jax.Array,
                    smooth: Optional[jax.Array]) -> jax.Array:
  """Inverse of :func:`quantize_keys`: f32 ``[..., K, H]``."""
  x = quant.dequantize_qk(values, scale, _PER_TOKEN)
  return x if smooth is None else x + smooth


def dequantize_values(values: jax.Array, scale: jax.Array,
                      smooth: Optional[jax.Array]) -> jax.Array:
  """Inverse of :func:`quantize_values`: f32 ``[..., K, H]``."""
  x = values.astype(jnp.float32) * scale[..., None]
  return x if smooth is None else x + smooth


# ----------------------------------------------------------------------------
# The cache.
# ----------------------------------------------------------------------------


def _is_pow2(x: int) -> bool:
  return isinstance(x, int) and x > 0 and (x & (x - 1)) == 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """A pool of KV pages (a pytree; see the module docstring).

  Attributes:
    k_pages: ``[K, P, page_size, H]`` int8 (quantized) or the activation dtype.
    v_pages: ``[K, P, page_size, H]`` in the activation dtype, or
      float8_e4m3fn ``[K, P, H, page_size]`` (``v_transposed``).
    k_scales, v_scales: f32 ``[K, P, page_size]``, or None (not quantized).
    k_smooth, v_smooth: f32 ``[K, H]`` smoothing vectors, or None.
    smooth_fixed: bool ``[]``, whether the smoothing vectors are set, or None.
    layout: ``"KPSH"`` (above) or ``"PSKH"`` (pages ``[P, page_size, K, H]``,
      scales ``[P, page_size, K]``: Flax's contiguous cache, paged).
    v_transposed: V pages are ``[K, P, H, page_size]`` (``"KPSH"`` only;
      :meth:`create` makes quantized caches so).
  """

  k_pages: jax.Array
  v_pages: jax.Array
  k_scales: Optional[jax.Array] = None
  v_scales: Optional[jax.Array] = None
  k_smooth: Optional[jax.Array] = None
  v_smooth: Optional[jax.Array] = None
  smooth_fixed: Optional[jax.Array] = None
  layout: str = dataclasses.field(default="KPSH", metadata=dict(static=True))
  v_transposed: bool = dataclasses.field(default=False,
                                         metadata=dict(static=True))

  def __post_init__(self):
    if self.v_transposed and self.layout != "KPSH":
      raise ValueError("v_transposed pages need layout='KPSH'.")

  @classmethod
  def create(cls, *, num_pages: int, page_size: int, num_kv_heads: int,
             head_dim: int, quantized: bool = True, dtype=jnp.bfloat16,
             smooth: bool = True) -> "PagedKVCache":
    """An empty cache of ``num_pages`` pages of ``page_size`` tokens.

    Args:
      num_pages: pages in the pool (shared by all sequences).
      page_size: tokens per page, a power of two.
      num_kv_heads, head_dim: K and H of the keys and values.
      quantized: INT8 K / FP8 e4m3 V with per-token scales (about half the
        bytes of bf16; V pages transposed), else pages in ``dtype``.
      dtype: page dtype when not quantized (the activations').
      smooth: with ``quantized``, subtract the smoothing vectors (module
        docstring) before quantizing; False only to measure what they buy.
    """
    if not _is_pow2(page_size):
      raise ValueError(f"page_size must be a power of two, got {page_size!r}.")
    for name, value in (("num_pages", num_pages),
                        ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    if not quantized and jnp.dtype(dtype) not in (jnp.dtype(jnp.float16),
                                                  jnp.dtype(jnp.bfloat16),
                                                  jnp.dtype(jnp.float32)):
      raise ValueError(f"dtype must be float16, bfloat16 or float32, got "
                       f"{jnp.dtype(dtype)}.")
    return _empty(cls, shape, quantized, jnp.dtype(dtype), smooth)

  @classmethod
  def from_contiguous(cls, k: jax.Array, v: jax.Array,
                      k_scales: Optional[jax.Array] = None,
                      v_scales: Optional[jax.Array] = None,
                      k_smooth: Optional[jax.Array] = None,
                      v_smooth: Optional[jax.Array] = None,
                      smooth_fixed: Optional[jax.Array] = None
                      ) -> tuple["PagedKVCache", jax.Array]:
    """A contiguous ``[B, S, K, H]`` cache (Flax's) as pages, and its table.

    Scales are ``[B, S, K]``. The page size is the largest power of two up to
    64 dividing S; returns ``(cache, page_table int32 [B, S / page_size])``.
    Both are views (reshapes): nothing is copied.
    """
    b, s, kh, h = k.shape
    ps = min(64, s & -s)
    pages = b * (s // ps)
    view = lambda x: None if x is None else x.reshape(  # noqa: E731
        (pages, ps) + x.shape[2:])
    cache = cls(view(k), view(v), view(k_scales), view(v_scales), k_smooth,
                v_smooth, smooth_fixed, layout="PSKH")
    table = jnp.arange(pages, dtype=jnp.int32).reshape(b, s // ps)
    return cache, table

  def contiguous(self, batch: int) -> dict[str, Optional[jax.Array]]:
    """Inverse of :meth:`from_contiguous` (``"PSKH"`` only): the arrays as
    ``[B, S, K, H]`` / ``[B, S, K]``, keyed by field name."""
    if self.layout != "PSKH":
      raise ValueError("contiguous() needs a cache made by from_contiguous.")
    out = {}
    for f in ("k_pages", "v_pages", "k_scales", "v_scales"):
      x = getattr(self, f)
      out[f] = None if x is None else x.reshape(
          (batch, -1) + x.shape[2:])
    return out

  # Shapes.

  @property
  def quantized(self) -> bool:
    return self.k_scales is not None

  @property
  def _head_axis(self) -> int:
    return 0 if self.layout == "KPSH" else 2

  @property
  def num_kv_heads(self) -> int:
    return self.k_pages.shape[self._head_axis]

  @property
  def num_pages(self) -> int:
    return self.k_pages.shape[1 if self.layout == "KPSH" else 0]

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[2 if self.layout == "KPSH" else 1]

  @property
  def head_dim(self) -> int:
    return self.k_pages.shape[-1]

  @property
  def nbytes(self) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(self))

  # Token rows <-> pages.

  def write(self, name: str, page: jax.Array, slot: jax.Array,
            rows: jax.Array) -> jax.Array:
    """Field ``name`` with ``rows [n, K, ...]`` written at ``(page, slot)``
    (int ``[n]``); rows whose page is ``num_pages`` are dropped."""
    x = getattr(self, name)
    if name == "v_pages" and self.v_transposed:   # x [K, P, H, ps]
      return x.at[:, page, :, slot].set(rows, mode="drop")
    if self.layout == "KPSH":
      return x.at[:, page, slot].set(jnp.moveaxis(rows, 1, 0), mode="drop")
    return x.at[page, slot].set(rows, mode="drop")

  def gather(self, name: str, pages: jax.Array) -> jax.Array:
    """Field ``name`` at ``pages`` (int ``[B, M]``, in range) as token rows
    ``[B, M * page_size, K, ...]``."""
    x = getattr(self, name)
    if name == "v_pages" and self.v_transposed:
      x = jnp.transpose(x[:, pages], (1, 2, 4, 0, 3))  # [B, M, ps, K, H]
    elif self.layout == "KPSH":
      x = jnp.moveaxis(x[:, pages], 0, 3)            # [B, M, ps, K, ...]
    else:
      x = x[pages]
    return x.reshape(x.shape[:1] + (-1,) + x.shape[3:])


@functools.partial(jax.jit, static_argnums=range(5))
def _empty(cls, shape, quantized, dtype, smooth) -> PagedKVCache:
  """The arrays of an empty cache, made on the device in one program."""
  if not quantized:
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
  smooth_state = {}
  if smooth:
    smooth_state = dict(
        k_smooth=jnp.zeros((shape[0], shape[-1]), jnp.float32),
        v_smooth=jnp.zeros((shape[0], shape[-1]), jnp.float32),
        smooth_fixed=jnp.zeros((), jnp.bool_))
  v_shape = shape[:2] + (shape[3], shape[2])        # [K, P, H, ps]
  return cls(jnp.zeros(shape, jnp.int8), jnp.zeros(v_shape, quant.FP8_DTYPE),
             jnp.ones(shape[:-1], jnp.float32),
             jnp.ones(shape[:-1], jnp.float32), **smooth_state,
             v_transposed=True)


# ----------------------------------------------------------------------------
# append.
# ----------------------------------------------------------------------------


try:  # JAX 0.10 and 0.11 both export it; the fallback guards later moves
  _Tracer = jax.core.Tracer
except AttributeError:  # pragma: no cover
  from jax._src.core import Tracer as _Tracer  # pylint: disable=g-import-not-at-top


def _is_concrete(*xs) -> bool:
  """Whether all given arrays have values (outside jit): checks can read."""
  return not any(isinstance(x, _Tracer) for x in xs if x is not None)


def token_rows(batch: int, rows: int, num_new: Optional[jax.Array],
               cu_seqlens: Optional[jax.Array]
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sequence, index within its new tokens, and validity of each token row.

  Padded (``cu_seqlens`` None): ``rows = B * T``, row ``r`` is token ``r % T``
  of sequence ``r // T``, valid below ``num_new`` (default T). Packed: rows of
  sequence b are ``[cu_seqlens[b], cu_seqlens[b + 1])``. Returns int32 ``[n]``
  ×2 and bool ``[n]``.
  """
  r = jnp.arange(rows, dtype=jnp.int32)
  if cu_seqlens is None:
    t_len = rows // batch
    seq, idx = r // t_len, r % t_len
    count = (jnp.full((batch,), t_len, jnp.int32) if num_new is None
             else num_new.astype(jnp.int32))
    return seq, idx, idx < count[seq]
  cu = cu_seqlens.astype(jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu, r, side="right").astype(jnp.int32) - 1,
                 0, batch - 1)
  idx = r - cu[seq]
  return seq, idx, (r >= cu[0]) & (r < cu[batch]) & (idx >= 0)


def token_counts(batch: int, rows: int, counts: Optional[jax.Array],
                 cu_seqlens: Optional[jax.Array], name: str
                 ) -> Optional[np.ndarray]:
  """New tokens per sequence of a padded batch (``counts`` int ``[B]`` within
  ``[0, T = rows]``, default T) or a packed one (``cu_seqlens [B + 1]`` over
  ``rows`` rows). Checks shapes always and values when concrete; returns the
  counts (numpy), or None under ``jit``."""
  if cu_seqlens is not None:
    if cu_seqlens.shape != (batch + 1,):
      raise ValueError(f"cu_seqlens must be int32 [B + 1] = [{batch + 1}], "
                       f"got {cu_seqlens.shape}.")
    if not _is_concrete(cu_seqlens):
      return None
    cu = np.asarray(cu_seqlens).astype(np.int64)
    if np.any(np.diff(cu) < 0) or cu[0] < 0 or cu[-1] > rows:
      raise ValueError(f"cu_seqlens must be non-decreasing within [0, "
                       f"{rows}], got {cu.tolist()}.")
    return np.diff(cu)
  if counts is None:
    return np.full((batch,), rows)
  if counts.shape != (batch,):
    raise ValueError(f"{name} must be int32 [B] = [{batch}], got "
                     f"{counts.shape}.")
  if not _is_concrete(counts):
    return None
  count = np.asarray(counts).astype(np.int64)
  if np.any(count < 0) or np.any(count > rows):
    raise ValueError(f"{name} must be within [0, T={rows}], got "
                     f"{count.tolist()}.")
  return count


def _check_append(cache: PagedKVCache, k, v, page_table, positions, num_new,
                  cu_seqlens) -> None:
  """Shape checks always; value checks when the inputs are concrete."""
  kh, h = cache.num_kv_heads, cache.head_dim
  packed = cu_seqlens is not None
  want_ndim = 3 if packed else 4
  if k.ndim != want_ndim or k.shape != v.shape:
    raise ValueError(
        f"k and v must have one shape, [total, K, H] with cu_seqlens or "
        f"[B, T, K, H] without; got {k.shape} and {v.shape}.")
  if k.shape[-2:] != (kh, h):
    raise ValueError(f"k/v heads and head dim {k.shape[-2:]} do not match the "
                     f"cache's (num_kv_heads={kh}, head_dim={h}).")
  if page_table.ndim != 2 or positions.ndim != 1:
    raise ValueError("page_table must be int32 [B, max_pages] and positions "
                     f"int32 [B]; got {page_table.shape}, {positions.shape}.")
  b = page_table.shape[0]
  if positions.shape[0] != b or (not packed and k.shape[0] != b):
    raise ValueError(f"batch sizes disagree: page_table {b}, positions "
                     f"{positions.shape[0]}, k {k.shape[0]}.")
  count = token_counts(b, k.shape[0 if packed else 1], num_new, cu_seqlens,
                       "num_new")
  if count is None or not _is_concrete(page_table, positions):
    return
  table = np.asarray(page_table)
  pos = np.asarray(positions).astype(np.int64)
  if np.any(pos < 0):
    raise ValueError(f"positions must be >= 0, got {pos.tolist()}.")
  capacity = table.shape[1] * cache.page_size
  over = np.nonzero(pos + count > capacity)[0]
  if over.size:
    i = over[0]
    raise ValueError(
        f"appending {count[i]} tokens at position {pos[i]} runs past sequence "
        f"{i}'s pages ({table.shape[1]} pages of {cache.page_size} = "
        f"{capacity} tokens); give it more pages in page_table.")
  check_pages(cache, table, pos, pos + count, "the tokens being appended")


def check_pages(cache: PagedKVCache, table: np.ndarray, lo: np.ndarray,
                hi: np.ndarray, what: str) -> None:
  """``ValueError`` if a page holding tokens ``[lo[b], hi[b])`` of sequence b
  (concrete ``table [B, max_pages]``) is outside the pool."""
  ps = cache.page_size
  for i in range(table.shape[0]):
    if hi[i] <= lo[i]:
      continue
    used = table[i, lo[i] // ps:(hi[i] - 1) // ps + 1]
    outside = (used < 0) | (used >= cache.num_pages)
    if np.any(outside):
      raise ValueError(f"page_table[{i}] names page {used[outside][0]} "
                       f"outside the pool [0, {cache.num_pages}) for {what}.")


def append(cache: PagedKVCache, k: jax.Array, v: jax.Array,
           page_table: jax.Array, positions: jax.Array, *,
           num_new: Optional[jax.Array] = None,
           cu_seqlens: Optional[jax.Array] = None,
           donate: bool = True) -> PagedKVCache:
  """Writes new tokens' K and V into their sequences' pages.

  Args:
    cache: the cache; **donated** (updated in place; do not use it after).
    k, v: ``[B, T, K, H]``, or packed ``[total, K, H]`` with ``cu_seqlens``.
    page_table: int32 ``[B, max_pages]``, each sequence's pages.
    positions: int32 ``[B]``, the index in its sequence of each sequence's
      first new token.
    num_new: int32 ``[B]``, new tokens per sequence in the padded form
      (default T); rows past it are ignored.
    cu_seqlens: int32 ``[B + 1]``: sequence b's tokens are rows
      ``[cu_seqlens[b], cu_seqlens[b + 1])`` of packed k and v.
    donate: False keeps the input cache valid (a copy is written).

  Returns:
    The updated cache.

  Bad input (tokens past a sequence's ``max_pages * page_size`` tokens, pages
  outside the pool) raises ``ValueError`` on concrete values. Under ``jit``,
  such tokens are not written at all (no other page is touched).
  """
  _check_append(cache, k, v, page_table, positions, num_new, cu_seqlens)
  fn = _append_donating if donate else _append
  return fn(cache, k, v, page_table, positions, num_new, cu_seqlens)


def _append_impl(cache: PagedKVCache, k, v, page_table, positions, num_new,
                 cu_seqlens) -> PagedKVCache:
  b, max_pages = page_table.shape
  page_table, positions = page_table.astype(jnp.int32), positions.astype(
      jnp.int32)
  ps = cache.page_size
  kh, h = cache.num_kv_heads, cache.head_dim
  rows_k = k.reshape(-1, kh, h)
  rows_v = v.reshape(-1, kh, h)
  seq, idx, valid = token_rows(b, rows_k.shape[0], num_new, cu_seqlens)
  pos = positions[seq] + idx
  slot_page = pos // ps
  page = page_table[seq, jnp.clip(slot_page, 0, max_pages - 1)]
  valid = (valid & (pos >= 0) & (slot_page < max_pages) & (page >= 0)
           & (page < cache.num_pages))
  page = jnp.where(valid, page, cache.num_pages)   # dropped by the scatter
  slot = pos % ps

  if not cache.quantized:
    return dataclasses.replace(
        cache,
        k_pages=cache.write("k_pages", page, slot,
                            rows_k.astype(cache.k_pages.dtype)),
        v_pages=cache.write("v_pages", page, slot,
                            rows_v.astype(cache.v_pages.dtype)))

  updates = {}
  k_smooth = v_smooth = None
  if cache.k_smooth is not None:
    # Fixed by the first append that brings any token: the mean of its
    # (finite) tokens, per KV head.
    fresh = jnp.logical_not(cache.smooth_fixed)

    def mean(x, old):
      x = x.astype(jnp.float32)
      w = valid[:, None] & jnp.all(jnp.isfinite(x), axis=-1)   # [n, K]
      total = jnp.sum(jnp.where(w[..., None], x, 0.0), axis=0)
      count = jnp.maximum(jnp.sum(w, axis=0), 1)[:, None]
      return jnp.where(fresh, total / count, old)

    k_smooth = mean(rows_k, cache.k_smooth)
    v_smooth = mean(rows_v, cache.v_smooth)
    updates = dict(k_smooth=k_smooth, v_smooth=v_smooth,
                   smooth_fixed=cache.smooth_fixed | jnp.any(valid))
  k8, ks = quantize_keys(rows_k, k_smooth)
  v8, vs = quantize_values(rows_v, v_smooth)
  return dataclasses.replace(
      cache, k_pages=cache.write("k_pages", page, slot, k8),
      k_scales=cache.write("k_scales", page, slot, ks),
      v_pages=cache.write("v_pages", page, slot, v8),
      v_scales=cache.write("v_scales", page, slot, vs), **updates)


_append = jax.jit(_append_impl)
_append_donating = jax.jit(_append_impl, donate_argnums=(0,))

"""Flax Linen integration: a drop-in ``MultiHeadDotProductAttention``.

Switching a Linen model to SageAttention is one import::

  from sagejax.nn import MultiHeadDotProductAttention   # was flax.linen's

:class:`SageMultiHeadAttention` (also exported under Flax's class names
``MultiHeadDotProductAttention`` and ``MultiHeadAttention``, so auto-named
submodules keep their checkpoint paths) has Flax's fields, ``__call__``
signature, parameter tree and ``'cache'`` collection, plus ``config``,
``implementation``, ``logits_soft_cap`` and ``quantized_cache``. :func:`attention_fn` returns a
function with Flax's ``attention_fn`` protocol for models that already take
one (Linen and NNX).

Where the quantized path cannot serve a Flax feature (attention-weight dropout,
``sow_weights``, custom attention einsums), that call runs Flax's own exact
``dot_product_attention`` instead and a one-time warning says so. Nothing is
silently approximated differently.

Rows that no key may see (fully masked) give the mean of V over all keys, as
Flax's and JAX's exact attention do (``sagejax.attention`` itself gives zeros).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import linen
from flax.linen.module import merge_param

from sagejax import _inputs, quant, serving
from sagejax.api import attention as _sage_attention
from sagejax.serving import cache as serving_cache
from sagejax.config import ConfigLike, SageConfig, resolve_config

Array = jax.Array

_COMPUTE_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16),
                   jnp.dtype(jnp.float32))
_WARNED: set[str] = set()


def _warn_fallback_once(reason: str) -> None:
  if reason in _WARNED:
    return
  _WARNED.add(reason)
  warnings.warn(
      f"sagejax: {reason}, which the quantized path cannot serve; such calls "
      "run Flax's exact dot_product_attention instead (warned once).",
      UserWarning, stacklevel=4)


# ----------------------------------------------------------------------------
# Flax-shaped inputs ([batch..., T, N, H]) to sagejax.attention's 4-D BTNH.
# ----------------------------------------------------------------------------


def _flatten_batch(x: Array, n_batch: int) -> Array:
  """``[batch..., T, N, H]`` → ``[B, T, N, H]`` (B = 1 without batch axes)."""
  return x.reshape((math.prod(x.shape[:n_batch]),) + x.shape[n_batch:])


def _flatten_pairwise(x: Optional[Array], batch: tuple[int, ...]
                      ) -> Optional[Array]:
  """A mask/bias broadcastable to ``[batch..., N, T, S]`` → ``[B|1, N|1, T|1, S|1]``.

  Batch axes that are all 1 stay a single broadcast axis (nothing is copied).
  """
  if x is None:
    return None
  x = jnp.asarray(x)
  nb = len(batch)
  if x.ndim > nb + 3:
    raise ValueError(f"mask/bias of shape {x.shape} has more axes than "
                     f"[batch..., heads, q_len, kv_len] = {nb + 3}.")
  x = x.reshape((1,) * (nb + 3 - x.ndim) + x.shape)
  if all(d == 1 for d in x.shape[:nb]):
    return x.reshape((1,) + x.shape[nb:])
  x = jnp.broadcast_to(x, batch + x.shape[nb:])
  return x.reshape((-1,) + x.shape[nb:])


def _mean_value_where_unseen(out: Array, lse: Array, value: Array) -> Array:
  """Rows with LSE −inf (no visible key) → mean of V over all keys (Flax's).

  ``out [B, T, N, H]``, ``lse [B, N, T]``, ``value [B, S, K, H]``.
  """
  n, kv_heads = out.shape[2], value.shape[2]
  mean = jnp.mean(value.astype(jnp.float32), axis=1)           # [B, K, H]
  mean = jnp.repeat(mean, n // kv_heads, axis=1)[:, None]      # [B, 1, N, H]
  unseen = (jnp.swapaxes(lse, 1, 2) == -jnp.inf)[..., None]   # [B, T, N, 1]
  return jnp.where(unseen, mean.astype(out.dtype), out)


def _sage_flax_shaped(query: Array, key: Array, value: Array,
                      bias: Optional[Array], mask: Optional[Array],
                      is_causal: bool, kv_lengths: Optional[Array],
                      config: SageConfig, implementation: Optional[str],
                      logits_soft_cap: Optional[float] = None) -> Array:
  batch = query.shape[:-3]
  q, k, v = (_flatten_batch(x, len(batch)) for x in (query, key, value))
  m = _flatten_pairwise(mask, batch)
  if m is not None:
    m = m.astype(jnp.bool_)
  out, lse = _sage_attention(
      q, k, v, _flatten_pairwise(bias, batch), m, is_causal=is_causal,
      key_value_seq_lengths=kv_lengths, config=config,
      implementation=implementation, return_lse=True,
      logits_soft_cap=logits_soft_cap)
  if m is not None:
    out = _mean_value_where_unseen(out, lse, v)
  return out.reshape(query.shape)


def _exact_flax(query, key, value, bias, mask, *, broadcast_dropout,
                dropout_rng, dropout_rate, deterministic, dtype, precision,
                module, is_causal, force_fp32_for_softmax,
                qk_attn_weights_einsum, attn_weights_value_einsum,
                kv_lengths) -> Array:
  """Flax's own exact attention, with causal and KV lengths folded into mask."""
  t, s = query.shape[-3], key.shape[-3]
  masks = [] if mask is None else [jnp.asarray(mask).astype(jnp.bool_)]
  if is_causal:
    masks.append(jnp.tril(jnp.ones((t, s), jnp.bool_)))
  if kv_lengths is not None:
    valid = jnp.arange(s)[None, :] < kv_lengths[:, None]
    masks.append(valid.reshape(query.shape[:-3] + (1, 1, s)))
  mask = functools.reduce(jnp.logical_and, masks) if masks else None
  linen_only = (isinstance(module, linen.Module) or force_fp32_for_softmax
                or qk_attn_weights_einsum is not None
                or attn_weights_value_einsum is not None)
  if linen_only:
    groups = query.shape[-2] // key.shape[-2]
    if groups > 1:  # Linen's exact attention has no GQA.
      key, value = (jnp.repeat(x, groups, axis=-2) for x in (key, value))
    return linen.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng,
        dropout_rate, deterministic, dtype, precision, module,
        force_fp32_for_softmax,
        qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum)
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return nnx.dot_product_attention(
      query, key, value, bias, mask, broadcast_dropout, dropout_rng,
      dropout_rate, deterministic, dtype, precision, module)


@dataclasses.dataclass(frozen=True)
class SageAttentionFn:
  """SageAttention with Flax's ``attention_fn`` protocol (see :func:`attention_fn`).

  Frozen and hashable, so modules holding it stay valid jit static data.
  """

  config: SageConfig
  implementation: Optional[str] = None
  logits_soft_cap: Optional[float] = None

  def __call__(
      self,
      query: Array,
      key: Array,
      value: Array,
      bias: Optional[Array] = None,
      mask: Optional[Array] = None,
      broadcast_dropout: bool = True,
      dropout_rng: Optional[Array] = None,
      dropout_rate: float = 0.0,
      deterministic: bool = False,
      dtype: Any = None,
      precision: Any = None,
      module: Any = None,
      is_causal: bool = False,
      force_fp32_for_softmax: bool = False,
      qk_attn_weights_einsum: Optional[Callable[..., Array]] = None,
      attn_weights_value_einsum: Optional[Callable[..., Array]] = None,
      key_value_seq_lengths: Optional[Array] = None,
  ) -> Array:
    """Attention over ``query [batch..., T, N, H]``, ``key``/``value [batch..., S, K, H]``.

    ``mask`` (True or nonzero = attend) and ``bias`` broadcast to ``[batch...,
    N, T, S]``; ``is_causal`` is top-left aligned (JAX's). ``precision`` and
    ``force_fp32_for_softmax`` only matter for the exact fallback (the
    quantized softmax is FP32 anyway). ``key_value_seq_lengths`` (int ``[B]``,
    B the product of the batch axes) is a sagejax extension the modules use
    while decoding. Returns ``[batch..., T, N, H]`` in ``dtype`` (default: the
    inputs' promoted dtype).
    """
    reason = None
    if module is not None:
      reason = "attention weights were requested (sow_weights=True)"
    elif dropout_rate > 0.0 and not deterministic:
      reason = "attention-weight dropout is active (dropout_rate > 0)"
    elif (qk_attn_weights_einsum is not None
          or attn_weights_value_einsum is not None):
      reason = "custom attention einsums were given"
    if reason is not None:
      if self.logits_soft_cap is not None:
        raise ValueError(
            f"logits_soft_cap is set but {reason}, which only Flax's exact "
            "attention (without a soft cap) serves; drop one of the two.")
      _warn_fallback_once(reason)
      return _exact_flax(
          query, key, value, bias, mask, broadcast_dropout=broadcast_dropout,
          dropout_rng=dropout_rng, dropout_rate=dropout_rate,
          deterministic=deterministic, dtype=dtype, precision=precision,
          module=module, is_causal=is_causal,
          force_fp32_for_softmax=force_fp32_for_softmax,
          qk_attn_weights_einsum=qk_attn_weights_einsum,
          attn_weights_value_einsum=attn_weights_value_einsum,
          kv_lengths=key_value_seq_lengths)
    out_dtype = (jnp.dtype(dtype) if dtype is not None
                 else jnp.result_type(query, key, value))
    compute = out_dtype if out_dtype in _COMPUTE_DTYPES else jnp.float32
    q, k, v = (jnp.asarray(x).astype(compute) for x in (query, key, value))
    out = _sage_flax_shaped(q, k, v, bias, mask, is_causal,
                            key_value_seq_lengths, self.config,
                            self.implementation, self.logits_soft_cap)
    return out.astype(out_dtype)


def attention_fn(config: ConfigLike = "sage2-8b",
                 implementation: Optional[str] = None,
                 logits_soft_cap: Optional[float] = None) -> SageAttentionFn:
  """SageAttention as a Flax ``attention_fn``.

  Example::

    attn = flax.linen.MultiHeadDotProductAttention(
        num_heads=8, attention_fn=sagejax.nn.attention_fn("sage2-8b"))

  The function takes ``(query, key, value, bias=None, mask=None, *, ...)`` with
  the keyword arguments Linen passes (it filters them by this signature) and
  those NNX passes (``mask``, ``dropout_rng``, ``dropout_rate``,
  ``broadcast_dropout``, ``deterministic``, ``dtype``, ``precision``,
  ``module``, ``is_causal``). Shapes are Flax's: ``[batch..., T, N, H]``,
  ``key``/``value`` may have fewer (KV) heads.

  Falls back to Flax's exact ``dot_product_attention`` (with a one-time
  warning) when dropout on the attention weights is active, when ``module`` is
  given (``sow_weights``: the weights must exist), or with custom einsums.

  Args:
    config: a :class:`sagejax.SageConfig` or preset name.
    implementation: backend for :func:`sagejax.attention` (None: fastest).
    logits_soft_cap: Gemma-2's logit soft cap (float > 0) or None; see
      :func:`sagejax.attention`.
  """
  return SageAttentionFn(resolve_config(config), implementation,
                         _inputs.check_soft_cap(logits_soft_cap))


dot_product_attention = attention_fn()
"""``attention_fn()`` with the default preset: for Flax's function's slot."""


# ----------------------------------------------------------------------------
# KV cache: Flax's layout, plain or INT8 K / FP8 V, read by sagejax.serving.
# ----------------------------------------------------------------------------

# Cache variables of the quantized cache besides K, V and their scales: the
# smoothing vectors (sagejax.serving.cache) and whether they are fixed.
_SMOOTH_FIELDS = {"cached_key_smooth": "k_smooth",
                  "cached_value_smooth": "v_smooth",
                  "cache_smooth_fixed": "smooth_fixed"}
_ARRAY_FIELDS = {"cached_key": "k_pages", "cached_value": "v_pages",
                 "cached_key_scale": "k_scales",
                 "cached_value_scale": "v_scales"}


def cache_layout(shape: tuple[int, ...], dtype, quantized: bool
                 ) -> dict[str, tuple[tuple[int, ...], Any]]:
  """Cache variables (besides ``cache_index``) for K/V of ``shape [..., S, K, H]``.

  Plain: Flax's ``cached_key``/``cached_value`` in ``dtype``. Quantized
  (:mod:`sagejax.serving.cache`'s scheme): ``cached_key`` int8 and
  ``cached_value`` float8_e4m3fn with f32 per-token scales
  ``cached_key_scale``/``cached_value_scale [..., S, K]`` (``2·(H + 4)`` bytes
  per token and KV head instead of ``2·2·H`` for bf16), and the smoothing
  vectors ``cached_key_smooth``/``cached_value_smooth [K, H]`` with
  ``cache_smooth_fixed``.
  """
  shape = tuple(shape)
  if not quantized:
    return {"cached_key": (shape, dtype), "cached_value": (shape, dtype)}
  kh_h = shape[-2:]
  return {"cached_key": (shape, jnp.int8),
          "cached_key_scale": (shape[:-1], jnp.float32),
          "cached_value": (shape, quant.FP8_DTYPE),
          "cached_value_scale": (shape[:-1], jnp.float32),
          "cached_key_smooth": (kh_h, jnp.float32),
          "cached_value_smooth": (kh_h, jnp.float32),
          "cache_smooth_fixed": ((), jnp.bool_)}


def _as_paged(cache: dict[str, Array]):
  """The cache variables as a :class:`sagejax.serving.PagedKVCache` view,
  with its page table and the batch shape."""
  batch = cache["cached_key"].shape[:-3]
  flat = lambda x: x.reshape((-1,) + x.shape[len(batch):])  # noqa: E731
  arrays = {field: flat(cache[name]) for name, field in _ARRAY_FIELDS.items()
            if name in cache}
  smooth = {field: cache[name] for name, field in _SMOOTH_FIELDS.items()
            if name in cache}
  paged, table = serving.PagedKVCache.from_contiguous(
      arrays["k_pages"], arrays["v_pages"], arrays.get("k_scales"),
      arrays.get("v_scales"), **smooth)
  return paged, table, batch


def write_cache(cache: dict[str, Array], index: Array, key: Array,
                value: Array) -> dict[str, Array]:
  """Appends ``key``/``value [..., T, K, H]`` at ``index`` of every row.

  Returns the updated cache (same names). Tokens past the cache's length are
  not written (and attention then gives NaN for those rows' queries).
  """
  *batch, length, heads, depth = cache["cached_key"].shape
  if key.shape != value.shape or key.shape[:-3] != tuple(batch) or (
      key.shape[-2:] != (heads, depth)) or key.shape[-3] > length:
    raise ValueError(
        f"Autoregressive cache shape error: expected key/value of shape "
        f"{(*batch, 'T', heads, depth)} with T <= {length}, got {key.shape} "
        f"and {value.shape}.")
  paged, table, _ = _as_paged(cache)
  flat = lambda x: x.reshape((-1,) + x.shape[len(batch):])  # noqa: E731
  positions = jnp.full((table.shape[0],), index, jnp.int32)
  paged = serving_cache.append(paged, flat(key), flat(value), table,
                               positions, donate=False)
  contiguous = paged.contiguous(table.shape[0])
  new = dict(cache)
  for name, field in _ARRAY_FIELDS.items():
    if name in cache:
      new[name] = contiguous[field].reshape(cache[name].shape)
  for name, field in _SMOOTH_FIELDS.items():
    if name in cache:
      new[name] = getattr(paged, field)
  return new


def read_cache(cache: dict[str, Array], dtype) -> tuple[Array, Array]:
  """The whole cached K and V, ``[..., S, K, H]`` in ``dtype`` (dequantized
  for a quantized cache), for an ``attention_fn`` that takes them."""
  if "cached_key_scale" not in cache:
    return cache["cached_key"], cache["cached_value"]
  key = serving_cache.dequantize_keys(
      cache["cached_key"], cache["cached_key_scale"],
      cache.get("cached_key_smooth"))
  value = serving_cache.dequantize_values(
      cache["cached_value"], cache["cached_value_scale"],
      cache.get("cached_value_smooth"))
  return key.astype(dtype), value.astype(dtype)


def paged_decode(fn: Callable[..., Array], cache: dict[str, Array],
                 index: Array, query: Array) -> Optional[Array]:
  """The new tokens' attention read straight from the cache.

  ``query [..., T, N, H]`` are the T tokens just written at ``index``; they
  see the cache up to themselves, causally. With sagejax's ``attention_fn``
  this runs :func:`sagejax.serving.decode_attention` (T = 1) or
  ``extend_attention`` on the cache as it is stored (INT8/FP8 entries read
  by the kernel, no dequantized copy). Returns None for any other
  ``attention_fn``, which the caller then gives :func:`read_cache`'s arrays.
  """
  if not isinstance(fn, SageAttentionFn):
    return None
  paged, table, batch = _as_paged(cache)
  t = query.shape[-3]
  q = query.reshape((-1,) + query.shape[len(batch):])
  lengths = jnp.full((q.shape[0],), index + t, jnp.int32)
  config = serving.SERVING_CONFIG.replace(pv_dtype=fn.config.pv_dtype)
  # "mosaic" (Hopper): serving picks its Hopper kernels itself (the Mosaic
  # extend for long chunks, the Triton kernel for decode and short chunks).
  impl = None if fn.implementation == "mosaic" else fn.implementation
  kwargs = dict(config=config, implementation=impl,
                logits_soft_cap=getattr(fn, "logits_soft_cap", None))
  if t == 1:
    out = serving.decode_attention(q[:, 0], paged, table, lengths, **kwargs)
    out = out[:, None]
  else:
    out = serving.extend_attention(q, paged, table, lengths, **kwargs)
  return out.reshape(query.shape)


def decode_attention_inputs(fn: Callable[..., Array], mask: Optional[Array],
                            index: Array, t: int, batch: tuple[int, ...],
                            length: int
                            ) -> tuple[Optional[Array], dict[str, Array]]:
  """The mask and extra kwargs for T new tokens at ``index`` reading the
  whole cache (token ``index + i`` sees keys ``<= index + i``).

  sagejax's function gets the valid length (padding then stays out of the
  quantization statistics), plus the causal mask when T > 1; any other
  ``attention_fn`` gets Flax's combined mask.
  """
  seen = (jnp.arange(length)[None, :]
          <= index + jnp.arange(t)[:, None])             # [T, S]
  seen = jnp.broadcast_to(seen, batch + (1, t, length))
  if isinstance(fn, SageAttentionFn):
    lengths = jnp.full((math.prod(batch),), index + t, jnp.int32)
    if t > 1:
      mask = seen if mask is None else linen.combine_masks(mask, seen)
    return mask, {"key_value_seq_lengths": lengths}
  return linen.combine_masks(mask, seen), {}


def call_attention_fn(fn: Callable[..., Array], args: tuple[Array, ...],
                      kwargs: dict[str, Any], filter_kwargs: bool,
                      **unfiltered: Any) -> Array:
  """Calls ``fn``; with ``filter_kwargs`` (Linen's rule) drops the ``kwargs``
  its signature lacks. ``unfiltered`` kwargs are always passed."""
  if filter_kwargs and not isinstance(fn, SageAttentionFn):
    params = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in params}
  return fn(*args, **kwargs, **unfiltered)


# ----------------------------------------------------------------------------
# The Linen module.
# ----------------------------------------------------------------------------


def resolve_inputs(inputs_q: Array, inputs_k: Optional[Array],
                   inputs_v: Optional[Array]) -> tuple[Array, Array]:
  """Flax's defaults: K from Q, V from K."""
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError("inputs_v was given without inputs_k; pass the shared "
                       "array as inputs_k and leave inputs_v None.")
    inputs_k = inputs_q
  return inputs_k, inputs_k if inputs_v is None else inputs_v


class SageMultiHeadAttention(linen.MultiHeadDotProductAttention):
  """SageAttention drop-in for :class:`flax.linen.MultiHeadDotProductAttention`.

  Same fields, ``__call__`` and parameters (``query``/``key``/``value``
  ``[features, N, H]`` kernels and ``[N, H]`` biases, ``out [N, H, features]``,
  ``query_ln``/``key_ln`` scales with ``normalize_qk``), so Flax checkpoints
  load unchanged. With ``decode=True`` the ``'cache'`` collection holds
  ``cached_key``/``cached_value [batch..., S, N, H]`` and ``cache_index``, as
  Flax's, or the quantized layout below.

  Attributes (beyond Flax's):
    attention_fn: None (default) for SageAttention with ``config``; any Flax
      ``attention_fn`` replaces it (``config`` is then unused).
    config: :class:`sagejax.SageConfig` or preset name (default
      ``"sage2-8b"``).
    implementation: backend for :func:`sagejax.attention` (None: fastest).
    logits_soft_cap: Gemma-2's logit soft cap (float > 0) or None; see
      :func:`sagejax.attention`.
    quantized_cache: decode with INT8 K and FP8 e4m3 V (per-token, per-head
      scales, smoothed: :mod:`sagejax.serving.cache`) in the cache:
      ``cached_key`` int8, ``cached_value`` float8_e4m3fn, f32
      ``cached_key_scale``/``cached_value_scale [batch..., S, K]`` and the
      smoothing vectors (:func:`cache_layout`), about half the memory of a
      bf16 cache.

  Decoding (``decode=True``) takes T >= 1 tokens per call (a prompt in one
  call, then one token at a time): they are appended at ``cache_index`` and
  attend causally to the cache up to themselves. With sagejax's attention and
  no mask, dropout or ``sow_weights``, the cache is read by
  :mod:`sagejax.serving`'s paged kernels (INT8/FP8 entries directly, plain
  entries in their dtype; Q·Kᵀ in INT8 and P in ``config.pv_dtype`` for a
  quantized cache); otherwise the whole (dequantized) cache goes to the
  ``attention_fn`` with Flax's decode mask.

  Fallbacks: with attention dropout active (``dropout_rate > 0`` and not
  deterministic) or ``sow_weights=True`` the call runs Flax's exact
  ``dot_product_attention`` (same dropout mask as Flax for the same rng) and
  warns once. Fully masked query rows give the mean of V, as in Flax.
  """

  attention_fn: Optional[Callable[..., Array]] = None
  config: ConfigLike = "sage2-8b"
  implementation: Optional[str] = None
  quantized_cache: bool = False
  logits_soft_cap: Optional[float] = None

  def resolved_attention_fn(self) -> Callable[..., Array]:
    if self.attention_fn is not None:
      return self.attention_fn
    return attention_fn(self.config, self.implementation,
                        self.logits_soft_cap)

  @linen.compact
  def __call__(
      self,
      inputs_q: Array,
      inputs_k: Optional[Array] = None,
      inputs_v: Optional[Array] = None,
      *,
      inputs_kv: Optional[Array] = None,
      mask: Optional[Array] = None,
      deterministic: Optional[bool] = None,
      dropout_rng: Optional[Array] = None,
      sow_weights: bool = False,
  ) -> Array:
    """Multi-head attention of ``inputs_q [batch..., T, features]``.

    Args:
      inputs_q: queries ``[batch..., T, features]``.
      inputs_k: keys ``[batch..., S, features]``; default ``inputs_q``.
      inputs_v: values ``[batch..., S, features]``; default ``inputs_k``.
      inputs_kv: deprecated (as in Flax): keys and values at once.
      mask: bool (or 0/1) ``[batch..., N|1, T, S]``, True = attend.
      deterministic: disables dropout; merged with the field as in Flax.
      dropout_rng: dropout key; default ``self.make_rng('dropout')``.
      sow_weights: store the attention weights in ``'intermediates'`` (exact
        fallback).

    Returns:
      ``[batch..., T, out_features or features]``.
    """
    if inputs_kv is not None:
      if inputs_k is not None or inputs_v is not None:
        raise ValueError("Pass either inputs_kv or inputs_k/inputs_v.")
      warnings.warn("inputs_kv is deprecated in Flax; pass inputs_k instead.",
                    DeprecationWarning, stacklevel=2)
      inputs_k = inputs_kv
    inputs_k, inputs_v = resolve_inputs(inputs_q, inputs_k, inputs_v)
    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    if qkv_features % self.num_heads:
      raise ValueError(f"qkv_features={qkv_features} is not divisible by "
                       f"num_heads={self.num_heads}.")
    head_dim = qkv_features // self.num_heads
    projection = functools.partial(
        linen.DenseGeneral, features=(self.num_heads, head_dim), axis=-1,
        dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init,
        use_bias=self.use_bias, precision=self.precision,
        dot_general=self.qkv_dot_general,
        dot_general_cls=self.qkv_dot_general_cls)
    query = projection(name="query")(inputs_q)
    key = projection(name="key")(inputs_k)
    value = projection(name="value")(inputs_v)
    if self.normalize_qk:
      norm = functools.partial(linen.LayerNorm, use_bias=False,
                               dtype=self.dtype, param_dtype=self.param_dtype)
      query = norm(name="query_ln")(query)
      key = norm(name="key_ln")(key)

    fn = self.resolved_attention_fn()
    if self.dropout_rate > 0.0:
      deterministic = merge_param("deterministic", self.deterministic,
                                  deterministic)
      if not deterministic and dropout_rng is None:
        dropout_rng = self.make_rng("dropout")
    else:
      deterministic = True
    x, extra = None, {}
    if self.decode:
      direct = (mask is None and deterministic and not sow_weights
                and not self.qk_attn_weights_einsum_cls
                and not self.attn_weights_value_einsum_cls)
      x, key, value, mask, extra = self._decode_step(fn, query, key, value,
                                                     mask, direct)
    kwargs = dict(
        mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
        broadcast_dropout=self.broadcast_dropout, deterministic=deterministic,
        dtype=self.dtype, precision=self.precision,
        force_fp32_for_softmax=self.force_fp32_for_softmax, **extra)
    if self.qk_attn_weights_einsum_cls or self.attn_weights_value_einsum_cls:
      kwargs["qk_attn_weights_einsum"] = (
          self.qk_attn_weights_einsum_cls and self.qk_attn_weights_einsum_cls())
      kwargs["attn_weights_value_einsum"] = (
          self.attn_weights_value_einsum_cls
          and self.attn_weights_value_einsum_cls())
    if sow_weights:  # Flax hands the module over unfiltered.
      extra_kwargs = {"module": self}
    else:
      extra_kwargs = {}
    if x is None:
      x = call_attention_fn(fn, (query, key, value), kwargs,
                            filter_kwargs=True, **extra_kwargs)
    return linen.DenseGeneral(
        features=features, axis=(-2, -1),
        kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init,
        use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision,
        dot_general=self.out_dot_general,
        dot_general_cls=self.out_dot_general_cls, name="out")(x)

  def _decode_step(self, fn, query, key, value, mask, direct: bool):
    """Creates the cache on init; afterwards appends the T new tokens.

    Returns ``(x, key, value, mask, extra)``: with ``direct`` (no mask,
    dropout or weights to sow) and sagejax's ``attention_fn``, ``x`` is the
    new tokens' attention read straight from the cache
    (:func:`paged_decode`); otherwise ``x`` is None and ``key``/``value`` are
    the whole cache for the ``attention_fn`` to attend with ``mask``/``extra``.
    """
    initialized = self.has_variable("cache", "cached_key")
    layout = cache_layout(key.shape, key.dtype, self.quantized_cache)
    variables = {name: self.variable("cache", name, jnp.zeros, shape, dtype)
                 for name, (shape, dtype) in layout.items()}
    index = self.variable("cache", "cache_index",
                          lambda: jnp.array(0, jnp.int32))
    if not initialized:
      return None, key, value, mask, {}
    start, t = index.value, key.shape[-3]
    cache = write_cache({name: var.value for name, var in variables.items()},
                        start, key, value)
    for name, var in variables.items():
      var.value = cache[name]
    index.value = start + t
    if direct:
      x = paged_decode(fn, cache, start, query)
      if x is not None:
        return x, key, value, mask, {}
    key, value = read_cache(cache, key.dtype)
    mask, extra = decode_attention_inputs(fn, mask, start, t, key.shape[:-3],
                                          key.shape[-3])
    return None, key, value, mask, extra


class MultiHeadDotProductAttention(SageMultiHeadAttention):
  """:class:`SageMultiHeadAttention` under Flax's class name (same auto-names)."""


class MultiHeadAttention(SageMultiHeadAttention):
  """:class:`SageMultiHeadAttention` under Flax's alias name (same auto-names)."""

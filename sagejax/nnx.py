"""Flax NNX integration: a drop-in ``nnx.MultiHeadAttention``.

::

  from sagejax.nnx import MultiHeadAttention   # was flax.nnx.MultiHeadAttention

:class:`SageMultiHeadAttention` takes ``nnx.MultiHeadAttention``'s arguments
(``num_kv_heads`` for GQA included) plus ``config``, ``implementation``,
``logits_soft_cap`` and ``quantized_cache``, builds the same submodules and
parameters, and keeps ``init_cache``/``decode``, ``is_causal`` and ``rngs``.
For a model that takes an ``attention_fn``, pass
:func:`sagejax.nn.attention_fn` instead.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.module import first_from

from sagejax.config import ConfigLike, resolve_config
from sagejax import nn as _sage_nn
from sagejax.nn import (
    cache_layout,
    call_attention_fn,
    decode_attention_inputs,
    paged_decode,
    read_cache,
    resolve_inputs,
    write_cache,
)

Array = jax.Array

_CACHE_NAMES = ("cached_key", "cached_key_scale", "cached_value",
                "cached_value_scale", "cached_key_smooth",
                "cached_value_smooth", "cache_smooth_fixed")


class SageMultiHeadAttention(nnx.MultiHeadAttention):
  """SageAttention drop-in for :class:`flax.nnx.MultiHeadAttention`.

  Parameters are Flax's: ``query [in_features, N, H]``, ``key``/``value
  [in_kv_features, K, H]`` (K = ``num_kv_heads``, default N), ``out [N, H,
  out_features]``, biases, and ``query_ln``/``key_ln`` with ``normalize_qk``;
  ``nnx.state`` moves between the two classes unchanged. GQA runs without
  repeating K/V heads.

  Args:
    num_heads, in_features, qkv_features, out_features, num_kv_heads,
      in_kv_features, **kwargs: as :class:`flax.nnx.MultiHeadAttention`
      (``rngs`` is required there too).
    config: :class:`sagejax.SageConfig` or preset name (default
      ``"sage2-8b"``).
    implementation: backend for :func:`sagejax.attention` (None: fastest).
    logits_soft_cap: Gemma-2's logit soft cap (float > 0) or None; see
      :func:`sagejax.attention`.
    quantized_cache: :meth:`init_cache` makes an INT8 K / FP8 e4m3 V cache
      (:func:`sagejax.nn.cache_layout`: f32 per-(token, head) scales
      ``cached_key_scale``/``cached_value_scale [batch..., S, K]`` and
      smoothing vectors), about half a bf16 cache, read directly by
      :mod:`sagejax.serving`'s kernels (see :mod:`sagejax.nn`'s module).
    attention_fn: None for SageAttention with ``config``; any Flax
      ``attention_fn`` replaces it.

  Attention-weight dropout and ``sow_weights=True`` fall back to Flax's exact
  attention with a one-time warning (see :mod:`sagejax.nn`).
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      qkv_features: Optional[int] = None,
      out_features: Optional[int] = None,
      num_kv_heads: Optional[int] = None,
      in_kv_features: Optional[int] = None,
      *,
      config: ConfigLike = "sage2-8b",
      implementation: Optional[str] = None,
      quantized_cache: bool = False,
      attention_fn: Optional[Callable[..., Array]] = None,
      logits_soft_cap: Optional[float] = None,
      **kwargs: Any,
  ):
    config = resolve_config(config)
    fn = attention_fn or _sage_nn.attention_fn(config, implementation,
                                               logits_soft_cap)
    super().__init__(num_heads, in_features, qkv_features, out_features,
                     num_kv_heads, in_kv_features, attention_fn=fn, **kwargs)
    self.config = config
    self.implementation = implementation
    self.logits_soft_cap = logits_soft_cap
    self.quantized_cache = quantized_cache
    for name in _CACHE_NAMES[1:]:
      if name != "cached_value":
        setattr(self, name, nnx.data(None))

  def init_cache(self, input_shape: tuple[int, ...],
                 dtype: Any = jnp.float32) -> None:
    """Makes an empty cache for inputs ``[batch..., max_length, features]``.

    ``dtype`` is the plain cache's; a quantized cache ignores it.
    """
    shape = (*input_shape[:-1], self.num_kv_heads, self.head_dim)
    for name, (shape_, dtype_) in cache_layout(shape, dtype,
                                               self.quantized_cache).items():
      setattr(self, name, nnx.Cache(jnp.zeros(shape_, dtype_)))
    self.cache_index = nnx.Cache(jnp.array(0, dtype=jnp.int32))

  def set_view(self, deterministic: Optional[bool] = None,
               decode: Optional[bool] = None, batch_size: Any = None,
               max_length: Optional[int] = None):
    """As Flax's; also creates a missing cache (in this module's layout)."""
    super().set_view(deterministic=deterministic, decode=decode,
                     batch_size=batch_size, max_length=max_length)
    if decode and self.cached_key is None and None not in (batch_size,
                                                           max_length):
      batch = (batch_size,) if isinstance(batch_size, int) else batch_size
      self.init_cache((*batch, max_length, self.in_features),
                      self.dtype or jnp.float32)

  def __call__(
      self,
      inputs_q: Array,
      inputs_k: Optional[Array] = None,
      inputs_v: Optional[Array] = None,
      *,
      mask: Optional[Array] = None,
      deterministic: Optional[bool] = None,
      rngs: Any = None,
      sow_weights: bool = False,
      decode: Optional[bool] = None,
      is_causal: bool = False,
      out_sharding: Any = None,
      qkv_sharding: Any = None,
  ) -> Array:
    """Multi-head attention of ``inputs_q [batch..., T, in_features]``.

    Same arguments as :meth:`flax.nnx.MultiHeadAttention.__call__`: ``mask``
    ``[batch..., N|1, T, S]`` (True = attend), ``is_causal`` top-left aligned,
    ``decode`` (after :meth:`init_cache`: T >= 1 tokens per call, appended
    and attending causally to the cache), ``rngs`` for dropout. Returns
    ``[batch..., T, out_features]``.
    """
    decode = first_from(
        decode, self.decode,
        error_msg="No `decode` argument was given to SageMultiHeadAttention, "
                  "neither in the call nor as an attribute.")
    if not decode:
      return super().__call__(
          inputs_q, inputs_k, inputs_v, mask=mask, deterministic=deterministic,
          rngs=rngs, sow_weights=sow_weights, decode=False,
          is_causal=is_causal, out_sharding=out_sharding,
          qkv_sharding=qkv_sharding)
    return self._decode(inputs_q, inputs_k, inputs_v, mask=mask,
                        deterministic=deterministic, rngs=rngs,
                        sow_weights=sow_weights, is_causal=is_causal,
                        out_sharding=out_sharding, qkv_sharding=qkv_sharding)

  def _decode(self, inputs_q, inputs_k, inputs_v, *, mask, deterministic,
              rngs, sow_weights, is_causal, out_sharding, qkv_sharding):
    """One autoregressive step: append the T new tokens' K/V, attend."""
    if self.cached_key is None or self.cache_index is None:
      raise ValueError("Autoregressive cache not initialized: call "
                       "init_cache first.")
    inputs_k, inputs_v = resolve_inputs(inputs_q, inputs_k, inputs_v)
    query = self.query(inputs_q, out_sharding=qkv_sharding)
    key = self.key(inputs_k, out_sharding=qkv_sharding)
    value = self.value(inputs_v, out_sharding=qkv_sharding)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)

    names = [n for n in _CACHE_NAMES if getattr(self, n) is not None]
    index, t = self.cache_index[...], key.shape[-3]
    cache = write_cache({n: getattr(self, n)[...] for n in names}, index, key,
                        value)
    for n in names:
      getattr(self, n)[...] = cache[n]
    self.cache_index[...] = index + t

    dropout_rng = None
    if self.dropout_rate > 0.0:
      deterministic = first_from(
          deterministic, self.deterministic,
          error_msg="No `deterministic` argument was given to "
                    "SageMultiHeadAttention, neither in the call nor as an "
                    "attribute.")
      if not deterministic:
        stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs
        stream = self.rngs if stream is None else stream
        if stream is None:
          raise ValueError("Dropout needs `rngs` in the call (this module "
                           "keeps none).")
        dropout_rng = stream()
    else:
      deterministic = True
    if mask is None and not sow_weights and deterministic:
      x = paged_decode(self.attention_fn, cache, index, query)
      if x is not None:
        return self.out(x, out_sharding=out_sharding)
    key, value = read_cache(cache, key.dtype)
    mask, extra = decode_attention_inputs(self.attention_fn, mask, index, t,
                                          key.shape[:-3], key.shape[-3])
    kwargs = dict(mask=mask, dropout_rng=dropout_rng,
                  dropout_rate=self.dropout_rate,
                  broadcast_dropout=self.broadcast_dropout,
                  deterministic=deterministic, dtype=self.dtype,
                  precision=self.precision,
                  module=self if sow_weights else None, is_causal=is_causal)
    x = call_attention_fn(self.attention_fn, (query, key, value), kwargs,
                          filter_kwargs=False, **extra)
    return self.out(x, out_sharding=out_sharding)


MultiHeadAttention = SageMultiHeadAttention

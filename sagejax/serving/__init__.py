"""Serving: a paged, quantized KV cache with decode and extend attention.

::

  from sagejax import serving
  cache = serving.PagedKVCache.create(num_pages=1024, page_size=16,
                                      num_kv_heads=8, head_dim=128)
  cache = serving.append(cache, k, v, page_table, positions)  # donates cache
  out = serving.decode_attention(q, cache, page_table, lengths)     # [B, N, H]
  out = serving.extend_attention(q, cache, page_table, lengths)  # [B, T, N, H]

See :mod:`sagejax.serving.cache` (layout, quantization, smoothing),
:mod:`sagejax.serving.attention` (the attention calls),
:mod:`sagejax.serving.triton_paged` (the Triton kernel),
:mod:`sagejax.serving.mosaic_paged` (decode and extend on Hopper) and
:mod:`sagejax.serving.reference` (its ``"xla"`` reference).
"""

from sagejax.serving.attention import (
    MOSAIC_EXTEND_CONFIG,
    SERVING_CONFIG,
    decode_attention,
    default_tiling,
    extend_attention,
)
from sagejax.kernels.mosaic_decode import DecodeTiling
from sagejax.serving.cache import PagedKVCache, append
from sagejax.serving.triton_paged import PagedTiling

__all__ = [
    "DecodeTiling",
    "MOSAIC_EXTEND_CONFIG",
    "PagedKVCache",
    "PagedTiling",
    "SERVING_CONFIG",
    "append",
    "decode_attention",
    "default_tiling",
    "extend_attention",
]

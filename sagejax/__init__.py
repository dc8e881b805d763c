"""sagejax: SageAttention-style quantized attention for JAX.

``sagejax.attention`` is a drop-in for ``jax.nn.dot_product_attention`` that
computes Q·Kᵀ in INT8/INT4 and P·V in FP8 (SageAttention, arXiv 2410.02367;
SageAttention2, arXiv 2411.10958).
"""

from sagejax import quant
from sagejax.api import attention
from sagejax.config import PRESETS, SageConfig, resolve_config
from sagejax.reference import exact_attention
from sagejax.ring import (
    ring_attention,
    ring_attention_on_mesh,
    zigzag_order,
    zigzag_restore,
)

__all__ = [
    "PRESETS",
    "SageConfig",
    "attention",
    "exact_attention",
    "quant",
    "resolve_config",
    "ring_attention",
    "ring_attention_on_mesh",
    "zigzag_order",
    "zigzag_restore",
]

__version__ = "0.1.0"

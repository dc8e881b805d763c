"""Small helpers shared by the Pallas Triton kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


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

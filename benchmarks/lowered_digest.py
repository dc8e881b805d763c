"""Digests of the Mosaic GPU kernels as lowered for CUDA, on any machine.

    python benchmarks/lowered_digest.py > before.txt
    (change the kernels' code)
    python benchmarks/lowered_digest.py | diff before.txt -

Lowers the forward (sage2-8b and sage1, causal and not; H=256 in column
parts), the backward (dQ fused and in its own kernel; H=256's wide
kernels), the serving decode (8-bit and bf16 pages) and extend (8-bit
pages) for CUDA
(``.lower(lowering_platforms=("cuda",))``, no GPU needed) with source
locations left out of the MLIR
(``jax_traceback_in_locations_limit=0``), and prints an MD5 per program. A
change that only moves or renames code (a refactor, a shim for a renamed
API) leaves every digest as it was; then, under this JAX version, the
kernels the GPU ran are the kernels the change ships. Digests depend on
the JAX version: compare runs of one environment, and do not read equal
digests under 0.10 as proof that 0.11 lowers the change (a refactor that
kept every 0.10.2 digest failed to compile under 0.11.2: NOTES B34); run
the GPU tests of the kernels it touches.
"""

from __future__ import annotations

import functools
import hashlib
import unittest.mock

import jax
import jax.numpy as jnp

jax.config.update("jax_traceback_in_locations_limit", 0)

from sagejax import PRESETS, _inputs, serving  # noqa: E402
from sagejax.backends import mosaic  # noqa: E402
from sagejax.serving import attention as serving_attention  # noqa: E402


def programs():
  """(name, function, example arguments) of each program to lower."""
  q = jax.ShapeDtypeStruct((2, 300, 4, 128), jnp.bfloat16)
  for causal in (False, True):
    for preset in ("sage2-8b", "sage1"):
      config = PRESETS[preset]

      def forward(q, k, v, config=config, causal=causal):
        call = _inputs.parse(q, k, v, is_causal=causal)
        prepared = mosaic.BACKEND.prepare(call, config)
        return mosaic.BACKEND.kernel(prepared, call, config)
      yield f"forward {preset} causal={causal}", forward, (q, q, q)
  q256 = jax.ShapeDtypeStruct((2, 300, 4, 256), jnp.bfloat16)
  yield "forward sage2-8b causal=True H=256", functools.partial(
      forward, config=PRESETS["sage2-8b"], causal=True), (q256,) * 3
  d_lse = jax.ShapeDtypeStruct((2, 4, 300), jnp.float32)
  for fused in (True, False):
    config = PRESETS["sage2-8b"]
    tiling = mosaic.default_backward_tiling(128, fused)

    def backward(q, k, v, do, d_lse, config=config, tiling=tiling):
      call = _inputs.parse(q, k, v, is_causal=True)
      stats = mosaic.BACKEND.forward(call, config)
      return mosaic.BACKEND.backward(call, config, do, d_lse, stats, tiling)
    yield f"backward fused_dq={fused}", backward, (q, q, q, q, d_lse)
  yield "backward H=256", functools.partial(
      backward, config=PRESETS["sage2-8b"].replace(backward_stats="saved"),
      tiling=None), (q256,) * 4 + (d_lse,)
  table = jnp.arange(64, dtype=jnp.int32).reshape(4, 16)
  lengths = jnp.full((4,), 900, jnp.int32)
  for quantized in (True, False):
    cache = serving.PagedKVCache.create(
        num_pages=64, page_size=64, num_kv_heads=2, head_dim=128,
        quantized=quantized, dtype=jnp.bfloat16)
    qd = jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16)
    qe = jax.ShapeDtypeStruct((4, 100, 8, 128), jnp.bfloat16)

    def decode(q, cache):
      return serving.decode_attention(q, cache, table, lengths,
                                      implementation="mosaic")

    def extend(q, cache):
      return serving.extend_attention(q, cache, table, lengths,
                                      implementation="mosaic")
    yield f"decode quantized={quantized}", decode, (qd, cache)
    if quantized:  # the Mosaic extend reads 8-bit pages only
      yield "extend quantized=True", extend, (qe, cache)


def main():
  # Lowering for CUDA on a CPU host: tell the serving API it runs on Hopper.
  with unittest.mock.patch.object(serving_attention, "is_hopper",
                                  lambda: True):
    for name, fn, args in programs():
      text = jax.jit(fn).trace(*args).lower(
          lowering_platforms=("cuda",)).as_text()
      print(f"{hashlib.md5(text.encode()).hexdigest()}  {name}")


if __name__ == "__main__":
  main()

"""Where a decode call's device time goes: the Mosaic decode beside cuDNN.

  PYTHONPATH=$PWD python benchmarks/decode_profile.py [--shapes "32,4096,128;..."]

For each ``B,tokens,page_size`` (GQA 32/8, H=128, bf16 q, INT8/FP8 pages of
random data): ``serving.decode_attention(implementation="mosaic")`` and
dense cuDNN on the same tokens, compiled and warmed up, then 20 back-to-back
calls timed on the host (wall) and under the JAX profiler, whose trace gives
each GPU kernel's time (``profile_step.kernel_times``): the kernel itself and
the XLA glue around it (Q quantization, the split merge, the bad-sequence
check).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import serving_check  # noqa: E402  pylint: disable=wrong-import-position
from profile_step import kernel_times  # noqa: E402  pylint: disable=wrong-import-position

from sagejax import serving  # noqa: E402  pylint: disable=wrong-import-position

N, K, H = serving_check.N, serving_check.K, serving_check.H


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default="32,4096,128;32,16384,128")
  p.add_argument("--calls", type=int, default=20)
  args = p.parse_args()
  for shape in args.shapes.split(";"):
    b, s, ps = (int(x) for x in shape.split(","))
    pools = serving_check.random_pages(jax.random.key(0), b * s // 16, 16,
                                       True, b)
    table = jnp.asarray(np.random.RandomState(0).permutation(
        b * s // ps).reshape(b, s // ps).astype(np.int32))
    lengths = jnp.full((b,), s, jnp.int32)
    q = jax.random.normal(jax.random.key(1), (b, N, H), jnp.bfloat16)
    fns = {
        "mosaic": jax.jit(lambda q, pools: serving.decode_attention(
            q, serving_check._cache(pools, True, ps), table, lengths,  # pylint: disable=protected-access
            implementation="mosaic")),
        "cudnn": jax.jit(lambda q, pools: jax.nn.dot_product_attention(
            q[:, None], *pools["dense"], implementation="cudnn")[:, 0]),
    }
    for name, fn in fns.items():
      jax.block_until_ready(fn(q, pools))
      jax.block_until_ready(fn(q, pools))
      t0 = time.perf_counter()
      for _ in range(args.calls):
        r = fn(q, pools)
      jax.block_until_ready(r)
      wall = (time.perf_counter() - t0) / args.calls * 1e6
      with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
          for _ in range(args.calls):
            r = fn(q, pools)
          jax.block_until_ready(r)
        times, _ = kernel_times(d, args.calls)
      total = sum(t for t, _ in times.values()) / args.calls
      print(f"\n## {name} B={b} tokens={s} pages of {ps}: wall {wall:.1f} us,"
            f" kernels {total:.1f} us per call", flush=True)
      for k, (t, c) in sorted(times.items(), key=lambda x: -x[1][0]):
        print(f"  {t / args.calls:8.1f} us x{max(1, c // args.calls)} "
              f"{k[:100]}")


if __name__ == "__main__":
  main()

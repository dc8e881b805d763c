"""Shared fixtures: fresh, reproducible PRNG keys and inputs for every check.

On a CPU-only run (``JAX_PLATFORMS=cpu``, as CI sets it) XLA compiles
without LLVM's optimizations: the suite's time is mostly compiling small
programs once (18.8 → 11.7-14.0 minutes at ``-n 2``; level 1: 15.4, its
large accuracy checks faster but its compiles slower). Results can differ
from an optimized build in the last bits (no contracted multiply-adds; e.g. a
cosine 0.99938273707 vs ...06), far inside every tolerance.
"""

import itertools
import os
import zlib

if (os.environ.get("JAX_PLATFORMS") == "cpu"
    and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS",
                                                               "")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest

from sagejax.testing import make_qkv

_make_qkv = jax.jit(make_qkv, static_argnums=tuple(range(1, 7)),
                    static_argnames=("kind", "dtype", "layout"))


@pytest.fixture
def next_key(request):
  """A function returning a new PRNG key on each call.

  Keys derive from the test's node id (name and parameters) and a per-test
  counter, so every check draws its own inputs, reproducibly.
  """
  base = jax.random.key(zlib.crc32(request.node.nodeid.encode()))
  counter = itertools.count()
  return lambda: jax.random.fold_in(base, next(counter))


@pytest.fixture
def qkv(next_key):
  """``qkv(B, T, S, N, K, H, kind=, dtype=, layout=)``: ``make_qkv`` (jitted)
  with a fresh key on every call."""
  return lambda *shape, **kw: _make_qkv(next_key(), *shape, **kw)

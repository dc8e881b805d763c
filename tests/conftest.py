"""Shared fixtures: fresh, reproducible PRNG keys and inputs for every check."""

import itertools
import zlib

import jax
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

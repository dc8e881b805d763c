"""Attention backends: each turns a checked call into (output, LSE).

A backend is a module-level object with ``name``, ``available()``,
``unsupported(call, config)`` (None, or the reason it cannot serve the call)
and ``forward(call, config)``. ``forward`` takes a checked call
(:class:`sagejax._inputs.ParsedCall`, Q/K/V 4-D in ``call.layout``) and returns
the output in that same layout (any float dtype; the caller casts) and the
natural-log LSE, f32 ``[B, N, T]``. It does its own quantization, mirroring
:mod:`sagejax.quant`, and may read the caller's layout directly.

``forward`` is split in two so that benchmarks can time the attention alone:
``prepare(call, config)`` returns a pytree of quantized inputs and
``kernel(prepared, call, config)`` the same ``(output, lse)`` as ``forward``;
``kernel`` reads only static fields, shapes, masks and lengths of ``call``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Protocol

import jax

from sagejax._inputs import ParsedCall
from sagejax.config import SageConfig


class Backend(Protocol):
  name: str

  def available(self) -> bool: ...

  def unsupported(self, call: ParsedCall, config: SageConfig
                  ) -> Optional[str]: ...

  def prepare(self, call: ParsedCall, config: SageConfig) -> Any: ...

  def kernel(self, prepared: Any, call: ParsedCall, config: SageConfig
             ) -> tuple[jax.Array, jax.Array]: ...

  def forward(self, call: ParsedCall, config: SageConfig
              ) -> tuple[jax.Array, jax.Array]: ...


@functools.cache
def registry() -> dict[str, Backend]:
  """Backends by name, fastest first (the order ``implementation=None`` tries)."""
  from sagejax.backends import xla
  backends: list[Backend] = []
  try:
    from sagejax.backends import mosaic
    backends.append(mosaic.BACKEND)
  except ImportError:  # pragma: no cover - Mosaic GPU missing from this jax
    pass
  try:
    from sagejax.backends import pallas_triton
    backends.append(pallas_triton.BACKEND)
  except ImportError:  # pragma: no cover - Pallas missing from this jax build
    pass
  backends.append(xla.BACKEND)
  return {b.name: b for b in backends}


def select(name: Optional[str], call: ParsedCall, config: SageConfig
           ) -> Backend:
  """The backend named, or the first available one that serves the call."""
  backends = registry()
  if name is not None:
    if name not in backends:
      raise ValueError(f"Unknown implementation {name!r}: pass one of "
                       f"{tuple(backends)} or None (pick automatically).")
    backend = backends[name]
    if not backend.available():
      raise ValueError(f"implementation={name!r} is not available on this "
                       f"machine ({jax.default_backend()}); pass "
                       "implementation=None or 'xla'.")
    reason = backend.unsupported(call, config)
    if reason is not None:
      raise ValueError(f"implementation={name!r} cannot serve this call: "
                       f"{reason}. Pass implementation='xla', which serves "
                       "every call.")
    return backend
  for backend in backends.values():
    if backend.available() and backend.unsupported(call, config) is None:
      return backend
  raise AssertionError("the 'xla' backend serves every call")

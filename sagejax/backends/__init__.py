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

A backend may also run the backward (``jax.grad``): ``backward_unsupported(
call, config)`` (None, or why not) and ``backward(call, config, d_out, d_lse,
saved)``, see :class:`BackwardBackend`. The custom VJP uses the backward of
the backend that ran the forward when it has one and it serves the call
(else another kernel backend's: :func:`backward_of`), and the exact FP32
``"xla"`` backward (:mod:`sagejax._vjp`) otherwise.
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


class BackwardBackend(Backend, Protocol):
  """A backend with its own backward (gradients of exact attention).

  ``backward(call, config, d_out, d_lse, saved)``:

  * ``call``: the forward's checked call (Q/K/V 4-D in ``call.layout``,
    mask, bias, lengths, ``spec``, ``sm_scale``).
  * ``d_out``: the output's cotangent, ``call.layout``, Q's dtype.
  * ``d_lse``: the LSE's cotangent, f32 ``[B, N, T]`` (zeros when unused).
  * ``saved``: ``(output in call.layout, natural-log LSE f32 [B, N, T])`` of
    the forward when ``config.saved_stats`` (take δ = rowsum(dO ∘ O) and the
    softmax statistics from them), else None (recompute them exactly).

  Returns ``(dq, dk, dv, dbias)``: dq, dk, dv in ``call.layout`` and the
  inputs' dtypes, dbias in the bias's own shape and dtype (None without a
  bias).
  """

  def backward_unsupported(self, call: ParsedCall, config: SageConfig
                           ) -> Optional[str]: ...

  def backward(self, call: ParsedCall, config: SageConfig, d_out: jax.Array,
               d_lse: jax.Array,
               saved: Optional[tuple[jax.Array, jax.Array]],
               ) -> tuple[jax.Array, jax.Array, jax.Array,
                          Optional[jax.Array]]: ...


def backward_of(name: str, call: ParsedCall, config: SageConfig
                ) -> Optional[BackwardBackend]:
  """The backend whose backward runs after a forward by backend ``name``.

  ``name``'s own backward when it has one that serves ``call``. A kernel
  backend without one (or whose backward refuses the call) borrows the first
  available backend's, in registry order, that serves it: the gradient is
  that of exact attention whichever kernels compute it. None (→ the exact
  ``"xla"`` backward) when none does, and always after an ``"xla"`` forward:
  that path is the oracle.
  """
  backends = registry()
  own = backends[name]
  if name == "xla":
    return None
  for backend in [own] + [b for b in backends.values() if b is not own]:
    if not callable(getattr(backend, "backward", None)):
      continue
    if backend is not own and not backend.available():
      continue
    if backend.backward_unsupported(call, config) is None:
      return backend
  return None


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

"""Attention backends: each turns a checked call into (output, LSE).

A backend is a module-level object with ``name``, ``platform``,
``default_preset``, ``available()``, ``unsupported(call, config)`` (None, or
the reason it cannot serve the call) and ``forward(call, config)``.
``forward`` takes a checked call (:class:`sagejax._inputs.ParsedCall`, Q/K/V
4-D in ``call.layout``) and returns the output in that same layout (any float
dtype; the caller casts) and the natural-log LSE, f32 ``[B, N, T]``. It does
its own quantization, mirroring :mod:`sagejax.quant`, and may read the
caller's layout directly.

``forward`` is split in two so that benchmarks can time the attention alone:
``prepare(call, config)`` returns a pytree of quantized inputs and
``kernel(prepared, call, config)`` the same ``(output, lse)`` as ``forward``;
``kernel`` reads only static fields, shapes, masks and lengths of ``call``.

A backend may also run the backward (``jax.grad``): ``backward_unsupported(
call, config)`` (None, or why not) and ``backward(call, config, d_out, d_lse,
saved)``, see :class:`BackwardBackend`. The custom VJP uses the backward of
the backend that ran the forward when it has one and it serves the call
(else another kernel backend's: :func:`backward_of`), and the exact FP32
``"xla"`` backward (:mod:`sagejax._vjp`) otherwise. A backend whose
backward would rather have another row statistic than the LSE saved (the
Mosaic one: lse₂, so that its backward need not read Q) declares
``saves_lse2(call, config)`` and ``forward_residual(call, config) ->
(output, lse, lse₂)``; its own backward then gets ``saved_lse2=True``. One
whose forward can also hand its backward K − k̄ (the Mosaic K pass writes
it, so that the backward need not read K again) declares
``centres_k(call, config)`` and takes ``forward_residual(call, config,
centre_k=True) -> (output, lse, lse₂, (K − k̄, k̄))``; the residual K is then
K − k̄, and its backward gets ``k_bar=k̄``.

Choosing a backend (``implementation=None``) happens per platform at lowering
time (:func:`plan`, :func:`sagejax._platforms.platform_dependent`), so that a
module exported on any host carries the GPU kernels for the GPU and the
``"xla"`` path elsewhere. What a backend declares for that, without needing a device:

* ``platform``: the lowering platform its kernels run on (``"cuda"``), or
  None for one that runs on every platform (``"xla"``, the fallback).
* ``unsupported(call, config)``: static (shapes, dtypes, config), never the
  device.
* ``min_compute_capability`` (optional, default 0): the oldest GPU it runs
  on. ``available()`` says whether a device of *this* machine runs it.
* ``custom_call_targets`` (optional): the custom calls its kernels lower to,
  which ``jax.export`` must be told to accept (:func:`export_disabled_checks`).

A preset per backend: ``default_preset`` names the preset that
``config=None`` / ``"auto"`` means on that backend: the one no other preset
beats on both speed and accuracy there (``benchmarks/preset_sweep.py``
measures it). A backend that declares none gets :data:`FALLBACK_PRESET`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Protocol

import jax

from sagejax._inputs import ParsedCall
from sagejax.config import PRESETS, ConfigLike, SageConfig, resolve_config

# The preset of a backend that declares no ``default_preset``.
# >>> mosaic: to be measured. The Mosaic GPU backend (sm90) sets
# >>> ``default_preset`` in sagejax/backends/mosaic.py once
# >>> benchmarks/preset_sweep.py has measured which preset no other beats on
# >>> both speed and accuracy there; until then it gets this one, the preset
# >>> it was written for.
FALLBACK_PRESET = "sage2-8b"


class Backend(Protocol):
  name: str
  platform: Optional[str]
  default_preset: str

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
    softmax statistics from them); ``(None, LSE)`` or None otherwise: the
    exact statistics are recomputed (the forward's LSE may serve as an
    estimate).

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


def default_preset(backend: "Backend | str | None" = None) -> str:
  """The preset ``config=None`` / ``"auto"`` means on ``backend`` (an object
  or name; None: the first backend available on this machine)."""
  if backend is None:
    backend = next(b for b in registry().values() if b.available())
  elif isinstance(backend, str):
    backend = registry()[backend]
  name = getattr(backend, "default_preset", FALLBACK_PRESET)
  if name not in PRESETS:
    raise AssertionError(f"backend {backend.name!r} declares an unknown "
                         f"default_preset {name!r}")
  return name


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which backend and config a call runs, per lowering platform.

  Attributes:
    backend, config: for every platform not in ``per_platform`` (and for a
      named ``implementation``, for all).
    per_platform: ``(platform, backend name, config)`` for the platforms
      whose kernels serve the call (``"cuda"``), chosen at lowering time.
  """
  backend: str
  config: SageConfig
  per_platform: tuple[tuple[str, str, SageConfig], ...] = ()


def _has_local_devices(platform: str) -> bool:
  """Whether this machine has devices of a lowering platform (``"cuda"``)."""
  try:
    return bool(jax.devices(platform))
  except (RuntimeError, ValueError):  # no such backend here
    return platform == "cuda" and jax.default_backend() == "gpu"


def plan(name: Optional[str], call: ParsedCall, config: ConfigLike | None
         ) -> Plan:
  """What a call runs: the backend named (checked as :func:`select`), or,
  for ``name=None``, per platform:

  * where this machine has devices of the platform: the first backend (in
    registry order, fastest first) for it that is available and serves the
    call, as :func:`select` picks;
  * for a platform this machine lacks (exporting for a GPU from a CPU host):
    the first serving backend among those that run on the oldest devices
    (lowest ``min_compute_capability``), since the exported module may meet
    any GPU sagejax supports; a call only newer-GPU backends serve takes the
    fallback there too;
  * everywhere else: the first platform-independent backend (``"xla"``).
  """
  if name is not None:
    backend = _check_named(name, call, config)
    return Plan(backend.name, resolve_config(config, backend))
  fallback = next(b for b in registry().values() if b.platform is None)
  per_platform = []
  platforms = dict.fromkeys(b.platform for b in registry().values()
                            if b.platform is not None)
  for platform in platforms:
    candidates = [b for b in registry().values() if b.platform == platform]
    if _has_local_devices(platform):
      candidates = [b for b in candidates if b.available()]
    else:
      oldest = min(getattr(b, "min_compute_capability", 0.0)
                   for b in candidates)
      candidates = [b for b in candidates
                    if getattr(b, "min_compute_capability", 0.0) == oldest]
    for b in candidates:
      cfg = resolve_config(config, b)
      if b.unsupported(call, cfg) is None:
        per_platform.append((platform, b.name, cfg))
        break
  return Plan(fallback.name, resolve_config(config, fallback), tuple(per_platform))


def _check_named(name: str, call: ParsedCall, config: ConfigLike | None
                 ) -> Backend:
  backends = registry()
  if name not in backends:
    raise ValueError(f"Unknown implementation {name!r}: pass one of "
                     f"{tuple(backends)} or None (pick automatically).")
  backend = backends[name]
  if not backend.available():
    raise ValueError(f"implementation={name!r} is not available on this "
                     f"machine ({jax.default_backend()}); pass "
                     "implementation=None or 'xla'.")
  reason = backend.unsupported(call, resolve_config(config, backend))
  if reason is not None:
    raise ValueError(f"implementation={name!r} cannot serve this call: "
                     f"{reason}. Pass implementation='xla', which serves "
                     "every call.")
  return backend


def select(name: Optional[str], call: ParsedCall, config: ConfigLike | None
           ) -> Backend:
  """The backend named, or the first available one that serves the call on
  this machine's default device."""
  if name is not None:
    return _check_named(name, call, config)
  for backend in registry().values():
    if (backend.available()
        and backend.unsupported(call, resolve_config(config, backend)) is None):
      return backend
  raise AssertionError("the 'xla' backend serves every call")


def export_disabled_checks() -> list:
  """What ``jax.export.export(..., disabled_checks=...)`` needs for sagejax.

  The Pallas kernels lower to custom calls without a cross-version
  compatibility guarantee (``__gpu$xla.gpu.triton`` carries the Triton IR):
  ``jax.export`` refuses them unless told. An exported module holding them
  runs with the jax/jaxlib version that exported it.
  """
  targets = dict.fromkeys(t for b in registry().values()
                          for t in getattr(b, "custom_call_targets", ()))
  return [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]

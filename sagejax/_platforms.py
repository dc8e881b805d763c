"""Per-platform code chosen at lowering time, each branch lowered for its own
platforms only.

:func:`jax.lax.platform_dependent` lowers every branch it keeps for *all* the
module's lowering platforms, so a branch holding a Pallas GPU kernel fails to
lower for ``"cpu"`` in a ``("cuda", "cpu")`` export. :func:`platform_dependent`
here binds one primitive whose lowering rule is per platform
(:func:`jax.interpreters.mlir.lower_per_platform` narrows each rule to its
platforms, and ``mlir.lower_fun`` lowers the branch for those alone). A branch
is traced only when lowered for its platform: on a CPU host the GPU branch is
never traced, except for a GPU export.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

try:  # compiles and caches one primitive (eager calls)
  from jax._src.dispatch import apply_primitive as _apply_primitive
except ImportError:  # pragma: no cover - moved in a later jax
  _apply_primitive = None

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

_select_p = jex_core.Primitive("sage_platform_dependent")
_select_p.multiple_results = True


@dataclasses.dataclass(frozen=True)
class _Flat:
  """A branch on flat arrays: ``fn(*unflatten(args))``, its outputs flattened.

  Frozen (hashable by value when ``fn`` is), so eager calls hit the compile
  cache."""
  fn: Callable[..., Any]
  in_tree: Any

  def __call__(self, *flat):
    args = jax.tree_util.tree_unflatten(self.in_tree, flat)
    return jax.tree_util.tree_leaves(self.fn(*args))


@dataclasses.dataclass(frozen=True)
class _Vmapped:
  """A flat branch under ``jax.vmap`` (batch axis 0 on every output)."""
  fn: Callable[..., Any]
  in_axes: tuple[Optional[int], ...]

  def __call__(self, *flat):
    return jax.vmap(self.fn, in_axes=self.in_axes)(*flat)


def platform_dependent(*args, default: Callable[..., Any], out_shapes: Any,
                       **per_platform: Callable[..., Any]):
  """``per_platform[p](*args)`` when lowered for platform ``p`` (``"cuda"``,
  ``"cpu"``, ...), ``default(*args)`` for any other.

  Args:
    *args: pytrees of arrays (``None`` leaves allowed).
    default, per_platform: functions of ``*args`` returning pytrees shaped as
      ``out_shapes``.
    out_shapes: pytree of :class:`jax.ShapeDtypeStruct`, what every branch
      returns.
  """
  unknown = set(per_platform) - set(PLATFORMS)
  if unknown:
    raise ValueError(f"unknown platforms {sorted(unknown)}; use {PLATFORMS}.")
  flat, in_tree = jax.tree_util.tree_flatten(args)
  shapes, out_tree = jax.tree_util.tree_flatten(out_shapes)
  branches = tuple((p, _Flat(fn, in_tree))
                   for p, fn in sorted(per_platform.items()))
  outs = _select_p.bind(
      *flat, branches=branches + ((None, _Flat(default, in_tree)),),
      out_avals=tuple(jax.core.ShapedArray(s.shape, s.dtype) for s in shapes))
  return jax.tree_util.tree_unflatten(out_tree, outs)


def _branch_for(platform: Optional[str], branches):
  for p, fn in branches:
    if p == platform or p is None:
      return fn
  raise AssertionError("the default branch is last")


def _impl(*flat, branches, out_avals):
  if _apply_primitive is not None:
    return _apply_primitive(_select_p, *flat, branches=branches,
                            out_avals=out_avals)
  return jax.jit(lambda *a: _select_p.bind(  # pragma: no cover
      *a, branches=branches, out_avals=out_avals))(*flat)


def _abstract_eval(*avals, branches, out_avals):
  del avals, branches
  return out_avals


def _lowering(platform: Optional[str]):
  def rule(ctx, *flat, branches, out_avals):
    del out_avals
    return mlir.lower_fun(_branch_for(platform, branches),
                          multiple_results=True)(ctx, *flat)
  return rule


def _batch(args, dims, *, branches, out_avals):
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  in_axes = tuple(dims)
  batched = tuple((p, _Vmapped(fn, in_axes)) for p, fn in branches)
  avals = tuple(jax.core.ShapedArray((size,) + a.shape, a.dtype)
                for a in out_avals)
  outs = _select_p.bind(*args, branches=batched, out_avals=avals)
  return outs, [0] * len(outs)


_select_p.def_impl(_impl)
_select_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_select_p, _lowering(None))
for _p in PLATFORMS:
  mlir.register_lowering(_select_p, _lowering(_p), platform=_p)
batching.primitive_batchers[_select_p] = _batch

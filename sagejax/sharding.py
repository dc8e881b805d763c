"""Running per-device kernels on arrays sharded over batch and heads.

A Pallas call is opaque to XLA's SPMD partitioner: under a sharded
``jax.jit`` it would run replicated after an all-gather of its inputs. The
helper here, :func:`batch_head_parallel`, wraps a function so that each device
runs it on its own shard. Every array argument names its axes with *roles*:

* ``BATCH``: independent batch elements. Sharded like the query's batch axis.
* ``HEADS``: query heads; ``KV_HEADS``: key/value heads (GQA: query head ``n``
  reads KV head ``n // G``). Both are split over the same mesh axes, so a
  device's query heads find their KV heads on the same device; the number of
  KV heads must be a multiple of the number of shards.
* any other string (``"query sequence T"``, ``"head dim H"``...): an axis the
  function needs whole. If it is sharded, the call raises a ``ValueError``
  naming the argument, the axis and the mesh axes.

Axes of size 1 (broadcast masks and biases) are replicated. An *output* whose
batch or head axis has size 1 while the inputs are sharded there (the gradient
of a broadcast bias) is summed over those shards.

Two mechanisms, one plan (:func:`_plan`):

* inputs whose types carry explicit shardings (``jax.sharding.AxisType.
  Explicit`` meshes): :func:`jax.shard_map` at trace time;
* otherwise (``NamedSharding``\\ s on a ``jax.jit`` with automatic axes):
  :func:`jax.experimental.custom_partitioning` (the way JAX partitions its
  cuDNN attention), through a primitive with its own ``vmap`` rule (folding a
  vmapped axis into the batch) and ``jvp`` rule.

On one device both reduce to calling the function.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    CompoundFactor,
    SdyShardingRule,
    custom_partitioning,
)
from jax.extend import core as jax_core
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

BATCH = "batch"
HEADS = "heads"
KV_HEADS = "kv_heads"
_PARALLEL = (BATCH, HEADS, KV_HEADS)

Roles = Optional[tuple[str, ...]]  # one role per axis; None: not an array


# ----------------------------------------------------------------------------
# The plan: which mesh axes split which array axes.
# ----------------------------------------------------------------------------


def _mesh_axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, (tuple, list)):
    return tuple(entry)
  return (entry,)


def _padded_spec(spec, ndim: int) -> tuple:
  spec = tuple(spec) if spec is not None else ()
  return spec + (None,) * (ndim - len(spec))


@dataclasses.dataclass(frozen=True)
class _Plan:
  in_specs: tuple[Optional[PartitionSpec], ...]
  out_specs: tuple[PartitionSpec, ...]
  psum_axes: tuple[tuple[str, ...], ...]  # per output: mesh axes to sum over
  sharded: bool


def _plan(names: Sequence[str], in_roles: Sequence[Roles], shapes, specs,
          out_roles: Sequence[tuple[str, ...]], out_shapes,
          mesh_shape: dict[str, int]) -> _Plan:
  """Mesh axes for batch and heads from the inputs' specs; checks the rest.

  ``specs``: per input, its (padded) PartitionSpec entries, or None when the
  input is not an array. Raises ValueError for shardings the kernels cannot
  run with.
  """
  chosen: dict[str, tuple[str, ...]] = {BATCH: (), HEADS: ()}
  for name, roles, shape, spec in zip(names, in_roles, shapes, specs):
    if roles is None or spec is None:
      continue
    for d, (role, entry) in enumerate(zip(roles, spec)):
      axes = _mesh_axes(entry)
      if not axes:
        continue
      if role not in _PARALLEL:
        raise ValueError(
            f"{name} is sharded along its axis {d} ({role}) over mesh axes "
            f"{axes}: sagejax runs each device's kernel on whole sequences "
            "and head dims, so only the batch and head axes may be sharded. "
            + ("For a sequence split over devices (context parallelism) use "
               "sagejax.ring_attention." if "sequence" in role else
               "Replicate this axis (e.g. with jax.lax.with_sharding_"
               "constraint) before the call."))
      key = BATCH if role == BATCH else HEADS
      if not chosen[key]:
        chosen[key] = axes
  if set(chosen[BATCH]) & set(chosen[HEADS]):
    raise ValueError(f"mesh axes {chosen[BATCH]} split both the batch and the "
                     "heads; shard them over different mesh axes.")
  shards = {k: math.prod(mesh_shape[a] for a in v) for k, v in chosen.items()}
  for name, roles, shape in zip(names, in_roles, shapes):
    if roles is None:
      continue
    for d, role in enumerate(roles):
      if role not in _PARALLEL or shape[d] == 1:
        continue
      key = BATCH if role == BATCH else HEADS
      if shape[d] % shards[key]:
        what = {BATCH: "batch size", HEADS: "number of heads",
                KV_HEADS: "number of key/value heads"}[role]
        hint = (" (GQA: every shard needs whole KV heads; shard the heads "
                "over fewer devices, or only the batch)"
                if role == KV_HEADS else "")
        raise ValueError(
            f"{name} has {what} {shape[d]} (axis {d}), which does not split "
            f"into the {shards[key]} shards of mesh axes {chosen[key]}"
            f"{hint}.")

  def spec_of(roles, shape):
    entries = []
    for role, size in zip(roles, shape):
      axes = ()
      if role in _PARALLEL and size > 1:
        axes = chosen[BATCH if role == BATCH else HEADS]
      entries.append(None if not axes else
                     axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)

  in_specs = tuple(None if r is None else spec_of(r, s)
                   for r, s in zip(in_roles, shapes))
  out_specs, psum_axes = [], []
  for roles, shape in zip(out_roles, out_shapes):
    out_specs.append(spec_of(roles, shape))
    summed = []
    for role, size in zip(roles, shape):
      if role in _PARALLEL and size == 1:
        summed += chosen[BATCH if role == BATCH else HEADS]
    psum_axes.append(tuple(dict.fromkeys(summed)))
  return _Plan(in_specs=in_specs, out_specs=tuple(out_specs),
               psum_axes=tuple(psum_axes),
               sharded=bool(chosen[BATCH] or chosen[HEADS]))


def _with_psums(fn: Callable, psum_axes) -> Callable:
  """``fn`` whose outputs are summed over the given mesh axes."""
  if not any(psum_axes):
    return fn

  def summed(*args):
    outs = fn(*args)
    return tuple(jax.lax.psum(o, axes) if axes else o
                 for o, axes in zip(outs, psum_axes))
  return summed


# ----------------------------------------------------------------------------
# The primitive (automatic sharding): custom_partitioning at lowering.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _Op:
  """What one wrapped call needs at lowering: the function and its roles.

  ``fn`` is traced again for each shard's shapes; ``traced`` is ``fn`` traced
  once at the global shapes (what runs unpartitioned).
  """
  fn: Callable  # flat arrays -> tuple of arrays
  names: tuple[str, ...]
  in_roles: tuple[tuple[str, ...], ...]
  out_roles: tuple[tuple[str, ...], ...]
  traced: Optional[Callable] = None

  @property
  def global_fn(self) -> Callable:
    return self.traced or self.fn


_parallel_p = Primitive("sagejax_batch_head_parallel")
_parallel_p.multiple_results = True


def _abstract_eval(*avals, op: _Op, out_avals):
  del avals, op
  return out_avals


def _impl(*args, op: _Op, out_avals):
  if any(len(getattr(getattr(a, "sharding", None), "device_set", ())) > 1
         for a in args):
    # Eager call on sharded arrays: through jit, so that it is partitioned.
    return jax.jit(functools.partial(_parallel_p.bind, op=op,
                                     out_avals=out_avals))(*args)
  return op.global_fn(*args)


def _jvp(primals, tangents, *, op: _Op, out_avals):
  del out_avals
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  return jax.jvp(op.global_fn, tuple(primals), tuple(tangents))


def _batch_rule(args, dims, *, op: _Op, out_avals):
  """vmap: the mapped axis joins the batch axis (then the call partitions as
  usual); falls back to ``jax.vmap`` of the function when it cannot (an input
  without a batch axis, or an output summed over the batch)."""
  size = next(x.shape[d] for x, d in zip(args, dims)
              if d is not None)
  foldable = all(BATCH in roles for roles in op.in_roles + op.out_roles)
  if foldable:
    batch = max(x.shape[roles.index(BATCH) + (
        d is not None and d <= roles.index(BATCH))]
                for x, d, roles in zip(args, dims, op.in_roles))
    foldable = all(aval.shape[roles.index(BATCH)] == batch
                   for roles, aval in zip(op.out_roles, out_avals))
  if not foldable:
    outs = jax.vmap(op.global_fn, in_axes=tuple(dims))(*args)
    return outs, (0,) * len(outs)
  folded = []
  for x, d, roles in zip(args, dims, op.in_roles):
    bdim = roles.index(BATCH)
    if d is None:
      if x.shape[bdim] == 1 and batch > 1:  # a broadcast (mask, bias)
        folded.append(x)
        continue
      x = jnp.expand_dims(x, bdim)
    else:
      x = jnp.moveaxis(x, d, bdim)
    x = jnp.broadcast_to(x, x.shape[:bdim] + (size, batch) + x.shape[bdim + 2:])
    folded.append(x.reshape(x.shape[:bdim] + (size * batch,)
                            + x.shape[bdim + 2:]))
  outs = batch_head_parallel(op.fn, op.in_roles, op.out_roles,
                             names=op.names)(*folded)
  result = []
  for o, roles in zip(outs, op.out_roles):
    bdim = roles.index(BATCH)
    result.append(o.reshape(o.shape[:bdim] + (size, batch)
                            + o.shape[bdim + 1:]))
  return result, tuple(roles.index(BATCH) for roles in op.out_roles)


def _arg_specs(arg_shapes):
  """Padded spec entries per argument; None when not a NamedSharding."""
  specs = []
  for a in arg_shapes:
    s = getattr(a, "sharding", None)
    specs.append(_padded_spec(s.spec, a.ndim)
                 if isinstance(s, NamedSharding) else None)
  return specs


def _partition_plan(op: _Op, mesh, arg_shapes, result_shape):
  return _plan(op.names, op.in_roles, [a.shape for a in arg_shapes],
               _arg_specs(arg_shapes), op.out_roles,
               [r.shape for r in result_shape], dict(mesh.shape))


def _partition(op: _Op, mesh, arg_shapes, result_shape):
  plan = _partition_plan(op, mesh, arg_shapes, result_shape)
  named = lambda s: NamedSharding(mesh, s)  # noqa: E731
  return (mesh, _with_psums(op.fn, plan.psum_axes),
          tuple(named(s) for s in plan.out_specs),
          tuple(named(s) for s in plan.in_specs))


def _infer(op: _Op, mesh, arg_shapes, result_shape):
  plan = _partition_plan(op, mesh, arg_shapes, result_shape)
  return tuple(NamedSharding(mesh, s) for s in plan.out_specs)


def _factor(role: str) -> str:
  name = "".join(c if c.isalnum() else "_" for c in role.lower())
  return "x_" + name


def _shardy_rule(op: _Op, mesh, value_types, result_types):
  """Batch and head axes are shared factors (query heads = KV heads × group);
  other axes keep their own factors (so a sharded sequence reaches the
  partitioner, which names it); size-1 axes are their own factors."""
  del mesh
  shapes = [tuple(t.shape) for t in value_types] + [
      tuple(t.shape) for t in result_types]
  roles = list(op.in_roles) + list(op.out_roles)
  sizes: dict[str, set[int]] = {}
  for r, shape in zip(roles, shapes):
    for role, size in zip(r, shape):
      if size > 1:
        sizes.setdefault(role, set()).add(size)
  heads, kv = sizes.get(HEADS, set()), sizes.get(KV_HEADS, set())
  factor_sizes = {}
  grouped = len(heads) == 1 and len(kv) == 1 and next(iter(heads)) != next(
      iter(kv))
  if grouped:
    factor_sizes["grp"] = next(iter(heads)) // next(iter(kv))
  count = 0
  mappings = []
  for r, shape in zip(roles, shapes):
    dims = []
    for role, size in zip(r, shape):
      if size == 1 or (role in sizes and len(sizes[role]) > 1
                       and role not in _PARALLEL):
        count += 1
        dims.append(f"u{count}")
      elif role == BATCH:
        dims.append("b")
      elif role in (HEADS, KV_HEADS):
        if role == HEADS and grouped:
          dims.append(CompoundFactor("kvh", "grp"))
        else:
          dims.append("kvh")
      else:
        dims.append(_factor(role))
    mappings.append(ArrayMapping(*dims))
  n_in = len(value_types)
  return SdyShardingRule(tuple(mappings[:n_in]), tuple(mappings[n_in:]),
                         **factor_sizes)


def _lowering(ctx, *args, op: _Op, out_avals):
  del out_avals
  devices = getattr(ctx.module_context.axis_context, "device_assignment", ())
  if devices is None or len(devices) == 1:  # nothing to partition
    return mlir.lower_fun(op.global_fn, multiple_results=True)(ctx, *args)
  cp = custom_partitioning(op.global_fn, static_argnums=())
  cp.def_partition(
      partition=functools.partial(_partition, op),
      infer_sharding_from_operands=functools.partial(_infer, op),
      sharding_rule=functools.partial(_shardy_rule, op))
  return mlir.lower_fun(lambda *a: tuple(cp(*a)), multiple_results=True)(
      ctx, *args)


_parallel_p.def_abstract_eval(_abstract_eval)
_parallel_p.def_impl(_impl)
ad.primitive_jvps[_parallel_p] = _jvp
batching.primitive_batchers[_parallel_p] = _batch_rule
mlir.register_lowering(_parallel_p, _lowering)
try:  # jit must know the devices when it lowers the call (custom_partitioning)
  from jax._src import dispatch as _dispatch
  _dispatch.prim_requires_devices_during_lowering.add(_parallel_p)
except (ImportError, AttributeError):  # pragma: no cover - other jax versions
  pass


# ----------------------------------------------------------------------------
# Explicit sharding (types carry the specs): shard_map at trace time.
# ----------------------------------------------------------------------------


def _explicit_mesh(arrays):
  """The abstract mesh of inputs typed with explicit shardings, else None."""
  for x in arrays:
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
      continue
    used = {a for e in sharding.spec for a in _mesh_axes(e)}
    if used & set(getattr(mesh, "explicit_axes", ())):
      return mesh
  return None


def _call_explicit(op: _Op, mesh, arrays):
  specs = [_padded_spec(jax.typeof(x).sharding.spec, x.ndim) for x in arrays]
  out_shapes = [o.shape for o in jax.eval_shape(
      op.fn, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays))]
  plan = _plan(op.names, op.in_roles, [x.shape for x in arrays], specs,
               op.out_roles, out_shapes, dict(mesh.shape))
  fn = _with_psums(op.fn, plan.psum_axes)
  return jax.shard_map(fn, mesh=mesh, in_specs=plan.in_specs,
                       out_specs=plan.out_specs, check_vma=False)(*arrays)


# ----------------------------------------------------------------------------
# The helper.
# ----------------------------------------------------------------------------


def batch_head_parallel(fn: Callable, in_roles: Sequence[Roles],
                        out_roles: Sequence[tuple[str, ...]], *,
                        names: Optional[Sequence[str]] = None) -> Callable:
  """Wraps ``fn`` to run on each device's batch/head shard under ``jit``.

  Args:
    fn: ``fn(*args) -> tuple of arrays``; positional arguments may be None
      (absent optional inputs). It must treat batch elements and (query head,
      KV head) groups independently, and must not depend on the batch size or
      number of heads beyond their shapes.
    in_roles: per positional argument, one role per axis (``BATCH``,
      ``HEADS``, ``KV_HEADS`` or a descriptive name of an axis that must stay
      whole), or None for a non-array argument.
    out_roles: per output, one role per axis.
    names: argument names for error messages.

  Returns:
    A function of the same arguments. Under ``jax.jit`` with sharded inputs
    each device runs ``fn`` on its shard: no all-gather of the inputs; the
    outputs are sharded like the inputs' batch and head axes.
  """
  in_roles = tuple(None if r is None else tuple(r) for r in in_roles)
  out_roles = tuple(tuple(r) for r in out_roles)
  names = tuple(names or (f"argument {i}" for i in range(len(in_roles))))

  @functools.wraps(fn)
  def wrapped(*args):
    if len(args) != len(in_roles):
      raise TypeError(f"expected {len(in_roles)} arguments, got {len(args)}.")
    present = [i for i, a in enumerate(args) if a is not None]
    for i in present:
      if in_roles[i] is None or jnp.ndim(args[i]) != len(in_roles[i]):
        raise ValueError(f"{names[i]} has shape {jnp.shape(args[i])}; "
                         f"expected axes {in_roles[i]}.")

    def flat_fn(*arrays):
      full: list[Any] = [None] * len(args)
      for i, a in zip(present, arrays):
        full[i] = a
      return tuple(fn(*full))

    arrays = [jnp.asarray(args[i]) for i in present]
    op = _Op(fn=flat_fn, names=tuple(names[i] for i in present),
             in_roles=tuple(in_roles[i] for i in present),
             out_roles=out_roles)
    mesh = _explicit_mesh(arrays)
    if mesh is not None:
      return tuple(_call_explicit(op, mesh, arrays))
    closed = jax.make_jaxpr(flat_fn)(*arrays)  # the one global trace
    traced = jax_core.jaxpr_as_fun(closed)
    op = dataclasses.replace(op, traced=lambda *a: tuple(traced(*a)))
    return tuple(_parallel_p.bind(*arrays, op=op,
                                  out_avals=tuple(closed.out_avals)))

  return wrapped


# ----------------------------------------------------------------------------
# Roles of sagejax.attention's arrays.
# ----------------------------------------------------------------------------

Q_SEQ, KV_SEQ, HEAD_DIM = "query sequence T", "key sequence S", "head dim H"


def attention_roles(layout: str) -> dict[str, tuple[str, ...]]:
  """Roles of the 4-D arrays of an attention call in ``layout``."""
  if layout == "BTNH":
    q = (BATCH, Q_SEQ, HEADS, HEAD_DIM)
    kv = (BATCH, KV_SEQ, KV_HEADS, HEAD_DIM)
  else:
    q = (BATCH, HEADS, Q_SEQ, HEAD_DIM)
    kv = (BATCH, KV_HEADS, KV_SEQ, HEAD_DIM)
  return {"query": q, "key": kv, "value": kv,
          "bias": (BATCH, HEADS, Q_SEQ, KV_SEQ),
          "mask": (BATCH, HEADS, Q_SEQ, KV_SEQ),
          "query_seq_lengths": (BATCH,), "key_value_seq_lengths": (BATCH,),
          "lse": (BATCH, HEADS, Q_SEQ),
          "key mean": (BATCH, KV_HEADS, HEAD_DIM)}


_INPUTS = ("query", "key", "value", "bias", "mask", "query_seq_lengths",
           "key_value_seq_lengths")


def attention_forward(fn: Callable, layout: str, residual: bool = False,
                      centre_k: bool = False) -> Callable:
  """``fn(q, k, v, bias, mask, q_lengths, kv_lengths) -> (out, lse)``
  (``residual``: ``(out, lse, rows)``, ``rows`` shaped as ``lse``;
  ``centre_k``: then K − k̄ shaped as ``k`` and k̄ ``[B, K, H]``),
  partitioned over batch and heads."""
  r = attention_roles(layout)
  outs = [r["query"], r["lse"]] + [r["lse"]] * residual
  if centre_k:
    outs += [r["key"], r["key mean"]]
  return batch_head_parallel(fn, [r[n] for n in _INPUTS], outs,
                             names=_INPUTS)


def attention_backward(fn: Callable, layout: str, has_bias: bool) -> Callable:
  """``fn(q, k, v, bias, mask, q_lengths, kv_lengths, d_out, d_lse, out,
  lse, k_bar) -> (dq, dk, dv[, dbias])`` (``out``, ``lse``: saved forward
  statistics or None; ``k_bar``: k̄ ``[B, K, H]`` where ``k`` is K − k̄, or
  None) partitioned over batch and heads; a bias broadcast over a sharded
  axis gets its gradient summed over the shards."""
  r = attention_roles(layout)
  outs = [r["query"], r["key"], r["value"]]
  if has_bias:
    outs.append(r["bias"])
  return batch_head_parallel(
      fn, [r[n] for n in _INPUTS] + [r["query"], r["lse"]] * 2
      + [r["key mean"]], outs,
      names=_INPUTS + ("output cotangent", "lse cotangent", "saved output",
                       "saved lse", "saved key mean"))

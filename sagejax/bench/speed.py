"""Speed: TOPS of each method over shapes, end to end and kernel-only."""

from __future__ import annotations

import time
from typing import Any, Optional

import jax

from sagejax.bench import env
from sagejax.bench.methods import Method, Shape, Skip, dtype_name, one_line
from sagejax.bench.progress import Task
from sagejax.bench.settings import Settings
from sagejax.bench.timing import rotating_sets, time_calls, tree_bytes
from sagejax.testing import make_qkv


class InputPool:
  """Random q, k, v sets for one problem size, per dtype, made on demand.

  Set ``i`` holds the same values in every dtype. Changing the size drops
  the sets of the previous one.
  """

  def __init__(self, seed: int = 0):
    self._seed = seed
    self._size: Optional[tuple] = None
    self._sets: dict[str, list[tuple]] = {}

  def get(self, shape: Shape, dtype, n: int) -> list[tuple]:
    size = (shape.batch, shape.heads, shape.kv_heads, shape.seq,
            shape.head_dim)
    if size != self._size:
      self._sets, self._size = {}, size
    sets = self._sets.setdefault(dtype_name(dtype), [])
    while len(sets) < n:
      key = jax.random.key(self._seed + len(sets))
      sets.append(make_qkv(key, shape.batch, shape.seq, shape.seq,
                           shape.heads, shape.kv_heads, shape.head_dim,
                           dtype=dtype))
    return sets[:n]

  def clear(self) -> None:
    self._sets, self._size = {}, None


def compiled_memory(compiled) -> Optional[dict[str, int]]:
  """Bytes from XLA's memory analysis of a compiled function, or None."""
  try:
    ma = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  # not on every platform
    return None
  if ma is None:
    return None
  arg = int(ma.argument_size_in_bytes)
  out = int(ma.output_size_in_bytes)
  temp = int(ma.temp_size_in_bytes)
  alias = int(ma.alias_size_in_bytes)
  return {"argument_bytes": arg, "output_bytes": out, "temp_bytes": temp,
          "alias_bytes": alias, "total_bytes": arg + out + temp - alias}


def check_fits(need: int, limit: Optional[int], what: str) -> None:
  """Raises Skip when ``need`` bytes exceed 90% of the device's ``limit``."""
  if limit is not None and need > 0.9 * limit:
    raise Skip(f"{what} needs {env.fmt_bytes(need)}, more than the "
               f"{env.fmt_bytes(limit)} of device memory")


def time_rotating(compiled, args: tuple, more_sets, settings: Settings,
                  label: str):
  """Times ``compiled`` on ``args`` and, so that the sets together exceed
  twice the L2, ``more_sets(n)`` (the other ``n - 1`` sets), after checking
  they fit the device (:class:`Skip` otherwise)."""
  n = rotating_sets(tree_bytes(args), settings.timing)
  mem = compiled_memory(compiled)
  if mem is not None:
    check_fits(mem["total_bytes"] + (n - 1) * mem["argument_bytes"],
               settings.memory_limit, label)
  return time_calls(compiled, [args] + list(more_sets(n)), settings.timing)


def base_row(method: Method, shape: Shape) -> dict[str, Any]:
  return {"method": method.key, "label": method.label,
          "family": method.family, "mode": method.mode,
          "backend": method.backend, "preset": method.preset,
          "dtype": dtype_name(method.dtype), "batch": shape.batch,
          "heads": shape.heads, "kv_heads": shape.kv_heads,
          "seq": shape.seq, "head_dim": shape.head_dim,
          "causal": shape.causal}


def compile_method(method: Method, shape: Shape, pool: InputPool):
  """Builds and compiles a method; returns (compiled, prepare, first args)."""
  built = method.build(shape)
  raw = pool.get(shape, method.dtype, 1)[0]
  prepare = None
  args = raw
  if built.prepare is not None:
    prepare = jax.jit(built.prepare).lower(*raw).compile()
    args = prepare(*raw)
  compiled = jax.jit(built.fn).lower(*args).compile()
  return compiled, prepare, args


def timed_row(method: Method, shape: Shape, pool: InputPool,
              settings: Settings, compile_fn, flops: float, **fields
              ) -> list[dict[str, Any]]:
  """One row: median time and TOPS (``flops`` / time), or why there is none.

  ``compile_fn(method, shape, pool)`` returns ``(compiled, as_args, args)``:
  the compiled function, how a raw ``(q, k, v)`` set becomes its arguments,
  and the arguments of the first set.
  """
  row = base_row(method, shape)
  row.update(status="ok", note=None, **fields)
  try:
    start = time.perf_counter()
    compiled, as_args, args = compile_fn(method, shape, pool)
    row["compile_s"] = round(time.perf_counter() - start, 3)
    t = time_rotating(
        compiled, args,
        lambda n: [as_args(r) for r in pool.get(shape, method.dtype, n)[1:]],
        settings, method.label)
    row.update(time_ms=t.median_s * 1e3, time_ms_min=t.min_s * 1e3,
               tops=flops / t.median_s / 1e12, calls=t.calls,
               repeats=t.repeats, input_sets=t.input_sets)
  except Skip as e:
    row.update(status="skipped", note=str(e))
  except Exception as e:  # pylint: disable=broad-except  # one line, go on
    row.update(status="error", note=one_line(e))
  return [row]


def measure(method: Method, shape: Shape, pool: InputPool,
            settings: Settings) -> list[dict[str, Any]]:
  """One speed row: median time and TOPS, or why there is none."""
  def compile_fn(method, shape, pool):
    compiled, prepare, args = compile_method(method, shape, pool)
    return compiled, (lambda r: prepare(*r)) if prepare else tuple, args
  return timed_row(method, shape, pool, settings, compile_fn, shape.flops)


def tasks(settings: Settings, methods: list[Method]) -> list[Task]:
  """One task per (shape, method); shapes share their random inputs."""
  pool = InputPool(settings.seed)
  out = []
  for shape in settings.speed_shapes:
    for method in methods:
      out.append(Task(
          "speed", f"speed {method.label} S={shape.seq} H={shape.head_dim}"
          f"{' causal' if shape.causal else ''}",
          lambda m=method, s=shape: measure(m, s, pool, settings)))
  out.append(Task("speed", "speed: free inputs",
                  lambda: (pool.clear(), [])[1]))
  return out

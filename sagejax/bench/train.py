"""Train: the speed of a training step through attention (forward + backward).

Each method is timed as ``jax.value_and_grad`` of ``sum(out · dO)`` with
respect to q, k and v (what a training step asks of attention), compiled
once, on rotating inputs like the speed mode. TFLOPS counts 3.5× the
forward's 4·B·N·T·S·H (the forward's two products and the backward's five;
halved when causal), whatever a method actually computes — so a backward
that recomputes a forward, or one that skips nothing under a causal mask,
shows as slower, not as more work.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from sagejax.bench.methods import (END_TO_END, INTERPRET, Method, Shape, Skip,
                                   one_line)
from sagejax.bench.progress import Task
from sagejax.bench.settings import Settings
from sagejax.bench.speed import (InputPool, base_row, check_fits,
                                 compiled_memory)
from sagejax.bench.timing import rotating_sets, time_calls, tree_bytes

TRAIN_FLOPS = 3.5  # × the forward's
# Methods without a backward worth timing here: the interpreted kernels
# (sagejax-bench calls their forward outside the custom VJP) and Pallas
# mgpu's forward-only kernel.
NO_TRAIN = (INTERPRET, "mgpu")


def train_step(forward: Callable[..., jax.Array]) -> Callable[..., Any]:
  """``(q, k, v, dO) → (loss, (dq, dk, dv))`` through ``forward(q, k, v)``."""
  def step(q, k, v, do):
    def loss(q, k, v):
      return jnp.sum(forward(q, k, v).astype(jnp.float32)
                     * do.astype(jnp.float32))
    return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)
  return step


def train_methods(methods: list[Method]) -> list[Method]:
  """The end-to-end methods a training step can go through."""
  return [m for m in methods if m.mode == END_TO_END
          and m.backend not in NO_TRAIN and m.key not in NO_TRAIN]


def _with_cotangent(qkv: tuple) -> tuple:
  q, k, v = qkv
  return q, k, v, jnp.flip(q, axis=-1)  # any data of q's shape, not zeros


def measure(method: Method, shape: Shape, pool: InputPool,
            settings: Settings) -> list[dict[str, Any]]:
  """One row: median training-step time and TFLOPS, or why there is none."""
  row = base_row(method, shape)
  row.update(mode="train", status="ok", note=None)
  try:
    start = time.perf_counter()
    built = method.build(shape)
    if built.prepare is not None:
      raise Skip("kernel-only methods have no training step")
    args = _with_cotangent(pool.get(shape, method.dtype, 1)[0])
    compiled = jax.jit(train_step(built.fn)).lower(*args).compile()
    row["compile_s"] = round(time.perf_counter() - start, 3)
    n = rotating_sets(tree_bytes(args), settings.timing)
    mem = compiled_memory(compiled)
    if mem is not None:
      row["planned_bytes"] = mem["total_bytes"]
      check_fits(mem["total_bytes"] + (n - 1) * mem["argument_bytes"],
                 settings.memory_limit, method.label)
    sets = [args] + [_with_cotangent(r)
                     for r in pool.get(shape, method.dtype, n)[1:]]
    t = time_calls(compiled, sets, settings.timing)
    row.update(time_ms=t.median_s * 1e3, time_ms_min=t.min_s * 1e3,
               tops=TRAIN_FLOPS * shape.flops / t.median_s / 1e12,
               calls=t.calls, repeats=t.repeats, input_sets=t.input_sets)
  except Skip as e:
    row.update(status="skipped", note=str(e))
  except Exception as e:  # pylint: disable=broad-except  # one line, go on
    row.update(status="error", note=one_line(e))
  return [row]


def tasks(settings: Settings, methods: list[Method]) -> list[Task]:
  """One task per (shape, method); shapes share their random inputs."""
  pool = InputPool(settings.seed)
  out = []
  for shape in settings.train_shapes:
    for method in train_methods(methods):
      out.append(Task(
          "train", f"train {method.label} S={shape.seq} H={shape.head_dim}"
          f"{' causal' if shape.causal else ''}",
          lambda m=method, s=shape: measure(m, s, pool, settings)))
  out.append(Task("train", "train: free inputs",
                  lambda: (pool.clear(), [])[1]))
  return out

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

from typing import Any, Callable

import jax
import jax.numpy as jnp

from sagejax.bench.methods import END_TO_END, INTERPRET, Method, Shape, Skip
from sagejax.bench.progress import Task
from sagejax.bench.settings import Settings
from sagejax.bench.speed import InputPool, timed_row

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


def _compile(method: Method, shape: Shape, pool: InputPool):
  built = method.build(shape)
  if built.prepare is not None:
    raise Skip("kernel-only methods have no training step")
  args = _with_cotangent(pool.get(shape, method.dtype, 1)[0])
  compiled = jax.jit(train_step(built.fn)).lower(*args).compile()
  return compiled, _with_cotangent, args


def measure(method: Method, shape: Shape, pool: InputPool,
            settings: Settings) -> list[dict[str, Any]]:
  """One row: median training-step time and TFLOPS, or why there is none."""
  return timed_row(method, shape, pool, settings, _compile,
                   TRAIN_FLOPS * shape.flops, mode="train")


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

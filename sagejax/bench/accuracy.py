"""Accuracy: cos sim, relative L1 and RMSE of every preset and granularity
against :func:`sagejax.exact_attention`, on normal and outlier data."""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

import sagejax
from sagejax.bench.methods import (INTERPRET, Shape, dtype_name, one_line,
                                   sage_forward)
from sagejax.bench.progress import Task
from sagejax.bench.settings import Settings
from sagejax.config import PRESETS
from sagejax.testing import error_metrics, make_qkv

# SageAttention's own accuracy on inputs drawn like ours (fp16, B=2, N=8,
# T=S=4096, H=128, against an fp32 reference), copied from
# shared/ANCHORS.md, "Accuracy of SageAttention itself" (one H200,
# 2026-11-21). Keys: (our preset, data kind, causal); values: cos sim,
# relative L1, RMSE. "fp16" is PyTorch's fp16 SDPA, the unquantized anchor.
ANCHOR_SHAPE = Shape(batch=2, heads=8, kv_heads=8, seq=4096, head_dim=128)
ANCHOR_METHODS = {
    "sage2-8b": "SageAttention2 CUDA sm90",
    "sage1": "SageAttention Triton",
    "fp16": "fp16 SDPA (PyTorch)",
}
ANCHORS: dict[tuple[str, str, bool], tuple[float, float, float]] = {
    ("sage2-8b", "normal", False): (0.999257, 0.03853, 0.00098),
    ("sage2-8b", "normal", True): (0.999386, 0.03690, 0.00241),
    ("sage2-8b", "channel_bias", False): (0.999999, 0.00193, 0.00856),
    ("sage1", "normal", False): (0.999912, 0.01319, 0.00034),
    ("sage1", "channel_bias", False): (1.000000, 0.00021, 0.00094),
    ("fp16", "normal", False): (1.000000, 0.00028, 0.00001),
}


@functools.cache
def _sage_fn(backend: str, preset: str, granularity: str, causal: bool):
  config = PRESETS[preset].replace(qk_granularity=granularity)
  return jax.jit(sage_forward(backend, config, causal))


@functools.cache
def _exact_fn(causal: bool):
  return jax.jit(functools.partial(sagejax.exact_attention, is_causal=causal))


@functools.cache
def _jax_nn_fn(causal: bool):
  return jax.jit(functools.partial(jax.nn.dot_product_attention,
                                   is_causal=causal, implementation="xla"))


class _Case:
  """Inputs and exact output of one (shape, data, causal), made once."""

  def __init__(self, seed: int):
    self._seed = seed
    self._key: Optional[tuple] = None
    self.q = self.k = self.v = self.ref = None

  def get(self, shape: Shape, data: str, causal: bool, dtype):
    key = (shape, data, causal)
    if key != self._key:
      self.q = self.k = self.v = self.ref = None
      self.q, self.k, self.v = make_qkv(
          jax.random.key(self._seed), shape.batch, shape.seq, shape.seq,
          shape.heads, shape.kv_heads, shape.head_dim, kind=data, dtype=dtype)
      self.ref = jax.block_until_ready(
          _exact_fn(causal)(self.q, self.k, self.v))
      self._key = key
    return self

  def clear(self) -> None:
    self.q = self.k = self.v = self.ref = None
    self._key = None


def _row(shape: Shape, data: str, causal: bool, **fields) -> dict[str, Any]:
  row = {"batch": shape.batch, "heads": shape.heads,
         "kv_heads": shape.kv_heads, "seq": shape.seq,
         "head_dim": shape.head_dim, "data": data, "causal": causal,
         "status": "ok", "note": None}
  row.update(fields)
  return row


def _sage_row(case: _Case, shape: Shape, data: str, causal: bool,
              backend: str, preset: str, granularity: str, dtype
              ) -> list[dict[str, Any]]:
  default = PRESETS[preset].qk_granularity
  label = preset if granularity == default else f"{preset} / {granularity}"
  row = _row(shape, data, causal, method=f"{preset}:{backend}",
             family="sagejax", label=f"{label} ({backend})",
             backend=backend, preset=preset, granularity=granularity,
             default_granularity=granularity == default,
             dtype=dtype_name(dtype))
  try:
    c = case.get(shape, data, causal, dtype)
    out = _sage_fn(backend, preset, granularity, causal)(c.q, c.k, c.v)
    row.update(error_metrics(out, c.ref))
  except Exception as e:  # pylint: disable=broad-except  # one line, go on
    row.update(status="error", note=one_line(e))
  return [row]


def _baseline_row(case: _Case, shape: Shape, data: str, causal: bool, dtype
                  ) -> list[dict[str, Any]]:
  """jax.nn.dot_product_attention (xla) on the same inputs: the floor."""
  row = _row(shape, data, causal, method="jax-xla", family="baseline",
             backend=None, preset=None, granularity=None,
             default_granularity=True)
  try:
    c = case.get(shape, data, causal, dtype)
    q, k, v = c.q, c.k, c.v
    try:
      out = jax.block_until_ready(_jax_nn_fn(causal)(q, k, v))
    except Exception:  # pylint: disable=broad-except  # fp16 dots on CPU
      q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
      out = _jax_nn_fn(causal)(q, k, v)
      row["note"] = (f"{dtype_name(dtype)} unsupported by jax.nn xla here; "
                     "inputs cast to bf16")
    row.update(label=f"jax.nn xla {dtype_name(q.dtype)}",
               dtype=dtype_name(q.dtype), **error_metrics(out, c.ref))
  except Exception as e:  # pylint: disable=broad-except
    row.update(label="jax.nn xla", status="error", note=one_line(e))
  return [row]


def tasks(settings: Settings, backends: list[str]) -> list[Task]:
  """One task per (shape, data, causal, method); inputs made once per case."""
  case = _Case(settings.seed)
  dtype = settings.dtype
  out = []
  for shape in settings.accuracy_shapes:
    for data in settings.data_kinds:
      for causal in settings.causal:
        where = f"S={shape.seq} {data}{' causal' if causal else ''}"
        if "jax-xla" in settings.baselines:
          out.append(Task("accuracy", f"accuracy jax.nn {where}",
                          lambda s=shape, d=data, c=causal: _baseline_row(
                              case, s, d, c, dtype)))
        for backend in backends:
          for preset in settings.accuracy_presets:
            # The interpreter checks the kernels run; the granularity sweep
            # is about the math, which the other backends already cover.
            grans = ([PRESETS[preset].qk_granularity] if backend == INTERPRET
                     else settings.granularities)
            for gran in grans:
              out.append(Task(
                  "accuracy", f"accuracy {preset}/{gran} {backend} {where}",
                  lambda s=shape, d=data, c=causal, b=backend, p=preset,
                  g=gran: _sage_row(case, s, d, c, b, p, g, dtype)))
  out.append(Task("accuracy", "accuracy: free inputs",
                  lambda: (case.clear(), [])[1]))
  return out


def anchor_comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Our default-granularity rows beside SageAttention's (ANCHORS) numbers."""
  out = []
  for row in rows:
    if row.get("status") != "ok" or not row.get("default_granularity"):
      continue
    name = row.get("preset") or ("fp16" if row.get("dtype") == "fp16"
                                 else None)
    anchor = ANCHORS.get((name, row["data"], row["causal"]))
    if anchor is None:
      continue
    out.append({
        "ours": row["label"], "anchor": ANCHOR_METHODS[name],
        "data": row["data"], "causal": row["causal"],
        "same_shape": (row["batch"], row["heads"], row["seq"],
                       row["head_dim"]) == (
                           ANCHOR_SHAPE.batch, ANCHOR_SHAPE.heads,
                           ANCHOR_SHAPE.seq, ANCHOR_SHAPE.head_dim),
        "cos_sim": row["cos_sim"], "anchor_cos_sim": anchor[0],
        "rel_l1": row["rel_l1"], "anchor_rel_l1": anchor[1],
        "rmse": row["rmse"], "anchor_rmse": anchor[2],
    })
  return out

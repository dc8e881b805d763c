"""The attention implementations a benchmark compares, behind one interface.

A :class:`Method` turns a :class:`Shape` into a :class:`Built`: an optional
``prepare`` (raw q, k, v → the arguments of the timed function, e.g. the
quantized inputs for kernel-only timing) and ``fn``, the function timed.

Kernel-only timing hook. A sagejax backend may provide two optional methods::

  backend.prepare(call: ParsedCall, config: SageConfig) -> prepared
  backend.kernel(prepared, call: ParsedCall, config: SageConfig
                 ) -> (out, lse)       # as backend.forward returns them

with ``backend.forward(call, config) == backend.kernel(backend.prepare(call,
config), call, config)``. ``prepared`` is a pytree of arrays (the quantized
inputs, e.g. a :class:`sagejax.quant.QuantizedQKV`). ``kernel`` gets a ``call``
whose ``q``, ``k``, ``v`` are ``jax.ShapeDtypeStruct`` (shapes only, no data):
it reads the static fields (``spec``, ``sm_scale``, ``layout``, shapes) and
the optional ``mask``, ``bias`` and lengths. Both backends provide it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

import sagejax
from sagejax import _inputs, backends
from sagejax.config import PRESETS, SageConfig

# Comparison methods outside sagejax, in table order.
BASELINES = ("jax-xla", "cudnn", "tokamax-mosaic", "tokamax-triton", "mgpu")
GPU_ONLY = ("cudnn", "tokamax-mosaic", "tokamax-triton", "mgpu")
END_TO_END, KERNEL = "end_to_end", "kernel"


class Skip(Exception):
  """A method cannot run this shape here; the message says why (one line)."""


@dataclasses.dataclass(frozen=True)
class Shape:
  """One attention problem: q ``[B, T, N, H]``, k and v ``[B, S, K, H]``."""
  batch: int
  heads: int
  kv_heads: int
  seq: int
  head_dim: int
  causal: bool = False

  @property
  def flops(self) -> float:
    """4·B·N·T·S·H, halved when causal (T = S)."""
    f = 4.0 * self.batch * self.heads * self.seq * self.seq * self.head_dim
    return f / 2 if self.causal else f

  def qkv_bytes(self, itemsize: int = 2) -> int:
    """Bytes of q, k, v and the output in a dtype of ``itemsize`` bytes."""
    q = self.batch * self.seq * self.heads * self.head_dim
    kv = self.batch * self.seq * self.kv_heads * self.head_dim
    return (2 * q + 2 * kv) * itemsize

  def describe(self) -> str:
    c = " causal" if self.causal else ""
    return (f"B={self.batch} N={self.heads} K={self.kv_heads} S={self.seq} "
            f"H={self.head_dim}{c}")


@dataclasses.dataclass
class Built:
  """``fn(*prepare(q, k, v))`` (or ``fn(q, k, v)``) is the timed call."""
  fn: Callable[..., Any]
  prepare: Optional[Callable[..., tuple]] = None


@dataclasses.dataclass(frozen=True)
class Method:
  """One line of the speed table/plot.

  Attributes:
    key: unique id, e.g. ``"sage2-8b:xla"`` or ``"cudnn"``.
    label: what tables and plots show.
    family: ``"sagejax"`` or ``"baseline"``.
    mode: ``"end_to_end"`` (quantization included) or ``"kernel"``.
    dtype: dtype of the raw q, k, v.
    build: ``Shape → Built``; raises :class:`Skip` when it cannot run.
    backend, preset: for sagejax methods.
  """
  key: str
  label: str
  family: str
  mode: str
  dtype: Any
  build: Callable[[Shape], Built]
  backend: Optional[str] = None
  preset: Optional[str] = None


def dtype_name(dtype) -> str:
  return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(
      jnp.dtype(dtype).name, jnp.dtype(dtype).name)


# ----------------------------------------------------------------------------
# sagejax backends.
# ----------------------------------------------------------------------------


def kernel_hooks(backend) -> Optional[tuple[Callable, Callable]]:
  """``(prepare, kernel)`` of a backend (see the module docstring), or None."""
  prepare = getattr(backend, "prepare", None)
  kernel = getattr(backend, "kernel", None)
  if callable(prepare) and callable(kernel):
    return prepare, kernel
  return None


INTERPRET = "pallas-interpret"


def sage_backend_names() -> list[str]:
  """Registry backends, plus the Pallas kernels under the interpreter."""
  names = list(backends.registry())
  if "pallas" in names:
    names.append(INTERPRET)
  return names


def sage_backend(key: str):
  """The backend object of a name from :func:`sage_backend_names`."""
  if key == INTERPRET:
    # pylint: disable-next=import-outside-toplevel
    from sagejax.backends import pallas_triton
    return pallas_triton.INTERPRET_BACKEND
  return backends.registry()[key]


def sage_forward(key: str, config: SageConfig, causal: bool
                 ) -> Callable[..., jax.Array]:
  """``(q, k, v) → out`` in BTNH: :func:`sagejax.attention` for registry
  backends; the backend's own ``forward`` for the interpreted kernels."""
  if key in backends.registry():
    return functools.partial(sagejax.attention, is_causal=causal,
                             config=config, implementation=key)
  backend = sage_backend(key)

  def forward(q, k, v):
    call = _inputs.parse(q, k, v, is_causal=causal)
    return backend.forward(call, config)[0].astype(q.dtype)
  return forward


def _check_served(backend, shape: Shape, config: SageConfig, dtype) -> None:
  """Raises Skip if the backend refuses a call of this shape."""
  shp = jax.ShapeDtypeStruct
  q = shp((shape.batch, shape.seq, shape.heads, shape.head_dim), dtype)
  kv = shp((shape.batch, shape.seq, shape.kv_heads, shape.head_dim), dtype)
  reason: list[Optional[str]] = [None]

  def probe(q, k, v):
    call = _inputs.parse(q, k, v, is_causal=shape.causal)
    reason[0] = backend.unsupported(call, config)
    return q

  jax.eval_shape(probe, q, kv, kv)
  if reason[0] is not None:
    raise Skip(f"does not serve this call: {reason[0]}")


def _sage_end_to_end(key: str, preset: str, dtype
                     ) -> Callable[[Shape], Built]:
  def build(shape: Shape) -> Built:
    config = PRESETS[preset]
    _check_served(sage_backend(key), shape, config, dtype)
    return Built(fn=sage_forward(key, config, shape.causal))
  return build


def _sage_kernel(key: str, preset: str, dtype) -> Callable[[Shape], Built]:
  def build(shape: Shape) -> Built:
    backend = sage_backend(key)
    config = PRESETS[preset]
    _check_served(backend, shape, config, dtype)
    prepare, kernel = kernel_hooks(backend)
    static: dict[str, _inputs.ParsedCall] = {}

    def prep(q, k, v):
      call = _inputs.parse(q, k, v, is_causal=shape.causal)
      static["call"] = dataclasses.replace(
          call, **{n: jax.ShapeDtypeStruct(x.shape, x.dtype)
                   for n, x in (("q", call.q), ("k", call.k), ("v", call.v))})
      return (prepare(call, config),)

    def run(prepared):
      return kernel(prepared, static["call"], config)[0]

    return Built(fn=run, prepare=prep)
  return build


def sage_methods(keys: list[str], presets: list[str], dtype,
                 kernel_only: bool = True) -> tuple[list[Method], list[str]]:
  """End-to-end (and kernel-only) methods of the available backends."""
  methods, notes = [], []
  for key in keys:
    backend = sage_backend(key)
    if not backend.available():
      notes.append(f"sagejax backend {key!r} is not available on "
                   f"{jax.default_backend()}; skipped.")
      continue
    hooks = kernel_hooks(backend) if kernel_only else None
    if kernel_only and hooks is None:
      notes.append(f"sagejax backend {key!r} has no prepare/kernel hook; "
                   "kernel-only timing skipped.")
    for preset in presets:
      methods.append(Method(
          key=f"{preset}:{key}", label=f"{preset} {key}", family="sagejax",
          mode=END_TO_END, dtype=dtype, backend=key, preset=preset,
          build=_sage_end_to_end(key, preset, dtype)))
      if hooks is not None:
        methods.append(Method(
            key=f"{preset}:{key}:kernel", label=f"{preset} {key} (kernel)",
            family="sagejax", mode=KERNEL, dtype=dtype, backend=key,
            preset=preset, build=_sage_kernel(key, preset, dtype)))
  return methods, notes


# ----------------------------------------------------------------------------
# Baselines.
# ----------------------------------------------------------------------------


def _jax_nn(implementation: str) -> Callable[[Shape], Built]:
  def build(shape: Shape) -> Built:
    return Built(fn=functools.partial(
        jax.nn.dot_product_attention, is_causal=shape.causal,
        implementation=implementation))
  return build


def _tokamax(implementation: str) -> Callable[[Shape], Built]:
  def build(shape: Shape) -> Built:
    try:
      import tokamax  # pylint: disable=import-outside-toplevel
    except Exception as e:  # pylint: disable=broad-except
      raise Skip(f"tokamax failed to import: {one_line(e)}") from e
    return Built(fn=functools.partial(
        tokamax.dot_product_attention, is_causal=shape.causal,
        implementation=implementation))
  return build


def _mgpu(shape: Shape) -> Built:
  try:
    # pylint: disable-next=import-outside-toplevel
    from jax.experimental.pallas.ops.gpu import attention_mgpu
  except Exception as e:  # pylint: disable=broad-except
    raise Skip(f"attention_mgpu failed to import: {one_line(e)}") from e
  if shape.head_dim % 64:
    raise Skip("attention_mgpu needs a head dim that is a multiple of 64")
  block_kv = 128 if shape.seq % 128 == 0 else 64
  config = attention_mgpu.TuningConfig(
      block_q=64, block_kv=block_kv, max_concurrent_steps=2,
      causal=shape.causal)
  return Built(fn=lambda q, k, v: attention_mgpu.attention(q, k, v, config))


def baseline_methods(names: list[str]) -> tuple[list[Method], list[str]]:
  """The baselines asked for that can run here; notes for the others."""
  methods, notes, gpu_only = [], [], []
  gpu = jax.devices()[0].platform == "gpu"
  have_tokamax = importlib.util.find_spec("tokamax") is not None
  bf16, fp16 = jnp.bfloat16, jnp.float16
  table = {
      "jax-xla": ("jax.nn xla bf16", bf16, _jax_nn("xla")),
      "cudnn": ("jax.nn cuDNN bf16", bf16, _jax_nn("cudnn")),
      "tokamax-mosaic": ("tokamax mosaic bf16", bf16, _tokamax("mosaic")),
      "tokamax-triton": ("tokamax triton bf16", bf16, _tokamax("triton")),
      "mgpu": ("Pallas mgpu fp16", fp16, _mgpu),
  }
  tokamax_noted = False
  for name in names:
    label, dtype, build = table[name]
    if name in GPU_ONLY and not gpu:
      gpu_only.append(name)
      continue
    if name.startswith("tokamax") and not have_tokamax:
      if not tokamax_noted:
        notes.append("tokamax is not installed (pip install tokamax); its "
                     "baselines skipped.")
        tokamax_noted = True
      continue
    methods.append(Method(key=name, label=label, family="baseline",
                          mode=END_TO_END, dtype=dtype, build=build))
  if gpu_only:
    notes.append(f"{', '.join(gpu_only)}: need an NVIDIA GPU; skipped on "
                 f"{jax.default_backend()}.")
  return methods, notes


def one_line(e: BaseException, limit: int = 160, typed: bool = True) -> str:
  """The first line of an exception (after its type when ``typed``; the
  type alone when it has no text), cut to ``limit`` chars."""
  text = str(e).strip().splitlines()
  if typed:
    msg = f"{type(e).__name__}: {text[0] if text else ''}"
  else:
    msg = text[0] if text else type(e).__name__
  return msg if len(msg) <= limit else msg[:limit - 1] + "…"

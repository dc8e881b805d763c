"""Decode and extend: attention over a paged KV cache, as a server runs it.

``decode``: one query token per sequence (q ``[B, N, H]``) against its
cached tokens; ``extend`` (prefix caching, chunked prefill): a chunk of T new
tokens per sequence (q ``[B, T, N, H]``) against its P cached ones and
themselves, causal with the diagonal at the bottom right. Each shape's
tokens (dense bf16 k, v ``[B, P + T, K, H]``) fill two
:class:`sagejax.serving.PagedKVCache` through :func:`sagejax.serving.append`,
one with INT8 K / FP8 V pages and one with bf16 pages, under a shuffled page
table.

Methods: each sagejax backend through :mod:`sagejax.serving` (``"xla"``,
``"pallas"``, ``"pallas-interpret"``: ``"pallas"`` under the interpreter,
``"mosaic"``: decode on pages of 32-128 tokens, 16-bit ones of 64-128
— ``--page-size 128`` —, extend on quantized pages) on each cache, with
``config=None`` and the default tiling; baselines ``jax.nn`` cuDNN and xla on
the dense contiguous bf16 k, v (not causal: ``jax.nn``'s cuDNN path has no
bottom-right causal mask; for decode, T = 1, nothing to mask) and JAX's own
Pallas ``paged_attention`` (GPU, decode) on the bf16 pages.

Timing as in the speed mode (:mod:`sagejax.bench.timing`): compiled once,
rotating input sets (set i > 0: a fresh q and copies of the rest). Work
counted for every method: 4·B·N·H·(T·P + T·(T + 1)/2) (the causal work);
bytes read: the cached tokens' K and V pages and their scales.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from sagejax import serving
from sagejax.bench import env
from sagejax.bench.methods import INTERPRET, Skip, one_line, sage_backend
from sagejax.bench.progress import Task
from sagejax.bench.speed import time_rotating

if TYPE_CHECKING:
  from sagejax.bench.settings import Settings

COMMANDS = ("decode", "extend")
# The serving modes' baselines, in table order; "jax-paged" is theirs only
# (speed, train and memory ignore it).
BASELINES = ("jax-xla", "cudnn", "jax-paged")
ONLY = ("jax-paged",)
GPU_ONLY = ("cudnn", "jax-paged")
QUANTIZED, BF16, DENSE = "int8/fp8", "bf16", "dense bf16"
K_SPLITS = 16  # JAX paged_attention's key splits


@dataclasses.dataclass(frozen=True)
class ServingShape:
  """B sequences of ``prefix + chunk`` cached tokens in pages of
  ``page_size``, the last ``chunk`` of each its queries: q ``[B, N, H]``
  (decode, chunk = 1) or ``[B, chunk, N, H]``; k, v ``[B, prefix + chunk,
  K, H]``."""
  batch: int
  heads: int
  kv_heads: int
  head_dim: int
  prefix: int
  chunk: int
  page_size: int

  @property
  def tokens(self) -> int:
    """Cached tokens per sequence, the new ones included."""
    return self.prefix + self.chunk

  @property
  def pages(self) -> int:
    """Pages per sequence."""
    return -(-self.tokens // self.page_size)

  @property
  def flops(self) -> float:
    """4·B·N·H·(T·P + T·(T + 1)/2): causal, bottom-right diagonal."""
    t, p = self.chunk, self.prefix
    return (4.0 * self.batch * self.heads * self.head_dim
            * (t * p + t * (t + 1) / 2))

  def cache_bytes(self, quantized: bool) -> int:
    """Bytes of the cached tokens' K and V: INT8 K + FP8 V + two f32 scales
    per (token, KV head) when ``quantized``, else bf16 K and V."""
    per_token = 2 * self.head_dim + 8 if quantized else 4 * self.head_dim
    return self.batch * self.tokens * self.kv_heads * per_token

  def input_bytes(self) -> int:
    """About the memory a shape's inputs take: dense k and v, both caches
    (whole pages), q and the output, and append's f32 temporaries."""
    rows = self.batch * self.tokens * self.kv_heads * self.head_dim
    paged = self.batch * self.pages * self.page_size * self.kv_heads
    q = self.batch * self.chunk * self.heads * self.head_dim
    return (2 * rows * 2 + paged * (2 * self.head_dim + 8)
            + paged * 4 * self.head_dim + 2 * q * 2 + 3 * rows * 4)

  def describe(self) -> str:
    return (f"B={self.batch} N={self.heads} K={self.kv_heads} "
            f"H={self.head_dim} prefix={self.prefix} chunk={self.chunk} "
            f"pages of {self.page_size}")


def shapes(batch_tokens: list[tuple[int, int]], chunk: int, heads: int,
           kv_heads: int, head_dim: int, page_size: int
           ) -> list[ServingShape]:
  """Shapes of ``(B, cached tokens)`` pairs, the last ``chunk`` the
  queries (decode: chunk = 1)."""
  return [ServingShape(b, heads, kv_heads, head_dim, s - chunk, chunk,
                       page_size) for b, s in batch_tokens]


# ----------------------------------------------------------------------------
# Inputs.
# ----------------------------------------------------------------------------


_normal = jax.jit(jax.random.normal, static_argnums=(1, 2))


def _page_table(shape: ServingShape, seed: int) -> np.ndarray:
  """int32 ``[B, pages]``: a shuffled pool of ``B · pages`` pages."""
  pool = shape.batch * shape.pages
  return np.random.RandomState(seed).permutation(pool).reshape(
      shape.batch, shape.pages).astype(np.int32)


def _split_table(table: np.ndarray) -> np.ndarray:
  """The page table padded (with page 0) to what JAX's ``paged_attention``
  needs: pages per sequence a multiple of ``K_SPLITS``, and each split's a
  multiple of its 8-page compute block when longer than one."""
  pages = -(-table.shape[1] // K_SPLITS) * K_SPLITS
  if pages // K_SPLITS > 8:
    pages = -(-pages // (8 * K_SPLITS)) * (8 * K_SPLITS)
  return np.pad(table, ((0, 0), (0, pages - table.shape[1])))


class ServingInputs:
  """The arrays of one shape, made on first use and shared by its methods.

  ``get(shape, i, names)`` returns input set ``i``: ``"q"`` (bf16 ``[B, N,
  H]`` for decode, else ``[B, T, N, H]``), ``"k"``, ``"v"`` (dense bf16
  ``[B, P + T, K, H]``), ``"cache_int8"``, ``"cache_bf16"`` (a
  :class:`~sagejax.serving.PagedKVCache` holding k and v), ``"table"`` (int32
  ``[B, pages]``), ``"table_split"`` (padded for JAX's paged attention) and
  ``"lengths"`` (int32 ``[B]``). Set ``i > 0`` has a fresh q and copies of
  the other arrays. Changing the shape drops the previous one's arrays.
  """

  def __init__(self, seed: int, decode: bool):
    self._seed = seed
    self._decode = decode
    self._shape: Optional[ServingShape] = None
    self._sets: dict[tuple[int, str], Any] = {}

  def get(self, shape: ServingShape, i: int, names: tuple[str, ...]
          ) -> tuple:
    if shape != self._shape:
      self.clear()
      self._shape = shape
    return tuple(self._array(shape, i, name) for name in names)

  def clear(self) -> None:
    self._sets, self._shape = {}, None

  def _array(self, shape: ServingShape, i: int, name: str) -> Any:
    if (i, name) not in self._sets:
      if i == 0 or name == "q":
        self._sets[(i, name)] = self._make(shape, i, name)
      else:
        self._sets[(i, name)] = jax.tree.map(jnp.copy,
                                             self._array(shape, 0, name))
    return self._sets[(i, name)]

  def _make(self, shape: ServingShape, i: int, name: str) -> Any:
    b, n, kh, h = shape.batch, shape.heads, shape.kv_heads, shape.head_dim
    key = jax.random.fold_in(jax.random.key(self._seed), i)
    if name == "q":
      dims = (b, n, h) if self._decode else (b, shape.chunk, n, h)
      return _normal(jax.random.fold_in(key, 0), dims, jnp.bfloat16)
    if name in ("k", "v"):
      return _normal(jax.random.fold_in(key, 1 if name == "k" else 2),
                     (b, shape.tokens, kh, h), jnp.bfloat16)
    if name == "table":
      return jnp.asarray(_page_table(shape, self._seed))
    if name == "table_split":
      return jnp.asarray(_split_table(_page_table(shape, self._seed)))
    if name == "lengths":
      return jnp.full((b,), shape.tokens, jnp.int32)
    if name in ("cache_int8", "cache_bf16"):
      cache = serving.PagedKVCache.create(
          num_pages=b * shape.pages, page_size=shape.page_size,
          num_kv_heads=kh, head_dim=h, quantized=name == "cache_int8",
          dtype=jnp.bfloat16)
      k, v, table = (self._array(shape, 0, x) for x in ("k", "v", "table"))
      return serving.append(cache, k, v, table, jnp.zeros((b,), jnp.int32))
    raise KeyError(name)


# ----------------------------------------------------------------------------
# Methods.
# ----------------------------------------------------------------------------

# ``build(shape, decode) → (fn, names)``: the timed function and the names of
# its arguments (see ServingInputs); raises Skip when it cannot run.
Build = Callable[[ServingShape, bool], tuple[Callable[..., Any],
                                             tuple[str, ...]]]


@dataclasses.dataclass(frozen=True)
class ServingMethod:
  """One column of the decode and extend tables.

  Attributes:
    key: unique id, e.g. ``"pallas:int8/fp8"`` or ``"cudnn"``.
    label: what tables and plots show.
    family: ``"sagejax"`` or ``"baseline"``.
    pages: what it reads: ``"int8/fp8"`` or ``"bf16"`` pages, or
      ``"dense bf16"`` (a contiguous cache).
    build: see :data:`Build`.
    backend: the sagejax backend, or None.
  """
  key: str
  label: str
  family: str
  pages: str
  build: Build
  backend: Optional[str] = None


def _sage(backend: str, quantized: bool) -> Build:
  implementation = "pallas" if backend == INTERPRET else backend

  def build(shape: ServingShape, decode: bool):
    if backend == "mosaic":
      smallest = 32 if quantized else 64
      if decode and shape.page_size < smallest:
        raise Skip(f"the Mosaic decode copies pages of at least {smallest} "
                   f"tokens; pass --page-size 128")
      if not decode and not quantized:
        raise Skip("the Mosaic extend reads only quantized (INT8 K / FP8 V) "
                   "pages")
    attend = serving.decode_attention if decode else serving.extend_attention
    fn = functools.partial(attend, implementation=implementation,
                           interpret=backend == INTERPRET)
    return fn, ("q", "cache_int8" if quantized else "cache_bf16", "table",
                "lengths")
  return build


def _dense(implementation: str) -> Build:
  def build(shape: ServingShape, decode: bool):
    def fn(q, k, v):
      if decode:
        return jax.nn.dot_product_attention(
            q[:, None], k, v, implementation=implementation)[:, 0]
      return jax.nn.dot_product_attention(q, k, v,
                                          implementation=implementation)
    return fn, ("q", "k", "v")
  return build


def _jax_paged(shape: ServingShape, decode: bool):
  if not decode:
    raise Skip("decode only: JAX's paged_attention takes one query token "
               "per sequence")
  try:
    # pylint: disable-next=import-outside-toplevel
    from jax.experimental.pallas.ops.gpu import paged_attention
  except Exception as e:  # pylint: disable=broad-except
    raise Skip(f"paged_attention failed to import: {one_line(e)}") from e
  scale = shape.head_dim ** -0.5

  def fn(q, cache, table, lengths):  # it applies no logit scale
    return paged_attention.paged_attention(
        q * scale, cache.k_pages, cache.v_pages, table, lengths,
        k_splits=K_SPLITS)
  return fn, ("q", "cache_bf16", "table_split", "lengths")


def serving_methods(backends: list[str], baselines: list[str],
                    modes: tuple[str, ...] = COMMANDS
                    ) -> tuple[list[ServingMethod], list[str]]:
  """Two methods (INT8/FP8 and bf16 pages) per available sagejax backend,
  then the serving baselines asked for that can run here; notes (for
  ``modes``) on the others."""
  methods, notes = [], []
  what = " and ".join(modes)
  for key in backends:
    if not sage_backend(key).available():
      notes.append(f"{what}: sagejax backend {key!r} is not "
                   f"available on {jax.default_backend()}; skipped.")
      continue
    for pages in (QUANTIZED, BF16):
      methods.append(ServingMethod(
          key=f"{key}:{pages}", label=f"sagejax {key} {pages}",
          family="sagejax", pages=pages, backend=key,
          build=_sage(key, pages == QUANTIZED)))
  table = {"jax-xla": ("jax.nn xla bf16", DENSE, _dense("xla")),
           "cudnn": ("jax.nn cuDNN bf16", DENSE, _dense("cudnn")),
           "jax-paged": ("JAX paged bf16", BF16, _jax_paged)}
  gpu_only = []
  for name in BASELINES:
    if name not in baselines:
      continue
    if name in GPU_ONLY and not env.is_gpu():
      gpu_only.append(name)
      continue
    label, pages, build = table[name]
    methods.append(ServingMethod(key=name, label=label, family="baseline",
                                 pages=pages, build=build))
  if gpu_only:
    notes.append(f"{what}: {', '.join(gpu_only)} need an NVIDIA GPU; "
                 f"skipped on {jax.default_backend()}.")
  return methods, notes


# ----------------------------------------------------------------------------
# Measuring.
# ----------------------------------------------------------------------------


def base_row(method: ServingMethod, shape: ServingShape, mode: str
             ) -> dict[str, Any]:
  return {"method": method.key, "label": method.label,
          "family": method.family, "mode": mode, "backend": method.backend,
          "preset": None, "pages": method.pages, "dtype": "bf16",
          "batch": shape.batch, "heads": shape.heads,
          "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
          "prefix": shape.prefix, "chunk": shape.chunk,
          "tokens": shape.tokens, "page_size": shape.page_size,
          "status": "ok", "note": None}


def chained(fn: Callable[..., Any], calls: int) -> Callable[..., Any]:
  """``calls`` dependent calls of ``fn(q, ...)`` in one program: each
  call's queries take a trace of the last output (an elementwise pass every
  method pays), so the device's time per call is measured, not the host's
  dispatch of one."""
  def run(q, *rest):
    def body(q, _):
      return q + (fn(q, *rest) * 1e-3).astype(q.dtype), None
    return jax.lax.scan(body, q, None, length=calls, unroll=True)[0]
  return run


def measure(method: ServingMethod, shape: ServingShape, mode: str,
            inputs: ServingInputs, settings: Settings
            ) -> list[dict[str, Any]]:
  """One row: median time, cache TB/s and TOPS, or why there is none."""
  row = base_row(method, shape, mode)
  try:
    fn, names = method.build(shape, mode == "decode")
    chain = settings.chain if mode == "decode" else 1
    if chain > 1:
      fn = chained(fn, chain)
    args = inputs.get(shape, 0, names)
    start = time.perf_counter()
    try:
      lowered = jax.jit(fn).lower(*args)
    except (ValueError, NotImplementedError) as e:  # refused while tracing
      reason = one_line(e, 200, typed=False)
      raise Skip(f"does not serve this call: {reason}") from e
    compiled = lowered.compile()
    row["compile_s"] = round(time.perf_counter() - start, 3)
    t = time_rotating(
        compiled, args,
        lambda n: [inputs.get(shape, i, names) for i in range(1, n)],
        settings, method.label)
    nbytes = shape.cache_bytes(method.pages == QUANTIZED)
    median, fastest = t.median_s / chain, t.min_s / chain
    row.update(time_ms=median * 1e3, time_ms_min=fastest * 1e3,
               time_us=median * 1e6, tops=shape.flops / median / 1e12,
               bytes_read=nbytes, tb_s=nbytes / median / 1e12,
               calls=t.calls * chain, repeats=t.repeats,
               input_sets=t.input_sets, chain=chain)
  except Skip as e:
    row.update(status="skipped", note=str(e))
  except Exception as e:  # pylint: disable=broad-except  # one line, go on
    row.update(status="error", note=one_line(e))
  return [row]


def tasks(settings: Settings, methods: list[ServingMethod], mode: str
          ) -> list[Task]:
  """One task per (shape, method) of ``mode`` (``"decode"`` or
  ``"extend"``); a shape's inputs are freed after its methods."""
  decode = mode == "decode"
  inputs = ServingInputs(settings.seed, decode)
  out = []
  for shape in settings.decode_shapes if decode else settings.extend_shapes:
    what = (f"B={shape.batch} S={shape.tokens}" if decode else
            f"B={shape.batch} P={shape.prefix} T={shape.chunk}")
    for method in methods:
      out.append(Task(
          mode, f"{mode} {method.label} {what}",
          lambda m=method, s=shape: measure(m, s, mode, inputs, settings)))
    out.append(Task(mode, f"{mode}: free inputs",
                    lambda: (inputs.clear(), [])[1]))
  return out


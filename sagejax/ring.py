"""Ring attention (context parallelism) with quantized K/V exchange.

The sequence axis of Q, K and V is split over the devices of a mesh axis;
inside :func:`jax.shard_map`, :func:`ring_attention` gives each device the
attention output of its query shard over the whole sequence:

* Each device quantizes its shard once: Q as :func:`sagejax.quant.quantize_q`,
  K minus the *global* mean of K (one ``psum``: K smoothing stays exact, and
  the LSE shift is the single-device one), V to FP8 with its own per-channel
  scales. The K/V shard (INT8 K with its scales, FP8 V with its scales: about
  half the bytes of bf16) then travels around the ring with
  :func:`jax.lax.ppermute`; the transfer of the next shard is issued before
  the attention on the current one, so that the two overlap.
* Each step runs the backend's attention kernel (``backend.kernel``, the one
  ``sagejax.attention`` uses) on (local Q, visiting K/V); the partial outputs
  are merged by their log-sum-exp.
* Causal: the diagonal shard is causal in local coordinates, shards before it
  are seen whole and shards after it not at all, so the kernels need no
  position offset. With ``order="contiguous"`` device ``i`` holds tokens
  ``[i·T/P, (i+1)·T/P)`` and does ``i + 1`` shards of work; with
  ``order="zigzag"`` device ``i`` holds chunks ``i`` and ``2P−1−i`` of ``2P``
  equal chunks (:func:`zigzag_order`), and after its own shard every step is
  exactly half a shard (all its queries × the first half of the visiting
  keys, or its second half of queries × all visiting keys): every device does
  the same work.
* Gradients are those of exact attention (as :mod:`sagejax._vjp`): a ring
  pass recomputes the exact FP32 softmax statistics, a second pass computes
  dQ locally while dK and dV travel with their K/V shard back to its owner.
  The backward exchanges K and V in the input dtype (exactness) and dK/dV in
  f32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from sagejax import _inputs, _vjp, backends, quant
from sagejax.config import ConfigLike, SageConfig, resolve_config
from sagejax.masks import MaskSpec

ORDERS = ("contiguous", "zigzag")
# Backends whose kernel the ring can feed (see _prepared).
RING_BACKENDS = ("mosaic", "pallas", "xla")
# Unroll the ring's steps (a measurement knob: one compiled step body, or
# every step visible to XLA's scheduler; benchmarks/multi_gpu_check.py).
UNROLL_STEPS = False
# Local shards are padded to a multiple of this many tokens (and of the
# config's blocks): every kernel tile then divides the padded length.
_TOKEN_MULTIPLE = 128


# ----------------------------------------------------------------------------
# Zig-zag order.
# ----------------------------------------------------------------------------


def _zigzag_chunks(num_shards: int) -> list[int]:
  """Chunk ids in zig-zag order: shard i holds chunks i and 2P−1−i."""
  last = 2 * num_shards - 1
  return [c for i in range(num_shards) for c in (i, last - i)]


def _permute_chunks(x: jax.Array, chunks: Sequence[int], axis: int
                    ) -> jax.Array:
  n = x.shape[axis]
  if n % len(chunks):
    raise ValueError(f"the sequence axis {axis} has length {n}, not a "
                     f"multiple of 2 x num_shards = {len(chunks)}; pad it "
                     "first (ring_attention_on_mesh pads for you).")
  parts = jnp.split(x, len(chunks), axis=axis)
  return jnp.concatenate([parts[c] for c in chunks], axis=axis)


def zigzag_order(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
  """Puts a sequence in zig-zag order for ``num_shards`` ring devices.

  The sequence axis (``axis``, length a multiple of ``2·num_shards``) is cut
  into ``2P`` equal chunks and reordered ``0, 2P−1, 1, 2P−2, ...``: a
  contiguous split into ``P`` shards then gives device ``i`` chunks ``i`` and
  ``2P−1−i``, which balances causal attention. Inverse: :func:`zigzag_restore`.
  """
  return _permute_chunks(x, _zigzag_chunks(num_shards), axis)


def zigzag_restore(x: jax.Array, num_shards: int, axis: int = 1
                   ) -> jax.Array:
  """Inverse of :func:`zigzag_order`."""
  chunks = _zigzag_chunks(num_shards)
  inverse = [chunks.index(c) for c in range(len(chunks))]
  return _permute_chunks(x, inverse, axis)


def _zigzag_dest(chunk: int, size: int) -> int:
  """The device that holds ``chunk`` in zig-zag order."""
  return chunk if chunk < size else 2 * size - 1 - chunk


def _zigzag_exchange(x: jax.Array, axis_name, size: int, axis: int,
                     inverse: bool = False) -> jax.Array:
  """Inside ``shard_map``: contiguous shards → zig-zag shards (or back) with
  two ppermute calls of half a shard each (what :func:`zigzag_order` does to
  the global array, without gathering it)."""
  i = jax.lax.axis_index(axis_name)
  even = i % 2 == 0
  first, second = jnp.split(x, 2, axis=axis)
  last = 2 * size - 1
  if not inverse:  # device d holds chunks 2d and 2d + 1
    a = jax.lax.ppermute(first, axis_name,
                         [(d, _zigzag_dest(2 * d, size)) for d in range(size)])
    b = jax.lax.ppermute(second, axis_name, [
        (d, _zigzag_dest(2 * d + 1, size)) for d in range(size)])
    # Device i receives chunk i and chunk 2P−1−i; the even one came by `a`.
    return jnp.where(even, jnp.concatenate([a, b], axis),
                     jnp.concatenate([b, a], axis))
  # Device i holds chunks i and 2P−1−i; chunk c goes home to device c // 2.
  even_chunk = jnp.where(even, first, second)
  odd_chunk = jnp.where(even, second, first)
  home = lambda c: c // 2  # noqa: E731
  a = jax.lax.ppermute(even_chunk, axis_name, [
      (d, home(d if d % 2 == 0 else last - d)) for d in range(size)])
  b = jax.lax.ppermute(odd_chunk, axis_name, [
      (d, home(last - d if d % 2 == 0 else d)) for d in range(size)])
  return jnp.concatenate([a, b], axis)


# ----------------------------------------------------------------------------
# Where the tokens are.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Ring:
  """Static geometry of one ring call (hashable)."""
  axis_name: object
  size: int          # P
  order: str
  causal: bool
  q_len: int         # local T
  kv_len: int        # local S

  def local_valid(self, lengths: Optional[jax.Array], device, n: int,
                  batch: int) -> jax.Array:
    """Valid tokens of ``device``'s shard (always a prefix), int32 ``[B]``.

    ``lengths`` are global valid lengths (padding at the end of the global
    sequence); None means all valid.
    """
    if lengths is None:
      return jnp.full((batch,), n, jnp.int32)
    lengths = lengths.astype(jnp.int32)
    if self.order == "contiguous":
      return jnp.clip(lengths - device * n, 0, n)
    half = n // 2
    first = jnp.clip(lengths - device * half, 0, half)
    second = jnp.clip(lengths - (2 * self.size - 1 - device) * half, 0, half)
    return first + second

  def tasks(self, own: bool, index, visiting) -> "_Tasks":
    """What device ``index`` computes against the shard of ``visiting``
    (``own``: its own shard, the first step)."""
    if own:
      return _Tasks(None, ("all", "all", self.causal), None)
    if not self.causal:
      return _Tasks(None, ("all", "all", False), None)
    before = visiting < index
    if self.order == "contiguous":
      return _Tasks(before, ("all", "all", False), "skip")
    return _Tasks(before, ("all", "first", False),
                  ("second", "all", False))


@dataclasses.dataclass(frozen=True)
class _Tasks:
  """One task, or two chosen at run time by ``pred`` (``lax.cond``)."""
  pred: Optional[jax.Array]
  if_true: tuple
  if_false: Optional[tuple]

  def run(self, fn: Callable, skip: Callable):
    if self.pred is None:
      return fn(*self.if_true)
    other = skip if self.if_false == "skip" else (
        lambda: fn(*self.if_false))
    return jax.lax.cond(self.pred, lambda: fn(*self.if_true), other)


def _rows(x: jax.Array, part: str, half: int, axis: int) -> jax.Array:
  """All rows, the first ``half``, or those after it, along ``axis``."""
  if part == "all":
    return x
  if part == "first":
    return jax.lax.slice_in_dim(x, 0, half, axis=axis)
  return jax.lax.slice_in_dim(x, half, x.shape[axis], axis=axis)


def _part_length(lengths: jax.Array, part: str, half: int) -> jax.Array:
  if part == "all":
    return lengths
  if part == "first":
    return jnp.minimum(lengths, half)
  return jnp.maximum(lengths - half, 0)


def _pad_to(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
  if x.shape[axis] == size:
    return x
  if x.shape[axis] > size:
    return jax.lax.slice_in_dim(x, 0, size, axis=axis)
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _merge(a, b):
  """Merges two partial attentions ``(out [B, N, T, H], lse [B, N, T])``."""
  (oa, la), (ob, lb) = a, b
  m = jnp.maximum(la, lb)
  m_use = jnp.where(jnp.isneginf(m), 0.0, m)
  wa, wb = jnp.exp(la - m_use), jnp.exp(lb - m_use)
  total = wa + wb
  seen = total > 0
  inv = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
  out = (oa * (wa * inv)[..., None] + ob * (wb * inv)[..., None])
  lse = jnp.where(seen, m_use + jnp.log(jnp.where(seen, total, 1.0)),
                  -jnp.inf)
  return out, lse


def _ring_perm(size: int):
  return [(j, (j + 1) % size) for j in range(size)]


def _ring_loop(ring: "_Ring", payload, step_fn: Callable, combine: Callable,
               carry=None):
  """Walks ``payload`` (this device's shard) around the ring.

  ``step_fn(tasks, visiting, payload)`` computes one step's part and
  ``combine(carry, part)`` accumulates it. The transfer of the next shard is
  issued before each step's compute so that the two overlap. Steps after the
  first run in a ``fori_loop`` (one compiled body); its last transfer is not
  used.
  """
  index = jax.lax.axis_index(ring.axis_name)
  perm = _ring_perm(ring.size)
  if ring.size > 1:
    incoming = jax.lax.ppermute(payload, ring.axis_name, perm)
  part = step_fn(ring.tasks(True, index, index), index, payload)
  carry = part if carry is None else combine(carry, part)
  if ring.size == 1:
    return carry

  def body(step, state):
    current, carry = state
    incoming = jax.lax.ppermute(current, ring.axis_name, perm)
    visiting = (index - step) % ring.size
    part = step_fn(ring.tasks(False, index, visiting), visiting, current)
    return incoming, combine(carry, part)

  return jax.lax.fori_loop(1, ring.size, body, (incoming, carry),
                           unroll=UNROLL_STEPS)[1]


# ----------------------------------------------------------------------------
# The quantized forward.
# ----------------------------------------------------------------------------


def _global_mean(x: jax.Array, valid: jax.Array, axis_name) -> jax.Array:
  """Mean over the valid tokens of all shards: f32 ``[B, K, H]`` (one psum)."""
  keep = jnp.arange(x.shape[2])[None, :] < valid[:, None]
  total = jnp.sum(jnp.where(keep[:, None, :, None], x.astype(jnp.float32),
                            0.0), axis=2)
  total, count = jax.lax.psum((total, valid.astype(jnp.float32)), axis_name)
  return total / jnp.maximum(count, 1.0)[:, None, None]


def _scale_groups(config: SageConfig, n: int):
  shape, reduce = quant._group_view("k", config, n)  # noqa: SLF001
  return shape, reduce


def _compact_k_scale(k_scale: jax.Array, config: SageConfig) -> jax.Array:
  """One K scale per quantization group (what travels), not one per token."""
  *lead, n = k_scale.shape
  shape, reduce = _scale_groups(config, n)
  x = k_scale.reshape(*lead, *shape)
  for a in reduce:
    x = jax.lax.slice_in_dim(x, 0, 1, axis=len(lead) + a)
  return x


def _expand_k_scale(compact: jax.Array, config: SageConfig, n: int
                    ) -> jax.Array:
  shape, _ = _scale_groups(config, n)
  lead = compact.shape[:compact.ndim - len(shape)]
  return jnp.broadcast_to(compact, (*lead, *shape)).reshape(*lead, n)


@dataclasses.dataclass(frozen=True)
class _Static:
  ring: _Ring
  config: SageConfig
  sm_scale: float
  backend: str
  layout: str

  @property
  def multiple(self) -> int:
    """Local shards are padded to a multiple of this many tokens."""
    return max(_TOKEN_MULTIPLE, self.config.block_q, self.config.block_k)


def _quantize_local(st: _Static, q, k, v, q_valid, kv_valid):
  """Quantizes the local shard: (Q values, Q scale, K/V payload, V mean,
  LSE shift). ``q``, ``k``, ``v`` are canonical and padded."""
  cfg = st.config
  k_mean = v_mean = None
  if cfg.smooth_k:
    k_mean = _global_mean(k, kv_valid, st.ring.axis_name)
    k = k.astype(jnp.float32) - k_mean[:, :, None, :]
  if cfg.smooth_v:
    v_mean = _global_mean(v, kv_valid, st.ring.axis_name)
    v = v.astype(jnp.float32) - v_mean[:, :, None, :]
  q_vals, q_scale, _ = quant.quantize_q(q, cfg, st.sm_scale, q_valid)
  shift = None
  if k_mean is not None:
    shift = quant.lse_shift(quant.zero_padding(q, q_valid), k_mean,
                            st.sm_scale)
  return q_vals, q_scale, _kv_payload(k, v, cfg, kv_valid), v_mean, shift


def _kv_payload(k, v, cfg: SageConfig, kv_valid):
  """What travels around the ring: (K values, K scales per group, V values, V
  scales per channel), from K and V already smoothed (global means)."""
  k_vals, k_scale, _, _ = quant.quantize_k(k, cfg.replace(smooth_k=False),
                                           kv_valid)
  v_vals, v_scale, _ = quant.quantize_v(v, cfg.replace(smooth_v=False),
                                        kv_valid)
  return (_to_wire(k_vals), _compact_k_scale(k_scale, cfg), _to_wire(v_vals),
          v_scale)


def _to_wire(x: jax.Array) -> jax.Array:
  """8-bit floats travel as their bytes (collectives may widen FP8 types)."""
  if x.dtype == quant.FP8_DTYPE:
    return jax.lax.bitcast_convert_type(x, jnp.uint8)
  return x


def _from_wire(x: jax.Array, dtype) -> jax.Array:
  if x.dtype == jnp.uint8:
    return jax.lax.bitcast_convert_type(x, dtype)
  return x


def exchange_bytes(key_shape: Sequence[int], config: ConfigLike = "sage2-8b",
                   layout: str = "BTNH") -> tuple[int, int]:
  """Bytes of one device's K/V shard on the ring: (quantized, bf16).

  ``key_shape`` is the local ``[B, S/P, K, H]`` (``layout``). The quantized
  shard is what :func:`ring_attention` sends each step (padded to whole
  blocks); the bf16 figure is K and V in bf16, what a bf16 ring sends.
  """
  cfg = resolve_config(config)
  b, a1, a2, h = key_shape
  kh, s = (a2, a1) if layout == "BTNH" else (a1, a2)
  sp = _round_up(s, max(_TOKEN_MULTIPLE, cfg.block_q, cfg.block_k))
  x = jax.ShapeDtypeStruct((b, kh, sp, h), jnp.float32)
  payload = jax.eval_shape(
      lambda k, v: _kv_payload(k, v, cfg, jnp.full((b,), s, jnp.int32)), x, x)
  quantized = sum(math.prod(p.shape) * p.dtype.itemsize
                  for p in jax.tree.leaves(payload))
  return quantized, 2 * 2 * b * kh * s * h


def _attend(st: _Static, backend, q_vals, q_scale, payload, v_mean, q_part,
            k_part, causal, q_valid, kv_valid):
  """The backend's kernel on (local Q rows, visiting K/V keys): f32 output
  ``[B, N, Tq, H]`` and LSE ``[B, N, Tq]`` over the rows of ``q_part``,
  placed back into the local rows (others: zeros, −inf)."""
  t_full = q_vals.shape[2]
  n_k = payload[0].shape[2]
  half_q, half_k = st.ring.q_len // 2, st.ring.kv_len // 2
  k_vals, k_scale_c, v_vals, v_scale = payload
  v_vals = _from_wire(v_vals, quant.FP8_DTYPE)
  k_scale = _expand_k_scale(k_scale_c, st.config, n_k)
  q = _rows(q_vals, q_part, half_q, 2)
  qs = _rows(q_scale, q_part, half_q, 2)
  k = _rows(k_vals, k_part, half_k, 2)
  ks = _rows(k_scale, k_part, half_k, 2)
  v = _rows(v_vals, k_part, half_k, 2)
  tq, sk = _round_up(q.shape[2], st.multiple), _round_up(k.shape[2],
                                                          st.multiple)
  q, qs = _pad_to(q, 2, tq), _pad_to(qs, 2, tq, 1.0)
  k, ks, v = _pad_to(k, 2, sk), _pad_to(ks, 2, sk, 1.0), _pad_to(v, 2, sk)
  q_len = _part_length(q_valid, q_part, half_q)
  kv_len = _part_length(kv_valid, k_part, half_k)
  qkv = quant.QuantizedQKV(q=q, q_scale=qs, k=k, k_scale=ks, v=v,
                           v_scale=v_scale, v_mean=v_mean, delta_s=None)
  b, n = q.shape[:2]
  kh, h = k.shape[1], v.shape[-1]
  spec = MaskSpec(is_causal=causal, causal_alignment="top_left", window=None,
                  q_len=tq, kv_len=sk)
  call = _inputs.ParsedCall(
      q=jax.ShapeDtypeStruct((b, n, tq, h), jnp.float32),
      k=jax.ShapeDtypeStruct((b, kh, sk, h), jnp.float32),
      v=jax.ShapeDtypeStruct((b, kh, sk, h), jnp.float32), bias=None,
      mask=None, q_lengths=q_len, kv_lengths=kv_len, spec=spec,
      sm_scale=st.sm_scale, layout="BNTH", unbatched=False)
  out, lse = backend.kernel(_prepared(backend, qkv, q_len, kv_len, st.config),
                            call, st.config)
  out = out.astype(jnp.float32)
  if q_part == "second":  # back into the local rows
    out = jnp.pad(out, [(0, 0), (0, 0), (half_q, 0), (0, 0)])
    lse = jnp.pad(lse, [(0, 0), (0, 0), (half_q, 0)],
                  constant_values=-jnp.inf)
  return _pad_to(out, 2, t_full), _pad_to(lse, 2, t_full, -jnp.inf)


def _prepared(backend, qkv: quant.QuantizedQKV, q_len, kv_len,
              config: SageConfig):
  """``qkv`` in the form ``backend.kernel`` takes."""
  if backend.name == "xla":
    return qkv
  if backend.name == "pallas":
    from sagejax.backends import pallas_triton
    v = qkv.v
    if v.dtype == quant.FP8_DTYPE:
      # FP8 values on FP16 tensor cores, or FP8 MMA on V transposed.
      v = (v.astype(jnp.float16) if backend.fp8_on_fp16_mma
           else jnp.swapaxes(v, 2, 3))
    return pallas_triton.Prepared(qkv=dataclasses.replace(qkv, v=v),
                                  q_lengths=q_len, kv_lengths=kv_len)
  if backend.name == "mosaic":
    from sagejax.backends import pallas_triton
    from sagejax.kernels.mosaic_attention import pv_key_order
    v = qkv.v
    if v.dtype == quant.FP8_DTYPE:  # [B, K, H, S], keys in the P̃ order
      v = jnp.swapaxes(jnp.take(v, pv_key_order(v.shape[2]), axis=2), 2, 3)
    q, k = qkv.q, qkv.k
    if config.qk_dtype == "int4":  # no 4-bit tensor cores on Hopper
      q, k = quant.unpack_int4(q), quant.unpack_int4(k)
    return pallas_triton.Prepared(
        qkv=dataclasses.replace(qkv, q=q, k=k, v=v), q_lengths=q_len,
        kv_lengths=kv_len)
  raise ValueError(f"ring_attention runs the backends {RING_BACKENDS}, not "
                   f"{backend.name!r}.")


def _select_backend(name: Optional[str], call, config: SageConfig):
  """The backend named (it must be one the ring feeds), or the first of
  those available that serves the call."""
  if name is not None:
    if name not in RING_BACKENDS:
      raise ValueError(f"ring_attention runs the backends {RING_BACKENDS}, "
                       f"not {name!r}.")
    return backends.select(name, call, config)
  for backend in backends.registry().values():
    if (backend.name in RING_BACKENDS and backend.available()
        and backend.unsupported(call, config) is None):
      return backend
  raise AssertionError("the 'xla' backend serves every call")


def _head_dim(backend, h: int) -> int:
  """The head dim the backend's kernel runs at (zero channels added)."""
  from sagejax.kernels._common import next_pow2
  if backend.name == "pallas":
    return max(32, next_pow2(h))
  if backend.name == "mosaic":
    return max(64, next_pow2(h))
  return h


def _ring_forward(st: _Static, q, k, v, q_lengths, kv_lengths):
  """Quantized ring forward on canonical local shards: (out f32 [B, N, T, H],
  lse [B, N, T])."""
  ring = st.ring
  backend = backends.registry()[st.backend]
  b, n, t, h = q.shape
  s = k.shape[2]
  index = jax.lax.axis_index(ring.axis_name)
  q_valid = ring.local_valid(q_lengths, index, t, b)
  hp = _head_dim(backend, h)
  tp, sp = _round_up(t, st.multiple), _round_up(s, st.multiple)
  q = _pad_to(_pad_to(q, 3, hp), 2, tp)
  k = _pad_to(_pad_to(k, 3, hp), 2, sp)
  v = _pad_to(_pad_to(v, 3, hp), 2, sp)
  kv_valid = ring.local_valid(kv_lengths, index, s, b)
  q_vals, q_scale, payload, v_mean, shift = _quantize_local(
      st, q, k, v, q_valid, kv_valid)
  attend = functools.partial(_attend, st, backend, q_vals, q_scale)
  empty = (jnp.zeros((b, n, tp, hp), jnp.float32),
           jnp.full((b, n, tp), -jnp.inf, jnp.float32))

  def step(tasks, visiting, payload):
    visiting_valid = ring.local_valid(kv_lengths, visiting, s, b)
    return tasks.run(lambda qp, kp, causal: attend(
        payload, v_mean, qp, kp, causal, q_valid, visiting_valid),
                     lambda: empty)

  acc = _ring_loop(ring, payload, step, _merge)
  out, lse = acc
  out, lse = out[:, :, :t, :h], lse[:, :, :t]
  if shift is not None:
    lse = lse + shift[:, :, :t]
  return out, lse


# ----------------------------------------------------------------------------
# The exact backward.
# ----------------------------------------------------------------------------


def _exact_part(st: _Static, q, k, v, q_part, k_part, causal, q_valid,
                kv_valid, fn, *extra):
  """Runs ``fn`` (an exact blockwise pass of :mod:`sagejax._vjp`) on the
  rows ``q_part`` of the local queries and ``k_part`` of the visiting keys."""
  half_q, half_k = st.ring.q_len // 2, st.ring.kv_len // 2
  rows = lambda x: _rows(x, q_part, half_q, 2)  # noqa: E731
  keys = lambda x: _rows(x, k_part, half_k, 2)  # noqa: E731
  spec = MaskSpec(is_causal=causal, causal_alignment="top_left", window=None,
                  q_len=rows(q).shape[2], kv_len=keys(k).shape[2])
  return fn(rows(q), keys(k), keys(v), None, None,
            _part_length(q_valid, q_part, half_q),
            _part_length(kv_valid, k_part, half_k),
            *[rows(x) for x in extra], spec, st.sm_scale)


def _place(x: jax.Array, part: str, half: int, full: int, value=0.0):
  """Rows of ``part`` back into ``full`` local rows (axis 2)."""
  if part == "second":
    widths = [(0, 0)] * x.ndim
    widths[2] = (half, 0)
    x = jnp.pad(x, widths, constant_values=value)
  return _pad_to(x, 2, full, value)


def _ring_exact_stats(st: _Static, q, k, v, q_lengths, kv_lengths):
  """Exact FP32 (out, lse) of the local queries over the whole ring."""
  ring = st.ring
  b, n, t, h = q.shape
  s = k.shape[2]
  index = jax.lax.axis_index(ring.axis_name)
  q_valid = ring.local_valid(q_lengths, index, t, b)
  empty = (jnp.zeros((b, n, t, h), jnp.float32),
           jnp.full((b, n, t), -jnp.inf, jnp.float32))

  def step(tasks, visiting, payload):
    vv = ring.local_valid(kv_lengths, visiting, s, b)

    def task(qp, kp, causal):
      out, lse = _exact_part(st, q, *payload, qp, kp, causal, q_valid, vv,
                             _vjp.exact_forward)
      return (_place(out, qp, ring.q_len // 2, t),
              _place(lse, qp, ring.q_len // 2, t, -jnp.inf))

    return tasks.run(task, lambda: empty)

  return _ring_loop(ring, (k, v), step, _merge)


def _ring_backward(st: _Static, q, k, v, q_lengths, kv_lengths, d_out,
                   d_lse):
  """Exact-attention gradients (dQ, dK, dV), f32, canonical local shards."""
  ring = st.ring
  b, n, t, h = q.shape
  s = k.shape[2]
  index = jax.lax.axis_index(ring.axis_name)
  q_valid = ring.local_valid(q_lengths, index, t, b)
  out, lse = _ring_exact_stats(st, q, k, v, q_lengths, kv_lengths)
  delta = jnp.sum(d_out.astype(jnp.float32) * out, axis=-1)
  if d_lse is not None:
    delta = delta - d_lse.astype(jnp.float32)
  no_grads = (jnp.zeros((b, n, t, h), jnp.float32),
              jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  perm = _ring_perm(ring.size)

  def step(tasks, visiting, kv):
    vv = ring.local_valid(kv_lengths, visiting, s, b)

    def task(qp, kp, causal):
      g = _exact_part(st, q, *kv, qp, kp, causal, q_valid, vv,
                      _vjp.backward_from_stats, d_out, lse, delta)
      return (_place(g[0], qp, ring.q_len // 2, t),
              _place(g[1], kp, ring.kv_len // 2, s),
              _place(g[2], kp, ring.kv_len // 2, s))

    return tasks.run(task, lambda: no_grads)

  # dK and dV travel with their K/V shard: each step adds to the visiting
  # shard's gradients; P transfers bring them back to their owner.
  def combine(carry, part):
    dq, grads = carry
    grads = (grads[0] + part[1], grads[1] + part[2])
    return dq + part[0], jax.lax.ppermute(grads, ring.axis_name, perm)

  dq, grads = _ring_loop(ring, (k, v), step, combine,
                         carry=(no_grads[0], no_grads[1:]))
  return dq, grads[0], grads[1]


# ----------------------------------------------------------------------------
# The public function.
# ----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(st: _Static, q, k, v, q_lengths, kv_lengths):
  canon = functools.partial(_inputs.to_canonical, layout=st.layout)
  out, lse = _ring_forward(st, canon(q), canon(k), canon(v), q_lengths,
                           kv_lengths)
  return _inputs.from_canonical(out, st.layout).astype(q.dtype), lse


def _ring_fwd(st, q, k, v, q_lengths, kv_lengths):
  return _ring(st, q, k, v, q_lengths, kv_lengths), (q, k, v, q_lengths,
                                                     kv_lengths)


def _ring_bwd(st, res, cotangents):
  q, k, v, q_lengths, kv_lengths = res
  d_out, d_lse = cotangents
  canon = functools.partial(_inputs.to_canonical, layout=st.layout)
  grads = _ring_backward(st, canon(q), canon(k), canon(v), q_lengths,
                         kv_lengths, canon(d_out), d_lse)
  dq, dk, dv = (_inputs.from_canonical(g, st.layout).astype(x.dtype)
                for g, x in zip(grads, (q, k, v)))
  return dq, dk, dv, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _axis_size(axis_name) -> int:
  try:
    return jax.lax.axis_size(axis_name)
  except (AttributeError, NameError) as e:
    raise ValueError(f"ring_attention must run inside jax.shard_map over "
                     f"the mesh axis {axis_name!r}.") from e


def ring_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    axis_name,
    is_causal: bool = False,
    order: str = "contiguous",
    scale: Optional[float] = None,
    query_seq_lengths: Optional[jax.Array] = None,
    key_value_seq_lengths: Optional[jax.Array] = None,
    config: ConfigLike = "sage2-8b",
    layout: str = "BTNH",
    implementation: Optional[str] = None,
    return_lse: bool = False,
):
  """Quantized attention over a sequence split across ``axis_name``.

  Call inside :func:`jax.shard_map` with the sequence axes of ``query``,
  ``key`` and ``value`` split over the mesh axis ``axis_name`` (P devices);
  returns this device's shard of :func:`sagejax.attention` on the whole
  sequence (see :func:`ring_attention_on_mesh` to skip the ``shard_map``).

  Shapes are local (``layout="BTNH"``; ``"BNTH"`` swaps T and N)::

    query [B, T/P, N, H], key and value [B, S/P, K, H] (N a multiple of K).

  Args:
    query, key, value: this device's shards.
    axis_name: the mesh axis (name or tuple of names) the sequence is split
      over.
    is_causal: causal attention on global positions (``"top_left"``: query
      ``i`` sees keys ``j <= i``); needs T == S.
    order: how the global sequence is laid out over the devices:
      ``"contiguous"`` (device i holds tokens ``[i·T/P, (i+1)·T/P)``) or
      ``"zigzag"`` (device i holds chunks ``i`` and ``2P−1−i`` of ``2P``
      equal chunks, :func:`zigzag_order`; local lengths must be even), which
      gives every device the same causal work.
    scale: logit scale; default ``1/sqrt(H)``.
    query_seq_lengths, key_value_seq_lengths: optional int ``[B]`` *global*
      valid lengths (the same on every device): tokens at or past them (at
      the end of the global sequence) are padding.
    config: a :class:`SageConfig` or preset without ``smooth_q`` (ΔS would
      need the visiting K in full precision): ``"sage2-8b"``, ``"sage1"``.
    layout: ``"BTNH"`` or ``"BNTH"``.
    implementation: ``"mosaic"``, ``"pallas"``, ``"xla"``, or None for the
      first available that serves the call (as :func:`sagejax.attention`).
    return_lse: also return the natural-log LSE, f32 ``[B, N, T/P]``.

  Returns:
    This device's output shard in ``query``'s dtype and layout (and the LSE).
    Padding query rows give zeros (LSE −inf).

  Gradients: those of exact attention with recomputed exact statistics
  (the arithmetic of :mod:`sagejax._vjp`, in XLA), whatever the config's
  backward options.
  """
  cfg = resolve_config(config)
  if cfg.smooth_q:
    raise ValueError(
        "ring_attention does not support smooth_q (ΔS = q̄·γ(K)ᵀ would need "
        "each visiting K shard in full precision); pass a config with "
        "smooth_q=False, e.g. 'sage2-8b' or config.replace(smooth_q=False).")
  if order not in ORDERS:
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}.")
  call = _inputs.parse(query, key, value, scale=scale, is_causal=is_causal,
                       layout=layout)
  if call.unbatched:
    raise ValueError("ring_attention takes 4-D query, key and value with a "
                     "batch axis.")
  b, _, t, _, _, s = call.dims
  if is_causal and t != s:
    raise ValueError(f"causal ring attention needs equal local query and key "
                     f"lengths, got T/P={t} and S/P={s}.")
  if order == "zigzag" and (t % 2 or s % 2):
    raise ValueError(f"order='zigzag' needs even local lengths (two chunks "
                     f"per device), got T/P={t}, S/P={s}.")
  lengths = [_inputs._check_lengths(x, name, b)  # noqa: SLF001
             for x, name in ((query_seq_lengths, "query_seq_lengths"),
                             (key_value_seq_lengths, "key_value_seq_lengths"))]
  backend = _select_backend(implementation, call, cfg)
  ring = _Ring(axis_name=axis_name, size=_axis_size(axis_name), order=order,
               causal=bool(is_causal), q_len=t, kv_len=s)
  st = _Static(ring=ring, config=cfg, sm_scale=call.sm_scale,
               backend=backend.name, layout=layout)
  out, lse = _ring(st, call.q, call.k, call.v, *lengths)
  return (out, lse) if return_lse else out


def ring_attention_on_mesh(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mesh: jax.sharding.Mesh,
    *,
    seq_axis,
    batch_axis=None,
    head_axis=None,
    is_causal: bool = False,
    load_balance: bool = True,
    query_seq_lengths: Optional[jax.Array] = None,
    key_value_seq_lengths: Optional[jax.Array] = None,
    layout: str = "BTNH",
    return_lse: bool = False,
    **kwargs,
):
  """:func:`ring_attention` on whole arrays: pads, orders, maps over the mesh.

  ``query [B, T, N, H]``, ``key``/``value [B, S, K, H]`` (global). The
  sequence is split over the mesh axis ``seq_axis``; optionally the batch over
  ``batch_axis`` and the heads over ``head_axis`` as well. Lengths not
  divisible by the ring size are padded (and masked). With ``is_causal`` and
  ``load_balance`` the shards are put in zig-zag order first and the output
  restored (two ppermute calls of half a shard for each of Q, K, V and the
  output: to skip them, keep activations in zig-zag order, see
  :func:`zigzag_order`, and call :func:`ring_attention` with
  ``order="zigzag"`` inside your own ``shard_map``). Other keyword arguments
  go to :func:`ring_attention`.
  """
  if layout not in _inputs.LAYOUTS:
    raise ValueError(f"layout must be one of {_inputs.LAYOUTS}, got "
                     f"{layout!r}.")
  axes = seq_axis if isinstance(seq_axis, tuple) else (seq_axis,)
  size = 1
  for a in axes:
    size *= mesh.shape[a]
  seq = 1 if layout == "BTNH" else 2
  t, s = query.shape[seq], key.shape[seq]
  zigzag = bool(is_causal and load_balance and size > 1)
  multiple = 2 * size if zigzag else size
  tp, sp = _round_up(t, multiple), _round_up(s, multiple)
  b = query.shape[0]
  if tp != t and query_seq_lengths is None:
    query_seq_lengths = jnp.full((b,), t, jnp.int32)
  if sp != s and key_value_seq_lengths is None:
    key_value_seq_lengths = jnp.full((b,), s, jnp.int32)
  q = _pad_to(query, seq, tp)
  k, v = _pad_to(key, seq, sp), _pad_to(value, seq, sp)
  P = jax.sharding.PartitionSpec
  heads = 2 if layout == "BTNH" else 1
  spec = [batch_axis, None, None, None]
  spec[seq], spec[heads] = seq_axis, head_axis
  x_spec = P(*spec)
  len_spec = P(batch_axis)
  lse_spec = P(batch_axis, head_axis, seq_axis)
  order = "zigzag" if zigzag else "contiguous"

  def local(q, k, v, ql, kvl):
    if zigzag:
      q, k, v = (_zigzag_exchange(x, seq_axis, size, seq) for x in (q, k, v))
    out, lse = ring_attention(q, k, v, axis_name=seq_axis,
                              is_causal=is_causal, order=order,
                              query_seq_lengths=ql, key_value_seq_lengths=kvl,
                              layout=layout, return_lse=True, **kwargs)
    if zigzag:
      out = _zigzag_exchange(out, seq_axis, size, seq, inverse=True)
      lse = _zigzag_exchange(lse, seq_axis, size, 2, inverse=True)
    return out, lse

  length_specs = tuple(None if x is None else len_spec
                       for x in (query_seq_lengths, key_value_seq_lengths))
  out, lse = jax.shard_map(
      local, mesh=mesh,
      in_specs=(x_spec, x_spec, x_spec) + length_specs,
      out_specs=(x_spec, lse_spec), check_vma=False)(
          q, k, v, query_seq_lengths, key_value_seq_lengths)
  out = jax.lax.slice_in_dim(out, 0, t, axis=seq)
  lse = lse[:, :, :t]
  return (out, lse) if return_lse else out

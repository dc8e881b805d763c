"""Argument checking and layout handling shared by the public entry points."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from sagejax.masks import CAUSAL_ALIGNMENTS, MaskSpec

LAYOUTS = ("BTNH", "BNTH")
FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class ParsedCall:
  """A checked attention call.

  ``q``, ``k``, ``v`` are 4-D in the caller's ``layout`` (a batch axis added to
  3-D inputs); :meth:`canonical` gives them as ``[B, N, T, H]`` / ``[B, K, S,
  H]``. ``bias`` and ``mask`` keep their own (broadcastable) ``[B|1, N|1, T|1,
  S|1]`` shapes. ``logits_soft_cap`` (None, or a float > 0) caps the
  natural-log logits as ``cap·tanh(x / cap)`` after ``sm_scale`` and the bias,
  before the masks.
  """

  q: jax.Array
  k: jax.Array
  v: jax.Array
  bias: Optional[jax.Array]
  mask: Optional[jax.Array]
  q_lengths: Optional[jax.Array]
  kv_lengths: Optional[jax.Array]
  spec: MaskSpec
  sm_scale: float
  layout: str
  unbatched: bool
  logits_soft_cap: Optional[float] = None

  def canonical(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q ``[B, N, T, H]``, k ``[B, K, S, H]``, v ``[B, K, S, H]``)."""
    return tuple(to_canonical(x, self.layout) for x in (self.q, self.k, self.v))

  @property
  def dims(self) -> tuple[int, int, int, int, int, int]:
    """(B, N, T, H, K, S)."""
    b, n, t, h = _canonical_shape(self.q.shape, self.layout)
    _, kh, s, _ = _canonical_shape(self.k.shape, self.layout)
    return b, n, t, h, kh, s

  def unbatch(self, x: jax.Array) -> jax.Array:
    """Drops the batch axis added to 3-D inputs."""
    return x[0] if self.unbatched else x


def _canonical_shape(shape, layout):
  b, a1, a2, h = shape
  return (b, a2, a1, h) if layout == "BTNH" else (b, a1, a2, h)


def to_canonical(x: jax.Array, layout: str) -> jax.Array:
  """``layout`` → ``[B, N, T, H]`` (a transpose for ``"BTNH"``)."""
  return jnp.swapaxes(x, 1, 2) if layout == "BTNH" else x


def from_canonical(x: jax.Array, layout: str) -> jax.Array:
  """``[B, N, T, H]`` → ``layout``."""
  return jnp.swapaxes(x, 1, 2) if layout == "BTNH" else x


def _as_array(x: Any, name: str) -> jax.Array:
  try:
    return jnp.asarray(x)
  except TypeError as e:
    raise TypeError(f"{name} must be an array, got {type(x).__name__}.") from e


def _check_broadcastable(x: jax.Array, name: str, full: tuple[int, ...]):
  if x.ndim != 4:
    raise ValueError(
        f"{name} must be 4-D and broadcastable to [B, N, T, S] = {full}, got "
        f"shape {x.shape}.")
  for d, (got, want) in enumerate(zip(x.shape, full)):
    if got not in (1, want):
      raise ValueError(
          f"{name} of shape {x.shape} is not broadcastable to [B, N, T, S] = "
          f"{full} (axis {d} is {got}; expected 1 or {want}).")


def _check_lengths(x, name: str, batch: int) -> Optional[jax.Array]:
  if x is None:
    return None
  x = _as_array(x, name)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must hold integers, got dtype {x.dtype}.")
  if x.shape != (batch,):
    raise ValueError(f"{name} must have shape [B] = ({batch},), got {x.shape}.")
  return x.astype(jnp.int32)


def check_soft_cap(cap) -> Optional[float]:
  """``logits_soft_cap`` as a float > 0 (or None); raises naming the argument."""
  if cap is None:
    return None
  if isinstance(cap, (bool, np.bool_)) or not isinstance(
      cap, (int, float, np.integer, np.floating)):
    raise TypeError("logits_soft_cap must be a Python float > 0 (e.g. 50.0, "
                    "Gemma-2's) or None; it is static, so not a traced "
                    f"array. Got {type(cap).__name__}.")
  cap = float(cap)
  if not (math.isfinite(cap) and cap > 0):
    raise ValueError(f"logits_soft_cap must be a finite float > 0 (e.g. 50.0)"
                     f" or None to disable capping, got {cap}.")
  return cap


def parse(query, key, value, bias=None, mask=None, *, scale=None,
          is_causal=False, causal_alignment="top_left",
          query_seq_lengths=None, key_value_seq_lengths=None,
          local_window_size=None, layout="BTNH", logits_soft_cap=None
          ) -> ParsedCall:
  """Checks an attention call; raises ValueError/TypeError naming the argument."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
  if causal_alignment not in CAUSAL_ALIGNMENTS:
    raise ValueError(f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}, "
                     f"got {causal_alignment!r}.")
  q = _as_array(query, "query")
  k = _as_array(key, "key")
  v = _as_array(value, "value")
  names = ("query", "key", "value")
  ranks = {x.ndim for x in (q, k, v)}
  if len(ranks) != 1 or ranks.pop() not in (3, 4):
    want = "[B, T, N, H]" if layout == "BTNH" else "[B, N, T, H]"
    raise ValueError(
        f"query, key and value must all be 4-D {want} (or 3-D without the "
        f"batch axis), got shapes {q.shape}, {k.shape}, {v.shape}.")
  unbatched = q.ndim == 3
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  for x, name in zip((q, k, v), names):
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype not in FLOAT_DTYPES:
      raise TypeError(
          f"{name} must be float16, bfloat16 or float32, got {x.dtype}; cast "
          "it first (e.g. x.astype(jnp.bfloat16)).")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"query, key and value must share a dtype, got {q.dtype}, "
                    f"{k.dtype}, {v.dtype}.")
  b, n, t, h = _canonical_shape(q.shape, layout)
  if k.shape != v.shape:
    raise ValueError(f"key and value must have the same shape, got {k.shape} "
                     f"and {v.shape}.")
  bk, kh, s, hk = _canonical_shape(k.shape, layout)
  if bk != b:
    raise ValueError(f"query and key must have the same batch size, got {b} "
                     f"and {bk}.")
  if hk != h:
    raise ValueError(f"query and key must have the same head dim H, got {h} "
                     f"and {hk}.")
  if n % kh:
    raise ValueError(f"The number of query heads N={n} must be a multiple of "
                     f"the number of key/value heads K={kh} (GQA/MQA).")
  if not 1 <= h <= MAX_HEAD_DIM:
    raise ValueError(f"Head dim H={h} is not supported: pass 1 <= H <= "
                     f"{MAX_HEAD_DIM}.")
  if t < 1 or s < 1:
    raise ValueError(f"Sequence lengths must be >= 1, got T={t}, S={s}.")
  full = (b, n, t, s)
  if mask is not None:
    mask = _as_array(mask, "mask")
    if mask.dtype != jnp.bool_:
      raise TypeError(f"mask must be boolean (True = attend), got {mask.dtype};"
                      " pass an additive mask as bias instead.")
    if unbatched and mask.ndim == 3:
      mask = mask[None]
    _check_broadcastable(mask, "mask", full)
  if bias is not None:
    bias = _as_array(bias, "bias")
    if not jnp.issubdtype(bias.dtype, jnp.floating):
      raise TypeError(f"bias must be floating point, got {bias.dtype}.")
    if unbatched and bias.ndim == 3:
      bias = bias[None]
    _check_broadcastable(bias, "bias", full)
  q_lengths = _check_lengths(query_seq_lengths, "query_seq_lengths", b)
  kv_lengths = _check_lengths(key_value_seq_lengths, "key_value_seq_lengths", b)
  window = None
  if local_window_size is not None:
    if isinstance(local_window_size, (int, np.integer)):
      window = (int(local_window_size), int(local_window_size))
    elif (isinstance(local_window_size, (tuple, list))
          and len(local_window_size) == 2
          and all(isinstance(w, (int, np.integer)) for w in local_window_size)):
      window = tuple(int(w) for w in local_window_size)
    else:
      raise ValueError("local_window_size must be an int or a (left, right) "
                       f"pair of ints, got {local_window_size!r}.")
    if min(window) < 0:
      raise ValueError(f"local_window_size must be >= 0, got {window}.")
  if scale is None:
    sm_scale = 1.0 / math.sqrt(h)
  else:
    try:
      sm_scale = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
      raise TypeError("scale must be a Python float (it is folded into the "
                      f"quantization scales), got {type(scale).__name__}."
                      ) from e
  spec = MaskSpec(is_causal=bool(is_causal), causal_alignment=causal_alignment,
                  window=window, q_len=t, kv_len=s)
  return ParsedCall(q=q, k=k, v=v, bias=bias, mask=mask, q_lengths=q_lengths,
                    kv_lengths=kv_lengths, spec=spec, sm_scale=sm_scale,
                    layout=layout, unbatched=unbatched,
                    logits_soft_cap=check_soft_cap(logits_soft_cap))

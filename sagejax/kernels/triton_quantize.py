"""Pallas (Triton) kernels that smooth and quantize Q, K and V.

Each kernel reads one block of tokens of one head once, straight from the
caller's layout (``[B, T, N, H]`` or ``[B, N, T, H]``), and writes the
quantized block in the layout the attention kernel reads. The math is
:mod:`sagejax.quant`'s, and so is the group layout: the kernels call
:func:`sagejax.quant.group_max` on their block of rows, never re-deriving
it. Reductions over *all* tokens (V's mean and per-channel max; K's mean
too if asked, though the backends take it from sampled tokens,
:func:`sagejax.quant.sampled_mean`) are made first by
:func:`token_statistics` (one pass in the inputs' layout, per-block partials
that XLA finishes) and passed in. Non-finite inputs follow
:mod:`sagejax.quant`'s rules (NaN scales, values 0), read with comparisons
since Triton's ``max`` ignores NaN.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sagejax import quant
from sagejax.config import SageConfig
from sagejax.kernels._common import (GROUP_SCALES_ONE, GROUP_SCALES_PER_STEP,
                                     round_half_even)


class Pass(NamedTuple):
  """One quantization pass, not yet launched: ``kernel(*in_refs, *out_refs,
  i=token block)`` over ``grid = (token blocks, B, heads)``, with its
  BlockSpecs (index maps of ``(i, b, n)``), and ``finish`` turning its raw
  outputs into the caller's results (XLA reductions of partials). Run alone
  (:func:`run_pass`) or several in one launch (:func:`run_passes`)."""
  kernel: Callable[..., None]
  grid: tuple[int, int, int]
  args: tuple
  in_specs: list
  out_shape: list
  out_specs: list
  num_warps: int
  name: str
  finish: Callable[[list], Any]


def run_pass(p: Pass, interpret: bool = False):
  """``p`` as its own ``pallas_call``; its ``finish``-ed results."""
  outs = pl.pallas_call(
      p.kernel, grid=p.grid, in_specs=p.in_specs, out_specs=p.out_specs,
      out_shape=p.out_shape, interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=p.num_warps,
                                           num_stages=1),
      name=p.name)(*p.args)
  return p.finish(list(outs))


def run_passes(passes: Sequence[Pass], interpret: bool = False) -> list:
  """Independent passes in **one** launch: a flat grid whose programs
  ``[o_p, o_p + |grid_p|)`` run pass ``p``'s kernel on the block its own
  grid would give them, in its order (token blocks fastest). Each pass's
  BlockSpecs see their own program indices, clamped into range for the
  other passes' programs, which never touch those blocks (Triton loads and
  stores where the kernel reads and writes; the interpreter stores back
  what it loaded). Saves the launches and the ramps between them (the
  forward end to end 3-4% faster at 1k, 2.7% at 4k on an H100;
  benchmarks/NOTES.md, Mosaic section 27; on 8 warps 20-25% slower than
  on 4: section 52). Returns each pass's results, in order."""
  if len(passes) == 1:
    return [run_pass(passes[0], interpret)]
  sizes = [math.prod(p.grid) for p in passes]
  starts = [sum(sizes[:j]) for j in range(len(passes))]

  def local(pid, j):
    """Pass ``j``'s grid indices (i, b, n) of flat program ``pid``."""
    nb, nbatch, _ = passes[j].grid
    x = jnp.clip(pid - starts[j], 0, sizes[j] - 1)
    return x % nb, (x // nb) % nbatch, x // (nb * nbatch)

  def rebase(spec, j):
    if spec is None:
      return None
    return pl.BlockSpec(spec.block_shape,
                        lambda pid: spec.index_map(*local(pid, j)))

  in_specs, out_specs, out_shape, args, counts = [], [], [], [], []
  for j, p in enumerate(passes):
    in_specs += [rebase(x, j) for x in p.in_specs]
    out_specs += [rebase(x, j) for x in p.out_specs]
    out_shape += list(p.out_shape)
    args += list(p.args)
    counts.append((len(p.in_specs), len(p.out_specs)))

  def kernel(*refs):
    pid = pl.program_id(0)
    ins, outs = refs[:len(in_specs)], refs[len(in_specs):]
    a = b = 0
    for j, p in enumerate(passes):
      n_in, n_out = counts[j]
      mine = ins[a:a + n_in] + outs[b:b + n_out]
      a, b = a + n_in, b + n_out
      i = local(pid, j)[0]
      pl.when((pid >= starts[j]) & (pid < starts[j] + sizes[j]))(
          functools.partial(p.kernel, *mine, i=i))

  outs = pl.pallas_call(
      kernel, grid=(sum(sizes),), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=interpret,
      compiler_params=plgpu.CompilerParams(
          num_warps=max(p.num_warps for p in passes), num_stages=1),
      name="_".join(p.name for p in passes))(*args)
  outs, results = list(outs), []
  for j, p in enumerate(passes):
    n_out = counts[j][1]
    results.append(p.finish(outs[:n_out]))
    outs = outs[n_out:]
  return results


def _token_spec(layout: str, block: int, h: int, head_of=lambda n: n):
  """BlockSpec of one head's block of tokens, grid (token block, b, head)."""
  if layout == "BTNH":
    return pl.BlockSpec((None, block, None, h),
                        lambda i, b, n: (b, i, head_of(n), 0))
  return pl.BlockSpec((None, None, block, h),
                      lambda i, b, n: (b, head_of(n), i, 0))


def _warps(block: int, h: int) -> int:
  """Warps for a program holding a ``[block, h]`` f32 tile: 2 up to 64 × 64
  values, 4 up to 128 × 128, else 8.

  A Q block of 128 tokens at H=256 on 4 warps ran the Q pass at 4.5x its
  H=128 time on an H100, on 8 at 3.0x; in programs of 64 tokens on 4,
  :func:`q_rows`, near K's time (benchmarks/NOTES.md, Mosaic sections 18
  and 23). At H=64, the launch of the K and Q passes with V's statistics in
  programs of 64 × 64 values ran 5-7% faster on 2 warps than on 4 on an
  H200, and 12-39% slower on 2 or 8 at H=128 (sections 52 and 53)."""
  values = block * h
  return 2 if values <= 64 * 64 else 4 if values <= 128 * 128 else 8


def q_program_rows(config: SageConfig) -> int:
  """The fewest Q rows a program of the Q pass may hold: its groups never
  straddle programs. ``block_q`` for per-block groups and block means
  (``smooth_q``); a warp's rows for per-thread and per-warp groups; 32 for
  per-token scales."""
  if config.smooth_q or config.qk_granularity == "per_block":
    return config.block_q
  if config.qk_granularity == "per_token":
    return min(32, config.block_q)
  return config.rows_per_warp


def q_rows(config: SageConfig, h: int, max_rows: Optional[int] = None
           ) -> int:
  """Rows of a Q program: ``block_q``, halved while the program holds more
  than 128 × 128 values or ``max_rows`` rows and the groups allow
  (:func:`q_program_rows`). Above 128 × 128 values (H=256: 64 rows on 4
  warps) the forward ran end to end 2-3.5% faster than with 128 rows on 8
  warps on an H100 (benchmarks/NOTES.md, Mosaic section 23); 64 rows at
  H=64 and 128 made the launch of the K and Q passes with V's statistics
  11-12% faster on an H200 (section 52)."""
  rows = config.block_q
  while ((rows * h > 128 * 128 or (max_rows is not None and rows > max_rows))
         and rows // 2 >= q_program_rows(config)):
    rows //= 2  # powers of two: still a multiple of q_program_rows
  return rows


def _group_config(config: SageConfig, role: str, rows: int) -> SageConfig:
  """``config`` with Q blocks of ``rows`` (a multiple of
  :func:`q_program_rows`): the same token groups on a program's rows."""
  if role != "q" or rows == config.block_q:
    return config
  if rows % q_program_rows(config) or config.block_q % rows:
    raise ValueError(
        f"a Q program of {rows} rows would split the groups of {config}; "
        f"pass a multiple of {q_program_rows(config)} dividing block_q.")
  warps = max(1, rows // config.rows_per_warp)
  return config.replace(block_q=rows, num_warps=min(warps,
                                                    config.num_warps))


def _block_abs_max(v: jax.Array, valid: jax.Array) -> jax.Array:
  """Max |V| per channel over a block's valid tokens, NaN read as +inf
  (:func:`sagejax.quant.abs_max`)."""
  a = jnp.abs(jnp.where(valid, v.astype(jnp.float32), 0.0))
  return jnp.max(jnp.where(a < jnp.inf, a, jnp.inf), axis=0)


def _quantize_qk_kernel(x_ref, len_ref, mean_ref, kbar_ref, v_ref, val_ref,
                        scale_ref, bmean_ref, shift_ref, v_amax_ref,
                        centred_ref, group_ref, *,
                        block: int, chunks: int, config: SageConfig,
                        group_config: SageConfig, role: str,
                        scale_mult: float, shift_mult: float,
                        step_blocks: int, interpret: bool, i=None):
  i = pl.program_id(0) if i is None else i
  length = len_ref[...]
  valid = ((i * block + jnp.arange(block)) < length)[:, None]
  hc = x_ref.shape[-1] // chunks
  xs = []
  shift = None
  for c in range(chunks):
    x = jnp.where(valid, x_ref[:, pl.ds(c * hc, hc)].astype(jnp.float32), 0.0)
    if kbar_ref is not None:  # Q: q·k̄ of each row (quant.lse_shift)
      part = jnp.sum(x * kbar_ref[pl.ds(c * hc, hc)][None, :], axis=1)
      shift = part if shift is None else shift + part
    if mean_ref is not None:  # K: the mean over all tokens, from XLA.
      x = x - mean_ref[pl.ds(c * hc, hc)][None, :]
    if bmean_ref is not None:  # Q: the mean of this block's valid rows.
      count = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
      m = jnp.sum(quant.finite_part(x), axis=0) / count
      bmean_ref[pl.ds(c * hc, hc)] = m
      x = x - m[None, :]
    xs.append(jnp.where(valid, x, 0.0))
    if centred_ref is not None:  # K − k̄ for the backward (rows past: 0)
      centred_ref[:, pl.ds(c * hc, hc)] = xs[-1].astype(centred_ref.dtype)
  row_amax = quant.row_amax(xs[0])  # +inf for a row holding a NaN or Inf
  for x in xs[1:]:
    row_amax = jnp.maximum(row_amax, quant.row_amax(x))
  scale = quant.group_scales(row_amax, role, group_config)  # NaN: such a row
  finite = (row_amax < jnp.inf)[:, None]
  qmax = config.qmax
  ys = [jnp.where(finite, jnp.clip(round_half_even(x / scale[:, None],
                                                   interpret), -qmax, qmax),
                  0.0).astype(jnp.int8) for x in xs]
  if chunks == 2:  # INT4: channel c low nibble, c + H/2 high (quant.pack_int4)
    val_ref[...] = (ys[0] & jnp.int8(0x0F)) | (ys[1] << jnp.int8(4))
  else:
    val_ref[...] = ys[0]
  scaled = scale * scale_mult
  scale_ref[...] = scaled
  if group_ref is not None:  # group_key_scales' entries of this block
    per_key = scaled.reshape(block // 64, 8, 4, 2)
    seen = per_key == per_key
    top = jnp.max(jnp.max(jnp.where(seen, per_key, 0.0), axis=3), axis=1)
    nan = jnp.max(jnp.max(jnp.where(seen, 0.0, 1.0), axis=3), axis=1)
    first = i * (block // 64) % step_blocks  # this block's 64s in the step
    slots = (first + jnp.arange(block // 64)[:, None]
             + step_blocks * jnp.arange(4)[None, :])  # [c][64 keys]
    group_ref[slots] = jnp.where(nan > 0, jnp.nan, top)
    group_ref[GROUP_SCALES_ONE] = jnp.float32(1.0)  # (every program: same)
  if shift_ref is not None:
    shift_ref[...] = shift * shift_mult
  if v_ref is not None:
    v_amax_ref[...] = _block_abs_max(v_ref[...], valid)


def quantize_qk(x: jax.Array, lengths: jax.Array, mean: Optional[jax.Array],
                *, role: str, config: SageConfig, layout: str,
                scale_mult: float = 1.0, k_mean: Optional[jax.Array] = None,
                shift_mult: float = 1.0, v: Optional[jax.Array] = None,
                rows: Optional[int] = None, num_warps: Optional[int] = None,
                centred: bool = False, group_scale_keys: Optional[int] = None,
                interpret: bool = False):
  """Quantizes Q or K, one block of tokens of one head per program: the
  launch of :func:`quantize_qk_pass` (same arguments and results)."""
  return run_pass(quantize_qk_pass(
      x, lengths, mean, role=role, config=config, layout=layout,
      scale_mult=scale_mult, k_mean=k_mean, shift_mult=shift_mult, v=v,
      rows=rows, num_warps=num_warps, centred=centred,
      group_scale_keys=group_scale_keys, interpret=interpret), interpret)


def quantize_qk_pass(x: jax.Array, lengths: jax.Array,
                     mean: Optional[jax.Array], *, role: str,
                     config: SageConfig, layout: str, scale_mult: float = 1.0,
                     k_mean: Optional[jax.Array] = None,
                     shift_mult: float = 1.0, v: Optional[jax.Array] = None,
                     rows: Optional[int] = None,
                     num_warps: Optional[int] = None, centred: bool = False,
                     group_scale_keys: Optional[int] = None,
                     interpret: bool = False) -> Pass:
  """The pass that quantizes Q or K, one block of tokens of one head per
  program (:class:`Pass`; run by :func:`run_pass` or :func:`run_passes`).

  Args:
    x: ``[B, T, N, H]`` (``layout="BTNH"``) or ``[B, N, T, H]``; T a multiple
      of the config's block for ``role`` and H a power of two.
    lengths: int32 ``[B]`` valid tokens; the rest is treated as zeros.
    mean: f32 ``[B, N, H]`` subtracted from every token (K smoothing), or None.
      For Q with ``config.smooth_q`` each block's own mean is subtracted.
    role: ``"q"`` or ``"k"``.
    scale_mult: folded into the scales (``sm_scale·log2(e)`` for Q).
    k_mean: Q only: f32 ``[B, K, H]`` (K's mean; N a multiple of K): also
      return each row's ``shift_mult · q·k̄`` of its KV head, what
      :func:`sagejax.quant.lse_shift` computes (unsmoothed Q, rows past
      ``lengths`` 0), without reading Q again.
    v: K only: V (K's shape and layout), read in the same programs for its
      max |V| per channel over the valid tokens (+inf where one is NaN or
      infinite; :func:`token_statistics`' ``v_amax`` without its launch).
    rows: Q only: rows a program holds, a multiple of
      :func:`q_program_rows` dividing ``block_q`` (default: ``block_q``, or
      fewer above 128 × 128 values).
    num_warps: warps a program runs (default by its tile's size).
    centred: K only, with ``mean``: also write ``x − mean`` in ``x``'s
      dtype, shape and layout (rows past ``lengths`` 0), what the backward
      multiplies, so that it need not read K again.
    group_scale_keys: K only: also write the Mosaic kernel's grouped key
      scales for its steps of this many keys (a multiple of both 64 and
      ``block_k``): what :func:`sagejax.kernels.mosaic_attention.
      group_key_scales` makes of the scales, without its XLA kernels (the
      padding after each step's ``4 · group_scale_keys / 64`` entries is
      left unwritten, but for the last entry's 1.0).

  Returns:
    (values int8 ``[B, N, T, H]`` or INT4-packed ``[B, N, T, H/2]``, scales
    f32 ``[B, N, T]``, Q block means f32 ``[B, N, T/block_q, H]`` or None,
    row shifts f32 ``[B, N, T]`` or None, V's max |V| f32 ``[B, N, H]`` or
    None, ``x − mean`` or None, grouped key scales f32 ``[B, N, T /
    group_scale_keys · 32]`` or None).
  """
  if layout == "BTNH":
    b, t, n, h = x.shape
  else:
    b, n, t, h = x.shape
  if rows is not None and role != "q":
    raise ValueError("rows (a Q program's rows) is for role='q' only; K's "
                     "groups span block_k.")
  block = rows or (q_rows(config, h) if role == "q" else config.block_k)
  group_config = _group_config(config, role, block)
  nb = t // block
  chunks = 2 if config.qk_dtype == "int4" else 1
  block_means = role == "q" and config.smooth_q
  if k_mean is not None and role != "q":
    raise ValueError("k_mean (the LSE shift) is for role='q' only.")
  if v is not None and (role != "k" or v.shape != x.shape):
    raise ValueError("v (its max |V|) goes with role='k' and K's shape.")
  if centred and (role != "k" or mean is None):
    raise ValueError("centred (K − mean) goes with role='k' and a mean.")
  if group_scale_keys is not None and (
      role != "k" or group_scale_keys % math.lcm(64, block)
      or t % group_scale_keys):
    raise ValueError(
        f"group_scale_keys={group_scale_keys} (K's grouped scales) needs "
        f"role='k' and a multiple of 64 and block_k={block} dividing the "
        f"{t} keys.")
  steps = None if group_scale_keys is None else t // group_scale_keys
  g = None if k_mean is None else n // k_mean.shape[1]
  kernel = functools.partial(
      _quantize_qk_kernel, block=block, chunks=chunks, config=config,
      group_config=group_config,
      role=role, scale_mult=float(scale_mult), shift_mult=float(shift_mult),
      step_blocks=(group_scale_keys or 64) // 64, interpret=interpret)
  out_shape = [jax.ShapeDtypeStruct((b, n, t, h // chunks), jnp.int8),
               jax.ShapeDtypeStruct((b, n, t), jnp.float32)]
  out_specs = [pl.BlockSpec((None, None, block, h // chunks),
                            lambda i, bb, nn: (bb, nn, i, 0)),
               pl.BlockSpec((None, None, block), lambda i, bb, nn: (bb, nn, i))]
  if block_means:
    out_shape.append(jax.ShapeDtypeStruct((b, n, nb, h), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, None, h),
                                  lambda i, bb, nn: (bb, nn, i, 0)))
  else:
    out_shape.append(None)
    out_specs.append(None)
  if k_mean is not None:
    out_shape.append(jax.ShapeDtypeStruct((b, n, t), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, block),
                                  lambda i, bb, nn: (bb, nn, i)))
  else:
    out_shape.append(None)
    out_specs.append(None)
  out_shape.append(None if v is None else
                   jax.ShapeDtypeStruct((b, n, nb, h), jnp.float32))
  out_specs.append(None if v is None else pl.BlockSpec(
      (None, None, None, h), lambda i, bb, nn: (bb, nn, i, 0)))
  out_shape.append(jax.ShapeDtypeStruct(x.shape, x.dtype) if centred
                   else None)
  out_specs.append(_token_spec(layout, block, h) if centred else None)
  out_shape.append(None if steps is None else
                   jax.ShapeDtypeStruct((b, n, steps * GROUP_SCALES_PER_STEP), jnp.float32))
  out_specs.append(None if steps is None else pl.BlockSpec(
      (None, None, GROUP_SCALES_PER_STEP),
      lambda i, bb, nn: (bb, nn, i * block // group_scale_keys)))
  in_specs = [
      _token_spec(layout, block, h),
      pl.BlockSpec((None,), lambda i, bb, nn: (bb,)),
      None if mean is None else pl.BlockSpec((None, None, h),
                                             lambda i, bb, nn: (bb, nn, 0)),
      None if k_mean is None else pl.BlockSpec(
          (None, None, h), lambda i, bb, nn: (bb, nn // g, 0)),
      None if v is None else _token_spec(layout, block, h),
  ]

  def finish(outs):
    values, scales, means, shifts, v_amax, centred_x, grouped = outs
    if v_amax is not None:
      v_amax = jnp.max(v_amax, axis=2)
    return values, scales, means, shifts, v_amax, centred_x, grouped

  return Pass(kernel=kernel, grid=(nb, b, n),
              args=(x, lengths, mean, k_mean, v), in_specs=in_specs,
              out_shape=out_shape, out_specs=out_specs,
              num_warps=num_warps or _warps(block, h),
              name=f"sage_quantize_{role}", finish=finish)


def _quantize_v_kernel(v_ref, len_ref, mean_ref, scale_ref, out_ref,
                       bad_ref, *, block: int, fp8: bool, transpose: bool,
                       key_order: Optional[tuple[int, ...]]):
  i = pl.program_id(0)
  valid = ((i * block + jnp.arange(block)) < len_ref[...])[:, None]
  x = v_ref[...].astype(jnp.float32)
  if mean_ref is not None:
    x = x - mean_ref[...][None, :]
  x = jnp.where(valid, x, 0.0)
  if bad_ref is not None:  # 1 for a channel holding a NaN or Inf in this block
    bad_ref[...] = jnp.max(jnp.where(jnp.abs(x) < jnp.inf, 0.0, 1.0), axis=0)
  if key_order is not None:  # keys [j, a, c, i] stored at [j, c, a, i]
    x = x.reshape(key_order).transpose(0, 2, 1, 3, 4).reshape(x.shape)
  if fp8:
    scale = scale_ref[...][None, :]
    x = jnp.clip(x / scale, -quant.FP8_MAX, quant.FP8_MAX)
    x = jnp.where(scale == scale, x, 0.0)  # NaN scale (quant): values 0
    x = x.astype(quant.FP8_DTYPE)  # FP8 values, stored as out_ref's dtype
  y = x.astype(out_ref.dtype)
  out_ref[...] = y.T if transpose else y


def quantize_v(v: jax.Array, lengths: jax.Array, mean: Optional[jax.Array],
               scale: jax.Array, *, config: SageConfig, layout: str,
               transpose: bool, store_dtype=None, wgmma_key_order: bool = False,
               interpret: bool = False, return_nonfinite: bool = False,
               block: Optional[int] = None, num_warps: int = 4):
  """V to the P·V operand type, one block of tokens of one head per program.

  Args:
    v: ``[B, S, K, H]`` or ``[B, K, S, H]`` (S a multiple of ``block_k``).
    lengths: int32 ``[B]``; tokens past it are written as zeros.
    mean: f32 ``[B, K, H]`` subtracted first (V smoothing), or None.
    scale: f32 ``[B, K, H]`` per-channel scale (FP8; ignored otherwise).
    transpose: write ``[B, K, H, S]`` (FP8 tensor cores want the contraction
      axis contiguous) instead of ``[B, K, S, H]``.
    store_dtype: dtype of the output; default the config's P·V operand type.
      FP8 values can be stored as float16 (exactly) for FP16 tensor cores.
    wgmma_key_order: store the keys of every group of 16 in the order of
      :func:`sagejax.kernels.mosaic_attention.pv_key_order` (the Mosaic
      kernel's in-register P̃ operand).
    return_nonfinite: also return f32 ``[B, K, S/block, H]``, 1 where a
      block of a channel holds a NaN or Inf (16-bit V has no scale pass over
      all tokens to catch it; see :func:`sagejax.quant.unit_v_scale`).
    block: tokens a program, dividing S (default ``block_k``; V's scales
      are per channel over all tokens, so any block gives the same values).
    num_warps: warps a program runs.

  Returns:
    the values; with ``return_nonfinite``, ``(values, nonfinite)``.
  """
  if layout == "BTNH":
    b, s, kh, h = v.shape
  else:
    b, kh, s, h = v.shape
  block = block or config.block_k
  if s % block:
    raise ValueError(f"{s} keys is not a multiple of block={block}.")
  fp8 = config.pv_dtype == "fp8_e4m3"
  dtype = store_dtype or quant.PV_OPERAND_DTYPES[config.pv_dtype]
  if transpose:
    out_shape = jax.ShapeDtypeStruct((b, kh, h, s), dtype)
    out_spec = pl.BlockSpec((None, None, h, block),
                            lambda i, bb, nn: (bb, nn, 0, i))
  else:
    out_shape = jax.ShapeDtypeStruct((b, kh, s, h), dtype)
    out_spec = pl.BlockSpec((None, None, block, h),
                            lambda i, bb, nn: (bb, nn, i, 0))
  head = pl.BlockSpec((None, None, h), lambda i, bb, nn: (bb, nn, 0))
  if wgmma_key_order and block % 16:
    raise ValueError(f"wgmma_key_order needs block_k % 16 == 0, got {block}.")
  key_order = (block // 16, 2, 4, 2, h) if wgmma_key_order else None
  bad_shape = bad_spec = None
  if return_nonfinite:
    bad_shape = jax.ShapeDtypeStruct((b, kh, s // block, h), jnp.float32)
    bad_spec = pl.BlockSpec((None, None, None, h),
                            lambda i, bb, nn: (bb, nn, i, 0))
  kernel = functools.partial(_quantize_v_kernel, block=block, fp8=fp8,
                             transpose=transpose, key_order=key_order)
  values, bad = pl.pallas_call(
      kernel, grid=(s // block, b, kh),
      in_specs=[_token_spec(layout, block, h),
                pl.BlockSpec((None,), lambda i, bb, nn: (bb,)),
                None if mean is None else head, head],
      out_specs=[out_spec, bad_spec], out_shape=[out_shape, bad_shape],
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                           num_stages=1),
      name="sage_quantize_v",
  )(v, lengths, mean, scale)
  return (values, bad) if return_nonfinite else values


def _token_statistics_kernel(k_ref, v_ref, len_ref, k_sum_ref, v_sum_ref,
                             v_amax_ref, *, block: int, i=None):
  i = pl.program_id(0) if i is None else i
  valid = ((i * block + jnp.arange(block)) < len_ref[...])[:, None]
  if k_sum_ref is not None:
    k = quant.finite_part(k_ref[...].astype(jnp.float32))
    k_sum_ref[...] = jnp.sum(jnp.where(valid, k, 0.0), axis=0)
  if v_ref is not None:
    v = v_ref[...].astype(jnp.float32)
    if v_sum_ref is not None:
      v_sum_ref[...] = jnp.sum(jnp.where(valid, quant.finite_part(v), 0.0),
                               axis=0)
    if v_amax_ref is not None:
      v_amax_ref[...] = _block_abs_max(v, valid)


def token_statistics(k: jax.Array, v: Optional[jax.Array],
                     lengths: jax.Array, *, layout: str,
                     block: Optional[int] = None, k_mean: bool = True, v_mean: bool = False,
                     v_amax: bool = False, interpret: bool = False):
  """K's and V's reductions over all valid tokens: the launch of
  :func:`token_statistics_pass` (same arguments and results)."""
  return run_pass(token_statistics_pass(
      k, v, lengths, layout=layout, block=block, k_mean=k_mean,
      v_mean=v_mean, v_amax=v_amax), interpret)


def token_statistics_pass(k: jax.Array, v: Optional[jax.Array],
                          lengths: jax.Array, *, layout: str,
                          block: Optional[int] = None, k_mean: bool = True,
                          v_mean: bool = False, v_amax: bool = False) -> Pass:
  """K's and V's reductions over all valid tokens in one pass, read in place
  (:class:`Pass`).

  A program reads one block of tokens of one KV head of K and V and writes
  its partial sums / maxima; XLA reduces the ``S / block`` partials. What
  :func:`sagejax.quant.token_mean` and :func:`sagejax.quant.abs_max` of the
  zero-padded tokens compute, without XLA's transposed reductions.

  Args:
    k, v: ``[B, S, K, H]`` (``layout="BTNH"``) or ``[B, K, S, H]``; ``v``
      may be None when only ``k_mean`` is asked for.
    lengths: int32 ``[B]`` valid tokens.
    block: tokens per program, dividing S; default the largest power of
      two up to 64 that does.
    k_mean, v_mean: K's / V's mean over the valid tokens (non-finite values
      count as 0).
    v_amax: max |V| per channel over the valid tokens (+inf where one is NaN
      or infinite).

  Returns:
    ``(k_mean, v_mean, v_amax)``, each f32 ``[B, K, H]`` or None.
  """
  if layout == "BTNH":
    b, s, kh, h = k.shape
  else:
    b, kh, s, h = k.shape
  block = block or math.gcd(s, 64)
  if s % block:
    raise ValueError(f"{s} tokens is not a multiple of block={block}.")
  nb = s // block
  partial = jax.ShapeDtypeStruct((b, kh, nb, h), jnp.float32)
  spec = pl.BlockSpec((None, None, None, h), lambda i, bb, nn: (bb, nn, i, 0))
  wanted = (k_mean, v_mean and v is not None, v_amax and v is not None)
  kernel = functools.partial(_token_statistics_kernel, block=block)

  def finish(outs):
    k_sum, v_sum, amax = outs
    count = jnp.clip(lengths, 1, s).astype(jnp.float32)[:, None, None]
    return (None if k_sum is None else jnp.sum(k_sum, axis=2) / count,
            None if v_sum is None else jnp.sum(v_sum, axis=2) / count,
            None if amax is None else jnp.max(amax, axis=2))

  # K's blocks are read only for its mean: without it, V's blocks alone.
  return Pass(kernel=kernel, grid=(nb, b, kh), args=(k, v, lengths),
              in_specs=[_token_spec(layout, block, h),
                        None if v is None else _token_spec(layout, block, h),
                        pl.BlockSpec((None,), lambda i, bb, nn: (bb,))],
              out_shape=[partial if w else None for w in wanted],
              out_specs=[spec if w else None for w in wanted],
              num_warps=_warps(block, h),
              name="sage_token_statistics", finish=finish)


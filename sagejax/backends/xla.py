"""The ``"xla"`` backend: SageAttention arithmetic in plain ``jax.numpy``.

It does exactly what the kernels do, step for step, and is their oracle:
INT32 products of the quantized Q and K, dequantization by the per-token
scales, ΔS, an online softmax in base 2 over KV blocks of ``block_k`` keys,
P̃ to FP8 with the static scale 448, each block's P·V on its own and then added
into an FP32 accumulator (``"fp32+fp32"``) or fed the running accumulator
(``"fp32"``, FP22-truncated with FP8 operands, as the tensor cores do), and the
V scale, 1/l and V mean in the epilogue. It walks K/V block by block with
``lax.scan``, so memory is O(T · block_k), never O(T · S). Runs on any
platform.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from sagejax import quant
from sagejax._inputs import ParsedCall, from_canonical
from sagejax.config import SageConfig
from sagejax.masks import MaskSpec, group_heads, key_block

_HIGHEST = jax.lax.Precision.HIGHEST


def _unpacked(x: jax.Array, config: SageConfig) -> jax.Array:
  return quant.unpack_int4(x) if config.qk_dtype == "int4" else x


def attend_quantized(qkv: quant.QuantizedQKV, config: SageConfig,
                     spec: MaskSpec, *,
                     q_lengths: Optional[jax.Array] = None,
                     kv_lengths: Optional[jax.Array] = None,
                     mask: Optional[jax.Array] = None,
                     bias: Optional[jax.Array] = None,
                     logits_soft_cap: Optional[float] = None,
                     ) -> tuple[jax.Array, jax.Array]:
  """Attention over quantized inputs (the kernel arithmetic).

  Args:
    qkv: output of :func:`sagejax.quant.quantize`.
    config: the config ``qkv`` was quantized with.
    spec: causal/window/length description; ``spec.q_len``/``kv_len`` are
      the unpadded T and S.
    q_lengths, kv_lengths: optional int32 ``[B]``.
    mask: optional bool ``[B|1, N|1, T|1, S|1]``.
    bias: optional float ``[B|1, N|1, T|1, S|1]`` in natural-log units.
    logits_soft_cap: optional cap of the natural-log logits (after the bias,
      before the masks; :func:`sagejax.quant.soft_cap_base2`), with
      ``qkv.lse_shift`` added to the scores first.

  Returns:
    f32 output ``[B, N, T, H]`` and natural-log LSE f32 ``[B, N, T]``; rows
    that see no key give zeros and −inf. Without a soft cap the LSE lacks
    ``qkv.lse_shift``; with one it is complete.
  """
  b, n, t_pad, _ = qkv.q.shape
  kh, s_pad = qkv.k.shape[1], qkv.k.shape[2]
  g, bk = n // kh, config.block_k
  h = qkv.v.shape[-1]
  t = spec.q_len
  q = _unpacked(qkv.q, config).reshape(b, kh, g, t_pad, -1)
  q_scale = qkv.q_scale.reshape(b, kh, g, t_pad, 1)
  delta_s = None
  if qkv.delta_s is not None:
    delta_s = qkv.delta_s.reshape(b, kh, g, -1, s_pad)
  mask = group_heads(mask, kh, t_pad, s_pad, False)
  bias = group_heads(bias, kh, t_pad, s_pad, 0.0)
  q_pos = jnp.arange(t_pad)
  fp8 = config.pv_dtype == "fp8_e4m3"
  row_shift = None
  if logits_soft_cap is not None and qkv.lse_shift is not None:
    row_shift = jnp.pad(qkv.lse_shift, [(0, 0), (0, 0), (0, t_pad - t)])
    row_shift = row_shift.reshape(b, kh, g, t_pad, 1)

  def block(carry, j):
    m, l, acc = carry
    start = j * bk
    k = _unpacked(jax.lax.dynamic_slice_in_dim(qkv.k, start, bk, 2), config)
    k_scale = jax.lax.dynamic_slice_in_dim(qkv.k_scale, start, bk, 2)
    v = jax.lax.dynamic_slice_in_dim(qkv.v, start, bk, 2)
    s_int = jnp.einsum("bkgth,bksh->bkgts", q, k,
                       preferred_element_type=jnp.int32)
    s = s_int.astype(jnp.float32) * q_scale * k_scale[:, :, None, None, :]
    if delta_s is not None:
      ds = jax.lax.dynamic_slice_in_dim(delta_s, start, bk, 4)
      s = s + jnp.repeat(ds, config.block_q, axis=3)
    if bias is not None:
      s = s + key_block(bias, start, bk).astype(jnp.float32) * quant.LOG2E
    if logits_soft_cap is not None:
      s = quant.soft_cap_base2(s, logits_soft_cap, row_shift)
    ok = spec.visible(q_pos, start + jnp.arange(bk), q_lengths, kv_lengths)
    ok = ok[:, :, None]  # [B|1, 1, 1, T_pad, bk]
    if mask is not None:
      ok = ok & key_block(mask, start, bk)
    s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s - m_use[..., None])
    alpha = jnp.exp2(m - m_use)
    l = l * alpha + jnp.sum(p, axis=-1)
    if fp8:
      p_op = quant.quantize_p_fp8(p)
    else:
      p_op = p.astype(qkv.v.dtype)
    pv = jnp.einsum("bkgts,bksh->bkgth", p_op.astype(jnp.float32),
                    v.astype(jnp.float32), precision=_HIGHEST)
    acc = acc * alpha[..., None] + pv
    if fp8 and config.pv_accumulation == "fp32":
      acc = quant.truncate_to_fp22(acc)
    return (m_new, l, acc), None

  init = (jnp.full((b, kh, g, t_pad), -jnp.inf, jnp.float32),
          jnp.zeros((b, kh, g, t_pad), jnp.float32),
          jnp.zeros((b, kh, g, t_pad, h), jnp.float32))
  (m, l, acc), _ = jax.lax.scan(block, init, jnp.arange(s_pad // bk))
  p_scale = quant.P_SCALE if fp8 else 1.0
  seen = l != 0  # a NaN sum (poisoned input) counts as seen: NaN out
  inv_l = jnp.where(seen, 1.0 / (l * p_scale), 0.0)
  out = acc * inv_l[..., None] * qkv.v_scale[:, :, None, None, :]
  if qkv.v_mean is not None:
    out = out + qkv.v_mean[:, :, None, None, :]
  out = jnp.where(seen[..., None], out, 0.0)  # also past a NaN V scale
  lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * quant.LN2,
                  -jnp.inf)
  out = out.reshape(b, n, t_pad, h)[:, :, :t]
  return out, lse.reshape(b, n, t_pad)[:, :, :t]


class _XlaBackend:
  name = "xla"
  platform = None  # every platform: the fallback of implementation=None
  # config=None / "auto" (README, "Default preset"): on a 2-core CPU sage1 is
  # the fastest preset here (S=4k, B=1, N=8, H=128, interleaved medians 0.97
  # vs 1.13 s sage2-8b, 1.11 s sage2-4b) and the most accurate (relative L1
  # 0.013 vs 0.038 and 0.21 on normal data); also the "pallas" default, so a
  # ("cuda", "cpu") export computes one preset on both platforms.
  default_preset = "sage1"

  def available(self) -> bool:
    return True

  def unsupported(self, call: ParsedCall, config: SageConfig
                  ) -> Optional[str]:
    return None

  def prepare(self, call: ParsedCall, config: SageConfig
              ) -> quant.QuantizedQKV:
    q, k, v = call.canonical()
    return quant.quantize(q, k, v, config, call.sm_scale, call.q_lengths,
                          call.kv_lengths)

  def kernel(self, qkv: quant.QuantizedQKV, call: ParsedCall,
             config: SageConfig) -> tuple[jax.Array, jax.Array]:
    """Attention alone on :meth:`prepare`'s output."""
    out, lse = attend_quantized(qkv, config, call.spec,
                                q_lengths=call.q_lengths,
                                kv_lengths=call.kv_lengths, mask=call.mask,
                                bias=call.bias,
                                logits_soft_cap=call.logits_soft_cap)
    if qkv.lse_shift is not None and call.logits_soft_cap is None:
      lse = lse + qkv.lse_shift
    return from_canonical(out, call.layout), lse

  def forward(self, call: ParsedCall, config: SageConfig
              ) -> tuple[jax.Array, jax.Array]:
    return self.kernel(self.prepare(call, config), call, config)


BACKEND = _XlaBackend()

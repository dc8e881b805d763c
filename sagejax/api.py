"""``sagejax.attention``: the public entry point."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from sagejax import _inputs, _platforms, _vjp, backends, sharding
from sagejax.config import ConfigLike, SageConfig
from sagejax.masks import CausalAlignment, MaskSpec


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything about a call that is not an array (hashable).

  ``backend`` and ``config`` run on every platform not in ``per_platform``
  (``(platform, backend, config)`` triples, chosen at lowering time).
  """
  config: SageConfig
  spec: MaskSpec
  sm_scale: float
  backend: str
  layout: str
  logits_soft_cap: Optional[float] = None
  per_platform: tuple[tuple[str, str, SageConfig], ...] = ()


def _call_of(static: _Static, q, k, v, bias, mask, q_lengths, kv_lengths):
  return _inputs.ParsedCall(q=q, k=k, v=v, bias=bias, mask=mask,
                            q_lengths=q_lengths, kv_lengths=kv_lengths,
                            spec=static.spec, sm_scale=static.sm_scale,
                            layout=static.layout, unbatched=False,
                            logits_soft_cap=static.logits_soft_cap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sage_attention(static: _Static, q, k, v, bias, mask, q_lengths,
                    kv_lengths):
  out, lse = _forward(static, q, k, v, bias, mask, q_lengths, kv_lengths)
  return out, lse


def _saves_lse2(name: str, call, config: SageConfig) -> bool:
  """Whether backend ``name``'s forward under ``jax.grad`` keeps lse₂ for
  its own backward in place of the LSE (``saves_lse2``); the forward and
  the backward both ask."""
  backend = backends.registry()[name]
  return (callable(getattr(backend, "saves_lse2", None))
          and backends.backward_of(name, call, config) is backend
          and backend.saves_lse2(call, config))


def _centres_k(name: str, call, config: SageConfig) -> bool:
  """Whether backend ``name``'s forward under ``jax.grad`` also makes K − k̄
  and k̄ for its backward (``centres_k``: the backward then takes them in
  place of K, and reads K no more)."""
  backend = backends.registry()[name]
  return (_saves_lse2(name, call, config)
          and callable(getattr(backend, "centres_k", None))
          and backend.centres_k(call, config))


@dataclasses.dataclass(frozen=True)
class _Run:
  """The forward on one backend (hashable: eager calls reuse compilations).
  ``residual``: also the row statistic its backward keeps (the LSE, or
  lse₂ where :func:`_saves_lse2`); ``centre_k``: also K − k̄ and k̄ where
  this backend :func:`_centres_k` (else K itself and zeros: one structure
  on every platform)."""
  static: _Static
  backend: str
  config: SageConfig
  residual: bool = False
  centre_k: bool = False

  def __call__(self, q, k, v, bias, mask, q_lengths, kv_lengths):
    call = _call_of(self.static, q, k, v, bias, mask, q_lengths, kv_lengths)
    backend = backends.registry()[self.backend]
    if self.centre_k and _centres_k(self.backend, call, self.config):
      out, lse, rows, (k_centred, k_bar) = backend.forward_residual(
          call, self.config, centre_k=True)
      return out.astype(q.dtype), lse, rows, k_centred, k_bar
    if self.residual and _saves_lse2(self.backend, call, self.config):
      out, lse, rows = backend.forward_residual(call, self.config)
    else:
      out, lse = backend.forward(call, self.config)
      rows = lse
    out = (out.astype(q.dtype), lse) + ((rows,) if self.residual else ())
    if self.centre_k:  # another platform's backend centres K
      b, _, _, h, kh, _ = call.dims
      out += (k, jnp.zeros((b, kh, h), jnp.float32))
    return out


def _forward(static, q, k, v, bias, mask, q_lengths, kv_lengths,
             residual: bool = False, centre_k: bool = False):
  """The forward, run on each device's batch/head shard (sagejax.sharding):
  (output, LSE[, the backward's row statistic[, K − k̄, k̄]]: :class:`_Run`)."""
  return sharding.attention_forward(
      functools.partial(_local_forward, static, residual=residual,
                        centre_k=centre_k),
      static.layout, residual=residual, centre_k=centre_k)(
          q, k, v, bias, mask, q_lengths, kv_lengths)


def _local_forward(static, q, k, v, bias, mask, q_lengths, kv_lengths,
                   residual: bool = False, centre_k: bool = False):
  arrays = (q, k, v, bias, mask, q_lengths, kv_lengths)
  default = _Run(static, static.backend, static.config, residual, centre_k)
  if not static.per_platform:
    return default(*arrays)
  # Chosen when lowering, per platform: an export for ("cuda", "cpu") holds
  # the GPU kernels for CUDA and the default ("xla") for the CPU.
  b, n, t, h, kh, _ = _call_of(static, *arrays).dims
  rows = jax.ShapeDtypeStruct((b, n, t), jnp.float32)
  out_shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), rows) + (
      (rows,) if residual else ()) + ((
          jax.ShapeDtypeStruct(k.shape, k.dtype),
          jax.ShapeDtypeStruct((b, kh, h), jnp.float32)) if centre_k else ())
  branches = {platform: _Run(static, name, config, residual, centre_k)
              for platform, name, config in static.per_platform}
  return _platforms.platform_dependent(*arrays, default=default,
                                       out_shapes=out_shapes, **branches)


def _differentiated(static: _Static, call) -> _Static:
  """``static`` with the config of each branch that a kernel backward
  follows replaced by :meth:`SageConfig.differentiated`. A chosen
  (per-platform) backend that does not serve that config (the Mosaic
  kernel with FP32 inputs above H=128) hands the branch to its backward's
  backend; a named one raises."""
  def branch(name, config, chosen: bool):
    backward = backends.backward_of(name, call, config)
    if backward is None:
      return name, config
    config = config.differentiated(call.q.dtype)
    reason = backends.registry()[name].unsupported(call, config)
    if reason is None:
      return name, config
    if chosen and backward.unsupported(call, config) is None:
      return backward.name, config
    raise ValueError(
        f"implementation={name!r} does not run the forward that jax.grad "
        f"differentiates (config {config}): {reason}. Pass "
        "implementation=None to let sagejax choose.")
  name, config = branch(static.backend, static.config, chosen=False)
  return dataclasses.replace(
      static, backend=name, config=config,
      per_platform=tuple((platform, *branch(name, config, chosen=True))
                         for platform, name, config in static.per_platform))


def _sage_attention_fwd(static, q, k, v, bias, mask, q_lengths, kv_lengths):
  call = _call_of(static, q, k, v, bias, mask, q_lengths, kv_lengths)
  static = _differentiated(static, call)
  # The forward's LSE (or lse₂: _saves_lse2) is saved for a kernel backward
  # (the Mosaic backward corrects it into the exact statistics; [B, N, T] is
  # small), its output too when that backward takes δ from it (residuals
  # have one structure on every platform).
  kernel_bwd = [(name, config) for name, config in _branches(static)
                if backends.backward_of(name, call, config) is not None]
  # Where a branch's K pass also writes K − k̄, the residual K is that
  # branch's K − k̄, with k̄ beside it (other branches: K, and zeros).
  centre_k = any(_centres_k(name, call, config)
                 for name, config in _branches(static))
  out, lse, *rows = _forward(static, q, k, v, bias, mask, q_lengths,
                             kv_lengths, residual=bool(kernel_bwd),
                             centre_k=centre_k)
  keep_out = any(config.saved_stats for _, config in kernel_bwd)
  saved = (out if keep_out else None, rows[0]) if kernel_bwd else None
  k_res, k_bar = (rows[1], rows[2]) if centre_k else (k, None)
  res = (q, k_res, v, bias, mask, q_lengths, kv_lengths, saved, k_bar)
  return (out, lse), res


def _branches(static: _Static) -> list[tuple[str, SageConfig]]:
  """(backend, config) of the default branch and of each platform's."""
  return [(static.backend, static.config)] + [
      (name, config) for _, name, config in static.per_platform]


@dataclasses.dataclass(frozen=True)
class _Grads:
  """The backward after a forward on one backend (hashable, as _Run)."""
  static: _Static
  backend: str
  config: SageConfig

  def __call__(self, q, k, v, bias, mask, q_lengths, kv_lengths, saved,
               d_out, d_lse, k_bar=None):
    """``k_bar``: where this backend :func:`_centres_k`, ``k`` is K − k̄
    (the forward's residual) and this is k̄; else ignored."""
    static = self.static
    call = _call_of(static, q, k, v, bias, mask, q_lengths, kv_lengths)
    backend = backends.backward_of(self.backend, call, self.config)
    if backend is not None:  # a kernel backward (backends.backward_of)
      if saved is not None and not self.config.saved_stats:
        saved = (None, saved[1])  # the LSE alone: a hint, not δ's source
      extra = {}
      if saved is not None and _saves_lse2(self.backend, call, self.config):
        extra = dict(saved_lse2=True)  # the forward kept lse₂ (_Run)
      if k_bar is not None and _centres_k(self.backend, call, self.config):
        extra["k_bar"] = k_bar
      dq, dk, dv, dbias = backend.backward(
          call, self.config, d_out, d_lse, saved, **extra)
    else:
      canon = functools.partial(_inputs.to_canonical, layout=static.layout)
      grads = _vjp.attention_backward(
          canon(q), canon(k), canon(v), bias, mask, q_lengths, kv_lengths,
          canon(d_out), d_lse, static.spec, static.sm_scale,
          logits_soft_cap=static.logits_soft_cap)
      dq, dk, dv = (_inputs.from_canonical(g, static.layout)
                    for g in grads[:3])
      dbias = grads[3]
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None if bias is None else dbias.astype(bias.dtype))


def _sage_attention_bwd(static, res, cotangents):
  q, k, v, bias, mask, q_lengths, kv_lengths, saved, k_bar = res
  static = _differentiated(static, _call_of(static, q, k, v, bias, mask,
                                            q_lengths, kv_lengths))
  out, lse = (None, None) if saved is None else saved
  grads = sharding.attention_backward(
      functools.partial(_local_backward, static), static.layout,
      bias is not None)(q, k, v, bias, mask, q_lengths, kv_lengths,
                        *cotangents, out, lse, k_bar)
  dbias = grads[3] if bias is not None else None
  return grads[0], grads[1], grads[2], dbias, None, None, None


def _local_backward(static, q, k, v, bias, mask, q_lengths, kv_lengths, d_out,
                    d_lse, out, lse, k_bar=None):
  """Gradients on one device's batch/head shard."""
  saved = None if lse is None else (out, lse)
  args = (q, k, v, bias, mask, q_lengths, kv_lengths, saved, d_out, d_lse,
          k_bar)
  default = _Grads(static, static.backend, static.config)
  if not static.per_platform:
    dq, dk, dv, dbias = default(*args)
  else:  # the backward of each platform's forward, chosen when lowering
    shapes = tuple(None if x is None else jax.ShapeDtypeStruct(x.shape,
                                                               x.dtype)
                   for x in (q, k, v, bias))
    dq, dk, dv, dbias = _platforms.platform_dependent(
        *args, default=default, out_shapes=shapes,
        **{platform: _Grads(static, name, config)
           for platform, name, config in static.per_platform})
  return (dq, dk, dv) + (() if bias is None else (dbias,))


_sage_attention.defvjp(_sage_attention_fwd, _sage_attention_bwd)


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: Optional[jax.Array] = None,
    mask: Optional[jax.Array] = None,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    causal_alignment: CausalAlignment = "top_left",
    query_seq_lengths: Optional[jax.Array] = None,
    key_value_seq_lengths: Optional[jax.Array] = None,
    local_window_size: int | tuple[int, int] | None = None,
    config: ConfigLike | None = None,
    layout: str = "BTNH",
    implementation: Optional[str] = None,
    return_lse: bool = False,
    logits_soft_cap: Optional[float] = None,
):
  """Quantized scaled dot-product attention (SageAttention).

  A drop-in for :func:`jax.nn.dot_product_attention`: the same arguments,
  shapes and mask semantics, computed with INT8/INT4 Q·Kᵀ and FP8 (or
  FP16/BF16) P·V as ``config`` says.

  Shapes (``layout="BTNH"``; ``"BNTH"`` swaps T and N)::

    query [B, T, N, H], key and value [B, S, K, H], N a multiple of K (GQA/MQA;
    K/V are never repeated in memory), mask and bias broadcastable to
    [B, N, T, S]. 3-D inputs without B are accepted, as in JAX.

  Args:
    query, key, value: float16, bfloat16 or float32 arrays of one dtype; head
      dims up to 256.
    bias: optional additive bias on the logits (after ``scale``).
    mask: optional boolean mask, True = attend.
    scale: logit scale; default ``1/sqrt(H)``.
    is_causal: causal masking; see ``causal_alignment``.
    causal_alignment: ``"top_left"`` (JAX's: query ``i`` sees keys ``j <= i``)
      or ``"bottom_right"`` (query ``i`` sees keys ``j <= i + S − T``, per batch
      element from the sequence lengths when given: the last query sees every
      key, as in KV-cache decoding and chunked prefill). Also places
      ``local_window_size``'s window.
    query_seq_lengths, key_value_seq_lengths: optional int ``[B]`` valid
      lengths; padding tokens are excluded from attention and from the
      quantization statistics. Padded query rows give zeros.
    local_window_size: ``w`` or ``(left, right)``: query ``i`` sees keys ``j``
      with ``i − left <= j <= i + right`` (shifted by the alignment's offset).
    config: a :class:`SageConfig`, a preset name (``"sage1"``: INT8
      per-block Q·Kᵀ, FP16 P·V; ``"sage2-8b"``: INT8 per-thread Q·Kᵀ, FP8
      P·V; ``"sage2-4b"``), or None / ``"auto"`` (default): each backend's
      own default preset, the one no other preset beats on both speed and
      accuracy there (``"sage1"`` on ``"pallas"`` and ``"xla"``).
    layout: ``"BTNH"`` (JAX's) or ``"BNTH"``.
    implementation: ``"xla"``, ``"pallas"``, ``"mosaic"``, or None: per
      platform at lowering time (:mod:`sagejax._platforms`), the fastest
      backend that serves the call there, ``"xla"`` (which serves all)
      elsewhere. So ``jax.export`` for ``("cuda", "cpu")`` on any host carries
      the GPU kernels for CUDA and ``"xla"`` for the CPU; see
      :func:`sagejax.backends.plan` for what a GPU export from a host without
      a GPU carries.
    return_lse: also return the natural-log log-sum-exp, f32 ``[B, N, T]``.
    logits_soft_cap: Gemma-2's logit soft cap ``c`` (a float > 0, or None):
      the logits ``x = scale·q·kᵀ + bias`` become ``c·tanh(x / c)`` before
      the masks and the softmax, as tokamax's ``logits_soft_cap``. The cap
      acts on the dequantized scores (K smoothing's shift restored first).

  Returns:
    The output in ``query``'s dtype and layout; with ``return_lse``, the tuple
    ``(output, lse)``. A row that sees no key at all (fully masked or
    padding) gives zeros and LSE −inf (JAX's ``"xla"`` gives the mean of V for
    a fully masked non-padding row).

  Gradients: under ``jax.grad`` the backward is that of *exact* attention at
  the same inputs (quantizers are straight-through), blockwise
  (FlashAttention-2 style, no S×S matrix). After a kernel forward a kernel
  backward runs it — the forward backend's own, else another available
  one's (``"pallas"``: Triton kernels, 16-bit tensor-core products with FP32
  accumulation, softmax statistics recomputed exactly or taken from the
  forward as ``config.backward_stats`` says, INT8 with
  ``config.backward_int8``); otherwise, and always after an ``"xla"``
  forward, the ``"xla"`` backward: FP32 with exactly recomputed statistics.
  With ``implementation=None`` the backward is chosen per platform with the
  forward; with a ``logits_soft_cap`` every backward carries dS back
  through the cap (dX = dS ∘ (1 − tanh²)), the kernels on K unsmoothed.
  A forward that a kernel backward follows runs with
  :meth:`SageConfig.differentiated` (``sage2-8b``: P·V in 16 bits, so that
  the backward can take its statistics from the forward). Gradients flow
  to ``query``, ``key``, ``value``, ``bias`` and through the returned LSE.
  """
  call = _inputs.parse(query, key, value, bias, mask, scale=scale,
                       is_causal=is_causal, causal_alignment=causal_alignment,
                       query_seq_lengths=query_seq_lengths,
                       key_value_seq_lengths=key_value_seq_lengths,
                       local_window_size=local_window_size, layout=layout,
                       logits_soft_cap=logits_soft_cap)
  plan = backends.plan(implementation, call, config)
  static = _Static(config=plan.config, spec=call.spec,
                   sm_scale=call.sm_scale, backend=plan.backend,
                   layout=call.layout, logits_soft_cap=call.logits_soft_cap,
                   per_platform=plan.per_platform)
  out, lse = _sage_attention(static, call.q, call.k, call.v, call.bias,
                             call.mask, call.q_lengths, call.kv_lengths)
  out = call.unbatch(out)
  if return_lse:
    return out, call.unbatch(lse)
  return out

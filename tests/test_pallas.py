"""The Pallas (Triton) backend: kernels vs sagejax.quant and the "xla" path.

On CPU the kernels run in the Pallas interpreter on small shapes and are
lowered for CUDA (so an unsupported primitive fails here, not on a user's
GPU). Tests marked ``gpu`` run the compiled kernels and skip without a GPU.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sagejax
from sagejax import PRESETS, SageConfig, _inputs, quant, testing
from sagejax.backends import pallas_triton, xla
from sagejax.kernels import triton_attention, triton_quantize
from sagejax.kernels._common import GROUP_SCALES_ONE, GROUP_SCALES_PER_STEP
from sagejax.masks import MaskSpec

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")

# Small blocks keep the interpreter fast; the math is the same at any size.
SMALL = {
    "int8_thread": SageConfig(block_q=32, block_k=32, num_warps=4),
    "int8_block": SageConfig(qk_granularity="per_block", block_q=32,
                             block_k=32, pv_dtype="fp16",
                             pv_accumulation="fp32"),
    "int8_warp_smoothv": SageConfig(qk_granularity="per_warp", block_q=32,
                                    block_k=32, smooth_v=True),
    "int8_token_bf16": SageConfig(qk_granularity="per_token", block_q=32,
                                  block_k=32, pv_dtype="bf16"),
    "int4_thread": SageConfig(qk_dtype="int4", smooth_q=True, block_q=32,
                              block_k=32),
}
TILING = triton_attention.KernelTiling(block_q=32, block_k=32, num_warps=4,
                                       num_stages=1)

_seed = itertools.count()


def _key():
  return jax.random.PRNGKey(1000 + next(_seed))


def _data(b, t, s, n, kh, h, kind="qkv_channel_bias", layout="BTNH",
          dtype=jnp.float32):
  return testing.make_qkv(_key(), b, t, s, n, kh, h, kind, dtype, layout)


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
def test_quantize_kernels_match_quant(name, layout):
  """Interpreted quantization kernels == sagejax.quant, value for value."""
  config = SMALL[name]
  q, k, v = _data(2, 70, 45, 4, 2, 64, layout=layout)
  kv_lengths = jnp.array([45, 20], jnp.int32)
  call = _inputs.parse(q, k, v, layout=layout,
                       key_value_seq_lengths=kv_lengths)
  got = pallas_triton.INTERPRET_BACKEND.prepare(call, config, TILING).qkv
  qc, kc, vc = call.canonical()
  want = quant.quantize(qc, kc, vc, config, call.sm_scale, None, kv_lengths)
  np.testing.assert_array_equal(got.q, want.q)
  # K's mean is summed in another order (token_statistics): a value may
  # round the other way at an exact half, a scale differ in the last bits.
  diff = np.abs(np.asarray(got.k, np.int32) - np.asarray(want.k, np.int32))
  assert diff.max() <= 1 and np.mean(diff > 0) < 1e-3, diff.max()
  for field in ("q_scale", "k_scale", "v_scale"):
    np.testing.assert_allclose(getattr(got, field), getattr(want, field),
                               rtol=1e-5)
  gv = got.v
  if gv.dtype == quant.FP8_DTYPE:
    gv = jnp.swapaxes(gv, 2, 3)  # FP8 for FP8 tensor cores: [B, K, H, S]
  elif config.pv_dtype == "fp8_e4m3":
    assert gv.dtype == jnp.float16  # FP8 values for FP16 tensor cores
  np.testing.assert_array_equal(gv.astype(jnp.float32),
                                want.v.astype(jnp.float32))
  if want.v_mean is not None:
    np.testing.assert_allclose(got.v_mean, want.v_mean, rtol=1e-6, atol=1e-6)
  if want.delta_s is not None:
    np.testing.assert_allclose(got.delta_s, want.delta_s, rtol=1e-5,
                               atol=1e-5)
  # The Q kernel's row shifts q·k̄ (the LSE of smoothed K's correction).
  assert (got.lse_shift is None) == (want.lse_shift is None)
  if want.lse_shift is not None:
    np.testing.assert_allclose(got.lse_shift, want.lse_shift, rtol=1e-5,
                               atol=1e-4)


@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
def test_token_statistics_match_quant(layout):
  """K's mean and V's mean and max |V| in one interpreted pass == the
  sagejax.quant reductions, with lengths and NaN/Inf tokens."""
  _, k, v = _data(2, 8, 96, 2, 2, 64, kind="channel_bias", layout=layout)
  t_ax = 1 if layout == "BTNH" else 2
  k = k.at[(0, 5, 1) if t_ax == 1 else (0, 1, 5)].set(jnp.inf)
  v = v.at[(1, 7, 0) if t_ax == 1 else (1, 0, 7)].set(jnp.nan)
  lengths = jnp.array([96, 40], jnp.int32)
  k_mean, v_mean, v_amax = triton_quantize.token_statistics(
      k, v, lengths, layout=layout, block=32, k_mean=True, v_mean=True,
      v_amax=True, interpret=True)
  kc, vc = (_inputs.to_canonical(x, layout) for x in (k, v))
  np.testing.assert_allclose(k_mean, quant.token_mean(kc, lengths),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(v_mean, quant.token_mean(vc, lengths),
                             rtol=1e-5, atol=1e-6)
  want = quant.abs_max(quant.zero_padding(vc, lengths), axis=-2)
  np.testing.assert_array_equal(v_amax, want)
  assert np.isinf(v_amax[1, 0]).any() and np.isfinite(v_amax[0]).all()
  # The K pass reading V beside K (quantize_qk(v=)) gives the same maxima
  # and K's values as without V (blocks of 32 tokens: S = 96).
  config = PRESETS["sage2-8b"].replace(block_k=32)
  with_v = triton_quantize.quantize_qk(
      k, lengths, k_mean, role="k", config=config, layout=layout, v=v,
      interpret=True)
  alone = triton_quantize.quantize_qk(
      k, lengths, k_mean, role="k", config=config, layout=layout,
      interpret=True)
  np.testing.assert_array_equal(with_v[4], want)
  assert alone[4] is None
  for a, b in zip(with_v[:2], alone[:2]):
    np.testing.assert_array_equal(a, b)


def _check_passes_in_one_launch(layout: str, interpret: bool,
                                dtype=jnp.float32):
  """``run_passes`` against each pass run alone, bit for bit (see below)."""
  config = PRESETS["sage2-8b"].replace(block_q=64, block_k=32)
  q, k, v = _data(2, 128, 96, 4, 2, 64, kind="channel_bias", layout=layout,
                  dtype=dtype)
  t_ax = 1 if layout == "BTNH" else 2
  k = k.at[(0, 5, 1) if t_ax == 1 else (0, 1, 5)].set(jnp.inf)
  v = v.at[(1, 7, 0) if t_ax == 1 else (1, 0, 7)].set(jnp.nan)
  q_len, kv_len = jnp.array([128, 70], jnp.int32), jnp.array([96, 40],
                                                               jnp.int32)
  k_mean = quant.sampled_mean(k, kv_len, token_axis=t_ax)
  kw = dict(config=config, layout=layout, interpret=interpret)
  passes = [
      triton_quantize.quantize_qk_pass(k, kv_len, k_mean, role="k",
                                       centred=True, **kw),
      triton_quantize.token_statistics_pass(
          k, v, kv_len, layout=layout, block=32, k_mean=False, v_mean=True,
          v_amax=True),
      triton_quantize.quantize_qk_pass(q, q_len, None, role="q",
                                       scale_mult=0.3, k_mean=k_mean,
                                       shift_mult=0.125, **kw)]
  alone = [triton_quantize.run_pass(p, interpret=interpret) for p in passes]
  if not interpret:
    testing.poison_device_memory(2 ** 26)
  together = triton_quantize.run_passes(passes, interpret=interpret)
  assert together[1][1] is not None and together[2][3] is not None
  for got, want in zip(jax.tree.leaves(together), jax.tree.leaves(alone)):
    np.testing.assert_array_equal(got, want)
  assert len(jax.tree.leaves(together)) == 8  # K 3, statistics 2, Q 3
  assert np.isinf(together[1][2][1, 0]).any()


@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
def test_passes_in_one_launch_equal_the_passes_alone(layout):
  """``run_passes`` (the K pass with K − k̄, V's statistics and the Q pass
  with its LSE shift, one interpreted launch of differently shaped grids:
  GQA, T ≠ S, Q rows 64, K and statistics blocks of 32) gives each pass's
  results bit for bit, NaN and Inf tokens and lengths included."""
  _check_passes_in_one_launch(layout, interpret=True)


@gpu
@needs_gpu
@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
def test_gpu_passes_in_one_launch_equal_the_passes_alone(layout):
  """As above, compiled for the GPU, bf16 inputs, outputs poisoned."""
  _check_passes_in_one_launch(layout, interpret=False, dtype=jnp.bfloat16)


@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
def test_k_pass_writes_the_centred_k_the_backward_makes(layout):
  """The K pass's K − k̄ (``centred=True``, what the Mosaic forward hands
  its backward) equals the backward's own copy (``smoothed``) on valid
  keys, bit for bit in bf16, and is 0 past the lengths; the K values and
  scales are those of the pass without it."""
  _, k, _ = _data(2, 8, 128, 2, 2, 64, kind="channel_bias", layout=layout,
                  dtype=jnp.bfloat16)
  t_ax = 1 if layout == "BTNH" else 2
  lengths = jnp.array([128, 70], jnp.int32)
  config = PRESETS["sage2-8b"].replace(block_k=32)
  want, k_mean = pallas_triton.smoothed(k, lengths, layout, 64, 128)
  run = lambda **kw: triton_quantize.quantize_qk(
      k, lengths, k_mean, role="k", config=config, layout=layout,
      interpret=True, **kw)
  with_centred, alone = run(centred=True), run()
  got = with_centred[5]
  assert got.dtype == k.dtype and got.shape == k.shape and alone[5] is None
  valid = (jnp.arange(128) < lengths[:, None])
  valid = valid[:, :, None, None] if t_ax == 1 else valid[:, None, :, None]
  np.testing.assert_array_equal(
      np.asarray(jnp.where(valid, got, 0), np.float32),
      np.asarray(jnp.where(valid, want, 0), np.float32))
  assert not np.asarray(jnp.where(valid, 0, got), np.float32).any()
  for a, b in zip(with_centred[:2], alone[:2]):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="centred"):
    triton_quantize.quantize_qk(k, lengths, None, role="k", config=config,
                                layout=layout, centred=True, interpret=True)


def _check_k_pass_group_scales(layout: str, block_k: int, step_keys: int,
                               interpret: bool):
  """The K pass's grouped scales (``group_scale_keys``) against
  ``group_key_scales`` of its per-key scales, on the entries the Mosaic
  kernel reads (a step's first 4 · step_keys / 64, and its last, 1.0), NaN
  keys and lengths included."""
  from sagejax.kernels.mosaic_attention import group_key_scales
  config = PRESETS["sage2-8b"].replace(block_k=block_k)
  _, k, _ = _data(2, 8, 512, 2, 2, 64, kind="channel_bias", layout=layout,
                  dtype=jnp.bfloat16)
  t_ax = 1 if layout == "BTNH" else 2
  k = k.at[(0, 70, 1) if t_ax == 1 else (0, 1, 70)].set(jnp.nan)
  k = k.at[(1, 200, 0) if t_ax == 1 else (1, 0, 200)].set(-jnp.inf)
  lengths = jnp.array([512, 300], jnp.int32)
  k_mean = quant.sampled_mean(k, lengths, token_axis=t_ax)
  got = triton_quantize.quantize_qk(
      k, lengths, k_mean, role="k", config=config, layout=layout,
      group_scale_keys=step_keys, interpret=interpret)
  used = 4 * step_keys // 64
  shape = (2, 2, 512 // step_keys, GROUP_SCALES_PER_STEP)
  want = np.asarray(group_key_scales(got[1], step_keys)).reshape(shape)
  grouped = np.asarray(got[6]).reshape(shape)
  np.testing.assert_array_equal(grouped[..., :used], want[..., :used])
  assert np.isnan(grouped[..., :used]).sum() == 2  # one group a bad key
  # the 1.0 the kernel's alpha_hint reads
  np.testing.assert_array_equal(grouped[..., GROUP_SCALES_ONE], 1.0)
  np.testing.assert_array_equal(want[..., GROUP_SCALES_ONE], 1.0)
  assert got[6].shape == (2, 2, 512 // step_keys * GROUP_SCALES_PER_STEP)


@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
@pytest.mark.parametrize("block_k,step_keys", [(64, 128), (64, 256),
                                               (128, 128)])
def test_k_pass_writes_the_grouped_key_scales(layout, block_k, step_keys):
  """The K pass writes the Mosaic kernel's grouped K scales (no XLA
  kernels for them) as ``group_key_scales`` makes them; a step that is not
  a multiple of its blocks and of 64 keys is refused."""
  _check_k_pass_group_scales(layout, block_k, step_keys, interpret=True)
  _, k, _ = _data(1, 8, 128, 2, 2, 64, layout=layout)
  with pytest.raises(ValueError, match="group_scale_keys"):
    triton_quantize.quantize_qk(
        k, jnp.array([128], jnp.int32), None, role="k",
        config=PRESETS["sage2-8b"].replace(block_k=128), layout=layout,
        group_scale_keys=64, interpret=True)


@gpu
@needs_gpu
@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
@pytest.mark.parametrize("block_k,step_keys", [(64, 128), (64, 256),
                                               (128, 128)])
def test_gpu_k_pass_writes_the_grouped_key_scales(layout, block_k,
                                                  step_keys):
  """As above, compiled for the GPU (the Triton scatter of 4 entries a
  64 keys)."""
  _check_k_pass_group_scales(layout, block_k, step_keys, interpret=False)


@pytest.mark.parametrize("granularity,rows", [
    ("per_thread", 32), ("per_thread", 64), ("per_warp", 32),
    ("per_token", 32)])
def test_q_pass_in_programs_smaller_than_a_block(granularity, rows):
  """The Q pass in programs of fewer rows than block_q (what its groups
  allow: triton_quantize.q_program_rows) writes the same values, scales
  and row shifts as one program a block, NaN/Inf rows and lengths
  included."""
  config = SageConfig(qk_granularity=granularity, block_q=128, block_k=64)
  q, k, _ = _data(2, 256, 64, 2, 2, 64, kind="channel_bias", layout="BNTH")
  q = q.at[0, 1, 37, 5].set(jnp.nan).at[1, 0, 100, 3].set(-jnp.inf)
  lengths = jnp.array([256, 150], jnp.int32)
  k_mean = jnp.mean(k, axis=2)
  run = lambda **kw: triton_quantize.quantize_qk(
      q, lengths, None, role="q", config=config, layout="BNTH",
      scale_mult=0.3, k_mean=k_mean, shift_mult=0.125, interpret=True,
      **kw)
  whole, split = run(), run(rows=rows, num_warps=2)
  for name, a, b in zip(("values", "scales", "means"), whole, split):
    assert (a is None) == (b is None), name
    if a is not None:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), name)
  # q·k̄ is summed over channels in another order on a smaller tile.
  np.testing.assert_allclose(split[3], whole[3], rtol=1e-5, atol=1e-5)
  assert np.isnan(np.asarray(split[1])[0, 1, 37])
  # sagejax.quant's values and scales of the rows within the lengths.
  want = quant.quantize_groups(quant.zero_padding(q, lengths), "q", config)
  np.testing.assert_array_equal(split[0], want[0])
  np.testing.assert_allclose(split[1], 0.3 * want[1], rtol=1e-6)
  with pytest.raises(ValueError, match="would split the groups"):
    run(rows=16)


def test_q_rows_halve_block_q_as_far_as_the_groups_allow():
  """``q_rows``: ``block_q`` halved above 128 × 128 values or ``max_rows``
  rows, never below a group (sage2-8b: 32-row warps; per-block groups:
  the whole block)."""
  sage2 = PRESETS["sage2-8b"]
  assert sage2.block_q == 128 and triton_quantize.q_program_rows(sage2) == 32
  assert triton_quantize.q_rows(sage2, 128) == 128
  assert triton_quantize.q_rows(sage2, 256) == 64
  assert triton_quantize.q_rows(sage2, 128, max_rows=64) == 64
  assert triton_quantize.q_rows(sage2, 64, max_rows=16) == 32
  per_block = sage2.replace(qk_granularity="per_block")
  assert triton_quantize.q_rows(per_block, 128, max_rows=64) == 128


MASKS = [
    dict(is_causal=False),
    dict(is_causal=True),
    dict(is_causal=True, causal_alignment="bottom_right"),
    dict(local_window_size=(9, 3)),
    dict(is_causal=True, local_window_size=(20, 0),
         causal_alignment="bottom_right"),
]


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("mask_id", range(len(MASKS)))
def test_attention_kernel_matches_xla(name, mask_id):
  """Same quantized inputs → interpreted kernel == "xla" arithmetic.

  Kernel tiles equal the config blocks, so the two do the same operations
  in the same order: measured ~1e-7 relative (3e-5 with BF16 P·V, whose
  block products the interpreter rounds differently). Not quite the same:
  ΔS and the row scale meet the scores in another order, so a last-bit
  difference can flip one P̃ element's FP8 rounding in a row (INT4 with
  smoothed Q: 2 of 90 inputs, one row each, rel L2 up to 6.7e-4).
  """
  config = SMALL[name]
  masks = MASKS[mask_id]
  b, t, s, n, kh, h = 2, 70, 90, 4, 2, 64
  q, k, v = _data(b, t, s, n, kh, h, layout="BNTH")
  q_lengths = jnp.array([70, 33], jnp.int32)
  kv_lengths = jnp.array([90, 41], jnp.int32)
  qkv = quant.quantize(q, k, v, config, 0.125, q_lengths, kv_lengths)
  spec = MaskSpec(masks.get("is_causal", False),
                  masks.get("causal_alignment", "top_left"),
                  masks.get("local_window_size"), t, s)
  want, want_lse = xla.attend_quantized(qkv, config, spec, q_lengths=q_lengths,
                                        kv_lengths=kv_lengths)
  got, got_lse = triton_attention.attention_forward(
      qkv, spec, q_lengths=q_lengths, kv_lengths=kv_lengths,
      config_block_q=config.block_q, out_dtype=jnp.float32,
      int4=config.qk_dtype == "int4", tiling=TILING, interpret=True)
  got, got_lse = got[:, :, :t], got_lse[:, :, :t]
  err = testing.error_metrics(got, want)["rel_l2"]
  assert err < 1e-3, err
  rows_apart = np.abs(np.asarray(got) - np.asarray(want)).max(-1) > 1e-4
  assert rows_apart.mean() < 0.01, (err, np.argwhere(rows_apart))
  finite = np.isfinite(np.asarray(want_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(got_lse)), finite)
  np.testing.assert_allclose(np.asarray(got_lse)[finite],
                             np.asarray(want_lse)[finite], atol=1e-5)
  # Padded query rows are zero.
  assert not np.any(np.asarray(got)[1, :, 33:])


def test_fp8_operands_on_fp16_tensor_cores_are_exact():
  """FP8-valued P̃ and V multiplied as FP16 == the FP8 MMA's operands."""
  config = SMALL["int8_thread"]
  q, k, v = _data(1, 64, 96, 2, 2, 64, kind="channel_bias")
  call = _inputs.parse(q, k, v, is_causal=True)
  outs = []
  for fp16_mma in (False, True):
    backend = pallas_triton._PallasTritonBackend(interpret=True,
                                                 fp8_on_fp16_mma=fp16_mma)
    prepared = backend.prepare(call, config, TILING)
    outs.append(backend.kernel(prepared, call, config, TILING)[0])
  np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6)


# Each preset once, the layouts and shapes taken in turn (the full crosses
# cost the CPU suite ~30 s; test_quantize_kernels_match_quant crosses the
# quantize kernels with both layouts).
@pytest.mark.parametrize("preset,layout", list(zip(
    sorted(PRESETS), itertools.cycle(["BTNH", "BNTH"]))))
def test_interpreted_backend_end_to_end(preset, layout):
  """Whole pallas path (quantize kernels + attention) vs "xla" and exact."""
  config = PRESETS[preset]
  q, k, v = _data(1, 130, 200, 4, 1, 64, kind="channel_bias", layout=layout,
                  dtype=jnp.bfloat16)
  call = _inputs.parse(q, k, v, is_causal=True, layout=layout)
  got, got_lse = pallas_triton.INTERPRET_BACKEND.forward(call, config)
  want, want_lse = xla.BACKEND.forward(call, config)
  # LSE includes the K-smoothing shift on both paths (measured < 2e-3 apart).
  np.testing.assert_allclose(got_lse, want_lse, atol=1e-2)
  exact = sagejax.exact_attention(q, k, v, is_causal=True, layout=layout)
  assert got.shape == q.shape and got.dtype == q.dtype
  vs_xla = testing.error_metrics(got, want.astype(got.dtype))["rel_l2"]
  vs_exact = testing.error_metrics(want, exact)["rel_l2"]
  # Both sides rounded to bf16 identically: the only difference is the
  # kernel's tile size (128 vs the config's 64 keys for P's running max).
  assert vs_xla < 0.3 * vs_exact + 1e-3, (vs_xla, vs_exact)


def _mask_and_bias(b, n, t, s, mask_shape, bias_shape):
  """A random boolean mask (every row keeps a key) and a random bias."""
  mask = jax.random.bernoulli(_key(), 0.7, mask_shape)
  mask = mask.at[..., 0].set(True)
  bias = 2.0 * jax.random.normal(_key(), bias_shape)
  return mask, bias


@pytest.mark.parametrize("preset,shapes", list(zip(
    sorted(PRESETS), itertools.cycle([
        ((2, 4, 70, 90), (1, 4, 70, 90)),   # full mask, per-head bias
        ((1, 1, 1, 90), (2, 1, 70, 1)),     # key-padding mask, per-row bias
    ]))))
def test_interpreted_mask_and_bias_match_xla(preset, shapes):
  """User mask and bias arrays: pallas path == "xla" path on the same call."""
  config = PRESETS[preset]
  b, t, s, n, kh, h = 2, 70, 90, 4, 2, 64
  q, k, v = _data(b, t, s, n, kh, h, kind="channel_bias")
  mask, bias = _mask_and_bias(b, n, t, s, *shapes)
  call = _inputs.parse(q, k, v, bias, mask, is_causal=True)
  got, got_lse = pallas_triton.INTERPRET_BACKEND.forward(call, config)
  want, want_lse = xla.BACKEND.forward(call, config)
  exact = sagejax.exact_attention(q, k, v, bias, mask, is_causal=True)
  vs_xla = testing.error_metrics(got, want)["rel_l2"]
  vs_exact = testing.error_metrics(want, exact)["rel_l2"]
  assert vs_xla < 0.3 * vs_exact + 1e-3, (vs_xla, vs_exact)
  fin = np.isfinite(np.asarray(want_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(got_lse)), fin)
  np.testing.assert_allclose(np.asarray(got_lse)[fin],
                             np.asarray(want_lse)[fin], atol=2e-2)


LOWER_CASES = [
    (preset, layout, causal, h)
    for preset in sorted(PRESETS)
    for layout, causal, h in [("BTNH", True, 128), ("BNTH", False, 64),
                              ("BTNH", False, 256), ("BTNH", True, 96)]
]


@pytest.mark.parametrize("preset,layout,causal,h", LOWER_CASES)
def test_lowers_for_cuda(preset, layout, causal, h):
  """Every kernel variant lowers through Pallas's Triton path for CUDA."""
  config = PRESETS[preset]
  q, k, v = _data(2, 200, 150, 4, 2, h, layout=layout, dtype=jnp.bfloat16)

  mask = jnp.ones((2, 1, 200, 150), bool) if h == 96 else None
  bias = jnp.zeros((1, 4, 1, 150)) if h == 256 else None

  def f(q, k, v):
    call = _inputs.parse(q, k, v, bias, mask, is_causal=causal, layout=layout,
                         key_value_seq_lengths=jnp.array([150, 99]))
    return pallas_triton.BACKEND.forward(call, config)

  lowered = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "sage_attention_fwd" in text and "sage_quantize_q" in text


def test_unsupported_calls_name_the_reason():
  q, k, v = _data(1, 16, 16, 2, 2, 64)
  call = _inputs.parse(q, k, v, scale=-1.0)
  reason = pallas_triton.BACKEND.unsupported(call, PRESETS["sage2-8b"])
  assert "positive scale" in reason
  call = _inputs.parse(q, k, v)
  reason = pallas_triton.BACKEND.unsupported(
      call, PRESETS["sage2-8b"].replace(pv_accumulation="fp32"))
  assert "fp32+fp32" in reason
  if not ON_GPU:
    with pytest.raises(ValueError, match="not available"):
      sagejax.attention(q, k, v, implementation="pallas")


# --------------------------------------------------------------------------
# GPU: compiled kernels.
# --------------------------------------------------------------------------

GPU_CASES = [
    # preset, causal, alignment, (B, T, S, N, K, H), lengths
    ("sage2-8b", False, "top_left", (2, 1024, 1024, 8, 8, 128), False),
    ("sage2-8b", True, "top_left", (2, 1000, 777, 8, 2, 128), False),
    ("sage2-8b", True, "bottom_right", (1, 333, 1500, 8, 1, 64), True),
    ("sage2-8b", False, "top_left", (1, 1, 300, 4, 4, 64), False),
    ("sage2-8b", True, "top_left", (1, 517, 517, 4, 2, 256), True),
    ("sage2-8b", False, "top_left", (1, 700, 900, 4, 4, 96), False),
    ("sage1", True, "top_left", (2, 1000, 1000, 8, 4, 128), False),
    ("sage1", False, "top_left", (1, 257, 1023, 4, 4, 64), True),
    ("sage2-4b", True, "top_left", (2, 1000, 1000, 8, 4, 128), False),
    ("sage2-4b", False, "bottom_right", (1, 300, 2000, 4, 2, 64), True),
]


@gpu
@needs_gpu
@pytest.mark.parametrize("preset,causal,align,shape,lengths", GPU_CASES)
@pytest.mark.parametrize("kind", ["normal", "qkv_channel_bias"])
def test_gpu_pallas_matches_xla_and_exact(preset, causal, align, shape,
                                          lengths, kind):
  b, t, s, n, kh, h = shape
  q, k, v = _data(b, t, s, n, kh, h, kind=kind, dtype=jnp.bfloat16)
  kwargs = dict(is_causal=causal, causal_alignment=align, config=preset)
  if lengths:
    kwargs["query_seq_lengths"] = jnp.full((b,), max(1, t - 5), jnp.int32)
    kwargs["key_value_seq_lengths"] = jnp.full((b,), max(1, s - 7), jnp.int32)
  run = jax.jit(lambda q, k, v, impl: sagejax.attention(
      q, k, v, implementation=impl, return_lse=True, **kwargs),
      static_argnums=3)
  got, got_lse = run(q, k, v, "pallas")
  want, want_lse = run(q, k, v, "xla")
  exact = sagejax.exact_attention(
      q, k, v, **{a: c for a, c in kwargs.items() if a != "config"})
  assert got.dtype == q.dtype and got.shape == q.shape
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  vs_xla = testing.error_metrics(got, want)["rel_l2"]
  vs_exact = testing.error_metrics(want, exact)["rel_l2"]
  pallas_exact = testing.error_metrics(got, exact)["rel_l2"]
  assert vs_xla < 0.3 * vs_exact + 2e-3, (vs_xla, vs_exact)
  assert pallas_exact < 1.2 * vs_exact + 2e-3, (pallas_exact, vs_exact)
  fin = np.isfinite(np.asarray(want_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(got_lse)), fin)
  np.testing.assert_allclose(np.asarray(got_lse)[fin],
                             np.asarray(want_lse)[fin], atol=2e-2)


@gpu
@needs_gpu
@pytest.mark.parametrize("preset", ["sage2-8b", "sage2-4b"])
def test_gpu_mask_and_bias(preset):
  b, t, s, n, kh, h = 2, 600, 1000, 8, 2, 128
  q, k, v = _data(b, t, s, n, kh, h, kind="qkv_channel_bias",
                  dtype=jnp.bfloat16)
  mask, bias = _mask_and_bias(b, n, t, s, (b, 1, t, s), (1, n, t, s))
  run = jax.jit(lambda q, k, v, m, bb, impl: sagejax.attention(
      q, k, v, bb, m, is_causal=True, causal_alignment="bottom_right",
      config=preset, implementation=impl), static_argnums=5)
  got = run(q, k, v, mask, bias, "pallas")
  want = run(q, k, v, mask, bias, "xla")
  exact = sagejax.exact_attention(q, k, v, bias, mask, is_causal=True,
                                  causal_alignment="bottom_right")
  vs_xla = testing.error_metrics(got, want)["rel_l2"]
  vs_exact = testing.error_metrics(want, exact)["rel_l2"]
  assert vs_xla < 0.3 * vs_exact + 2e-3, (vs_xla, vs_exact)


@gpu
@needs_gpu
def test_gpu_default_implementation_is_a_kernel():
  """"mosaic" on Hopper (sm90), "pallas" on other NVIDIA GPUs."""
  q, k, v = _data(1, 256, 256, 4, 4, 64, dtype=jnp.bfloat16)
  call = _inputs.parse(q, k, v)
  from sagejax import backends
  from sagejax.backends import mosaic
  want = "mosaic" if mosaic.BACKEND.available() else "pallas"
  assert backends.select(None, call, PRESETS["sage2-8b"]).name == want


@gpu
@needs_gpu
@pytest.mark.parametrize("stats", ["recompute", "saved"])
def test_gpu_grad_through_pallas(stats):
  """The Triton backward kernel on f32 inputs (16-bit tensor-core operands,
  FP32 accumulation). Recomputed statistics: the gradient of exact
  attention up to those operands (cos > 0.9999, as tests/test_backward.py's
  GPU tests; rel. L2 was above 1e-4 on an H200). Saved ones (the quantized
  forward's output and LSE, sage1's default): cos >= 0.999, the bound of the
  default backward."""
  q, k, v = _data(1, 300, 300, 4, 2, 64, dtype=jnp.float32)
  w = jax.random.normal(_key(), q.shape)
  config = PRESETS["sage1"].replace(backward_stats=stats)
  f = lambda fn: (lambda q, k, v: jnp.sum(fn(q, k, v, is_causal=True) * w))
  got = jax.grad(f(lambda *a, **kw: sagejax.attention(
      *a, implementation="pallas", config=config, **kw)), (0, 1, 2))(q, k, v)
  want = jax.grad(f(sagejax.exact_attention), (0, 1, 2))(q, k, v)
  for g, w_ in zip(got, want):
    err = testing.error_metrics(g, w_)
    assert err["cos_sim"] > (0.9999 if stats == "recompute" else 0.999)


def test_interpreted_backend_under_vmap():
  """pallas_call batching: vmap over an extra leading axis == per-slice calls."""
  config = SMALL["int8_thread"]
  q, k, v = _data(2, 40, 50, 4, 2, 64)
  scale = jnp.array([1.0, 0.5])[:, None, None, None, None]
  qs, ks, vs = q[None] * scale, jnp.stack([k, k]), jnp.stack([v, -v])

  def f(q, k, v):
    call = _inputs.parse(q, k, v, is_causal=True)
    return pallas_triton.INTERPRET_BACKEND.forward(call, config)[0]

  batched = jax.vmap(f)(qs, ks, vs)
  for i in range(2):
    one = f(qs[i], ks[i], vs[i])
    np.testing.assert_allclose(batched[i], one, rtol=1e-5, atol=1e-6)

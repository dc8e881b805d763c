"""CPU study (benchmarks/NOTES.md, Mosaic section 12): the statistics a
single-pass K/V quantization could use, against today's global ones.

Each operand's quantization error alone, one head at a time, T = S = 4096,
H = 128, float64 reference:

1. V in FP8 e4m3 with one scale per channel over all tokens (sage2-8b), one
   per channel and 128-key block, or one per block of 64 or 256 keys shared
   by all channels: relative L2 error of ``P·V_deq`` with the exact P; and,
   per output channel, with one outlier channel 1-10000x the others.
2. K smoothed by its mean over all tokens, over 256 strided tokens, over
   the first 256 tokens, or not at all, then INT8 per token: relative L2
   error of ``softmax(q·K_deqᵀ)·V`` with the exact V.

Data: normal, channel-bias (the tests' kinds), and channel-bias Q and K
with a rotary position embedding (K's mean then drifts with position).

    python benchmarks/quant_stats_study.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from sagejax import testing

T = S = 4096
H = 128
FP8 = jnp.float8_e4m3fn


def rope(x: np.ndarray) -> np.ndarray:
  """Rotary position embedding of ``x [S, H]`` (base 10000)."""
  s, h = x.shape
  angle = np.arange(s)[:, None] * 10000.0 ** (-np.arange(0, h, 2) / h)
  cos, sin = np.cos(angle), np.sin(angle)
  out = np.empty_like(x)
  out[:, 0::2] = x[:, 0::2] * cos - x[:, 1::2] * sin
  out[:, 1::2] = x[:, 0::2] * sin + x[:, 1::2] * cos
  return out


def fp8_round(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
  y = jnp.asarray(x / scale).astype(FP8).astype(jnp.float32)
  return np.asarray(y, np.float64) * scale


def fp8_v(v: np.ndarray, block=None) -> np.ndarray:
  """V dequantized from FP8, scaled per channel (per block of keys)."""
  block = block or v.shape[0]
  out = np.empty_like(v)
  for j in range(0, v.shape[0], block):
    amax = np.abs(v[j:j + block]).max(0, keepdims=True)
    out[j:j + block] = fp8_round(v[j:j + block],
                                 np.where(amax > 0, amax / 448, 1.0))
  return out


def fp8_v_block_scalar(v: np.ndarray, block: int) -> np.ndarray:
  """V dequantized from FP8 with one scale per block of keys (all
  channels)."""
  out = np.empty_like(v)
  for j in range(0, v.shape[0], block):
    amax = np.abs(v[j:j + block]).max()
    out[j:j + block] = fp8_round(v[j:j + block],
                                 amax / 448 if amax > 0 else 1.0)
  return out


def int8_k(k: np.ndarray, mean: np.ndarray) -> np.ndarray:
  """K smoothed by ``mean``, INT8 per token, dequantized (mean added back:
  softmax is shift-invariant, so only the rounding error differs)."""
  kc = k - mean
  scale = np.abs(kc).max(1, keepdims=True) / 127
  scale = np.where(scale > 0, scale, 1.0)
  return np.round(kc / scale) * scale + mean


def softmax(x: np.ndarray) -> np.ndarray:
  e = np.exp(x - x.max(1, keepdims=True))
  return e / e.sum(1, keepdims=True)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
  for kind in ("normal", "qkv_channel_bias", "qkv_channel_bias+rope"):
    q, k, v = testing.make_qkv(jax.random.PRNGKey(len(kind)), 1, T, S, 2, 2,
                               H, kind.split("+")[0], jnp.float32, "BTNH")
    errors = {}
    for head in range(2):
      qh, kh, vh = (np.asarray(x[0, :, head], np.float64) for x in (q, k, v))
      if kind.endswith("rope"):
        qh, kh = rope(qh), rope(kh)
      p = softmax(qh @ kh.T / np.sqrt(H))
      out = p @ vh
      for name, vd in (("V per channel (now)", fp8_v(vh)),
                       ("V per 128-key block and channel", fp8_v(vh, 128)),
                       ("V per 256-key block, one scale",
                        fp8_v_block_scalar(vh, 256)),
                       ("V per 64-key block, one scale",
                        fp8_v_block_scalar(vh, 64))):
        errors.setdefault(name, []).append(rel_l2(p @ vd, out))
      means = {"K mean over all tokens (now)": kh.mean(0, keepdims=True),
               "K mean over 256 strided tokens":
                   kh[::S // 256].mean(0, keepdims=True),
               "K mean over the first 256 tokens":
                   kh[:256].mean(0, keepdims=True),
               "K not smoothed": np.zeros((1, H))}
      for name, mean in means.items():
        pd = softmax(qh @ int8_k(kh, mean).T / np.sqrt(H))
        errors.setdefault(name, []).append(rel_l2(pd @ vh, out))
    for name, errs in errors.items():
      print(f"{kind:22s} {name:34s} rel_l2 {max(errs):.2e}", flush=True)


def outlier_channels():
  """FP8 V with one channel ``mult`` times the others: relative L2 error of
  each output channel of P·V (P exact), median and worst channel."""
  rng = np.random.default_rng(0)
  q, k = rng.standard_normal((2, S, H))
  p = softmax(q @ k.T / np.sqrt(H))
  for mult in (1, 100, 1000, 10000):
    v = rng.standard_normal((S, H))
    v[:, 3] *= mult
    out = p @ v
    for name, vd in (("V per channel (now)", fp8_v(v)),
                     ("V per 256-key block, one scale",
                      fp8_v_block_scalar(v, 256))):
      err = (np.linalg.norm(p @ vd - out, axis=0)
             / np.linalg.norm(out, axis=0))
      print(f"outlier channel x{mult:<6d} {name:34s} median channel "
            f"{np.median(err):.2e} worst {err.max():.2e}", flush=True)


if __name__ == "__main__":
  main()
  outlier_channels()

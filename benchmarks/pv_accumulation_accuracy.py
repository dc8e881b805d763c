"""Error to exact attention of FP8 P·V accumulated two-level or one-level.

    python benchmarks/pv_accumulation_accuracy.py --out DIR

On a Hopper GPU: relative L2 to exact attention (FP32) of the Mosaic
kernel with ``sage2-8b``'s two-level accumulation (each KV block's P·V in
a fresh FP32 accumulator, added by the CUDA cores) and with one-level
(``pv_accumulation="fp32"``: P·V added straight into the output by the
tensor cores), beside the "xla" arithmetic (FP32 sums) and cuDNN bf16;
and one-level with V smoothed (``smooth_v``: V's mean over tokens taken
out before quantization, added back to the output, SageAttention2's
alternative to two-level), B=1, N=8, H=256 and 128, normal data, q/k/v
channel bias, and channel bias whose V offsets drift along the tokens
(benchmarks/NOTES.md, Mosaic sections 17-18). Prints a table; writes
``pv_accumulation_accuracy.json`` under ``--out``. ``--dry-run``: the
"xla" backend for every variant on tiny shapes (tests the script on a
CPU).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import sagejax
from sagejax import PRESETS, testing

# q/k/v channel bias whose V offsets drift along the tokens (each channel's
# offset times 1 + cos(2πt/S), so 0..2×): what smoothing V by its mean over
# all tokens does not take out.
DRIFT = "qkv_channel_bias_drift"


def make_data(key, h: int, s: int, kind: str):
  """B=1, N=8 bf16 q, k, v [B, S, N, H] of ``kind`` (a testing kind or
  :data:`DRIFT`)."""
  if kind != DRIFT:
    return testing.make_qkv(key, 1, s, s, 8, 8, h, kind, jnp.bfloat16, "BTNH")
  q, k, v = testing.make_qkv(key, 1, s, s, 8, 8, h, "qkv_channel_bias",
                             jnp.float32, "BTNH")
  offset = v.mean(axis=1, keepdims=True)  # the per-channel offsets (~4σ)
  ramp = jnp.cos(2 * jnp.pi * jnp.arange(s) / s)[None, :, None, None]
  v = v + offset * ramp
  return tuple(x.astype(jnp.bfloat16) for x in (q, k, v))

CASES = [  # H, S, data, causal
    (256, 4096, "normal", False),
    (256, 4096, "qkv_channel_bias", False),
    (256, 16384, "normal", False),
    (256, 16384, "qkv_channel_bias", True),
    (256, 16384, DRIFT, False),
    (128, 16384, "normal", False),
    (128, 16384, "qkv_channel_bias", False),
    (128, 16384, DRIFT, True),
]


def errors(h: int, s: int, kind: str, causal: bool, gpu: str = "mosaic"
           ) -> dict:
  """Relative L2 to exact attention of each variant on one input."""
  two_level = PRESETS["sage2-8b"]
  one_level = two_level.replace(pv_accumulation="fp32")
  one_level_sv = one_level.replace(smooth_v=True)
  q, k, v = make_data(jax.random.key(s + h), h, s, kind)
  exact = jax.jit(lambda q, k, v: sagejax.exact_attention(
      q, k, v, is_causal=causal))(q, k, v)
  out = {}
  for name, impl, config in [("mosaic two-level", gpu, two_level),
                             ("mosaic one-level", gpu, one_level),
                             ("mosaic one-level smooth_v", gpu, one_level_sv),
                             ("xla sage2-8b", "xla", two_level),
                             ("xla smooth_v", "xla", one_level_sv)]:
    got = jax.jit(lambda q, k, v, impl=impl, config=config: sagejax.attention(
        q, k, v, is_causal=causal, config=config, implementation=impl))(
            q, k, v)
    out[name] = testing.error_metrics(got, exact)["rel_l2"]
  got = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal,
      implementation="cudnn" if gpu == "mosaic" else None))(q, k, v)
  out["cudnn bf16"] = testing.error_metrics(got, exact)["rel_l2"]
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=".")
  parser.add_argument("--dry-run", action="store_true")
  args = parser.parse_args()
  cases, gpu = CASES, "mosaic"
  if args.dry_run:
    cases = [(64, 128, kind, causal) for _, _, kind, causal in CASES[3:5]]
    gpu = "xla"
  rows = []
  for h, s, kind, causal in cases:
    rows.append(dict(h=h, s=s, kind=kind, causal=causal,
                     **errors(h, s, kind, causal, gpu)))
    print(rows[-1], flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "pv_accumulation_accuracy.json"), "w") as f:
    json.dump(rows, f, indent=1)
  names = [k for k in rows[0] if k not in ("h", "s", "kind", "causal")]
  print("| H | S | data | causal | " + " | ".join(names) + " |")
  for r in rows:
    print(f"| {r['h']} | {r['s']} | {r['kind']} | {r['causal']} | "
          + " | ".join(f"{r[n]:.2e}" for n in names) + " |")


if __name__ == "__main__":
  main()

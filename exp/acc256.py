"""Accuracy at H=256 (and 128): rel L2 to exact attention (f32) of the
Mosaic kernel with two-level and one-level FP8 P·V accumulation, the
"xla" arithmetic, and cuDNN bf16; B=1, N=8."""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
import sagejax
from sagejax import PRESETS, testing

two = PRESETS["sage2-8b"]
one = two.replace(pv_accumulation="fp32")
rows = []
for h, s, kind, causal in [(256, 4096, "normal", False),
                           (256, 4096, "qkv_channel_bias", False),
                           (256, 16384, "normal", False),
                           (256, 16384, "qkv_channel_bias", True),
                           (128, 16384, "normal", False),
                           (128, 16384, "qkv_channel_bias", False)]:
  q, k, v = testing.make_qkv(jax.random.key(s + h), 1, s, s, 8, 8, h, kind,
                             jnp.bfloat16, "BTNH")
  exact = jax.jit(lambda q, k, v: sagejax.exact_attention(
      q, k, v, is_causal=causal))(q, k, v)
  res = {}
  for name, impl, cfg in [("mosaic two-level", "mosaic", two),
                          ("mosaic one-level", "mosaic", one),
                          ("xla sage2-8b", "xla", two)]:
    out = jax.jit(lambda q, k, v: sagejax.attention(
        q, k, v, is_causal=causal, config=cfg, implementation=impl))(q, k, v)
    res[name] = testing.error_metrics(out, exact)["rel_l2"]
  out = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, implementation="cudnn"))(q, k, v)
  res["cudnn bf16"] = testing.error_metrics(out, exact)["rel_l2"]
  rows.append(dict(h=h, s=s, kind=kind, causal=causal, **res))
  print(rows[-1], flush=True)
  del exact
with open(os.path.join(os.environ.get("OUT", "."), "acc256.json"), "w") as f:
  json.dump(rows, f, indent=1)
print("| H | S | data | causal | " + " | ".join(k for k in rows[0] if k not in
      ("h", "s", "kind", "causal")) + " |")
for r in rows:
  print(f"| {r['h']} | {r['s']} | {r['kind']} | {r['causal']} | " + " | ".join(
      f"{v:.2e}" for k, v in r.items() if k not in ("h", "s", "kind", "causal"))
      + " |")

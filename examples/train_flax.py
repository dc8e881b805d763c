"""Train a small Flax transformer with exact attention and with sagejax.

The task is copying: each sequence is 32 random tokens followed by the same
32 tokens again, and the causal LM is scored on the second half (the first
half is unpredictable noise). Predicting the copy needs attention to the token
31 positions back, so the quantized attention must stay sharp.

The two runs share everything (initial parameters, data, optimizer); only the
attention class differs: ``flax.linen.MultiHeadDotProductAttention`` or its
drop-in ``sagejax.nn.MultiHeadDotProductAttention`` (``sage2-8b``). After
training, each model greedily generates the copy token by token through the
``decode=True`` KV cache (the sagejax model also with the quantized cache).

Run from the repository root (about two minutes on a laptop CPU)::

  python examples/train_flax.py
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import sagejax.nn  # noqa: E402

VOCAB, HALF = 16, 32
SEQ = 2 * HALF - 1  # inputs: tokens 0..62, targets: tokens 1..63


class Block(nn.Module):
  attention: Any
  heads: int
  decode: bool

  @nn.compact
  def __call__(self, x, mask):
    x = x + self.attention(num_heads=self.heads, decode=self.decode)(
        nn.LayerNorm()(x), mask=mask)
    y = nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))
    return x + nn.Dense(x.shape[-1])(nn.gelu(y))


class CopyLM(nn.Module):
  """A 2-layer pre-LN decoder; ``attention`` is the attention module class."""
  attention: Any
  dim: int = 64
  heads: int = 4
  layers: int = 2
  decode: bool = False

  @nn.compact
  def __call__(self, tokens, positions):
    x = nn.Embed(VOCAB, self.dim)(tokens)
    x = x + nn.Embed(SEQ, self.dim)(positions)
    # While decoding, the cache masks the future; otherwise a causal mask.
    mask = None if self.decode else nn.make_causal_mask(tokens)
    for _ in range(self.layers):
      x = Block(self.attention, self.heads, self.decode)(x, mask)
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def batch_of(key, batch: int) -> jax.Array:
  half = jax.random.randint(key, (batch, HALF), 0, VOCAB)
  return jnp.concatenate([half, half], axis=1)


def copy_loss(model, params, seq):
  logits = model.apply(params, seq[:, :-1], jnp.arange(SEQ)[None])
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, seq[:, 1:])
  return jnp.mean(nll[:, HALF - 1:])  # targets in the copied half


def train(model, params, steps: int, batch: int, lr: float, seed: int):
  opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, 30, steps))
  state = opt.init(params)

  @jax.jit
  def step(params, state, key):
    loss, grads = jax.value_and_grad(
        lambda p: copy_loss(model, p, batch_of(key, batch)))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for key in jax.random.split(jax.random.key(seed), steps):
    params, state, loss = step(params, state, key)
    losses.append(float(loss))
  return params, np.array(losses)


def greedy_copy_accuracy(attention, params, seq, **attn_kwargs) -> float:
  """Feeds the first half, then generates the copy one token at a time."""
  mod = lambda **kw: attention(**kw, **attn_kwargs)
  model = CopyLM(mod, decode=True)
  cache = jax.jit(model.init)(jax.random.key(0), seq[:, :-1],
                              jnp.arange(SEQ)[None])["cache"]

  @jax.jit
  def step(cache, token, pos):
    logits, upd = model.apply({"params": params["params"], "cache": cache},
                              token, pos, mutable=["cache"])
    return upd["cache"], jnp.argmax(logits[:, -1], -1)

  token, generated = seq[:, :1], []
  for t in range(SEQ):
    cache, pred = step(cache, token, jnp.full((1, 1), t))
    # Teacher-force the (random) first half, then feed back predictions.
    token = seq[:, t + 1:t + 2] if t + 1 < HALF else pred[:, None]
    if t >= HALF - 1:
      generated.append(pred)
  return float(jnp.mean(jnp.stack(generated, 1) == seq[:, HALF:]))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=str(pathlib.Path(__file__).with_name(
      "train_flax.png")))
  args = parser.parse_args()

  runs = {"exact (flax.linen)": nn.MultiHeadDotProductAttention,
          "sagejax sage2-8b": sagejax.nn.MultiHeadDotProductAttention}
  sample = batch_of(jax.random.key(1), 1)
  init = jax.jit(CopyLM(nn.MultiHeadDotProductAttention).init)(
      jax.random.key(args.seed), sample[:, :-1], jnp.arange(SEQ)[None])
  results = {}
  for name, attention in runs.items():
    start = time.time()
    params, losses = train(CopyLM(attention), init, args.steps, args.batch,
                           args.lr, args.seed)
    results[name] = (params, losses, time.time() - start)
  marks = sorted({s for s in (50, 100, 200, args.steps) if s <= args.steps})
  print("mean loss over the 10 steps ending at step "
        + ", ".join(map(str, marks)) + " (train time):")
  for name, (_, losses, seconds) in results.items():
    window = [losses[max(0, s - 10):s].mean() for s in marks]
    print(f"  {name:20s} " + "  ".join(f"{w:.4g}" for w in window)
          + f"  ({seconds:.0f}s)")
  exact, sage = (results[n][1] for n in runs)
  rel = (sage - exact) / exact
  print(f"relative loss difference (sage - exact) / exact: mean |.| "
        f"{np.abs(rel).mean():.2%}, max |.| {np.abs(rel).max():.2%}")

  test = batch_of(jax.random.key(10_000), 64)
  (p_exact, _, _), (p_sage, _, _) = (results[n] for n in runs)
  accuracy = {
      "exact, Flax cache": greedy_copy_accuracy(
          nn.MultiHeadDotProductAttention, p_exact, test),
      "sagejax, plain cache": greedy_copy_accuracy(
          sagejax.nn.MultiHeadDotProductAttention, p_sage, test),
      "sagejax, INT8/FP8 cache": greedy_copy_accuracy(
          sagejax.nn.MultiHeadDotProductAttention, p_sage, test,
          quantized_cache=True),
  }
  for name, acc in accuracy.items():
    print(f"greedy copy accuracy, {name:24s} {acc:.4f}")

  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
  steps = np.arange(1, args.steps + 1)
  for (name, (_, losses, _)), style in zip(results.items(), ("-", "--")):
    ax.plot(steps, losses, style, lw=1.4, label=name)
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("copy-half cross-entropy (nats)")
  ax.set_title("2-layer transformer, d=64, copy task")
  ax.axhline(np.log(VOCAB), color="gray", lw=0.8, ls=":")
  ax.text(steps[-1], np.log(VOCAB), "chance ln 16", ha="right", va="bottom",
          color="gray", fontsize=8)
  ax.legend()
  bx.plot(steps, 100 * rel, lw=1.0, color="C2")
  bx.axhline(0, color="gray", lw=0.8)
  bx.set_xlabel("step")
  bx.set_ylabel("(loss_sagejax - loss_exact) / loss_exact  [%]")
  bx.set_title("relative difference per step (same data, same init)")
  fig.tight_layout()
  fig.savefig(args.out, dpi=120)
  print(f"saved {args.out}")


if __name__ == "__main__":
  main()

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

On a GPU it also times a training step of a larger causal model (bf16, S=4k,
head dim 128 by default; ``--time-*`` flags) with exact attention through
cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")``) and with
sagejax (kernel forward and backward), in the same process
(``--time-steps`` forces it elsewhere, ``--no-time-steps`` skips it).
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

import sagejax  # noqa: E402
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


def causal_attention(attend):
  """Flax ``attention_fn`` that ignores the mask and attends causally.

  ``attend(q, k, v)`` gets Flax's ``[batch, T, N, H]`` arrays.
  """
  def fn(query, key, value, bias=None, mask=None, **unused):
    del bias, mask, unused  # the timing model passes neither
    return attend(query, key, value)
  return fn


ATTENTION_FNS = {
    "exact (cuDNN)": lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"),
    "sagejax sage2-8b": lambda q, k, v: sagejax.attention(
        q, k, v, is_causal=True),
}


class TimingLM(nn.Module):
  """A pre-LN causal decoder in bf16 for timing: the attention is
  ``attention_fn`` (causal), everything else identical."""
  attention_fn: Any
  vocab: int
  seq: int
  dim: int
  heads: int
  layers: int

  @nn.compact
  def __call__(self, tokens):
    bf16 = jnp.bfloat16
    x = nn.Embed(self.vocab, self.dim, dtype=bf16)(tokens)
    x = x + nn.Embed(self.seq, self.dim, dtype=bf16)(
        jnp.arange(tokens.shape[1]))[None]
    for _ in range(self.layers):
      x = x + nn.MultiHeadDotProductAttention(
          num_heads=self.heads, dtype=bf16,
          attention_fn=causal_attention(self.attention_fn))(
              nn.LayerNorm(dtype=bf16)(x))
      y = nn.Dense(4 * self.dim, dtype=bf16)(nn.LayerNorm(dtype=bf16)(x))
      x = x + nn.Dense(self.dim, dtype=bf16)(nn.gelu(y))
    return nn.Dense(self.vocab, dtype=bf16)(nn.LayerNorm(dtype=bf16)(x))


def _time_steps(model, tokens, iters: int) -> float:
  params = jax.jit(model.init)(jax.random.key(1), tokens)
  opt = optax.adamw(1e-4)
  state = opt.init(params)

  @jax.jit
  def step(params, state, tokens):
    def loss(p):
      logits = model.apply(p, tokens)[:, :-1].astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, tokens[:, 1:]).mean()
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  for _ in range(3):  # compile and warm up
    params, state, value = step(params, state, tokens)
  jax.block_until_ready(value)
  runs = []
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(iters):
      params, state, value = step(params, state, tokens)
    jax.block_until_ready(value)
    runs.append((time.perf_counter() - start) / iters)
  return 1e3 * float(np.median(runs))


def time_training_steps(args) -> dict[str, float]:
  """Median milliseconds per optimizer step with each attention function."""
  vocab = 1024
  tokens = jax.random.randint(jax.random.key(0), (args.time_batch,
                                                   args.time_seq), 0, vocab)
  times = {}
  for name, attend in ATTENTION_FNS.items():
    try:
      times[name] = _time_steps(TimingLM(
          attend, vocab, args.time_seq, args.time_dim, args.time_heads,
          args.time_layers), tokens, args.time_iters)
    except Exception as e:  # pylint: disable=broad-except  # e.g. no cuDNN
      print(f"  {name}: failed: {type(e).__name__}: {str(e)[:200]}")
  return times


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=str(pathlib.Path(__file__).with_name(
      "train_flax.png")))
  parser.add_argument("--time-steps", action=argparse.BooleanOptionalAction,
                      default=None, help="time training steps of a larger "
                      "model (default: on a GPU)")
  parser.add_argument("--time-seq", type=int, default=4096)
  parser.add_argument("--time-batch", type=int, default=2)
  parser.add_argument("--time-dim", type=int, default=2048)
  parser.add_argument("--time-heads", type=int, default=16)
  parser.add_argument("--time-layers", type=int, default=2)
  parser.add_argument("--time-iters", type=int, default=10)
  args = parser.parse_args()
  if args.time_steps is None:
    args.time_steps = jax.default_backend() == "gpu"

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

  if args.time_steps:
    print(f"training step, B={args.time_batch} S={args.time_seq} "
          f"d={args.time_dim} heads={args.time_heads} (head dim "
          f"{args.time_dim // args.time_heads}) layers={args.time_layers}, "
          f"bf16, causal, on {jax.devices()[0].device_kind}:")
    times = time_training_steps(args)
    for name, ms in times.items():
      print(f"  {name:20s} {ms:8.2f} ms/step")
    if len(times) == 2:
      exact, sage = times.values()
      print(f"  sagejax step time / exact: {sage / exact:.2f}")


if __name__ == "__main__":
  main()

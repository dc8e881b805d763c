"""Serve a small decoder-only LM through sagejax.serving's paged KV cache.

A 2-layer GQA transformer (d=64, 4 query heads and 2 KV heads of 32, RoPE)
is first trained briefly to copy: every sequence is a fixed 32-token "system
prompt", a preamble of 0-15 random tokens (noise), a 12-token segment, a
separator, and the segment again. Then 8 requests with different preambles
and segments are served the way a serving engine does it:

1. **Prefix caching**: the system prompt is prefilled once, into two pages
   that every request's page table then starts with.
2. **Extend / chunked prefill**: each request's own prompt (preamble, segment
   and separator) goes through ``serving.extend_attention`` in chunks of 8 tokens
   on top of the cached prefix; different requests have different new-token
   counts in each chunk (padded with ``q_lengths``).
3. **Greedy decode**: one token per request per step with
   ``serving.decode_attention`` until each has copied its segment.

The generated tokens are compared with the dense path (the same model
recomputing full causal attention over the whole sequence at every step, no
cache), for a bf16 cache (pages in bf16) and for the INT8 K / FP8 V cache.
Run from the repository root (about a minute on a CPU)::

  python examples/serve_paged.py
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from sagejax import serving  # noqa: E402

VOCAB, SEP = 32, 1            # token 1 separates segment and copy
DIM, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 4, 2, 32, 2
SYSTEM, PRE_MAX, SEG = 32, 15, 12
MAX_LEN = SYSTEM + PRE_MAX + 2 * SEG + 1
PAGE, CHUNK = 16, 8


# ----------------------------------------------------------------------------
# The model (functional: one parameter dict, attention pluggable).
# ----------------------------------------------------------------------------


def init_params(key):
  keys = iter(jax.random.split(key, 4 + 6 * LAYERS))
  dense = lambda *shape: jax.random.normal(next(keys), shape) / np.sqrt(  # noqa
      shape[0])
  layers = [dict(wq=dense(DIM, HEADS, HEAD_DIM),
                 wk=dense(DIM, KV_HEADS, HEAD_DIM),
                 wv=dense(DIM, KV_HEADS, HEAD_DIM),
                 wo=dense(HEADS * HEAD_DIM, DIM).reshape(HEADS, HEAD_DIM, DIM),
                 w1=dense(DIM, 4 * DIM), w2=dense(4 * DIM, DIM))
            for _ in range(LAYERS)]
  return dict(embed=dense(VOCAB, DIM) * 0.5, layers=layers,
              unembed=dense(DIM, VOCAB))


def _norm(x):
  return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True)
                                                    + 1e-5)


def rope(x, positions):
  """Rotary position embedding of ``x [B, T, heads, H]`` at ``positions``."""
  half = HEAD_DIM // 2
  freq = 10000.0 ** (-jnp.arange(half) / half)
  angle = positions[..., None, None] * freq                # [B, T, 1, H/2]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle),
                          x1 * jnp.sin(angle) + x2 * jnp.cos(angle)], -1)


def forward(params, tokens, positions, attend):
  """Logits ``[B, T, V]`` of tokens ``[B, T]`` at ``positions [B, T]``.

  ``attend(layer, q [B, T, N, H], k, v [B, T, K, H])`` returns the attention
  output ``[B, T, N, H]``: dense causal attention, or the paged cache.
  """
  x = params["embed"][tokens]
  for i, p in enumerate(params["layers"]):
    h = _norm(x)
    q = rope(jnp.einsum("btd,dnh->btnh", h, p["wq"]), positions)
    k = rope(jnp.einsum("btd,dnh->btnh", h, p["wk"]), positions)
    v = jnp.einsum("btd,dnh->btnh", h, p["wv"])
    x = x + jnp.einsum("btnh,nhd->btd", attend(i, q, k, v), p["wo"])
    x = x + jax.nn.gelu(_norm(x) @ p["w1"]) @ p["w2"]
  return _norm(x) @ params["unembed"]


def dense_attend(_, q, k, v):
  """Exact causal attention over the whole sequence (GQA), f32."""
  return jax.nn.dot_product_attention(q, k, v, is_causal=True)


# ----------------------------------------------------------------------------
# Data and training.
# ----------------------------------------------------------------------------

SYSTEM_PROMPT = np.random.RandomState(7).randint(2, VOCAB, SYSTEM)


def make_sequence(rng, pre_len):
  """System prompt, preamble, segment, separator, segment; and the prompt's
  length (up to the separator)."""
  pre, seg = rng.randint(2, VOCAB, pre_len), rng.randint(2, VOCAB, SEG)
  seq = np.concatenate([SYSTEM_PROMPT, pre, seg, [SEP], seg])
  return seq, SYSTEM + pre_len + SEG + 1


def train(steps: int, seed: int = 0):
  rng = np.random.RandomState(seed)
  params = init_params(jax.random.key(seed))
  opt = optax.adamw(optax.warmup_cosine_decay_schedule(0, 3e-3, 30, steps))
  state = opt.init(params)

  @jax.jit
  def step(params, state, tokens, weights):
    def loss_fn(params):
      pos = jnp.broadcast_to(jnp.arange(tokens.shape[1] - 1), tokens[:, 1:].shape)
      logits = forward(params, tokens[:, :-1], pos, dense_attend)
      nll = optax.softmax_cross_entropy_with_integer_labels(logits,
                                                            tokens[:, 1:])
      return jnp.sum(nll * weights) / jnp.sum(weights)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  for i in range(steps):
    tokens = np.zeros((32, MAX_LEN), np.int32)
    weights = np.zeros((32, MAX_LEN - 1), np.float32)
    for b in range(32):
      seq, prompt = make_sequence(rng, rng.randint(0, PRE_MAX + 1))
      tokens[b, :len(seq)] = seq
      weights[b, prompt - 1:len(seq) - 1] = 1.0   # predict the copy
    params, state, loss = step(params, state, tokens, weights)
    if (i + 1) % 100 == 0:
      print(f"  step {i + 1}: copy loss {float(loss):.4f}")
  return params


# ----------------------------------------------------------------------------
# Serving through the paged cache.
# ----------------------------------------------------------------------------


def paged_attend(caches, table, positions, num_new, decode, implementation):
  """An ``attend`` that appends each layer's new K/V to its paged cache and
  attends the new queries to it; fills ``caches`` (a list) in place."""
  lengths = positions + num_new

  def attend(i, q, k, v):
    caches[i] = serving.append(caches[i], k, v, table, positions,
                               num_new=num_new)
    if decode:
      return serving.decode_attention(q[:, 0], caches[i], table, lengths,
                                      implementation=implementation)[:, None]
    return serving.extend_attention(q, caches[i], table, lengths,
                                    q_lengths=num_new,
                                    implementation=implementation)
  return attend


@functools.partial(jax.jit, static_argnames=("decode", "implementation"),
                   donate_argnums=(1,))
def serve_step(params, caches, tokens, table, positions, num_new, *,
               decode: bool, implementation=None):
  """New tokens ``[B, T]`` (sequence b: its first ``num_new[b]``, at
  ``positions[b]`` onwards) → (caches, logits of each sequence's last new
  token ``[B, V]``)."""
  caches = list(caches)
  t = tokens.shape[1]
  pos = positions[:, None] + jnp.arange(t)[None, :]
  attend = paged_attend(caches, table, positions, num_new, decode,
                        implementation)
  logits = forward(params, tokens, pos, attend)
  last = jnp.clip(num_new - 1, 0, t - 1)
  return caches, logits[jnp.arange(tokens.shape[0]), last]


def serve(params, prompts, new_tokens, *, quantized: bool,
          implementation=None):
  """Greedy generation of ``new_tokens[b]`` tokens after each prompt.

  Prompts share the system prompt: it is prefilled once (request 0's first
  pages) and every request's page table starts with those pages.
  """
  b = len(prompts)
  pages_per_seq = -(-MAX_LEN // PAGE)
  shared = SYSTEM // PAGE
  num_pages = shared + b * (pages_per_seq - shared)
  table = np.zeros((b, pages_per_seq), np.int32)
  table[:, :shared] = np.arange(shared)
  table[:, shared:] = shared + np.arange(b * (pages_per_seq - shared)).reshape(
      b, -1)
  table = jnp.asarray(table)
  caches = [serving.PagedKVCache.create(
      num_pages=num_pages, page_size=PAGE, num_kv_heads=KV_HEADS,
      head_dim=HEAD_DIM, quantized=quantized, dtype=jnp.bfloat16)
            for _ in range(LAYERS)]

  # 1. Prefix: the system prompt, once (request 0's row of the page table).
  caches, _ = serve_step(params, caches, jnp.asarray(SYSTEM_PROMPT[None]),
                         table[:1], jnp.zeros(1, jnp.int32),
                         jnp.full(1, SYSTEM, jnp.int32), decode=False,
                         implementation=implementation)
  # 2. Extend: each request's own prompt, in chunks of CHUNK tokens.
  own = [p[SYSTEM:] for p in prompts]
  lengths = np.array([len(o) for o in own])
  last_logits = np.zeros((b, VOCAB), np.float32)
  for start in range(0, lengths.max(), CHUNK):
    chunk = np.zeros((b, CHUNK), np.int32)
    count = np.clip(lengths - start, 0, CHUNK)
    for i, o in enumerate(own):
      chunk[i, :count[i]] = o[start:start + count[i]]
    caches, logits = serve_step(
        params, caches, jnp.asarray(chunk), table,
        jnp.asarray(SYSTEM + np.minimum(start, lengths), jnp.int32),
        jnp.asarray(count, jnp.int32), decode=False,
        implementation=implementation)
    done = (count > 0) & (start + count == lengths)
    last_logits[done] = np.asarray(logits)[done]
  # 3. Decode: one token per request per step.
  out = [[] for _ in range(b)]
  out_logits = [[] for _ in range(b)]
  length = SYSTEM + lengths
  token = last_logits.argmax(-1)
  for _ in range(max(new_tokens)):
    for i in range(b):
      if len(out[i]) < new_tokens[i]:
        out[i].append(int(token[i]))
        out_logits[i].append(last_logits[i])
    active = np.array([len(out[i]) < new_tokens[i] for i in range(b)])
    if not active.any():
      break
    caches, logits = serve_step(
        params, caches, jnp.asarray(token[:, None], jnp.int32), table,
        jnp.asarray(length, jnp.int32), jnp.asarray(active, jnp.int32),
        decode=True, implementation=implementation)
    length = length + active
    last_logits = np.asarray(logits)
    token = last_logits.argmax(-1)
  return out, out_logits, sum(c.nbytes for c in caches)


def dense_generate(params, prompts, new_tokens):
  """The reference: recompute the whole causal forward at every step."""
  b = len(prompts)
  tokens = np.zeros((b, MAX_LEN), np.int32)
  length = np.array([len(p) for p in prompts])
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  run = jax.jit(lambda p, t: forward(
      p, t, jnp.broadcast_to(jnp.arange(MAX_LEN), t.shape), dense_attend))
  out = [[] for _ in range(b)]
  out_logits = [[] for _ in range(b)]
  for _ in range(max(new_tokens)):
    logits = np.asarray(run(params, jnp.asarray(tokens)))
    last = logits[np.arange(b), length - 1]
    nxt = last.argmax(-1)
    for i in range(b):
      if len(out[i]) < new_tokens[i]:
        out[i].append(int(nxt[i]))
        out_logits[i].append(last[i])
        tokens[i, length[i]] = nxt[i]
    length = np.minimum(length + 1, MAX_LEN - 1)
  return out, out_logits


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--requests", type=int, default=8)
  parser.add_argument("--implementation", default=None,
                      help="serving implementation (default: fastest)")
  args = parser.parse_args(argv)
  t0 = time.time()
  print(f"training the copy model ({args.steps} steps)...")
  params = train(args.steps)
  rng = np.random.RandomState(123)
  pres = rng.randint(0, PRE_MAX + 1, args.requests)
  seqs = [make_sequence(rng, n) for n in pres]
  prompts = [s[:n] for s, n in seqs]
  targets = [list(s[n:]) for s, n in seqs]
  segs = np.full(args.requests, SEG)
  dense, dense_logits = dense_generate(params, prompts, segs)
  flat = lambda ls: np.concatenate([np.stack(x) for x in ls])  # noqa: E731
  rows = []
  for name, quantized in (("bf16 pages", False), ("INT8 K / FP8 V pages",
                                                   True)):
    got, logits, nbytes = serve(params, prompts, segs, quantized=quantized,
                                implementation=args.implementation)
    a, d = flat(logits), flat(dense_logits)
    rel = np.linalg.norm(a - d) / np.linalg.norm(d)
    total = sum(segs)
    same = sum(int(a == b) for g, d in zip(got, dense) for a, b in zip(g, d))
    right = sum(int(a == b) for g, t in zip(got, targets) for a, b in zip(g, t))
    rows.append((name, same, right, total, nbytes, rel,
                 all(g == d for g, d in zip(got, dense))))
  total = sum(segs)
  dense_right = sum(int(a == b) for d, t in zip(dense, targets)
                    for a, b in zip(d, t))
  print(f"\n{args.requests} requests, own prompts of "
        f"{[len(p) - SYSTEM for p in prompts]} tokens after a {SYSTEM}-token "
        f"system prompt (cached once), chunks of {CHUNK}, {SEG} tokens "
        f"generated each, {time.time() - t0:.0f} s")
  print(f"dense path: copies {dense_right}/{total} tokens correctly")
  print("| cache | tokens equal to the dense path | copies correct | logits "
        "vs dense (rel. L2) | cache bytes |")
  print("| --- | --- | --- | --- | --- |")
  for name, same, right, total, nbytes, rel, identical in rows:
    print(f"| {name} | {same}/{total} ({100 * same / total:.1f}%)"
          f"{', identical' if identical else ''} | {right}/{total} | "
          f"{rel:.2e} | {nbytes} |")


if __name__ == "__main__":
  main()

"""``sagejax-bench``: does sagejax pay off on this machine?

Subcommands ``speed``, ``accuracy``, ``memory``, ``train`` (forward +
backward), ``all`` (the default: those four), and the serving modes
``decode`` and ``extend`` (paged KV cache; run only when named); see
``sagejax-bench --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from sagejax.bench import (accuracy, env, memory, methods, progress, report,
                           serving, settings as st, speed, train)
from sagejax.config import GRANULARITIES, PRESETS
from sagejax.testing import DATA_KINDS

_ALIASES = {"tokamax": ("tokamax-mosaic", "tokamax-triton")}


def _size(text: str) -> int:
  """``'4096'``, ``'4k'`` or ``'16K'`` → int."""
  t = text.strip().lower()
  try:
    value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"expected a size like 4096 or 4k, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
  return value


def _names(values: Optional[Sequence[str]]) -> Optional[list[str]]:
  """Flattens ``['a,b', 'c']`` → ``['a', 'b', 'c']``; None stays None."""
  if values is None:
    return None
  return [v for x in values for v in x.split(",") if v]


def _sizes(values: Optional[Sequence[str]], parser, flag: str
           ) -> Optional[list[int]]:
  names = _names(values)
  if names is None:
    return None
  try:
    return [_size(v) for v in names]
  except argparse.ArgumentTypeError as e:
    parser.error(f"{flag}: {e}")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="sagejax-bench",
      description="Speed, accuracy and memory of sagejax attention beside "
      "jax.nn.dot_product_attention (xla; cuDNN on GPU), tokamax and Pallas "
      "Mosaic GPU attention when available; decode and extend over a paged "
      "KV cache (sagejax.serving) beside jax.nn on a dense cache and JAX's "
      "Pallas paged_attention. Writes results.json, results.md and PNG plots "
      "to --out.",
      epilog="Examples: sagejax-bench --quick | sagejax-bench speed --seq 1k "
      "4k --head-dim 128 | sagejax-bench accuracy --seq 4096 --head-dim 128 "
      "--batch 2 --heads 8 | sagejax-bench decode --batch 16 --seq 8k | "
      "sagejax-bench extend --chunk 1k --seq 8k 32k")
  p.add_argument("command", nargs="?", default="all",
                 choices=("all",) + st.COMMANDS + st.SERVING_COMMANDS,
                 help="what to measure (default: all = "
                 f"{', '.join(st.COMMANDS)}); decode and extend (attention "
                 "over a paged KV cache, bf16 q) run only when named: they "
                 "would add about half to the time of a --quick all")
  p.add_argument("--quick", action="store_true",
                 help="tiny shapes and few repeats (about a minute on a CPU)")
  p.add_argument("--out", default="bench_out", type=pathlib.Path,
                 help="output folder (default: bench_out)")
  p.add_argument("--backends", nargs="+", metavar="NAME",
                 help="methods to run, comma or space separated: sagejax "
                 "backends (xla, pallas, pallas-interpret: the Pallas kernels "
                 "under the interpreter, for CPU checks) and baselines "
                 "(jax-xla, cudnn, tokamax-mosaic, tokamax-triton, tokamax, "
                 "mgpu; jax-paged: JAX's Pallas paged_attention, decode "
                 "only); default: all that run here")
  p.add_argument("--presets", nargs="+", metavar="NAME",
                 help=f"sagejax presets {tuple(PRESETS)} or 'all' (default: "
                 "sage2-8b for speed and memory, all for accuracy)")
  p.add_argument("--granularities", nargs="+", metavar="NAME",
                 help=f"accuracy: Q/K scale granularities {GRANULARITIES} "
                 "(default: all)")
  p.add_argument("--data", nargs="+", metavar="KIND",
                 help=f"accuracy: input kinds {DATA_KINDS} (default: all; "
                 "--quick: the first two)")
  p.add_argument("--seq", nargs="+", metavar="S",
                 help="sequence lengths T = S, e.g. 1k 4k 16k; decode: "
                 "cached tokens per sequence; extend: cached prefix lengths")
  p.add_argument("--head-dim", nargs="+", metavar="H",
                 help="head dims (decode, extend: the first)")
  p.add_argument("--batch", type=int, help="batch size B")
  p.add_argument("--heads", type=int, help="query heads N")
  p.add_argument("--kv-heads", type=int,
                 help="key/value heads K (default: N; fewer for GQA; decode "
                 "and extend: 8, 2 with --quick, when it divides N)")
  p.add_argument("--chunk", metavar="T",
                 help="extend: new (query) tokens per sequence (default "
                 "4096; 64 with --quick)")
  p.add_argument("--page-size", type=int, metavar="P",
                 help="decode, extend: tokens per cache page, a power of two "
                 "(default 16)")
  p.add_argument("--chain", type=int, metavar="R",
                 help="decode: time R dependent calls in one program and "
                 "report per call (default 1; the host's dispatch of one "
                 "call bounds small decode shapes, ~80 us; R=10 measures "
                 "the device, as decode runs inside a model's step)")
  p.add_argument("--causal", action=argparse.BooleanOptionalAction,
                 default=None,
                 help="only causal (--causal) or only not (--no-causal); "
                 "default both")
  p.add_argument("--dtype", choices=("float16", "bfloat16"),
                 help="sagejax input dtype (default float16, bfloat16 for "
                 "train; jax.nn, cuDNN and tokamax run in bfloat16; decode "
                 "and extend: bfloat16)")
  p.add_argument("--memory-seq", metavar="S",
                 help="memory: the long sequence length (default 16k on GPU)")
  p.add_argument("--repeats", type=int, help="timing repeats (median)")
  p.add_argument("--clock", choices=("wall", "device"), default="wall",
                 help="time each repeat by the host's clock (default) or by "
                 "the device's span of its kernels in a profiler trace "
                 "(GPU only; host dispatch and waits left out)")
  p.add_argument("--no-kernel-only", dest="kernel_only",
                 action="store_false",
                 help="speed: skip kernel-only (pre-quantized) timing")
  p.add_argument("--no-plots", dest="plots", action="store_false",
                 help="do not draw PNG plots")
  p.add_argument("--no-progress", dest="progress", action="store_false",
                 help="no progress bar")
  p.add_argument("--write-results", type=pathlib.Path, metavar="PATH",
                 help="also write this run as a section of PATH (e.g. "
                 "benchmarks/RESULTS.md) with its plots in PATH's plots/")
  p.add_argument("--section", help="section name for --write-results "
                 "(default: platform and command, e.g. cpu-quick, "
                 "cpu-quick-decode, gpu-extend)")
  p.add_argument("--seed", type=int, default=0, help="random seed")
  return p


def _choose(parser, flag: str, given: Optional[list[str]],
            allowed: Sequence[str], default: Sequence[str]) -> list[str]:
  if given is None:
    return list(default)
  if given == ["all"]:
    return list(allowed)
  for name in given:
    if name not in allowed:
      parser.error(f"{flag}: unknown name {name!r}; choose from "
                   f"{', '.join(allowed)} or 'all'.")
  return list(dict.fromkeys(given))


def _split_backends(parser, given: Optional[list[str]], quick: bool
                    ) -> tuple[list[str], list[str]]:
  """``--backends`` → (sagejax backend names, baseline names).

  By default: every sagejax backend available here (with ``--quick`` off a
  GPU, also the Pallas kernels under the interpreter) and every baseline.
  """
  sage_names = methods.sage_backend_names()
  baselines = list(methods.BASELINES) + list(serving.ONLY)
  gpu_only = methods.GPU_ONLY + serving.GPU_ONLY
  known = sage_names + baselines + list(_ALIASES)
  if given is None or given == ["all"]:
    sage = [n for n in sage_names if n != methods.INTERPRET
            and methods.sage_backend(n).available()]
    if quick and not env.is_gpu() and methods.INTERPRET in sage_names:
      sage.append(methods.INTERPRET)
    return sage, baselines
  sage, base = [], []
  for name in given:
    if name in sage_names:
      sage.append(name)
    elif name in baselines:
      base.append(name)
    elif name in _ALIASES:
      base.extend(_ALIASES[name])
    else:
      parser.error(f"--backends: unknown backend {name!r}; choose from "
                   f"{', '.join(known)}.")
  runnable = [n for n in sage if methods.sage_backend(n).available()]
  runnable += [n for n in base if env.is_gpu() or n not in gpu_only]
  if not runnable:
    parser.error(f"--backends: none of {', '.join(given)} can run on "
                 f"{env.device_name()} ({jax.default_backend()}); try xla, "
                 f"jax-xla or {methods.INTERPRET}.")
  return list(dict.fromkeys(sage)), list(dict.fromkeys(base))


def _positive(parser, flag: str, value: Optional[int]) -> None:
  if value is not None and value < 1:
    parser.error(f"{flag} must be >= 1, got {value}.")


def _check_memory(parser, limit: Optional[int], need: int, what: str,
                  shape: methods.Shape | serving.ServingShape) -> None:
  """Exits with a clear message when a shape cannot fit (before allocating)."""
  if limit is not None and need > 0.9 * limit:
    parser.error(
        f"{what} at {shape.describe()} needs about {env.fmt_bytes(need)}, "
        f"more than the {env.fmt_bytes(limit)} of memory on {env.device_name()}"
        "; pass a smaller --seq, --batch or --heads.")


def _serving_shapes(args: argparse.Namespace, parser, commands, small: bool,
                    seqs: Optional[list[int]], head_dims: Optional[list[int]]
                    ) -> tuple[list[serving.ServingShape],
                               list[serving.ServingShape], list[str]]:
  """Decode and extend shapes: the defaults (``--quick`` ones when
  ``small``) with the shape flags applied; (decode, extend, notes)."""
  notes: list[str] = []
  chunk = _sizes([args.chunk] if args.chunk else None, parser, "--chunk")
  page_size = args.page_size
  if page_size is not None and (page_size < 1 or page_size & (page_size - 1)):
    parser.error(f"--page-size must be a power of two, got {page_size}.")
  if head_dims and len(head_dims) > 1:
    notes.append(f"decode and extend use the first --head-dim, "
                 f"{head_dims[0]}.")

  def dims(defaults) -> tuple[int, int, int, int]:
    heads = args.heads or defaults["heads"]
    kv = args.kv_heads or (defaults["kv_heads"]
                           if heads % defaults["kv_heads"] == 0 else heads)
    if heads % kv:
      parser.error(f"--heads {heads} must be a multiple of --kv-heads {kv}.")
    return (heads, kv, head_dims[0] if head_dims else defaults["head_dim"],
            page_size or defaults["page_size"])

  decode, extend = [], []
  if "decode" in commands:
    d = st.DECODE_QUICK if small else st.DECODE_FULL
    pairs = d["batch_tokens"]
    if seqs:  # at the first default batch
      pairs = [(pairs[0][0], s) for s in seqs]
    decode = serving.shapes([(args.batch or b, s) for b, s in pairs], 1,
                            *dims(d))
  if "extend" in commands:
    e = st.EXTEND_QUICK if small else st.EXTEND_FULL
    t = chunk[0] if chunk else e["chunk"]
    b = args.batch or e["batch"]
    extend = serving.shapes([(b, p + t) for p in seqs or e["prefixes"]], t,
                            *dims(e))
  elif chunk:
    notes.append("--chunk applies to extend only; ignored.")
  if page_size and not (decode or extend):
    notes.append("--page-size applies to decode and extend only; ignored.")
  return decode, extend, notes


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser
            ) -> tuple[st.Settings, list[str]]:
  """Checks the arguments and fills in the defaults."""
  notes: list[str] = []
  commands = st.COMMANDS if args.command == "all" else (args.command,)
  for flag in ("batch", "heads", "kv_heads", "repeats", "page_size",
               "chain"):
    _positive(parser, "--" + flag.replace("_", "-"), getattr(args, flag))
  seqs = _sizes(args.seq, parser, "--seq")
  head_dims = _sizes(args.head_dim, parser, "--head-dim")
  memory_seq = _sizes([args.memory_seq] if args.memory_seq else None, parser,
                      "--memory-seq")
  for h in head_dims or ():
    if h > 256:
      parser.error(f"--head-dim: sagejax supports head dims up to 256, got "
                   f"{h}.")
  sage, baselines = _split_backends(parser, _names(args.backends),
                                    args.quick)
  presets = _names(args.presets)
  speed_presets = _choose(parser, "--presets", presets, list(PRESETS),
                          ["sage2-8b"])
  accuracy_presets = _choose(parser, "--presets", presets, list(PRESETS),
                             list(PRESETS))
  granularities = _choose(parser, "--granularities", _names(args.granularities),
                          GRANULARITIES, GRANULARITIES)
  data_kinds = _choose(parser, "--data", _names(args.data), DATA_KINDS,
                       st.DATA_QUICK if args.quick else DATA_KINDS)
  causal = [False, True] if args.causal is None else [args.causal]

  gpu = env.is_gpu()
  shape_flags = any(x is not None for x in (args.seq, args.head_dim,
                                            args.batch, args.heads))
  small = args.quick or not gpu
  small_modes = [c for c in commands
                 if c in ("speed", "memory") + st.SERVING_COMMANDS]
  if not args.quick and not gpu and not shape_flags and small_modes:
    verb = "uses" if len(small_modes) == 1 else "use"
    notes.append(f"no GPU ({jax.default_backend()}): "
                 f"{' and '.join(small_modes)} {verb} the --quick shapes; "
                 "pass --seq/--head-dim/--batch/--heads for others.")
  sp = st.SPEED_QUICK if small else st.SPEED_FULL
  tr = st.TRAIN_QUICK if small else st.TRAIN_FULL
  ac = st.ACCURACY_QUICK if args.quick else st.ACCURACY_FULL

  def pick(defaults, seqs_, hds_):
    return dict(batch=args.batch or defaults["batch"],
                heads=args.heads or defaults["heads"],
                kv_heads=args.kv_heads, seqs=seqs_ or defaults["seqs"],
                head_dims=hds_ or defaults["head_dims"], causal=causal)

  speed_shapes = st.grid(**pick(sp, seqs, head_dims))
  train_shapes = st.grid(**pick(tr, seqs, head_dims))
  dense = any(c in commands for c in st.COMMANDS)
  for s in (speed_shapes[0], st.grid(**pick(ac, seqs, head_dims))[0]):
    if dense and s.heads % s.kv_heads:
      parser.error(f"--heads {s.heads} must be a multiple of --kv-heads "
                   f"{s.kv_heads}.")
  accuracy_shapes = st.grid(**pick(ac, seqs, head_dims))
  accuracy_shapes = [dataclasses.replace(s, causal=False)
                     for s in accuracy_shapes if s.causal == causal[0]]
  mem_seq = (memory_seq[0] if memory_seq else
             st.MEMORY_SEQ_QUICK if small else st.MEMORY_SEQ_FULL)
  s0 = speed_shapes[0]
  memory_shape = methods.Shape(s0.batch, s0.heads, s0.kv_heads, mem_seq,
                               max(s.head_dim for s in speed_shapes))

  decode_shapes, extend_shapes, serving_notes = _serving_shapes(
      args, parser, commands, small, seqs, head_dims)
  notes += serving_notes

  limit = env.memory_limit()
  for what, shapes in (("decode", decode_shapes), ("extend", extend_shapes)):
    if shapes:
      big = max(shapes, key=lambda s: s.input_bytes())
      _check_memory(parser, limit, big.input_bytes(), what, big)
  if "speed" in commands:
    big = max(speed_shapes, key=lambda s: s.qkv_bytes())
    _check_memory(parser, limit, big.qkv_bytes(2), "speed", big)
  if "memory" in commands:
    _check_memory(parser, limit, memory_shape.qkv_bytes(2), "memory",
                  memory_shape)
  if "train" in commands:  # inputs, cotangent and three gradients
    big = max(train_shapes, key=lambda s: s.qkv_bytes())
    _check_memory(parser, limit, 2 * big.qkv_bytes(2), "train", big)
  if "accuracy" in commands:
    big = max(accuracy_shapes, key=lambda s: s.batch * s.heads * s.seq ** 2)
    scores = 3 * 4 * big.batch * big.heads * big.seq * big.seq
    _check_memory(parser, limit, scores + big.qkv_bytes(4),
                  "accuracy (the exact fp32 reference)", big)

  timing = st.TIMING_QUICK if small else st.TIMING_GPU
  timing = dataclasses.replace(timing, l2_bytes=env.l2_bytes(),
                               repeats=args.repeats or timing.repeats,
                               clock=args.clock)
  settings = st.Settings(
      commands=tuple(commands), quick=args.quick, out=args.out, backends=sage,
      baselines=baselines, speed_presets=speed_presets,
      accuracy_presets=accuracy_presets, granularities=granularities,
      data_kinds=data_kinds, dtype=jnp.dtype(args.dtype or "float16").type,
      causal=causal, train_shapes=train_shapes,
      train_dtype=jnp.dtype(args.dtype or "bfloat16").type,
      speed_shapes=speed_shapes, accuracy_shapes=accuracy_shapes,
      memory_shape=memory_shape, decode_shapes=decode_shapes,
      extend_shapes=extend_shapes, timing=timing, kernel_only=args.kernel_only,
      plots=args.plots, progress=args.progress,
      write_results=args.write_results, section=args.section,
      seed=args.seed, memory_limit=limit, chain=args.chain or 1)
  if args.chain and "decode" not in commands:
    notes.append("--chain applies to decode only; ignored.")
  return settings, notes


def run(settings: st.Settings, notes: list[str], argv: Sequence[str]
        ) -> dict[str, Any]:
  """Runs the benchmark and writes the reports; returns the report."""
  meta = env.run_info(list(argv))
  print(f"sagejax-bench on {meta['device']}, JAX {meta['jax_version']}: "
        f"{', '.join(settings.commands)}"
        f"{' (quick)' if settings.quick else ''} → {settings.out}/",
        file=sys.stderr)
  sage, base = [], []
  if any(c in settings.commands for c in st.COMMANDS):  # not serving only
    sage, sage_notes = methods.sage_methods(
        settings.backends, settings.speed_presets, settings.dtype,
        settings.kernel_only)
    base, base_notes = methods.baseline_methods(
        [b for b in settings.baselines if b in methods.BASELINES])
    notes += sage_notes + base_notes
  served = [c for c in st.SERVING_COMMANDS if c in settings.commands]
  if served:
    serving_methods, serving_notes = serving.serving_methods(
        settings.backends, settings.baselines, tuple(served))
    notes += serving_notes
  if methods.INTERPRET in settings.backends and "train" in settings.commands:
    notes.append(f"train: {methods.INTERPRET} is not timed (sagejax-bench "
                 "calls the interpreted kernels outside the custom VJP).")
  if methods.INTERPRET in settings.backends:
    notes.append(f"{methods.INTERPRET} runs the Pallas kernels under the "
                 "interpreter (through XLA): a check that they run and agree, "
                 "not a kernel speed.")
  for note in notes:
    print(f"note: {note}", file=sys.stderr)
  tasks = []
  if "speed" in settings.commands:
    tasks += speed.tasks(settings, sage + base)
  if "accuracy" in settings.commands:
    available = [b for b in settings.backends
                 if methods.sage_backend(b).available()]
    tasks += accuracy.tasks(settings, available)
  if "memory" in settings.commands:
    tasks += memory.tasks(settings, sage + base)
  if "train" in settings.commands:
    train_sage, _ = methods.sage_methods(
        [b for b in settings.backends if b != methods.INTERPRET],
        settings.speed_presets, settings.train_dtype, kernel_only=False)
    tasks += train.tasks(settings, train_sage + base)
  for mode in served:
    tasks += serving.tasks(settings, serving_methods, mode)
  results, seconds = progress.run_tasks(tasks, settings.progress)
  meta["seconds"] = seconds
  row_notes = report.row_notes(results)
  for note in row_notes:
    print(f"note: {note}", file=sys.stderr)
  rep = {"meta": meta, "settings": settings.as_json(),
         "notes": notes + row_notes, "results": results,
         "accuracy_vs_anchors": accuracy.anchor_comparison(
             results.get("accuracy", []))}

  out = settings.out
  out.mkdir(parents=True, exist_ok=True)
  plots = report.write_plots(rep, out, rep["notes"]) if settings.plots else {}
  rep["files"] = {"json": str(out / "results.json"),
                  "markdown": str(out / "results.md"),
                  "plots": [str(p) for p in plots.values()]}
  md = report.markdown(rep, {k: p.name for k, p in plots.items()})
  (out / "results.md").write_text(md)
  report.write_json(rep, out / "results.json")
  if settings.write_results is not None:
    # e.g. cpu-quick (all), cpu-quick-decode, gpu-all, gpu-decode
    one = [] if len(settings.commands) > 1 else [settings.commands[0]]
    section = settings.section or "-".join(
        [meta["platform"]] + (["quick"] + one if settings.quick else
                              one or ["all"]))
    report.update_results(settings.write_results, section, rep, plots)
  print(md)
  print(f"Wrote {out / 'results.json'}, {out / 'results.md'}"
        + "".join(f", {p}" for p in plots.values())
        + (f" and section of {settings.write_results}"
           if settings.write_results else ""), file=sys.stderr)
  return rep


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Entry point of ``sagejax-bench`` and ``python -m sagejax.bench``."""
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser()
  args = parser.parse_args(argv)
  settings, notes = resolve(args, parser)
  run(settings, notes, argv)
  return 0

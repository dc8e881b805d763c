"""Times the Mosaic GPU (Hopper) backend in one process.

    PYTHONPATH=$PWD python benchmarks/mosaic_check.py --out $OUT [--quick]

TOPS = 4·B·N·T·S·H / time (halved when causal) of the kernel alone and end to
end (quantization included) beside cuDNN bf16 and the ``"pallas"`` backend,
B=4, N=32, bf16, and kernel tilings (``--kernel-variants``), each checked
against the default kernel's output on the same inputs. Correctness proper is
``python -m pytest -m gpu tests/test_mosaic.py`` (poisoned outputs, every
preset, alignments, GQA, odd lengths, windows, layouts).

Writes ``mosaic_check.json`` under ``--out`` and prints the tables last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
import traceback
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

import sagejax
from sagejax import PRESETS, SageConfig, _inputs, testing
from sagejax._inputs import ParsedCall
from sagejax.backends import mosaic, registry
from sagejax.bench import timing
from sagejax.kernels._common import next_pow2
from sagejax.kernels.mosaic_attention import MosaicTiling

IMPL = "mosaic"  # --dry-run: "xla" on a CPU, to test this script


def tops(shape, seconds):
  b, n, s, h, causal = shape
  f = 4.0 * b * n * s * s * h / (2 if causal else 1)
  return f / seconds / 1e12


def time_case(shape, variants, key, cfg):
  b, n, s, h, causal = shape
  results = {}
  ref_out = None
  sets = []
  for _ in range(3):
    key, sub = jax.random.split(key)
    sets.append(testing.make_qkv(sub, b, s, s, n, n, h, "normal",
                                 jnp.bfloat16, "BTNH"))
  for name, make in variants:
    try:
      fn, prep = make(causal)
      args = [prep(*x) if prep else x for x in sets]
      t = timing.time_calls(fn, args, cfg)
      results[name] = tops(shape, t.median_s)
      note = ""
      if "kernel" in name:  # same inputs as the default kernel: compare
        out = np.asarray(fn(*args[0])[0], np.float32)
        if ref_out is None:
          ref_out = out
        else:
          note = (f" vs default kernel rel_l2="
                  f"{testing.error_metrics(out, ref_out)['rel_l2']:.1e}")
      print(f"  {name:28s} {results[name]:7.1f} TOPS "
            f"({t.median_s * 1e3:.3f} ms) [{time.strftime('%X')}]{note}",
            flush=True)
    except Exception as e:
      traceback.print_exc(limit=2)
      results[name] = None
      print(f"  {name:28s} FAILED {type(e).__name__}: {str(e)[:200]}",
            flush=True)
  return results


TilingSpec = Union[MosaicTiling, Callable[[ParsedCall, SageConfig],
                                           MosaicTiling]]


def parse_variant(spec: str) -> tuple[TilingSpec, SageConfig]:
  """``"bkv=64,stages=3,regs=240/24,sched=0,expturn=1,overlap=1,rs=0,qk=1,
  nc=3,persist=1,ctas=132,ahint=1"``
  → (MosaicTiling, sage2-8b config): the named fields over
  ``MosaicTiling()``'s defaults, which are *not* the backend's choice for a
  call. A spec starting with ``default`` (``"default,idle=0"``) names fields
  over the backend's choice for each call instead: the tiling is then a
  function of (call, config) (:func:`resolve_tiling`). The config fields
  ``warps=N``
  (``num_warps``: 8 gives the 16-row Q groups ``qk=1`` needs),
  ``fp32acc`` (``pv_accumulation="fp32"``), ``smoothv`` (``smooth_v``) and
  ``pv=bf16`` (16-bit P·V, as ``SageConfig.differentiated`` runs it) may
  be among them."""
  kw, config = {}, PRESETS["sage2-8b"]
  items = list(filter(None, spec.split(",")))
  relative = bool(items) and items[0] == "default"
  for item in items[relative:]:
    name, _, value = item.partition("=")
    if name == "fp32acc":
      config = config.replace(pv_accumulation="fp32")
    elif name == "smoothv":  # V's mean over tokens taken out, added back
      config = config.replace(smooth_v=True)
    elif name == "pv":  # "bf16"/"fp16": the training forward's P·V
      config = config.replace(pv_dtype=value, pv_accumulation="fp32")
    elif name == "warps":
      config = config.replace(num_warps=int(value))
    elif name == "bkv":
      kw["block_kv"] = int(value)
    elif name == "stages":
      kw["num_stages"] = int(value)
    elif name == "regs":
      c, p = value.split("/")
      kw["consumer_registers"], kw["producer_registers"] = int(c), int(p)
    elif name == "sched":
      kw["schedule_barrier"] = bool(int(value))
    elif name == "expturn":
      kw["schedule_exp"] = bool(int(value))
    elif name == "overlap":
      kw["overlap_qk"] = bool(int(value))
    elif name == "rs":
      kw["register_softmax"] = bool(int(value))
    elif name == "heavy":  # causal: last query tiles first (1) or not
      kw["heavy_first"] = bool(int(value))
    elif name == "nc":  # consumer warpgroups per CTA
      kw["num_consumers"] = int(value)
    elif name == "qk":  # Q quantized in the kernel (1) or by a pass (0)
      kw["quantize_q"] = bool(int(value))
    elif name == "pvcols":  # head dims above it: P·V in parts of so many
      kw["pv_part_cols"] = int(value)
    elif name == "persist":  # a persistent grid of CTAs (1)
      kw["persistent"] = bool(int(value))
    elif name == "ctas":  # with persist=1: the grid's CTAs
      kw["num_ctas"] = int(value)
    elif name == "epi":  # persistent: epilogues overlapped by a split meeting
      kw["overlap_epilogues"] = bool(int(value))
    elif name == "idle":  # idle consumers skip their steps' work (1)
      kw["skip_idle_rows"] = bool(int(value))
    elif name == "gks":  # unmasked steps' K scales grouped before the kernel
      kw["group_key_scales"] = bool(int(value))
    elif name == "ahint":  # α times the grouped scales' 1.0 (alpha_hint)
      kw["alpha_hint"] = bool(int(value))
    else:
      raise ValueError(f"unknown variant field {name!r}")
  if relative:
    return (lambda call, cfg: dataclasses.replace(mosaic.default_tiling(
        max(64, next_pow2(call.dims[3])), cfg, call), **kw)), config
  return MosaicTiling(**kw), config


def resolve_tiling(tiling: Optional[TilingSpec], call: ParsedCall,
                   cfg: SageConfig) -> Optional[MosaicTiling]:
  """A variant's tiling for ``call``: as parsed, or the backend's choice
  with the variant's fields (a ``default,...`` spec)."""
  return tiling(call, cfg) if callable(tiling) else tiling


KERNEL_VARIANTS: list[str] = []  # --kernel-variants: extra tilings to time
WITH_PALLAS = False  # --pallas: the "pallas" backend end to end beside them
KERNELS_ONLY = False  # --kernels-only: the variants' kernels, not their e2e


def kernel_alone(tiling: Optional[TilingSpec], cfg: SageConfig,
                 causal: bool):
  """The backend's kernel alone under ``tiling`` (None: its default; see
  :func:`resolve_tiling`): ``(fn, prepare)``, where ``prepare(q, k, v)``
  quantizes (jitted) into the arguments of ``fn``, the jitted kernel."""
  parse = lambda q, k, v: _inputs.parse(q, k, v, is_causal=causal)
  backend = registry()[IMPL]
  extra = lambda call: (() if IMPL == "xla" else
                        (resolve_tiling(tiling, call, cfg),))

  def prepared(q, k, v):
    call = parse(q, k, v)
    return (backend.prepare(call, cfg, *extra(call)),)

  prep = jax.jit(prepared)
  calls = []

  def prepare(q, k, v):  # the kernel reads only the call's static fields
    calls.append(parse(q, k, v))
    return prep(q, k, v)

  fn = jax.jit(lambda p: backend.kernel(p, calls[0], cfg, *extra(calls[0])))
  return fn, prepare


def variants_for(h, quick):
  def e2e(impl, preset="sage2-8b"):
    def make(causal):
      f = jax.jit(lambda q, k, v: sagejax.attention(
          q, k, v, is_causal=causal, config=preset, implementation=impl))
      return f, None
    return make

  def cudnn(causal):
    f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"))
    return f, None

  def kernel_only(tiling=None, cfg=PRESETS["sage2-8b"]):
    return functools.partial(kernel_alone, tiling, cfg)

  def e2e_tiling(tiling, cfg):
    """End to end (quantization included) with a tiling: prepare + kernel
    in one jit."""
    def make(causal):
      backend = registry()[IMPL]

      def f(q, k, v):
        call = _inputs.parse(q, k, v, is_causal=causal)
        extra = (() if IMPL == "xla" else
                 (resolve_tiling(tiling, call, cfg),))
        return backend.kernel(backend.prepare(call, cfg, *extra), call, cfg,
                              *extra)
      return jax.jit(f), None
    return make

  out = [("cudnn", cudnn), ("mosaic e2e", e2e(IMPL)),
         ("mosaic kernel", kernel_only())]
  for v in KERNEL_VARIANTS:
    tiling, cfg = parse_variant(v)
    out.append((f"kernel {v}", kernel_only(tiling, cfg)))
    if not KERNELS_ONLY:
      out.append((f"e2e {v}", e2e_tiling(tiling, cfg)))
  if KERNEL_VARIANTS:
    if WITH_PALLAS:
      out.append(("pallas e2e", e2e("pallas")))
    return out
  if not quick:
    out += [("kernel fp32-acc", kernel_only(
        cfg=PRESETS["sage2-8b"].replace(pv_accumulation="fp32"))),
            ("kernel stages=3", kernel_only(MosaicTiling(num_stages=3))),
            ("mosaic sage1 e2e", e2e("mosaic", "sage1")),
            ("pallas e2e", e2e("pallas"))]
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="bench_out")
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--kernel-variants", default="",
                      help="';'-separated tilings, e.g. 'bkv=64,stages=3;"
                      "regs=240/24;qk=1,warps=8' (fields over "
                      "MosaicTiling()'s defaults, not the backend's choice; "
                      "'default,idle=0': fields over the backend's choice "
                      "for each shape; only these beside cudnn and default; "
                      "warps= sets SageConfig.num_warps)")
  parser.add_argument("--pallas", action="store_true",
                      help="with --kernel-variants: time the 'pallas' "
                      "(Triton) backend end to end too")
  parser.add_argument("--kernels-only", action="store_true",
                      help="with --kernel-variants: time the variants' "
                      "kernels alone (no end-to-end call per variant)")
  parser.add_argument("--shapes", default="",
                      help="';'-separated B,N,S,H,causal (causal 0/1)")
  parser.add_argument("--compile-only", action="store_true",
                      help="compile the default kernel per shape (with "
                      "--kernel-variants: only theirs) and stop (with "
                      "MOSAIC_GPU_DUMP_PTXAS=1: register report)")
  parser.add_argument("--clock", choices=("wall", "device"), default="wall",
                      help="time each repeat by the host's clock or by the "
                      "device's span in a profiler trace (issue 8's 4k "
                      "target is met by one and not the other: NOTES "
                      "Mosaic section 46)")
  parser.add_argument("--dry-run", action="store_true",
                      help="xla backend, tiny shapes: test the script on a CPU")
  args = parser.parse_args()
  global IMPL, WITH_PALLAS, KERNELS_ONLY
  KERNEL_VARIANTS.extend(filter(None, args.kernel_variants.split(";")))
  WITH_PALLAS = args.pallas
  KERNELS_ONLY = args.kernels_only
  if args.dry_run:
    IMPL = "xla"
  os.makedirs(args.out, exist_ok=True)
  dev = jax.devices()[0]
  env = dict(jax=jax.__version__, device=dev.device_kind, clock=args.clock,
             compute_capability=getattr(dev, "compute_capability", None))
  print(env, flush=True)
  key = jax.random.key(int(time.time()))
  report = dict(env=env)
  cfg = timing.TimingConfig(repeats=5, target_s=0.05, clock=args.clock)
  shapes = [(4, 32, 4096, 128, False), (4, 32, 16384, 128, False),
            (4, 32, 16384, 128, True), (4, 32, 1024, 128, False),
            (4, 32, 4096, 128, True), (4, 32, 16384, 64, False)]
  if args.quick:
    shapes = shapes[:3]
  if args.shapes:
    shapes = [tuple(int(x) for x in sh.split(",")) for sh in
              args.shapes.split(";")]
    shapes = [(b, n, s, h, bool(c)) for b, n, s, h, c in shapes]
  if args.dry_run:
    shapes = [(1, 2, 128, 64, False)]
  if args.compile_only:
    for shape in shapes:
      b, n, s, h, causal = shape
      x = testing.make_qkv(key, b, s, s, n, n, h, "normal", jnp.bfloat16,
                           "BTNH")
      for name, make in variants_for(h, True)[2:]:
        if KERNEL_VARIANTS and not name.startswith("kernel "):
          continue  # with variants: only their kernels (one dump each)
        print(f"=== compile {name} B={b} N={n} S={s} H={h} causal={causal}",
              flush=True)
        fn, prep = make(causal)
        jax.block_until_ready(fn(*(prep(*x) if prep else x)))
    return
  speed = {}
  for shape in shapes:
    print(f"speed B={shape[0]} N={shape[1]} S={shape[2]} H={shape[3]} "
          f"causal={shape[4]}", flush=True)
    speed[str(shape)] = time_case(shape, variants_for(shape[3], args.quick),
                                  key, cfg)
  report["speed"] = speed
  with open(os.path.join(args.out, "mosaic_check.json"), "w") as f:
    json.dump(report, f, indent=1, default=str)
  print("\n| shape | " + " | ".join(
      name for name, _ in variants_for(128, args.quick)) + " |")
  for shape, res in speed.items():
    cells = [("-" if v is None else f"{v:.0f}") for v in res.values()]
    base = res.get("cudnn")
    e2e = res.get("mosaic e2e")
    ratio = f"{e2e / base:.2f}x" if base and e2e else "-"
    print(f"| {shape} | " + " | ".join(cells) + f" | e2e/cudnn {ratio}")


if __name__ == "__main__":
  main()

"""sagejax-bench end to end on CPU: reports, plots, RESULTS.md, bad args."""

import dataclasses
import gzip
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sagejax import _inputs
from sagejax.bench import (accuracy, device_time, methods, report, serving,
                           timing)
from sagejax.bench.cli import main
from sagejax.config import PRESETS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """One tiny ``--quick`` run of every subcommand; (out dir, RESULTS.md).
  The "xla" backend and its kernel hook stand for the kernel backends here
  (the interpreted Pallas kernels doubled the run's time: they run in
  ``serving_run`` and tests/test_pallas.py)."""
  out = tmp_path_factory.mktemp("bench")
  results_md = out / "benchmarks" / "RESULTS.md"
  backends = ["xla", "jax-xla"]
  code = main(["all", "--quick", "--seq", "128", "--head-dim", "32",
               "--heads", "2", "--presets", "sage2-8b", "--granularities",
               "per_thread,per_block", "--data", "normal", "--no-causal",
               "--memory-seq", "256", "--repeats", "2", "--no-progress",
               "--backends", ",".join(backends), "--out", str(out),
               "--write-results", str(results_md)])
  assert code == 0
  return out, results_md


def test_json_report(run):
  out, _ = run
  rep = json.loads((out / "results.json").read_text())
  assert {"meta", "settings", "notes", "results", "accuracy_vs_anchors",
          "files"} <= set(rep)
  for key in ("device", "platform", "jax_version", "date", "command"):
    assert rep["meta"][key]
  speed = rep["results"]["speed"]
  modes = {(r["method"], r["mode"]) for r in speed}
  assert ("sage2-8b:xla", "end_to_end") in modes
  assert ("sage2-8b:xla:kernel", "kernel") in modes
  assert ("jax-xla", "end_to_end") in modes
  for r in speed:
    assert r["status"] == "ok", r
    assert r["tops"] > 0 and r["time_ms"] > 0 and r["input_sets"] >= 1
  acc = rep["results"]["accuracy"]
  assert {r["granularity"] for r in acc if r["backend"] == "xla"} == {
      "per_thread", "per_block"}
  for r in acc:
    assert r["status"] == "ok", r
    assert r["cos_sim"] > 0.99 and 0 <= r["rel_l1"] < 0.1 and r["rmse"] >= 0
  mem = rep["results"]["memory"]
  assert mem and all(r["total_bytes"] > 0 for r in mem)
  train = rep["results"]["train"]
  assert {r["method"] for r in train} == {"sage2-8b:xla", "jax-xla"}
  for r in train:
    assert r["status"] == "ok" and r["mode"] == "train", r
    assert r["tops"] > 0 and r["dtype"] == "bf16"
  # GPU-only baselines are skipped with one line, not an error.
  assert all("\n" not in n for n in rep["notes"])


def test_markdown_and_plots(run):
  out, _ = run
  md = (out / "results.md").read_text()
  for heading in ("## Speed (TOPS)", "## Accuracy vs exact attention",
                  "## Memory at S=256", "| H | S | causal |",
                  "## Training step, forward + backward (TFLOPS)",
                  "(train.png)",
                  "| method | data | causal | cos sim | relative L1 | RMSE |",
                  "(speed.png)", "(accuracy.png)"):
    assert heading in md
  for name in ("speed.png", "accuracy.png", "train.png"):
    data = (out / name).read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_results_file_sections(run, tmp_path):
  out, results_md = run
  text = results_md.read_text()
  assert text.count("<!-- sagejax-bench section cpu-quick -->") == 1
  assert "plots/cpu-quick-speed.png" in text
  assert (results_md.parent / "plots" / "cpu-quick-speed.png").read_bytes(
      ).startswith(PNG_MAGIC)
  # Writing the same section again replaces it; another one is appended.
  rep = json.loads((out / "results.json").read_text())
  copy = tmp_path / "RESULTS.md"
  copy.write_text(text)
  report.update_results(copy, "cpu-quick", rep, {})
  report.update_results(copy, "gpu-all", rep, {})
  new = copy.read_text()
  assert new.count("<!-- sagejax-bench section cpu-quick -->") == 1
  assert new.count("<!-- sagejax-bench section gpu-all -->") == 1


@pytest.mark.parametrize("args, message", [
    (["--backends", "nope"], "unknown backend 'nope'"),
    (["--presets", "sage9"], "unknown name 'sage9'"),
    (["--seq", "4m"], "expected a size like 4096 or 4k"),
    (["speed", "--seq", "1000k", "--batch", "64", "--heads", "64"],
     "more than the"),
    (["--heads", "6", "--kv-heads", "4"], "must be a multiple of"),
    (["bogus"], "invalid choice"),
    (["extend", "--chunk", "0"], "--chunk: sizes must be >= 1"),
    (["decode", "--page-size", "12"], "--page-size must be a power of two"),
    (["decode", "--heads", "6", "--kv-heads", "4"], "must be a multiple of"),
    (["decode", "--seq", "4000k", "--batch", "64", "--heads", "64"],
     "more than the"),
])
def test_bad_arguments(args, message, capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    main(args + ["--out", str(tmp_path)])
  assert e.value.code == 2
  assert message in capsys.readouterr().err
  assert not (tmp_path / "results.json").exists()


SERVING_ARGS = ["--quick", "--heads", "2", "--kv-heads", "1", "--head-dim",
                "32", "--repeats", "1", "--no-progress"]


@pytest.fixture(scope="module")
def serving_run(tmp_path_factory):
  """``decode`` and ``extend`` in ``--quick`` mode with tiny shapes (a
  partly filled last page in decode) and every serving method: mode →
  (out dir, report)."""
  backends = ["xla", "jax-xla", "cudnn", "jax-paged"]
  if methods.INTERPRET in methods.sage_backend_names():
    backends.append(methods.INTERPRET)
  runs = {}
  for mode, shape in (("decode", ["--seq", "64", "100"]),
                      ("extend", ["--seq", "48", "--chunk", "16"])):
    out = tmp_path_factory.mktemp(mode)
    assert main([mode] + shape + SERVING_ARGS + [
        "--backends", ",".join(backends), "--out", str(out)]) == 0
    runs[mode] = out, json.loads((out / "results.json").read_text())
  return runs


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_serving_rows(serving_run, mode):
  _, rep = serving_run[mode]
  assert set(rep["results"]) == {mode}
  shapes = rep["settings"][f"{mode}_shapes"]
  assert shapes and all(s["heads"] == 2 and s["kv_heads"] == 1 and
                        s["head_dim"] == 32 and s["page_size"] == 16
                        for s in shapes)
  if mode == "decode":
    assert [(s["prefix"], s["chunk"]) for s in shapes] == [(63, 1), (99, 1)]
  else:
    assert [(s["prefix"], s["chunk"]) for s in shapes] == [(48, 16)]
  rows = rep["results"][mode]
  want = {"xla:int8/fp8", "xla:bf16", "jax-xla"}
  if methods.INTERPRET in methods.sage_backend_names():
    want |= {f"{methods.INTERPRET}:int8/fp8", f"{methods.INTERPRET}:bf16"}
  for key in want:
    got = [r for r in rows if r["method"] == key]
    assert len(got) == len(shapes), key
    for r in got:
      assert r["status"] == "ok" and r["mode"] == mode, r
      assert r["time_us"] > 0 and r["tops"] > 0 and r["tb_s"] > 0
  r = next(r for r in rows if r["method"] == "xla:int8/fp8")
  s = shapes[0]
  assert r["bytes_read"] == s["batch"] * (s["prefix"] + s["chunk"]) * (
      s["kv_heads"]) * (2 * s["head_dim"] + 8)
  if jax.devices()[0].platform != "gpu":
    # GPU-only baselines: no rows, one note.
    assert not [r for r in rows if r["method"] in ("cudnn", "jax-paged")]
    assert any("cudnn, jax-paged need an NVIDIA GPU" in n
               for n in rep["notes"])


def test_decode_chain(tmp_path):
  """``--chain R``: R dependent calls timed in one program, reported per
  call; the chained function equals R calls in a Python loop."""
  fn = lambda q, c: jnp.tanh(q * c)  # noqa: E731
  q, c = jnp.linspace(-2.0, 2.0, 12).reshape(3, 4), jnp.float32(1.5)
  want = q
  for _ in range(3):
    want = want + fn(want, c) * 1e-3
  np.testing.assert_allclose(serving.chained(fn, 3)(q, c), want,
                             rtol=1e-6)
  assert main(["decode", "--seq", "64", "--chain", "3"] + SERVING_ARGS + [
      "--backends", "xla", "--out", str(tmp_path)]) == 0
  rep = json.loads((tmp_path / "results.json").read_text())
  assert rep["settings"]["decode_chain"] == 3
  rows = [r for r in rep["results"]["decode"] if r["status"] == "ok"]
  assert rows and all(r["chain"] == 3 and r["calls"] % 3 == 0 and
                      r["time_us"] > 0 for r in rows)


def test_serving_markdown_and_plots(serving_run):
  out, _ = serving_run["decode"]
  md = (out / "results.md").read_text()
  for text in ("## Decode over a paged KV cache (µs, cache TB/s)",
               "| B | cached tokens | sagejax xla int8/fp8 |", " µs (",
               " TB/s) |", "(decode.png)"):
    assert text in md
  out, _ = serving_run["extend"]
  md = (out / "results.md").read_text()
  for text in ("## Extend over a paged KV cache (TOPS)",
               "| B | chunk T | prefix P | sagejax xla int8/fp8 |",
               " TOPS (", "**not causal**", "(extend.png)"):
    assert text in md
  for mode in ("decode", "extend"):
    out, _ = serving_run[mode]
    data = (out / f"{mode}.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_serving_vs_cudnn_column():
  """The × cuDNN column: cuDNN's time over the fastest sagejax INT8/FP8."""
  def row(method, backend, pages, family, ms):
    return {"method": method, "label": method, "backend": backend,
            "pages": pages, "family": family, "status": "ok",
            "time_ms": ms, "time_us": ms * 1e3, "tb_s": 1.0, "tops": 1.0,
            "batch": 2, "heads": 4, "kv_heads": 2, "head_dim": 64,
            "prefix": 255, "chunk": 1, "tokens": 256, "page_size": 16,
            "repeats": 3}
  rows = [row("xla:int8/fp8", "xla", "int8/fp8", "sagejax", 2.0),
          row("pallas:int8/fp8", "pallas", "int8/fp8", "sagejax", 0.5),
          row("pallas:bf16", "pallas", "bf16", "sagejax", 0.25),
          row("cudnn", None, "dense bf16", "baseline", 1.0)]
  md = "\n".join(report.decode_markdown(rows, "##"))
  assert "| × cuDNN |" in md and "| 2.00× (pallas) |" in md
  assert "× cuDNN |" not in "\n".join(report.decode_markdown(rows[:3], "##"))


def test_serving_shape_work_and_split_table():
  s = serving.ServingShape(batch=2, heads=8, kv_heads=2, head_dim=64,
                           prefix=100, chunk=4, page_size=16)
  assert s.tokens == 104 and s.pages == 7
  assert s.flops == 4 * 2 * 8 * 64 * (4 * 100 + 4 * 5 / 2)
  assert s.cache_bytes(False) == 2 * 104 * 2 * 4 * 64
  assert s.cache_bytes(True) == 2 * 104 * 2 * (2 * 64 + 8)
  for pages, want in ((7, 16), (16, 16), (200, 256), (256, 256)):
    table = np.arange(2 * pages, dtype=np.int32).reshape(2, pages)
    split = serving._split_table(table)  # pylint: disable=protected-access
    assert split.shape == (2, want)
    assert np.array_equal(split[:, :pages], table)


def test_speed_ignores_serving_baselines(tmp_path):
  """jax-paged is a serving baseline: speed runs without it."""
  assert main(["speed", "--quick", "--seq", "128", "--head-dim", "32",
               "--heads", "2", "--no-causal", "--repeats", "1",
               "--no-kernel-only", "--no-plots", "--no-progress",
               "--backends", "jax-xla,jax-paged", "--out", str(tmp_path)]
              ) == 0
  rep = json.loads((tmp_path / "results.json").read_text())
  assert {r["method"] for r in rep["results"]["speed"]} == {"jax-xla"}


def test_unavailable_backend_is_explained(capsys, tmp_path):
  if jax.devices()[0].platform == "gpu":
    pytest.skip("cudnn runs here")
  with pytest.raises(SystemExit):
    main(["--backends", "cudnn", "--out", str(tmp_path)])
  assert "can run on" in capsys.readouterr().err


def test_missing_matplotlib_is_a_note(run, monkeypatch, tmp_path):
  out, _ = run
  rep = json.loads((out / "results.json").read_text())

  def no_matplotlib():
    raise ImportError("no matplotlib")

  monkeypatch.setattr(report, "_pyplot", no_matplotlib)
  notes = []
  assert report.write_plots(rep, tmp_path, notes) == {}
  assert len(notes) == 1 and "matplotlib" in notes[0]


def test_xla_kernel_hook_matches_forward(qkv):
  q, k, v = qkv(1, 128, 128, 2, 2, 32)
  config = PRESETS["sage2-8b"]
  backend = methods.sage_backend("xla")
  prepare, kernel = methods.kernel_hooks(backend)
  call = _inputs.parse(q, k, v, is_causal=True)
  want, _ = backend.forward(call, config)
  got, _ = kernel(prepare(call, config), call, config)
  assert got.shape == want.shape
  assert jnp.allclose(got, want)


def test_timing_counts_and_rotation():
  f = jax.jit(lambda x: x * 2).lower(jnp.ones(8)).compile()
  cfg = timing.TimingConfig(repeats=3, target_s=0.001, min_calls=4,
                            max_calls=8, l2_bytes=64)
  t = timing.time_calls(f, [(jnp.ones(8),), (jnp.zeros(8),)], cfg)
  assert 4 <= t.calls <= 8 and t.repeats == 3 and t.input_sets == 2
  assert 0 < t.min_s <= t.median_s
  assert timing.rotating_sets(32, cfg) == 4  # 2 × 64 B of L2 / 32 B
  assert timing.rotating_sets(10**9, cfg) == 1


def test_device_time_splits_the_trace_into_blocks(tmp_path):
  # A perfetto trace as jax.profiler writes it: GPU kernels of two blocks
  # of 2 calls, a host event and a host-to-device copy (both ignored), and
  # a stray copy alone in the gap (fewer events than calls: not a block).
  events = [
      {"ph": "M", "name": "process_name", "pid": 1,
       "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "name": "process_name", "pid": 2,
       "args": {"name": "/host:CPU"}},
      {"ph": "X", "pid": 1, "name": "kernel_b", "ts": 110.0, "dur": 40.0},
      {"ph": "X", "pid": 1, "name": "kernel_a", "ts": 100.0, "dur": 5.0},
      {"ph": "X", "pid": 1, "name": "Memcpy HtoD", "ts": 120.0, "dur": 9.0},
      {"ph": "X", "pid": 2, "name": "host_op", "ts": 130.0, "dur": 500.0},
      {"ph": "X", "pid": 1, "name": "Memcpy DtoD", "ts": 20000.0, "dur": 1.0},
      {"ph": "X", "pid": 1, "name": "kernel_a", "ts": 50000.0, "dur": 5.0},
      {"ph": "X", "pid": 1, "name": "kernel_b", "ts": 50007.0, "dur": 13.0},
  ]
  trace_dir = tmp_path / "plugins" / "profile" / "run"
  trace_dir.mkdir(parents=True)
  with gzip.open(trace_dir / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  found = device_time.gpu_events(str(tmp_path))
  assert [e[0] for e in found] == ["kernel_a", "kernel_b", "Memcpy DtoD",
                                   "kernel_a", "kernel_b"]
  assert device_time.block_spans(found, 1000.0) == [
      (50.0, 2), (1.0, 1), (20.0, 2)]
  assert device_time.gpu_events(str(tmp_path / "none")) == []


def test_device_time_sums_each_modules_kernels_per_block(tmp_path):
  """``module_blocks``: per block of kernels between idle gaps, µs by XLA
  module and kernel name (a layer's attention among its matmuls)."""
  def kernel(name, ts, dur, module):
    return {"ph": "X", "pid": 1, "name": name, "ts": ts, "dur": dur,
            "args": {"hlo_module": module}}
  events = [
      {"ph": "M", "name": "process_name", "pid": 1,
       "args": {"name": "/device:GPU:0"}},
      kernel("gemm", 0.0, 50.0, "jit_project"),
      kernel("quantize", 50.0, 7.0, "jit_attend"),
      kernel("attention", 58.0, 30.0, "jit_attend"),
      kernel("gemm", 90.0, 80.0, "jit_mlp"),
      kernel("quantize", 170.0, 6.0, "jit_attend"),
      kernel("gemm", 90000.0, 40.0, "jit_project"),
      {"ph": "X", "pid": 1, "name": "no_module", "ts": 90050.0, "dur": 2.0},
  ]
  trace_dir = tmp_path / "plugins" / "profile" / "run"
  trace_dir.mkdir(parents=True)
  with gzip.open(trace_dir / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  blocks = device_time.module_blocks(str(tmp_path), 1000.0)
  assert blocks == [
      {"jit_project": {"gemm": 50.0}, "jit_mlp": {"gemm": 80.0},
       "jit_attend": {"quantize": 13.0, "attention": 30.0}},
      {"jit_project": {"gemm": 40.0}, "?": {"no_module": 2.0}}]


def test_layer_clock_stacks_layers_around_each_attention(monkeypatch):
  """benchmarks/layer_clock.py: the layer loop runs (on the CPU, sagejax's
  default there) with matmuls and without, output shape kept."""
  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1]
                                  / "benchmarks"))
  import layer_clock  # pylint: disable=import-outside-toplevel
  for variant, matmuls, probes in (("sagejax", True, False),
                                   ("none", False, True)):
    run, x = layer_clock.layer_stack(1, 128, 2, 64, variant, matmuls, probes)
    y = run(x, 2)
    assert y.shape == x.shape == (1, 128, 128)
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
  with pytest.raises(ValueError, match="pass one of"):
    layer_clock.attention_fn("flash")
  # The probe's chain (interpreted here): a fixed point of a·0.999999 + 1e-6.
  out = layer_clock.clock_probe("probe_test")(jnp.ones((32,), jnp.float32))
  np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-3)
  # Clocks from probe durations: the shortest probe at the top clock.
  row = {"in_layers": {"sagejax": {"probe_before_us": [12.0, 12.0],
                                   "probe_after_us": [10.0]}},
         "without_matmuls": {"sagejax": {"probe_before_us": [10.0],
                                         "probe_after_us": [10.0]}}}
  clocks = layer_clock.probe_clocks(row)
  assert clocks["in_layers sagejax"] == {"before": 1650.0, "after": 1980.0}
  assert clocks["without_matmuls sagejax"] == {"before": 1980.0,
                                               "after": 1980.0}


def test_device_time_rounds_vary_each_functions_predecessor():
  """Every round runs each function once, and across rounds each function
  follows several others (a rotation kept one predecessor throughout)."""
  names = ["a", "b", "c", "cudnn"]
  orders = device_time.round_orders(names, 10)
  assert all(sorted(o) == sorted(names) for o in orders)
  assert orders == device_time.round_orders(names, 10)  # seeded
  flat = [name for o in orders for name in o]
  for name in names:
    before = {flat[i - 1] for i in range(1, len(flat)) if flat[i] == name}
    assert len(before) >= 2, (name, before)


def test_device_clock_needs_a_gpu():
  with pytest.raises(ValueError, match="pass 'wall' or 'device'"):
    timing.TimingConfig(clock="host")
  if any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("a GPU is present: the device clock works here")
  f = jax.jit(lambda x: x * 2).lower(jnp.ones(8)).compile()
  cfg = timing.TimingConfig(repeats=2, target_s=0.001, min_calls=2,
                            max_calls=2, clock="device")
  with pytest.raises(RuntimeError, match="needs a GPU"):
    timing.time_calls(f, [(jnp.ones(8),)], cfg)


def test_anchor_comparison_uses_the_anchor_numbers():
  row = {"status": "ok", "default_granularity": True, "preset": "sage2-8b",
         "data": "normal", "causal": False, "label": "sage2-8b (xla)",
         "batch": 2, "heads": 8, "seq": 4096, "head_dim": 128,
         "cos_sim": 0.9993, "rel_l1": 0.037, "rmse": 0.001}
  (c,) = accuracy.anchor_comparison([row])
  assert c["same_shape"]
  assert (c["anchor_cos_sim"], c["anchor_rel_l1"], c["anchor_rmse"]) == (
      0.999257, 0.03853, 0.00098)


def test_module_entry_point_help():
  root = pathlib.Path(__file__).resolve().parents[1]
  res = subprocess.run([sys.executable, "-m", "sagejax.bench", "--help"],
                       capture_output=True, text=True, cwd=root, check=False)
  assert res.returncode == 0
  assert "accuracy" in res.stdout and "--quick" in res.stdout


@pytest.mark.parametrize("consumers", [2, 3])
def test_kernel_profile_reads_nested_regions(tmp_path, monkeypatch,
                                             consumers):
  """benchmarks/kernel_profile.py: clocks per region and warpgroup role from
  a Perfetto trace as Mosaic GPU's profiler writes it (ts in µs of clocks;
  tid 1 + warpgroup + (consumers + 1)·CTA), nested regions counted in
  both."""
  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1]
                                  / "benchmarks"))
  import kernel_profile  # pylint: disable=import-outside-toplevel
  regions = ([("qk", None)] * (consumers - 1) + [("pv", "wait_k"),
                                                  ("wait_v_free", None)])
  events = []
  for cta in range(2):
    for wg, (name, inner) in enumerate(regions):
      tid = 1 + wg + (consumers + 1) * cta
      t0 = 10.0 * cta
      events.append(dict(name=name, ph="B", ts=t0, pid=1, tid=tid))
      if inner:
        events.append(dict(name=inner, ph="B", ts=t0 + 0.1, pid=1, tid=tid))
        events.append(dict(name=inner, ph="E", ts=t0 + 0.3, pid=1, tid=tid))
      events.append(dict(name=name, ph="E", ts=t0 + 1.0 + cta, pid=1,
                         tid=tid))
  path = tmp_path / "trace.json"
  path.write_text(json.dumps(dict(traceEvents=events)))
  got = kernel_profile.region_clocks(str(path), consumers)
  last = f"consumer {consumers - 1}"
  assert set(got) == {f"consumer {i}" for i in range(consumers)} | {
      "producer"}
  np.testing.assert_allclose(got["consumer 0"]["regions"]["qk"], 1500.0)
  np.testing.assert_allclose(got[last]["regions"]["pv"], 1500.0)
  np.testing.assert_allclose(got[last]["regions"]["wait_k"], 200.0)
  np.testing.assert_allclose(got["producer"]["span"], 1500.0)
  assert got[last]["entries"] == {"pv": 1.0, "wait_k": 1.0}


def test_kernel_profile_step_periods_by_position(tmp_path, monkeypatch):
  """benchmarks/kernel_profile.py: each consumer's clocks from one ``qk``
  stamp to the next, by the later step's position in its tile (0 spans a
  tile end), over CTAs; the producer's stamps ignored."""
  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1]
                                  / "benchmarks"))
  import kernel_profile  # pylint: disable=import-outside-toplevel
  consumers, steps = 3, 4
  events = []
  for cta in range(2):
    for wg in range(consumers + 1):
      tid = 1 + wg + (consumers + 1) * cta
      name = "qk" if wg < consumers else "wait_k_free"
      t = 0.0
      for i in range(3 * steps):  # three tiles; a tile end costs 5 more
        t += (6.0 if i % steps == 0 and i else 1.0) * (1 + wg)
        events.append(dict(name=name, ph="B", ts=t, pid=1, tid=tid))
        events.append(dict(name=name, ph="E", ts=t + 0.5, pid=1, tid=tid))
  path = tmp_path / "trace.json"
  path.write_text(json.dumps(dict(traceEvents=events)))
  got = kernel_profile.step_periods(str(path), consumers, steps)
  assert set(got) == {f"consumer {i}" for i in range(consumers)}
  for wg in range(consumers):
    np.testing.assert_allclose(got[f"consumer {wg}"],
                               [6000.0 * (1 + wg)] + [1000.0 * (1 + wg)] * 3)


def test_tile_overhead_fits_steps_and_intercept(monkeypatch):
  """benchmarks/tile_overhead.py: a line through kernel times over key
  lengths gives µs per KV step of all tiles and the intercept (§47's
  default at T = 4096: 36.5 µs a step, 100 µs)."""
  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1]
                                  / "benchmarks"))
  import tile_overhead  # pylint: disable=import-outside-toplevel
  lengths = [2048, 4096, 8192, 16384]
  ms = [0.1 + 0.0365 * s / 128 for s in lengths]
  slope, intercept = tile_overhead.fit_steps(lengths, ms, 128)
  np.testing.assert_allclose((slope, intercept), (36.5, 100.0), rtol=1e-9)


def test_mosaic_check_variants_over_defaults_or_the_backends_choice(
    monkeypatch):
  """benchmarks/mosaic_check.py: a variant's fields lie over MosaicTiling()'s
  defaults, or with a leading ``default`` over the backend's choice for
  each call (4096 keys: three consumers on the persistent grid; 1024: two);
  unknown fields are errors."""
  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1]
                                  / "benchmarks"))
  import mosaic_check  # pylint: disable=import-outside-toplevel
  from sagejax import PRESETS, _inputs  # pylint: disable=import-outside-toplevel
  from sagejax.backends import mosaic  # pylint: disable=import-outside-toplevel
  from sagejax.kernels.mosaic_attention import MosaicTiling  # pylint: disable=import-outside-toplevel
  config = PRESETS["sage2-8b"]
  plain, _ = mosaic_check.parse_variant("idle=0,bkv=64")
  assert plain == MosaicTiling(skip_idle_rows=False, block_kv=64)
  relative, cfg = mosaic_check.parse_variant("default,idle=0")
  for s in (4096, 1024):
    x = jnp.ones((1, s, 2, 128), jnp.bfloat16)
    call = _inputs.parse(x, x, x)
    want = mosaic.default_tiling(128, config, call)
    got = mosaic_check.resolve_tiling(relative, call, cfg)
    assert got == dataclasses.replace(want, skip_idle_rows=False)
    assert mosaic_check.resolve_tiling(plain, call, cfg) is plain
  assert got.num_consumers == 2 and want.persistent  # 1024 keys
  with pytest.raises(ValueError, match="unknown variant field"):
    mosaic_check.parse_variant("default,nope=1")


def test_mosaic_sass_finds_loops_and_the_ptx(monkeypatch):
  """benchmarks/mosaic_sass.py: the PTX modules of a Mosaic dump log (the
  first, or the first holding a string), and each loop of ``nvdisasm -c``
  output (a backward branch's span) with its opcode counts; branches after
  the last EXIT (barrier-wait retries) are not loops."""
  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1]
                                  / "benchmarks"))
  import mosaic_sass  # pylint: disable=import-outside-toplevel
  module = ("//\n// Generated by LLVM NVPTX Back-End\n//\n\n.version 9.0\n"
            ".target sm_90a\n.visible .entry k() {\n ret;\n}\n")
  log = "=== compile\n" + module + "\n" + module.replace("k()", "k2()") + (
      "ptxas info    : Used 168 registers\nAB: {'default': True}\n")
  ptx = mosaic_sass.pick_module(log)
  assert ptx.count(".version") == 1 and "k()" in ptx and "k2" not in ptx
  second = mosaic_sass.pick_module(log, contains="k2()")
  assert second.count(".version") == 1 and "k2()" in second
  assert len(mosaic_sass.ptx_modules(log)) == 2
  assert mosaic_sass.ptx_modules(log)[1].endswith(" ret;\n}\n")  # not AB:
  with pytest.raises(SystemExit, match="none of the log's 2"):
    mosaic_sass.pick_module(log, contains="cp.reduce.async.bulk")
  sass = "\n".join([
      "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
      ".L_x_1:",
      "        /*0010*/                   STL [R1+0x4], R2 ;",
      "        /*0020*/                   IGMMA.64x128x32.S8.S8 R24, gdesc[UR16], RZ ;",
      "        /*0030*/                   LDL.LU R2, [R1+0x4] ;",
      "        /*0040*/               @P1 BRA `(.L_x_1) ;",
      "        /*0050*/                   EXIT ;",
      ".L_x_2:",
      "        /*0060*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R5 ;",
      "        /*0070*/              @!P1 BRA `(.L_x_2) ;",
  ])
  (lo, hi, ops), = mosaic_sass.loops(sass)
  assert (lo, hi) == (1, 5)
  assert (ops["STL"], ops["LDL"], ops["IGMMA"], ops["BRA"]) == (1, 1, 1, 1)

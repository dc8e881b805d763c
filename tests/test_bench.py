"""sagejax-bench end to end on CPU: reports, plots, RESULTS.md, bad args."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from sagejax import _inputs
from sagejax.bench import accuracy, methods, report, timing
from sagejax.bench.cli import main
from sagejax.config import PRESETS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """One tiny ``--quick`` run of every subcommand; (out dir, RESULTS.md)."""
  out = tmp_path_factory.mktemp("bench")
  results_md = out / "benchmarks" / "RESULTS.md"
  backends = ["xla", "jax-xla"]
  if methods.INTERPRET in methods.sage_backend_names():
    backends.append(methods.INTERPRET)
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
])
def test_bad_arguments(args, message, capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    main(args + ["--out", str(tmp_path)])
  assert e.value.code == 2
  assert message in capsys.readouterr().err
  assert not (tmp_path / "results.json").exists()


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

"""Reports: JSON, Markdown, PNG plots, and sections of ``RESULTS.md``."""

from __future__ import annotations

import json
import math
import pathlib
import re
import shutil
from typing import Any, Optional

from sagejax.bench import env
from sagejax.bench.accuracy import ANCHORS, ANCHOR_SHAPE, anchor_comparison

SPEED_PNG, ACCURACY_PNG, TRAIN_PNG = "speed.png", "accuracy.png", "train.png"
DECODE_PNG, EXTEND_PNG = "decode.png", "extend.png"


# ----------------------------------------------------------------------------
# Number formatting.
# ----------------------------------------------------------------------------


def _tops(x: Optional[float]) -> str:
  if x is None:
    return "–"
  if x >= 100:
    return f"{x:.0f}"
  return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def _err(x: Optional[float], digits: int = 5) -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "–"
  if x != 0 and abs(x) < 10 ** -(digits - 1):
    return f"{x:.2e}"
  return f"{x:.{digits}f}"


def _cos(x: Optional[float]) -> str:
  return "–" if x is None else f"{x:.6f}"


def _yes(b: bool) -> str:
  return "yes" if b else "no"


def _seq(s: int) -> str:
  return f"{s // 1024}k" if s % 1024 == 0 else str(s)


def _us(x: Optional[float]) -> str:
  if x is None:
    return "–"
  if x >= 100:
    return f"{x:.0f}"
  return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return lines


# ----------------------------------------------------------------------------
# Markdown.
# ----------------------------------------------------------------------------


def _labels(rows: list[dict[str, Any]]) -> list[str]:
  """Method labels in first-seen order (sagejax first, as run)."""
  seen: dict[str, None] = {}
  for r in rows:
    seen.setdefault(r["label"], None)
  return list(seen)


def speed_markdown(rows: list[dict[str, Any]], h: str) -> list[str]:
  return _tops_markdown(
      rows, f"{h} Speed (TOPS)",
      "TOPS = 4·B·N·T·S·H / time (halved when causal), {how}. End to end "
      "(quantization included) unless marked \"(kernel)\" (pre-quantized "
      "inputs).")


def train_markdown(rows: list[dict[str, Any]], h: str) -> list[str]:
  r0 = rows[0] if rows else {}
  return _tops_markdown(
      rows, f"{h} Training step, forward + backward (TFLOPS)",
      f"{r0.get('dtype')} inputs; jax.value_and_grad of sum(out·dO) w.r.t. "
      "q, k, v. TFLOPS = 3.5 × 4·B·N·T·S·H / time (halved when causal), "
      "{how}.")


def _tops_markdown(rows: list[dict[str, Any]], title: str, what: str
                   ) -> list[str]:
  if not rows:
    return []
  r0 = rows[0]
  timing = next((r for r in rows if r["status"] == "ok"), None)
  how = (f"median of {timing['repeats']} repeats of back-to-back calls on "
         "rotating inputs" if timing else "no method ran")
  lines = [title, "",
           f"B={r0['batch']}, N={r0['heads']}, K={r0['kv_heads']}, T=S. "
           + what.format(how=how) + " – = skipped or failed (see notes).",
           ""]
  labels = _labels(rows)
  cells: dict[tuple, dict[str, str]] = {}
  for r in rows:
    key = (r["head_dim"], r["seq"], r["causal"])
    cells.setdefault(key, {})[r["label"]] = _tops(r.get("tops"))
  body = [[str(hd), _seq(s), _yes(c)] + [cells[(hd, s, c)].get(l, "–")
                                         for l in labels]
          for (hd, s, c) in cells]
  return lines + _table(["H", "S", "causal"] + labels, body) + [""]


def accuracy_markdown(rows: list[dict[str, Any]], h: str) -> list[str]:
  if not rows:
    return []
  lines = [f"{h} Accuracy vs exact attention (fp32)", ""]
  shapes = sorted({(r["batch"], r["heads"], r["seq"], r["head_dim"])
                   for r in rows})
  for b, n, s, hd in shapes:
    sub = [r for r in rows if (r["batch"], r["heads"], r["seq"],
                               r["head_dim"]) == (b, n, s, hd)]
    dtypes = sorted({r["dtype"] for r in sub if r.get("family") == "sagejax"
                     and r.get("dtype")})
    lines += [f"B={b}, N={n}, T=S={s}, H={hd}, {'/'.join(dtypes)} inputs; "
              "\"normal\": N(0, 1); \"channel_bias\": k += 8·N(0,1), "
              "v += 4·N(0,1) per (head, channel); \"qkv_channel_bias\": also "
              "q += 2·N(0,1). Rows \"preset / granularity\" change only the "
              "Q/K scale granularity.", ""]
    body = [[r["label"], r["data"], _yes(r["causal"]), _cos(r.get("cos_sim")),
             _err(r.get("rel_l1")), _err(r.get("rmse"))] for r in sub]
    lines += _table(["method", "data", "causal", "cos sim", "relative L1",
                     "RMSE"], body) + [""]
  comparison = anchor_comparison(rows)
  if comparison:
    a = ANCHOR_SHAPE
    lines += [f"{h}# Beside SageAttention (ANCHORS)", "",
              "SageAttention's own numbers from `shared/ANCHORS.md` (one H200,"
              f" B={a.batch}, N={a.heads}, T=S={a.seq}, H={a.head_dim}, fp16 "
              "inputs drawn the same way, different random draws). Each cell: "
              "ours / theirs.", ""]
    if not all(c["same_shape"] for c in comparison):
      lines += ["**Not like for like**: this run's shape differs from the "
                "ANCHORS setting; run `sagejax-bench accuracy --seq 4096 "
                "--head-dim 128 --batch 2 --heads 8` to compare.", ""]
    body = [[c["ours"], c["anchor"], c["data"], _yes(c["causal"]),
             f"{_cos(c['cos_sim'])} / {_cos(c['anchor_cos_sim'])}",
             f"{_err(c['rel_l1'])} / {_err(c['anchor_rel_l1'])}",
             f"{_err(c['rmse'])} / {_err(c['anchor_rmse'])}"]
            for c in comparison]
    lines += _table(["ours", "SageAttention", "data", "causal", "cos sim",
                     "relative L1", "RMSE"], body) + [""]
  return lines


def memory_markdown(rows: list[dict[str, Any]], h: str) -> list[str]:
  if not rows:
    return []
  r0 = rows[0]
  lines = [f"{h} Memory at S={_seq(r0['seq'])}", "",
           f"B={r0['batch']}, N={r0['heads']}, H={r0['head_dim']}, not "
           "causal. Planned = XLA's compiled memory analysis (arguments + "
           "outputs + temporaries − aliases); measured = rise of the "
           "device's peak_bytes_in_use during one call (GPU only).", ""]
  body = [[r["label"], env.fmt_bytes(r.get("argument_bytes")),
           env.fmt_bytes(r.get("output_bytes")),
           env.fmt_bytes(r.get("temp_bytes")),
           env.fmt_bytes(r.get("total_bytes")),
           env.fmt_bytes(r.get("measured_peak_bytes"))] for r in rows]
  return lines + _table(["method", "arguments", "outputs", "temporaries",
                         "planned total", "measured peak"], body) + [""]


def _serving_shapes(rows: list[dict[str, Any]]) -> list[tuple[int, ...]]:
  """(tokens, B, prefix, chunk) of the rows' shapes, in run order."""
  return list(dict.fromkeys((r["tokens"], r["batch"], r["prefix"], r["chunk"])
                            for r in rows))


def _vs_cudnn(sub: list[dict[str, Any]]) -> Optional[str]:
  """cuDNN's time over the fastest sagejax INT8/FP8 row's, with its backend;
  None unless both ran."""
  ok = [r for r in sub if r["status"] == "ok"]
  cudnn = next((r for r in ok if r["method"] == "cudnn"), None)
  sage = [r for r in ok if r["family"] == "sagejax"
          and r["pages"] == "int8/fp8"]
  if cudnn is None or not sage:
    return None
  best = min(sage, key=lambda r: r["time_ms"])
  return f"{cudnn['time_ms'] / best['time_ms']:.2f}× ({best['backend']})"


def _serving_markdown(rows: list[dict[str, Any]], title: str, what: str,
                      first: list[str], first_cells, cell) -> list[str]:
  """A table: one line per shape, one column per method (``cell(row)``),
  and a "× cuDNN" column when cuDNN ran."""
  if not rows:
    return []
  r0 = rows[0]
  timing = next((r for r in rows if r["status"] == "ok"), None)
  how = (f"median of {timing['repeats']} repeats of back-to-back calls on "
         "rotating inputs (a fresh q, copies of the caches)" if timing
         else "no method ran")
  lines = [title, "",
           what.format(how=how, N=r0["heads"], K=r0["kv_heads"],
                       H=r0["head_dim"], ps=r0["page_size"])
           + " – = skipped or failed (see notes).", ""]
  labels = _labels(rows)
  ratio = any(r["method"] == "cudnn" and r["status"] == "ok" for r in rows)
  body = []
  for key in _serving_shapes(rows):
    sub = [r for r in rows
           if (r["tokens"], r["batch"], r["prefix"], r["chunk"]) == key]
    cells = {r["label"]: cell(r) if r["status"] == "ok" else "–"
             for r in sub}
    line = first_cells(sub[0]) + [cells.get(l, "–") for l in labels]
    if ratio:
      line.append(_vs_cudnn(sub) or "–")
    body.append(line)
  header = first + labels + (["× cuDNN"] if ratio else [])
  return lines + _table(header, body) + [""]


def decode_markdown(rows: list[dict[str, Any]], h: str) -> list[str]:
  return _serving_markdown(
      rows, f"{h} Decode over a paged KV cache (µs, cache TB/s)",
      "One bf16 query token per sequence (q [B, N, H]) against all its cached "
      "tokens; N={N}, K={K}, H={H}, pages of {ps} in a shuffled page table. "
      "Cell: time (cache bytes read per second: the cached tokens' K and V "
      "pages and scales, INT8 K + FP8 V + two f32 scales per token and head "
      "on INT8/FP8 pages, bf16 K and V otherwise), {how}. sagejax: "
      "`sagejax.serving.decode_attention` on INT8/FP8 and on bf16 pages "
      "(config=None, default tiling); jax.nn xla and cuDNN: "
      "`jax.nn.dot_product_attention` on a dense contiguous bf16 cache "
      "[B, S, K, H] (one query token: nothing to mask); JAX paged: "
      "`jax.experimental.pallas.ops.gpu.paged_attention` on the bf16 pages "
      "(k_splits=16). × cuDNN: cuDNN's time over the fastest sagejax "
      "INT8/FP8 row's.",
      ["B", "cached tokens"], lambda r: [str(r["batch"]), _seq(r["tokens"])],
      lambda r: f"{_us(r['time_us'])} µs ({_tops(r['tb_s'])} TB/s)")


def extend_markdown(rows: list[dict[str, Any]], h: str) -> list[str]:
  return _serving_markdown(
      rows, f"{h} Extend over a paged KV cache (TOPS)",
      "A chunk of T new bf16 query tokens per sequence (q [B, T, N, H]) "
      "against its P cached prefix tokens and itself, causal with the "
      "diagonal at the bottom right; N={N}, K={K}, H={H}, pages of {ps} in "
      "a shuffled page table. Cell: TOPS (time), TOPS = 4·B·N·H·(T·P + "
      "T·(T+1)/2) / time, the causal work, for every method; {how}. sagejax: "
      "`sagejax.serving.extend_attention` on INT8/FP8 and on bf16 pages "
      "(config=None, default tiling). jax.nn xla and cuDNN: "
      "`jax.nn.dot_product_attention` on a dense contiguous bf16 cache, "
      "**not causal** (all P+T keys for every query: jax.nn's cuDNN path has "
      "no bottom-right causal mask), so they compute more than the work "
      "counted. × cuDNN: cuDNN's time over the fastest sagejax INT8/FP8 "
      "row's.",
      ["B", "chunk T", "prefix P"],
      lambda r: [str(r["batch"]), _seq(r["chunk"]), _seq(r["prefix"])],
      lambda r: f"{_tops(r['tops'])} TOPS ({_us(r['time_us'])} µs)")


def row_notes(results: dict[str, list[dict[str, Any]]]) -> list[str]:
  """One note per (section, method, message) for rows that did not run."""
  counts: dict[tuple, int] = {}
  for section, rows in results.items():
    for r in rows:
      if r.get("note") and r.get("status") != "ok":
        key = (section, r["label"], r["note"])
        counts[key] = counts.get(key, 0) + 1
  return [f"{sec}: {label}: {note}" + (f" ({n} cases)" if n > 1 else "")
          for (sec, label, note), n in counts.items()]


def markdown(report: dict[str, Any], plots: dict[str, str], level: int = 1
             ) -> str:
  """The whole report; ``plots`` maps a PNG kind to its link."""
  h = "#" * (level + 1)
  m = report["meta"]
  run = report["settings"]
  kind = m["platform"].upper() + (" quick" if run["quick"] else "")
  lines = [f"{'#' * level} {kind} run ({', '.join(run['commands'])}) on "
           f"{m['device']}", "",
           f"- Device: {m['device']} ({m['platform']}, "
           f"{m['device_count']} device(s))",
           f"- JAX {m['jax_version']} (jaxlib {m['jaxlib_version']}), sagejax "
           f"{m['sagejax_version']}, Python {m['python']}",
           f"- Date: {m['date']}",
           f"- Command: `{m['command']}`", ""]
  res = report["results"]
  lines += speed_markdown(res.get("speed", []), h)
  if SPEED_PNG in plots:
    lines += [f"![TOPS vs sequence length]({plots[SPEED_PNG]})", ""]
  lines += accuracy_markdown(res.get("accuracy", []), h)
  if ACCURACY_PNG in plots:
    lines += [f"![Error per preset]({plots[ACCURACY_PNG]})", ""]
  lines += memory_markdown(res.get("memory", []), h)
  lines += train_markdown(res.get("train", []), h)
  if TRAIN_PNG in plots:
    lines += [f"![Training-step TFLOPS vs sequence length]"
              f"({plots[TRAIN_PNG]})", ""]
  lines += decode_markdown(res.get("decode", []), h)
  if DECODE_PNG in plots:
    lines += [f"![Decode cache TB/s vs cached tokens]({plots[DECODE_PNG]})",
              ""]
  lines += extend_markdown(res.get("extend", []), h)
  if EXTEND_PNG in plots:
    lines += [f"![Extend TOPS vs prefix length]({plots[EXTEND_PNG]})", ""]
  if report["notes"]:
    lines += [f"{h} Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
  return "\n".join(lines)


# ----------------------------------------------------------------------------
# Plots.
# ----------------------------------------------------------------------------


def _pyplot():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def plot_train(rows: list[dict[str, Any]], path: pathlib.Path) -> bool:
  """Training-step TFLOPS vs S per method (see :func:`plot_speed`)."""
  return plot_speed(rows, path, "Training step (fwd+bwd) throughput",
                    "TFLOPS (3.5 × forward)", "")


def plot_speed(rows: list[dict[str, Any]], path: pathlib.Path,
               title: str = "Attention throughput", ylabel: str = "TOPS",
               legend_note: str = " (dashed: kernel only)") -> bool:
  """TOPS vs S per method; one panel per (H, causal). False if no data."""
  ok = [r for r in rows if r["status"] == "ok"]
  if not ok:
    return False
  plt = _pyplot()
  hds = sorted({r["head_dim"] for r in rows})
  causals = sorted({r["causal"] for r in rows})
  labels = _labels(rows)
  colors = plt.get_cmap("tab10")
  fig, axes = plt.subplots(len(hds), len(causals), squeeze=False,
                           figsize=(5.2 * len(causals), 3.6 * len(hds) + 0.8),
                           sharex=True)
  r0 = rows[0]
  for i, hd in enumerate(hds):
    for j, causal in enumerate(causals):
      ax = axes[i][j]
      for k, label in enumerate(labels):
        pts = sorted((r["seq"], r["tops"]) for r in ok if r["label"] == label
                     and r["head_dim"] == hd and r["causal"] == causal)
        if not pts:
          continue
        kernel = "(kernel)" in label
        base = label.replace(" (kernel)", "")
        color = colors(labels.index(base) % 10 if base in labels else k % 10)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label,
                color=color, linestyle="--" if kernel else "-",
                marker="o" if not kernel else "s", markersize=4)
      ax.set_xscale("log", base=2)
      seqs = sorted({r["seq"] for r in rows})
      ax.set_xticks(seqs)
      ax.set_xticklabels([_seq(s) for s in seqs])
      ax.set_title(f"H={hd}, {'causal' if causal else 'not causal'}")
      ax.set_xlabel("sequence length S (= T)")
      ax.set_ylabel(ylabel)
      ax.set_ylim(bottom=0)
      ax.grid(alpha=0.3)
  handles, names = axes[0][0].get_legend_handles_labels()
  for ax in axes.flat:
    for hdl, name in zip(*ax.get_legend_handles_labels()):
      if name not in names:
        handles.append(hdl)
        names.append(name)
  fig.legend(handles, names, loc="lower center", ncol=min(3, len(names)),
             frameon=False, fontsize=9)
  fig.suptitle(f"{title}, B={r0['batch']} N={r0['heads']}{legend_note}",
               fontsize=11)
  rows_of_legend = math.ceil(len(names) / 3)
  fig.tight_layout(rect=(0, 0.05 + 0.035 * rows_of_legend, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def _plot_serving(rows: list[dict[str, Any]], path: pathlib.Path,
                  metric: str, ylabel: str, title: str, xlabel: str,
                  xtick) -> bool:
  """``metric`` per method over the shapes (in run order, one tick each,
  ``xtick(row)``); dashed: bf16 pages. False if no data."""
  ok = [r for r in rows if r["status"] == "ok" and r.get(metric)]
  if not ok:
    return False
  plt = _pyplot()
  keys = _serving_shapes(rows)
  ticks = {}
  for r in rows:
    ticks.setdefault((r["tokens"], r["batch"], r["prefix"], r["chunk"]),
                     xtick(r))
  labels = _labels(rows)
  # One color per sagejax backend (both its page kinds) or baseline.
  groups = list(dict.fromkeys(r["backend"] or r["label"] for r in rows))
  colors = plt.get_cmap("tab10")
  fig, ax = plt.subplots(figsize=(7.0, 4.8))
  for label in labels:
    mine = [r for r in ok if r["label"] == label]
    if not mine:
      continue
    pts = sorted((keys.index((r["tokens"], r["batch"], r["prefix"],
                              r["chunk"])), r[metric]) for r in mine)
    bf16 = mine[0]["family"] == "sagejax" and mine[0]["pages"] == "bf16"
    color = colors(groups.index(mine[0]["backend"] or label) % 10)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label,
            color=color, linestyle="--" if bf16 else "-",
            marker="s" if bf16 else "o", markersize=4)
  ax.set_xticks(range(len(keys)))
  ax.set_xticklabels([ticks[key] for key in keys])
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_ylim(bottom=0)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, frameon=False)
  r0 = rows[0]
  ax.set_title(f"{title}, N={r0['heads']} K={r0['kv_heads']} "
               f"H={r0['head_dim']}, pages of {r0['page_size']} (dashed: "
               "sagejax on bf16 pages)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def plot_decode(rows: list[dict[str, Any]], path: pathlib.Path) -> bool:
  """Decode: cache TB/s per method vs (cached tokens, B)."""
  return _plot_serving(rows, path, "tb_s", "cache TB/s (bytes read / time)",
                       "Decode", "cached tokens per sequence (batch B)",
                       lambda r: f"{_seq(r['tokens'])}\nB={r['batch']}")


def plot_extend(rows: list[dict[str, Any]], path: pathlib.Path) -> bool:
  """Extend: TOPS (causal work) per method vs the cached prefix."""
  r0 = rows[0] if rows else {}
  return _plot_serving(rows, path, "tops", "TOPS (causal work)", "Extend",
                       f"cached prefix P (chunk T={r0.get('chunk')}, "
                       f"B={r0.get('batch')})",
                       lambda r: _seq(r["prefix"]))


def _anchor_points(rows, labels, data, causal, metric
                   ) -> list[tuple[int, float]]:
  """(x, value) of SageAttention's own figure for rows that have one."""
  index = {"rel_l1": 1, "rmse": 2}[metric]
  points = []
  for x, label in enumerate(labels):
    row = next((r for r in rows if r["label"] == label), None)
    if row is None or not row.get("default_granularity"):
      continue
    name = row.get("preset") or ("fp16" if row.get("dtype") == "fp16"
                                 else None)
    anchor = ANCHORS.get((name, data, causal))
    if anchor is not None:
      points.append((x, anchor[index]))
  return points


def plot_accuracy(rows: list[dict[str, Any]], path: pathlib.Path) -> bool:
  """Relative L1 and RMSE per method and data kind, not causal, log scale."""
  ok = [r for r in rows if r["status"] == "ok"]
  if not ok:
    return False
  causal = min(r["causal"] for r in ok)
  first = min((r["batch"], r["heads"], r["seq"], r["head_dim"]) for r in ok)
  ok = [r for r in ok if r["causal"] == causal and (
      r["batch"], r["heads"], r["seq"], r["head_dim"]) == first]
  plt = _pyplot()
  labels = _labels(ok)
  datas = list(dict.fromkeys(r["data"] for r in ok))
  colors = plt.get_cmap("tab10")
  width = 0.8 / len(datas)
  fig, axes = plt.subplots(2, 1, figsize=(max(7.0, 0.55 * len(labels) + 2),
                                          7.5), sharex=True)
  for ax, metric, name in zip(axes, ("rel_l1", "rmse"),
                              ("relative L1", "RMSE")):
    anchor_labelled = False
    for d, data in enumerate(datas):
      xs, ys = [], []
      for x, label in enumerate(labels):
        v = [r[metric] for r in ok if r["label"] == label and r["data"] == data]
        if v and v[0] > 0 and math.isfinite(v[0]):
          xs.append(x + (d - (len(datas) - 1) / 2) * width)
          ys.append(v[0])
      ax.bar(xs, ys, width=width, label=data, color=colors(d))
      ax_anchor = _anchor_points(ok, labels, data, causal, metric)
      if ax_anchor:
        ax.plot([x + (d - (len(datas) - 1) / 2) * width
                 for x, _ in ax_anchor], [y for _, y in ax_anchor],
                linestyle="none", marker="_", markersize=14,
                markeredgewidth=2.5, color="black",
                label="SageAttention (ANCHORS)" if not anchor_labelled
                else None)
        anchor_labelled = True
    ax.set_yscale("log")
    ax.set_ylabel(f"{name} vs exact")
    ax.grid(axis="y", alpha=0.3)
  axes[0].legend(title="data", fontsize=8, title_fontsize=8)
  axes[1].set_xticks(range(len(labels)))
  axes[1].set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
  b, n, s, hd = first
  fig.suptitle(f"Error per preset, B={b} N={n} T=S={s} H={hd}, "
               f"{'causal' if causal else 'not causal'} (lower is better; "
               "black: SageAttention's own, ANCHORS)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def write_plots(report: dict[str, Any], out: pathlib.Path,
                notes: list[str]) -> dict[str, pathlib.Path]:
  """PNG plots into ``out``; a note (not a crash) if matplotlib is missing."""
  try:
    _pyplot()
  except ImportError:
    notes.append("matplotlib is not installed (pip install matplotlib); no "
                 "plots.")
    return {}
  made = {}
  res = report["results"]
  for name, fn, rows in ((SPEED_PNG, plot_speed, res.get("speed", [])),
                         (ACCURACY_PNG, plot_accuracy,
                          res.get("accuracy", [])),
                         (TRAIN_PNG, plot_train, res.get("train", [])),
                         (DECODE_PNG, plot_decode, res.get("decode", [])),
                         (EXTEND_PNG, plot_extend, res.get("extend", []))):
    if rows and fn(rows, out / name):
      made[name] = out / name
  return made


# ----------------------------------------------------------------------------
# Files.
# ----------------------------------------------------------------------------


def write_json(report: dict[str, Any], path: pathlib.Path) -> None:
  def clean(x):
    if isinstance(x, float) and not math.isfinite(x):
      return None
    if isinstance(x, dict):
      return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [clean(v) for v in x]
    return x
  path.write_text(json.dumps(clean(report), indent=1) + "\n")


_RESULTS_HEAD = """# Benchmark results

Written by `sagejax-bench --write-results benchmarks/RESULTS.md`. Each section
is the report of one run, with its device, JAX version, date and command at
the top, and is replaced when that kind of run (platform and command) is
repeated. Compare numbers only within one section. CPU sections check that
everything runs and measure accuracy; their timings say nothing about GPU
speed. A GPU section comes from running the same command on the GPU machine.
"""
_SECTION = "<!-- sagejax-bench section "


def update_results(path: pathlib.Path, section: str, report: dict[str, Any],
                   plots: dict[str, pathlib.Path]) -> None:
  """Writes this run as section ``section`` of a RESULTS.md file.

  Plots are copied to ``plots/<section>-<name>.png`` beside the file. Other
  sections are kept; this one is replaced (or appended).
  """
  path.parent.mkdir(parents=True, exist_ok=True)
  plot_dir = path.parent / "plots"
  links = {}
  for name, src in plots.items():
    plot_dir.mkdir(exist_ok=True)
    dest = plot_dir / f"{section}-{name}"
    shutil.copyfile(src, dest)
    links[name] = f"plots/{dest.name}"
  begin = f"{_SECTION}{section} -->"
  end = f"<!-- end of section {section} -->"
  body = f"{begin}\n{markdown(report, links, level=2)}\n{end}\n"
  text = path.read_text() if path.exists() else ""
  first = text.find(_SECTION)
  text = _RESULTS_HEAD + ("\n" + text[first:] if first >= 0 else "")
  pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?",
                       re.S)
  if pattern.search(text):
    text = pattern.sub(lambda _: body, text)
  else:
    text = text.rstrip("\n") + "\n\n" + body
  path.write_text(text)

"""What one benchmark run measures: shapes, methods and timing, resolved.

Defaults depend on ``--quick`` and on the platform: on a GPU the full sweep
(B=4, N=32, H ∈ {64, 128}, S = 1k…16k; training steps at the ANCHORS training
setting B=2, N=32, bf16); ``--quick`` (and a CPU without shape flags) uses
tiny shapes. Accuracy defaults to the ANCHORS setting (B=2, N=8, T=S=4096,
H=128, fp16). Serving (decode, extend) defaults to GQA N=32, K=8, H=128,
pages of 16: decode at (B, cached tokens) = (32, 4k), (32, 16k), (8, 32k);
extend a 4096-token chunk on prefixes of 8k, 16k and 32k tokens, B=2.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import TYPE_CHECKING, Any, Optional

from sagejax.bench.methods import Shape
from sagejax.bench.timing import TimingConfig

if TYPE_CHECKING:
  from sagejax.bench.serving import ServingShape

COMMANDS = ("speed", "accuracy", "memory", "train")
# Serving modes: run only when named (not part of "all").
SERVING_COMMANDS = ("decode", "extend")

SPEED_FULL = {"batch": 4, "heads": 32, "head_dims": (64, 128),
              "seqs": (1024, 2048, 4096, 8192, 16384)}
SPEED_QUICK = {"batch": 1, "heads": 2, "head_dims": (64,),
               "seqs": (256, 512)}
# The ANCHORS training-step setting (shared/ANCHORS.md).
TRAIN_FULL = {"batch": 2, "heads": 32, "head_dims": (64, 128),
              "seqs": (1024, 4096, 8192, 16384)}
TRAIN_QUICK = {"batch": 1, "heads": 2, "head_dims": (64,), "seqs": (256,)}
# The ANCHORS accuracy setting (shared/ANCHORS.md).
ACCURACY_FULL = {"batch": 2, "heads": 8, "head_dims": (128,), "seqs": (4096,)}
ACCURACY_QUICK = {"batch": 1, "heads": 2, "head_dims": (64,), "seqs": (256,)}
# --quick leaves out "qkv_channel_bias" (pass --data to add it).
DATA_QUICK = ("normal", "channel_bias")
MEMORY_SEQ_FULL = 16384
MEMORY_SEQ_QUICK = 1024
# Serving: (B, cached tokens) pairs for decode; B, chunk and prefixes for
# extend; GQA heads, head dim and page size for both.
DECODE_FULL = {"batch_tokens": ((32, 4096), (32, 16384), (8, 32768)),
               "heads": 32, "kv_heads": 8, "head_dim": 128, "page_size": 16}
DECODE_QUICK = {"batch_tokens": ((2, 256), (2, 1000)), "heads": 4,
                "kv_heads": 2, "head_dim": 64, "page_size": 16}
EXTEND_FULL = {"batch": 2, "chunk": 4096, "prefixes": (8192, 16384, 32768),
               "heads": 32, "kv_heads": 8, "head_dim": 128, "page_size": 16}
EXTEND_QUICK = {"batch": 1, "chunk": 64, "prefixes": (128,), "heads": 4,
                "kv_heads": 2, "head_dim": 64, "page_size": 16}

TIMING_GPU = TimingConfig(repeats=5, target_s=0.1, min_calls=10,
                          max_calls=200)
TIMING_QUICK = TimingConfig(repeats=3, target_s=0.02, min_calls=2,
                            max_calls=50, max_sets=4,
                            sync_each_output=True)


@dataclasses.dataclass
class Settings:
  """A resolved run (see ``sagejax-bench --help`` for the meaning)."""
  commands: tuple[str, ...]
  quick: bool
  out: pathlib.Path
  backends: list[str]
  baselines: list[str]
  speed_presets: list[str]
  accuracy_presets: list[str]
  granularities: list[str]
  data_kinds: list[str]
  dtype: Any
  causal: list[bool]
  speed_shapes: list[Shape]
  accuracy_shapes: list[Shape]
  memory_shape: Shape
  timing: TimingConfig
  train_shapes: list[Shape] = dataclasses.field(default_factory=list)
  decode_shapes: list[ServingShape] = dataclasses.field(default_factory=list)
  extend_shapes: list[ServingShape] = dataclasses.field(default_factory=list)
  train_dtype: Any = None
  kernel_only: bool = True
  plots: bool = True
  progress: bool = True
  write_results: Optional[pathlib.Path] = None
  section: Optional[str] = None
  seed: int = 0
  memory_limit: Optional[int] = None
  chain: int = 1

  def as_json(self) -> dict[str, Any]:
    """The settings as plain data for the JSON report."""
    def shapes(xs):
      return sorted({(s.batch, s.heads, s.kv_heads, s.seq, s.head_dim)
                     for s in xs})
    return {
        "commands": list(self.commands), "quick": self.quick,
        "backends": self.backends, "baselines": self.baselines,
        "speed_presets": self.speed_presets,
        "accuracy_presets": self.accuracy_presets,
        "granularities": self.granularities, "data": self.data_kinds,
        "dtype": str(self.dtype.__name__ if hasattr(self.dtype, "__name__")
                     else self.dtype),
        "causal": self.causal,
        "speed_shapes_BNKSH": shapes(self.speed_shapes),
        "accuracy_shapes_BNKSH": shapes(self.accuracy_shapes),
        "memory_shape_BNKSH": shapes([self.memory_shape])[0],
        "train_shapes_BNKSH": shapes(self.train_shapes),
        "train_dtype": (None if self.train_dtype is None else
                        getattr(self.train_dtype, "__name__",
                                str(self.train_dtype))),
        "decode_shapes": [dataclasses.asdict(s) for s in self.decode_shapes],
        "extend_shapes": [dataclasses.asdict(s) for s in self.extend_shapes],
        "timing": dataclasses.asdict(self.timing),
        "seed": self.seed,
        "decode_chain": self.chain,
    }


def grid(batch: int, heads: int, kv_heads: Optional[int], seqs, head_dims,
         causal: list[bool]) -> list[Shape]:
  """Every (H, S, causal) at one batch and head count, H outermost."""
  kv = kv_heads or heads
  return [Shape(batch, heads, kv, s, h, c)
          for h in head_dims for s in seqs for c in causal]

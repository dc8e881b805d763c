"""Running a list of benchmark tasks under a progress bar."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable, Iterable


@dataclasses.dataclass
class Task:
  """One unit of work; ``run()`` returns result rows for ``section``."""
  section: str
  desc: str
  run: Callable[[], list[dict[str, Any]]]


def _bar(tasks: list[Task], enabled: bool) -> Iterable[Task]:
  if not enabled:
    yield from tasks
    return
  try:
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  except ImportError:
    for i, task in enumerate(tasks):
      print(f"[{i + 1}/{len(tasks)}] {task.desc}", file=sys.stderr, flush=True)
      yield task
    return
  bar = tqdm(tasks, unit="task", dynamic_ncols=True, file=sys.stderr,
             disable=None)
  for task in bar:
    bar.set_description(task.desc[:60])
    yield task
  bar.close()


def run_tasks(tasks: list[Task], progress: bool = True
              ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, float]]:
  """Runs the tasks in order: (rows by section, seconds by section)."""
  rows: dict[str, list[dict[str, Any]]] = {}
  seconds: dict[str, float] = {}
  for task in _bar(tasks, progress):
    start = time.perf_counter()
    rows.setdefault(task.section, []).extend(task.run())
    seconds[task.section] = (seconds.get(task.section, 0.0)
                             + time.perf_counter() - start)
  return rows, {k: round(v, 1) for k, v in seconds.items()}

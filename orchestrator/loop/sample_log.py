"""Completions a user can read: every ``metrics.samples_every`` steps, and the segment's first and last steps
whatever the cadence, a few of the step's rollouts to ``samples.jsonl`` in the directory the segment writes,
and to the dashboards' text tab (the run's closing lines quote the last one written: the last step's).

Each line is one completion the step trained on (``LiveSource.step_samples``):
its step, the weights version that sampled it, the prompt and completion as
text, its reward and advantage, whether the task's own check passed, and
whether it was cut at the length limit (null for a fixed-length answer). A
``SampleLog`` is one more of the program's ``on_step`` callables: it runs
after the step's record is finished (in the pipelined modes, while the next
step computes).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The file, inside the directory a segment writes.
SAMPLES_FILE = "samples.jsonl"
#: Completions written per sampled step.
SAMPLES_PER_STEP = 4


class SampleLog:
  """Writes ``SAMPLES_PER_STEP`` completions of every ``every``-th step (steps 0, every, 2·every, …), of the
  segment's first step and of its last (``last_step``, or, a run that stopped early, the step ``finish``
  names).

  Args:
    path: the JSON-lines file (appended to; the segment's directory is its own).
    source: the live source (``step_samples``).
    every: steps between two writes (> 0).
    first_step, last_step: the segment's first step and the run's last.
    text: ``(step, tag, text)``, the dashboards' text tab (``MetricsLog.write_text``), or None.
  """

  def __init__(self, path: Path, source, every: int, *, first_step: int = 0, last_step: int | None = None,
               text: Callable[[int, str, str], None] | None = None):
    self.path, self._source, self._every, self._text = Path(path), source, every, text
    self._first, self._last = first_step, last_step
    self._written: int | None = None  # the last step written

  def __call__(self, record) -> None:
    if record.step % self._every and record.step not in (self._first, self._last):
      return
    self._write(record.step)

  def finish(self, last_step: int | None) -> None:
    """The run ended after ``last_step`` (a stop may end it early): its samples close the file."""
    if last_step is not None and self._written != last_step:
      self._write(last_step)

  def _write(self, step: int) -> None:
    samples = self._source.step_samples(step, SAMPLES_PER_STEP)
    self._written = step
    if not samples:
      return
    with self.path.open("a", encoding="utf-8") as f:
      for sample in samples:
        f.write(json.dumps(sample, ensure_ascii=False) + "\n")
    if self._text is not None:
      self._text(step, "samples", "\n\n".join(describe(s) for s in samples))


def describe(sample: dict[str, Any]) -> str:
  """One sample in a line: its step, reward and advantage, the prompt and the completion (quoted)."""
  cut = " (cut at the length limit)" if sample.get("truncated") else ""
  return (f"step {sample['step']}, reward {sample['reward']:.3f}, advantage {sample['advantage']:+.3f}:"
          f" {json.dumps(sample['prompt'], ensure_ascii=False)} → {json.dumps(sample['completion'], ensure_ascii=False)}"
          f"{cut}")


def last_sample(directory: Path) -> dict[str, Any] | None:
  """The last sample written in ``directory`` (its ``SAMPLES_FILE``), or None."""
  path = Path(directory) / SAMPLES_FILE
  if not path.is_file():
    return None
  lines = path.read_text(encoding="utf-8").splitlines()
  return json.loads(lines[-1]) if lines else None

"""Step sources: iterators of per-step payloads whose position can be saved and restored.

A run pulls one step (``micro_batches_per_step`` payloads) at a time. Before
each pull the program asks the source for ``get_state()``; a checkpoint keeps
the state before the first step it does not cover, and a resumed run hands it
to ``set_state`` so that it trains on exactly the steps an uninterrupted run
would have. States are JSON-able dicts that name their kind.
"""

from __future__ import annotations

from typing import Any

from orchestrator.data.recording import Recording, RecordingError
from orchestrator.data.synthetic import SyntheticRollouts


class SourceStateError(ValueError):
  """A saved source state that does not belong to this source."""


class SyntheticSteps:
  """``SyntheticRollouts`` one step at a time; its position is the next step's index."""

  kind = "synthetic"

  def __init__(self, rollouts: SyntheticRollouts, micro_batches_per_step: int):
    self._rollouts = rollouts
    self._m = micro_batches_per_step
    self._next = 0

  def __iter__(self) -> "SyntheticSteps":
    return self

  def __next__(self) -> list:
    step = self._rollouts.step(self._next, self._m)
    self._next += 1
    return step

  def get_state(self) -> dict[str, Any]:
    return {"kind": self.kind, "next_step": self._next}

  def set_state(self, state: dict[str, Any]) -> None:
    _check_kind(state, self.kind)
    self._next = int(state["next_step"])


class ReplaySteps:
  """A recording replayed through its grain pipeline; its position is the grain iterator's state."""

  kind = "replay"

  def __init__(self, recording: Recording, *, rows: int, tokens_per_row: int, micro_batches_per_step: int):
    from orchestrator.data.replay import replay_pipeline  # grain (and so JAX) is imported on use

    self._pipeline = replay_pipeline(recording, rows=rows, tokens_per_row=tokens_per_row,
                                     micro_batches_per_step=micro_batches_per_step)
    self._iterator = iter(self._pipeline)
    self._recording = recording

  def __iter__(self) -> "ReplaySteps":
    return self

  def __next__(self) -> list:
    return next(self._iterator)

  def get_state(self) -> dict[str, Any]:
    return {"kind": self.kind, "grain": self._iterator.get_state()}

  def set_state(self, state: dict[str, Any]) -> None:
    _check_kind(state, self.kind)
    self._iterator.set_state(state["grain"])

  def count_steps(self, limit: int) -> int:
    """How many whole steps the recording holds, up to ``limit`` (a separate pass; position unchanged)."""
    n = 0
    for _ in self._pipeline:
      n += 1
      if n >= limit:
        break
    return n

  def require_steps(self, steps: int) -> None:
    """Raises RecordingError when the recording holds fewer than ``steps`` steps."""
    available = self.count_steps(steps)
    if available < steps:
      raise RecordingError(
          f"{self._recording.data_path}: its {self._recording.manifest['num_trajectories']} trajectories make"
          f" only {available} steps of this batch shape; {steps} were asked for — record more groups or run"
          " fewer steps")


def _check_kind(state: Any, kind: str) -> None:
  if not isinstance(state, dict) or state.get("kind") != kind:
    got = state.get("kind") if isinstance(state, dict) else type(state).__name__
    raise SourceStateError(f"a saved rollout position of kind {got!r} cannot restore a {kind!r} source")

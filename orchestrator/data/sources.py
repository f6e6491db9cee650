"""Step sources (``orchestrator.contract.StepSource``) for synthetic and recorded rollouts.

A run pulls one step (``micro_batches_per_step`` payloads) at a time. Before
each pull the program asks the source for ``get_state()``; a checkpoint keeps
the state before the first step it does not cover, and a resumed run hands it
to ``set_state`` so that it trains on exactly the steps an uninterrupted run
would have. States are JSON-able dicts that name their kind.

``IterableSteps`` gives any iterable of steps (a list, a generator) the same
surface, with no position to save.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from orchestrator.contract import SourceStateError, StepSource
from orchestrator.contract.source import missing_step_source_methods
from orchestrator.data.recording import Recording, RecordingError
from orchestrator.data.synthetic import SyntheticRollouts

__all__ = ["IterableSteps", "ReplaySteps", "SourceStateError", "SyntheticSteps", "as_step_source"]


class _Positioned:
  """What the synthetic and replayed sources share: a state that is JSON already, nothing to stop."""

  def __iter__(self):
    return self

  def state_json(self, state: dict[str, Any]) -> dict[str, Any]:
    return state

  def close(self) -> None:
    pass


class IterableSteps(_Positioned):
  """Any iterable of steps as a ``StepSource``: no position to save (a checkpoint keeps None), none to restore."""

  kind = "iterable"

  def __init__(self, steps: Iterable[Sequence[Any]]):
    self._steps = steps
    self._iterator: Iterator[Sequence[Any]] = iter(steps)

  def __next__(self) -> Sequence[Any]:
    return next(self._iterator)

  def get_state(self) -> None:
    return None

  def state_json(self, state: None) -> None:
    return None

  def set_state(self, state: Any) -> None:
    raise SourceStateError(f"a plain iterable of steps has no position to restore (got {state!r}); use a"
                           " source with a position (orchestrator.data.sources) to resume")

  def count_steps(self, limit: int) -> int:
    """The steps a sized iterable holds, up to ``limit``; ``limit`` for one whose length is unknown."""
    return min(limit, len(self._steps)) if isinstance(self._steps, Sequence) else limit


def as_step_source(source: Any) -> StepSource:
  """``source`` itself when it is a ``StepSource``; an iterable of steps with no position in ``IterableSteps``.

  Raises:
    TypeError: ``source`` has a position (``get_state``, ``set_state`` or ``state_json``) but lacks part of
      the ``StepSource`` contract (named): wrapping it would lose that position.
  """
  missing = missing_step_source_methods(source)
  if missing is None:
    return IterableSteps(source)
  if missing:
    raise TypeError(f"{type(source).__name__} is part step source: it lacks {', '.join(missing)}"
                    " (orchestrator.contract.StepSource)")
  return source


class SyntheticSteps(_Positioned):
  """``SyntheticRollouts`` one step at a time; its position is the next step's index."""

  kind = "synthetic"

  def __init__(self, rollouts: SyntheticRollouts, micro_batches_per_step: int):
    self._rollouts = rollouts
    self._m = micro_batches_per_step
    self._next = 0

  def __next__(self) -> list:
    step = self._rollouts.step(self._next, self._m)
    self._next += 1
    return step

  def get_state(self) -> dict[str, Any]:
    return {"kind": self.kind, "next_step": self._next}

  def set_state(self, state: dict[str, Any]) -> None:
    _check_kind(state, self.kind)
    self._next = int(state["next_step"])

  def count_steps(self, limit: int) -> int:
    """Synthetic steps never run out: ``limit``."""
    return limit

  def positions_at(self, steps: Iterable[int]) -> dict[int, dict[str, Any]]:
    """The position before each of ``steps``, as ``get_state`` gives it there (to check a saved one)."""
    return {step: {"kind": self.kind, "next_step": step} for step in steps}


class ReplaySteps(_Positioned):
  """A recording replayed through its grain pipeline; its position is the grain iterator's state."""

  kind = "replay"

  def __init__(self, recording: Recording, *, rows: int, tokens_per_row: int, micro_batches_per_step: int):
    from orchestrator.data.replay import replay_pipeline  # import here: grain imports JAX; the loop needs none

    self._pipeline = replay_pipeline(recording, rows=rows, tokens_per_row=tokens_per_row,
                                     micro_batches_per_step=micro_batches_per_step)
    self._iterator = iter(self._pipeline)
    self._recording = recording

  def __next__(self) -> list:
    return next(self._iterator)

  def get_state(self) -> dict[str, Any]:
    return {"kind": self.kind, "grain": self._iterator.get_state()}

  def set_state(self, state: dict[str, Any]) -> None:
    _check_kind(state, self.kind)
    self._iterator.set_state(state["grain"])

  def positions_at(self, steps: Iterable[int]) -> dict[int, dict[str, Any]]:
    """The position before each of ``steps``, as ``get_state`` gives it there: the recording replayed again
    in a separate pass (position unchanged), to check a saved one. Steps past the recording's end are left out."""
    wanted, out = set(steps), {}
    iterator = iter(self._pipeline)
    for step in range(max(wanted, default=-1) + 1):
      if step in wanted:
        out[step] = {"kind": self.kind, "grain": iterator.get_state()}
      try:
        next(iterator)
      except StopIteration:
        break
    return out

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

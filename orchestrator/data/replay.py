"""Replay a recording as per-step micro-batch payloads, through a grain pipeline.

    ArrayRecordDataSource  →  map(decode_group)  →  PackGroupsIntoMicroBatches  →  batch(M, list)

Each transform has one job. Packing keeps a prompt's generations together (as
GRPO needs) and fills a micro-batch with whole groups, in recording order, while
they fit first-fit into ``rows × tokens_per_row`` — the engine's own packing —
so the same recording and batch shape give the same micro-batches, byte for
byte, in any process.
"""

from __future__ import annotations

from typing import Any

import grain

from orchestrator.data.packing import fits
from orchestrator.data.recording import Recording, RecordingError, decode_group
from orchestrator.data.trajectory import Trajectory, TrajectoryGroup


class PackGroupsIntoMicroBatches(grain.IterDataset):
  """Groups → payloads (lists of Trajectory) that each pack into one micro-batch."""

  def __init__(self, parent: grain.IterDataset, *, rows: int, tokens_per_row: int, source_name: str = ""):
    super().__init__(parent)
    self.rows = rows
    self.tokens_per_row = tokens_per_row
    self.source_name = source_name

  def __iter__(self) -> grain.DatasetIterator:
    return _PackIterator(self._parent.__iter__(), self)


class _PackIterator(grain.DatasetIterator):
  """Fills each payload with whole groups; a group that does not fit is carried to the next one.

  Its state is the parent's state *before* the carried group was read, so a
  restored iterator reads that group again and yields the same payloads.
  """

  def __init__(self, parent: grain.DatasetIterator, spec: PackGroupsIntoMicroBatches):
    super().__init__(parent)
    self._spec = spec
    self._carry: TrajectoryGroup | None = None
    self._parent_state_before_carry: dict[str, Any] | None = None
    self._payloads_made = 0

  def _next_group(self) -> TrajectoryGroup | None:
    if self._carry is not None:
      group, self._carry = self._carry, None
      self._parent_state_before_carry = None
      return group
    try:
      return next(self._parent)
    except StopIteration:
      return None

  def __next__(self) -> list[Trajectory]:
    payload: list[Trajectory] = []
    while True:
      state_before = self._parent.get_state()
      group = self._next_group()
      if group is None:
        break
      candidate = payload + group.trajectories()
      if fits(candidate, rows=self._spec.rows, tokens_per_row=self._spec.tokens_per_row):
        payload = candidate
        continue
      if not payload:
        raise RecordingError(
            f"{self._spec.source_name} group {group.group_id}: its {len(group.completions)}"
            f" trajectories do not fit one micro-batch of {self._spec.rows} rows x"
            f" {self._spec.tokens_per_row} tokens; raise rows / tokens_per_row"
        )
      self._carry, self._parent_state_before_carry = group, state_before
      break
    if not payload:
      raise StopIteration
    self._payloads_made += 1
    return payload

  def get_state(self) -> dict[str, Any]:
    parent = self._parent_state_before_carry if self._carry is not None else self._parent.get_state()
    return {"parent": parent, "payloads_made": self._payloads_made}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._carry = None
    self._parent_state_before_carry = None
    self._payloads_made = int(state["payloads_made"])


def replay_pipeline(recording: Recording, *, rows: int, tokens_per_row: int, micro_batches_per_step: int):
  """The grain pipeline yielding one list of ``micro_batches_per_step`` payloads per step."""
  source = grain.sources.ArrayRecordDataSource([str(recording.data_path)])
  groups = grain.MapDataset.source(source).map(decode_group)
  payloads = PackGroupsIntoMicroBatches(
      groups.to_iter_dataset(), rows=rows, tokens_per_row=tokens_per_row,
      source_name=str(recording.data_path),
  )
  return payloads.batch(micro_batches_per_step, drop_remainder=True, batch_fn=list)


def replay_steps(
    recording: Recording, *, rows: int, tokens_per_row: int, micro_batches_per_step: int, steps: int
) -> list[list[list[Trajectory]]]:
  """The first ``steps`` steps of a recording.

  Raises:
    RecordingError: the recording does not hold enough trajectories for ``steps`` steps.
  """
  out: list = []
  for step in replay_pipeline(recording, rows=rows, tokens_per_row=tokens_per_row,
                              micro_batches_per_step=micro_batches_per_step):
    out.append(step)
    if len(out) == steps:
      return out
  raise RecordingError(
      f"{recording.data_path}: its {recording.manifest['num_trajectories']} trajectories make"
      f" only {len(out)} steps of {micro_batches_per_step} micro-batches of {rows} rows x"
      f" {tokens_per_row} tokens; {steps} were asked for — record more groups or run fewer steps"
  )

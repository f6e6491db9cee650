"""The staleness schedule of live rollouts, and the weights kept for it.

Sampled batch b samples with weights version ``max(0, (b - max_staleness) ·
steps_per_batch)`` (version v = the weights after v updates; with one step per
batch, step s samples with ``max(0, s - max_staleness)``; the schedule is
``rollout_batches.BatchSchedule``'s). ``WeightVersions`` answers which version a
step needs and whether it is synced yet, and keeps each synced version a batch
samples with until the sampling thread takes it.
"""

from __future__ import annotations

from typing import Any

from orchestrator.live.rollout_batches import BatchSchedule


class WeightVersions:
  """The weights versions a live source's ``steps`` sample with under its ``schedule``; the source's condition
  guards it.

  Attributes:
    synced: the newest version synced so far.
    first: the oldest version this source can sample with (a resumed run's: its checkpoint's).
  """

  def __init__(self, schedule: BatchSchedule, *, steps: int):
    self.schedule, self._steps = schedule, steps
    # version -> weights (host, or on a split sampler's devices); None: the sampler's own (version 0)
    self._kept: dict[int, Any] = {0: None}
    self.synced = 0
    self.first = 0

  def version_for(self, step: int) -> int:
    return self.schedule.version_for(step)

  def carried(self, first: int) -> list[int]:
    """The batches a position before step ``first`` must carry: those with steps from ``first`` on that were
    sampled with weights older than ``first``'s, which a run resumed there cannot sample again (past the last
    step too: an extended run's)."""
    batch = self.schedule.batch_of(first)
    return [b for b in range(batch, batch + self.schedule.max_staleness + 1) if self.schedule.batch_version(b) < first]

  def carried_problem(self, first: int, carried: list[int], run_batches: int) -> str | None:
    """Why a position before step ``first`` that carries the sampled batches ``carried`` cannot be resumed
    (None: it can): they must be consecutive from ``first``'s batch and hold every batch of the run it owes
    (``carried``); it may carry more (past the end of the run that wrote it, which this run may never reach)."""
    start = self.schedule.batch_of(first)
    owed = [b for b in self.carried(first) if b < run_batches]
    if carried == list(range(start, start + len(carried))) and set(owed) <= set(carried):
      return None
    return (f"the saved rollout position before step {first} carries sampled batches {carried}, but"
            f" max_staleness {self.schedule.max_staleness} with {self.schedule.steps_per_batch} steps per batch"
            f" needs {owed}; the run cannot be resumed from this checkpoint")

  def blocked_on_sync(self, step: int) -> bool:
    """True when ``step``'s rollouts need weights that have not been synced yet: the newest version the sampler
    call holding its first micro-batch samples with (``BatchSchedule.first_micro_batch_version``; without
    in-flight updates its batch's own)."""
    return step < self._steps and self.schedule.first_micro_batch_version(step) > self.synced

  def can_sample(self, batch: int) -> bool:
    """Whether ``batch``'s version is one this source can still have (not older than ``first``)."""
    return self.schedule.batch_version(batch) >= self.first

  def samples_with(self, version: int) -> bool:
    """Whether some batch samples with ``version``'s weights (``BatchSchedule.samples_with``): without in-flight
    updates every version with one step per batch, else those after a batch's last step; with them every
    version some decode chunk samples with, so a generation under way finds the newer versions it takes."""
    return self.schedule.samples_with(version)

  def keep(self, version: int, weights: Any) -> None:
    """``version``'s weights, synced; kept only if a batch samples with them (``samples_with``)."""
    if self.samples_with(version):
      self._kept[version] = weights
    self.synced = max(self.synced, version)

  def available(self, version: int) -> bool:
    """Whether ``version``'s weights are synced and kept."""
    return version <= self.synced and version in self._kept

  def take(self, version: int) -> Any:
    """``version``'s weights (``available`` first); the older ones, which no later batch needs, are dropped (the
    versions the sampler takes only rise: batch by batch, and chunk by chunk within one)."""
    weights = self._kept[version]
    for old in [v for v in self._kept if v < version]:
      del self._kept[old]
    return weights

  def restart_at(self, version: int) -> None:
    """A resumed run: ``version`` (its checkpoint's) is the first, and is synced once its weights arrive."""
    self.synced, self.first, self._kept = version, version, {}

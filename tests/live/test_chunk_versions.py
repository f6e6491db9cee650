"""The version each decode chunk samples with (``BatchSchedule.chunk_version``): a function of counts; every chunk
on its batch's own version without in-flight updates; rising chunk by chunk from it with them, never older than
the staleness bound and never newer than the step that trains it; and a loop that follows it never deadlocks —
pinned by a model of the loop's waits, with the rules that would deadlock as negative controls."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from orchestrator.live.rollout_batches import BatchSchedule

pytestmark = pytest.mark.spec

#: (batch_steps, epochs, micro_batches_per_step, micro_batches_per_call, chunks_per_call), each S in 1..3.
SHAPES = [(1, 1, 1, 1, 2), (1, 1, 2, 1, 4), (1, 1, 2, 2, 4), (2, 2, 2, 4, 4), (4, 2, 2, 8, 4), (4, 2, 2, 1, 3),
          (3, 1, 1, 1, 7), (2, 1, 3, 3, 1), (1, 3, 2, 2, 16)]


def _schedules(in_flight: bool = True):
  for (batch_steps, epochs, per_step, per_call, chunks), staleness in itertools.product(SHAPES, (1, 2, 3)):
    yield BatchSchedule(per_step, 2, batch_steps, epochs, staleness, in_flight_updates=in_flight,
                        micro_batches_per_call=per_call, chunks_per_call=chunks)


def _versions(schedule: BatchSchedule, batch: int) -> list[int]:
  return [schedule.chunk_version(batch, c) for c in range(schedule.chunks_per_batch)]


def test_without_in_flight_updates_every_chunk_samples_with_its_batch_s_version():
  """Today's schedule: a generation on one version. Negative control: with in-flight updates some chunk of a
  later batch does not."""
  for schedule in _schedules(in_flight=False):
    for batch in range(8):
      assert _versions(schedule, batch) == [schedule.batch_version(batch)] * schedule.chunks_per_batch
      assert schedule.newest_version(batch) == schedule.batch_version(batch)
  assert any(len(set(_versions(s, 5))) > 1 for s in _schedules())


def test_chunk_versions_rise_from_the_batch_s_own_to_at_most_the_next_batch_s():
  """Monotone within a batch and across batches (the sampler never goes back to older weights), the first chunk
  on the batch's own version: its oldest token is what today's staleness bound counts."""
  for schedule in _schedules():
    previous = 0
    for batch in range(10):
      versions = _versions(schedule, batch)
      assert versions[0] == schedule.batch_version(batch) >= previous
      assert versions == sorted(versions)
      assert versions[-1] <= schedule.newest_version(batch) <= schedule.batch_version(batch + 1)
      previous = versions[-1]


def test_one_step_per_batch_at_staleness_one_takes_the_next_version_half_way():
  """The default shape of a batch: the first half of the chunks on the batch's version, the second on the next
  one's, which the trainer reaches on the batch before (step b trains with version b)."""
  schedule = BatchSchedule(1, 2, max_staleness=1, in_flight_updates=True, chunks_per_call=4)
  assert [_versions(schedule, b) for b in range(4)] == [[0, 0, 0, 0], [0, 0, 1, 1], [1, 1, 2, 2], [2, 2, 3, 3]]


def test_no_token_is_older_than_the_staleness_bound_or_newer_than_the_step_that_trains_it():
  """Per token: the step that trains it is at most (S + 1) · steps_per_batch − 1 updates past its version, as a
  batch's tokens all were without in-flight updates, and never behind it (the trainer does not wait for its own
  future). Negative control: a batch sampled one batch later than the bound allows breaks the first."""
  for schedule in _schedules():
    bound = (schedule.max_staleness + 1) * schedule.steps_per_batch - 1
    for step in range(12 * schedule.steps_per_batch):
      for version in _versions(schedule, schedule.batch_of(step)):
        assert 0 <= step - version <= bound
    older = dataclasses.replace(schedule, max_staleness=schedule.max_staleness + 1)
    step = 8 * schedule.steps_per_batch - 1
    assert step - older.chunk_version(older.batch_of(step), 0) > bound


def test_the_chunk_schedule_is_a_function_of_counts_alone():
  """Two schedules of one recipe answer alike (no clock, no state), and a bad chunk index is refused."""
  for schedule in _schedules():
    again = dataclasses.replace(schedule)
    assert [_versions(schedule, b) for b in range(6)] == [_versions(again, b) for b in range(6)]
  with pytest.raises(ValueError, match="chunk 4 is outside a batch's 4 decode chunks"):
    BatchSchedule(1, 2, max_staleness=1, in_flight_updates=True, chunks_per_call=4).chunk_version(3, 4)


def test_samples_with_is_every_version_some_chunk_samples_with():
  """What a weight sync must keep; without in-flight updates each batch's first step's (as ``WeightVersions``
  keeps them). Negative control: with in-flight updates over several steps a batch, versions inside a batch are
  kept too."""
  for schedule in [*_schedules(), *_schedules(in_flight=False)]:
    used = {v for b in range(14) for v in _versions(schedule, b)}
    last = schedule.batch_version(13)
    assert {v for v in range(last) if schedule.samples_with(v)} == {v for v in used if v < last}
  for schedule in _schedules(in_flight=False):
    assert all(schedule.samples_with(v) == (v % schedule.steps_per_batch == 0) for v in range(40))
  multi = BatchSchedule(2, 2, 4, 2, 1, in_flight_updates=True, micro_batches_per_call=8, chunks_per_call=4)
  assert multi.samples_with(10) and not dataclasses.replace(multi, in_flight_updates=False).samples_with(10)


def test_chunks_before_is_the_prefix_of_a_batch_sampled_with_older_weights():
  for schedule in _schedules():
    for batch, version in itertools.product(range(6), range(6 * schedule.steps_per_batch)):
      count = schedule.chunks_before(batch, version)
      assert all((v < version) == (c < count) for c, v in enumerate(_versions(schedule, batch)))


class Deadlock(AssertionError):
  """The modelled loop reached a state where neither the trainer nor the sampler can go on."""


def run_loop(schedule: BatchSchedule, steps: int, *, honest_blocked_on_sync: bool = True,
             carry_whole_batches: bool = False) -> None:
  """A model of the live loop's waits, at decode-chunk granularity. The sampler samples batches in order, chunk
  by chunk, each once its version is synced; a call's micro-batches exist once its last chunk is. The trainer
  dispatches step k's micro-batches (pass 0: its own; a later pass: the whole batch) and at the boundary after
  it writes a checkpoint (waiting for what the position before step k + 1 carries: the chunks of the batches
  sampled ahead with weights older than k + 1, or with ``carry_whole_batches`` those batches whole) and syncs
  version k + 1 — after dispatching step k + 1's first micro-batch, unless the source says that micro-batch
  waits for the sync (``blocked_on_sync``: with ``honest_blocked_on_sync`` the newest version its call needs,
  else the batch's own version, what it was without in-flight updates).

  Raises:
    Deadlock: neither side can move.
  """
  synced, sampled = 0, {}  # the newest synced version; batch -> its chunks sampled
  batches = schedule.batches_for(steps) + schedule.max_staleness + 1  # sampled ahead past the end too

  def exists(batch: int, micro_batch: int) -> bool:
    call = micro_batch // schedule.micro_batches_per_call
    return sampled.get(batch, 0) >= (call + 1) * schedule.chunks_per_call

  def blocked(step: int) -> bool:
    needs = (schedule.first_micro_batch_version(step) if honest_blocked_on_sync
             else schedule.version_for(step))
    return needs > synced

  def carried(first: int) -> list[tuple[int, int]]:
    start = schedule.batch_of(first)
    owed = [b for b in range(start, start + schedule.max_staleness + 1) if schedule.batch_version(b) < first]
    return [(b, schedule.chunks_per_batch if carry_whole_batches else schedule.chunks_before(b, first))
            for b in owed]

  def trainer():  # yields a condition (a callable) before each action it waits for
    nonlocal synced
    for step in range(steps):
      batch = schedule.batch_of(step)
      needed = ([schedule.sampled_index(step, i) for i in range(schedule.micro_batches_per_step)]
                if schedule.pass_of(step) == 0 else list(range(schedule.micro_batches_per_batch)))
      if step == 0 or not first_dispatched:
        yield lambda: exists(batch, needed[0])
      for m in needed[1:]:
        yield lambda m=m: exists(batch, m)
      first_dispatched = False
      if step + 1 < steps and not blocked(step + 1):  # step k + 1's first dispatch before the sync
        nxt = step + 1
        yield lambda: exists(schedule.batch_of(nxt), schedule.sampled_index(nxt, 0))
        first_dispatched = True
      for b, count in carried(step + 1):  # the checkpoint at every boundary
        yield lambda b=b, count=count: sampled.get(b, 0) >= count
      synced = step + 1

  waits = trainer()
  condition = next(waits, None)
  batch = chunk = 0
  while condition is not None:
    if condition():
      condition = next(waits, None)
    elif batch < batches and schedule.chunk_version(batch, chunk) <= synced:
      sampled[batch] = chunk + 1
      batch, chunk = (batch + 1, 0) if chunk + 1 == schedule.chunks_per_batch else (batch, chunk + 1)
    else:
      raise Deadlock(f"trainer waits at step {synced}; sampler at batch {batch} chunk {chunk}")


def test_a_loop_following_the_schedule_never_deadlocks_with_a_checkpoint_at_every_boundary():
  for schedule in [*_schedules(), *_schedules(in_flight=False)]:
    run_loop(schedule, 6 * schedule.steps_per_batch)


class OneVersionTooNew(BatchSchedule):
  """The rule with its bound one version past the first step's: that version needs an update of this batch."""

  def newest_version(self, batch: int) -> int:
    return max(self.batch_version(batch), min(self.batch_version(batch + 1), self.first_step(batch)) + 1)


def test_negative_controls_each_rule_the_schedule_and_the_loop_keep_deadlocks_when_broken():
  """A bound one version newer, a ``blocked_on_sync`` that looks at the batch's own version only, and a
  checkpoint that carries whole batches (waiting for chunks of weights it has not synced): each deadlocks the
  modelled loop, so the model can fail and each rule is needed."""
  shape = dict(micro_batches_per_step=1, generations_per_group=2, max_staleness=1, in_flight_updates=True,
               chunks_per_call=4)
  run_loop(BatchSchedule(**shape), 6)
  with pytest.raises(Deadlock):
    run_loop(OneVersionTooNew(**shape), 6)
  with pytest.raises(Deadlock):
    run_loop(BatchSchedule(**shape), 6, honest_blocked_on_sync=False)
  with pytest.raises(Deadlock):
    run_loop(BatchSchedule(**shape), 6, carry_whole_batches=True)
  run_loop(dataclasses.replace(BatchSchedule(**shape), in_flight_updates=False), 6, honest_blocked_on_sync=False,
           carry_whole_batches=True)  # what the loop does today: sound without in-flight updates

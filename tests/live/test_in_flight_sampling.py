"""In-flight weight updates in the sampling thread (``rollouts.in_flight_updates``), on a fake sampler: each call
decodes in chunks, chunk by chunk on the version ``BatchSchedule.call_versions`` gives it, waiting for that
version's sync; every token carries the version that sampled it and that version's log-prob, no token is older
than the staleness bound allows or newer than the step that trains it; the sync keeps every version a chunk
samples with; a step waits for the newest version its first call needs; the wait for a version lets an
evaluation take the sampler, ends when the source closes, and is recorded as the step's sampler pause. Without
in-flight updates the sampler is called as it always was, and its pause before a batch is recorded alike."""

from __future__ import annotations

import time

import numpy as np
import pytest

from orchestrator.live.rollout_batches import BatchSchedule
from orchestrator.live.weight_versions import WeightVersions
from orchestrator.tasks.tasks import ModularAddition

CHUNKS, CHUNK_TOKENS = 4, 2  # a completion of 8 tokens in four chunks
STEPS, MICRO, GROUPS, GENERATIONS = 6, 2, 1, 2


def logprob_of(version: int) -> float:
  """The fake policy's log-prob of every token it samples with ``version``'s weights: tells versions apart."""
  return -0.125 * (version + 1)


class _ChunkSampler:
  """What ``SharedSampler`` asks of a sampler; a chunked call takes each chunk's weights from ``weights_for_chunk``
  and writes, per token, the version and that version's log-prob (``logprob_of``)."""

  placement = None

  def __init__(self):
    self.weights_version = 0
    self.calls: list[dict] = []  # per call: whether chunked, and each chunk's (version, weights)
    self.between_chunks: list[int] = []  # chunks after which the test's hook ran

  def sync(self, weights, version):
    self.weights_version = version

  def sample(self, prompts, *, seed, weights_for_chunk=None, chunk_tokens=0, **_):
    from orchestrator.live.sampler import Samples  # import here: it loads JAX

    call = {"chunked": weights_for_chunk is not None, "chunks": []}
    self.calls.append(call)
    if weights_for_chunk is None:
      versions = np.full(CHUNKS * CHUNK_TOKENS, self.weights_version, np.int64)
    else:
      assert chunk_tokens == CHUNK_TOKENS
      for chunk in range(CHUNKS):
        call["chunks"].append(weights_for_chunk(chunk))
      versions = np.repeat([v for v, _ in call["chunks"]], CHUNK_TOKENS).astype(np.int64)
    ids = [np.arange(1, len(versions) + 1, dtype=np.int32) for _ in prompts]
    logprobs = [np.asarray([logprob_of(v) for v in versions], np.float32) for _ in prompts]
    return Samples(list(prompts), [np.array([1], np.int32) for _ in prompts], ids, logprobs, ["x"] * len(prompts),
                   int(versions[0]), versions=None if weights_for_chunk is None else [versions.copy() for _ in prompts])


def _zero_reward(problems, texts, **_):
  return np.zeros(len(texts), np.float32)


def _source(*, in_flight: bool, staleness: int = 1, batch_steps: int = 1, per_call: int = 1):
  from orchestrator.live.rollouts import LiveRollouts, LiveShape  # import here: it loads JAX

  extra = {"in_flight_updates": True, "decode_chunk_tokens": CHUNK_TOKENS, "decode_chunks": CHUNKS} if in_flight else {}
  shape = LiveShape(STEPS, MICRO, GROUPS, GENERATIONS, staleness, seed=3, batch_steps=batch_steps,
                    micro_batches_per_call=per_call, **extra)
  sampler = _ChunkSampler()
  return LiveRollouts(sampler, ModularAddition(), shape, reward=_zero_reward), sampler


def _train(source, *, close: bool = True) -> tuple[list[list], list]:
  """The loop's order, one step at a time: a step's rollouts once its first call's versions are synced
  (``blocked_on_sync``: the boundary before it synced them), then its update, whose weights the next boundary
  syncs. Returns each step's trajectories and ``RolloutStats``; ``close``: the source is closed after."""
  steps, stats = [], []
  try:
    for step in range(STEPS):
      assert not source.blocked_on_sync(step)  # the boundary before it synced what it needs
      payloads = next(source)
      steps.append([t for index in range(len(payloads)) for t in payloads[index]])
      stats.append(source.step_stats(step))
      if step + 1 < STEPS:  # before this boundary's sync: blocked where its first call needs the version to come
        assert source.blocked_on_sync(step + 1) == (source._schedule.first_micro_batch_version(step + 1) > step)
      source.sync(step + 1, f"w{step + 1}")  # the update of ``step``: version step + 1
  finally:
    if close:
      source.close()
  return steps, stats


@pytest.mark.engine
@pytest.mark.parametrize("staleness, batch_steps, per_call", [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 1), (1, 2, 2)])
def test_each_token_carries_the_version_its_chunk_samples_with_and_that_versions_log_prob(staleness, batch_steps,
                                                                                          per_call):
  """A batch's versions spread over its chunks in sampling order: with one call a batch (or two steps a batch) a
  generation's later chunks take a newer version; with two calls a batch of one step, the first call is all on
  the batch's own version and the second on the next, so no generation spans two (the schedule's, not a miss)."""
  source, sampler = _source(in_flight=True, staleness=staleness, batch_steps=batch_steps, per_call=per_call)
  schedule = source._schedule
  steps, stats = _train(source)
  spread = False
  for step, trajectories in enumerate(steps):
    batch = schedule.batch_of(step)
    for t in trajectories:
      assert t.versions is not None and t.versions.shape == t.completion_ids.shape
      np.testing.assert_array_equal(t.old_logprobs, [logprob_of(v) for v in t.versions])
      # the staleness bound: the oldest token is the batch's own version; none newer than the step training it
      assert t.versions.min() >= schedule.batch_version(batch) and t.versions.max() <= step
      assert step - t.versions.min() <= (staleness + 1) * schedule.steps_per_batch - 1
      spread |= t.versions.min() < t.versions.max()
    assert stats[step].weights_version == schedule.batch_version(batch)  # the batch's own, its oldest tokens'
    assert stats[step].token_version_min == min(t.versions.min() for t in trajectories)
    assert stats[step].token_version_max == max(t.versions.max() for t in trajectories)
  calls = [(b, c) for b in range(schedule.batches_for(STEPS)) for c in range(schedule.calls_per_batch)]
  spans_versions = any(len(set(schedule.call_versions(b, c))) > 1 for b, c in calls)
  assert spread == spans_versions and spread == ((staleness, batch_steps, per_call) != (1, 1, 1))
  chunked = [c for c in sampler.calls if c["chunked"]]
  assert len(chunked) == len(sampler.calls) == schedule.batches_for(STEPS) * schedule.calls_per_batch
  for index, call in enumerate(chunked):  # calls in sampling order: batch by batch, call by call
    batch, call_index = divmod(index, schedule.calls_per_batch)
    assert [v for v, _ in call["chunks"]] == schedule.call_versions(batch, call_index)
    assert [w for v, w in call["chunks"]] == [None if v == 0 else f"w{v}" for v, _ in call["chunks"]]


@pytest.mark.engine
def test_without_in_flight_updates_the_sampler_is_called_whole_on_the_batchs_version():
  """Negative control: the same loop with the key off samples every call whole, on one version, carrying none."""
  source, sampler = _source(in_flight=False)
  steps, stats = _train(source)
  assert sampler.calls and not any(c["chunked"] for c in sampler.calls)
  assert all(t.versions is None for trajectories in steps for t in trajectories)
  assert all(s.token_version_min is None and s.token_version_max is None for s in stats)
  assert all(s.sampler_sync_wait_s >= 0.0 for s in stats)  # a pause before a batch only, for its version's sync


HELD_S = 0.3  # how long a test holds back version 1's sync while the sampler waits for it


def _steps_around_a_held_sync(source, sampler, calls_waiting: int):
  """Steps 0 and 1's ``RolloutStats``, version 1's sync held back ``HELD_S`` once the sampler has made
  ``calls_waiting`` calls, the last of which (or the next) waits for version 1; the source is closed after."""
  try:
    assert len(next(source)[1]) == GROUPS * GENERATIONS  # step 0 whole
    step0 = source.step_stats(0)
    give_up = time.monotonic() + 30.0
    while len(sampler.calls) < calls_waiting:
      assert time.monotonic() < give_up and source._sampling.error is None
      time.sleep(0.01)
    time.sleep(HELD_S)
    assert len(sampler.calls) == calls_waiting  # none more: the sampler waits for version 1 all the while
    source.sync(1, "w1")
    assert len(next(source)[1]) == GROUPS * GENERATIONS  # step 1 whole: its record is complete
    step1 = source.step_stats(1)
  finally:
    source.close()
  return step0, step1


@pytest.mark.engine
def test_without_in_flight_updates_a_steps_record_gives_the_sampler_s_pause_for_its_batch_s_weights():
  """At staleness 0 the sampler waits before every batch for the update before it: a sync held back a measured
  while is step 1's ``sampler_sync_wait_s``; step 0, on the weights the source starts with, paused for none."""
  source, sampler = _source(in_flight=False, staleness=0)
  step0, step1 = _steps_around_a_held_sync(source, sampler, calls_waiting=MICRO)  # batch 0's calls, then none
  assert step0.sampler_sync_wait_s == 0.0
  assert HELD_S * 0.9 <= step1.sampler_sync_wait_s < HELD_S + 10.0


@pytest.mark.engine
def test_a_steps_record_gives_the_seconds_its_calls_paused_for_a_newer_versions_sync():
  """Batch 1's second call (step 1's second micro-batch) waits for version 1, synced a measured while later: step
  1's ``sampler_sync_wait_s`` holds that wait; step 0's calls, on version 0 throughout, paused for none."""
  source, sampler = _source(in_flight=True)
  step0, step1 = _steps_around_a_held_sync(source, sampler, calls_waiting=4)  # batch 1's second call waits
  assert step0.sampler_sync_wait_s == 0.0
  assert HELD_S * 0.9 <= step1.sampler_sync_wait_s < HELD_S + 10.0


@pytest.mark.spec
def test_the_sync_keeps_every_version_a_chunk_samples_with():
  """Two steps a batch at staleness 1: without in-flight updates only a batch's own versions (even ones) are
  kept; with them the odd versions later chunks sample with too (dropping them would leave a generation waiting
  for weights that never come)."""
  def kept(in_flight: bool) -> list[int]:
    versions = WeightVersions(BatchSchedule(1, 2, batch_steps=2, max_staleness=1, in_flight_updates=in_flight,
                                            chunks_per_call=4), steps=8)
    for version in range(1, 8):
      versions.keep(version, f"w{version}")
    return [v for v in range(8) if versions.available(v)]

  assert kept(in_flight=False) == [0, 2, 4, 6]
  assert kept(in_flight=True) == [0, 1, 2, 3, 4, 5, 6, 7]


@pytest.mark.spec
def test_a_step_waits_for_the_newest_version_its_first_call_needs():
  """One step a batch at staleness 1, four chunks: step k's call ends on version k, so it is blocked until the
  sync of version k; without in-flight updates it samples with version k - 1 alone (negative control)."""
  def blocked(in_flight: bool, synced: int, step: int) -> bool:
    versions = WeightVersions(BatchSchedule(1, 2, max_staleness=1, in_flight_updates=in_flight, chunks_per_call=4),
                              steps=8)
    for version in range(1, synced + 1):
      versions.keep(version, f"w{version}")
    return versions.blocked_on_sync(step)

  assert blocked(True, synced=2, step=3) and not blocked(True, synced=3, step=3)
  assert not blocked(False, synced=2, step=3)


@pytest.mark.engine
def test_a_generation_waiting_for_a_version_lets_an_evaluation_take_the_sampler_and_ends_when_closed():
  """One step a batch at staleness 1, two calls a batch: batch 1's second call samples with version 1, which is
  never synced. The thread waits inside that call without the sampler's turn (an evaluation at the boundary
  whose sync it waits for takes it), and ``close`` ends the wait with no error."""
  source, sampler = _source(in_flight=True)
  assert source._schedule.call_versions(1, 1) == [1, 1, 1, 1]
  next(source)  # step 0; the thread samples batches 0 and 1 on version 0 until that call
  give_up = time.monotonic() + 30.0
  while len(sampler.calls) < 4:
    assert time.monotonic() < give_up and source._sampling.error is None
    time.sleep(0.01)
  time.sleep(0.2)  # into its wait for version 1
  assert sampler.calls[3]["chunks"] == []  # still waiting for its first chunk's weights
  with source._shared.turn(stop=lambda: time.monotonic() > give_up) as taken:
    assert taken  # the wait does not hold the sampler
  source.close(timeout_s=5.0)
  assert not source._sampling.thread.is_alive() and source._sampling.error is None
  assert sampler.calls[3]["chunks"] == []  # nothing sampled with weights it was not given


@pytest.mark.engine
def test_a_position_inside_a_generation_names_it_and_the_last_steps_checkpoint_carries_no_partial_batch():
  """Checkpoints with in-flight updates (until a part-sampled generation can be carried): a position inside the
  run falls inside batch k's generation (its later chunks need version k), which the source names
  (``checkpoint_problem``) rather than wait for; the position after the last step carries nothing past the end
  (batch 6 would need version 6, which no sync delivers), and is ready at once. Negative control: without
  in-flight updates no position has a problem, and the last one carries batch 6, sampled whole on version 5."""
  from orchestrator.loop.live_waits import LiveWaits, StoppedWithoutCheckpointError

  source, _ = _source(in_flight=True, per_call=2)
  try:
    _train(source, close=False)
    problem = source.checkpoint_problem(3)
    assert problem.startswith("the position before step 3 falls inside the generation of step 3 (its decode"
                              " chunks from 2 on sample with the weights of step 3 or newer")
    assert source.checkpoint_problem(STEPS) is None
    assert source.ready_to_checkpoint(STEPS, 1.0)
    assert source.state_json({"next_step": STEPS})["sampled"] == []
    waits = LiveWaits(source, lambda: "SIGTERM", grace_s=60.0, latest=lambda: ("no checkpoint was written", False))
    start = time.monotonic()
    with pytest.raises(StoppedWithoutCheckpointError, match="stopped by SIGTERM after step 2, but no checkpoint of"
                                                            " it could be written: the position before step 3"):
      waits.checkpoint(2, "SIGTERM")
    assert time.monotonic() - start < 1.0  # at once, not after the grace
  finally:
    source.close()
  plain, _ = _source(in_flight=False, per_call=2)
  try:
    _train(plain, close=False)
    assert all(plain.checkpoint_problem(position) is None for position in range(STEPS + 1))
    assert plain.ready_to_checkpoint(STEPS, 30.0)
    assert [r["batch"] for r in plain.state_json({"next_step": STEPS})["sampled"]] == [STEPS]
  finally:
    plain.close()


@pytest.mark.engine
def test_a_wait_for_a_checkpoints_ask_is_not_a_pause_for_weights():
  """After the run's last batch the sampler waits until a checkpoint asks for the batch past the end, whose
  version is synced already: that wait (held here a measured while) is no pause for weights, and the carried
  batch records none."""
  source, _ = _source(in_flight=False, per_call=2)
  try:
    _train(source, close=False)
    time.sleep(0.3)  # the sampler waits for the ask, with batch 6's version 5 kept since step 4's sync
    assert source.ready_to_checkpoint(STEPS, 30.0)
    carried, = source.state_json({"next_step": STEPS})["sampled"]
  finally:
    source.close()
  assert carried["batch"] == STEPS and carried["sync_wait_s"] == [0.0] * MICRO


@pytest.mark.engine
def test_a_stop_inside_the_run_says_it_keeps_no_checkpoint_and_one_after_the_last_step_that_it_does():
  """The line a stop prints promises a checkpoint only where one will be written (``RunHandle.stop_keeps``): not
  while the position after the step in flight falls inside a generation; after the last step, and without
  in-flight updates (negative control), it does."""
  from types import SimpleNamespace

  from orchestrator.app.run import RunHandle
  from orchestrator.app.signals import STOP_KEEPS

  def keeps(source, steps_done: int) -> str:
    program = SimpleNamespace(worker=SimpleNamespace(capabilities=SimpleNamespace(can_checkpoint=True)),
                              live=source, steps_done=steps_done)
    return RunHandle(program=program, progress=None).stop_keeps()

  for in_flight in (True, False):
    source, _ = _source(in_flight=in_flight, per_call=2)
    try:
      _train(source, close=False)
      expected = "inside a generation" if in_flight else "kept"
      assert [keeps(source, done) for done in (1, 2, STEPS - 2)] == [expected] * 3
      assert keeps(source, STEPS - 1) == "kept"  # the position after the last step: its checkpoint is written
    finally:
      source.close()
  assert "without a checkpoint" in STOP_KEEPS["inside a generation"]

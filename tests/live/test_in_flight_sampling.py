"""In-flight weight updates in the sampling thread (``rollouts.in_flight_updates``), on a fake sampler: each call
decodes in chunks, chunk by chunk on the version ``BatchSchedule.call_versions`` gives it, waiting for that
version's sync; every token carries the version that sampled it and that version's log-prob, no token is older
than the staleness bound allows or newer than the step that trains it; the sync keeps every version a chunk
samples with; a step waits for the newest version its first call needs; the wait for a version lets an
evaluation take the sampler, ends when the source closes, and is recorded as the step's sampler pause; a
checkpoint inside a generation carries it, and a source restored there goes on from it as the uninterrupted
source did. Without in-flight updates the sampler is called as it always was, and its pause before a batch is
recorded alike."""

from __future__ import annotations

import json
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

  def sample(self, prompts, *, seed, weights_for_chunk=None, chunk_tokens=0, before_chunk=None, resume_from=None,
             **_):
    from orchestrator.live.chunked_sampling import PartialGeneration  # import here: it loads JAX
    from orchestrator.live.sampler import Samples

    call = {"chunked": weights_for_chunk is not None, "chunks": [], "seed": seed,
            "resumed_at": None if resume_from is None else resume_from.next_chunk}
    self.calls.append(call)
    if weights_for_chunk is None:
      versions = np.full(CHUNKS * CHUNK_TOKENS, self.weights_version, np.int64)
    else:
      assert chunk_tokens == CHUNK_TOKENS
      # a resumed call goes on after the carried chunks, whose versions the carried tokens hold
      chunk_versions = [] if resume_from is None else [int(v) for v in resume_from.versions[::CHUNK_TOKENS]]
      assert resume_from is None or resume_from.call == {"seed": seed, "rows": len(prompts)}
      for chunk in range(len(chunk_versions), CHUNKS):
        if before_chunk is not None and chunk > 0:
          so_far = np.repeat(chunk_versions, CHUNK_TOKENS).astype(np.int64)
          before_chunk(chunk, lambda: PartialGeneration(
              next_chunk=chunk, tokens=[np.arange(1, len(so_far) + 1, dtype=np.int32) for _ in prompts],
              logprobs=[np.asarray([logprob_of(v) for v in so_far], np.float32) for _ in prompts],
              done=[False] * len(prompts), versions=so_far, call={"seed": seed, "rows": len(prompts)}))
        version, weights = weights_for_chunk(chunk)
        call["chunks"].append((version, weights))
        chunk_versions.append(version)
      versions = np.repeat(chunk_versions, CHUNK_TOKENS).astype(np.int64)
    ids = [np.arange(1, len(versions) + 1, dtype=np.int32) for _ in prompts]
    logprobs = [np.asarray([logprob_of(v) for v in versions], np.float32) for _ in prompts]
    return Samples(list(prompts), [np.array([1], np.int32) for _ in prompts], ids, logprobs, ["x"] * len(prompts),
                   int(versions[0]), versions=None if weights_for_chunk is None else [versions.copy() for _ in prompts])


def _zero_reward(problems, texts, **_):
  return np.zeros(len(texts), np.float32)


#: The fake model's vocabulary: its tokens are the ids 1, 2, ... of each completion's positions.
VOCAB = 64


def _source(*, in_flight: bool, staleness: int = 1, batch_steps: int = 1, per_call: int = 1):
  from orchestrator.live.rollouts import LiveRollouts, LiveShape  # import here: it loads JAX

  extra = {"in_flight_updates": True, "decode_chunk_tokens": CHUNK_TOKENS, "decode_chunks": CHUNKS} if in_flight else {}
  shape = LiveShape(STEPS, MICRO, GROUPS, GENERATIONS, staleness, seed=3, batch_steps=batch_steps,
                    micro_batches_per_call=per_call, vocab_size=VOCAB, **extra)
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


def _train_until(source, position: int) -> list[list]:
  """``_train``'s loop up to the checkpoint before step ``position``: the steps before it, each boundary's sync
  but the last one's, which comes after that checkpoint."""
  steps = []
  for step in range(position):
    assert not source.blocked_on_sync(step)
    payloads = next(source)
    steps.append([t for index in range(len(payloads)) for t in payloads[index]])
    if step + 1 < position:
      source.sync(step + 1, f"w{step + 1}")
  return steps


def _checkpoint(source, position: int) -> dict:
  """The position before step ``position`` as a checkpoint writes it (JSON and back), once it can be."""
  assert source.ready_to_checkpoint(position, 30.0)
  return json.loads(json.dumps(source.state_json({"kind": source.kind, "next_step": position})))


def _resumed(state: dict, position: int, **shape):
  """A new source (``_source``'s ``shape``; default two micro-batches a call) restored at ``position`` from
  ``state``, its checkpoint's weights synced, trained on to the end."""
  source, sampler = _source(in_flight=True, **{"per_call": 2, **shape})
  source.set_state(state)
  source.sync(position, f"w{position}")
  steps = []
  try:
    for step in range(position, STEPS):
      assert not source.blocked_on_sync(step)
      payloads = next(source)
      steps.append([t for index in range(len(payloads)) for t in payloads[index]])
      source.sync(step + 1, f"w{step + 1}")
  finally:
    source.close()
  return steps, sampler


def _assert_trained_alike(resumed: list[list], uninterrupted: list[list]) -> None:
  """The resumed source's steps trained on what the uninterrupted source's same steps did: per trajectory, its
  completion, each token's version and log-prob."""
  assert len(resumed) == len(uninterrupted)
  for again, before in zip(resumed, uninterrupted):
    assert len(again) == len(before)
    for t, u in zip(again, before):
      np.testing.assert_array_equal(t.versions, u.versions)
      np.testing.assert_array_equal(t.old_logprobs, u.old_logprobs)
      np.testing.assert_array_equal(t.completion_ids, u.completion_ids)


def _checkpointed_at(position: int) -> dict:
  """The position before step ``position`` of an in-flight source of one call a batch of two micro-batches,
  trained up to it and checkpointed there (the source closed after)."""
  source, _ = _source(in_flight=True, per_call=2)
  try:
    _train_until(source, position)
    return _checkpoint(source, position)
  finally:
    source.close()


@pytest.mark.engine
def test_a_checkpoint_inside_a_generation_carries_it_and_a_resume_there_samples_what_the_run_did():
  """One call a batch of two micro-batches at staleness 1: batch k's four chunks sample with versions k-1, k-1,
  k, k, so the position before step 3 cuts batch 3's generation after its second chunk, whose later chunks need
  version 3, synced after that checkpoint. The checkpoint waits for the sampler to reach the cut and carries
  the generation so far; a source restored there goes on from it (its first call resumed at chunk 2, on
  version 3) and trains on what the uninterrupted source trained on, token versions and log-probs alike.
  Without in-flight updates (negative control) nothing is cut and no generation is carried."""
  whole, _ = _source(in_flight=True, per_call=2)
  uninterrupted, _ = _train(whole)

  state = _checkpointed_at(3)
  assert [r["batch"] for r in state["sampled"]] == [3] and state["sampled"][0]["payloads"] == []
  assert state["generation"]["next_chunk"] == 2 and state["generation"]["versions"] == [2] * 2 * CHUNK_TOKENS
  resumed, sampler = _resumed(state, 3)
  assert sampler.calls[0]["resumed_at"] == 2 and [v for v, _ in sampler.calls[0]["chunks"]] == [3, 3]
  assert all(call["resumed_at"] is None for call in sampler.calls[1:])
  _assert_trained_alike(resumed, uninterrupted[3:])

  plain, _ = _source(in_flight=False, per_call=2)
  try:
    _train_until(plain, 3)
    assert "generation" not in _checkpoint(plain, 3)
  finally:
    plain.close()


@pytest.mark.engine
def test_a_restored_position_must_carry_the_generation_the_schedule_cuts():
  """A checkpoint's position read back is held to the schedule: one that should carry the generation before chunk
  2 and carries none, one before another chunk, or one of another seed, shape, versions or with values no
  sampler gives, is refused in one line naming what differs; the one written passes."""
  from orchestrator.contract import SourceStateError

  state = _checkpointed_at(3)
  generation = state["generation"]
  for changed, says in (({k: v for k, v in state.items() if k != "generation"}, "carries no generation, where the"
                         " schedule needs one before chunk 2 of a sampler call"),
                        ({**state, "generation": {**generation, "next_chunk": 1}},
                         "carries a generation before chunk 1, where the schedule needs one before chunk 2"),
                        ({**state, "generation": {**generation, "call": {**generation["call"], "seed": 5}}},
                         "carries a generation that was sampled with seed 5, not "),
                        ({**state, "generation": {**generation, "versions": [1] * len(generation["versions"])}},
                         "carries a generation that holds token versions \\[1, 1, 1, 1\\], where the schedule"
                         " gives \\[2, 2, 2, 2\\]"),
                        ({**state, "generation": {**generation, "done": generation["done"][:1]}},
                         "carries a generation that holds \\[1, 4\\] rows of \\[4\\] tokens, where a call of"
                         " this run samples 4 rows"),
                        ({**state, "generation": {**generation, "tokens": [[-1] + row[1:]
                                                                            for row in generation["tokens"]]}},
                         "carries a generation that holds a negative token id"),
                        ({**state, "generation": {**generation, "tokens": [[VOCAB] + row[1:]
                                                                            for row in generation["tokens"]]}},
                         f"carries a generation that holds a token id of {VOCAB}, past the model's {VOCAB} ids"),
                        ({**state, "generation": {**generation, "logprobs": [[float("nan")] + row[1:]
                                                                              for row in generation["logprobs"]]}},
                         "carries a generation that holds a log-prob that is not a finite number <= 0"),
                        ({**state, "generation": {**generation, "tokens": [[2**40] + row[1:]
                                                                            for row in generation["tokens"]]}},
                         "a carried generation that does not read as one \\(OverflowError")):
    restored, _ = _source(in_flight=True, per_call=2)
    with pytest.raises(SourceStateError, match=says):
      restored.set_state(changed)
  restored, _ = _source(in_flight=True, per_call=2)
  restored.set_state(state)


@pytest.mark.engine
def test_a_checkpoint_after_its_boundarys_sync_carries_the_generation_the_sampler_went_past():
  """A stop while step 2 waits for its later micro-batches checkpoints the position before it after version 2's
  sync (``LiveWaits.checkpoint`` of step 1), so the sampler may be past the cut: two steps a batch, one
  micro-batch a call, batch 1's chunks on versions 0 to 2, cut before its third call's fourth chunk. The
  checkpoint carries the batch's first two micro-batches and that call's generation as it was at the cut, and a
  source restored there trains on what the uninterrupted source did."""
  from orchestrator.loop.live_waits import LiveWaits

  shape = {"batch_steps": 2, "per_call": 1}
  whole, _ = _source(in_flight=True, **shape)
  uninterrupted, _ = _train(whole)
  source, _ = _source(in_flight=True, **shape)
  try:
    _train_until(source, 2)
    source.sync(2, "w2")
    next(source)  # step 2 taken: its later micro-batches are sampled with version 2 from here on
    assert source.micro_batch_ready(3, 1, 30.0)  # the batch's last call sampled: the sampler is past the cut
    waits = LiveWaits(source, lambda: "SIGTERM", grace_s=30.0, latest=lambda: ("no checkpoint was written", False))
    waits.checkpoint(1, "SIGTERM")
    state = json.loads(json.dumps(source.state_json({"kind": source.kind, "next_step": 2})))
  finally:
    source.close()
  assert [len(r["payloads"]) for r in state["sampled"]] == [2] and state["generation"]["next_chunk"] == 3
  resumed, sampler = _resumed(state, 2, **shape)
  assert sampler.calls[0]["resumed_at"] == 3
  _assert_trained_alike(resumed, uninterrupted[2:])


@pytest.mark.engine
def test_a_stop_inside_a_generation_writes_its_checkpoint_once_the_sampler_reaches_the_cut():
  """A stop after step 2 (inside batch 3's generation) waits for the sampler to reach the cut, and the checkpoint
  is written, carrying the generation (before, a stop there ended without one)."""
  from orchestrator.loop.live_waits import LiveWaits

  source, _ = _source(in_flight=True, per_call=2)
  try:
    _train_until(source, 3)
    waits = LiveWaits(source, lambda: "SIGTERM", grace_s=60.0, latest=lambda: ("no checkpoint was written", False))
    waits.checkpoint(2, "SIGTERM")  # raises StoppedWithoutCheckpointError where the rollouts cannot be carried
    assert source.state_json({"kind": source.kind, "next_step": 3})["generation"]["next_chunk"] == 2
  finally:
    source.close()


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
def test_a_stop_inside_the_run_says_it_keeps_a_checkpoint_with_in_flight_updates_as_without():
  """The line a stop prints promises a checkpoint wherever the position falls (``RunHandle.stop_keeps``): inside a
  generation too, whose part sampled the checkpoint carries; the same with the key off."""
  from types import SimpleNamespace

  from orchestrator.app.run import RunHandle

  def keeps(source, steps_done: int) -> str:
    program = SimpleNamespace(worker=SimpleNamespace(capabilities=SimpleNamespace(can_checkpoint=True)),
                              live=source, steps_done=steps_done)
    return RunHandle(program=program, progress=None).stop_keeps()

  for in_flight in (True, False):
    source, _ = _source(in_flight=in_flight, per_call=2)
    try:
      _train(source, close=False)
      assert [keeps(source, done) for done in (1, 2, STEPS - 2, STEPS - 1)] == ["kept"] * 4
    finally:
      source.close()


@pytest.mark.spec
def test_the_sampling_left_before_a_cut_counts_the_cut_batch_up_to_its_cut_call():
  """A checkpoint at a position that cuts a batch waits for that batch's micro-batches before the cut's call and
  that call (whose generation is kept part way through it), not the whole batch; a batch carried whole counts in
  full; a cut at a call's start needs no more of it (the negative controls)."""
  from orchestrator.live.rollout_batches import SampledBatches

  batches = SampledBatches(False, 8)
  batches.publish(3, 0, ([], [], [], 0, None), 0.5)  # one micro-batch of batch 3 sampled, at 0.5 s each
  assert batches.seconds_left([3]) == 7 * 0.5
  assert batches.seconds_left([3], {3: 2 + 2}) == 3 * 0.5  # cut in the call at micro-batch 2, two a call
  assert batches.seconds_left([3], {3: 1}) == 0.0  # everything the cut needs is there
  assert batches.seconds_left([2, 3], {3: 4}) == (8 + 3) * 0.5  # batch 2 carried whole

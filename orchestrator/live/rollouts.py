"""Live rollouts: a sampler thread that produces each sampled batch's micro-batches ahead, under a staleness bound.

A sampled batch serves ``batch_steps`` × ``epochs`` optimizer steps (one by
default: a batch is then a step); batch b is sampled with weights version
``max(0, (b - S) · steps_per_batch)`` (``S`` = ``max_staleness``; version v =
the weights after v updates), never "whatever is newest", and every
micro-batch's sampling seed derives from (seed, batch, micro-batch). Which
micro-batches each step trains on, and in which order, is
``rollout_batches.BatchSchedule``'s. So what a step trains on is a fixed
function of the recipe — the same in every boundary mode — and only *when* it
is ready varies.

With ``S = 0`` a batch needs the weights after the last step of the batch
before: its rollouts cannot exist before that boundary's weight sync, so
nothing can be staged there (``blocked_on_sync``); the other boundaries of a
batch train on rollouts already sampled. With ``S >= 1`` batch b+1 is sampled
while batch b trains.

Batches stream at micro-batch granularity: the sampler samples a batch's
micro-batches in training order (pass 0's) and publishes each as it is done, so
step s+1 can be taken (and its first micro-batch staged) once that micro-batch
exists; its later ones are waited for, if at all, when the program dispatches
them (``micro_batch_ready``; the seconds go in that step's ``RolloutStats``).
A later pass reshuffles the whole batch, which its first pass has waited for.

The source is an iterator of steps like the others (``orchestrator.data.sources``):
``next`` blocks until the next step's first micro-batch is sampled; ``get_state``
is its position, and ``state_json`` adds the already-sampled batches a resumed run
cannot sample again (their weights are older than the checkpoint's: the rest of
the batch a checkpoint lands inside, and those sampled ahead), which a
checkpoint first waits for (``ready_to_checkpoint``). The program never blocks in them:
it first polls ``ready`` (or ``ready_to_checkpoint``) with a timeout, looking
at its stop flag in between, so a stuck sampler cannot hold a stop.

A position near the end of the run carries batches past it too: a run of N steps
extended later (``run_rl --resume DIR --steps M``) trains step N first, and at
staleness S >= 1 that step needs weights older than N, which no checkpoint of
N steps holds. So a checkpoint whose position needs such batches asks the
sampling thread for them (``ready_to_checkpoint``) and keeps them; nothing past
the end is sampled for a run that writes no such checkpoint. A run whose steps
end inside a batch samples that batch whole and trains part of it; its last
checkpoint carries the batch, so an extension continues inside it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from orchestrator.contract import HeldOutScore, RolloutStats, SourceStateError, WeightTransfer
from orchestrator.data.trajectory import Trajectory, TrajectoryGroup
from orchestrator.live.evaluations import HeldOutEvaluations
from orchestrator.live.placement import keep
from orchestrator.tasks.rewards import Reward, task_reward
from orchestrator.live.rollout_batches import BatchRollouts, BatchSchedule, SampledBatches
from orchestrator.live.rollout_positions import RolloutPositions
from orchestrator.live.rollout_thread import RolloutThread
from orchestrator.live.sampler import LiveSampler
from orchestrator.live.shared_sampler import WAIT_POLL_S, SharedSampler
from orchestrator.live.weight_versions import WeightVersions

#: How long ``close`` waits for the sampling thread to end: it ends when its sampling call in progress returns
#: (a call takes seconds at the recipes' shapes, and a reward function's wait is cancelled); one still in a call
#: after a minute is stuck, and is left behind.
CLOSE_JOIN_TIMEOUT_S = 60.0


class RolloutError(RuntimeError):
  """The rollout thread failed; the message names the step it was sampling."""


@dataclasses.dataclass(frozen=True)
class LiveShape:
  """How many rollouts a step holds, and how many steps a sampled batch serves."""

  steps: int
  micro_batches_per_step: int
  groups_per_micro_batch: int
  generations_per_group: int
  max_staleness: int
  temperature: float = 1.0
  seed: int = 0
  batch_steps: int = 1  # optimizer steps (mini-batches) per pass over a sampled batch
  epochs: int = 1  # passes over a sampled batch
  micro_batches_per_call: int = 1  # micro-batches the sampler generates in one call (divides a batch's)
  top_p: float = 1.0  # nucleus sampling's mass (1.0: off)
  top_k: int = 0  # the most likely ids sampled from (0: off)
  stop: tuple[str, ...] = ()  # strings that end a completion (the token completing one is kept, its text cut)
  advantage_scaling: str = "group"  # a group's advantages over its reward std, or not ("none": Dr. GRPO)
  # In-flight updates (rollouts.in_flight_updates): a call decodes in chunks of decode_chunk_tokens tokens,
  # decode_chunks of them (schema.decode_chunk_size, schema.decode_chunks), each on BatchSchedule.chunk_version.
  in_flight_updates: bool = False
  decode_chunk_tokens: int = 0  # 0: whole (no in-flight updates)
  decode_chunks: int = 1
  # The model's vocabulary: a generation a checkpoint carries must hold ids below it (None: not checked)
  vocab_size: int | None = None

  def sampling_settings(self) -> dict[str, Any]:
    """The sampler's keyword arguments for how each token is drawn and where a completion ends
    (``LiveSampler.sample``), as every sampled completion of the run takes them."""
    return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "stop": self.stop}

  @property
  def schedule(self) -> BatchSchedule:
    return BatchSchedule(self.micro_batches_per_step, self.generations_per_group, self.batch_steps, self.epochs,
                         self.max_staleness, self.seed, in_flight_updates=self.in_flight_updates,
                         micro_batches_per_call=self.micro_batches_per_call, chunks_per_call=self.decode_chunks)

  @property
  def micro_batches_per_batch(self) -> int:
    return self.batch_steps * self.micro_batches_per_step


class LiveRollouts:
  """Samples batches on a background thread, each from its fixed weights version, and hands them out a step at
  a time; a ``StepSource`` and a ``LiveSource`` (``orchestrator.contract``) on a ``tasks.Task``, trained on
  ``reward`` (default: the task's own; ``shared_sampler.score_micro_batch``). With ``record``, every batch
  taken is kept for ``recorded_steps``. It holds the batches sampled and taken (``SampledBatches``), the
  staleness schedule and the weights kept for it (``WeightVersions``), one condition guarding both, the
  thread that samples them (``RolloutThread``), the sampler, which evaluation takes in turns with the sampling
  thread (``SharedSampler``), and the evaluations on held-out prompts (``HeldOutEvaluations``), which answer
  ``LiveSource``'s part of them."""

  kind = "live"

  def __init__(self, sampler: LiveSampler, task, shape: LiveShape, *, record: bool = False,
               reward: Reward | None = None, sampler_where: str | None = None, on_trainer_devices: bool = False):
    self._shared = SharedSampler(sampler, task, reward if reward is not None else task_reward(task), shape)
    self._evaluations = HeldOutEvaluations(self._shared, task, shape)
    self.sampler_where = sampler_where  # where the sampler runs and why, in words (the run's opening line)
    self.on_trainer_devices = on_trainer_devices  # the sampler computes on the trainer's devices (shared)
    self.shape = shape
    self._cond = threading.Condition()
    self._schedule = shape.schedule
    self._versions = WeightVersions(self._schedule, steps=shape.steps)  # guarded by _cond
    self._batches = SampledBatches(record, shape.micro_batches_per_batch)  # guarded by _cond
    self._run_batches = self._schedule.batches_for(shape.steps)
    self._sampling = RolloutThread(self._shared, shape, self._schedule, self._cond, self._versions, self._batches,
                                   until_batch=self._run_batches)
    self._positions = RolloutPositions(self._schedule, self._versions, self._batches, self._sampling, shape,
                                       run_batches=self._run_batches)  # guarded by _cond
    self._next = 0
    self._last_wait_s = 0.0
    self._take_wait_s = 0.0  # the part of that wait spent before ``next``, in ``ready``

  @property
  def sampler(self) -> LiveSampler:
    """The sampler this source draws from (a benchmark reuses one compiled sampler across arms)."""
    return self._shared.sampler

  def version_for(self, step: int) -> int:
    """The weights version ``step`` samples with."""
    return self._versions.version_for(step)

  def blocked_on_sync(self, step: int) -> bool:
    """True when ``step``'s rollouts need weights that have not been synced yet."""
    with self._cond:
      return self._versions.blocked_on_sync(step)

  def sync(self, version: int, weights: Any) -> WeightTransfer | None:
    """Keeps the weights of ``version`` for the steps that need them (``placement.keep``: on host, or on a split
    sampler's devices, returning what the transfer moved). It never waits for the sampler: the copy waits only
    for the update that produced the weights, and the condition's lock is never held while sampling. Weights no
    batch samples with (inside a batch of several steps) are not copied at all: every process of a job skips
    the same ones."""
    if weights is None:
      return None
    kept, moved = None, None
    if self._versions.samples_with(int(version)):
      kept, moved = keep(self._shared.sampler.placement, weights,
                         on_device=getattr(self._shared.sampler, "takes_device_arrays", False))
    with self._cond:
      self._versions.keep(int(version), kept)
      self._cond.notify_all()
    return moved

  def eval_prompt_count(self, asked: int) -> int:
    """``asked``, or what a finite held-out split holds if fewer (``HeldOutEvaluations.eval_prompt_count``)."""
    return self._evaluations.eval_prompt_count(asked)

  def held_out_count(self, limit: int) -> int:
    """The prompts the held-out split holds, counted up to ``limit`` (``HeldOutEvaluations.held_out_count``)."""
    return self._evaluations.held_out_count(limit)

  def evaluate(self, weights: Any, version: int, prompts: int, *, pass_k: int = 0,
               stop: Callable[[], Any] | None = None) -> HeldOutScore | None:
    """``HeldOutEvaluations.evaluate``: on the sampler in its turn between two micro-batches."""
    return self._evaluations.evaluate(weights, version, prompts, pass_k=pass_k, stop=stop)

  def keep_start_weights(self, weights: Any) -> None:
    """A host copy of version 0's weights, for batches sampled after an evaluation took the sampler's own
    (``HeldOutEvaluations.keep_start_weights``)."""
    self._evaluations.keep_start_weights(weights)

  def __iter__(self) -> "LiveRollouts":
    return self

  def __next__(self) -> Sequence[list[Trajectory]]:
    """The next step's micro-batches once its first is sampled: a list, or, while the later ones are still
    being sampled, a ``StreamedPayloads`` whose items wait for theirs."""
    self._sampling.start()
    with self._cond:
      step = self._next
      if step >= self.shape.steps:
        raise StopIteration
      start, ready = time.perf_counter(), self._sampled(step, 0)
      self._cond.wait_for(lambda: self._sampled(step, 0) or self._sampling.error is not None)
      self._last_wait_s = self._take_wait_s + (0.0 if ready else time.perf_counter() - start)
      self._take_wait_s = 0.0
      self._raise_error()
      self._next += 1
      self._forget_before(step - self.shape.max_staleness - 2)
      batch = self._schedule.batch_of(step)
      self._batches.take(batch)
      if self._batches.complete(batch) is None:
        return StreamedPayloads(self, step, self.shape.micro_batches_per_step)
      return self._schedule.mini_batch(step, self._batches.micro_batches_of(batch))

  def _sampled(self, step: int, index: int) -> bool:
    """Under the condition: whether micro-batch ``index`` of ``step`` can be had without waiting."""
    batch = self._schedule.batch_of(step)
    return len(self._batches.micro_batches_of(batch)) > self._schedule.sampled_index(step, index)

  def _forget_before(self, step: int) -> None:
    """Drops the batch that ends at ``step``: no position from now on can carry it."""
    if step >= 0 and (step + 1) % self._schedule.steps_per_batch == 0:
      batch = self._schedule.batch_of(step)
      first = self._schedule.first_step(batch)
      self._batches.forget(batch, range(first, first + self._schedule.steps_per_batch))
      self._sampling.forget(batch)

  def micro_batch(self, step: int, index: int) -> list[Trajectory]:
    """Micro-batch ``index`` of a taken ``step``, waiting until it is sampled (``micro_batch_ready``'s wait).

    Raises:
      RolloutError: the sampling thread failed, or the source was closed first.
    """
    while not self.micro_batch_ready(step, index, WAIT_POLL_S):
      with self._cond:
        if self._sampling.closed:
          raise RolloutError(f"the rollout source was closed before step {step}'s micro-batch {index} was sampled")
    with self._cond:
      return self._schedule.mini_batch(step, self._batches.micro_batches_of(self._schedule.batch_of(step)))[index]

  def micro_batch_ready(self, step: int, index: int, timeout_s: float) -> bool:
    """Waits at most ``timeout_s`` until micro-batch ``index`` of ``step`` is sampled; True then. The seconds
    waited count in that step's ``RolloutStats.micro_batch_wait_s``. Raises the sampling thread's error."""
    with self._cond:
      done, waited = self._wait_until(lambda: self._sampled(step, index), timeout_s)
      self._batches.micro_batch_wait_s[step] = self._batches.micro_batch_wait_s.get(step, 0.0) + waited
      return done

  @property
  def last_wait_s(self) -> float:
    """How long taking the last step waited for it to be sampled (``ready``'s and ``get_state``'s waits before
    ``next`` included: the program polls ``ready`` first)."""
    return self._last_wait_s

  def recorded_steps(self) -> list[BatchRollouts] | None:
    """Every sampled batch taken so far (once, whatever its passes), when built with ``record``; None
    otherwise."""
    return self._batches.recorded

  def count_steps(self, limit: int) -> int:
    """The steps this source samples (its shape's), up to ``limit``."""
    return min(limit, self.shape.steps)

  def step_samples(self, step: int, count: int) -> list[dict[str, Any]]:
    """Up to ``count`` of a taken ``step``'s completions to read (``BatchRollouts.samples``); [] if it has none."""
    with self._cond:
      rollouts = self._batches.batches.get(self._schedule.batch_of(step))
      return [] if rollouts is None else rollouts.samples(self._schedule, step, count, self.sampler.tokenizer)

  def step_stats(self, step: int) -> RolloutStats | None:
    with self._cond:
      batch, waited = self._schedule.batch_of(step), self._batches.micro_batch_wait_s.get(step, 0.0)
      rollouts = self._batches.batches.get(batch) if batch in self._batches.taken else None
      if rollouts is None or not self._sampled(step, self.shape.micro_batches_per_step - 1):
        return None  # not this run's, or still streaming
      return rollouts.stats(self._schedule, step, waited)

  def check(self) -> None:
    """Raises the rollout thread's error, if it failed (the program checks at every boundary)."""
    with self._cond:
      self._raise_error()

  def sampling_on_trainer_devices_s(self, start: float, end: float) -> float | None:
    """The seconds of [``start``, ``end``] the sampling thread's calls ran, where the sampler computes on the
    trainer's devices (``on_trainer_devices``); None elsewhere. Evaluations are not counted: a step that waited
    for one is left out of the measured saving by its own field (``eval_s``)."""
    return self._sampling.spans.seconds_within(start, end) if self.on_trainer_devices else None

  def _raise_error(self) -> None:
    error = self._sampling.error
    if error is not None:
      raise RolloutError(str(error)) from error

  def get_state(self) -> dict[str, Any]:
    """The position before the next step. Called before every step is taken, so it waits for nothing:
    ``state_json`` adds the sampled steps the position carries when a checkpoint needs it."""
    self._sampling.start()
    with self._cond:
      return {"kind": self.kind, "next_step": self._next}

  def state_json(self, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as JSON, for a checkpoint's metadata, with the batches sampled from weights older than its
    position's (their arrays as lists), which ``ready_to_checkpoint`` waited for; past the source's last step
    too, as far as they are sampled (a run extended from this checkpoint trains them first); with in-flight
    updates the batch it cuts in part, with the generation under way there (``RolloutPositions``).

    Raises:
      RuntimeError: a batch the position must carry is not sampled yet (``ready_to_checkpoint`` comes first).
    """
    position = state["next_step"]
    with self._cond:
      carried = self._positions.carried_json(position)
    return {"kind": self.kind, "next_step": position, **carried}

  def ready(self, step: int, timeout_s: float) -> bool:
    """Waits at most ``timeout_s`` until taking ``step`` (``get_state``, then ``next``) would not wait for
    sampling, i.e. its first micro-batch is sampled; True then, False on the timeout. Raises the sampling
    thread's error."""
    self._sampling.start()
    with self._cond:
      if not self._next <= step < self.shape.steps:
        return True
      done, waited = self._wait_until(lambda: self._sampled(step, 0), timeout_s)
      self._take_wait_s += waited  # the step's rollout wait (``last_wait_s``): the policy must not judge it
      return done

  def ready_to_checkpoint(self, position: int, timeout_s: float, *, extendable: bool = True) -> bool:
    """Waits at most ``timeout_s`` until a checkpoint at ``position`` has every sampled batch it must carry
    (see ``LiveSource.ready_to_checkpoint``). Those past the end, asked of the sampling thread here, are left
    out when they cannot be sampled any more (weights older than this source's: its checkpoint lacked them)."""
    self._sampling.start()
    with self._cond:
      carried = self._versions.carried(position)
      needed = [b for b in carried if b < self._run_batches]  # a taken one too: it may still be streaming
      # past the end too (with in-flight updates the last of them sampled up to the position's cut, whose later
      # chunks need weights no sync after the run's last step delivers: an extended run samples them)
      past_end = [b for b in carried if b >= self._run_batches]
      if extendable and all(self._batches.complete(b) or self._versions.can_sample(b) for b in past_end):
        needed += past_end
        if past_end:
          self._sampling.sample_until(past_end[-1] + 1)
      return self._wait_until(lambda: all(self._positions.carriable(b, position) for b in needed), timeout_s)[0]

  def sampling_left_s(self, position: int) -> float | None:
    """Seconds, at the sampler's recent pace, until a checkpoint at ``position`` has the run's own sampled
    batches it must carry (``SampledBatches.seconds_left``): a batch the position cuts up to its cut's call (that
    call's generation is kept part way through it)."""
    with self._cond:
      cut = self._positions.cut(position)
      needed = {} if cut is None else {cut[0]: cut[1] + (self.shape.micro_batches_per_call if cut[2] else 0)}
      return self._batches.seconds_left([b for b in self._versions.carried(position) if b < self._run_batches],
                                        needed)

  def _wait_until(self, sampled: Callable[[], bool], timeout_s: float) -> tuple[bool, float]:
    """Under the condition: waits at most ``timeout_s`` until ``sampled()``; whether it is, and the seconds
    waited (0.0 when nothing was missing). Raises the sampling thread's error."""
    start, waited = time.perf_counter(), not sampled()
    done = self._cond.wait_for(lambda: self._sampling.error is not None or sampled(), timeout=max(0.0, timeout_s))
    self._raise_error()
    return bool(done), time.perf_counter() - start if waited else 0.0

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues from ``get_state()``'s output; call before the first ``next`` and sync the checkpoint's weights."""
    if not isinstance(state, dict) or state.get("kind") != self.kind:
      raise SourceStateError(f"a saved rollout position of kind {state.get('kind') if isinstance(state, dict) else state!r}"
                             f" cannot restore a {self.kind!r} source")
    if self._sampling.thread is not None:
      raise RuntimeError("set_state must come before the first step is taken")
    self._next = int(state["next_step"])
    self._positions.restore(self._next, state)
    self._versions.restart_at(self._next)  # the checkpoint's weights; sync() delivers them

  def carried_payloads(self) -> list[tuple[str, int, list[Trajectory]]]:
    """(the batch named, micro-batch, payload) of each sampled batch a restored position carries (checked
    before a resume)."""
    return [(self._schedule.describe(b), i, p) for b, i, p in self._batches.ready_payloads()]

  def close(self, timeout_s: float = CLOSE_JOIN_TIMEOUT_S) -> None:
    """Stops the sampling thread and waits for it: one inside JAX at exit aborts the process (exit 134)."""
    self._sampling.close(timeout_s)

  def release(self) -> None:
    """Closes the sampler (``LiveSampler.close``: a sampler process exits); after ``close`` and the evaluations."""
    self._shared.sampler.close()



class StreamedPayloads(Sequence):
  """A taken step's micro-batches while its later ones are still being sampled (pass 0 of its batch): item i
  waits for micro-batch i (``LiveRollouts.micro_batch``); its length is the step's micro-batch count from the
  start."""

  def __init__(self, source: LiveRollouts, step: int, micro_batches: int):
    self._source, self._step, self._len = source, step, micro_batches

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index):
    if not isinstance(index, int):
      raise TypeError(f"a streamed step's micro-batches are indexed by int, not {type(index).__name__}")
    if not 0 <= index < self._len:
      raise IndexError(f"micro-batch {index} of a step of {self._len}")
    return self._source.micro_batch(self._step, index)


def recorded_groups(batches: list[BatchRollouts], generations: int):
  """The groups of recorded batches, as a recording stores them (``orchestrator.data.recording``): each
  sampled group once, however many passes trained on it."""
  for rollouts in batches:
    for payload, rewards in zip(rollouts.payloads, rollouts.rewards):
      for first in range(0, len(payload), generations):
        group = payload[first:first + generations]
        yield TrajectoryGroup(group[0].group_id, group[0].prompt_ids, [t.completion_ids for t in group],
                              np.asarray(rewards[first:first + generations], np.float32),
                              np.asarray([t.advantage for t in group], np.float32),
                              [t.old_logprobs for t in group], np.arange(len(group), dtype=np.int32),
                              rollouts.weights_version,
                              None if group[0].routing is None else [t.routing for t in group])

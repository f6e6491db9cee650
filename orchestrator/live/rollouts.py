"""Live rollouts: a sampler thread that produces each step's micro-batches ahead, under a staleness bound.

Step ``s`` trains on rollouts sampled with weights version ``max(0, s - S)``
(``S`` = ``max_staleness``; version v = the weights after v updates), never
"whatever is newest", and every micro-batch's sampling seed derives from
(seed, step, micro-batch). So what a step trains on is a fixed function of the
recipe — the same in every boundary mode — and only *when* it is ready varies.

With ``S = 0`` step s+1 needs the weights of update s: its rollouts cannot
exist before that boundary's weight sync, so nothing can be staged there
(``blocked_on_sync``). With ``S >= 1`` they are sampled while step s trains.

Steps stream at micro-batch granularity: the sampler samples a step's
micro-batches in training order and publishes each as it is done, so step s+1
can be taken (and its first micro-batch staged) once that micro-batch exists;
its later ones are waited for, if at all, when the program dispatches them
(``micro_batch_ready``; the seconds go in that step's ``RolloutStats``).

The source is an iterator of steps like the others (``orchestrator.data.sources``):
``next`` blocks until the next step's first micro-batch is sampled; ``get_state``
is its position, and ``state_json`` adds the already-sampled steps a resumed run
cannot sample again (their weights are older than the checkpoint's), which a
checkpoint first waits for (``ready_to_checkpoint``). The program never blocks in them:
it first polls ``ready`` (or ``ready_to_checkpoint``) with a timeout, looking
at its stop flag in between, so a stuck sampler cannot hold a stop.

A position near the end of the run carries steps past it too: a run of N steps
extended later (``run_rl --resume DIR --steps M``) trains step N first, and at
staleness S >= 1 that step needs weights version N - S, which no checkpoint of
N steps holds. So a checkpoint whose position needs such steps asks the
sampling thread for them (``ready_to_checkpoint``) and keeps them; nothing past
the end is sampled for a run that writes no such checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from orchestrator.contract import RolloutStats, SourceStateError, WeightTransfer
from orchestrator.data.trajectory import Trajectory, TrajectoryGroup
from orchestrator.live.placement import keep
from orchestrator.live.rewards import CallCancelled, Reward, task_reward
from orchestrator.live.sampler import LiveSampler
from orchestrator.live.shared_sampler import WAIT_POLL_S, SharedSampler
from orchestrator.live.weight_versions import WeightVersions

log = logging.getLogger("step_boundary.rollouts")


class RolloutError(RuntimeError):
  """The rollout thread failed; the message names the step it was sampling."""


@dataclasses.dataclass
class StepRollouts:
  """One step's micro-batches and what sampling them measured."""

  step: int
  payloads: list[list[Trajectory]]
  rewards: list[list[float]]  # per trajectory, aligned with payloads
  weights_version: int
  reward_mean: float
  reward_std: float
  accuracy: float
  sampled_tokens: int
  sampling_s: float

  def stats(self, micro_batch_wait_s: float = 0.0) -> RolloutStats:
    return RolloutStats(weights_version=self.weights_version, staleness=self.step - self.weights_version,
                        reward_mean=self.reward_mean, reward_std=self.reward_std, accuracy=self.accuracy,
                        sampled_tokens_per_s=self.sampled_tokens / self.sampling_s if self.sampling_s > 0 else None,
                        micro_batch_wait_s=micro_batch_wait_s)

  def to_json(self) -> dict[str, Any]:
    payloads = [[{"prompt_ids": t.prompt_ids.tolist(), "completion_ids": t.completion_ids.tolist(),
                  "advantage": float(t.advantage), "old_logprobs": t.old_logprobs.tolist(), "group_id": t.group_id}
                 for t in payload] for payload in self.payloads]
    return dict(dataclasses.asdict(self), payloads=payloads)

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> "StepRollouts":
    payloads = [[Trajectory(np.asarray(t["prompt_ids"], np.int32), np.asarray(t["completion_ids"], np.int32),
                            float(t["advantage"]), np.asarray(t["old_logprobs"], np.float32), int(t["group_id"]))
                 for t in payload] for payload in data["payloads"]]
    return cls(**dict(data, payloads=payloads))


@dataclasses.dataclass(frozen=True)
class LiveShape:
  """How many rollouts a step holds."""

  steps: int
  micro_batches_per_step: int
  groups_per_micro_batch: int
  generations_per_group: int
  max_staleness: int
  temperature: float = 1.0
  seed: int = 0


class LiveRollouts:
  """Samples steps on a background thread, each from its fixed weights version; a ``StepSource`` and a
  ``LiveSource`` (``orchestrator.contract``) on a ``tasks.Task``, trained on ``reward`` (default: the task's own;
  ``shared_sampler.score_micro_batch``). With ``record``, every step taken is kept for ``recorded_steps``.

  It holds the steps sampled and taken (``SampledSteps``), the staleness schedule and the weights kept for it
  (``WeightVersions``) and the sampler, which evaluation takes in turns with the sampling thread
  (``SharedSampler``); one condition guards the first two."""

  kind = "live"

  def __init__(self, sampler: LiveSampler, task, shape: LiveShape, *, record: bool = False,
               reward: Reward | None = None):
    self._shared = SharedSampler(sampler, task, reward if reward is not None else task_reward(task), shape)
    self.shape = shape
    self._cond = threading.Condition()
    self._versions = WeightVersions(steps=shape.steps, max_staleness=shape.max_staleness)  # guarded by _cond
    self._steps = SampledSteps(record)  # guarded by _cond
    self._next = 0
    self._produce_from = 0
    self._produce_until = shape.steps  # raised by a checkpoint that carries steps past the end
    self._error: BaseException | None = None
    self._closed = False
    self._thread: threading.Thread | None = None
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
    for the update that produced the weights, and the condition's lock is never held while sampling."""
    if weights is None:
      return None
    kept, moved = keep(self._shared.sampler.placement, weights)
    with self._cond:
      self._versions.keep(int(version), kept)
      self._cond.notify_all()
    return moved

  def __iter__(self) -> "LiveRollouts":
    return self

  def __next__(self) -> Sequence[list[Trajectory]]:
    """The next step's micro-batches once its first is sampled: a list, or, while the later ones are still
    being sampled, a ``StreamedPayloads`` whose items wait for theirs."""
    self._start()
    with self._cond:
      step = self._next
      if step >= self.shape.steps:
        raise StopIteration
      start, ready = time.perf_counter(), self._steps.first_sampled(step)
      self._cond.wait_for(lambda: self._steps.first_sampled(step) or self._error is not None)
      self._last_wait_s = self._take_wait_s + (0.0 if ready else time.perf_counter() - start)
      self._take_wait_s = 0.0
      self._raise_error()
      self._next += 1
      self._steps.forget(step - self.shape.max_staleness - 2)
      taken = self._steps.take(step)
      return taken if taken is not None else StreamedPayloads(self, step, self.shape.micro_batches_per_step)

  def micro_batch(self, step: int, index: int) -> list[Trajectory]:
    """Micro-batch ``index`` of a taken ``step``, waiting until it is sampled (``micro_batch_ready``'s wait).

    Raises:
      RolloutError: the sampling thread failed, or the source was closed first.
    """
    while not self.micro_batch_ready(step, index, WAIT_POLL_S):
      with self._cond:
        if self._closed:
          raise RolloutError(f"the rollout source was closed before step {step}'s micro-batch {index} was sampled")
    with self._cond:
      return self._steps.micro_batches_of(step)[index]

  def micro_batch_ready(self, step: int, index: int, timeout_s: float) -> bool:
    """Waits at most ``timeout_s`` until micro-batch ``index`` of ``step`` is sampled; True then. The seconds
    waited count in that step's ``RolloutStats.micro_batch_wait_s``. Raises the sampling thread's error."""
    with self._cond:
      done, waited = self._wait_until(lambda: len(self._steps.micro_batches_of(step)) > index, timeout_s)
      self._steps.micro_batch_wait_s[step] = self._steps.micro_batch_wait_s.get(step, 0.0) + waited
      return done

  @property
  def last_wait_s(self) -> float:
    """How long taking the last step waited for it to be sampled (``ready``'s and ``get_state``'s waits before
    ``next`` included: the program polls ``ready`` first)."""
    return self._last_wait_s

  def recorded_steps(self) -> list[StepRollouts] | None:
    """Every step taken so far, when built with ``record``; None otherwise."""
    return self._steps.recorded

  def count_steps(self, limit: int) -> int:
    """The steps this source samples (its shape's), up to ``limit``."""
    return min(limit, self.shape.steps)

  def step_stats(self, step: int) -> RolloutStats | None:
    with self._cond:
      rollouts, waited = self._steps.delivered.get(step), self._steps.micro_batch_wait_s.get(step, 0.0)
    return rollouts.stats(waited) if rollouts else None

  def check(self) -> None:
    """Raises the rollout thread's error, if it failed (the program checks at every boundary)."""
    with self._cond:
      self._raise_error()

  def _raise_error(self) -> None:
    if self._error is not None:
      raise RolloutError(str(self._error)) from self._error

  def get_state(self) -> dict[str, Any]:
    """The position before the next step. Called before every step is taken, so it waits for nothing:
    ``state_json`` adds the sampled steps the position carries when a checkpoint needs it."""
    self._start()
    with self._cond:
      return {"kind": self.kind, "next_step": self._next}

  def state_json(self, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as JSON, for a checkpoint's metadata, with the steps sampled from weights older than its
    position's (their arrays as lists), which ``ready_to_checkpoint`` waited for; past the source's last step
    too, as far as they are sampled (a run extended from this checkpoint trains them first).

    Raises:
      RuntimeError: a step the position must carry is not sampled yet (``ready_to_checkpoint`` comes first).
    """
    with self._cond:
      sampled = self._steps.carried(state["next_step"], self._versions.carried(state["next_step"]), self.shape.steps)
    return {"kind": self.kind, "next_step": state["next_step"], "sampled": [r.to_json() for r in sampled]}

  def ready(self, step: int, timeout_s: float) -> bool:
    """Waits at most ``timeout_s`` until taking ``step`` (``get_state``, then ``next``) would not wait for
    sampling, i.e. its first micro-batch is sampled; True then, False on the timeout. Raises the sampling
    thread's error."""
    self._start()
    with self._cond:
      if not self._next <= step < self.shape.steps:
        return True
      done, waited = self._wait_until(lambda: self._steps.first_sampled(step), timeout_s)
      self._take_wait_s += waited  # the step's rollout wait (``last_wait_s``): the policy must not judge it
      return done

  def ready_to_checkpoint(self, position: int, timeout_s: float, *, extendable: bool = True) -> bool:
    """Waits at most ``timeout_s`` until a checkpoint at ``position`` has every sampled step it must carry (see
    ``LiveSource.ready_to_checkpoint``). Those past the end, asked of the sampling thread here, are left out when
    they cannot be sampled any more (weights older than this source's: its checkpoint lacked them)."""
    self._start()
    with self._cond:
      carried = self._versions.carried(position)
      needed = [s for s in carried if s < self.shape.steps]  # a taken one too: it may still be streaming
      past_end = [s for s in carried if s >= self.shape.steps]
      if extendable and all(self._steps.complete(s) or self._versions.can_sample(s) for s in past_end):
        needed += past_end
        if past_end and past_end[-1] >= self._produce_until:
          self._produce_until = past_end[-1] + 1
          self._cond.notify_all()
      return self._wait_until(lambda: all(self._steps.complete(s) for s in needed), timeout_s)[0]

  def _wait_until(self, sampled: Callable[[], bool], timeout_s: float) -> tuple[bool, float]:
    """Under the condition: waits at most ``timeout_s`` until ``sampled()``; whether it is, and the seconds
    waited (0.0 when nothing was missing). Raises the sampling thread's error."""
    start, waited = time.perf_counter(), not sampled()
    done = self._cond.wait_for(lambda: self._error is not None or sampled(), timeout=max(0.0, timeout_s))
    self._raise_error()
    return bool(done), time.perf_counter() - start if waited else 0.0

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues from ``get_state()``'s output; call before the first ``next`` and sync the checkpoint's weights."""
    if not isinstance(state, dict) or state.get("kind") != self.kind:
      raise SourceStateError(f"a saved rollout position of kind {state.get('kind') if isinstance(state, dict) else state!r}"
                             f" cannot restore a {self.kind!r} source")
    if self._thread is not None:
      raise RuntimeError("set_state must come before the first step is taken")
    self._next = int(state["next_step"])
    carried = self._steps.restore(state["sampled"])
    # Steps that need weights older than the checkpoint's cannot be sampled again: the state must carry them.
    # It may carry more (steps past the end of the run that wrote it, which this run may never reach).
    owed = [s for s in self._versions.carried(self._next) if s < self.shape.steps]
    if carried != list(range(self._next, self._next + len(carried))) or not set(owed) <= set(carried):
      raise SourceStateError(f"the saved rollout position before step {self._next} carries steps {carried},"
                             f" but max_staleness {self.shape.max_staleness} needs {owed}; the run cannot be resumed"
                             " from this checkpoint")
    self._produce_from = self._next + len(carried)
    self._versions.restart_at(self._next)  # the checkpoint's weights; sync() delivers them

  def carried_payloads(self) -> list[tuple[int, int, list[Trajectory]]]:
    """(step, micro-batch, payload) of each step a restored position carries (checked before a resume)."""
    return self._steps.ready_payloads()

  def _start(self) -> None:
    if self._thread is None:
      self._thread = threading.Thread(target=self._produce, name="rollouts", daemon=True)
      self._thread.start()

  def close(self, timeout_s: float = 60.0) -> None:
    """Stops the sampling thread and waits for it: one inside JAX at exit aborts the process (exit 134)."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()
    if self._thread not in (None, threading.current_thread()):
      self._thread.join(timeout_s)

  def _produce(self) -> None:
    step = self._produce_from
    try:
      while True:
        version = self._versions.version_for(step)
        with self._cond:
          # Past the run's last step only when a checkpoint asks (``_produce_until``); close() ends the wait.
          self._cond.wait_for(lambda: self._closed or (step < self._produce_until
                                                       and self._versions.available(version)))
          if self._closed:
            return
          weights = self._versions.take(version)
        start, parts = time.perf_counter(), []
        for i in range(self.shape.micro_batches_per_step):  # in training order, each published when done
          parts.append(self._shared.sample_micro_batch(step, i, version, weights, cancelled=lambda: self._closed))
          with self._cond:
            self._steps.publish(step, parts, lambda: assemble_step(step, version, parts, time.perf_counter() - start),
                                taken=step < self._next, micro_batches=self.shape.micro_batches_per_step)
            self._cond.notify_all()
        step += 1
    except CallCancelled as e:  # closed while a reward function ran: the run ends without waiting for it
      log.warning("[rollouts] the run ended while sampling waited for %s; it was left running", e)
    except BaseException as e:  # pylint: disable=broad-except  # surfaced at the next boundary
      with self._cond:
        self._error = RuntimeError(f"the rollout thread failed while sampling step {step}: {type(e).__name__}: {e}")
        self._cond.notify_all()

  def eval_prompt_count(self, asked: int) -> int:
    """``asked``, or what a finite evaluation split holds (a dataset's) if fewer: no prompt counts twice."""
    return self._shared.eval_prompt_count(asked)

  def evaluate(self, weights: Any, version: int, prompts: int, *,
               stop: Callable[[], Any] | None = None) -> float | None:
    """Greedy accuracy on ``prompts`` held-out problems with the given weights, in the sampler's turn between
    two micro-batches (``SharedSampler.evaluate``: None when ``stop()`` came first)."""
    return self._shared.evaluate(weights, version, prompts, stop=stop)


class SampledSteps:
  """What the sampling thread has produced and the loop has taken, by step; the source's condition guards it.

  Attributes:
    ready: complete steps not taken yet. delivered: complete steps taken (the last few).
    partial: the step being sampled, its micro-batches so far (in training order).
    micro_batch_wait_s: per taken step, the seconds spent waiting for its micro-batches after the first.
    recorded: every step taken, in order, once complete (None when the run records no rollouts).
  """

  def __init__(self, record: bool):
    self.ready: dict[int, StepRollouts] = {}
    self.delivered: dict[int, StepRollouts] = {}
    self.partial: dict[int, list[list[Trajectory]]] = {}
    self.micro_batch_wait_s: dict[int, float] = {}
    self.recorded: list[StepRollouts] | None = [] if record else None

  def complete(self, step: int) -> StepRollouts | None:
    """``step`` when all its micro-batches are sampled (taken or not); else None."""
    return self.ready.get(step) or self.delivered.get(step)

  def micro_batches_of(self, step: int) -> list[list[Trajectory]]:
    """The micro-batches of ``step`` sampled so far."""
    done = self.complete(step)
    return done.payloads if done is not None else self.partial.get(step, [])

  def first_sampled(self, step: int) -> bool:
    return bool(self.micro_batches_of(step))

  def carried(self, position: int, steps: list[int], run_steps: int) -> list[StepRollouts]:
    """The complete ``steps`` a position before ``position`` carries; past the run's ``run_steps`` as far as
    they are sampled.

    Raises:
      RuntimeError: one before the end is not sampled yet.
    """
    sampled = []
    for s in steps:
      rollouts = self.complete(s)
      if rollouts is None and s < run_steps:
        raise RuntimeError(f"the position before step {position} must carry step {s}, which is not"
                           " sampled yet; wait for ready_to_checkpoint first")
      if rollouts is None:
        break
      sampled.append(rollouts)
    return sampled

  def restore(self, sampled: list[dict[str, Any]]) -> list[int]:
    """The steps a restored position carries (``StepRollouts.to_json``'s), ready to be taken; their numbers."""
    self.ready = {r["step"]: StepRollouts.from_json(r) for r in sampled}
    return sorted(self.ready)

  def ready_payloads(self) -> list[tuple[int, int, list[Trajectory]]]:
    """(step, micro-batch, payload) of each step ready to be taken, in order."""
    return [(step, i, p) for step, r in sorted(self.ready.items()) for i, p in enumerate(r.payloads)]

  def take(self, step: int) -> list[list[Trajectory]] | None:
    """Marks ``step`` taken; its payloads when it is complete, None while it still streams."""
    if step not in self.ready:
      return None
    self._deliver(self.ready.pop(step))
    return self.delivered[step].payloads

  def forget(self, step: int) -> None:
    """Drops what is kept of a step no position can carry any more."""
    self.delivered.pop(step, None)
    self.micro_batch_wait_s.pop(step, None)

  def publish(self, step: int, parts: list, assemble: Callable[[], StepRollouts], *, taken: bool,
              micro_batches: int) -> None:
    """``step``'s micro-batches sampled so far (``parts``: ``sample_micro_batch``'s results); once all
    ``micro_batches`` are, the step, complete (``assemble()``), delivered at once if it was ``taken``."""
    if len(parts) < micro_batches:
      self.partial[step] = [part[0] for part in parts]
      return
    self.partial.pop(step, None)
    if taken:
      self._deliver(assemble())
    else:
      self.ready[step] = assemble()

  def _deliver(self, rollouts: StepRollouts) -> None:
    self.delivered[rollouts.step] = rollouts
    if self.recorded is not None:
      self.recorded.append(rollouts)


class StreamedPayloads(Sequence):
  """A taken step's micro-batches while its later ones are still being sampled: item i waits for micro-batch
  i (``LiveRollouts.micro_batch``); its length is the step's micro-batch count from the start."""

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


def assemble_step(step: int, version: int, parts: list, sampling_s: float) -> StepRollouts:
  """A step from its micro-batches' ``sample_micro_batch`` results, in training order."""
  payloads, rewards, correct, tokens = (list(part) for part in zip(*parts))
  flat = np.concatenate(rewards)
  return StepRollouts(step, payloads, [r.tolist() for r in rewards], version, float(flat.mean()), float(flat.std()),
                      float(np.mean(np.concatenate(correct))), sum(tokens), sampling_s)


def recorded_groups(steps: list[StepRollouts], generations: int):
  """The groups of recorded steps, as a recording stores them (``orchestrator.data.recording``)."""
  for rollouts in steps:
    for payload, rewards in zip(rollouts.payloads, rollouts.rewards):
      for first in range(0, len(payload), generations):
        group = payload[first:first + generations]
        yield TrajectoryGroup(group[0].group_id, group[0].prompt_ids, [t.completion_ids for t in group],
                              np.asarray(rewards[first:first + generations], np.float32),
                              np.asarray([t.advantage for t in group], np.float32),
                              [t.old_logprobs for t in group], np.arange(len(group), dtype=np.int32),
                              rollouts.weights_version)

"""One sampler for a live run's two users: the sampling thread and evaluation, each in its turn.

The sampling thread samples each step's micro-batches with that step's weights
version; an evaluation (``evaluations.HeldOutEvaluations``) needs the sampler
too, with its own weights. They take it in turns, one micro-batch or one
evaluation at a time, and whoever takes it syncs the weights it needs first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from orchestrator.data.trajectory import Trajectory
from orchestrator.tasks.rewards import Reward
from orchestrator.live.sampler import LiveSampler
from orchestrator.tasks.tasks import group_advantages

#: How long one wait for the sampler lasts before the waiter looks at its stop flag again.
WAIT_POLL_S = 0.1


class ClosedWhileWaiting(Exception):
  """The source was closed while a generation waited between decode chunks (for a newer version's weights, or
  the sampler's turn); the argument says what for. Nothing is left running: the call just ends."""


class SharedSampler:
  """A ``LiveSampler`` on a ``tasks.Task``, taken in turns by the sampling thread (``sample_micro_batches``) and
  evaluation (``turn``); trained on ``reward``, judged by the task's own check.

  Args:
    sampler: the sampler (its weights are whoever's took it last).
    task: the task the training prompts come from.
    reward: the training reward of a micro-batch's completions (``score_micro_batch``).
    shape: the steps' ``rollouts.LiveShape`` (its seed: the problems' and the sampling seeds').
  """

  def __init__(self, sampler: LiveSampler, task, reward: Reward, shape):
    self.sampler, self._task, self._reward, self._shape = sampler, task, reward, shape
    self._turn = threading.Lock()
    #: A copy of version 0's weights, which a batch is given as None ("the sampler's own"): an evaluation during
    #: the run replaces the sampler's weights, and a batch still sampled with version 0 syncs them back from here.
    self.start_weights: Any = None

  def sample_micro_batches(self, batch: int, first: int, count: int, version: int, weights: Any, *,
                           cancelled: Callable[[], bool] | None = None,
                           chunk_weights: Callable[[int], tuple[int, Any]] | None = None,
                           before_chunk: Callable[[int, Callable[[], Any]], None] | None = None,
                           resume_from: Any = None) -> list:
    """Micro-batches ``first`` … ``first + count - 1`` of sampled ``batch`` with weights ``version`` (``weights``;
    None: the sampler's own), in one sampler call in this caller's turn: ``sample_micro_batches``'s result.

    ``chunk_weights`` (in-flight updates): the call decodes in chunks instead, chunk g with ``chunk_weights(g)``'s
    (version, weights; None: version 0's, the sampler's own), which may wait for that version's sync. The turn is
    held chunk by chunk, not while that waits: an evaluation at the boundary whose sync it waits for takes the
    sampler in between (the generation's state is the call's own, and each chunk is given its weights).
    ``before_chunk``, ``resume_from``: with ``chunk_weights``, as ``chunked_sampling.sample_in_chunks`` takes them
    (the generation so far handed out before each chunk; a carried one gone on from)."""
    if chunk_weights is not None:
      return self._sample_in_chunks(batch, first, count, chunk_weights, cancelled, before_chunk, resume_from)
    with self._turn:  # per call: an evaluation may take the sampler (and its weights) between
      weights = self._own_or(weights, version, batch)
      if weights is not None and self.sampler.weights_version != version:
        self.sampler.sync(weights, version)
      return sample_micro_batches(self.sampler, self._task, self._reward, self._shape, batch, first, count,
                                  cancelled=cancelled)

  def _own_or(self, weights: Any, version: int, batch: int) -> Any:
    """In the turn: ``weights``, or for None (the sampler's own, version 0's) None while the sampler still holds
    them, else the copy kept of them (``start_weights``)."""
    if weights is None and self.sampler.weights_version != version:  # an evaluation took the sampler's own
      weights = self.start_weights
      if weights is None:
        raise RuntimeError(f"sampled batch {batch} samples with the sampler's own weights (version {version}),"
                           f" but it holds version {self.sampler.weights_version} and no copy of them was kept")
    return weights

  def _sample_in_chunks(self, batch: int, first: int, count: int, chunk_weights: Callable[[int], tuple[int, Any]],
                        cancelled: Callable[[], bool] | None, before_chunk, resume_from) -> list:
    """``sample_micro_batches`` in decode chunks, the turn taken for each chunk once its weights are there."""
    held = False

    def weights_for_chunk(chunk: int) -> tuple[int, Any]:
      nonlocal held
      if held:
        self._turn.release()
        held = False
      version, weights = chunk_weights(chunk)
      if not acquire_unless(self._turn, cancelled):
        raise ClosedWhileWaiting(f"the sampler's turn for decode chunk {chunk} of"
                                 f" {self._shape.schedule.describe(batch)}")
      held = True
      return version, self._own_or(weights, version, batch)

    try:
      return sample_micro_batches(self.sampler, self._task, self._reward, self._shape, batch, first, count,
                                  cancelled=cancelled, weights_for_chunk=weights_for_chunk,
                                  before_chunk=before_chunk, resume_from=resume_from)
    finally:
      if held:
        self._turn.release()

  @contextlib.contextmanager
  def turn(self, stop: Callable[[], Any] | None = None) -> Iterator[bool]:
    """The sampler for the caller alone while the block runs (an evaluation's turn, between two of the sampling
    thread's calls): yields True once taken, or False, not taken, where ``stop()`` turned true first (looked at
    every ``WAIT_POLL_S``)."""
    taken = acquire_unless(self._turn, stop)
    try:
      yield taken
    finally:
      if taken:
        self._turn.release()


def token_limits(problems) -> list[int | None] | None:
  """Each problem's own token limit (a dataset row's ``task.max_tokens_field``), or None where none has one."""
  limits = [getattr(p, "max_new_tokens", None) for p in problems]
  return None if all(limit is None for limit in limits) else limits


def acquire_unless(lock: threading.Lock, stop: Callable[[], Any] | None) -> bool:
  """Takes ``lock``, looking at ``stop()`` every ``WAIT_POLL_S`` while it waits; False (not taken) once it is true."""
  while not lock.acquire(timeout=WAIT_POLL_S):
    if stop is not None and stop():
      return False
  return True


def call_seed(seed: int, batch: int, first: int) -> int:
  """The seed of the sampler call that samples micro-batches from ``first`` on of sampled ``batch`` (the run's
  ``seed``): a function of those numbers alone."""
  return int(np.random.default_rng((seed, batch, first)).integers(2**31 - 1))


def sample_micro_batches(sampler: LiveSampler, task, reward: Reward, shape, batch: int, first: int, count: int, *,
                         cancelled: Callable[[], bool] | None = None,
                         weights_for_chunk: Callable[[int], tuple[int, Any]] | None = None,
                         before_chunk: Callable[[int, Callable[[], Any]], None] | None = None,
                         resume_from: Any = None) -> list:
  """Samples micro-batches ``first`` … ``first + count - 1`` of sampled ``batch`` (a step, with one step per
  batch) in one call with the sampler's current weights: per micro-batch (payload, rewards, correct, completion
  tokens). Their problems and the call's seed are functions of (seed, batch, first) and the count alone, so one
  micro-batch per call samples each as it always was. ``cancelled``: whether the source is closing (a reward
  call still running is then given up: ``rewards.CallCancelled``). Each micro-batch's last item says which
  completions were cut at the length limit (None: a fixed-length answer, which has no end). ``weights_for_chunk``:
  the call decodes in ``shape.decode_chunk_tokens`` chunks on those weights (``LiveSampler.sample``), and each
  trajectory carries its tokens' versions; ``before_chunk`` and ``resume_from`` go with it to the sampler."""
  g, groups = shape.generations_per_group, shape.groups_per_micro_batch
  first_group = (batch * shape.micro_batches_per_batch + first) * groups
  problems = [task.problem(shape.seed, "train", first_group + j) for j in range(count * groups)]
  repeated = [p for p in problems for _ in range(g)]
  seed = call_seed(shape.seed, batch, first)
  chunked = ({} if weights_for_chunk is None
             else {"weights_for_chunk": weights_for_chunk, "chunk_tokens": shape.decode_chunk_tokens,
                   "before_chunk": before_chunk, "resume_from": resume_from})
  samples = sampler.sample([p.prompt for p in repeated], seed=seed, max_new_tokens=token_limits(repeated),
                           **shape.sampling_settings(), **chunked)
  if any(len(c) == 0 for c in samples.completion_ids):
    raise RuntimeError(f"the sampler returned an empty completion at {shape.schedule.describe(batch)},"
                       f" micro-batches {first}–{first + count - 1}")
  rows = groups * g
  out = []
  for m in range(count):  # each micro-batch scored and normalised on its own, as when sampled alone
    part, rows_m = problems[m * groups:(m + 1) * groups], slice(m * rows, (m + 1) * rows)
    rewards, correct = score_micro_batch(task, reward, part, samples.texts[rows_m], first_group + m * groups, g,
                                         step=shape.schedule.first_step(batch), cancelled=cancelled)
    advantages = group_advantages(rewards, g, shape.advantage_scaling)
    payload = [Trajectory(samples.prompt_ids[k], samples.completion_ids[k], float(advantages[k - m * rows]),
                          samples.logprobs[k], first_group + k // g,
                          None if samples.routing is None else samples.routing[k],
                          None if samples.versions is None else samples.versions[k])
               for k in range(m * rows, (m + 1) * rows)]
    truncated = None if samples.ended is None else [not e for e in samples.ended[rows_m]]
    out.append((payload, rewards, correct, int(sum(len(c) for c in samples.completion_ids[rows_m])), truncated))
  return out


def score_micro_batch(task, reward: Reward, problems, texts: list[str], first_index: int, generations: int, *,
                      step: int | None = None, cancelled: Callable[[], bool] | None = None):
  """(training rewards, correct) of a micro-batch's completions of ``step``, ``generations`` per problem, the
  first problem drawn with index ``first_index``. The reward is one call over all of them, as Tunix calls reward
  functions (a model-based one batches), limited in time (``Reward.timeout_s``); correct is the task's own check,
  so accuracy means the same whatever the reward."""
  each = [problems[k // generations] for k in range(len(texts))]
  rewards = reward(each, texts, indices=[first_index + k // generations for k in range(len(texts))], step=step,
                   cancelled=cancelled)
  return rewards, np.array([task.reward(p, text) == 1.0 for p, text in zip(each, texts)])

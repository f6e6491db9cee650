"""HeldOutEvaluations: a live run's evaluations on held-out prompts, on the run's one sampler in its turn.

An evaluation scores the weights just synced on the task's held-out split: greedy accuracy, and with ``pass_k``
pass@k over completions sampled with the run's settings. It takes the sampler the sampling thread shares
(``SharedSampler``) between two of its calls, so sampling and evaluation never hold it at once; each syncs the
weights it needs first. A live source (``LiveRollouts``) holds one and answers ``LiveSource``'s evaluation part
through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from orchestrator.contract.source import HeldOutScore
from orchestrator.live.placement import gather_across_processes
from orchestrator.live.shared_sampler import SharedSampler, token_limits
from orchestrator.tasks.tasks import split_sizes

#: Mixed into the seed of an evaluation's sampled completions: never the seed of a training batch's.
EVAL_SEED_STREAM = 0x5EED_E7A1


class HeldOutEvaluations:
  """Evaluations of ``task``'s held-out problems on ``shared``'s sampler, in its turn; judged by the task's own
  check.

  Args:
    shared: the sampler the sampling thread shares (its turn taken for each evaluation).
    task: the task the held-out problems come from (its ``eval_problems``, where it lists them).
    shape: the steps' ``rollouts.LiveShape``: its seed (the problems' and the sampling seeds'), its sampling
      settings, and the size of a training call (no evaluation call is larger).
  """

  def __init__(self, shared: SharedSampler, task, shape):
    self._shared, self._task, self._shape = shared, task, shape

  def eval_prompt_count(self, asked: int) -> int:
    """``asked``, or what a finite evaluation split holds (a dataset's) if fewer: no prompt counts twice."""
    return min(asked, len(getattr(self._task, "eval_problems", None) or range(asked)))

  def held_out_count(self, limit: int) -> int:
    """The prompts the held-out split holds, counted up to ``limit`` (a built-in task's space may be vast)."""
    listed = getattr(self._task, "eval_problems", None)
    if listed is not None:
      return min(limit, len(listed))
    return min(limit, split_sizes(self._task, enough=limit).eval)

  def keep_start_weights(self, weights: Any) -> None:
    """A host copy of version 0's weights, for batches sampled after an evaluation took the sampler's own
    (``SharedSampler.start_weights``)."""
    self._shared.start_weights = weights

  def evaluate(self, weights: Any, version: int, prompts: int, *, pass_k: int = 0,
               stop: Callable[[], Any] | None = None) -> HeldOutScore | None:
    """Greedy accuracy on ``prompts`` held-out problems with the given weights; with ``pass_k``, also pass@k:
    ``pass_k`` completions sampled per problem (the run's sampling settings, a seed drawn from the run's seed and
    ``version``), a problem passing when one of them passes the task's own check.

    The sampling thread may hold the sampler: with ``stop`` the wait for it looks at ``stop()`` every
    ``WAIT_POLL_S`` and gives up (None) once it is true. In a job of several processes the weights are
    gathered before it (a collective every process issues, whatever the wait ends in).
    """
    weights = gather_across_processes(weights)[0]
    problems = [self._task.problem(self._shape.seed, "eval", j) for j in range(prompts)]
    with self._shared.turn(stop) as taken:
      if not taken:
        return None
      if weights is not None:
        self._shared.sampler.sync(weights, version)
      answers, sampled = self._greedy(problems), None
      if pass_k:
        sampled = self._sampled([p for p in problems for _ in range(pass_k)], version)
    accuracy = float(np.mean([self._task.reward(p, a) for p, a in zip(problems, answers)]))
    if sampled is None:
      return HeldOutScore(accuracy=accuracy)
    passed = [any(self._task.reward(p, text) == 1.0 for text in sampled[j * pass_k:(j + 1) * pass_k])
              for j, p in enumerate(problems)]
    return HeldOutScore(accuracy=accuracy, pass_k=pass_k, pass_at_k=float(np.mean(passed)))

  def _call_rows(self) -> int:
    """Completions one sampler call makes in training: an evaluation calls no larger (its memory is the same)."""
    s = self._shape
    return s.groups_per_micro_batch * s.generations_per_group * s.micro_batches_per_call

  def _greedy(self, problems) -> list[str]:
    """Greedy completions of ``problems``, in calls of a training call's size, ended as sampled ones are."""
    rows, stop = self._call_rows(), self._shape.sampling_settings()["stop"]
    sampler = self._shared.sampler
    return [text for first in range(0, len(problems), rows) for text in sampler.greedy(
        [p.prompt for p in problems[first:first + rows]], stop=stop,
        max_new_tokens=token_limits(problems[first:first + rows]))]

  def _sampled(self, problems, version: int) -> list[str]:
    """Sampled completions of ``problems`` with the run's settings, in calls of a training call's size, each
    with a seed drawn from the run's seed, the weights version and the call's index."""
    rows, texts = self._call_rows(), []
    for call, first in enumerate(range(0, len(problems), rows)):
      part = problems[first:first + rows]
      seed = int(np.random.default_rng((self._shape.seed, EVAL_SEED_STREAM, version, call)).integers(2**31 - 1))
      texts += self._shared.sampler.sample([p.prompt for p in part], seed=seed, max_new_tokens=token_limits(part),
                                           **self._shape.sampling_settings()).texts
    return texts

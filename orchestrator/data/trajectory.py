"""One sampled trajectory: what an RL sampler hands the trainer for a single generation."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Trajectory:
  """A prompt, one completion of it, and what the loss needs to learn from it.

  Attributes:
    prompt_ids: token ids of the prompt, shape [P], integer.
    completion_ids: token ids of the sampled completion, shape [C], integer.
    advantage: the (group-normalised) advantage of this completion; applied to
      every completion token.
    old_logprobs: optional per-token log-probabilities of the completion under
      the sampling policy, shape [C]; without them the ratio is taken against
      the current policy (on-policy, ratio 1).
    group_id: which prompt group the completion belongs to.
    routing: optional experts each MoE layer of the sampling policy chose for each token of the prompt and the
      completion, shape [P + C, layers, top_k], integer (rollout routing replay: the trainer routes each token
      to these experts; ``orchestrator.engine.moe``).
    versions: optional weights version (updates applied) of the policy that sampled each completion token,
      shape [C], integer; its ``old_logprobs`` are that policy's. Set by a live sampler with in-flight updates
      (a generation that took newer weights part way); None: every token the same version. It is for the
      records only: packing (and so the content digest) and the trainer never read it.
  """

  prompt_ids: np.ndarray
  completion_ids: np.ndarray
  advantage: float
  old_logprobs: np.ndarray | None = None
  group_id: int = 0
  routing: np.ndarray | None = None
  versions: np.ndarray | None = None

  @property
  def num_tokens(self) -> int:
    return len(self.prompt_ids) + len(self.completion_ids)


@dataclasses.dataclass(frozen=True)
class TrajectoryGroup:
  """One prompt sampled ``len(completions)`` times."""

  group_id: int
  prompt_ids: np.ndarray
  completions: list[np.ndarray]
  rewards: np.ndarray
  advantages: np.ndarray
  old_logprobs: list[np.ndarray] | None
  generation_ids: np.ndarray
  policy_version: int = 0
  routing: list[np.ndarray] | None = None  # per completion: [P + C, layers, top_k] (``Trajectory.routing``)

  def trajectories(self) -> list[Trajectory]:
    return [
        Trajectory(
            self.prompt_ids, c, float(self.advantages[g]),
            None if self.old_logprobs is None else self.old_logprobs[g], self.group_id,
            None if self.routing is None else self.routing[g],
        )
        for g, c in enumerate(self.completions)
    ]

"""Seeded synthetic rollouts shaped like real RL payloads.

Each prompt is sampled ``generations_per_group`` times; prompt and completion
lengths are drawn from log-normal distributions (many short, a few long), rewards
are Bernoulli per completion and advantages are normalised within the group, as
GRPO does. Micro-batches are filled with whole groups up to about ``fill`` of
``rows × tokens_per_row`` and always pack. Same seed, step and index → the same
micro-batch, in any process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from orchestrator.data.trajectory import Trajectory
from orchestrator.engine.inputs import assign_rows


@dataclasses.dataclass(frozen=True)
class SyntheticRollouts:
  """A deterministic source of micro-batch payloads for one batch shape."""

  vocab_size: int
  rows: int
  tokens_per_row: int
  generations_per_group: int = 4
  fill: float = 0.85
  with_old_logprobs: bool = True
  seed: int = 0

  def __post_init__(self):
    if self.tokens_per_row < 4:
      raise ValueError(f"tokens_per_row={self.tokens_per_row} is too short for a trajectory")
    if not 0 < self.fill <= 1:
      raise ValueError(f"fill={self.fill} must be in (0, 1]")

  def _group(self, rng: np.random.Generator, group_id: int) -> list[Trajectory]:
    t = self.tokens_per_row
    prompt_len = int(np.clip(rng.lognormal(np.log(max(t / 8, 2)), 0.5), 2, t // 2))
    prompt = rng.integers(1, self.vocab_size, prompt_len, dtype=np.int32)
    room = t - prompt_len
    lengths = np.clip(rng.lognormal(np.log(max(room / 3, 1)), 0.6, self.generations_per_group), 1, room)
    rewards = rng.random(self.generations_per_group) < 0.5
    rewards = rewards.astype(np.float32)
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    group = []
    for g in range(self.generations_per_group):
      n = int(lengths[g])
      completion = rng.integers(1, self.vocab_size, n, dtype=np.int32)
      old = None
      if self.with_old_logprobs:
        old = -rng.exponential(2.0, n).astype(np.float32)
      group.append(Trajectory(prompt.copy(), completion, float(adv[g]), old, group_id))
    return group

  def micro_batch(self, step: int, index: int) -> list[Trajectory]:
    """The payload of micro-batch ``index`` of optimizer step ``step``."""
    rng = np.random.default_rng((self.seed, step, index))
    budget = self.fill * self.rows * self.tokens_per_row
    payload: list[Trajectory] = []
    used = 0
    group_id = 0
    while True:
      group = self._group(rng, group_id)
      candidate = payload + group
      n = sum(tr.num_tokens for tr in group)
      if payload and used + n > budget:
        break
      try:
        assign_rows([tr.num_tokens for tr in candidate], rows=self.rows, tokens_per_row=self.tokens_per_row)
      except ValueError:
        if not payload:  # one group alone does not fit: keep what fits of it
          for tr in group:
            try:
              assign_rows([x.num_tokens for x in payload + [tr]], rows=self.rows, tokens_per_row=self.tokens_per_row)
              payload.append(tr)
            except ValueError:
              break
        break
      payload, used = candidate, used + n
      group_id += 1
    return payload

  def step(self, step: int, micro_batches: int) -> list[list[Trajectory]]:
    return [self.micro_batch(step, i) for i in range(micro_batches)]

  def steps(self, num_steps: int, micro_batches: int, start: int = 0) -> Iterator[list[list[Trajectory]]]:
    for s in range(start, start + num_steps):
      yield self.step(s, micro_batches)

"""Seeded synthetic rollouts shaped like real RL payloads: one group sampler, two consumers.

``sample_group`` draws one prompt sampled ``generations_per_group`` times:
prompt and completion lengths from log-normal distributions (many short, a few
long), Bernoulli rewards per completion and advantages normalised within the
group, as GRPO does. ``generate_groups`` streams groups for a recording
(``run_rl record``); ``SyntheticRollouts`` fills micro-batches with whole groups
for a run. Same seed, step and index → the same micro-batch, in any process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from orchestrator.data.packing import ROUTING_DTYPE, RoutingShape, fits
from orchestrator.data.trajectory import Trajectory, TrajectoryGroup


@dataclasses.dataclass(frozen=True)
class RolloutShape:
  """Distributions of a group's shapes (log-normal lengths, clipped to ``max_tokens``).

  ``completion_len_median`` None takes a third of the room the prompt leaves.
  """

  groups: int = 256
  generations_per_group: int = 8
  prompt_len_median: float = 24
  prompt_len_sigma: float = 0.5
  min_prompt_len: int = 1
  completion_len_median: float | None = 16
  completion_len_sigma: float = 0.7
  max_tokens: int = 128
  vocab_size: int = 512
  with_old_logprobs: bool = True
  old_logprob_scale: float = 1.5
  seed: int = 0
  routing: RoutingShape | None = None  # each token's experts per MoE layer, drawn uniformly (routing replay)


#: Tokens whose routing is drawn at once (bounds the draw's memory: chunk × layers × experts floats).
ROUTING_CHUNK_TOKENS = 1024


def _routing(rng: np.random.Generator, tokens: int, routing: RoutingShape) -> np.ndarray:
  """[tokens, layers, top_k] distinct experts per token and layer, uniformly drawn (the top_k of uniform keys),
  a chunk of tokens at a time."""
  out = np.empty((tokens, routing.layers, routing.top_k), ROUTING_DTYPE)
  for first in range(0, tokens, ROUTING_CHUNK_TOKENS):
    keys = rng.random((min(ROUTING_CHUNK_TOKENS, tokens - first), routing.layers, routing.num_experts),
                      dtype=np.float32)
    out[first:first + len(keys)] = np.argpartition(keys, routing.top_k - 1, axis=-1)[..., :routing.top_k]
  return out


def sample_group(rng: np.random.Generator, group_id: int, shape: RolloutShape) -> TrajectoryGroup:
  """One group drawn from ``rng`` in ``shape``'s distributions."""
  t, g = shape.max_tokens, shape.generations_per_group
  p = int(np.clip(rng.lognormal(np.log(shape.prompt_len_median), shape.prompt_len_sigma),
                  shape.min_prompt_len, t // 2))
  prompt = rng.integers(1, shape.vocab_size, p, dtype=np.int32)
  room = t - p
  median = shape.completion_len_median or max(room / 3, 1)
  lengths = np.clip(rng.lognormal(np.log(median), shape.completion_len_sigma, g), 1, room).astype(int)
  rewards = (rng.random(g) < 0.5).astype(np.float32)
  advantages = ((rewards - rewards.mean()) / (rewards.std() + 1e-4)).astype(np.float32)
  completions, old = [], []
  for n in lengths:
    completions.append(rng.integers(1, shape.vocab_size, int(n), dtype=np.int32))
    if shape.with_old_logprobs:
      old.append(-rng.exponential(shape.old_logprob_scale, int(n)).astype(np.float32))
  # drawn after everything else, so a shape without routing draws what it always drew
  routing = None if shape.routing is None else [_routing(rng, p + len(c), shape.routing) for c in completions]
  return TrajectoryGroup(group_id, prompt, completions, rewards, advantages,
                         old if shape.with_old_logprobs else None, np.arange(g, dtype=np.int32), 0, routing)


def generate_groups(shape: RolloutShape) -> Iterator[TrajectoryGroup]:
  """``shape.groups`` seeded groups, for a recording."""
  rng = np.random.default_rng(shape.seed)
  for gid in range(shape.groups):
    yield sample_group(rng, gid, shape)


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
  routing: RoutingShape | None = None

  def __post_init__(self):
    if self.tokens_per_row < 4:
      raise ValueError(f"tokens_per_row={self.tokens_per_row} is too short for a trajectory")
    if not 0 < self.fill <= 1:
      raise ValueError(f"fill={self.fill} must be in (0, 1]")

  @property
  def shape(self) -> RolloutShape:
    t = self.tokens_per_row
    return RolloutShape(
        generations_per_group=self.generations_per_group, prompt_len_median=max(t / 8, 2),
        min_prompt_len=2, completion_len_median=None, completion_len_sigma=0.6, max_tokens=t,
        vocab_size=self.vocab_size, with_old_logprobs=self.with_old_logprobs, old_logprob_scale=2.0,
        routing=self.routing,
    )

  def micro_batch(self, step: int, index: int) -> list[Trajectory]:
    """The payload of micro-batch ``index`` of optimizer step ``step``: whole groups up to ``fill``."""
    rng = np.random.default_rng((self.seed, step, index))
    shape = self.shape
    budget = self.fill * self.rows * self.tokens_per_row
    payload: list[Trajectory] = []
    used = 0
    while True:
      group = sample_group(rng, len(payload) // self.generations_per_group, shape).trajectories()
      n = sum(tr.num_tokens for tr in group)
      if payload and used + n > budget:
        return payload
      if fits(payload + group, rows=self.rows, tokens_per_row=self.tokens_per_row):
        payload, used = payload + group, used + n
        continue
      if not payload:  # one group alone does not fit: keep what fits of it
        for tr in group:
          if not fits(payload + [tr], rows=self.rows, tokens_per_row=self.tokens_per_row):
            break
          payload.append(tr)
      return payload

  def step(self, step: int, micro_batches: int) -> list[list[Trajectory]]:
    return [self.micro_batch(step, i) for i in range(micro_batches)]

  def steps(self, num_steps: int, micro_batches: int, start: int = 0) -> Iterator[list[list[Trajectory]]]:
    for s in range(start, start + num_steps):
      yield self.step(s, micro_batches)

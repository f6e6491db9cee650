"""Sampled batches: several optimizer steps per batch of rollouts, and the passes over it.

A sampled batch is ``batch_steps`` × ``micro_batches_per_step`` micro-batches,
all sampled with one weights version; it serves ``batch_steps`` × ``epochs``
optimizer steps (``steps_per_batch``). Pass 0 trains its mini-batches in
sampling order, so micro-batches still stream to the trainer as they are
sampled; each later pass reshuffles the batch's GRPO groups (a group's
advantages are relative within it) by a seeded rule — a function of (seed,
batch, pass) alone, so identical in every boundary mode and across resume —
keeping every micro-batch's shape (``groups_per_micro_batch`` groups).

Batch b samples with the weights at the start of batch b − S (S =
``max_staleness``): version ``max(0, (b − S) · steps_per_batch)``. With one
step per batch (the default) a batch is a step and all of this is the step
schedule it always was.

With in-flight updates a batch's generations decode in chunks, and later
chunks may sample with newer versions, up to the batch's newest
(``BatchSchedule.newest_version``): the next batch's version, and never past
the version its first step trains with (the trainer holds it without needing
this batch, so no sampler waits on a trainer that waits on it). Chunk c of a
batch's C chunks (its calls' chunks, in sampling order) samples with
``V_b + ⌊c · (U_b − V_b + 1) / C⌋`` (``chunk_version``): counts alone, so the
version a token is sampled with is the same in every run of the recipe, every
boundary mode and across a resume. Its oldest token is the batch's own
version, so the staleness bound is what it was.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from orchestrator import phases
from orchestrator.contract import RolloutStats
from orchestrator.data.packing import ROUTING_DTYPE
from orchestrator.data.trajectory import Trajectory

#: The last entry of a reshuffle's seed, so its stream is never a sampling seed's ((seed, batch, micro-batch)).
SHUFFLE_STREAM = 1
#: The sampler's pace (``SampledBatches.seconds_left``) is its slowest of this many latest micro-batches.
PACE_MICRO_BATCHES = 4


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
  """Which sampled batch, pass and mini-batch each optimizer step trains on, and the version each batch samples
  with. Every answer is a function of these numbers alone."""

  micro_batches_per_step: int
  generations_per_group: int
  batch_steps: int = 1
  epochs: int = 1
  max_staleness: int = 0
  seed: int = 0
  # In-flight updates (rollouts.in_flight_updates): a batch's later decode chunks may sample with newer weights.
  in_flight_updates: bool = False
  micro_batches_per_call: int = 1  # micro-batches the sampler generates in one call (divides a batch's)
  chunks_per_call: int = 1  # decode chunks of one call's generation (schema.decode_chunks)

  @property
  def steps_per_batch(self) -> int:
    return self.batch_steps * self.epochs

  @property
  def micro_batches_per_batch(self) -> int:
    return self.batch_steps * self.micro_batches_per_step

  def batch_of(self, step: int) -> int:
    return step // self.steps_per_batch

  def first_step(self, batch: int) -> int:
    return batch * self.steps_per_batch

  def batches_for(self, steps: int) -> int:
    """The batches a run of ``steps`` samples: its last one whole, though it may train only part of it."""
    return math.ceil(steps / self.steps_per_batch)

  def batch_version(self, batch: int) -> int:
    """The weights version (updates done) ``batch`` samples with."""
    return max(0, (batch - self.max_staleness) * self.steps_per_batch)

  def version_for(self, step: int) -> int:
    """The weights version the rollouts ``step`` trains on were sampled with (with in-flight updates, the
    oldest of their tokens')."""
    return self.batch_version(self.batch_of(step))

  # ------------------------------------------------------------ in-flight updates: the version of each chunk
  @property
  def calls_per_batch(self) -> int:
    return self.micro_batches_per_batch // self.micro_batches_per_call

  @property
  def chunks_per_batch(self) -> int:
    """Decode chunks of a batch: its calls' chunks, in sampling order (chunk c is call c // chunks_per_call's)."""
    return self.calls_per_batch * self.chunks_per_call

  def newest_version(self, batch: int) -> int:
    """The newest version any token of ``batch`` samples with: its own without in-flight updates; with them the
    next batch's (so the versions the sampler takes never go back, and every batch's are kept until it is
    sampled), at most the version its first step trains with — the trainer reaches that one on the batches
    before it alone, while a newer one needs a step of this batch, which would wait for this batch's sampling."""
    own = self.batch_version(batch)
    if not self.in_flight_updates:
      return own
    return max(own, min(self.batch_version(batch + 1), self.first_step(batch)))

  def chunk_version(self, batch: int, chunk: int) -> int:
    """The version decode chunk ``chunk`` of ``batch`` (of ``chunks_per_batch``) samples with: the batch's
    versions spread evenly over its chunks in order, the first chunk on the batch's own."""
    if not 0 <= chunk < self.chunks_per_batch:
      raise ValueError(f"chunk {chunk} is outside a batch's {self.chunks_per_batch} decode chunks")
    oldest = self.batch_version(batch)
    return oldest + chunk * (self.newest_version(batch) - oldest + 1) // self.chunks_per_batch

  def call_versions(self, batch: int, call: int) -> list[int]:
    """The version each decode chunk of sampler call ``call`` of ``batch`` samples with, in order."""
    first = call * self.chunks_per_call
    return [self.chunk_version(batch, c) for c in range(first, first + self.chunks_per_call)]

  def first_micro_batch_version(self, step: int) -> int:
    """The newest version the sampler call holding ``step``'s first micro-batch needs: that micro-batch exists
    only once its call is sampled, so the step's rollouts wait for that version's sync (``blocked_on_sync``)."""
    batch, call = self.batch_of(step), self.sampled_index(step, 0) // self.micro_batches_per_call
    return max(self.call_versions(batch, call))

  def chunks_before(self, batch: int, version: int) -> int:
    """How many of ``batch``'s decode chunks (a prefix: the versions rise chunk by chunk) sample with weights
    older than ``version``: what a position before step ``version`` must carry of a batch sampled ahead, since a
    run resumed there holds no older weights, and what it can carry without waiting on a newer version."""
    return sum(1 for c in range(self.chunks_per_batch) if self.chunk_version(batch, c) < version)

  def samples_with(self, version: int) -> bool:
    """Whether some batch samples with ``version``'s weights (so a weight sync must keep them): a batch's own
    version without in-flight updates, every chunk's with them."""
    if not self.in_flight_updates:
      return version % self.steps_per_batch == 0
    # a batch's versions run from its own to the next batch's: only the two batches whose own are nearest below
    # ``version`` (and one past, where versions repeat near the start) can span it
    nearest = version // self.steps_per_batch + self.max_staleness
    return any(self.batch_version(b) <= version <= self.newest_version(b)
               and any(self.chunk_version(b, c) == version for c in range(self.chunks_per_batch))
               for b in range(max(0, nearest - 1), nearest + 2))

  def pass_of(self, step: int) -> int:
    return step % self.steps_per_batch // self.batch_steps

  def sampled_index(self, step: int, index: int) -> int:
    """The last of its batch's sampled micro-batches that micro-batch ``index`` of ``step`` needs: in pass 0
    its own (training follows sampling), in a later pass the batch's last (a reshuffle takes the whole batch)."""
    if self.pass_of(step) > 0:
      return self.micro_batches_per_batch - 1
    return step % self.batch_steps * self.micro_batches_per_step + index

  def sampled_range(self, step: int) -> range:
    """The batch's sampled micro-batches ``step``'s rollouts come from."""
    if self.pass_of(step) > 0:
      return range(self.micro_batches_per_batch)
    first = step % self.batch_steps * self.micro_batches_per_step
    return range(first, first + self.micro_batches_per_step)

  def mini_batch(self, step: int, sampled: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """``step``'s micro-batches of its batch's ``sampled`` per-micro-batch lists (trajectories, or anything
    aligned with them: rewards). In pass 0 those sampled for it, as sampled (a prefix of the batch will do);
    in a later pass the whole batch's groups reshuffled (``shuffled``)."""
    pass_ = self.pass_of(step)
    micro = self.shuffled(self.batch_of(step), pass_, sampled) if pass_ > 0 else sampled
    first = step % self.batch_steps * self.micro_batches_per_step
    return [list(m) for m in micro[first:first + self.micro_batches_per_step]]

  def shuffled(self, batch: int, pass_: int, sampled: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """The batch's micro-batches with its groups (``generations_per_group`` consecutive items) permuted by
    ``group_order``: each micro-batch keeps its count of groups."""
    g = self.generations_per_group
    groups = [list(m[i:i + g]) for m in sampled for i in range(0, len(m), g)]
    per_micro = len(sampled[0]) // g
    order = group_order(self.seed, batch, pass_, len(groups))
    return [[item for j in order[m * per_micro:(m + 1) * per_micro] for item in groups[j]]
            for m in range(len(sampled))]

  def describe(self, batch: int) -> str:
    """``batch`` in a message: its step when a batch is one step."""
    first = self.first_step(batch)
    return f"step {first}" if self.steps_per_batch == 1 else f"the batch of steps {first}-{first + self.steps_per_batch - 1}"


def group_order(seed: int, batch: int, pass_: int, groups: int) -> list[int]:
  """The order of a batch's ``groups`` in pass ``pass_``: a permutation seeded by (seed, batch, pass)."""
  return np.random.default_rng((seed, batch, pass_, SHUFFLE_STREAM)).permutation(groups).tolist()


@dataclasses.dataclass
class BatchRollouts:
  """One sampled batch's micro-batches so far (in sampling order) and what sampling each measured."""

  batch: int
  weights_version: int
  payloads: list[list[Trajectory]] = dataclasses.field(default_factory=list)
  rewards: list[list[float]] = dataclasses.field(default_factory=list)  # per trajectory, aligned with payloads
  correct: list[list[bool]] = dataclasses.field(default_factory=list)  # the task's own check, per trajectory
  sampled_tokens: list[int] = dataclasses.field(default_factory=list)  # per micro-batch
  sampling_s: list[float] = dataclasses.field(default_factory=list)  # per micro-batch
  # Per trajectory, whether its completion was cut at the length limit; None: fixed-length answers (no end).
  truncated: list[list[bool]] | None = None
  # Per micro-batch, its share of the seconds the sampler waited for weights before and inside its call (the batch's
  # version's sync, and with in-flight updates a newer one's between chunks); None: a batch restored from a
  # checkpoint written before the sampler's waits were recorded.
  sync_wait_s: list[float] | None = None

  def add(self, payload: list[Trajectory], rewards, correct, tokens: int, seconds: float,
          truncated: list[bool] | None = None, sync_wait_s: float | None = None) -> None:
    if truncated is not None:
      self.truncated = (self.truncated or []) + [[bool(t) for t in truncated]]
    if sync_wait_s is not None:
      self.sync_wait_s = (self.sync_wait_s or []) + [float(sync_wait_s)]
    self.payloads.append(payload)
    self.rewards.append([float(r) for r in rewards])
    self.correct.append([bool(c) for c in correct])
    self.sampled_tokens.append(int(tokens))
    self.sampling_s.append(float(seconds))

  def first(self, count: int) -> "BatchRollouts":
    """This batch's first ``count`` micro-batches, with what sampling each measured."""
    return dataclasses.replace(
        self, payloads=self.payloads[:count], rewards=self.rewards[:count], correct=self.correct[:count],
        sampled_tokens=self.sampled_tokens[:count], sampling_s=self.sampling_s[:count],
        truncated=None if self.truncated is None else self.truncated[:count],
        sync_wait_s=None if self.sync_wait_s is None else self.sync_wait_s[:count])

  def stats(self, schedule: BatchSchedule, step: int, micro_batch_wait_s: float = 0.0) -> RolloutStats:
    """What ``step`` trains on: its mini-batch's rewards and accuracy, the sampling rate of the micro-batches
    they were sampled in, and how far behind ``step`` the weights that sampled them are."""
    rewards = np.asarray([r for m in schedule.mini_batch(step, self.rewards) for r in m], np.float32)
    # a group's completions are contiguous, whatever pass reshuffled the groups; ddof 1, as TRL and the advantages
    group_stds = rewards.astype(np.float64).reshape(-1, schedule.generations_per_group).std(axis=1, ddof=1)
    correct = [c for m in schedule.mini_batch(step, self.correct) for c in m]
    lengths = [len(t.completion_ids) for m in schedule.mini_batch(step, self.payloads) for t in m]
    truncated = (None if self.truncated is None
                 else float(np.mean([c for m in schedule.mini_batch(step, self.truncated) for c in m])))
    sampled = schedule.sampled_range(step)
    tokens, seconds = sum(self.sampled_tokens[i] for i in sampled), sum(self.sampling_s[i] for i in sampled)
    versions = token_versions([t for m in schedule.mini_batch(step, self.payloads) for t in m])
    sync_wait_s = None if self.sync_wait_s is None else sum(self.sync_wait_s[i] for i in sampled)
    return RolloutStats(weights_version=self.weights_version, staleness=step - self.weights_version,
                        reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
                        accuracy=float(np.mean(correct)),
                        sampled_tokens_per_s=tokens / seconds if seconds > 0 else None,
                        micro_batch_wait_s=micro_batch_wait_s, reward_min=float(rewards.min()),
                        reward_max=float(rewards.max()), completion_tokens_mean=float(np.mean(lengths)),
                        completion_tokens_max=int(max(lengths)), truncated_fraction=truncated,
                        reward_group_std=float(np.mean(group_stds)),
                        frac_reward_zero_std=float(np.mean(group_stds == 0.0)),
                        **({} if versions is None else {
                            "token_version_min": int(versions.min()), "token_version_max": int(versions.max()),
                            "token_age_mean": float(step - versions.mean())}),
                        sampler_sync_wait_s=sync_wait_s)

  def samples(self, schedule: BatchSchedule, step: int, count: int, tokenizer) -> list[dict[str, Any]]:
    """The first ``count`` completions ``step`` trains on, to read: the weights version that sampled them, each
    one's prompt (as the model saw it) and completion (decoded with ``tokenizer``), reward, advantage, whether
    the task's check passed and whether it was cut at the length limit (None: a fixed-length answer)."""
    mini = zip(*(schedule.mini_batch(step, column) for column in (
        self.payloads, self.rewards, self.correct, self.truncated or [[None] * len(m) for m in self.payloads])))
    rows = [row for micro in mini for row in zip(*micro)][:count]
    decode_prompt = getattr(tokenizer, "decode_prompt", tokenizer.decode)  # a chat template's text holds eos ids
    return [{"step": step, "weights_version": self.weights_version, "prompt": decode_prompt(t.prompt_ids),
             "completion": tokenizer.decode(t.completion_ids), "reward": reward, "advantage": float(t.advantage),
             "correct": correct, "truncated": truncated} for t, reward, correct, truncated in rows]

  def to_json(self) -> dict[str, Any]:
    payloads = [[{"prompt_ids": t.prompt_ids.tolist(), "completion_ids": t.completion_ids.tolist(),
                  "advantage": float(t.advantage), "old_logprobs": t.old_logprobs.tolist(), "group_id": t.group_id,
                  **({} if t.routing is None else {"routing": _encoded(t.routing)}),
                  **({} if t.versions is None else {"versions": t.versions.tolist()})}
                 for t in payload] for payload in self.payloads]
    return dict(dataclasses.asdict(self), payloads=payloads)

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> "BatchRollouts":
    payloads = [[Trajectory(np.asarray(t["prompt_ids"], np.int32), np.asarray(t["completion_ids"], np.int32),
                            float(t["advantage"]), np.asarray(t["old_logprobs"], np.float32), int(t["group_id"]),
                            _decoded(t["routing"]) if "routing" in t else None,
                            np.asarray(t["versions"], np.int64) if "versions" in t else None)
                 for t in payload] for payload in data["payloads"]]
    return cls(**dict(data, payloads=payloads))


def token_versions(trajectories: Sequence[Trajectory]) -> np.ndarray | None:
  """Every completion token's version of ``trajectories``, in order (``Trajectory.versions``); None where none
  carries them (no in-flight updates: each token has its batch's version).

  Raises:
    ValueError: some carry them and some do not, or one's are not one per completion token.
  """
  carried = [t.versions is not None for t in trajectories]
  if not any(carried):
    return None
  if not all(carried):
    raise ValueError(f"{carried.count(False)} of {len(carried)} trajectories carry no per-token versions beside"
                     " others that do; a sampled batch's trajectories carry them all or none")
  for i, t in enumerate(trajectories):
    if np.shape(t.versions) != np.shape(t.completion_ids):
      raise ValueError(f"trajectory {i}'s versions have shape {np.shape(t.versions)}; they must match its"
                       f" completion_ids' {np.shape(t.completion_ids)}: one version per completion token")
  return np.concatenate([np.asarray(t.versions, np.int64) for t in trajectories])


def _encoded(routing: np.ndarray) -> dict[str, Any]:
  """A routing array as JSON: its shape and its int16 bytes in base64 (a list of ints would be ~4× larger)."""
  return {"shape": list(routing.shape),
          "int16_base64": base64.b64encode(np.ascontiguousarray(routing, ROUTING_DTYPE).tobytes()).decode()}


def _decoded(data: dict[str, Any]) -> np.ndarray:
  return np.frombuffer(base64.b64decode(data["int16_base64"]), ROUTING_DTYPE).reshape(data["shape"]).copy()


class SampledBatches:
  """What the sampling thread has produced and the loop has taken, by batch; the source's condition guards it.

  Attributes:
    batches: each batch sampled or being sampled (the last few), its micro-batches so far.
    taken: the batches some step of which was taken.
    micro_batch_wait_s: per taken step, the seconds spent waiting for its micro-batches after the first.
    recorded: every batch taken, in order, once complete (None when the run records no rollouts).
  """

  def __init__(self, record: bool, micro_batches_per_batch: int):
    self._per_batch = micro_batches_per_batch
    self.batches: dict[int, BatchRollouts] = {}
    self.taken: set[int] = set()
    self.micro_batch_wait_s: dict[int, float] = {}
    self.recorded: list[BatchRollouts] | None = [] if record else None
    self._pace_s: collections.deque[float] = collections.deque(maxlen=PACE_MICRO_BATCHES)  # the latest ones'

  def complete(self, batch: int) -> BatchRollouts | None:
    """``batch`` when all its micro-batches are sampled (taken or not); else None."""
    rollouts = self.batches.get(batch)
    return rollouts if rollouts is not None and len(rollouts.payloads) == self._per_batch else None

  def seconds_left(self, batches: list[int], needed: dict[int, int] | None = None) -> float | None:
    """Seconds until ``batches`` are sampled, at the sampler's recent pace (its slowest micro-batch of the last
    ``PACE_MICRO_BATCHES``): 0.0 when they are; None before any micro-batch was sampled. ``needed``: batch ->
    how many of its micro-batches count (a batch a position cuts: up to its cut's call); the others' all."""
    needed = needed or {}
    left = sum(max(0, needed.get(b, self._per_batch) - len(self.micro_batches_of(b))) for b in batches)
    if left == 0:
      return 0.0
    return left * max(self._pace_s) if self._pace_s else None

  def micro_batches_of(self, batch: int) -> list[list[Trajectory]]:
    """The micro-batches of ``batch`` sampled so far."""
    rollouts = self.batches.get(batch)
    return rollouts.payloads if rollouts is not None else []

  def carried(self, position: int, batches: list[int], run_batches: int,
              part: tuple[int, int, int] | None = None) -> list[BatchRollouts]:
    """The complete ``batches`` a position before step ``position`` carries; past the run's ``run_batches``
    as far as they are sampled. ``part``: (batch, micro-batches, its version) of the one batch the position cuts
    (in-flight updates: its later chunks sample with newer weights), carried with its first micro-batches alone.

    Raises:
      RuntimeError: one the run trains is not sampled yet, or the cut one not as far as ``part`` says.
    """
    sampled = []
    for b in batches:
      if part is not None and b == part[0]:
        rollouts = self.batches.get(b) or BatchRollouts(b, part[2])
        if len(rollouts.payloads) < part[1]:
          raise RuntimeError(f"the position before step {position} carries the first {part[1]} micro-batches of"
                             f" sampled batch {b}, which has {len(rollouts.payloads)}; wait for"
                             " ready_to_checkpoint first")
        sampled.append(rollouts.first(part[1]))
        break
      rollouts = self.complete(b)
      if rollouts is None and b < run_batches:
        raise RuntimeError(f"the position before step {position} must carry sampled batch {b}, which is not"
                           " sampled yet; wait for ready_to_checkpoint first")
      if rollouts is None:
        break
      sampled.append(rollouts)
    return sampled

  def restore(self, sampled: list[dict[str, Any]], part: tuple[int, int] | None = None) -> list[int]:
    """The batches a restored position carries (``BatchRollouts.to_json``'s), ready to be taken; their numbers.
    ``part``: (batch, micro-batches) of the one the position cuts (``carried``'s), which holds exactly those.

    Raises:
      ValueError: one of them is not a whole batch (the cut one: not as far as ``part`` says).
    """
    restored = [BatchRollouts.from_json(r) for r in sampled]
    owed = {r.batch: self._per_batch for r in restored}
    if part is not None and part[0] in owed:
      owed[part[0]] = part[1]
    short = [r.batch for r in restored if len(r.payloads) != owed[r.batch]]
    if short:
      raise ValueError(f"sampled batches {short} do not hold {[owed[b] for b in short]} micro-batches (each whole"
                       f" batch {self._per_batch}, a batch the position cuts its carried part)")
    self.batches = {r.batch: r for r in restored}
    return sorted(self.batches)

  def ready_payloads(self) -> list[tuple[int, int, list[Trajectory]]]:
    """(batch, micro-batch, payload) of each batch not taken yet, in order."""
    return [(b, i, p) for b, r in sorted(self.batches.items()) if b not in self.taken for i, p in enumerate(r.payloads)]

  def take(self, batch: int) -> None:
    """Marks ``batch`` taken (one of its steps is); recorded now if it is complete, else once it is."""
    if batch in self.taken:
      return
    self.taken.add(batch)
    self._record(batch)

  def forget(self, batch: int, steps: range) -> None:
    """Drops what is kept of a batch (and its ``steps``) no position can carry any more."""
    self.batches.pop(batch, None)
    self.taken.discard(batch)
    for step in steps:
      self.micro_batch_wait_s.pop(step, None)

  def publish(self, batch: int, version: int, sampled: tuple, seconds: float, sync_wait_s: float | None = None) -> None:
    """The next micro-batch of ``batch`` (one of ``sample_micro_batches``' results), sampled with ``version`` in
    ``seconds``, after or inside which the sampler waited ``sync_wait_s`` for weights (a version's sync); a batch
    taken before it was complete is recorded once it is."""
    rollouts = self.batches.setdefault(batch, BatchRollouts(batch, version))
    self._pace_s.append(seconds)
    payload, rewards, correct, tokens, truncated = sampled
    rollouts.add(payload, rewards, correct, tokens, seconds, truncated, sync_wait_s)
    phases.mark("first_rollout")
    if batch in self.taken:
      self._record(batch)

  def _record(self, batch: int) -> None:
    done = self.complete(batch)
    if self.recorded is not None and done is not None:
      self.recorded.append(done)

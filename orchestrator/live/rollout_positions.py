"""RolloutPositions: what a checkpoint before a step carries of a live source's sampling, and where a restored one
goes on.

A position before step k carries the batches sampled with weights older than k (``WeightVersions.carried``): a
run resumed at k holds no weights to sample them again. Without in-flight updates each is whole. With them the
last may be cut: its decode chunks from ``BatchSchedule.chunks_before`` on sample with weights from k on, which
the sync after the checkpoint delivers, so the position carries the batch's micro-batches sampled before the cut
and, where the cut falls inside a sampler call, that call's generation so far (``RolloutThread.generation``,
kept while the call waits for those weights). A run resumed there goes on from them (``chunked_sampling``'s
``resume_from``) as the uninterrupted run went on. The live source's condition guards every method.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from orchestrator.contract import SourceStateError
from orchestrator.live.chunked_sampling import PartialGeneration
from orchestrator.live.rollout_batches import BatchSchedule, SampledBatches
from orchestrator.live.rollout_thread import RolloutThread
from orchestrator.live.shared_sampler import call_seed
from orchestrator.live.weight_versions import WeightVersions

#: Where a position cuts a batch: (batch, micro-batches before the sampler call the cut falls in, the cut's decode
#: chunk in that call; 0: the call starts there).
Cut = tuple[int, int, int]


class RolloutPositions:
  """The positions of one live source (its schedule, weights kept, batches sampled and sampling thread), the run
  being ``run_batches`` batches long."""

  def __init__(self, schedule: BatchSchedule, versions: WeightVersions, batches: SampledBatches,
               sampling: RolloutThread, shape, *, run_batches: int):
    self._schedule, self._versions, self._batches, self._sampling = schedule, versions, batches, sampling
    self._shape, self._run_batches = shape, run_batches

  def _whole_before(self, batch: int, position: int) -> bool:
    """Whether every decode chunk of ``batch`` samples with weights older than ``position``'s (always, for a batch
    a position carries, without in-flight updates)."""
    return self._schedule.chunks_before(batch, position) == self._schedule.chunks_per_batch

  def cut(self, position: int) -> Cut | None:
    """The batch that a position before step ``position`` cuts (the run's, or one past its end that a run
    extended from there trains); None where it cuts none. At most one: the last it carries (the versions a batch
    samples with stop short of the next batch's own)."""
    cut = [b for b in self._versions.carried(position) if not self._whole_before(b, position)]
    if not cut:
      return None
    call, in_call = divmod(self._schedule.chunks_before(cut[0], position), self._schedule.chunks_per_call)
    return cut[0], call * self._schedule.micro_batches_per_call, in_call

  def carriable(self, batch: int, position: int) -> bool:
    """Whether a position before step ``position`` can carry ``batch`` now: whole, or, the batch it cuts, sampled
    up to the cut with the generation there kept (the sampler waits there for the weights of ``position``, or,
    where they were synced before the checkpoint, may have gone on)."""
    cut = self.cut(position)
    if cut is None or batch != cut[0]:
      return self._batches.complete(batch) is not None
    return (len(self._batches.micro_batches_of(batch)) >= cut[1]
            and (cut[2] == 0 or self._generation_at(cut) is not None))

  def carried_json(self, position: int) -> dict[str, Any]:
    """What a position before step ``position`` carries, as JSON: ``sampled``, its batches (``BatchRollouts``),
    and, where it cuts a sampler call, ``generation``, that call's so far (``PartialGeneration``).

    Raises:
      RuntimeError: something it must carry is not there yet (``carriable`` first).
    """
    cut = self.cut(position)
    if cut is not None and cut[0] >= self._run_batches and not self.carriable(cut[0], position):
      cut = None  # past the end, as far as it is sampled: not as far as the cut (a stop asked for none of it)
    part = None if cut is None else (cut[0], cut[1], self._schedule.batch_version(cut[0]))
    sampled = self._batches.carried(position, self._versions.carried(position), self._run_batches, part)
    out: dict[str, Any] = {"sampled": [r.to_json() for r in sampled]}
    if cut is not None and cut[2]:
      generation = self._generation_at(cut)
      if generation is None:
        raise RuntimeError(f"the position before step {position} cuts a generation of"
                           f" {self._schedule.describe(cut[0])} that was not kept; wait for ready_to_checkpoint"
                           " first")
      out["generation"] = generation.to_json()
    return out

  def restore(self, position: int, state: dict[str, Any]) -> None:
    """Restores what ``carried_json`` wrote at ``position`` and starts the sampling thread after it: at the
    first batch not carried, or inside the batch the position cuts, going on from its generation.

    Raises:
      SourceStateError: the state does not carry what the schedule says a position there carries.
    """
    cut = self.cut(position)
    try:
      carried = self._batches.restore(state["sampled"], None if cut is None else cut[:2])
      generation = None if state.get("generation") is None else PartialGeneration.from_json(state["generation"])
    except ValueError as e:
      raise SourceStateError(f"the saved rollout position before step {position}: {e}") from None
    # Batches that need weights older than the checkpoint's cannot be sampled again: the state must carry them.
    problem = self._versions.carried_problem(position, carried, self._run_batches)
    if problem is not None:
      raise SourceStateError(problem)
    cut = cut if cut is not None and cut[0] in carried else None  # one past the end may not be carried
    expected = None if cut is None or cut[2] == 0 else cut[2]
    if (None if generation is None else generation.next_chunk) != expected:
      carries = "no generation" if generation is None else f"a generation before chunk {generation.next_chunk}"
      needs = "none" if expected is None else f"one before chunk {expected} of a sampler call"
      raise SourceStateError(f"the saved rollout position before step {position} carries {carries}, where the"
                             f" schedule needs {needs}; the run cannot be resumed from this checkpoint")
    problem = None if generation is None else self._generation_problem(generation, cut)
    if problem is not None:
      raise SourceStateError(f"the saved rollout position before step {position} carries a generation that"
                             f" {problem}; the run cannot be resumed from this checkpoint")
    self._sampling.first_batch = self._schedule.batch_of(position) + len(carried)
    if cut is not None:  # the cut batch goes on where its carried part ends
      self._sampling.first_batch, self._sampling.first_micro_batch = cut[0], cut[1]
      self._sampling.resume_generation = generation

  def _generation_problem(self, generation: PartialGeneration, cut: Cut) -> str | None:
    """What makes ``generation`` not the one this run samples for the call ``cut`` falls in (None: nothing):
    its seed, its rows, its length before the cut, each token's version, its ids inside the model's vocabulary
    (``LiveShape.vocab_size``), its log-probs. Its prompts and settings are checked by
    the call that resumes it (``chunked_sampling.sample_in_chunks``)."""
    batch, first, chunk = cut
    shape = self._shape
    seed = call_seed(shape.seed, batch, first)
    if generation.call.get("seed") != seed:
      return (f"was sampled with seed {generation.call.get('seed')!r}, not {seed} (the seed of"
              f" {self._schedule.describe(batch)}'s call at micro-batch {first})")
    rows = shape.micro_batches_per_call * shape.groups_per_micro_batch * shape.generations_per_group
    tokens = chunk * shape.decode_chunk_tokens
    counts = {len(generation.tokens), len(generation.logprobs), len(generation.done)}
    lengths = {len(row) for row in (*generation.tokens, *generation.logprobs)} | {len(generation.versions)}
    if counts != {rows} or lengths != {tokens}:
      return (f"holds {sorted(counts)} rows of {sorted(lengths)} tokens, where a call of this run samples {rows}"
              f" rows and {tokens} tokens come before chunk {chunk}")
    versions = [v for v in self._schedule.call_versions(batch, first // shape.micro_batches_per_call)[:chunk]
                for _ in range(shape.decode_chunk_tokens)]
    if generation.versions.tolist() != versions:
      return f"holds token versions {generation.versions.tolist()}, where the schedule gives {versions}"
    if any((row < 0).any() for row in generation.tokens):
      return "holds a negative token id"
    vocab = shape.vocab_size
    if vocab is not None and any((row >= vocab).any() for row in generation.tokens):
      return f"holds a token id of {max(int(row.max()) for row in generation.tokens)}, past the model's {vocab} ids"
    if not all(np.isfinite(row).all() and (row <= 0).all() for row in generation.logprobs):
      return "holds a log-prob that is not a finite number <= 0"
    return None

  def _generation_at(self, cut: Cut) -> PartialGeneration | None:
    """The generation the sampling thread kept of the call ``cut`` falls in, before its chunk (None: not yet)."""
    return self._sampling.generations.get(cut)

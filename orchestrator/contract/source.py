"""The contract between the step loop and where its steps come from: ``StepSource`` and ``LiveSource``.

A run pulls one step — ``micro_batches_per_step`` payloads — at a time from a
``StepSource``. Before each pull the program asks for the source's position;
a checkpoint keeps the position before the first step it does not cover, and a
resumed run hands it back, so it trains on exactly the steps an uninterrupted
run would have. Recorded and synthetic rollouts are step sources
(``orchestrator.data.sources``).

A source that samples its rollouts from the weights being trained (the live
loop, ``orchestrator.live.rollouts``) is also a ``LiveSource``: it says when a
step must wait for a weight sync, takes the sync, and reports what sampling
cost. Its waits have timeouts (``ready``, ``ready_to_checkpoint``, the
evaluation's ``stop``), so the program can look at its stop flag while the
sampler is slow or stuck. The program checks once, when it is built, which
parts a source has (``live_part``), the way the worker checks its engine's
capabilities.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from orchestrator.contract.engine import missing_methods


class SourceStateError(ValueError):
  """A saved source position that does not belong to this source (the message names both kinds)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeldOutScore:
  """What one evaluation on held-out prompts measured (a live source's ``evaluate``).

  Attributes:
    accuracy: the share of prompts whose greedy completion passes the task's own check.
    pass_k: completions sampled per prompt for pass@k (0: none sampled).
    pass_at_k: the share of prompts with at least one of its ``pass_k`` sampled completions passing (None
      without ``pass_k``). With exactly k samples per prompt this is the unbiased pass@k estimate's value.
  """

  accuracy: float
  pass_k: int = 0
  pass_at_k: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutStats:
  """What sampling one step's rollouts measured (a live source).

  Attributes:
    weights_version: the updates applied to the weights the step was sampled with.
    staleness: the step's index minus that version: how many updates the rollouts lag the weights the step
      trains (with several steps per sampled batch, it grows within each batch).
    reward_mean, reward_std: over the step's completions.
    accuracy: the share of completions whose reward is full marks.
    sampled_tokens_per_s: completion tokens sampled per second of sampling; None if nothing was timed.
    micro_batch_wait_s: seconds the loop waited, inside the step, for its micro-batches after the first
      (which the boundary before waited for: ``rollout_wait_s``); 0 when each was sampled before it was due.
    reward_min, reward_max: over the step's completions.
    completion_tokens_mean, completion_tokens_max: the step's completions' lengths, in tokens.
    truncated_fraction: the share of the step's completions cut at the length limit (no end token sampled);
      None for fixed-length answers, which have no end.
    reward_group_std: the mean over the step's groups of each group's reward std (TRL's ``reward_std``; the
      spread the advantages see, where ``reward_std`` pools every completion).
    frac_reward_zero_std: the share of the step's groups whose rewards are all equal: their advantages are 0,
      so they give no gradient (TRL's ``frac_reward_zero_std``).
    token_version_min, token_version_max, token_age_mean: with in-flight updates (each completion token carries
      the version that sampled it, ``Trajectory.versions``), the oldest and newest of the step's completion
      tokens' versions, and the mean over them of the step's index minus the version (updates behind the
      weights the step trains); None without in-flight updates, where every token has ``weights_version``.
    sampler_sync_wait_s: the seconds the sampler paused for weights over the calls that sampled the step's
      rollouts: before a batch's first call, for the sync of the version the batch samples with, and with in-flight
      updates between decode chunks, for a newer version's (each call's pause shared among its micro-batches, as its
      seconds are); None where nothing measured it (a batch carried by a checkpoint written without it).
  """

  weights_version: int
  staleness: int
  reward_mean: float
  reward_std: float
  accuracy: float
  sampled_tokens_per_s: float | None
  micro_batch_wait_s: float = 0.0
  reward_min: float | None = None
  reward_max: float | None = None
  completion_tokens_mean: float | None = None
  completion_tokens_max: int | None = None
  truncated_fraction: float | None = None
  reward_group_std: float | None = None
  frac_reward_zero_std: float | None = None
  token_version_min: int | None = None
  token_version_max: int | None = None
  token_age_mean: float | None = None
  sampler_sync_wait_s: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightTransfer:
  """What a weight sync moved: onto a sampler on devices of its own (``rollouts.placement: split``, what
  ``LiveSource.sync`` returns), gathered onto this process's sampler device from a mesh that spans several
  processes (a job's live loop), or over the wire from a trainer in another process (its export,
  ``WeightsOverWire.last_export``).

  Attributes:
    bytes: onto a sampler's devices, the bytes written there (every copy: a replicated leaf counts once per
      device); for a gather, the bytes of the whole weights this process keeps; over the wire, the bytes of
      the reply received (the weights and the header that lists them).
    seconds: from the transfer's dispatch until the copy was on the sampler's devices; for a gather, the host
      seconds of its dispatch (the sampler waits for it as it samples); over the wire, the export call's wall
      time (request, the trainer's copy to host, the reply).
    started_at, ended_at: the same span on ``time.perf_counter``'s clock (the program's default clock).
  """

  bytes: int
  seconds: float
  started_at: float
  ended_at: float


@runtime_checkable
class StepSource(Protocol):
  """An iterator of steps whose position can be saved and restored.

  Each ``next`` returns one step: a sequence of ``micro_batches_per_step``
  payloads, in training order. What a step holds must depend only on the
  source's settings and the step's index, never on timing.
  """

  def __iter__(self) -> Iterator[Sequence[Any]]:
    """The source itself."""
    ...

  def __next__(self) -> Sequence[Any]:
    """The next step's payloads (may block until they exist); ``StopIteration`` when the source is done."""
    ...

  def get_state(self) -> Any:
    """The position before the next step. Cheap (called before every pull); not necessarily JSON-able."""
    ...

  def state_json(self, state: Any) -> Mapping[str, Any]:
    """``state`` (from ``get_state``) as a JSON-able dict that names its kind (what a checkpoint keeps)."""
    ...

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Continues from a position ``state_json`` wrote.

    Raises:
      SourceStateError: the position belongs to another kind of source, or this one cannot take it.
    """
    ...

  def count_steps(self, limit: int) -> int:
    """How many whole steps the source holds from its start, up to ``limit``; its position is unchanged."""
    ...

  def close(self) -> None:
    """Stops whatever the source runs (a sampling thread); idempotent. Must not raise a sampling error."""
    ...


@runtime_checkable
class LiveSource(Protocol):
  """The part of a step source that samples from the weights being trained.

  Step ``s`` is sampled with the weights of a fixed version (``s - max_staleness``,
  floored at 0; with several steps per sampled batch, its batch's), so what it holds is the same in every
  boundary mode; only when it is ready varies.
  """

  @property
  def last_wait_s(self) -> float:
    """How long the last ``next`` blocked until its step was sampled."""
    ...

  def blocked_on_sync(self, step: int) -> bool:
    """Whether ``step``'s rollouts need weights that have not been synced yet (so it cannot be staged)."""
    ...

  def sync(self, version: int, weights: Any) -> WeightTransfer | None:
    """The weight sync: keeps the weights after ``version`` updates for the steps sampled from them; what it
    copied onto a sampler's own devices, where it has them, or gathered from a mesh spanning several processes
    (else None: a host copy). In a job of several processes every process calls it at the same point."""
    ...

  def step_stats(self, step: int) -> RolloutStats | None:
    """What sampling ``step`` measured; None for a step this run did not sample."""
    ...

  def check(self) -> None:
    """Raises the sampling thread's error, if it failed (the program calls it at every boundary)."""
    ...

  def sampling_on_trainer_devices_s(self, start: float, end: float) -> float | None:
    """The seconds of [``start``, ``end``] (``time.perf_counter``'s clock) in which a sampling call ran on the
    trainer's own devices, a call still running counted up to now; None where the sampler computes elsewhere
    (its own process, its own devices, a remote trainer's driver). A step that holds such a call holds work
    of the sampler's that no boundary mode changes: the measured saving leaves its span out
    (``policies.saving.boundary_span``). Must not block on the sampling thread's work."""
    ...

  def evaluate(self, weights: Any, version: int, prompts: int, *, pass_k: int = 0,
               stop: Callable[[], Any] | None = None) -> HeldOutScore | None:
    """Greedy accuracy of ``weights`` on ``prompts`` held-out prompts, and with ``pass_k`` pass@k over that many
    completions sampled per prompt (with a seed drawn from ``version``).

    While it waits for the sampler it looks at ``stop()`` now and then; None when that turned true first. In a
    job of several processes every process calls it at the same point: the weights are gathered first.
    """
    ...

  def keep_start_weights(self, weights: Any) -> None:
    """Keeps a host copy of the weights version 0 samples with, before the first step of a run that evaluates
    during the run (an evaluation replaces the sampler's weights; a batch still sampled with version 0 syncs
    them back from this copy)."""
    ...

  def eval_prompt_count(self, asked: int) -> int:
    """``asked``, or fewer where the held-out split is a list of fewer prompts (none evaluated twice)."""
    ...

  def held_out_count(self, limit: int) -> int:
    """The prompts the held-out split holds, counted up to ``limit``."""
    ...

  def recorded_steps(self) -> Sequence[Any] | None:
    """Every step taken so far when the run records its rollouts; None when it does not."""
    ...

  def step_samples(self, step: int, count: int) -> list[dict[str, Any]]:
    """Up to ``count`` of the taken ``step``'s completions, to read (``loop/sample_log.py`` names the fields);
    [] where the step has none."""
    ...

  def release(self) -> None:
    """Frees what sampling holds beyond its thread (a sampler's own process exits): after ``close`` and the
    last ``evaluate``; nothing samples or evaluates after it. A second call does nothing."""
    ...

  def ready(self, step: int, timeout_s: float) -> bool:
    """Waits at most ``timeout_s`` until taking ``step`` (``get_state``, then ``next``) would not wait for
    sampling: its first micro-batch is sampled. True then, False on the timeout. Raises the sampling thread's
    error."""
    ...

  def micro_batch_ready(self, step: int, index: int, timeout_s: float) -> bool:
    """Waits at most ``timeout_s`` until micro-batch ``index`` of the taken ``step`` is sampled (a step is
    taken once its first is: the later ones stream in, in training order); True then, False on the timeout.
    The seconds waited go in the step's ``RolloutStats.micro_batch_wait_s``. Raises the sampling thread's
    error."""
    ...

  def ready_to_checkpoint(self, position: int, timeout_s: float, *, extendable: bool = True) -> bool:
    """Waits at most ``timeout_s`` until a checkpoint at ``position`` (the position before that step) has
    every sampled step it must carry: those sampled with weights older than its own, which a resumed run
    cannot sample again. True then, False on the timeout.

    ``extendable``: also the steps past the source's last one that the position carries (the source samples
    them on this request), so the run can be extended from the checkpoint; without it, only those the run
    itself trains.
    """
    ...

  def sampling_left_s(self, position: int) -> float | None:
    """Seconds, at the sampler's measured pace, until a checkpoint at ``position`` has the sampled steps of the
    run it must carry (``ready_to_checkpoint`` without ``extendable``): 0.0 when it has them; None before the
    sampler's pace was measured. It waits for nothing: a stop uses it to bound its wait for them."""
    ...


def live_part(source: Any) -> LiveSource | None:
  """``source`` as a ``LiveSource``, or None when it has none of that part (judged by ``missing_methods``).

  Raises:
    TypeError: the source has some of ``LiveSource``'s members but not all (named).
  """
  missing = missing_methods(source, LiveSource)
  if not missing:
    return source
  if len(missing) < len(missing_methods(object(), LiveSource)):
    raise TypeError(f"{type(source).__name__} is part live source: it lacks {', '.join(missing)}")
  return None


#: What marks an object as meaning to be a ``StepSource`` (a position); one with some of them must have all.
POSITION_METHODS = ("get_state", "set_state", "state_json")


def missing_step_source_methods(source: Any) -> tuple[str, ...] | None:
  """The ``StepSource`` members ``source`` lacks; None when it has no position at all (a plain iterable).

  An object with a position (any of ``POSITION_METHODS``) but not the whole contract is not a plain
  iterable either: the program must not silently drop its position, so it gets the list of what it lacks.
  """
  missing = missing_methods(source, StepSource)
  if any(name not in missing for name in POSITION_METHODS):
    if not callable(getattr(type(source), "__next__", None)):
      missing = ("__next__", *missing)
    return missing
  return None

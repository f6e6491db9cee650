"""The contract between the step loop and a trainer worker: the ``Worker`` Protocol and its result types.

A worker owns one engine privately and offers the program exactly what it
needs. ``orchestrator.loop.trainer_worker.TrainerWorker`` is the worker in this
process; ``orchestrator.remote.client.RemoteTrainerWorker`` is the same surface
over an RPC. Both return the types below, and both hold the one table of which
call may follow which (``ALLOWED_TRANSITIONS``, applied by ``next_call_state``),
raising ``WorkerUsageError`` for calls out of order in the same words, so the
program cannot tell them apart.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from orchestrator.contract.engine import DeviceMemory, PreparedInput, Receipt, StepMetrics, missing_methods
from orchestrator.contract.source import WeightTransfer


class WorkerUsageError(RuntimeError):
  """The worker was driven out of order (the message says what and what to call instead)."""


class NoCheckpointError(ValueError):
  """A restore asked for a checkpoint the trainer does not hold (the message names its directory and what it
  holds); a ``ValueError``, as a bad step is."""


class CallState(enum.Enum):
  """Where a worker stands between two calls, as far as their order is concerned.

  ``update_owed`` and ``has_staged`` are the two facts the ``Worker`` reports;
  ``STAGED_DISPATCHED`` is the remote worker's alone: the round trip of a deferred update also dispatched the
  staged input (``apply_deferred_update``'s ``then_dispatch_staged``), whose receipt waits for the
  ``fwd_bwd_staged`` that takes it.
  """

  READY = "ready"
  STAGED = "staged"
  UPDATE_OWED = "update owed"
  UPDATE_OWED_STAGED = "update owed, input staged"
  STAGED_DISPATCHED = "staged input dispatched with the update"

  @property
  def update_owed(self) -> bool:
    return self in (CallState.UPDATE_OWED, CallState.UPDATE_OWED_STAGED)

  @property
  def has_staged(self) -> bool:
    return self in (CallState.STAGED, CallState.UPDATE_OWED_STAGED, CallState.STAGED_DISPATCHED)


class Call(enum.Enum):
  """A worker call whose order the contract rules, one member per way it can change the ``CallState``.

  The value is the call as its refusals name it (``method``).
  """

  FWD_BWD = "fwd_bwd"
  FWD_BWD_DEFERRING = "fwd_bwd(defer_update=True)"
  STAGE = "stage_fwd_bwd"
  FWD_BWD_STAGED = "fwd_bwd_staged"
  FWD_BWD_STAGED_DEFERRING = "fwd_bwd_staged(defer_update=True)"
  FWD_BWD_STAGED_UPDATING = "fwd_bwd_staged(apply_optimizer=True)"
  APPLY_DEFERRED_UPDATE = "apply_deferred_update"
  APPLY_DEFERRED_UPDATE_THEN_STAGED = "apply_deferred_update(then_dispatch_staged=True)"
  UPDATE = "update"
  RESTORE_CHECKPOINT = "restore_checkpoint"

  @property
  def method(self) -> str:
    """The worker method this call is."""
    return self.value.partition("(")[0]

  @staticmethod
  def dispatch(*, staged: bool, apply_optimizer: bool, defer_update: bool) -> Call:
    """The micro-batch dispatch with these options (``defer_update`` wins over ``apply_optimizer``, as it does
    in the worker)."""
    if not staged:
      return Call.FWD_BWD_DEFERRING if defer_update else Call.FWD_BWD
    if defer_update:
      return Call.FWD_BWD_STAGED_DEFERRING
    return Call.FWD_BWD_STAGED_UPDATING if apply_optimizer else Call.FWD_BWD_STAGED


# Why a call is refused, in the words both workers have always used ({method}: the call's method).
_OWED = "{method}: the previous step's update is still owed; call apply_deferred_update() first"
_ALREADY_STAGED = "{method}: an input is already staged; dispatch it with fwd_bwd_staged() first"
_NOTHING_STAGED = "{method}: nothing is staged; call stage_fwd_bwd(payload) first"
_NOT_OWED = "{method}: no update is owed; defer one with fwd_bwd(..., defer_update=True)"
_NOTHING_STAGED_TO_FOLLOW = ("{call}: nothing is staged, so the update was not applied either; stage an input first,"
                             " or send then_dispatch_staged=false")
_TAKE_THE_DISPATCHED = ("{method}: the staged input was already dispatched with the deferred update; take it with"
                        " fwd_bwd_staged() first")
_DISPATCHED_AS_IT_IS = ("{method}: the staged input went out with the deferred update as a step's first micro-batch;"
                        " it cannot also apply or defer an update")

_S = CallState
#: Which call may follow which: per state, every ruled call leads to the next state or is refused with its
#: reason. Calls not in ``Call`` (the reads, ``save_checkpoint``, the waits) are allowed in every state.
ALLOWED_TRANSITIONS: Mapping[CallState, Mapping[Call, CallState | str]] = {
    _S.READY: {
        Call.FWD_BWD: _S.READY, Call.FWD_BWD_DEFERRING: _S.UPDATE_OWED, Call.STAGE: _S.STAGED,
        Call.FWD_BWD_STAGED: _NOTHING_STAGED, Call.FWD_BWD_STAGED_DEFERRING: _NOTHING_STAGED,
        Call.FWD_BWD_STAGED_UPDATING: _NOTHING_STAGED, Call.APPLY_DEFERRED_UPDATE: _NOT_OWED,
        Call.APPLY_DEFERRED_UPDATE_THEN_STAGED: _NOTHING_STAGED_TO_FOLLOW, Call.UPDATE: _S.READY,
        Call.RESTORE_CHECKPOINT: _S.READY,
    },
    _S.STAGED: {
        Call.FWD_BWD: _S.STAGED, Call.FWD_BWD_DEFERRING: _S.UPDATE_OWED_STAGED, Call.STAGE: _ALREADY_STAGED,
        Call.FWD_BWD_STAGED: _S.READY, Call.FWD_BWD_STAGED_DEFERRING: _S.UPDATE_OWED,
        Call.FWD_BWD_STAGED_UPDATING: _S.READY, Call.APPLY_DEFERRED_UPDATE: _NOT_OWED,
        Call.APPLY_DEFERRED_UPDATE_THEN_STAGED: _NOT_OWED, Call.UPDATE: _S.STAGED,
        Call.RESTORE_CHECKPOINT: _S.READY,
    },
    _S.UPDATE_OWED: {
        Call.FWD_BWD: _OWED, Call.FWD_BWD_DEFERRING: _OWED, Call.STAGE: _S.UPDATE_OWED_STAGED,
        Call.FWD_BWD_STAGED: _NOTHING_STAGED, Call.FWD_BWD_STAGED_DEFERRING: _NOTHING_STAGED,
        Call.FWD_BWD_STAGED_UPDATING: _NOTHING_STAGED, Call.APPLY_DEFERRED_UPDATE: _S.READY,
        Call.APPLY_DEFERRED_UPDATE_THEN_STAGED: _NOTHING_STAGED_TO_FOLLOW, Call.UPDATE: _OWED,
        Call.RESTORE_CHECKPOINT: _OWED,
    },
    _S.UPDATE_OWED_STAGED: {
        Call.FWD_BWD: _OWED, Call.FWD_BWD_DEFERRING: _OWED, Call.STAGE: _ALREADY_STAGED,
        Call.FWD_BWD_STAGED: _OWED, Call.FWD_BWD_STAGED_DEFERRING: _OWED, Call.FWD_BWD_STAGED_UPDATING: _OWED,
        Call.APPLY_DEFERRED_UPDATE: _S.STAGED, Call.APPLY_DEFERRED_UPDATE_THEN_STAGED: _S.STAGED_DISPATCHED,
        Call.UPDATE: _OWED, Call.RESTORE_CHECKPOINT: _OWED,
    },
    _S.STAGED_DISPATCHED: {
        Call.FWD_BWD: _TAKE_THE_DISPATCHED, Call.FWD_BWD_DEFERRING: _TAKE_THE_DISPATCHED,
        Call.STAGE: _ALREADY_STAGED, Call.FWD_BWD_STAGED: _S.READY,
        Call.FWD_BWD_STAGED_DEFERRING: _DISPATCHED_AS_IT_IS, Call.FWD_BWD_STAGED_UPDATING: _DISPATCHED_AS_IT_IS,
        Call.APPLY_DEFERRED_UPDATE: _NOT_OWED, Call.APPLY_DEFERRED_UPDATE_THEN_STAGED: _NOT_OWED,
        Call.UPDATE: _TAKE_THE_DISPATCHED, Call.RESTORE_CHECKPOINT: _S.READY,
    },
}


def next_call_state(state: CallState, call: Call) -> CallState:
  """The state ``call`` leads to from ``state`` (``ALLOWED_TRANSITIONS``); it changes nothing itself.

  Raises:
    WorkerUsageError: ``call`` may not follow ``state``; the message says why and what to call instead.
  """
  outcome = ALLOWED_TRANSITIONS[state][call]
  if isinstance(outcome, CallState):
    return outcome
  raise WorkerUsageError(outcome.format(method=call.method, call=call.value))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerCapabilities:
  """What the engine behind a worker can do, decided once when the worker is built.

  Attributes:
    can_stage: the engine has every ``StagingEngine`` method.
    missing_staging_methods: the ``StagingEngine`` methods it lacks, in the Protocol's order.
    can_checkpoint: it can save and restore checkpoints.
    can_export_weights: it can hand out its weights for the sync.
    can_report_memory: it reports its devices' memory (``device_memory`` answered, once, when the worker
      was built; CPU backends do not).
  """

  can_stage: bool
  missing_staging_methods: tuple[str, ...]
  can_checkpoint: bool
  can_export_weights: bool
  can_report_memory: bool = False


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class StageReceipt:
  """What staging the next micro-batch cost the host, what it holds on the devices, and its fingerprint.

  Attributes:
    stage_s: host seconds ``stage_fwd_bwd`` took (input mapping plus issuing the copy).
    started_at, ended_at: ``time.perf_counter()`` around that call.
    prepared: the staged input (a ``PreparedInput``: its ``digest`` hashed only when asked).
    staged_bytes_per_device: bytes the staged input holds on each device, in device-id order (this
      process's devices); None when the engine does not say.
    staged_bytes_by_field: the same bytes by input field (tokens, masks, advantages, log-probs, …), each
      over this process's devices; None when the engine does not say.
    memory: the devices' memory right after the stage (``DeviceMemory``); None when the engine cannot tell.
  """

  stage_s: float
  started_at: float
  ended_at: float
  prepared: Any = dataclasses.field(repr=False)
  staged_bytes_per_device: tuple[int, ...] | None = None
  memory: DeviceMemory | None = None
  staged_bytes_by_field: dict[str, int] | None = None

  @property
  def input_digest(self) -> str | None:
    """The staged input's content digest (hashed on first use, off the hot path); None where the input has
    none (a ``PreparedInput``'s ``digest`` missing or None)."""
    return None if missing_methods(self.prepared, PreparedInput) else self.prepared.digest


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeferredUpdate:
  """The owed update, applied.

  Attributes:
    device_wait_s: how long the host blocked on the device after the stage, until the step's last
      micro-batch was done (how long queued work still ran).
    wait_started_at: ``time.perf_counter()`` when the call began.
    update: the update's receipt.
    update_returned_at: where the update was dispatched first and the wait came after it, when ``update()``
      returned (the wait then ran from there to the call's end); None where the wait came first
      (``wait_started_at`` to ``wait_started_at + device_wait_s``, then the update).
  """

  device_wait_s: float
  wait_started_at: float
  update: Receipt
  update_returned_at: float | None = None


@runtime_checkable
class Worker(Protocol):
  """What the step loop drives: micro-batches, staged inputs, deferred updates and the boundary's reads.

  One caller drives a worker. Every call out of order raises
  ``WorkerUsageError`` and changes nothing: which call may follow which is
  ``ALLOWED_TRANSITIONS`` (a second ``stage_fwd_bwd`` with one pending,
  ``fwd_bwd_staged`` with none, ``apply_deferred_update`` with no update owed,
  a micro-batch of a new step while an update is still owed); staging on an
  engine that cannot is refused too.
  """

  capabilities: WorkerCapabilities

  @property
  def update_owed(self) -> bool:
    """True between ``fwd_bwd(..., defer_update=True)`` and ``apply_deferred_update()``."""
    ...

  @property
  def has_staged(self) -> bool:
    """True between ``stage_fwd_bwd`` and the dispatch of what it staged."""
    ...

  def fwd_bwd(self, payload: Any, apply_optimizer: bool = False, defer_update: bool = False) -> Receipt:
    """Dispatches one micro-batch from its payload (with ``defer_update``, an update is then owed)."""
    ...

  def stage_fwd_bwd(self, payload: Any) -> StageReceipt:
    """Prepares ``payload`` ahead and keeps it; dispatches nothing. Allowed while an update is owed."""
    ...

  def fwd_bwd_staged(self, apply_optimizer: bool = False, defer_update: bool = False) -> Receipt:
    """Dispatches the staged input as the next micro-batch (same options as ``fwd_bwd``)."""
    ...

  def apply_deferred_update(self) -> DeferredUpdate:
    """Runs the owed update and waits until the step's last micro-batch is done (``DeferredUpdate``)."""
    ...

  def update(self) -> Receipt:
    """Runs the update now, without waiting for the device."""
    ...

  def sample_wait_floor(self, samples: int) -> list[float]:
    """``samples`` device waits with nothing in flight (the runtime's own wait floor)."""
    ...

  def wait_for_device(self) -> float:
    """One wait for every queued computation; returns the seconds it took."""
    ...

  def get_metrics(self) -> StepMetrics:
    """The last applied update's metrics (may block until that update is done)."""
    ...

  def export_weights(self) -> Any:
    """The weights for the sync (valid after the next dispatch); None when the engine has none."""
    ...

  def state_digest(self) -> str | None:
    """The engine's state digest; None when it cannot fingerprint its state."""
    ...

  def device_memory(self) -> DeviceMemory | None:
    """The devices' memory now (``MemoryReportingEngine``); None when the engine cannot tell. Waits for nothing."""
    ...

  def save_checkpoint(self, metadata: Mapping[str, Any] | None = None) -> str:
    """Saves the state as of the last applied update; returns the checkpoint's path."""
    ...

  def restore_checkpoint(self, step: int | None = None) -> Mapping[str, Any]:
    """Restores the latest (or ``step``'s) checkpoint; drops a staged input; returns its metadata."""
    ...


@runtime_checkable
class WeightsOverWire(Protocol):
  """The part of a worker whose trainer runs in another process: ``export_weights`` moves the weights over a
  wire, and the weight sync records what that moved (``loop.boundary_work.BoundaryWork.sync``)."""

  @property
  def last_export(self) -> WeightTransfer | None:
    """What the last ``export_weights`` received: the reply's bytes and the call's seconds; None before the
    first, and when the trainer had no weights to send."""
    ...

"""The contract between the step loop and a trainer worker: the ``Worker`` Protocol and its result types.

A worker owns one engine privately and offers the program exactly what it
needs. ``orchestrator.loop.trainer_worker.TrainerWorker`` is the worker in this
process; ``orchestrator.remote.client.RemoteTrainerWorker`` is the same surface
over an RPC. Both return the types below, and both raise ``WorkerUsageError``
for calls out of order, so the program cannot tell them apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from orchestrator.contract.engine import DeviceMemory, Receipt, StepMetrics
from orchestrator.contract.source import WeightTransfer


class WorkerUsageError(RuntimeError):
  """The worker was driven out of order (the message says what and what to call instead)."""


class NoCheckpointError(ValueError):
  """A restore asked for a checkpoint the trainer does not hold (the message names its directory and what it
  holds); a ``ValueError``, as a bad step is."""


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
    prepared: the staged input (anything with a ``digest``), hashed only when asked.
    staged_bytes_per_device: bytes the staged input holds on each device, in device-id order (this
      process's devices); None when the engine does not say.
    memory: the devices' memory right after the stage (``DeviceMemory``); None when the engine cannot tell.
  """

  stage_s: float
  started_at: float
  ended_at: float
  prepared: Any = dataclasses.field(repr=False)
  staged_bytes_per_device: tuple[int, ...] | None = None
  memory: DeviceMemory | None = None

  @property
  def input_digest(self) -> str | None:
    """The staged input's content digest (hashed on first use, off the hot path)."""
    return getattr(self.prepared, "digest", None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeferredUpdate:
  """The owed update, applied.

  Attributes:
    device_wait_s: how long the device still computed before the update could go.
    wait_started_at: ``time.perf_counter()`` when that wait began.
    update: the update's receipt.
  """

  device_wait_s: float
  wait_started_at: float
  update: Receipt


@runtime_checkable
class Worker(Protocol):
  """What the step loop drives: micro-batches, staged inputs, deferred updates and the boundary's reads.

  One caller drives a worker. Every call out of order raises
  ``WorkerUsageError`` and changes nothing: a second ``stage_fwd_bwd`` with one
  pending, ``fwd_bwd_staged`` with none, ``apply_deferred_update`` with no
  update owed, a micro-batch of a new step while an update is still owed,
  staging on an engine that cannot.
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
    """Waits for the device, then runs the owed update."""
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
  wire, and the weight sync records what that moved (``loop.weight_sync.timed_sync``)."""

  @property
  def last_export(self) -> WeightTransfer | None:
    """What the last ``export_weights`` received: the reply's bytes and the call's seconds; None before the
    first, and when the trainer had no weights to send."""
    ...

"""TrainerWorker: the orchestrator-facing trainer API over one engine.

The worker owns its engine privately and offers the program exactly what it
needs: micro-batches, staged inputs, deferred updates, metrics, checkpoints,
the weights for the sync, the state digest and wait-floor samples. In process
today; a remote worker implements the same surface over an RPC.

It satisfies ``orchestrator.contract.Worker`` and returns that contract's
result types. The engine is checked against ``orchestrator.contract`` once, at construction:
``TrainingEngine`` is required; ``StagingEngine``, ``CheckpointingEngine``,
``WeightSource`` and ``MemoryReportingEngine`` are optional and recorded in
``capabilities``; ``StateDigestingEngine`` is optional too (without it the
state digest is None).

Misuse is an error, never silently absorbed (``WorkerUsageError``): a call out
of the order the contract's ``ALLOWED_TRANSITIONS`` allows (a second
``stage_fwd_bwd`` with one pending, ``fwd_bwd_staged`` with none,
``apply_deferred_update`` with no update owed, a micro-batch of a new step
while an update is still owed), staging on an engine that cannot.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from orchestrator import contract
from orchestrator.contract import (
    DeferredUpdate,
    DeviceMemory,
    Receipt,
    StageReceipt,
    StepMetrics,
    WorkerCapabilities,
    WorkerUsageError,
)
from orchestrator.contract.worker import Call, CallState, next_call_state

__all__ = ["TrainerWorker", "WorkerUsageError", "WorkerCapabilities", "StageReceipt", "DeferredUpdate"]


class TrainerWorker:
  """Drives one engine through micro-batches, deferred updates and staged inputs.

  Args:
    engine: an ``orchestrator.contract.TrainingEngine``.

  Raises:
    TypeError: the engine lacks a required method.
  """

  def __init__(self, engine: Any):
    missing = contract.missing_methods(engine, contract.TrainingEngine)
    if missing:
      raise TypeError(f"{type(engine).__name__} cannot back a TrainerWorker: it lacks {', '.join(missing)}")
    self._engine = engine
    self.capabilities = WorkerCapabilities(
        can_stage=not contract.missing_methods(engine, contract.StagingEngine),
        missing_staging_methods=contract.missing_methods(engine, contract.StagingEngine),
        can_checkpoint=not contract.missing_methods(engine, contract.CheckpointingEngine),
        can_export_weights=not contract.missing_methods(engine, contract.WeightSource),
        can_report_memory=(not contract.missing_methods(engine, contract.MemoryReportingEngine)
                           and engine.device_memory() is not None),
    )
    self._can_digest_state = not contract.missing_methods(engine, contract.StateDigestingEngine)
    self._call_state = CallState.READY
    self._staged: Any = None  # the prepared input while the call state has one staged
    self._last_ready: Any = None  # the last micro-batch's completion handle (None: the engine gave none)
    self._step = 0
    self._micro = 0

  @property
  def call_state(self) -> CallState:
    """Where the worker stands in the contract's ``ALLOWED_TRANSITIONS``."""
    return self._call_state

  @property
  def update_owed(self) -> bool:
    """True between ``fwd_bwd(..., defer_update=True)`` and ``apply_deferred_update()``."""
    return self._call_state.update_owed

  @property
  def has_staged(self) -> bool:
    return self._call_state.has_staged

  def fwd_bwd(self, payload: Any, apply_optimizer: bool = False, defer_update: bool = False) -> Receipt:
    """Runs one micro-batch from its payload; returns its receipt.

    With ``apply_optimizer`` and not ``defer_update``: the engine's ``fwd_bwd``
    then its ``update()`` (the receipt's ``update``). With ``defer_update``:
    the micro-batch runs and an update is owed; ``apply_deferred_update()``
    must come before the next step's first micro-batch.

    Raises:
      WorkerUsageError: an update is still owed.
    """
    after = next_call_state(self._call_state, Call.dispatch(staged=False, apply_optimizer=apply_optimizer,
                                                           defer_update=defer_update))
    receipt = self._dispatch(payload, apply_optimizer, defer_update)
    self._call_state = after
    return receipt

  def stage_fwd_bwd(self, payload: Any) -> StageReceipt:
    """Prepares ``payload`` ahead (``prepare_fwd_bwd_input``) and keeps it; dispatches nothing.

    Allowed while an update is owed (that is the point of staging before the update). The receipt
    carries what the input holds per device and, where the engine reports it, the devices' memory
    after the stage (both read after the stage's own timing).

    Raises:
      WorkerUsageError: the engine cannot stage, or an input is already staged.
    """
    if not self.capabilities.can_stage:
      raise WorkerUsageError(
          f"stage_fwd_bwd: the engine lacks {', '.join(self.capabilities.missing_staging_methods)};"
          " check worker.capabilities.can_stage before staging")
    after = next_call_state(self._call_state, Call.STAGE)
    start = time.perf_counter()
    self._staged = self._engine.prepare_fwd_bwd_input(payload)
    end = time.perf_counter()
    self._call_state = after
    held = getattr(self._staged, "bytes_per_device", None)
    by_field = getattr(self._staged, "bytes_by_field", None)
    return StageReceipt(stage_s=end - start, started_at=start, ended_at=end, prepared=self._staged,
                        staged_bytes_per_device=None if held is None else tuple(int(n) for n in held),
                        memory=self.device_memory(),
                        staged_bytes_by_field=None if by_field is None else {k: int(v) for k, v in by_field.items()})

  def fwd_bwd_staged(self, apply_optimizer: bool = False, defer_update: bool = False) -> Receipt:
    """Dispatches the staged input as the next micro-batch (same options as ``fwd_bwd``).

    Raises:
      WorkerUsageError: nothing is staged, or an update is still owed.
    """
    after = next_call_state(self._call_state, Call.dispatch(staged=True, apply_optimizer=apply_optimizer,
                                                           defer_update=defer_update))
    staged, self._staged = self._staged, None
    self._call_state = next_call_state(self._call_state, Call.FWD_BWD_STAGED)  # spent even if the dispatch fails
    receipt = self._dispatch(staged, apply_optimizer, defer_update)
    self._call_state = after
    return receipt

  def apply_deferred_update(self) -> DeferredUpdate:
    """Dispatches the owed ``update()``, then waits until the step's last micro-batch is done.

    The update goes first so that it is queued behind that micro-batch and starts the moment it ends; a wait
    first would leave the devices idle while the host noticed and dispatched it. The device wait is what the
    host then blocked on the device: the update's own host wait (``Receipt.host_wait_s``: a dropped-token
    flag read under dropless re-runs, a non-finite check, an in-flight limit), the whole call where the
    engine does not say, and the wait on the last micro-batch's completion handle (none where the handle says
    it is ready: on a runtime whose every block costs a round trip, the update's own wait stands alone). An
    engine that gives no handle is waited on as before: ``wait_for_device()``, then the update.

    Raises:
      WorkerUsageError: no update is owed.
    """
    after = next_call_state(self._call_state, Call.APPLY_DEFERRED_UPDATE)
    last, self._last_ready = self._last_ready, None
    started = time.perf_counter()
    if not self.capabilities.can_stage or last is None:
      waited = self._engine.wait_for_device() if self.capabilities.can_stage else 0.0
      self._call_state = after
      return DeferredUpdate(device_wait_s=waited, wait_started_at=started, update=self._update())
    update = self._update()
    self._call_state = after
    returned = time.perf_counter()
    is_ready = getattr(last, "is_ready", None)
    if not (callable(is_ready) and is_ready()):  # done already (an update that read its flag): no block's floor
      last.block_until_ready()
    ended = time.perf_counter()
    update_wait_s = returned - started if update.host_wait_s is None else update.host_wait_s
    return DeferredUpdate(device_wait_s=update_wait_s + (ended - returned), wait_started_at=started,
                          update=update, update_returned_at=returned)

  def update(self) -> Receipt:
    """Runs the engine's ``update()`` now, without waiting for the device.

    Raises:
      WorkerUsageError: an update is owed (use ``apply_deferred_update``).
    """
    after = next_call_state(self._call_state, Call.UPDATE)
    receipt = self._update()
    self._call_state = after
    return receipt

  def _update(self) -> Receipt:
    receipt = Receipt.coerce(self._engine.update(), kind="update", step=self._step, micro_step=-1)
    self._step, self._micro = self._step + 1, 0
    return receipt

  def _dispatch(self, x: Any, apply_optimizer: bool, defer_update: bool) -> Receipt:
    result = self._engine.fwd_bwd(x)
    receipt = Receipt.coerce(result, kind="fwd_bwd", step=self._step, micro_step=self._micro)
    self._micro += 1
    self._last_ready = receipt.ready
    if apply_optimizer and not defer_update:
      receipt = dataclasses.replace(receipt, update=self._update())
    return receipt

  def sample_wait_floor(self, samples: int) -> list[float]:
    """``samples`` waits with nothing in flight (after one unscored call that may pay one-off costs).

    Raises:
      WorkerUsageError: the engine cannot stage (it has no ``wait_for_device``).
    """
    if not self.capabilities.can_stage:
      raise WorkerUsageError("sample_wait_floor: the engine has no wait_for_device")
    self.wait_for_device()
    return [self.wait_for_device() for _ in range(samples)]

  def wait_for_device(self) -> float:
    """One wait for the device (the engine's ``wait_for_device``); returns the seconds it took.

    Raises:
      WorkerUsageError: the engine cannot stage (it has no ``wait_for_device``).
    """
    if not self.capabilities.can_stage:
      raise WorkerUsageError("wait_for_device: the engine has none")
    return self._engine.wait_for_device()

  def get_metrics(self) -> StepMetrics:
    """The engine's metrics of its last update (may block until that update is done), typed."""
    return StepMetrics.coerce(self._engine.get_metrics())

  def export_weights(self) -> Any:
    """The weights for the sync (device arrays, valid after the next dispatch); None if the engine has none."""
    return self._engine.export_weights() if self.capabilities.can_export_weights else None

  def reference_weights(self) -> Any:
    """The KL term's frozen reference weights (``engine.kl_beta`` > 0), where the engine holds them apart from
    the weights it trains; None otherwise (no KL term, or an engine that does not say)."""
    held = getattr(self._engine, "reference_weights", None)
    return held() if callable(held) else None

  def state_digest(self) -> str | None:
    """The engine's state digest; None if it cannot fingerprint its state (no ``StateDigestingEngine``)."""
    return self._engine.state_digest() if self._can_digest_state else None

  def device_memory(self) -> DeviceMemory | None:
    """The engine's ``device_memory()``; None when it cannot tell (``capabilities.can_report_memory``)."""
    return self._engine.device_memory() if self.capabilities.can_report_memory else None

  def save_checkpoint(self, metadata: Mapping[str, Any] | None = None) -> str:
    """Saves the training state as of the last applied update; returns the checkpoint's path.

    Allowed while the next step's update is owed: a pipelined boundary
    checkpoints step k after step k+1's first micro-batch was dispatched.

    Raises:
      WorkerUsageError: the engine cannot checkpoint.
    """
    if not self.capabilities.can_checkpoint:
      raise WorkerUsageError("save_checkpoint: the engine has no save_checkpoint")
    return self._engine.save_checkpoint(metadata)

  def restore_checkpoint(self, step: int | None = None) -> Mapping[str, Any]:
    """Restores the latest (or ``step``'s) checkpoint; drops a staged input; returns its metadata."""
    after = next_call_state(self._call_state, Call.RESTORE_CHECKPOINT)
    if not self.capabilities.can_checkpoint:
      raise WorkerUsageError("restore_checkpoint: the engine has no restore_checkpoint")
    metadata = self._engine.restore_checkpoint(step)
    self._staged, self._call_state = None, after
    self._step, self._micro = int(metadata.get("step", self._step)), 0
    return metadata

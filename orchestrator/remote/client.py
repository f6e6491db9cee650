"""``RemoteTrainerWorker``: the ``TrainerWorker`` surface over gRPC, for a trainer in another process or host.

It is one more implementation of the worker the program drives (the same
methods, the same typed results, the same call-order table), so the program,
the recorder, the policy and the rig run unchanged. It calls through a
``connection.TrainerConnection``, which holds the session, moves the server's
times onto the driver's clock and turns the wire's failures into
``TrainerLostError``, ``TrainerRefusedError``, ``WorkerUsageError`` or
``ValueError``. What differs from a local worker is made explicit:

* **Call order.** A call out of order is refused here, before a round trip,
  by the contract's ``ALLOWED_TRANSITIONS`` (the server holds the same table,
  for any other client).
* **The wait floor.** ``wait_for_device`` is a round trip: ``sample_wait_floor``
  times it from here, so the policy's threshold comes from the wire's floor.
  A deferred update's device wait is what the driver saw: the call's time less
  the update's own dispatch on the server.
* **The weights.** ``export_weights`` is the weight sync's transfer: the
  trainer's weights come back as host arrays, and ``last_export`` (the
  contract's ``WeightsOverWire``) says what that reply held on the wire and
  how long the call took, for the record.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from orchestrator.contract import (
    DeferredUpdate,
    DeviceMemory,
    Receipt,
    StageReceipt,
    StepMetrics,
    WeightTransfer,
    WorkerCapabilities,
    WorkerUsageError,
)
from orchestrator.contract.worker import Call, CallState, next_call_state
from orchestrator.remote import protocol, wire
from orchestrator.remote.connection import TrainerConnection, TrainerLostError, TrainerRefusedError

__all__ = ["RemoteTrainerWorker", "TrainerLostError", "TrainerRefusedError"]


@dataclasses.dataclass(frozen=True)
class _Staged:
  digest: str | None
  bytes_per_device: tuple[int, ...] | None = None


class RemoteTrainerWorker:
  """Drives the trainer served at ``address``; see the module docstring.

  Args:
    address: ``host:port`` of ``run_rl serve-trainer``.
    recipe_digest: ``protocol.recipe_digest`` of the driver's recipe (must match the server's).
    micro_batches_per_step: with more than one, a step's first micro-batch never defers an update,
      so a staged input is dispatched in the same round trip as the deferred update before it
      (``policies.call_order``: DISPATCH_FIRST_STAGED follows DEFERRED_UPDATE).
    token: the shared token, or None for a loopback server started without one.
    limits: message size limit and per-call timeout.

  Raises:
    TrainerRefusedError: the server refused the handshake (the message says why).
    TrainerLostError: nothing answers at ``address`` within the timeout.
  """

  def __init__(self, address: str, *, recipe_digest: str, token: str | None = None,
               limits: protocol.Limits = protocol.Limits(), micro_batches_per_step: int = 1):
    self.address = address
    self.limits = limits
    self._early_dispatch = micro_batches_per_step > 1
    self._early: Receipt | None = None  # the staged input's receipt while STAGED_DISPATCHED
    self._step, self._micro = 0, 0
    self._call_state = CallState.READY
    self.last_export: WeightTransfer | None = None  # the contract's WeightsOverWire: the sync records it
    self._connection = TrainerConnection(address, recipe_digest=recipe_digest, token=token, limits=limits,
                                         position=lambda: (self._step, self._micro))
    caps = self._connection.hello["capabilities"]
    self.capabilities = WorkerCapabilities(can_stage=caps["can_stage"],
                                           missing_staging_methods=tuple(caps["missing_staging_methods"]),
                                           can_checkpoint=caps["can_checkpoint"],
                                           can_export_weights=caps["can_export_weights"],
                                           # a trainer of a version before memory reports sends no such key
                                           can_report_memory=bool(caps.get("can_report_memory", False)))

  @property
  def offset_s(self) -> float:
    """The trainer's clock less the driver's, as the handshake estimated it."""
    return self._connection.offset_s

  @property
  def offset_error_s(self) -> float:
    return self._connection.offset_error_s

  def _call(self, header: dict, parts: list | None = None) -> tuple[dict, dict]:
    return self._connection.call(header, parts)

  @property
  def call_state(self) -> CallState:
    """Where the worker stands in the contract's ``ALLOWED_TRANSITIONS``."""
    return self._call_state

  @property
  def update_owed(self) -> bool:
    return self._call_state.update_owed

  @property
  def has_staged(self) -> bool:
    return self._call_state.has_staged

  def fwd_bwd(self, payload: Any, apply_optimizer: bool = False, defer_update: bool = False) -> Receipt:
    after = next_call_state(self._call_state, Call.dispatch(staged=False, apply_optimizer=apply_optimizer,
                                                           defer_update=defer_update))
    message = wire.encode_payload("fwd_bwd", list(payload), apply_optimizer=apply_optimizer,
                                  defer_update=defer_update)
    header, _ = self._call({"method": "fwd_bwd"}, message)
    return self._dispatched(self._connection.receipt(header["receipt"]), after)

  def stage_fwd_bwd(self, payload: Any) -> StageReceipt:
    after = next_call_state(self._call_state, Call.STAGE)
    start = time.perf_counter()
    header, _ = self._call({"method": "stage"}, wire.encode_payload("stage", list(payload)))
    end = time.perf_counter()
    held = header.get("staged_bytes_per_device")  # absent from a trainer of a version before memory reports
    staged = _Staged(header["input_digest"], None if held is None else tuple(held))
    self._call_state = after
    return StageReceipt(stage_s=end - start, started_at=start, ended_at=end, prepared=staged,
                        staged_bytes_per_device=staged.bytes_per_device,
                        memory=DeviceMemory.from_json(header.get("memory")),
                        staged_bytes_by_field=header.get("staged_bytes_by_field"))  # absent: an older trainer

  def fwd_bwd_staged(self, apply_optimizer: bool = False, defer_update: bool = False) -> Receipt:
    after = next_call_state(self._call_state, Call.dispatch(staged=True, apply_optimizer=apply_optimizer,
                                                           defer_update=defer_update))
    if self._call_state is CallState.STAGED_DISPATCHED:  # it went out with the deferred update
      receipt, self._early = self._early, None
      return self._dispatched(receipt, after)
    header, _ = self._call({"method": "fwd_bwd_staged", "apply_optimizer": apply_optimizer,
                            "defer_update": defer_update})
    return self._dispatched(self._connection.receipt(header["receipt"]), after)

  def _dispatched(self, receipt: Receipt, after: CallState) -> Receipt:
    self._micro += 1
    if receipt.update is not None:
      self._step, self._micro = self._step + 1, 0
    self._call_state = after
    return receipt

  def apply_deferred_update(self) -> DeferredUpdate:
    then_staged = self._early_dispatch and self._call_state.has_staged
    after = next_call_state(self._call_state, Call.APPLY_DEFERRED_UPDATE_THEN_STAGED if then_staged
                            else Call.APPLY_DEFERRED_UPDATE)
    started = time.perf_counter()
    header, _ = self._call({"method": "apply_deferred_update", "then_dispatch_staged": then_staged})
    elapsed = time.perf_counter() - started
    update = self._connection.receipt(header["receipt"])
    self._step, self._micro = self._step + 1, 0
    self._early = self._connection.receipt(header["staged_receipt"])
    self._call_state = after
    # What the driver waited: the call less the update's own time on the server.
    return DeferredUpdate(device_wait_s=max(0.0, elapsed - (header["call_s"] - header["device_wait_s"])),
                          wait_started_at=started, update=update)

  def update(self) -> Receipt:
    after = next_call_state(self._call_state, Call.UPDATE)
    header, _ = self._call({"method": "update"})
    self._step, self._micro = self._step + 1, 0
    self._call_state = after
    return self._connection.receipt(header["receipt"])

  def sample_wait_floor(self, samples: int) -> list[float]:
    """Round trips of ``wait_for_device`` with nothing in flight, timed here (after one unscored call)."""
    if not self.capabilities.can_stage:
      raise WorkerUsageError("sample_wait_floor: the engine has no wait_for_device")
    self.wait_for_device()
    return [self.wait_for_device() for _ in range(samples)]

  def wait_for_device(self) -> float:
    """One round trip of ``wait_for_device``, timed here: the trainer's wait plus the wire's."""
    if not self.capabilities.can_stage:
      raise WorkerUsageError("wait_for_device: the engine has none")
    start = time.perf_counter()
    self._call({"method": "wait_for_device"})
    return time.perf_counter() - start

  def device_memory(self) -> DeviceMemory | None:
    """The trainer's devices' memory (one round trip); None, asking nothing, when it does not report memory."""
    if not self.capabilities.can_report_memory:
      return None
    return DeviceMemory.from_json(self._call({"method": "device_memory"})[0]["memory"])

  def get_metrics(self) -> StepMetrics:
    return StepMetrics.coerce(self._call({"method": "get_metrics"})[0]["metrics"])

  def export_weights(self) -> Any:
    """The trainer's weights as host arrays; what crossed the wire for them is ``last_export``."""
    start = time.perf_counter()
    reply = self._connection.exchange({"method": "export_weights"})
    end = time.perf_counter()
    header, arrays = wire.decode(reply)
    if header.get("none"):
      self.last_export = None
      return None
    self.last_export = WeightTransfer(bytes=len(reply), seconds=end - start, started_at=start, ended_at=end)
    return wire.decode_tree(header, arrays)

  def state_digest(self) -> str | None:
    return self._call({"method": "state_digest"})[0]["digest"]

  def save_checkpoint(self, metadata: Mapping[str, Any] | None = None) -> str:
    return self._call({"method": "save_checkpoint", "metadata": dict(metadata or {})})[0]["path"]

  def restore_checkpoint(self, step: int | None = None) -> Mapping[str, Any]:
    after = next_call_state(self._call_state, Call.RESTORE_CHECKPOINT)
    metadata = self._call({"method": "restore_checkpoint", "step": step})[0]["metadata"]
    self._call_state, self._early = after, None
    self._step, self._micro = int(metadata.get("step", self._step)), 0
    return metadata

  def rig_begin_arm(self, fault: str | None) -> dict:
    """The rig's hook (``orchestrator.rig``): the trainer returns to the rig's starting state and records its
    engine calls; returns its batch shape."""
    header, _ = self._call({"method": "rig_begin_arm", "fault": fault})
    self._step, self._micro, self._call_state, self._early = 0, 0, CallState.READY, None
    return header

  def rig_end_arm(self) -> tuple[list, int]:
    """The rig's hook: the arm's engine calls as (kind, content digest) and the compiles it caused."""
    header, _ = self._call({"method": "rig_end_arm"})
    return header["events"], header["compiles"]

  def close(self) -> None:
    """Says goodbye (the server frees itself for the next driver) and closes the channel."""
    self._connection.close()

"""``RemoteTrainerWorker``: the ``TrainerWorker`` surface over gRPC, for a trainer in another process or host.

It is one more implementation of the worker the program drives (the same
methods, the same typed results), so the program, the recorder, the policy and
the rig run unchanged. What differs is made explicit:

* **Time.** The server stamps dispatch and completion times on its clock; the
  handshake estimates the offset (the sample with the shortest round trip,
  accurate to half of it) and every time is moved onto the driver's clock, so
  records, the trace and idle figures mean what they mean locally.
* **The wait floor.** ``wait_for_device`` is a round trip: ``sample_wait_floor``
  times it from here, so the policy's threshold comes from the wire's floor.
  A deferred update's device wait is what the driver saw: the call's time less
  the update's own dispatch on the server.
* **Faults.** Every call has a timeout (``Limits.timeout_s``). A server that
  stops answering, or fails on its side (``INTERNAL``), raises
  ``TrainerLostError`` naming the step and micro-batch. Misuse the server
  refuses (``FAILED_PRECONDITION`` "WorkerUsageError: ...") raises
  ``WorkerUsageError`` and a malformed value (``INVALID_ARGUMENT``
  "ValueError: ...") ``ValueError``, as the local worker would; any other
  refusal is a ``TrainerRefusedError``.
* **The weights.** ``export_weights`` is the weight sync's transfer: the
  trainer's weights come back as host arrays, and ``last_export`` (the
  contract's ``WeightsOverWire``) says what that reply held on the wire and
  how long the call took, for the record.
* **The session.** ``Hello`` answers a session id that every later call
  carries; the constructor opens the ``Attach`` stream and returns only once
  the server confirms it (the server serves no worker call before), and holds
  it for as long as it drives; if the driver dies the server drops its
  partial step.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping
from typing import Any

import grpc

from orchestrator.contract import (
    DeferredUpdate,
    DeviceMemory,
    NoCheckpointError,
    Receipt,
    StageReceipt,
    StepMetrics,
    WeightTransfer,
    WorkerCapabilities,
    WorkerUsageError,
)
from orchestrator.remote import protocol, wire

CLOCK_SAMPLES = 16
_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
         grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


class TrainerLostError(RuntimeError):
  """The remote trainer stopped answering (the message names the step and micro-batch)."""


class TrainerRefusedError(RuntimeError):
  """The remote trainer refused this driver (wrong token, version, recipe, or another driver attached)."""


@dataclasses.dataclass(frozen=True)
class _Staged:
  digest: str | None
  bytes_per_device: tuple[int, ...] | None = None


class RemoteCompletion:
  """A completion handle for a computation on the remote trainer; ``ready_at`` is on the driver's clock."""

  def __init__(self, worker: "RemoteTrainerWorker", computation_id: int):
    self._worker = worker
    self._id = computation_id
    self.ready_at: float | None = None

  def block_until_ready(self) -> "RemoteCompletion":
    if self.ready_at is None:
      header, _ = self._worker._call({"method": "wait_ready", "id": self._id,
                                      "timeout_s": self._worker.limits.timeout_s})
      self.ready_at = self._worker.to_local(header["ready_at"])
    return self


class RemoteTrainerWorker:
  """Drives the trainer served at ``address``; see the module docstring.

  Args:
    address: ``host:port`` of ``run_rl serve-trainer``.
    recipe_digest: ``protocol.recipe_digest`` of the driver's recipe (must match the server's).
    micro_batches_per_step: with more than one, a step's first micro-batch never defers an update,
      so a staged input is dispatched in the same round trip as the deferred update before it
      (``policies.call_order``: DISPATCH_FIRST_STAGED follows WAIT_AND_UPDATE).
    token: the shared token, or None for a loopback server started without one.
    limits: message size limit and per-call timeout.

  Raises:
    TrainerRefusedError: the server refused the handshake (the message says why).
    TrainerLostError: nothing answers at ``address`` within the timeout.
  """

  def __init__(self, address: str, *, recipe_digest: str, token: str | None = None,
               limits: protocol.Limits = protocol.Limits(), micro_batches_per_step: int = 1):
    self.address = address
    self._early_dispatch = micro_batches_per_step > 1
    self._early: Receipt | None = None
    self.limits = limits
    self._token = token
    self._channel = grpc.insecure_channel(address, options=limits.grpc_options())
    self._session: str | None = None
    self._step, self._micro = 0, 0
    self._update_owed = False
    self._staged: _Staged | None = None
    self.last_export: WeightTransfer | None = None  # the contract's WeightsOverWire: the sync records it
    self.offset_s, self.offset_error_s = 0.0, 0.0
    hello = self._unary("Hello", wire.encode({"protocol": protocol.PROTOCOL_VERSION,
                                               "recipe_digest": recipe_digest}))
    self._session = hello["session"]
    caps = hello["capabilities"]
    self.capabilities = WorkerCapabilities(can_stage=caps["can_stage"],
                                           missing_staging_methods=tuple(caps["missing_staging_methods"]),
                                           can_checkpoint=caps["can_checkpoint"],
                                           can_export_weights=caps["can_export_weights"],
                                           # a trainer of a version before memory reports sends no such key
                                           can_report_memory=bool(caps.get("can_report_memory", False)))
    self._estimate_offset()
    self._attach_confirmed = threading.Event()
    self._attached = False
    self._attach_error: grpc.RpcError | None = None
    self._attach = self._channel.unary_stream(f"/{protocol.SERVICE}/Attach")(
        wire.encode({}), metadata=self._metadata())
    self._lifeline = threading.Thread(target=self._hold, name="trainer-lifeline", daemon=True)
    self._lifeline.start()
    self._await_attached()

  # ------------------------------------------------------------------ plumbing
  def _metadata(self) -> list[tuple[str, str]]:
    meta = []
    if self._token is not None:
      meta.append((protocol.TOKEN_HEADER, self._token))
    if self._session is not None:
      meta.append((protocol.SESSION_HEADER, self._session))
    return meta

  def _raise(self, error: grpc.RpcError, call: str, started: float):
    code = error.code() if callable(getattr(error, "code", None)) else None
    detail = error.details() if callable(getattr(error, "details", None)) else str(error)
    if code == grpc.StatusCode.FAILED_PRECONDITION and detail.startswith("WorkerUsageError: "):
      raise WorkerUsageError(detail.removeprefix("WorkerUsageError: ")) from None
    if code == grpc.StatusCode.NOT_FOUND and detail.startswith("NoCheckpointError: "):
      raise NoCheckpointError(f"the trainer at {self.address} has no such checkpoint ({call}: NOT_FOUND):"
                              f" {detail.removeprefix('NoCheckpointError: ')}") from None
    if code == grpc.StatusCode.INVALID_ARGUMENT and detail.startswith("ValueError: "):
      raise ValueError(detail.removeprefix("ValueError: ")) from None
    if code == grpc.StatusCode.INTERNAL:  # the trainer answered, but failed on its side (its log has more)
      raise TrainerLostError(
          f"the trainer at {self.address} failed during step {self._step}, micro-batch {self._micro} ({call}:"
          f" INTERNAL after {time.perf_counter() - started:.1f} s): {detail}") from None
    if code in _LOST or code is None:
      raise TrainerLostError(
          f"the trainer at {self.address} stopped answering during step {self._step}, micro-batch"
          f" {self._micro} ({call}: {code.name if code else 'no status'} after {time.perf_counter() - started:.1f} s,"
          f" trainer.timeout_s={self.limits.timeout_s:g}): {detail}") from None
    raise TrainerRefusedError(f"the trainer at {self.address} refused {call}: {detail}") from None

  def _unary(self, name: str, request: bytes) -> dict:
    started = time.perf_counter()
    try:
      reply = self._channel.unary_unary(f"/{protocol.SERVICE}/{name}")(
          request, timeout=self.limits.timeout_s, metadata=self._metadata())
    except grpc.RpcError as e:
      self._raise(e, name, started)
    return wire.decode(reply)[0]

  def _call(self, header: dict, parts: list | None = None) -> tuple[dict, dict]:
    """One worker call: the request (``wire.encode_parts``) streamed in chunks, the reply joined and decoded."""
    return wire.decode(self._exchange(header, parts))

  def _exchange(self, header: dict, parts: list | None = None) -> bytes:
    """One worker call's request streamed in chunks; the reply joined, not yet decoded (its size is what
    crossed the wire)."""
    message = parts if parts is not None else wire.encode_parts(header)
    size = wire.message_size(message)
    if size > self.limits.max_message_bytes:
      raise wire.MessageTooLarge(
          f"{header.get('method')}: the request is {size:,} bytes, over the {self.limits.max_message_bytes:,}-byte"
          " limit (trainer.max_message_bytes); raise it on both ends or send smaller micro-batches")
    started = time.perf_counter()
    try:
      pieces = self._channel.stream_stream(f"/{protocol.SERVICE}/Invoke")(
          wire.chunks(message), timeout=self.limits.timeout_s, metadata=self._metadata())
      return wire.join(pieces, self.limits.max_message_bytes)
    except grpc.RpcError as e:
      self._raise(e, str(header.get("method")), started)

  def _estimate_offset(self) -> None:
    best = None
    for _ in range(CLOCK_SAMPLES):
      sent = time.perf_counter()
      server = self._unary("Clock", wire.encode({}))["server_time"]
      back = time.perf_counter()
      if best is None or back - sent < best[0]:
        best = (back - sent, server - (sent + back) / 2)
    self.offset_error_s, self.offset_s = best[0] / 2, best[1]

  def to_local(self, server_time: float | None) -> float | None:
    return None if server_time is None else server_time - self.offset_s

  def _hold(self) -> None:
    """Holds the Attach stream open; its first message is the server's word that this driver is attached."""
    try:
      for _ in self._attach:
        if not self._attach_confirmed.is_set():
          self._attached = True
          self._attach_confirmed.set()
    except grpc.RpcError as e:
      if not self._attached:
        self._attach_error = e
    finally:
      self._attach_confirmed.set()  # wakes the constructor however the stream ended

  def _await_attached(self) -> None:
    """Returns once the server confirmed the Attach stream; worker calls before that would be refused.

    Raises:
      TrainerRefusedError: the server refused the Attach (e.g. this driver missed the attach deadline).
      TrainerLostError: no confirmation within the timeout, or the stream ended without one.
    """
    started = time.perf_counter()
    self._attach_confirmed.wait(self.limits.timeout_s)
    if self._attached:
      return
    self._attach.cancel()
    self._channel.close()
    if self._attach_error is not None:
      self._raise(self._attach_error, "Attach", started)
    raise TrainerLostError(f"the trainer at {self.address} did not confirm the Attach stream within"
                           f" {time.perf_counter() - started:.1f} s (trainer.timeout_s={self.limits.timeout_s:g});"
                           " check that it is up, then reconnect")

  def _receipt(self, data: dict | None) -> Receipt | None:
    if data is None:
      return None
    ready = None if data["id"] is None else RemoteCompletion(self, data["id"])
    return Receipt(kind=data["kind"], step=data["step"], micro_step=data["micro_step"], ready=ready,
                   dispatched_at=self.to_local(data["dispatched_at"]), mapping_s=data["mapping_s"],
                   placement_s=data["placement_s"], host_wait_s=data["host_wait_s"],
                   update=self._receipt(data["update"]))

  def _after_dispatch(self, receipt: Receipt, defer_update: bool) -> Receipt:
    self._micro += 1
    if defer_update:
      self._update_owed = True
    if receipt.update is not None:
      self._step, self._micro = self._step + 1, 0
    return receipt

  # ------------------------------------------------------------------ the worker surface
  @property
  def update_owed(self) -> bool:
    return self._update_owed

  @property
  def has_staged(self) -> bool:
    return self._staged is not None

  def fwd_bwd(self, payload: Any, apply_optimizer: bool = False, defer_update: bool = False) -> Receipt:
    if self._early is not None:
      raise WorkerUsageError("fwd_bwd: the staged input was already dispatched with the deferred update;"
                             " take it with fwd_bwd_staged() first")
    message = wire.encode_payload("fwd_bwd", list(payload), apply_optimizer=apply_optimizer,
                                  defer_update=defer_update)
    header, _ = self._call({"method": "fwd_bwd"}, message)
    return self._after_dispatch(self._receipt(header["receipt"]), defer_update)

  def stage_fwd_bwd(self, payload: Any) -> StageReceipt:
    start = time.perf_counter()
    header, _ = self._call({"method": "stage"}, wire.encode_payload("stage", list(payload)))
    end = time.perf_counter()
    held = header.get("staged_bytes_per_device")  # absent from a trainer of a version before memory reports
    self._staged = _Staged(header["input_digest"], None if held is None else tuple(held))
    return StageReceipt(stage_s=end - start, started_at=start, ended_at=end, prepared=self._staged,
                        staged_bytes_per_device=self._staged.bytes_per_device,
                        memory=DeviceMemory.from_json(header.get("memory")))

  def fwd_bwd_staged(self, apply_optimizer: bool = False, defer_update: bool = False) -> Receipt:
    if self._early is not None:
      if apply_optimizer or defer_update:
        raise WorkerUsageError("fwd_bwd_staged: the staged input went out with the deferred update as a step's"
                               " first micro-batch; it cannot also apply or defer an update")
      receipt, self._early, self._staged = self._early, None, None
      return self._after_dispatch(receipt, False)
    header, _ = self._call({"method": "fwd_bwd_staged", "apply_optimizer": apply_optimizer,
                            "defer_update": defer_update})
    self._staged = None
    return self._after_dispatch(self._receipt(header["receipt"]), defer_update)

  def apply_deferred_update(self) -> DeferredUpdate:
    started = time.perf_counter()
    early = self._early_dispatch and self._staged is not None
    header, _ = self._call({"method": "apply_deferred_update", "then_dispatch_staged": early})
    elapsed = time.perf_counter() - started
    update = self._receipt(header["receipt"])
    self._update_owed = False
    self._step, self._micro = self._step + 1, 0
    self._early = self._receipt(header["staged_receipt"])
    # What the driver waited: the call less the update's own time on the server.
    return DeferredUpdate(device_wait_s=max(0.0, elapsed - (header["call_s"] - header["device_wait_s"])),
                          wait_started_at=started, update=update)

  def update(self) -> Receipt:
    header, _ = self._call({"method": "update"})
    self._step, self._micro = self._step + 1, 0
    return self._receipt(header["receipt"])

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
    reply = self._exchange({"method": "export_weights"})
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
    metadata = self._call({"method": "restore_checkpoint", "step": step})[0]["metadata"]
    self._staged, self._update_owed = None, False
    self._step, self._micro = int(metadata.get("step", self._step)), 0
    return metadata

  # ------------------------------------------------------------------ the rig's hooks (orchestrator.rig)
  def rig_begin_arm(self, fault: str | None) -> dict:
    """The trainer returns to the rig's starting state and records its engine calls; returns its batch shape."""
    header, _ = self._call({"method": "rig_begin_arm", "fault": fault})
    self._step, self._micro, self._staged, self._update_owed = 0, 0, None, False
    return header

  def rig_end_arm(self) -> tuple[list, int]:
    """The arm's engine calls as (kind, content digest) and the compiles it caused."""
    header, _ = self._call({"method": "rig_end_arm"})
    return header["events"], header["compiles"]

  def close(self) -> None:
    """Says goodbye (the server frees itself for the next driver) and closes the channel."""
    try:
      self._call({"method": "bye"})
    except (TrainerLostError, TrainerRefusedError):
      pass
    self._attach.cancel()
    self._channel.close()

"""A driver's session with a remote trainer: the channel, the handshake, the clock and the lifeline.

``TrainerConnection`` is what ``RemoteTrainerWorker`` calls through; it knows
nothing of micro-batches or call order. What it owns:

* **The session.** ``Hello`` answers a session id that every later call
  carries; the constructor opens the ``Attach`` stream and returns only once
  the server confirms it (the server serves no worker call before), and holds
  it for as long as it drives; if the driver dies the server drops its
  partial step.
* **Time.** The server stamps dispatch and completion times on its clock; the
  handshake estimates the offset (the sample with the shortest round trip,
  accurate to half of it) and ``receipt`` moves every time onto the driver's
  clock, so records, the trace and idle figures mean what they mean locally.
* **Faults.** Every call has a timeout (``Limits.timeout_s``). A server that
  stops answering, or fails on its side (``INTERNAL``), raises
  ``TrainerLostError`` naming the step and micro-batch. Misuse the server
  refuses (``FAILED_PRECONDITION`` "WorkerUsageError: ...") raises
  ``WorkerUsageError`` and a malformed value (``INVALID_ARGUMENT``
  "ValueError: ...") ``ValueError``, as the local worker would; any other
  refusal is a ``TrainerRefusedError``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from orchestrator.contract import NoCheckpointError, Receipt, WorkerUsageError
from orchestrator.remote import protocol, wire

CLOCK_SAMPLES = 16
_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
         grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


class TrainerLostError(RuntimeError):
  """The remote trainer stopped answering (the message names the step and micro-batch)."""


class TrainerRefusedError(RuntimeError):
  """The remote trainer refused this driver (wrong token, version, recipe, or another driver attached)."""


class RemoteCompletion:
  """A completion handle for a computation on the remote trainer; ``ready_at`` is on the driver's clock."""

  def __init__(self, connection: TrainerConnection, computation_id: int):
    self._connection = connection
    self._id = computation_id
    self.ready_at: float | None = None

  def block_until_ready(self) -> RemoteCompletion:
    if self.ready_at is None:
      header, _ = self._connection.call({"method": "wait_ready", "id": self._id,
                                         "timeout_s": self._connection.limits.timeout_s})
      self.ready_at = self._connection.to_local(header["ready_at"])
    return self


class TrainerConnection:
  """One attached session with the trainer served at ``address``; see the module docstring.

  Args:
    address: ``host:port`` of ``run_rl serve-trainer``.
    recipe_digest: ``protocol.recipe_digest`` of the driver's recipe (must match the server's).
    token: the shared token, or None for a loopback server started without one.
    limits: message size limit and per-call timeout.
    position: the driver's (step, micro-batch) now, which a ``TrainerLostError`` names.

  Attributes:
    hello: the server's answer to ``Hello`` (its capabilities among them).
    offset_s, offset_error_s: the server's clock less the driver's, and the estimate's error.

  Raises:
    TrainerRefusedError: the server refused the handshake (the message says why).
    TrainerLostError: nothing answers at ``address`` within the timeout.
  """

  def __init__(self, address: str, *, recipe_digest: str, token: str | None, limits: protocol.Limits,
               position: Callable[[], tuple[int, int]]):
    self.address = address
    self.limits = limits
    self._token = token
    self._position = position
    self._channel = grpc.insecure_channel(address, options=limits.grpc_options())
    self._session: str | None = None
    self.offset_s, self.offset_error_s = 0.0, 0.0
    self.hello = self.unary("Hello", wire.encode({"protocol": protocol.PROTOCOL_VERSION,
                                                  "recipe_digest": recipe_digest}))
    self._session = self.hello["session"]
    self._estimate_offset()
    self._attach_confirmed = threading.Event()
    self._attached = False
    self._attach_error: grpc.RpcError | None = None
    self._attach = self._channel.unary_stream(f"/{protocol.SERVICE}/Attach")(
        wire.encode({}), metadata=self.metadata())
    self._lifeline = threading.Thread(target=self._hold, name="trainer-lifeline", daemon=True)
    self._lifeline.start()
    self._await_attached()

  @property
  def channel(self) -> grpc.Channel:
    return self._channel

  def metadata(self) -> list[tuple[str, str]]:
    """What every call carries: the token (when there is one) and, after ``Hello``, the session."""
    meta = []
    if self._token is not None:
      meta.append((protocol.TOKEN_HEADER, self._token))
    if self._session is not None:
      meta.append((protocol.SESSION_HEADER, self._session))
    return meta

  def unary(self, name: str, request: bytes) -> dict:
    """One of the service's unary methods (``Hello``, ``Clock``); returns the reply's header."""
    started = time.perf_counter()
    try:
      reply = self._channel.unary_unary(f"/{protocol.SERVICE}/{name}")(
          request, timeout=self.limits.timeout_s, metadata=self.metadata())
    except grpc.RpcError as e:
      self._raise(e, name, started)
    return wire.decode(reply)[0]

  def call(self, header: dict, parts: list | None = None) -> tuple[dict, dict]:
    """One worker call: the request (``wire.encode_parts``) streamed in chunks, the reply joined and decoded."""
    return wire.decode(self.exchange(header, parts))

  def exchange(self, header: dict, parts: list | None = None) -> bytes:
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
          wire.chunks(message), timeout=self.limits.timeout_s, metadata=self.metadata())
      return wire.join(pieces, self.limits.max_message_bytes)
    except grpc.RpcError as e:
      self._raise(e, str(header.get("method")), started)

  def to_local(self, server_time: float | None) -> float | None:
    return None if server_time is None else server_time - self.offset_s

  def receipt(self, data: dict | None) -> Receipt | None:
    """A receipt the server sent, its times on the driver's clock and its completion a ``RemoteCompletion``."""
    if data is None:
      return None
    ready = None if data["id"] is None else RemoteCompletion(self, data["id"])
    return Receipt(kind=data["kind"], step=data["step"], micro_step=data["micro_step"], ready=ready,
                   dispatched_at=self.to_local(data["dispatched_at"]), mapping_s=data["mapping_s"],
                   placement_s=data["placement_s"], host_wait_s=data["host_wait_s"],
                   update=self.receipt(data["update"]))

  def close(self) -> None:
    """Says goodbye (the server frees itself for the next driver) and closes the channel."""
    try:
      self.call({"method": "bye"})
    except (TrainerLostError, TrainerRefusedError):
      pass
    self._attach.cancel()
    self._channel.close()

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
    step, micro = self._position()
    if code == grpc.StatusCode.INTERNAL:  # the trainer answered, but failed on its side (its log has more)
      raise TrainerLostError(
          f"the trainer at {self.address} failed during step {step}, micro-batch {micro} ({call}:"
          f" INTERNAL after {time.perf_counter() - started:.1f} s): {detail}") from None
    if code in _LOST or code is None:
      raise TrainerLostError(
          f"the trainer at {self.address} stopped answering during step {step}, micro-batch"
          f" {micro} ({call}: {code.name if code else 'no status'} after {time.perf_counter() - started:.1f} s,"
          f" trainer.timeout_s={self.limits.timeout_s:g}): {detail}") from None
    raise TrainerRefusedError(f"the trainer at {self.address} refused {call}: {detail}") from None

  def _estimate_offset(self) -> None:
    best = None
    for _ in range(CLOCK_SAMPLES):
      sent = time.perf_counter()
      server = self.unary("Clock", wire.encode({}))["server_time"]
      back = time.perf_counter()
      if best is None or back - sent < best[0]:
        best = (back - sent, server - (sent + back) / 2)
    self.offset_error_s, self.offset_s = best[0] / 2, best[1]

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

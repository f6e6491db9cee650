"""The trainer server: one ``TrainerWorker`` behind gRPC, driven by one client at a time.

``TrainerService`` owns its worker privately (built by ``make_worker``) and
serves the methods in ``protocol``. Worker calls run one at a time, in arrival
order; ``wait_ready`` (a completion time) does not take that lock, so the
driver's completion watcher never waits behind a dispatch. Receipts carry
server-clock times and a completion id; the server's own watcher stamps when
each computation finished, where it ran.

**Sessions are the only way in.** ``Hello`` (with the token, when the server
has one) claims the trainer and answers a session id; every other call
carries that id in its metadata (``protocol.SESSION_HEADER``), and ``Invoke``
is served only once the session is attached (its ``Attach`` stream open).
``Clock`` needs the session too, attached or not: it reads no training state,
but the driver always has the id by then, so one rule covers every call but
``Hello``. A refused call changes nothing. The rule:

* no session, or one this trainer never issued (or has forgotten: it keeps the
  last ``DriverSessions.REMEMBERED``): ``UNAUTHENTICATED``;
* a session it issued that no longer drives it (the driver detached, said
  goodbye, or missed the attach deadline; a newer driver may hold the trainer
  now), or ``Invoke`` before ``Attach``: ``FAILED_PRECONDITION``;
* ``Hello`` while a session is claimed or attached: ``RESOURCE_EXHAUSTED``.

A claim that does not attach within ``attach_deadline_s`` (default
``ATTACH_DEADLINE_S``) of its ``Hello`` answer is dropped, so a driver killed
between the two does not lock the trainer. A driver that goes away — its
``Attach`` stream ends — takes its partial step with it: the worker it drove
is discarded (its owed update, staged input and accumulated gradients are
never applied) and the next driver gets a fresh one (and restores a checkpoint
to resume). Between drivers nothing of the last one's state (weights, digest,
metrics, checkpoints) is served to anyone.

**Validate, then act.** Every request is checked whole before it changes
anything (``wire.decode`` and the per-method checks in ``_REQUEST_CHECKS``,
then the worker's own preconditions); a refused one leaves the state as it
was. The status says which kind of refusal it was: a malformed request is
``INVALID_ARGUMENT`` ("ValueError: ...", raised as ``ValueError`` by the
client), misuse of the worker is ``FAILED_PRECONDITION`` ("WorkerUsageError:
...", raised as ``WorkerUsageError``), and anything else that fails on the
server is logged here with its traceback and answered ``INTERNAL`` in one line
— never ``UNKNOWN``.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import jax

from orchestrator.remote import protocol, wire
from orchestrator.contract import NoCheckpointError, WorkerUsageError
from orchestrator.loop.trainer_worker import TrainerWorker
from orchestrator.loop.watcher import CompletionWatcher

log = logging.getLogger("step_boundary.remote")

ATTACH_DEADLINE_S = 10.0  # Hello to Attach is 16 clock samples on the driver's side: well under a second
MAX_WAIT_READY_S = 24 * 3600.0  # a completion wait longer than this is a mistake (trainer.timeout_s is 120 s)


class _Refused(Exception):
  """A call refused with ``code``; ``message`` is the one line the caller sees."""

  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code, self.message = code, message


def _invalid(error: Exception) -> _Refused:
  return _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"ValueError: {error}")


def _one_line(error: BaseException, limit: int = 300) -> str:
  text = " ".join(str(error).split()) or "(no message)"
  return f"{type(error).__name__}: {text if len(text) <= limit else text[:limit] + '...'}"


def _failure(call: str, error: Exception) -> _Refused:
  """The last resort: ``error`` logged here with its traceback, and one ``INTERNAL`` line for the caller."""
  log.error("trainer: %s failed", call, exc_info=error)
  return _Refused(grpc.StatusCode.INTERNAL, f"{call} failed on the trainer: {_one_line(error)}; the trainer's log"
                  " has the traceback")


def _guarded(call: str, body: Callable[[Any, Any], bytes]) -> Callable[[Any, Any], bytes]:
  """``body`` as a unary handler whose every error reaches the caller as a status, never ``UNKNOWN``."""
  def handle(request, context):
    try:
      return body(request, context)
    except _Refused as refusal:
      context.abort(refusal.code, refusal.message)
    except Exception as error:  # the last resort: logged, then one line
      refusal = _failure(call, error)
      context.abort(refusal.code, refusal.message)
  return handle


def _guarded_stream(call: str, body: Callable[[Any, Any], Iterator[bytes]]) -> Callable[[Any, Any], Iterator[bytes]]:
  """``_guarded`` for a handler that answers a stream."""
  def handle(request, context):
    try:
      yield from body(request, context)
    except _Refused as refusal:
      context.abort(refusal.code, refusal.message)
    except Exception as error:  # the last resort: logged, then one line
      refusal = _failure(call, error)
      context.abort(refusal.code, refusal.message)
  return handle


def _receipt_json(receipt, ids: Callable[[Any, str, int, int], int | None]) -> dict | None:
  if receipt is None:
    return None
  return {"kind": receipt.kind, "step": receipt.step, "micro_step": receipt.micro_step,
          "id": ids(receipt.ready, receipt.kind, receipt.step, receipt.micro_step),
          "dispatched_at": receipt.dispatched_at, "mapping_s": receipt.mapping_s,
          "placement_s": receipt.placement_s, "host_wait_s": receipt.host_wait_s,
          "update": _receipt_json(receipt.update, ids)}


def _stage_json(stage) -> dict:
  """What a stage reply carries: its seconds and digest, and (since they were added; a driver that does not know
  them ignores them) what the staged input holds per device and the devices' memory after the stage."""
  held, memory = stage.staged_bytes_per_device, stage.memory
  return {"stage_s": stage.stage_s, "input_digest": stage.input_digest,
          "staged_bytes_per_device": None if held is None else list(held),
          "memory": None if memory is None else memory.to_json()}


def _rig_host(rig):
  """The rig's host this trainer was served with; WorkerUsageError when it has none."""
  if rig is None:
    raise WorkerUsageError("this trainer was started without the rig's host; serve it with run_rl serve-trainer")
  return rig


def _number(value: Any) -> Any:
  """A metric as JSON: numbers keep their kind (an int stays an int), anything else becomes its text."""
  if hasattr(value, "item") and getattr(value, "size", 1) == 1:
    value = value.item()
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, (list, tuple)):  # per-micro-batch metrics stay lists, not their text
    return [_number(v) for v in value]
  try:
    return float(value)
  except (TypeError, ValueError):
    return str(value)


# ------------------------------------------------------------------ request checks (before anything acts)
def _no_fields(header, arrays) -> None:
  """The method reads nothing from its request."""


def _dispatch_fields(header, arrays) -> None:
  wire.read_flag(header, "apply_optimizer")
  wire.read_flag(header, "defer_update")


def _payload_fields(header, arrays) -> None:
  wire.decode_payload(header, arrays)
  _dispatch_fields(header, arrays)


def _wait_ready_fields(header, arrays) -> None:
  wire.read_int(header, "id", required=True)
  wire.read_seconds(header, "timeout_s", default_s=60.0, maximum_s=MAX_WAIT_READY_S)


def _save_checkpoint_fields(header, arrays) -> None:
  metadata = header.get("metadata", {})
  if not isinstance(metadata, dict):
    raise wire.WireError(f"save_checkpoint: metadata must be a JSON object, not {type(metadata).__name__}")


def _restore_checkpoint_fields(header, arrays) -> None:
  step = header.get("step")
  if step is not None and (type(step) is not int or step < 0):  # type(): a JSON true is no step
    raise wire.WireError(f"restore_checkpoint: step {step!r:.80} is not a checkpoint step; give a non-negative"
                         " integer (or leave it out for the latest)")


#: What each Invoke method's request must hold; a method not listed is UNIMPLEMENTED.
_REQUEST_CHECKS: dict[str, Callable[[dict, dict], None]] = {
    "fwd_bwd": _payload_fields,
    "stage": lambda header, arrays: wire.decode_payload(header, arrays),
    "fwd_bwd_staged": _dispatch_fields,
    "apply_deferred_update": lambda header, arrays: wire.read_flag(header, "then_dispatch_staged"),
    "update": _no_fields,
    "wait_for_device": _no_fields,
    "device_memory": _no_fields,
    "get_metrics": _no_fields,
    "export_weights": _no_fields,
    "echo": _no_fields,
    "state_digest": _no_fields,
    "save_checkpoint": _save_checkpoint_fields,
    "restore_checkpoint": _restore_checkpoint_fields,
    "rig_begin_arm": lambda header, arrays: wire.read_text(header, "fault"),
    "rig_end_arm": _no_fields,
    "wait_ready": _wait_ready_fields,
    "bye": _no_fields,
}


class DriverSessions:
  """Who may drive the trainer: at most one session, claimed by ``Hello`` and attached by ``Attach``.

  ``claim`` hands out a session; ``open_attach_window`` starts its attach deadline (after the trainer is
  ready, so building a fresh worker does not eat into it); a claim still not attached when the deadline
  passes is retired by a timer, which then calls ``on_expired(session)`` outside the lock. Retired ids
  are remembered (the last ``REMEMBERED``) so that a stale session is told apart from one never issued.
  Thread-safe.
  """

  REMEMBERED = 256

  def __init__(self, attach_deadline_s: float, on_expired: Callable[[str], None]):
    if not attach_deadline_s > 0:
      raise ValueError(f"attach_deadline_s={attach_deadline_s!r}: give a positive number of seconds")
    self.attach_deadline_s = attach_deadline_s
    self._on_expired = on_expired
    self._lock = threading.Lock()
    self._current: str | None = None
    self._attached = False
    self._claimed_at = 0.0  # time.time(), for the refusal's text
    self._attach_by: float | None = None  # time.monotonic(); None while Hello is still preparing
    self._timer: threading.Timer | None = None
    self._retired: collections.deque[str] = collections.deque(maxlen=self.REMEMBERED)
    self._worker_driven = False  # an attached driver may have changed the worker since it was built

  def claim(self) -> tuple[str, bool]:
    """A new session and whether the worker needs rebuilding (a driver attached since it was built).

    Raises:
      _Refused: RESOURCE_EXHAUSTED, a session is claimed or attached.
    """
    with self._lock:
      if self._current is not None:
        raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, self._held_text())
      self._current, self._attached, self._attach_by = secrets.token_hex(16), False, None
      self._claimed_at = time.time()
      needs_fresh_worker, self._worker_driven = self._worker_driven, False
      return self._current, needs_fresh_worker

  def _held_text(self) -> str:
    held_s = time.time() - self._claimed_at
    if self._attached:
      return (f"another driver has held this trainer for {held_s:.0f} s; one driver at a time: stop it, or wait"
              " for it to finish")
    if self._attach_by is None:
      return (f"another driver's Hello has been preparing this trainer for {held_s:.0f} s; one driver at a"
              " time: wait for it to attach or give up")
    left_s = max(0.0, self._attach_by - time.monotonic())
    return (f"another driver said Hello {held_s:.0f} s ago and has {left_s:.1f} s left to attach; one driver at"
            " a time: retry after that")

  def open_attach_window(self, session: str) -> None:
    """Starts ``session``'s attach deadline."""
    with self._lock:
      if session != self._current:
        return
      self._attach_by = time.monotonic() + self.attach_deadline_s
      self._timer = threading.Timer(self.attach_deadline_s, self._expire, args=(session,))
      self._timer.daemon = True
      self._timer.start()

  def _expire(self, session: str) -> None:
    with self._lock:
      if session != self._current or self._attached:
        return
      self._retire_locked()
    self._on_expired(session)

  def abandon(self, session: str) -> None:
    """Retires ``session`` whose Hello failed; the next Hello rebuilds the worker."""
    with self._lock:
      if session == self._current:
        self._retire_locked()
      self._worker_driven = True

  def attach(self, session: str | None) -> None:
    """Marks ``session`` attached.

    Raises:
      _Refused: the session rule (module docstring); FAILED_PRECONDITION when it is attached already or
        its deadline passed.
    """
    with self._lock:
      self._require_locked(session)
      if self._attached:
        raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                       "this session is attached already; a driver holds one Attach stream")
      if self._attach_by is None or time.monotonic() > self._attach_by:
        raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                       f"this session did not attach within {self.attach_deadline_s:g} s of Hello; say Hello again")
      self._attached = self._worker_driven = True
      if self._timer is not None:
        self._timer.cancel()

  def check(self, session: str | None, *, attached: bool) -> None:
    """Returns if ``session`` is the current one (and, with ``attached``, attached).

    Raises:
      _Refused: the session rule (module docstring).
    """
    with self._lock:
      self._require_locked(session)
      if attached and not self._attached:
        raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                       "this session has not attached yet; open its Attach stream before any worker call")

  def release(self, session: str | None) -> bool:
    """Retires ``session`` if it is the current one; returns whether it was."""
    with self._lock:
      if session is None or session != self._current:
        return False
      self._retire_locked()
      return True

  def _retire_locked(self) -> None:
    self._retired.append(self._current)
    self._current, self._attached, self._attach_by = None, False, None
    if self._timer is not None:
      self._timer.cancel()
      self._timer = None

  def _require_locked(self, session: str | None) -> None:
    if session is None:
      raise _Refused(grpc.StatusCode.UNAUTHENTICATED,
                     f"the call carries no trainer session (metadata {protocol.SESSION_HEADER}); say Hello and"
                     " Attach first")
    if self._current is not None and hmac.compare_digest(session.encode(), self._current.encode()):
      return
    if session in self._retired:
      raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                     f"session {session[:8]}... no longer drives this trainer (its driver detached, said goodbye"
                     f" or did not attach within {self.attach_deadline_s:g} s of Hello); reconnect with Hello")
    raise _Refused(grpc.StatusCode.UNAUTHENTICATED,
                   f"session {session[:8]!r}... is not one this trainer issued; say Hello and Attach first")


class TrainerService:
  """The gRPC handlers; see the module docstring.

  Args:
    make_engine: builds a fresh engine (called at start and after a driver is lost); the
      service wraps it in a ``TrainerWorker`` it owns.
    recipe_digest: ``protocol.recipe_digest`` of the recipe the worker was built from.
    token: the shared token, or None (loopback only; checked by ``serve``).
    limits: message size limit.
    on_driver_left: called (outside any lock) after a driver leaves, however it left (a claim that missed
      its attach deadline included).
    make_rig_host: builds the rig's instrumentation over each new engine (``orchestrator.rig.remote_host.RigHost``,
      handed in so that this package never imports the rig); None: the ``rig_*`` calls are refused.
    attach_deadline_s: how long after its ``Hello`` answer a driver has to open ``Attach`` before its claim
      is dropped and the next ``Hello`` may take the trainer.
  """

  def __init__(self, make_engine: Callable[[], Any], *, recipe_digest: str, token: str | None,
               limits: protocol.Limits = protocol.Limits(), on_driver_left: Callable[[], None] | None = None,
               make_rig_host: Callable[[Any], Any] | None = None, attach_deadline_s: float = ATTACH_DEADLINE_S):
    self._on_driver_left = on_driver_left
    self._make_rig_host = make_rig_host
    self._make_engine = make_engine
    self._new_worker()
    self._recipe_digest = recipe_digest
    self._token = token
    self._limits = limits
    self._sessions = DriverSessions(attach_deadline_s, on_expired=self._claim_expired)
    self._calls = threading.Lock()
    self._watcher = CompletionWatcher()
    self._next_id = 0

  def _new_worker(self) -> None:
    self._engine = self._make_engine()
    self._worker = TrainerWorker(self._engine)
    self._rig = self._make_rig_host(self._engine) if self._make_rig_host else None
    # Micro-batches run since the last update (None: unknown, after a rig arm); the engine refuses update()
    # with none as a RuntimeError, which is checked here first so that the driver hears misuse, not a failure.
    self._micro_batches_since_update: int | None = 0

  # ------------------------------------------------------------------ access
  def _session_of(self, context) -> str | None:
    """The call's session id, after its token is checked."""
    meta = dict(context.invocation_metadata())
    if not protocol.tokens_match(meta.get(protocol.TOKEN_HEADER), self._token):
      raise _Refused(grpc.StatusCode.UNAUTHENTICATED,
                     "wrong or missing trainer token; give the server's token (trainer.token_file or"
                     f" ${protocol.TOKEN_ENV})")
    return meta.get(protocol.SESSION_HEADER)

  def _decode(self, message: bytes):
    try:
      return wire.decode(message)
    except wire.WireError as e:
      raise _invalid(e) from None

  def hello(self, request: bytes, context) -> bytes:
    """The handshake: checks version and recipe, claims the trainer, answers the session and capabilities."""
    self._session_of(context)  # the token only: Hello is where a session begins
    header, _ = self._decode(request)
    if header.get("protocol") != protocol.PROTOCOL_VERSION:
      raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                     f"protocol version {header.get('protocol')!r} does not match the trainer's"
                     f" {protocol.PROTOCOL_VERSION}; run the same step-boundary version on both ends")
    if header.get("recipe_digest") != self._recipe_digest:
      raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                     f"the driver's recipe (model/engine/batch/mesh digest {header.get('recipe_digest')!r}) is not"
                     f" the one the trainer was started with ({self._recipe_digest}); start serve-trainer with"
                     " the same recipe")
    session, needs_fresh_worker = self._sessions.claim()
    try:
      with self._calls:  # after any call of the last driver still in flight
        if needs_fresh_worker:  # the previous driver's state (and any partial step) goes with it
          self._new_worker()
        caps = self._worker.capabilities
    except BaseException:
      self._sessions.abandon(session)  # the trainer is not left claimed by a Hello that failed
      raise
    self._sessions.open_attach_window(session)
    return wire.encode({"session": session, "protocol": protocol.PROTOCOL_VERSION,
                        "server_time": time.perf_counter(),
                        "attach_deadline_s": self._sessions.attach_deadline_s,
                        "capabilities": dataclasses.asdict(caps)})  # a driver ignores capabilities it does not know

  def clock(self, request: bytes, context) -> bytes:
    self._sessions.check(self._session_of(context), attached=False)
    return wire.encode({"server_time": time.perf_counter()})

  def attach(self, request: bytes, context) -> Iterator[bytes]:
    """The driver's lifeline: one message at once (it is attached), heartbeats until it goes; then its state
    is dropped."""
    session = self._session_of(context)
    self._sessions.attach(session)
    gone = threading.Event()
    context.add_callback(gone.set)
    try:
      yield wire.encode({"attached": True, "server_time": time.perf_counter()})
      while not gone.wait(protocol.HEARTBEAT_S) and context.is_active():
        yield wire.encode({"server_time": time.perf_counter()})
    finally:
      self._release(session, "its connection ended")

  def _release(self, session: str | None, why: str) -> None:
    if not self._sessions.release(session):
      return
    owed = self._worker.update_owed or self._worker.has_staged
    log.warning("trainer: the driver left (%s)%s; a new driver gets a fresh trainer", why,
                "; its owed update and staged input were dropped" if owed else "")
    if self._on_driver_left is not None:
      self._on_driver_left()

  def _claim_expired(self, session: str) -> None:
    log.warning("trainer: a driver said Hello but did not attach within %g s; the trainer takes a new driver",
                self._sessions.attach_deadline_s)
    if self._on_driver_left is not None:
      self._on_driver_left()

  # ------------------------------------------------------------------ calls
  def invoke(self, request_iterator, context) -> Iterator[bytes]:
    """One worker call: the session, then the whole request, are checked before the worker is touched."""
    session = self._session_of(context)
    self._sessions.check(session, attached=True)  # before reading the request: no session, no bytes read
    try:
      message = wire.join(request_iterator, self._limits.max_message_bytes)
    except wire.MessageTooLarge as e:
      raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
    header, arrays = self._decode(message)
    method = header.get("method")
    check = _REQUEST_CHECKS.get(method) if isinstance(method, str) else None
    if check is None:
      raise _Refused(grpc.StatusCode.UNIMPLEMENTED, f"unknown trainer method {method!r:.80}; the client and the"
                     f" trainer run different step-boundary versions (known: {', '.join(sorted(_REQUEST_CHECKS))})")
    try:
      check(header, arrays)
    except (ValueError, TypeError) as e:  # wire.WireError is a ValueError
      raise _invalid(e) from None
    if method == "wait_ready":  # never behind the worker lock
      reply = self._wait_ready(header)
    elif method == "bye":
      self._release(session, "it said goodbye")
      reply = wire.encode({})
    else:
      reply = self._run(session, method, header, arrays)
    yield from wire.chunks(reply)

  def _run(self, session: str, method: str, header: dict, arrays: dict) -> bytes:
    """``_do_<method>`` under the worker lock; misuse and bad values come back as what they are."""
    with self._calls:
      self._sessions.check(session, attached=True)  # it may have left while this call waited for the lock
      try:
        reply = getattr(self, f"_do_{method}")(header, arrays)
      except WorkerUsageError as e:
        raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, f"WorkerUsageError: {e}") from None
      except NoCheckpointError as e:  # the trainer is fine; it lacks what was asked for
        raise _Refused(grpc.StatusCode.NOT_FOUND, f"NoCheckpointError: {e}") from None
      except ValueError as e:
        raise _invalid(e) from None
      except Exception as e:  # logged under the worker method's name; the guard sends the line
        raise _failure(method, e) from None
      if method == "restore_checkpoint":  # the engine's accumulation starts over at the restored step
        self._micro_batches_since_update = 0
      return reply

  def _watch(self, ready, kind: str, step: int, micro_step: int) -> int:
    self._next_id += 1
    self._watcher.watch(self._next_id, ready, kind=kind, step=step, micro_step=micro_step,
                        dispatched_at=time.perf_counter())
    return self._next_id

  def _wait_ready(self, header) -> bytes:
    computation = wire.read_int(header, "id", required=True)
    timeout_s = wire.read_seconds(header, "timeout_s", default_s=60.0, maximum_s=MAX_WAIT_READY_S)
    try:
      ready_at = self._watcher.ready_at(computation, timeout_s=timeout_s)
    except KeyError:
      raise _Refused(grpc.StatusCode.NOT_FOUND, f"no computation {computation} on this trainer") from None
    except TimeoutError as e:
      raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED, str(e)) from None
    item = self._watcher.get(computation)
    if item is not None and item.error is not None:
      raise _Refused(grpc.StatusCode.INTERNAL, f"the computation failed: {_one_line(item.error)}")
    return wire.encode({"ready_at": ready_at})

  def _receipt(self, receipt) -> bytes:
    return wire.encode({"receipt": _receipt_json(receipt, self._watch)})

  def _counted(self, receipt):
    """``receipt`` of a micro-batch, counted towards the next update (reset when it applied one)."""
    if receipt.update is not None:
      self._micro_batches_since_update = 0
    elif self._micro_batches_since_update is not None:
      self._micro_batches_since_update += 1
    return receipt

  def _do_fwd_bwd(self, header, arrays) -> bytes:
    payload = wire.decode_payload(header, arrays)
    return self._receipt(self._counted(self._worker.fwd_bwd(
        payload, apply_optimizer=wire.read_flag(header, "apply_optimizer"),
        defer_update=wire.read_flag(header, "defer_update"))))

  def _do_stage(self, header, arrays) -> bytes:
    return wire.encode(_stage_json(self._worker.stage_fwd_bwd(wire.decode_payload(header, arrays))))

  def _do_fwd_bwd_staged(self, header, arrays) -> bytes:
    return self._receipt(self._counted(self._worker.fwd_bwd_staged(
        apply_optimizer=wire.read_flag(header, "apply_optimizer"),
        defer_update=wire.read_flag(header, "defer_update"))))

  def _do_apply_deferred_update(self, header, arrays) -> bytes:
    """The owed update; with ``then_dispatch_staged``, the staged input right after it (one round trip).

    Both halves are checked before the update runs: a request whose second half would be refused changes nothing.
    """
    then_dispatch_staged = wire.read_flag(header, "then_dispatch_staged")
    if then_dispatch_staged and not self._worker.has_staged:
      raise WorkerUsageError("apply_deferred_update(then_dispatch_staged=True): nothing is staged, so the update"
                             " was not applied either; stage an input first, or send then_dispatch_staged=false")
    start = time.perf_counter()
    applied = self._worker.apply_deferred_update()
    call_s = time.perf_counter() - start
    self._micro_batches_since_update = 0
    staged = self._counted(self._worker.fwd_bwd_staged()) if then_dispatch_staged else None
    return wire.encode({"device_wait_s": applied.device_wait_s, "call_s": call_s,
                        "receipt": _receipt_json(applied.update, self._watch),
                        "staged_receipt": _receipt_json(staged, self._watch)})

  def _do_update(self, header, arrays) -> bytes:
    if self._micro_batches_since_update == 0 and not self._worker.update_owed:
      raise WorkerUsageError("update: no micro-batch ran since the last update, so there is nothing to apply;"
                             " run fwd_bwd at least once per step")
    receipt = self._worker.update()
    self._micro_batches_since_update = 0
    return self._receipt(receipt)

  def _do_wait_for_device(self, header, arrays) -> bytes:
    return wire.encode({"waited_s": self._worker.wait_for_device()})

  def _do_device_memory(self, header, arrays) -> bytes:
    memory = self._worker.device_memory()
    return wire.encode({"memory": None if memory is None else memory.to_json()})

  def _do_get_metrics(self, header, arrays) -> bytes:
    return wire.encode({"metrics": {k: _number(v) for k, v in self._worker.get_metrics().to_json().items()}})

  def _do_export_weights(self, header, arrays) -> bytes:
    weights = self._worker.export_weights()
    if weights is None:
      return wire.encode({"none": True})
    return wire.encode_tree(jax.device_get(weights))

  def _do_echo(self, header, arrays) -> bytes:
    """Receives a message and answers its size: the wire's own cost, for benchmarks."""
    return wire.encode({"bytes": sum(a.nbytes for a in arrays.values())})

  def _do_rig_begin_arm(self, header, arrays) -> bytes:
    """The rig: back to the state the first arm started from, with the engine's calls recorded."""
    self._worker = TrainerWorker(_rig_host(self._rig).begin_arm(wire.read_text(header, "fault")))
    self._micro_batches_since_update = 0  # an arm starts from a snapshot taken at a step boundary
    return wire.encode(self._rig.info())

  def _do_rig_end_arm(self, header, arrays) -> bytes:
    """The rig: the arm's engine calls (kind, content digest) and the compiles it caused."""
    events, compiles = _rig_host(self._rig).end_arm()
    self._worker = TrainerWorker(self._engine)
    self._micro_batches_since_update = None
    return wire.encode({"events": events, "compiles": compiles})

  def _do_state_digest(self, header, arrays) -> bytes:
    return wire.encode({"digest": self._worker.state_digest()})

  def _do_save_checkpoint(self, header, arrays) -> bytes:
    """Saves the trainer's state with the driver's ``metadata``, which must be a JSON object (absent: empty)."""
    metadata = header.get("metadata", {})
    if not isinstance(metadata, dict):
      raise ValueError(f"save_checkpoint: metadata must be a JSON object, not {type(metadata).__name__}")
    return wire.encode({"path": str(self._worker.save_checkpoint(metadata))})

  def _do_restore_checkpoint(self, header, arrays) -> bytes:
    """Restores checkpoint ``step`` (absent or null: the latest), a non-negative integer, checked before any read.

    The step is the driver's; it names a checkpoint by number, never a path (the
    engine's checkpointer also refuses one whose directory leads outside its own).
    """
    step = header.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
      raise ValueError(f"restore_checkpoint: step {step!r} is not a checkpoint step; give a non-negative integer"
                       " (or leave it out for the latest)")
    return wire.encode({"metadata": self._worker.restore_checkpoint(step)})

  # ------------------------------------------------------------------ gRPC wiring
  def handler(self) -> grpc.GenericRpcHandler:
    """The four methods, each behind a guard: a refusal becomes its status, any other error ``INTERNAL``."""
    return grpc.method_handlers_generic_handler(protocol.SERVICE, {
        "Hello": grpc.unary_unary_rpc_method_handler(_guarded("Hello", self.hello)),
        "Clock": grpc.unary_unary_rpc_method_handler(_guarded("Clock", self.clock)),
        "Attach": grpc.unary_stream_rpc_method_handler(_guarded_stream("Attach", self.attach)),
        "Invoke": grpc.stream_stream_rpc_method_handler(_guarded_stream("Invoke", self.invoke)),
    })


def start_server(service: TrainerService, listen: str, limits: protocol.Limits) -> tuple[grpc.Server, int]:
  """Binds ``listen`` (port 0: a free one) alone and starts serving; returns the server and its port.

  The port is this server's only: gRPC's port sharing (``SO_REUSEPORT``) is
  off, so a second server, another user's included, cannot bind it too and
  take some of the drivers' connections.

  Raises:
    AddressError: ``listen`` is in use or not an address of this host.
  """
  options = [*limits.grpc_options(), ("grpc.so_reuseport", 0)]
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=options, maximum_concurrent_rpcs=64)
  server.add_generic_rpc_handlers((service.handler(),))
  try:
    port = server.add_insecure_port(listen)
  except RuntimeError:  # gRPC raises where older versions returned 0
    port = 0
  if port == 0:
    server.stop(None)
    raise protocol.AddressError(f"cannot listen on {listen}: the address is in use or not on this host; choose"
                                " another port or stop the server there")
  server.start()
  return server, port

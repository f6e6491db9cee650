"""The trainer server: one ``TrainerWorker`` behind gRPC, driven by one client at a time.

``TrainerService`` owns its worker privately (built by ``make_worker``) and
serves the methods in ``protocol``. Worker calls run one at a time, in arrival
order; ``wait_ready`` (a completion time) does not take that lock, so the
driver's completion watcher never waits behind a dispatch. Receipts carry
server-clock times and a completion id; the server's own watcher stamps when
each computation finished, where it ran.

A driver that goes away — its ``Attach`` stream ends — takes its partial step
with it: the worker it drove is discarded (its owed update, staged input and
accumulated gradients are never applied) and the next driver gets a fresh one
(and restores a checkpoint to resume).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import jax

from orchestrator.remote import protocol, wire
from orchestrator.contract import WorkerUsageError
from orchestrator.loop.trainer_worker import TrainerWorker
from orchestrator.loop.watcher import CompletionWatcher

log = logging.getLogger("step_boundary.remote")


def _receipt_json(receipt, ids: Callable[[Any, str, int, int], int | None]) -> dict | None:
  if receipt is None:
    return None
  return {"kind": receipt.kind, "step": receipt.step, "micro_step": receipt.micro_step,
          "id": ids(receipt.ready, receipt.kind, receipt.step, receipt.micro_step),
          "dispatched_at": receipt.dispatched_at, "mapping_s": receipt.mapping_s,
          "placement_s": receipt.placement_s, "host_wait_s": receipt.host_wait_s,
          "update": _receipt_json(receipt.update, ids)}


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


class TrainerService:
  """The gRPC handlers; see the module docstring.

  Args:
    make_engine: builds a fresh engine (called at start and after a driver is lost); the
      service wraps it in a ``TrainerWorker`` it owns.
    recipe_digest: ``protocol.recipe_digest`` of the recipe the worker was built from.
    token: the shared token, or None (loopback only; checked by ``serve``).
    limits: message size limit.
    on_driver_left: called (outside any lock) after a driver leaves, however it left.
    make_rig_host: builds the rig's instrumentation over each new engine (``orchestrator.rig.remote_host.RigHost``,
      handed in so that this package never imports the rig); None: the ``rig_*`` calls are refused.
  """

  def __init__(self, make_engine: Callable[[], Any], *, recipe_digest: str, token: str | None,
               limits: protocol.Limits = protocol.Limits(), on_driver_left: Callable[[], None] | None = None,
               make_rig_host: Callable[[Any], Any] | None = None):
    self._on_driver_left = on_driver_left
    self._make_rig_host = make_rig_host
    self._make_engine = make_engine
    self._new_worker()
    self._used = False
    self._recipe_digest = recipe_digest
    self._token = token
    self._limits = limits
    self._driver: str | None = None
    self._driver_since = 0.0
    self._state = threading.Lock()
    self._calls = threading.Lock()
    self._watcher = CompletionWatcher()
    self._next_id = 0

  def _new_worker(self) -> None:
    self._engine = self._make_engine()
    self._worker = TrainerWorker(self._engine)
    self._rig = self._make_rig_host(self._engine) if self._make_rig_host else None

  # ------------------------------------------------------------------ access
  def _check(self, context, *, session: bool = True) -> None:
    meta = dict(context.invocation_metadata())
    if not protocol.tokens_match(meta.get(protocol.TOKEN_HEADER), self._token):
      context.abort(grpc.StatusCode.UNAUTHENTICATED,
                    "wrong or missing trainer token; give the server's token (trainer.token_file or"
                    f" ${protocol.TOKEN_ENV})")
    if session and meta.get(protocol.SESSION_HEADER) != self._driver:
      context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                    "this client is not the trainer's current driver (it was dropped, or never said Hello);"
                    " reconnect")

  def hello(self, request: bytes, context) -> bytes:
    self._check(context, session=False)
    header, _ = self._decode(request, context)
    if header.get("protocol") != protocol.PROTOCOL_VERSION:
      context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                    f"protocol version {header.get('protocol')!r} does not match the trainer's"
                    f" {protocol.PROTOCOL_VERSION}; run the same step-boundary version on both ends")
    if header.get("recipe_digest") != self._recipe_digest:
      context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                    f"the driver's recipe (model/engine/batch/mesh digest {header.get('recipe_digest')}) is not"
                    f" the one the trainer was started with ({self._recipe_digest}); start serve-trainer with"
                    " the same recipe")
    with self._state:
      if self._driver is not None:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"another driver has held this trainer for {time.time() - self._driver_since:.0f} s;"
                      " one driver at a time: stop it, or wait for it to finish")
      if self._used:  # the previous driver's state (and any partial step) goes with it
        self._new_worker()
      self._used = False
      self._driver, self._driver_since = uuid.uuid4().hex, time.time()
      caps = self._worker.capabilities
      return wire.encode({"session": self._driver, "protocol": protocol.PROTOCOL_VERSION,
                          "server_time": time.perf_counter(),
                          "capabilities": {"can_stage": caps.can_stage,
                                           "missing_staging_methods": list(caps.missing_staging_methods),
                                           "can_checkpoint": caps.can_checkpoint,
                                           "can_export_weights": caps.can_export_weights}})

  def clock(self, request: bytes, context) -> bytes:
    self._check(context, session=False)
    return wire.encode({"server_time": time.perf_counter()})

  def attach(self, request: bytes, context) -> Iterator[bytes]:
    """The driver's lifeline: heartbeats until it goes; then its state is dropped."""
    self._check(context)
    session = dict(context.invocation_metadata()).get(protocol.SESSION_HEADER)
    gone = threading.Event()
    context.add_callback(gone.set)
    try:
      while not gone.wait(protocol.HEARTBEAT_S) and context.is_active():
        yield wire.encode({"server_time": time.perf_counter()})
    finally:
      self._release(session, "its connection ended")

  def _release(self, session: str | None, why: str) -> None:
    with self._state:
      if session is None or session != self._driver:
        return
      self._driver = None
      owed = self._worker.update_owed or self._worker.has_staged
      self._used = True
      log.warning("trainer: the driver left (%s)%s; a new driver gets a fresh trainer", why,
                  "; its owed update and staged input were dropped" if owed else "")
    if self._on_driver_left is not None:
      self._on_driver_left()

  # ------------------------------------------------------------------ calls
  def _decode(self, message: bytes, context):
    try:
      return wire.decode(message)
    except wire.WireError as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

  def invoke(self, request_iterator, context) -> Iterator[bytes]:
    self._check(context)
    try:
      message = wire.join(request_iterator, self._limits.max_message_bytes)
    except wire.MessageTooLarge as e:
      context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    header, arrays = self._decode(message, context)
    method = header.get("method")
    if method == "wait_ready":  # never behind the worker lock
      reply = self._wait_ready(header, context)
    elif method == "bye":
      self._release(dict(context.invocation_metadata()).get(protocol.SESSION_HEADER), "it said goodbye")
      reply = wire.encode({})
    else:
      handler = getattr(self, f"_do_{method}", None) if isinstance(method, str) else None
      if handler is None:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"unknown trainer method {method!r}")
      with self._calls:
        self._used = True
        try:
          reply = handler(header, arrays)
        except WorkerUsageError as e:
          context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"WorkerUsageError: {e}")
        except (ValueError, wire.WireError) as e:
          context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ValueError: {e}")
    yield from wire.chunks(reply)

  def _watch(self, ready, kind: str, step: int, micro_step: int) -> int:
    self._next_id += 1
    self._watcher.watch(self._next_id, ready, kind=kind, step=step, micro_step=micro_step,
                        dispatched_at=time.perf_counter())
    return self._next_id

  def _wait_ready(self, header, context) -> bytes:
    try:
      ready_at = self._watcher.ready_at(int(header["id"]), timeout_s=float(header.get("timeout_s", 60)))
    except KeyError:
      context.abort(grpc.StatusCode.NOT_FOUND, f"no computation {header.get('id')!r} on this trainer")
    except TimeoutError as e:
      context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
    item = self._watcher.get(int(header["id"]))
    if item is not None and item.error is not None:
      context.abort(grpc.StatusCode.INTERNAL, f"the computation failed: {item.error!r}")
    return wire.encode({"ready_at": ready_at})

  def _receipt(self, receipt) -> bytes:
    return wire.encode({"receipt": _receipt_json(receipt, self._watch)})

  def _do_fwd_bwd(self, header, arrays) -> bytes:
    payload = wire.decode_payload(header, arrays)
    return self._receipt(self._worker.fwd_bwd(payload, apply_optimizer=bool(header.get("apply_optimizer")),
                                              defer_update=bool(header.get("defer_update"))))

  def _do_stage(self, header, arrays) -> bytes:
    stage = self._worker.stage_fwd_bwd(wire.decode_payload(header, arrays))
    return wire.encode({"stage_s": stage.stage_s, "input_digest": stage.input_digest})

  def _do_fwd_bwd_staged(self, header, arrays) -> bytes:
    return self._receipt(self._worker.fwd_bwd_staged(apply_optimizer=bool(header.get("apply_optimizer")),
                                                     defer_update=bool(header.get("defer_update"))))

  def _do_apply_deferred_update(self, header, arrays) -> bytes:
    """The owed update; with ``then_dispatch_staged``, the staged input right after it (one round trip)."""
    start = time.perf_counter()
    applied = self._worker.apply_deferred_update()
    call_s = time.perf_counter() - start
    staged = self._worker.fwd_bwd_staged() if header.get("then_dispatch_staged") else None
    return wire.encode({"device_wait_s": applied.device_wait_s, "call_s": call_s,
                        "receipt": _receipt_json(applied.update, self._watch),
                        "staged_receipt": _receipt_json(staged, self._watch)})

  def _do_update(self, header, arrays) -> bytes:
    return self._receipt(self._worker.update())

  def _do_wait_for_device(self, header, arrays) -> bytes:
    return wire.encode({"waited_s": self._worker.wait_for_device()})

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
    if self._rig is None:
      raise WorkerUsageError("this trainer was started without the rig's host; serve it with run_rl serve-trainer")
    self._worker = TrainerWorker(self._rig.begin_arm(header.get("fault")))
    return wire.encode(self._rig.info())

  def _do_rig_end_arm(self, header, arrays) -> bytes:
    """The rig: the arm's engine calls (kind, content digest) and the compiles it caused."""
    if self._rig is None:
      raise WorkerUsageError("this trainer was started without the rig's host; serve it with run_rl serve-trainer")
    events, compiles = self._rig.end_arm()
    self._worker = TrainerWorker(self._engine)
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
    return grpc.method_handlers_generic_handler(protocol.SERVICE, {
        "Hello": grpc.unary_unary_rpc_method_handler(self.hello),
        "Clock": grpc.unary_unary_rpc_method_handler(self.clock),
        "Attach": grpc.unary_stream_rpc_method_handler(self.attach),
        "Invoke": grpc.stream_stream_rpc_method_handler(self.invoke),
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

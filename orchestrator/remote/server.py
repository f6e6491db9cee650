"""The trainer server: one worker behind gRPC, driven by one client at a time.

``TrainerService`` serves the four methods in ``protocol``: who may call is
``sessions.DriverSessions``'s rule (a token, then one session claimed by
``Hello`` and attached by ``Attach``), and what a worker call does is
``served_worker.ServedWorker``'s. Worker calls run one at a time, in arrival
order; ``wait_ready`` (a completion time) does not take that lock, so the
driver's completion watcher never waits behind a dispatch.

A driver that goes away — its ``Attach`` stream ends — takes its partial step
with it: the worker it drove is discarded (its owed update, staged input and
accumulated gradients are never applied) and the next driver gets a fresh one
(and restores a checkpoint to resume). Between drivers nothing of the last
one's state (weights, digest, metrics, checkpoints) is served to anyone.

**Validate, then act.** Every request is checked whole before it changes
anything (``wire.decode`` and the per-method checks in
``requests.REQUEST_CHECKS``, then the worker's own preconditions, the
contract's ``ALLOWED_TRANSITIONS`` among them); a refused one leaves the state
as it was. The status says which kind of refusal it was: a malformed request
is ``INVALID_ARGUMENT`` ("ValueError: ...", raised as ``ValueError`` by the
client), misuse of the worker is ``FAILED_PRECONDITION`` ("WorkerUsageError:
...", raised as ``WorkerUsageError``), and anything else that fails on the
server is logged here with its traceback and answered ``INTERNAL`` in one line
(``refusals``) — never ``UNKNOWN``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from orchestrator.remote import protocol, wire
from orchestrator.remote.refusals import Refused, guarded, guarded_stream, invalid
from orchestrator.remote.requests import REQUEST_CHECKS
from orchestrator.remote.served_worker import ServedWorker
from orchestrator.remote.sessions import ATTACH_DEADLINE_S, DriverSessions

log = logging.getLogger("step_boundary.remote")


class TrainerService:
  """The gRPC handlers; see the module docstring.

  Args:
    make_engine: builds a fresh engine (called at start and after a driver is lost); the
      service wraps it in a ``served_worker.ServedWorker`` it owns.
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
    self._served = ServedWorker(make_engine, make_rig_host)
    self._recipe_digest = recipe_digest
    self._token = token
    self._limits = limits
    self._sessions = DriverSessions(attach_deadline_s, on_expired=self._claim_expired)
    self._calls = threading.Lock()

  def _session_of(self, context) -> str | None:
    """The call's session id, after its token is checked."""
    meta = dict(context.invocation_metadata())
    if not protocol.tokens_match(meta.get(protocol.TOKEN_HEADER), self._token):
      raise Refused(grpc.StatusCode.UNAUTHENTICATED,
                    "wrong or missing trainer token; give the server's token (trainer.token_file or"
                    f" ${protocol.TOKEN_ENV})")
    return meta.get(protocol.SESSION_HEADER)

  def _decode(self, message: bytes):
    try:
      return wire.decode(message)
    except wire.WireError as e:
      raise invalid(e) from None

  def hello(self, request: bytes, context) -> bytes:
    """The handshake: checks version and recipe, claims the trainer, answers the session and capabilities."""
    self._session_of(context)  # the token only: Hello is where a session begins
    header, _ = self._decode(request)
    if header.get("protocol") != protocol.PROTOCOL_VERSION:
      raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                    f"protocol version {header.get('protocol')!r} does not match the trainer's"
                    f" {protocol.PROTOCOL_VERSION}; run the same step-boundary version on both ends")
    if header.get("recipe_digest") != self._recipe_digest:
      raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                    f"the driver's recipe (model/engine/batch/mesh digest {header.get('recipe_digest')!r}) is not"
                    f" the one the trainer was started with ({self._recipe_digest}); start serve-trainer with"
                    " the same recipe")
    session, needs_fresh_worker = self._sessions.claim()
    try:
      with self._calls:  # after any call of the last driver still in flight
        if needs_fresh_worker:  # the previous driver's state (and any partial step) goes with it
          self._served.renew()
        caps = self._served.capabilities
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
    owed = self._served.holds_partial_step
    log.warning("trainer: the driver left (%s)%s; a new driver gets a fresh trainer", why,
                "; its owed update and staged input were dropped" if owed else "")
    if self._on_driver_left is not None:
      self._on_driver_left()

  def _claim_expired(self, session: str) -> None:
    log.warning("trainer: a driver said Hello but did not attach within %g s; the trainer takes a new driver",
                self._sessions.attach_deadline_s)
    if self._on_driver_left is not None:
      self._on_driver_left()

  def invoke(self, request_iterator, context) -> Iterator[bytes]:
    """One worker call: the session, then the whole request, are checked before the worker is touched."""
    session = self._session_of(context)
    self._sessions.check(session, attached=True)  # before reading the request: no session, no bytes read
    try:
      message = wire.join(request_iterator, self._limits.max_message_bytes)
    except wire.MessageTooLarge as e:
      raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
    header, arrays = self._decode(message)
    method = header.get("method")
    check = REQUEST_CHECKS.get(method) if isinstance(method, str) else None
    if check is None:
      raise Refused(grpc.StatusCode.UNIMPLEMENTED, f"unknown trainer method {method!r:.80}; the client and the"
                    f" trainer run different step-boundary versions (known: {', '.join(sorted(REQUEST_CHECKS))})")
    try:
      check(header, arrays)
    except (ValueError, TypeError) as e:  # wire.WireError is a ValueError
      raise invalid(e) from None
    if method == "wait_ready":  # never behind the worker lock
      reply = self._served.wait_ready(header)
    elif method == "bye":
      self._release(session, "it said goodbye")
      reply = wire.encode({})
    else:
      reply = self._run(session, method, header, arrays)
    yield from wire.chunks(reply)

  def _run(self, session: str, method: str, header: dict, arrays: dict) -> bytes:
    """The served worker's ``method`` under the worker lock."""
    with self._calls:
      self._sessions.check(session, attached=True)  # it may have left while this call waited for the lock
      return self._served.call(method, header, arrays)

  def handler(self) -> grpc.GenericRpcHandler:
    """The four methods, each behind a guard: a refusal becomes its status, any other error ``INTERNAL``."""
    return grpc.method_handlers_generic_handler(protocol.SERVICE, {
        "Hello": grpc.unary_unary_rpc_method_handler(guarded("Hello", self.hello)),
        "Clock": grpc.unary_unary_rpc_method_handler(guarded("Clock", self.clock)),
        "Attach": grpc.unary_stream_rpc_method_handler(guarded_stream("Attach", self.attach)),
        "Invoke": grpc.stream_stream_rpc_method_handler(guarded_stream("Invoke", self.invoke)),
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

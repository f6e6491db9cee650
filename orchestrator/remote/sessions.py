"""Who may drive a trainer server: one session at a time, claimed by ``Hello`` and attached by ``Attach``.

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

A claim that does not attach within the attach deadline (default
``ATTACH_DEADLINE_S``) of its ``Hello`` answer is dropped, so a driver killed
between the two does not lock the trainer.
"""

from __future__ import annotations

import collections
import hmac
import secrets
import threading
import time
from collections.abc import Callable

import grpc

from orchestrator.remote import protocol
from orchestrator.remote.refusals import Refused

ATTACH_DEADLINE_S = 10.0  # Hello to Attach is 16 clock samples on the driver's side: well under a second


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
      Refused: RESOURCE_EXHAUSTED, a session is claimed or attached.
    """
    with self._lock:
      if self._current is not None:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, self._held_text())
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
      Refused: the session rule (module docstring); FAILED_PRECONDITION when it is attached already or
        its deadline passed.
    """
    with self._lock:
      self._require_locked(session)
      if self._attached:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                      "this session is attached already; a driver holds one Attach stream")
      if self._attach_by is None or time.monotonic() > self._attach_by:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                      f"this session did not attach within {self.attach_deadline_s:g} s of Hello; say Hello again")
      self._attached = self._worker_driven = True
      if self._timer is not None:
        self._timer.cancel()

  def check(self, session: str | None, *, attached: bool) -> None:
    """Returns if ``session`` is the current one (and, with ``attached``, attached).

    Raises:
      Refused: the session rule (module docstring).
    """
    with self._lock:
      self._require_locked(session)
      if attached and not self._attached:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
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
      raise Refused(grpc.StatusCode.UNAUTHENTICATED,
                    f"the call carries no trainer session (metadata {protocol.SESSION_HEADER}); say Hello and"
                    " Attach first")
    if self._current is not None and hmac.compare_digest(session.encode(), self._current.encode()):
      return
    if session in self._retired:
      raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                    f"session {session[:8]}... no longer drives this trainer (its driver detached, said goodbye"
                    f" or did not attach within {self.attach_deadline_s:g} s of Hello); reconnect with Hello")
    raise Refused(grpc.StatusCode.UNAUTHENTICATED,
                  f"session {session[:8]!r}... is not one this trainer issued; say Hello and Attach first")

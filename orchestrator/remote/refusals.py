"""How a trainer server's call ends when it does not answer: one gRPC status and one line for the caller.

A handler raises ``Refused`` for a refusal it means (its status and line); ``guarded`` and
``guarded_stream`` wrap a handler so that anything else is logged here with its traceback and reaches the
caller as one ``INTERNAL`` line (``failure``) — never ``UNKNOWN``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

log = logging.getLogger("step_boundary.remote")


class Refused(Exception):
  """A call refused with ``code``; ``message`` is the one line the caller sees."""

  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code, self.message = code, message


def invalid(error: Exception) -> Refused:
  return Refused(grpc.StatusCode.INVALID_ARGUMENT, f"ValueError: {error}")


def one_line(error: BaseException, limit: int = 300) -> str:
  text = " ".join(str(error).split()) or "(no message)"
  return f"{type(error).__name__}: {text if len(text) <= limit else text[:limit] + '...'}"


def failure(call: str, error: Exception) -> Refused:
  """The last resort: ``error`` logged here with its traceback, and one ``INTERNAL`` line for the caller."""
  log.error("trainer: %s failed", call, exc_info=error)
  return Refused(grpc.StatusCode.INTERNAL, f"{call} failed on the trainer: {one_line(error)}; the trainer's log"
                 " has the traceback")


def guarded(call: str, body: Callable[[Any, Any], bytes]) -> Callable[[Any, Any], bytes]:
  """``body`` as a unary handler whose every error reaches the caller as a status, never ``UNKNOWN``."""
  def handle(request, context):
    try:
      return body(request, context)
    except Exception as error:
      _abort(call, error, context)
  return handle


def guarded_stream(call: str, body: Callable[[Any, Any], Iterator[bytes]]) -> Callable[[Any, Any], Iterator[bytes]]:
  """``guarded`` for a handler that answers a stream."""
  def handle(request, context):
    try:
      yield from body(request, context)
    except Exception as error:
      _abort(call, error, context)
  return handle


def _abort(call: str, error: Exception, context) -> None:
  """Ends the call: a refusal with its status, anything else as the last resort (logged, then one line)."""
  refusal = error if isinstance(error, Refused) else failure(call, error)
  context.abort(refusal.code, refusal.message)

"""What both ends of the remote trainer agree on: names, version, limits, addresses and the token.

The service is ``step_boundary.Trainer`` with four methods (docs/design.md §11):

* ``Hello`` — the version handshake and the driver's claim: the client sends
  its protocol version and the digest of the recipe's model/engine/batch
  settings; the server refuses another version, another recipe, or a second
  driver while one is attached, and answers a session id, its capabilities
  and its clock.
* ``Clock`` — the server's clock, for the offset estimate (several samples,
  the one with the shortest round trip wins).
* ``Attach`` — a stream the driver holds open for as long as it drives; when
  it ends (the driver closed, crashed or lost the network) the server drops
  the owed update, the staged input and the partial step, and frees itself
  for a new driver.
* ``Invoke`` — every worker call: a stream of chunks in, a stream of chunks
  out, each message in ``wire``'s layout with its ``method`` in the header.

Every call carries the token (when the server has one) and, after ``Hello``,
the session id, in its metadata.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import json
import os
import socket
from pathlib import Path

PROTOCOL_VERSION = 1
SERVICE = "step_boundary.Trainer"
TOKEN_HEADER = "x-step-boundary-token"
SESSION_HEADER = "x-step-boundary-session"
TOKEN_ENV = "STEP_BOUNDARY_TRAINER_TOKEN"
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
HEARTBEAT_S = 1.0


class AddressError(ValueError):
  """A listen or connect address that cannot be used (the text says why and what to use)."""


def split_address(address: str) -> tuple[str, int]:
  """``host:port`` → (host, port); IPv6 hosts in brackets.

  Raises:
    AddressError: no port, or a port out of range.
  """
  host, sep, port = str(address).rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
    raise AddressError(f"address {address!r} is not HOST:PORT (e.g. 127.0.0.1:50051; port 0 picks a free one)")
  return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def read_token(token_file: str | None = None) -> str | None:
  """The shared token: from ``token_file`` when given, else ``$STEP_BOUNDARY_TRAINER_TOKEN``; None if neither.

  Raises:
    AddressError: the file is missing, unreadable or empty.
  """
  if token_file:
    try:
      token = Path(token_file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
      raise AddressError(f"trainer token file {token_file}: {e.__class__.__name__}: {e}; give a readable"
                         " text file holding the token") from None
    if not token:
      raise AddressError(f"trainer token file {token_file} is empty; put the shared token in it")
    return token
  return os.environ.get(TOKEN_ENV) or None


def tokens_match(given: str | None, expected: str | None) -> bool:
  """Constant-time comparison; a server without a token accepts any caller (loopback only)."""
  if expected is None:
    return True
  return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def recipe_digest(recipe) -> str:
  """What must be equal on both ends for the driver's steps to mean the same: model, engine, batch, mesh."""
  from orchestrator import recipe as recipe_lib  # pylint: disable=import-outside-toplevel

  data = recipe_lib.to_dict(recipe)
  key = {name: data[name] for name in ("model", "engine", "batch", "mesh")}
  return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def free_loopback_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-message size limit (bytes) and per-call timeout (seconds)."""

  max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
  timeout_s: float = 120.0

  def grpc_options(self) -> list[tuple[str, int]]:
    from orchestrator.remote.wire import CHUNK_BYTES  # pylint: disable=import-outside-toplevel

    cap = CHUNK_BYTES + (64 << 10)  # one chunk and its framing: larger messages arrive as chunk streams
    return [("grpc.max_receive_message_length", cap), ("grpc.max_send_message_length", cap)]

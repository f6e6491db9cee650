"""What both ends of the remote trainer agree on: names, version, limits, addresses and the token.

The service is ``step_boundary.Trainer`` with four methods (docs/remote.md):

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
import json
import os
import secrets
import stat
from pathlib import Path

# The address rules live in orchestrator.addresses (the recipe checks addresses with them too); they are
# named here as well because both ends of the protocol reach them as protocol.X.
from orchestrator.addresses import AddressError, free_loopback_port, is_loopback, split_address  # noqa: F401
from orchestrator.remote.wire import CHUNK_BYTES

PROTOCOL_VERSION = 2  # 2: a session is the only way in, and a driver waits for Attach to be taken
SERVICE = "step_boundary.Trainer"
TOKEN_HEADER = "x-step-boundary-token"
SESSION_HEADER = "x-step-boundary-session"
TOKEN_ENV = "STEP_BOUNDARY_TRAINER_TOKEN"
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
HEARTBEAT_S = 1.0


def read_token(token_file: str | None = None) -> str | None:
  """The shared token: from ``token_file`` when given, else ``$STEP_BOUNDARY_TRAINER_TOKEN``; None if neither.

  A token file must be private, as ssh requires of a key: one that its group or
  others have any access to (``mode & 0o077``) is refused. A symbolic link is
  followed and the file it names is judged (the mode is read from the open
  file, so it is the mode of what is read).

  Surrounding whitespace (a file's or a shell's trailing newline) is dropped; what is left must be
  printable ASCII without spaces, as a gRPC metadata value must be.

  Raises:
    AddressError: the file is missing, unreadable, readable by others, or empty; the token holds a
      character a gRPC header cannot carry.
  """
  if not token_file:
    token = (os.environ.get(TOKEN_ENV) or "").strip()
    return _checked_token(token, f"${TOKEN_ENV}") if token else None
  try:
    with open(token_file, encoding="utf-8") as f:
      mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
      if mode & 0o077:
        raise AddressError(f"trainer token file {token_file} has mode {mode:04o}: its group or others can access"
                           f" it; make it private: chmod 600 {token_file}")
      token = f.read().strip()
  except (OSError, UnicodeDecodeError) as e:
    raise AddressError(f"trainer token file {token_file}: {e.__class__.__name__}: {e}; give a readable"
                       " text file holding the token") from None
  if not token:
    raise AddressError(f"trainer token file {token_file} is empty; put the shared token in it")
  return _checked_token(token, f"trainer token file {token_file}")


def _checked_token(token: str, where: str) -> str:
  bad = sorted({c for c in token if not (33 <= ord(c) <= 126)})
  if bad:
    raise AddressError(f"{where} holds a token with {', '.join(repr(c) for c in bad)}, which a gRPC header cannot"
                       " carry; use printable ASCII without spaces (e.g. python3 -c 'import secrets;"
                       " print(secrets.token_urlsafe(32))')")
  return token


def write_new_token(path: Path) -> str:
  """A fresh random token, written to ``path``, a new file that only its owner can read or write (mode 0600).

  The file is created with that mode (never briefly readable by others) and
  never replaces an existing file.

  Raises:
    OSError: ``path`` exists, or its directory cannot be created or written.
  """
  token = secrets.token_urlsafe(32)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    f.write(token + "\n")
  return token


def tokens_match(given: str | None, expected: str | None) -> bool:
  """Constant-time comparison; a server without a token accepts any caller (loopback only)."""
  if expected is None:
    return True
  return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def recipe_digest(recipe) -> str:
  """What must be equal on both ends for the driver's steps to mean the same: model, engine, batch, mesh.

  ``recipe`` is a ``Recipe`` (any dataclass with those four fields), read as plain data with
  ``dataclasses.asdict`` (what ``recipe_lib.to_dict`` returns), so the protocol needs no import of the recipe.
  """
  data = dataclasses.asdict(recipe)
  key = {name: data[name] for name in ("model", "engine", "batch", "mesh")}
  return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-message size limit (bytes) and per-call timeout (seconds)."""

  max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
  timeout_s: float = 120.0

  def grpc_options(self) -> list[tuple[str, int]]:
    cap = CHUNK_BYTES + (64 << 10)  # one chunk and its framing: larger messages arrive as chunk streams
    return [("grpc.max_receive_message_length", cap), ("grpc.max_send_message_length", cap)]

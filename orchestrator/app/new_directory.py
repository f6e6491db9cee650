"""A new output directory a command writes (``export --out``, ``import-gguf --out``), its missing parents made as
``mkdir -p`` would and removed again if the write fails."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import threading
from pathlib import Path


def nearest_existing(out: Path) -> Path:
  """The closest directory above ``out`` that exists (or a link there): what must be writable for ``out`` and its
  missing parents to be made."""
  existing = out.absolute().parent
  while not existing.exists() and not existing.is_symlink():
    existing = existing.parent
  return existing


def writable_above(out: Path) -> Path | None:
  """None where ``out`` can be made (its nearest existing parent is a directory this user may write), else that
  parent, for the refusal to name."""
  existing = nearest_existing(out)
  return None if existing.is_dir() and os.access(existing, os.W_OK) else existing


def missing_parents(out: Path) -> list[Path]:
  """The directories above ``out`` that do not exist yet, outermost first."""
  missing = []
  parent = out.absolute().parent
  while not parent.exists() and not parent.is_symlink():
    missing.append(parent)
    parent = parent.parent
  return missing[::-1]


def remove_empty(made_parents: list[Path]) -> None:
  """Removes the parents a write made, innermost first, where nothing else was put in them meanwhile."""
  for directory in reversed(made_parents):
    try:
      directory.rmdir()
    except OSError:
      return


class Terminated(BaseException):
  """SIGTERM while a command writes a new directory (``sigterm_raises``): its cleanup runs as for Ctrl-C."""


@contextlib.contextmanager
def sigterm_raises():
  """SIGTERM raises ``Terminated`` meanwhile (not the default: an exit that skips every cleanup, leaving the
  hidden partial folder); a SIGTERM ignored by whoever started the process stays ignored."""
  if (threading.current_thread() is not threading.main_thread()
      or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN):
    yield
    return

  def _raise(signum, frame):
    raise Terminated()

  previous = signal.signal(signal.SIGTERM, _raise)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


def make_partial(out: Path) -> tuple[Path, int]:
  """A new hidden sibling of ``out`` to write into (renamed to ``out`` once complete), and a descriptor holding
  its lock (``flock``) until closed: a partial folder no process holds was left by one that was killed."""
  partial = out.absolute().parent / f".{out.name}.{secrets.token_hex(4)}.partial"
  unlocked = partial.with_name(partial.name + "-new")  # not a name remove_stale_partials takes
  unlocked.mkdir()  # exclusive, with the user's umask
  fd = os.open(unlocked, os.O_RDONLY | os.O_DIRECTORY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(unlocked, partial)  # named as a partial folder only once it is locked
  except BaseException:
    os.close(fd)
    unlocked.rmdir()  # made here just now, empty
    raise
  return partial, fd


def remove_stale_partials(out: Path) -> list[Path]:
  """Removes the hidden partial folders of ``out`` (``.NAME.XXXXXXXX.partial``) that no process holds: those of
  a write that was killed (SIGKILL, a power cut). Returns them, for the note."""
  parent = out.absolute().parent
  pattern = re.compile(rf"\.{re.escape(out.name)}\.[0-9a-f]{{8}}\.partial")
  removed = []
  try:
    entries = [p for p in parent.iterdir() if pattern.fullmatch(p.name)]
  except OSError:
    return removed
  for entry in entries:
    if entry.is_symlink() or not entry.is_dir():
      continue
    try:
      fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      continue  # another export or import is writing it now
    else:
      shutil.rmtree(entry, ignore_errors=True)
      removed.append(entry)
    finally:
      os.close(fd)
  return removed

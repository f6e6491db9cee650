"""A run directory's lock (``DIR/run.lock``), and which process of a run holds it.

The process that runs, resumes or launches a run holds its directory's lock
from before it reads anything there to its exit; a second one is refused
naming the holder. A process the launcher started, or a process other than 0
of a job started by hand, holds none: the launcher, or process 0, holds them
for it (``lock_if_holder``). The OS releases a lock when its process ends.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from orchestrator.distributed.launcher import LAUNCHED_ENV
from orchestrator.recipe.loading import PROCESS_ID_ENV
from orchestrator.run_files import run_dir
from orchestrator.run_files.run_dir import LOCK, RunDirError


class DirLock:
  """An exclusive lock on a directory (``DIR/run.lock``); the OS releases it when the process ends.

  A directory the lock created and nothing else wrote into is removed again on release (a refusal after the
  lock leaves nothing behind); so is a lock file it created in a run directory that had none (``lock_run``:
  a refused resume or export leaves the directory as it found it).
  """

  def __init__(self, path: Path, fd: int | None, *, created: bool = False, made_file: bool = False):
    self.path, self._fd, self._created, self._made_file = path, fd, created, made_file

  def release(self) -> None:
    if self._fd is None:  # released, or a re-entry of a lock this process already holds
      return
    _HELD.discard(_key(self.path))
    if self._created and [p.name for p in self.path.iterdir()] == [LOCK]:
      (self.path / LOCK).unlink()
      self.path.rmdir()
    elif self._made_file:  # unlinked while held: a process that opened it retries on a new file (``lock``)
      (self.path / LOCK).unlink(missing_ok=True)
    os.close(self._fd)  # closing the descriptor drops the lock
    self._fd = None

  def __enter__(self) -> "DirLock":
    return self

  def __exit__(self, *exc) -> None:
    self.release()


# The directories this process holds the lock of: taking one again is a no-op (``record`` holds its recording
# directory, and the run it starts takes it again).
_HELD: set[str] = set()


def _key(path: Path) -> str:
  return os.path.realpath(path)


def lock(path: Path, *, flag: str, create: bool = False, keep_file: bool = True) -> DirLock:
  """Takes ``path``'s lock before anything there is read or written, creating the directory if ``create``;
  without ``keep_file``, a lock file this call creates is removed again on release.

  Raises:
    RunDirError: another process holds it (its pid and command named), or ``path`` cannot be written.
  """
  if _key(path) in _HELD:
    return DirLock(path, None)
  created = create and not path.exists()
  if create:
    try:
      path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise RunDirError(f"{flag} {path}: cannot create it ({e.strerror}); choose a directory you can write") from None
  elif not path.is_dir():
    what = "run directory" if flag == "--resume" else "directory"
    raise RunDirError(f"{flag} {path}: no such {what}")
  if not os.access(path, os.W_OK | os.X_OK):
    raise RunDirError(f"{flag} {path}: the directory is not writable; every run writes its outputs there"
                      " (a resume writes a new segment): make it writable, or copy the run somewhere writable")
  made_file = not keep_file and not os.path.lexists(path / LOCK)
  try:
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # never write through a link
  except OSError as e:
    raise RunDirError(f"{flag} {path}: cannot open {path / LOCK} ({e.strerror}); make the directory writable")
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    holder = _holder(fd)
    os.close(fd)
    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      raise RunDirError(f"{flag} {path}: cannot lock {path / LOCK} ({e.strerror})") from None
    raise RunDirError(f"{flag} {path} is in use by {holder}; wait for it to end or stop it,"
                      " then try again") from None
  try:
    same_file = os.stat(path / LOCK, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
  except FileNotFoundError:
    same_file = False
  if not same_file:  # its holder removed the file it had made (``DirLock.release``): lock the one there now
    os.close(fd)
    return lock(path, flag=flag, create=create, keep_file=keep_file)
  os.ftruncate(fd, 0)
  os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
                           "since": datetime.datetime.now().isoformat(timespec="seconds")}).encode())
  _HELD.add(_key(path))
  return DirLock(path, fd, created=created, made_file=made_file)


def lock_run(path: Path, *, flag: str) -> DirLock:
  """The lock of the existing run in ``path`` (``lock``), for a resume or an export.

  A directory that has no lock file was never locked by a run: it is checked to
  hold a run (``run_dir.read_config``) before a lock file is written into it, so that a
  directory that is not a run (a recording, a model checkpoint) is refused with
  nothing written, and the lock file it then writes is removed again on release (a copied run, or one of an
  older version, is left as it was found). A run's directory keeps the lock file its run made, so its lock is
  taken before anything there is read.

  Raises:
    RunDirError: no run there, or ``lock``'s refusals.
  """
  if not (path / LOCK).exists() and not (path / LOCK).is_symlink():
    run_dir.read_config(path, flag=flag)
  return lock(path, flag=flag, keep_file=False)


def _holder(fd: int) -> str:
  """Who holds a lock, as its lock file says."""
  try:
    info = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
    return f"pid {int(info['pid'])} on {info.get('host')} (`{info.get('command')}`, since {info.get('since')})"
  except (OSError, ValueError, KeyError, TypeError):
    return "another process (its lock file names none)"


def holds_the_lock() -> bool:
  """Whether this process takes the run directory's lock: not a process the launcher started (the launcher
  holds it), nor a process other than 0 of a job started by hand (process 0 owns the directory)."""
  return os.environ.get(LAUNCHED_ENV) != "1" and os.environ.get(PROCESS_ID_ENV, "0").strip() in ("", "0")


def lock_if_holder(path: Path, *, flag: str, create: bool = False):
  """``path``'s lock (``lock``), or nothing to hold where another process holds it for this one."""
  return lock(path, flag=flag, create=create) if holds_the_lock() else contextlib.nullcontext()


def lock_run_if_holder(path: Path, *, flag: str):
  """The lock of the run in ``path`` (``lock_run``), or nothing to hold where another process holds it."""
  return lock_run(path, flag=flag) if holds_the_lock() else contextlib.nullcontext()

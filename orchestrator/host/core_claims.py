"""The CPU cores the runs on this machine have claimed, so that no run pins its threads onto another's.

A run that pins itself writes a claim file (its pid, the cores it took, when,
on the machine's monotonic clock) into a directory its user's runs share
(``$STEP_BOUNDARY_CORE_CLAIMS``, else ``<temp dir>/step-boundary-cores-<uid>``)
and holds an exclusive ``flock`` on it while it lives. A claim whose lock can
be taken belongs to a run that has ended (killed ones too: the kernel drops
their locks) and is removed by whoever reads it. Plans are made under the
directory's own lock, so two runs started together see each other; a lock not
had within ``LOCK_WAIT_S`` (a run stopped while holding it) is given up.

The directory must be this user's own: a real directory (not a link), owned
by this user, writable by no one else; files in it are opened without
following links. Anything else raises ``ClaimsUnavailable``, and the run plans
on its own cores without claiming (host_threads.apply_core_plan says so).

A run that claimed cores yields to the runs that start after it: its share is
the cores it claimed less the cores claimed by newer runs (never none), and it
grows back when they end. ``CoreWatcher`` keeps this process's threads, and the
processes it follows (the sampler's), on that share.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import secrets
import stat
import tempfile
import threading
import time
from pathlib import Path

#: The directory the runs of one user share their claims in (default: a per-user directory in the temp dir).
CLAIMS_ENV = "STEP_BOUNDARY_CORE_CLAIMS"

#: How often a run looks for newer runs to yield cores to, or for ended ones to take its cores back from.
POLL_S = 1.0
#: How long a run waits for the directory's lock before it plans without claims.
LOCK_WAIT_S = 5.0

#: The name XLA's CPU client gives its pool's threads (``/proc/<pid>/task/<tid>/comm``).
XLA_POOL_THREAD = "tf_XLAEigen"

#: Processes this run started whose threads follow its share, on the host's cores: the sampler's.
FOLLOWERS: set[int] = set()

_LOG = logging.getLogger(__name__)


class ClaimsUnavailable(Exception):
  """The claims directory cannot be used safely (named in the message); the run plans without claims."""


@dataclasses.dataclass(frozen=True)
class Claim:
  """One live run's claim: its process, the cores it took, and when (``time.monotonic_ns``)."""

  pid: int
  cores: tuple[int, ...]
  started_ns: int


def claims_dir() -> Path:
  given = os.environ.get(CLAIMS_ENV)
  if given:
    return Path(given)
  try:
    return Path(tempfile.gettempdir()) / f"step-boundary-cores-{os.getuid()}"
  except (OSError, FileNotFoundError) as e:  # no usable temp dir
    raise ClaimsUnavailable(f"no temporary directory for the claims ({e})") from None


def share(own: Claim, others: list[Claim]) -> tuple[int, ...]:
  """The cores ``own`` keeps beside ``others``: its claim less those of the runs that started after it (all of
  its claim if that would leave none)."""
  taken = {core for claim in others if claim.started_ns > own.started_ns for core in claim.cores}
  kept = tuple(core for core in own.cores if core not in taken)
  return kept or own.cores


def layout(cores: tuple[int, ...], reserved: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(XLA's cores, the host's) on ``cores``: the last one kept for the host when the plan reserved one and there
  are two or more."""
  return (cores[:-1], cores[-1:]) if reserved and len(cores) > 1 else (cores, cores)


class CoreClaims:
  """This user's claims directory: read the live claims, make one for this process, release it."""

  def __init__(self, directory: Path | None = None):
    self.directory = Path(directory) if directory is not None else claims_dir()
    self._held: int | None = None  # this process's claim file, open and locked while the claim lives
    self._name: str | None = None
    self.own: Claim | None = None

  def _checked_directory(self) -> None:
    """Makes the directory (mode 0700) if missing; raises ``ClaimsUnavailable`` unless it is this user's own."""
    try:
      self.directory.mkdir(mode=0o700, parents=True)
    except FileExistsError:
      pass
    except OSError as e:
      raise ClaimsUnavailable(f"{self.directory}: cannot make it ({e.strerror})") from None
    try:
      info = os.lstat(self.directory)
    except OSError as e:
      raise ClaimsUnavailable(f"{self.directory}: {e.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
      raise ClaimsUnavailable(f"{self.directory} is not a directory")
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
      raise ClaimsUnavailable(f"{self.directory} is not this user's own (owned by uid {info.st_uid}, mode"
                              f" {stat.S_IMODE(info.st_mode):o}); {CLAIMS_ENV}=DIR names another")

  def _open(self, name: str, flags: int) -> int:
    return os.open(self.directory / name, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)

  @contextlib.contextmanager
  def planning(self, wait_s: float = LOCK_WAIT_S):
    """Holds the directory's lock: no other run plans or claims meanwhile. Raises ``ClaimsUnavailable`` where
    the directory is not safe to use or its lock is not had within ``wait_s``."""
    self._checked_directory()
    try:
      lock = self._open(".lock", os.O_RDWR | os.O_CREAT)
    except OSError as e:
      raise ClaimsUnavailable(f"{self.directory / '.lock'}: {e.strerror}") from None
    try:
      deadline = time.monotonic() + wait_s
      while True:
        try:
          fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
          break
        except BlockingIOError:
          if time.monotonic() > deadline:
            raise ClaimsUnavailable(f"{self.directory / '.lock'} stayed locked for {wait_s:.0f} s (a run stopped"
                                    " while planning?)") from None
          time.sleep(0.05)
      try:
        yield self
      finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
    finally:
      os.close(lock)

  def live_claims(self) -> list[Claim]:
    """Every other live run's claim, oldest first; the claims of runs that have ended are removed."""
    claims = []
    for path in sorted(self.directory.glob("*.json")):
      if path.name != self._name and (claim := self._read_live(path.name)) is not None:
        claims.append(claim)
    return sorted(claims, key=lambda c: c.started_ns)

  def _read_live(self, name: str) -> Claim | None:
    try:
      fd = self._open(name, os.O_RDONLY)
    except OSError:  # vanished meanwhile, or a link: not a live run's
      return None
    try:
      try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
      except BlockingIOError:  # its run holds it: live
        data = json.loads(os.read(fd, 1 << 16) or b"null")
        return Claim(int(data["pid"]), tuple(int(c) for c in data["cores"]), int(data["started_ns"]))
      with contextlib.suppress(OSError):
        os.unlink(self.directory / name)  # nobody holds it: its run has ended
      return None
    except (OSError, ValueError, KeyError, TypeError):  # not a claim
      return None
    finally:
      os.close(fd)

  def claim(self, cores: tuple[int, ...]) -> Claim:
    """Claims ``cores`` for this process until it exits (or ``release``). A name of its own (pid and a random
    part: runs in other pid namespaces may share the directory), created, never reused."""
    self.own = Claim(os.getpid(), tuple(cores), time.monotonic_ns())
    name = f"{self.own.pid}-{secrets.token_hex(4)}.json"
    try:
      fd = self._open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      os.write(fd, json.dumps(dataclasses.asdict(self.own)).encode())
    except OSError as e:
      raise ClaimsUnavailable(f"{self.directory / name}: {e.strerror or errno.errorcode.get(e.errno)}") from None
    self._held, self._name = fd, name
    return self.own

  def release(self) -> None:
    if self._held is not None:
      with contextlib.suppress(OSError):
        os.unlink(self.directory / self._name)
      os.close(self._held)
      self._held = self._name = None


def pin_threads(pid: int, xla_cores: tuple[int, ...], host_cores: tuple[int, ...], *,
                skip: frozenset = frozenset()) -> set[int]:
  """XLA's pool threads of ``pid`` onto ``xla_cores``, its other threads onto ``host_cores``, but the thread ids
  in ``skip``; returns the thread ids it found."""
  found = set()
  with contextlib.suppress(OSError):  # a process that has ended meanwhile
    for tid in (int(t) for t in os.listdir(f"/proc/{pid}/task")):
      found.add(tid)
      if tid in skip:
        continue
      with contextlib.suppress(OSError):  # a thread that has ended meanwhile
        name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        os.sched_setaffinity(tid, xla_cores if name.startswith(XLA_POOL_THREAD) else host_cores)
  return found


def pin_run(xla_cores: tuple[int, ...], host_cores: tuple[int, ...], *, skip: frozenset = frozenset()) -> set[int]:
  """This process's threads (``pin_threads``) and every thread of the processes that follow it (``FOLLOWERS``:
  the sampler's, onto the host's cores); returns the thread ids found."""
  found = pin_threads(os.getpid(), xla_cores, host_cores, skip=skip)
  for pid in list(FOLLOWERS):
    found |= pin_threads(pid, host_cores, host_cores, skip=skip)
  return found


class CoreWatcher:
  """A daemon thread that keeps this process and its followers on its share of its claim (``share``), laid out
  as its plan was (``layout``)."""

  def __init__(self, claims: CoreClaims, *, reserved: bool, poll_s: float = POLL_S):
    self._claims, self._reserved, self._poll_s = claims, reserved, poll_s
    self.cores = claims.own.cores
    self._moved = False  # whether the share ever changed: from then on, threads started since follow it
    self._pinned: frozenset = frozenset()  # thread ids already on the current share
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="core-watcher", daemon=True)
    self._failed = False

  def start(self) -> CoreWatcher:
    self._thread.start()
    return self

  @property
  def moved(self) -> bool:
    """Whether the share ever changed (from then on this watcher keeps every thread of the run on it)."""
    return self._moved

  def stop(self) -> None:
    """Stops watching; returns once the thread no longer pins anything."""
    self._stop.set()
    if self._thread.is_alive() and self._thread is not threading.current_thread():
      self._thread.join(self._poll_s + LOCK_WAIT_S + 1.0)

  def _run(self) -> None:
    while not self._stop.wait(self._poll_s):
      try:
        self.check()
      except (ClaimsUnavailable, OSError) as e:  # this poll is skipped; said once
        if not self._failed:
          _LOG.warning("[cores] could not look at the other runs' claims (%s); keeping cores %s", e,
                       span(self.cores))
          self._failed = True

  def check(self) -> tuple[int, ...]:
    """Re-pins this process when its share changed, and threads started since onto it; returns the share."""
    with self._claims.planning():
      others = self._claims.live_claims()
    cores = share(self._claims.own, others)
    if self._stop.is_set():
      return self.cores
    if cores != self.cores:
      newer = sorted(c.pid for c in others if c.started_ns > self._claims.own.started_ns)
      _LOG.info("[cores] %s: this run now runs on cores %s (was %s)",
                f"runs {newer} started after this one" if newer else "the runs started after this one ended",
                span(cores), span(self.cores))
      self.cores, self._pinned, self._moved = cores, frozenset(), True
    if self._moved:
      self._pinned = frozenset(pin_run(*layout(cores, self._reserved), skip=self._pinned))
    return cores


def span(cores: tuple[int, ...]) -> str:
  """Cores in words: ``0-3`` for a run of three or more, else ``0,2``."""
  if len(cores) > 2 and list(cores) == list(range(cores[0], cores[-1] + 1)):
    return f"{cores[0]}-{cores[-1]}"
  return ",".join(str(c) for c in cores)

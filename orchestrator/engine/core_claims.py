"""The CPU cores the runs on this machine have claimed, so that no run pins its threads onto another's.

A run that pins itself writes ``<pid>.json`` (the cores it took, when it
started) into a directory its user's runs share (``$STEP_BOUNDARY_CORE_CLAIMS``,
else ``<temp dir>/step-boundary-cores-<uid>``) and holds an exclusive ``flock``
on that file while it lives. A claim whose lock can be taken belongs to a run
that has ended (killed ones too: the kernel drops their locks) and is removed
by whoever reads it. Plans are made under the directory's own lock, so two runs
started together see each other.

A run that claimed cores yields to the runs that start after it: its share is
the cores it claimed less the cores claimed by newer runs (never none), and it
grows back when they end (``CoreWatcher``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

#: The directory the runs of one user share their claims in (default: a per-user directory in the temp dir).
CLAIMS_ENV = "STEP_BOUNDARY_CORE_CLAIMS"

#: How often a run looks for newer runs to yield cores to, or for ended ones to take its cores back from.
POLL_S = 1.0

_LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Claim:
  """One live run's claim: its process, the cores it took, and when (``time.time_ns``)."""

  pid: int
  cores: tuple[int, ...]
  started_ns: int


def claims_dir() -> Path:
  return Path(os.environ.get(CLAIMS_ENV) or Path(tempfile.gettempdir()) / f"step-boundary-cores-{os.getuid()}")


def share(own: Claim, others: list[Claim]) -> tuple[int, ...]:
  """The cores ``own`` keeps beside ``others``: its claim less those of the runs that started after it (all of
  its claim if that would leave none)."""
  taken = {core for claim in others if claim.started_ns > own.started_ns for core in claim.cores}
  kept = tuple(core for core in own.cores if core not in taken)
  return kept or own.cores


class CoreClaims:
  """This user's claims directory: read the live claims, make one for this process, release it."""

  def __init__(self, directory: Path | None = None):
    self.directory = Path(directory) if directory is not None else claims_dir()
    self._held = None  # this process's claim file, open and locked while the claim lives
    self.own: Claim | None = None

  @contextlib.contextmanager
  def planning(self):
    """Holds the directory's lock: no other run plans or claims meanwhile."""
    self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(self.directory / ".lock", "a") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      try:
        yield self
      finally:
        fcntl.flock(lock, fcntl.LOCK_UN)

  def live_claims(self) -> list[Claim]:
    """Every other live run's claim, oldest first; the claims of runs that have ended are removed."""
    claims = []
    for path in sorted(self.directory.glob("*.json")) if self.directory.is_dir() else ():
      if self.own is not None and path.name == f"{self.own.pid}.json":
        continue
      claim = self._read_live(path)
      if claim is not None:
        claims.append(claim)
    return sorted(claims, key=lambda c: c.started_ns)

  def _read_live(self, path: Path) -> Claim | None:
    try:
      with open(path) as f:
        try:
          fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # its run holds it: live
          data = json.loads(f.read() or "null")
          return Claim(int(data["pid"]), tuple(int(c) for c in data["cores"]), int(data["started_ns"]))
        path.unlink(missing_ok=True)  # nobody holds it: its run has ended
        return None
    except (OSError, ValueError, KeyError, TypeError):  # vanished meanwhile, or not a claim: not a live run's
      return None

  def claim(self, cores: tuple[int, ...]) -> Claim:
    """Claims ``cores`` for this process until it exits (or ``release``)."""
    self.own = Claim(os.getpid(), tuple(cores), time.time_ns())
    path = self.directory / f"{self.own.pid}.json"
    held = open(path, "w")
    fcntl.flock(held, fcntl.LOCK_EX)
    held.write(json.dumps(dataclasses.asdict(self.own)))
    held.flush()
    self._held = held
    return self.own

  def release(self) -> None:
    if self._held is not None:
      with contextlib.suppress(OSError):
        (self.directory / f"{self.own.pid}.json").unlink()
      self._held.close()
      self._held = None


#: The name XLA's CPU client gives its pool's threads (``/proc/<pid>/task/<tid>/comm``).
XLA_POOL_THREAD = "tf_XLAEigen"


def layout(cores: tuple[int, ...], reserved: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(XLA's cores, the host's) on ``cores``: the last one kept for the host when the plan reserved one and there
  are two or more."""
  return (cores[:-1], cores[-1:]) if reserved and len(cores) > 1 else (cores, cores)


def pin_process_tree(pid: int, xla_cores: tuple[int, ...], host_cores: tuple[int, ...], *,
                     skip: frozenset = frozenset()) -> set[int]:
  """XLA's pool threads of ``pid`` onto ``xla_cores``, its other threads and its child processes (the sampler's)
  onto ``host_cores``, but the thread ids in ``skip``; returns the thread ids it found."""
  found = set()
  for tid in _threads(pid):
    found.add(tid)
    with contextlib.suppress(OSError):  # a thread that has ended meanwhile
      if tid not in skip:
        name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        os.sched_setaffinity(tid, xla_cores if name.startswith(XLA_POOL_THREAD) else host_cores)
      for child in _children(pid, tid):
        found |= pin_process_tree(child, host_cores, host_cores, skip=skip)
  return found


def _threads(pid: int) -> list[int]:
  with contextlib.suppress(OSError):
    return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
  return []


def _children(pid: int, tid: int) -> list[int]:
  with contextlib.suppress(OSError, ValueError):
    return [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
  return []


class CoreWatcher:
  """A daemon thread that keeps this process (and its children) on its share of its claim (``share``), laid out
  as its plan was (``layout``)."""

  def __init__(self, claims: CoreClaims, *, reserved: bool, poll_s: float = POLL_S):
    self._claims, self._reserved, self._poll_s = claims, reserved, poll_s
    self.cores = claims.own.cores
    self._moved = False  # whether the share ever changed: from then on, threads started since follow it
    self._pinned: frozenset = frozenset()  # thread ids already on the current share
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="core-watcher", daemon=True)

  def start(self) -> CoreWatcher:
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()

  def _run(self) -> None:
    while not self._stop.wait(self._poll_s):
      self.check()

  def check(self) -> tuple[int, ...]:
    """Re-pins this process when its share changed, and threads started since onto it; returns the share."""
    with self._claims.planning():
      others = self._claims.live_claims()
    cores = share(self._claims.own, others)
    if cores != self.cores:
      newer = sorted(c.pid for c in others if c.started_ns > self._claims.own.started_ns)
      _LOG.info("[cores] %s: this run now runs on cores %s (was %s)",
                f"runs {newer} started after this one" if newer else "the runs started after this one ended",
                _span(cores), _span(self.cores))
      self.cores, self._pinned, self._moved = cores, frozenset(), True
    if self._moved:
      self._pinned = frozenset(pin_process_tree(os.getpid(), *layout(cores, self._reserved), skip=self._pinned))
    return cores


def _span(cores: tuple[int, ...]) -> str:
  return ",".join(str(c) for c in cores)

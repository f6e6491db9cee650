"""A heartbeat per process through the coordinator; a peer that fails or goes silent ends this process.

Each process bumps its own counter every ``interval_s`` and reads every
peer's. A peer whose counter has not moved for ``timeout_s`` — killed, hung
outside JAX, its host gone — is reported through ``on_lost`` with its id and
how long it was silent; so is a coordinator that cannot be reached. JAX's own
heartbeat (``bringup``) waits longer, so this line comes first. A peer that
failed says so (``post_failure``: its one line, under its own key) before it
ends, and the next check reports it with that line, within ``interval_s``
rather than after a silence of ``timeout_s``. ``on_lost`` runs on the
watchdog's thread and is expected to end the process: a peer inside a
collective with a dead process would otherwise wait forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

_KEY = "step_boundary/alive/"
_FAILED_KEY = "step_boundary/failed/"
_ENDING_KEY = "step_boundary/ending/"  # a process ending because a peer failed or went silent
#: The longest failure line a process posts for its peers (the first line of its error).
MAX_FAILURE_CHARS = 300
#: The beats every peer must have sent since a failure of this process before it counts as its own.
BEATS_TO_PROVE_ALIVE = 2


class Watchdog:
  """Heartbeats for this process and watches its peers' (see the module docstring).

  Args:
    client: the job's key-value client.
    process_id, num_processes: this process and the job's size.
    timeout_s: silence after which a peer counts as lost.
    on_lost: called once with one line saying which process was lost and how.
  """

  def __init__(self, client, process_id: int, num_processes: int, *, timeout_s: float,
               on_lost: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
    self._client = client
    self.process_id, self.num_processes = process_id, num_processes
    self.timeout_s = timeout_s
    self.interval_s = min(1.0, timeout_s / 5)
    self._on_lost = on_lost
    self._clock = clock
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="step-boundary-watchdog", daemon=True)
    self._seen: dict[int, tuple[str | None, float]] = {}
    self._beats_seen: dict[int, int] = {}  # per peer, how many new beats the checks saw (read by wait_for_peers)

  def start(self) -> "Watchdog":
    self._thread.start()
    return self

  def stop(self) -> None:
    """Stops watching (before the job's last barrier: processes finish at different times)."""
    self._stop.set()
    if self._thread.is_alive() and threading.current_thread() is not self._thread:
      self._thread.join(timeout=5 * self.interval_s)

  def wait_for_peers(self) -> None:
    """This process just failed: gives the watchdog time to find the peer that caused it (one that failed or
    died first: a collective with it fails here too), and ``on_lost`` then ends the process naming it. Returns
    once every peer has sent ``BEATS_TO_PROVE_ALIVE`` beats and posted no failure (they are alive, so the
    failure is this process's own), or after a silence of ``timeout_s`` found no lost peer."""
    start = dict(self._beats_seen)
    deadline = self._clock() + self.timeout_s + 3 * self.interval_s
    peers = [p for p in range(self.num_processes) if p != self.process_id]
    while self._thread.is_alive() and self._clock() < deadline:
      if all(self._beats_seen.get(p, 0) - start.get(p, 0) >= BEATS_TO_PROVE_ALIVE for p in peers):
        return
      self._thread.join(timeout=self.interval_s / 2)

  def post_failure(self, line: str) -> None:
    """Tells the peers that this process failed (``line``: how, its first line is kept) and stops watching
    them: this process ends naming its own failure, and each peer's next check ends it naming this one."""
    self.stop()
    text = (line.strip().splitlines() or ["an error without a message"])[0][:MAX_FAILURE_CHARS]
    self._client.key_value_set(_FAILED_KEY + str(self.process_id), text, allow_overwrite=True)

  def wait_until_peers_end(self) -> None:
    """After ``post_failure``: waits until every peer has said it is ending (``post_ending``) or posted a failure
    of its own, at most ``timeout_s``. Process 0 does, since it serves the coordinator: JAX ends a peer with its
    own lines once the coordinator is gone, and this lets each peer say first which process failed."""
    peers = {str(p) for p in range(self.num_processes) if p != self.process_id}
    deadline = self._clock() + self.timeout_s
    while self._clock() < deadline:
      told = {key.rsplit("/", 1)[-1] for prefix in (_ENDING_KEY, _FAILED_KEY)
              for key, _ in self._client.key_value_dir_get(prefix)}
      if peers <= told:
        return
      time.sleep(self.interval_s / 2)

  def post_ending(self) -> None:
    """Says that this process is ending because a peer failed or went silent (its line already said which); a
    coordinator that is gone already is no matter: nobody is waiting then."""
    try:
      self._client.key_value_set(_ENDING_KEY + str(self.process_id), "1", allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except  # the client raises its runtime's error types
      pass

  def _run(self) -> None:
    beat = 0
    while not self._stop.is_set():
      beat += 1
      try:
        lost = self.check(beat)
      except Exception as e:  # pylint: disable=broad-except  # the coordinator's channel failed
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        lost = f"the job's coordinator (process 0) cannot be reached ({reason})"
      if lost and not self._stop.is_set():
        self._stop.set()
        self._on_lost(lost)
        return
      self._stop.wait(self.interval_s)

  def check(self, beat: int) -> str | None:
    """Posts this process's ``beat`` and reads the peers'; returns a line naming a peer that failed (with its
    own line) or went silent, or None.

    A peer that has not posted yet counts from the first check (it may still be starting).
    """
    self._client.key_value_set(_KEY + str(self.process_id), str(beat), allow_overwrite=True)
    failed = {key.rsplit("/", 1)[-1]: text for key, text in self._client.key_value_dir_get(_FAILED_KEY)}
    for peer in range(self.num_processes):
      if peer != self.process_id and str(peer) in failed:
        return f"process {peer} of {self.num_processes} failed: {failed[str(peer)]}"
    beats = {key.rsplit("/", 1)[-1]: value for key, value in self._client.key_value_dir_get(_KEY)}
    now = self._clock()
    for peer in range(self.num_processes):
      if peer == self.process_id:
        continue
      value, last = beats.get(str(peer)), self._seen.get(peer)
      if last is None or last[0] != value:
        self._beats_seen[peer] = self._beats_seen.get(peer, 0) + (last is not None)
        self._seen[peer] = (value, now)
      elif now - last[1] > self.timeout_s:
        return (f"process {peer} of {self.num_processes} sent no heartbeat for {now - last[1]:.1f} s"
                f" (distributed.timeout_s={self.timeout_s:g})")
    return None

"""A heartbeat per process through the coordinator; a peer that goes silent ends this process with one line.

Each process bumps its own counter every ``interval_s`` and reads every
peer's. A peer whose counter has not moved for ``timeout_s`` — killed, hung
outside JAX, its host gone — is reported through ``on_lost`` with its id and
how long it was silent; so is a coordinator that cannot be reached. JAX's own
heartbeat (``bringup``) waits longer, so this line comes first. ``on_lost``
runs on the watchdog's thread and is expected to end the process: a peer
inside a collective with a dead process would otherwise wait forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

_KEY = "step_boundary/alive/"


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

  def start(self) -> "Watchdog":
    self._thread.start()
    return self

  def stop(self) -> None:
    """Stops watching (before the job's last barrier: processes finish at different times)."""
    self._stop.set()
    if self._thread.is_alive() and threading.current_thread() is not self._thread:
      self._thread.join(timeout=5 * self.interval_s)

  def wait_for_loss(self) -> None:
    """Gives the watchdog one timeout to find a lost peer (a collective just failed: a dead peer is the
    likely cause, and ``on_lost`` then ends the process naming it); returns if none is found."""
    self._thread.join(timeout=self.timeout_s + 3 * self.interval_s)

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
    """Posts this process's ``beat`` and reads the peers'; returns a line naming a lost peer, or None.

    A peer that has not posted yet counts from the first check (it may still be starting).
    """
    self._client.key_value_set(_KEY + str(self.process_id), str(beat), allow_overwrite=True)
    beats = {key.rsplit("/", 1)[-1]: value for key, value in self._client.key_value_dir_get(_KEY)}
    now = self._clock()
    for peer in range(self.num_processes):
      if peer == self.process_id:
        continue
      value, last = beats.get(str(peer)), self._seen.get(peer)
      if last is None or last[0] != value:
        self._seen[peer] = (value, now)
      elif now - last[1] > self.timeout_s:
        return (f"process {peer} of {self.num_processes} sent no heartbeat for {now - last[1]:.1f} s"
                f" (distributed.timeout_s={self.timeout_s:g})")
    return None

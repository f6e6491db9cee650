"""How SIGINT and SIGTERM end a run: at the next boundary, checkpointed, with the signal's exit code.

The first signal asks the program to stop at the next boundary: the step in
flight finishes, its update is applied, a checkpoint is written,
``summary.json`` says ``"ended": "signal"``, and the exit code is 130 or 143. Signals within ``SIGNAL_WINDOW_S`` of the first are the
same stop (a wrapper that forwards the terminal's signal delivers it twice); a
later one stops at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator.distributed.launcher import resume_hint

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
# Signals this soon after the first are that one stop: `timeout` at a terminal, or any wrapper that forwards
# the terminal's SIGINT, delivers one Ctrl-C to the process group and again to its child.
SIGNAL_WINDOW_S = 1.0


class StopSignals:
  """First SIGINT/SIGTERM: stop at the next boundary. Another within ``SIGNAL_WINDOW_S``: the same stop.
  One after that: stop at once, with one line."""

  def __init__(self, out: Path, *, quiet: bool = False):
    self.out, self.quiet = out, quiet
    self.received: signal.Signals | None = None
    self._first_at = 0.0
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> "StopSignals":
    for sig in EXIT_CODES:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _handle(self, signum: int, frame) -> None:
    del frame
    sig = signal.Signals(signum)
    now = time.monotonic()
    if self.received is not None and now - self._first_at < SIGNAL_WINDOW_S:
      return  # the same stop delivered twice (to the process group and again to this process)
    if self.received is None:
      self.received, self._first_at = sig, now
      if self.quiet:  # another process of the job tells the terminal
        return
      print(f"\nrun_rl: {sig.name} received: stopping after the step in flight (its update applied and"
            f" checkpointed); {sig.name} again stops at once", file=sys.stderr, flush=True)
      return
    print(f"run_rl: second {sig.name}: stopped at once; {resume_hint(self.out)}", file=sys.stderr, flush=True)
    os._exit(EXIT_CODES.get(sig, 130))

  def requested(self) -> str | None:
    """The signal's name once one came (truthy), else None; the program stops at the next boundary."""
    return self.received.name if self.received is not None else None

  def stopped_by(self, stop_reason: str | None) -> signal.Signals:
    """The signal a run that stopped ended by: the one this process received, else the one the program
    agreed on (``stop_reason``; in a job of several processes it may have reached another process)."""
    return self.received or signal_named(stop_reason)


def signal_named(name: str | None) -> signal.Signals:
  try:
    return signal.Signals[name]
  except KeyError:
    return signal.SIGTERM  # a stop asked for by other means ends like a polite termination

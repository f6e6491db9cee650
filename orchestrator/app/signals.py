"""How SIGINT and SIGTERM end a run: at the next boundary, checkpointed, with the signal's exit code.

The first signal asks the program to stop at the next boundary: the step in
flight finishes, its update is applied, a checkpoint is written,
``summary.json`` says ``"ended": "signal"``, and the exit code is 130 or 143.
A stop that finds the run waiting for rollouts ends it after the last finished
step, checkpointed the same way (docs/resume.md). A stop that leaves nothing to
resume from (before the run's first update, with no checkpoint to resume, or
with an engine that writes none) exits ``EXIT_NOTHING_TO_RESUME`` instead, so a
script can tell the two apart. Signals within ``SIGNAL_WINDOW_S`` of the first
are the same stop (a wrapper that forwards the terminal's signal delivers it
twice); a later one stops at once.

Before the run installs its handlers (start-up: imports, checks, the JAX
backend), SIGINT raises ``KeyboardInterrupt`` as Python's own handler does, and
is also remembered (``startup_interrupts``): an interrupt raised inside a
finalizer or a garbage-collector callback is printed and dropped by Python, and
the run would otherwise go on as if no Ctrl-C had come. ``StopSignals`` takes a
remembered one as its first signal. A signal ignored when the process started
(``nohup``, a shell's background job) stays ignored to the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.distributed.launcher import has_complete_checkpoint, resume_hint

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
#: A stop after which there is nothing to resume (no checkpoint of this run or of the one it resumed).
EXIT_NOTHING_TO_RESUME = 4
#: What a stop would end with, as ``StopSignals.keeps`` says it, and how the first line puts it.
STOP_KEEPS = {
    "kept": ("stopping after the step in flight, or after the last finished step if the next one still waits for"
             " its rollouts, checkpointed"),
    "after the first step": ("stopping after the first step if it finishes (checkpointed); a stop while it waits"
                             " for its rollouts ends with nothing to resume"),
    "none": "stopping after the step in flight; this engine writes no checkpoints, so nothing can be resumed",
}
#: The stop signals whoever started run_rl set to be ignored (read as start-up begins: ``startup_interrupts``).
_ignored_at_start: set[signal.Signals] = set()
# Signals this soon after the first are that one stop: `timeout` at a terminal, or any wrapper that forwards
# the terminal's SIGINT, delivers one Ctrl-C to the process group and again to its child.
SIGNAL_WINDOW_S = 1.0
# When the SIGINT that came during start-up arrived (monotonic seconds), until a run's StopSignals takes it.
_startup_sigint_at: list[float] = []


def _startup_sigint(signum: int, frame) -> None:
  _startup_sigint_at.append(time.monotonic())
  signal.default_int_handler(signum, frame)


@contextlib.contextmanager
def startup_interrupts():
  """SIGINT during start-up raises ``KeyboardInterrupt`` and is remembered for the run's ``StopSignals``
  (see the module's docstring); the previous handler is restored on exit. A stop signal ignored now stays
  ignored, here and in the run's ``StopSignals``."""
  _startup_sigint_at.clear()
  _ignored_at_start.clear()
  _ignored_at_start.update(sig for sig in EXIT_CODES if signal.getsignal(sig) is signal.SIG_IGN)
  if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:  # ignored by whoever started us: stays so
    yield
    return
  previous = signal.signal(signal.SIGINT, _startup_sigint)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)
    _startup_sigint_at.clear()


class StopSignals:
  """First SIGINT/SIGTERM: stop at the next boundary. Another within ``SIGNAL_WINDOW_S``: the same stop.
  One after that: stop at once, with one line. A signal ignored at the process's start is left ignored.

  Attributes:
    keeps: set by the run: what a stop now would end with (``STOP_KEEPS``), so that the first line promises a
      checkpoint only where there will be one to resume from.
  """

  def __init__(self, out: Path, *, quiet: bool = False):
    self.out, self.quiet = out, quiet
    self.received: signal.Signals | None = None
    self.keeps: Callable[[], str] = lambda: "after the first step"
    self._first_at = 0.0
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> "StopSignals":
    for sig in EXIT_CODES:
      if sig not in _ignored_at_start:
        self._previous[sig] = signal.signal(sig, self._handle)
    if signal.SIGINT in _ignored_at_start and not self.quiet:  # nothing else would tell why Ctrl-C does nothing
      print("run_rl: note: SIGINT is ignored in this process (started in the background or under nohup), so"
            " Ctrl-C will not stop the run; SIGTERM (kill PID) stops it at the next boundary", file=sys.stderr)
    if _startup_sigint_at and self.received is None:  # a Ctrl-C whose KeyboardInterrupt Python dropped
      self._request(signal.SIGINT, _startup_sigint_at[0])
      _startup_sigint_at.clear()
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
      self._request(sig, now)
      return
    print(f"run_rl: second {sig.name}: stopped at once; {resume_hint(self.out)}", file=sys.stderr, flush=True)
    os._exit(EXIT_CODES.get(sig, 130) if has_complete_checkpoint(self.out) else EXIT_NOTHING_TO_RESUME)

  def _request(self, sig: signal.Signals, at_s: float) -> None:
    self.received, self._first_at = sig, at_s
    if self.quiet:  # another process of the job tells the terminal
      return
    what = STOP_KEEPS[self.keeps()]
    print(f"\nrun_rl: {sig.name} received: {what}; {sig.name} again stops at once", file=sys.stderr, flush=True)

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

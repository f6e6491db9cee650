"""The step loop's waits for a live source's rollouts, each with a timeout and the stop flag (docs/resume.md).

A sampler that is stuck or slow must not hold a stop. ``LiveWaits`` asks the source with a timeout
(``LiveSource.ready``, ``ready_to_checkpoint``) and looks at the stop flag between asks; the program decides
what a stop there ends. In a job of several processes a stop seen by one process while it waits would end its
run while the others go on to the next step, so there a stop never ends a wait (``local_stops`` false): it is
agreed at the next boundary, as every stop is, and a checkpoint waits for all the rollouts it must carry, which
every process samples alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from orchestrator.contract import LiveSource

log = logging.getLogger("step_boundary.program")

#: How long one ask for a live source's rollouts waits before the loop looks at its stop flag again.
WAIT_POLL_S = 0.1
#: Once a stop is asked for, a checkpoint waits for the rollouts it must carry the stop grace plus this many
#: times what the sampler still has to sample of them at its measured pace (``LiveSource.sampling_left_s``):
#: a sampler that keeps its pace delivers them, a stuck one cannot hold the stop for long.
PACE_MARGIN = 1.5
#: However slow the sampler, a stop waits at most this long for those rollouts: a scheduler's SIGTERM is
#: followed by its SIGKILL (often 30 s later, in Kubernetes), and a user's Ctrl-C expects an end.
STOP_MAX_WAIT_S = 120.0


class StoppedWithoutCheckpointError(RuntimeError):
  """A stop came where no checkpoint of the steps done could be written; the message names the latest one.

  Attributes:
    resumable: whether an earlier checkpoint of the run exists to continue from (else nothing can be resumed).
  """

  def __init__(self, message: str, *, resumable: bool):
    super().__init__(message)
    self.resumable = resumable


class SourceFailed(Exception):
  """The step source failed while step ``step`` was taken (``error``: what it raised); the loop records the
  boundary it was in, then raises ``error``."""

  def __init__(self, step: int, error: BaseException):
    super().__init__(f"step {step}'s payloads: {error}")
    self.step, self.error = step, error


class StopWhileWaiting(Exception):
  """A stop was asked for while the loop waited for rollouts; ``reason``: what asked (a signal's name)."""

  def __init__(self, reason: str):
    super().__init__(reason)
    self.reason = reason


class StopInsideStep(Exception):
  """A stop was asked for while ``step`` waited for one of its later micro-batches (its first ones are
  dispatched): the run ends after the step before, whose checkpoint drops them (never applied)."""

  def __init__(self, reason: str, step: int):
    super().__init__(reason)
    self.reason, self.step = reason, step


def latest_checkpoint(records: Sequence[Any], *, written: str | None = None, written_steps: int | None = None,
                      resumed_from: int = 0) -> tuple[str, bool]:
  """Where a run that could not checkpoint its last steps continues from, as the end of its one line, and
  whether there is one: the last checkpoint this run wrote (``written``, after ``written_steps`` steps), else the
  last of ``records`` (a resumed run's earlier ones included) that names one, else the checkpoint a resumed run
  started from (``resumed_from`` steps; a stop's checkpoint is named by no record)."""
  if written is not None:
    return (f"the latest checkpoint is {written} (after step {written_steps - 1}); `run_rl --resume` continues"
            " from it"), True
  last = next((r for r in reversed(records) if r.checkpoint_path), None)
  if last is not None:
    return (f"the latest checkpoint is {last.checkpoint_path} (after step {last.step}); `run_rl --resume`"
            " continues from it"), True
  if resumed_from:
    return (f"the latest checkpoint is the one this run resumed from (after step {resumed_from - 1}); `run_rl"
            " --resume` continues from it"), True
  return "no checkpoint was written, so the run cannot be resumed: start it again with a new --out", False


class LiveWaits:
  """The loop's waits on ``live``: for a step's rollouts and for those a checkpoint must carry.

  Args:
    live: the source.
    stop_requested: the program's stop flag (truthy: a stop was asked for; a string names what asked).
    grace_s: once a stop is asked for, how long a checkpoint may still wait for its rollouts.
    latest: the end of the line a run that cannot checkpoint ends with, and whether an earlier checkpoint exists
      (``latest_checkpoint``'s).
    local_stops: whether a stop may end a wait (one process); false in a job of several (module docstring).
  """

  def __init__(self, live: LiveSource, stop_requested: Callable[[], Any], *, grace_s: float,
               latest: Callable[[], tuple[str, bool]], local_stops: bool = True):
    self.live, self.stop_requested, self.grace_s, self.latest = live, stop_requested, grace_s, latest
    self.local_stops = local_stops

  def take(self, step: int, *, first_of_run: bool) -> None:
    """Returns once ``step`` can be taken (``get_state``, ``next``) without waiting for sampling.

    Raises:
      StopWhileWaiting: a stop was asked for first (the loop ends after the step before).
      StoppedWithoutCheckpointError: that, for the run's first step (no step of this run to end after).
    """
    try:
      self._wait(lambda timeout_s: self.live.ready(step, timeout_s))
    except StopWhileWaiting as stop:
      if not first_of_run:
        raise
      raise self._without_checkpoint(f"stopped by {stop.reason} while waiting for step {step}'s rollouts,"
                                     " before this run trained a step") from None

  def micro_batch(self, step: int, index: int) -> None:
    """Returns once micro-batch ``index`` of the taken ``step`` is sampled.

    Raises:
      StopInsideStep: a stop came first. The step's first micro-batches are dispatched already; the run ends
        after the step before it, whose checkpoint needs the same sampled batch this wait does (or none).
    """
    try:
      return self._wait(lambda timeout_s: self.live.micro_batch_ready(step, index, timeout_s))
    except StopWhileWaiting as stop:
      raise StopInsideStep(stop.reason, step) from None

  def checkpoint(self, step: int, stopping: str | None) -> None:
    """Returns once the checkpoint after ``step`` can be written with the rollouts it must carry.

    At staleness S >= 1 the position before step k+1 holds the steps sampled with weights older than the
    checkpoint's, up to k+S, past the run's end too, so the run can be extended from it. Once a stop is asked
    for (``stopping``: it already was) the wait lasts at most ``grace_s`` plus ``PACE_MARGIN`` times what the
    sampler still has to sample of the run's own at its measured pace (said in one line when that is longer
    than ``grace_s``); then the checkpoint goes without the steps past the end, or, where the run's own are
    missing (a stuck sampler), not at all.

    With in-flight updates a position may fall inside a generation sampled ahead: the wait is then for the
    sampler to reach the chunk that needs this boundary's weights, whose generation so far the checkpoint carries.

    Raises:
      StoppedWithoutCheckpointError: a stop came, and the rollouts the checkpoint must carry did not.
    """
    if not stopping or not self.local_stops:  # a job's processes all wait the whole way: none ends alone
      try:
        return self._wait(lambda timeout_s: self.live.ready_to_checkpoint(step + 1, timeout_s))
      except StopWhileWaiting as stop:
        stopping = stop.reason  # the loop stops at the next boundary; this one waits no longer than a stop may
    if self.live.ready_to_checkpoint(step + 1, 0.0, extendable=False):
      return self._past_the_end(step, stopping)
    left_s = self.live.sampling_left_s(step + 1)
    allowed_s = max(self.grace_s, min(STOP_MAX_WAIT_S, self.grace_s + PACE_MARGIN * (left_s or 0.0)))
    if allowed_s > self.grace_s:
      log.warning("[stop] the checkpoint of step %d waits for the rollouts it must carry (sampled with older"
                  " weights, rollouts.max_staleness): about %.1f s at the sampler's pace, at most %.1f s; %s"
                  " again stops at once, without it", step, left_s, allowed_s, stopping)
    if self.live.ready_to_checkpoint(step + 1, allowed_s, extendable=False):
      return self._past_the_end(step, stopping)
    raise self._without_checkpoint(
        f"stopped by {stopping} after step {step}, but no checkpoint of it could be written: it must carry"
        " rollouts sampled ahead with older weights (rollouts.max_staleness), and the sampler did not deliver"
        f" them within {allowed_s:g} s")

  def _past_the_end(self, step: int, stopping: str) -> None:
    """The run's own rollouts are there: those past its end go too if the sampler has them within the grace."""
    if self.live.ready_to_checkpoint(step + 1, self.grace_s):
      return None
    log.warning("[checkpoint] the checkpoint after step %d lacks the rollouts of the steps past the run's end:"
                " %s came before they were sampled, so the run cannot be extended from it (--resume --steps)",
                step, stopping)
    return None

  def _without_checkpoint(self, what: str) -> StoppedWithoutCheckpointError:
    line, resumable = self.latest()
    return StoppedWithoutCheckpointError(f"{what}; {line}", resumable=resumable)

  def _wait(self, ready: Callable[[float], bool]) -> None:
    """Calls ``ready(timeout_s)`` until it is true, looking at the stop flag between calls."""
    while not ready(WAIT_POLL_S):
      asked = self.local_stops and self.stop_requested()
      if asked:
        raise StopWhileWaiting(asked if isinstance(asked, str) else "stop")

"""StepFeed: the step loop's side of its source — taking steps, handing out their micro-batches, the waits.

The program asks the feed for micro-batch i of step k; the feed takes step k from the source when it is first
needed (noting the source's position before it, which a checkpoint keeps) and, for a live source, waits for
what is not sampled yet with the stop flag in view (``LiveWaits``): the step's first micro-batch before it is
taken, each later one before it is handed out. Each micro-batch is waited for once and fetched from the step
once: a staged dispatch sends what the stage prepared and asks the feed for nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from orchestrator.contract import LiveSource, StepSource, live_part
from orchestrator.loop.live_waits import LiveWaits, SourceFailed


class StepFeed:
  """The steps of a run from ``source``, ``micro_batches_per_step`` payloads each.

  Args:
    source: the step source (``StepSource``); its live part (``LiveSource``), if any, is found once, here.
    micro_batches_per_step: payloads each step must have.
    start_step, steps: the run's first step (a resumed run's) and its length, for the messages of a source
      that runs out.
    stop_requested, grace_s, latest, local_stops: what a live source's waits need (see ``LiveWaits``).
  """

  def __init__(self, source: StepSource, *, micro_batches_per_step: int, start_step: int, steps: int,
               stop_requested: Callable[[], Any], grace_s: float, latest: Callable[[], str], local_stops: bool):
    self.source = source
    self.live: LiveSource | None = live_part(source)
    self.micro_batches_per_step, self.start_step, self.steps = micro_batches_per_step, start_step, steps
    self.waits = None if self.live is None else LiveWaits(self.live, stop_requested, grace_s=grace_s,
                                                          latest=latest, local_stops=local_stops)
    self._payloads: dict[int, Sequence[Any]] = {}
    self._positions: dict[int, Any] = {}  # the source's position before each step was taken
    self._take_wait_s: dict[int, float] = {}  # how long taking each step blocked for sampling (a live source)

  def micro_batch(self, step: int, index: int) -> Any:
    """Micro-batch ``index`` of ``step``, taking the step from the source when it is first needed.

    Raises:
      SourceFailed: the source failed while the step was taken.
      StopWhileWaiting, StoppedWithoutCheckpointError: a stop came while a live source's rollouts were awaited.
    """
    if step not in self._payloads:
      self._take(step)
    if self.waits is not None and index > 0:  # a step streams in: its later micro-batches may still be sampled
      self.waits.micro_batch(step, index)
    return self._payloads[step][index]

  def rollout_wait_s(self, step: int) -> float | None:
    """How long taking ``step`` blocked until its rollouts were sampled; None where the source is not live."""
    return self._take_wait_s.get(step)

  def next_ready(self, step: int) -> bool:
    """Whether ``step``'s first micro-batch can exist before the boundary's weight sync (a live source says)."""
    return self.live is None or not self.live.blocked_on_sync(step)

  def sampled_now(self, step: int, *, next_ready: bool, one_process: bool) -> bool | None:
    """Whether ``step``'s first micro-batch is sampled now, for the plan (``StepBoundaryPolicy.plan``): a live
    source in one process; None elsewhere — a recorded source has every step, and in a job of several processes
    each process's sampler is at its own point, while a plan must be the same in every process."""
    if self.live is None or not next_ready or not one_process:
      return None
    return self.live.ready(step, 0.0)

  def position_before(self, step: int) -> Any:
    """The source's position before ``step`` (after the last step taken, when ``step`` never was), as JSON."""
    state = self._positions[step] if step in self._positions else self.source.get_state()
    return self.source.state_json(state) if state is not None else None

  def forget(self, step: int) -> None:
    """Drops ``step``'s payloads and position: its boundary is over, and only the position before the step
    after it can still be checkpointed."""
    del self._payloads[step]
    self._positions.pop(step, None)
    self._take_wait_s.pop(step, None)

  def _take(self, step: int) -> None:
    """Takes ``step``'s payloads from the source, noting the source's position before it."""
    try:
      if self.waits is not None:  # a stuck or slow sampler must not hold a stop
        self.waits.take(step, first_of_run=step == self.start_step)
      self._positions[step] = self.source.get_state()
      payloads = next(self.source)
    except (RuntimeError, ValueError) as error:  # a rollout thread's or a recording's failure, for the loop
      raise SourceFailed(step, error) from error
    except StopIteration:
      taken = step - self.start_step
      raise ValueError("the source yielded no steps" if taken == 0 else
                       f"the source ran out after {taken} steps; {self.steps - self.start_step} were asked for"
                       ) from None
    m = self.micro_batches_per_step
    if len(payloads) != m:
      raise ValueError(f"step {step} has {len(payloads)} micro-batch payloads; micro_batches_per_step is {m}")
    self._payloads[step] = payloads
    if self.live is not None:  # a sampling source says how long it blocked
      self._take_wait_s[step] = self.live.last_wait_s

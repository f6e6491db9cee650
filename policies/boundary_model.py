"""Boundary model: the timeline of one step boundary per mode, from component times.

Pure Python (no JAX), used by the rig to write predictions before its arms run
and by ``run_rl simulate`` as a planning tool.

Model. One device runs its work in dispatch order; one host thread issues it.
Time 0 is the dispatch of step k's last micro-batch, which starts computing at
once (the device was busy with the micro-batch before it). Host costs:
``dispatch_s`` per dispatch, ``prepare_s`` to map and place one micro-batch,
``boundary_work_s`` for metrics, logging, checkpoint and weight sync. Device
costs: ``micro_batch_s``, ``update_s`` and, under dropless replay,
``replays_per_step`` re-runs of ``rerun_s`` each. If ``update_waits_for_last``
(dropless replay reads an overflow flag; a non-finite check reads the gradient
norm), ``update()`` returns to the host only when the last micro-batch is done,
and dispatches that micro-batch's re-run (when it overflowed) before the update.

Per mode, the host's order is DESIGN.md §4's table. ``boundary_idle_s`` is the
gap between update k finishing and step k+1's first micro-batch being
dispatched; ``step_s`` adds it, and any delay of the update's start, to the
compute-only bound ``M × micro_batch_s + update_s``.

Known biases: it assumes the copy issued by ``prepare`` is complete when the
micro-batch is dispatched (pessimistic where copies overlap compute on a real
transfer engine — the copy is then partly hidden even unstaged), that boundary
work never contends with compute (optimistic on a 2-core CPU, where host work
and XLA share the memory bus), and a wait floor that is paid once per deferred
update (pessimistic for runtimes whose floor overlaps the wait).
"""

from __future__ import annotations

import dataclasses

from policies.step_boundary import Mode


@dataclasses.dataclass(frozen=True)
class Components:
  """Measured or assumed component times of one optimizer step, in seconds."""

  micro_batch_s: float
  prepare_s: float
  update_s: float
  boundary_work_s: float
  dispatch_s: float = 0.0005
  wait_floor_s: float = 0.0
  micro_batches_per_step: int = 1
  update_waits_for_last: bool = False
  replays_per_step: float = 0.0  # dropless re-runs per step (on average)
  rerun_s: float = 0.0

  @property
  def compute_bound_s(self) -> float:
    return (self.micro_batches_per_step * self.micro_batch_s + self.replays_per_step * self.rerun_s
            + self.update_s)

  @property
  def last_rerun_s(self) -> float:
    """Expected re-run of the last micro-batch, which ``update()`` dispatches before the update."""
    share = min(1.0, self.replays_per_step / max(self.micro_batches_per_step, 1))
    return share * self.rerun_s


@dataclasses.dataclass(frozen=True)
class Segment:
  lane: str  # "device" or "host"
  name: str  # micro-batch, update, stage, boundary work, idle, wait, dispatch
  start_s: float
  end_s: float


@dataclasses.dataclass(frozen=True)
class Prediction:
  mode: Mode
  boundary_idle_s: float
  boundary_idle_strict_s: float
  step_s: float
  update_delay_s: float
  segments: tuple[Segment, ...]

  def as_dict(self) -> dict:
    return {
        "mode": self.mode.value,
        "boundary_idle_s": self.boundary_idle_s,
        "boundary_idle_strict_s": self.boundary_idle_strict_s,
        "step_s": self.step_s,
        "update_delay_s": self.update_delay_s,
    }


def predict(c: Components, mode: Mode) -> Prediction:
  """The timeline of one boundary in ``mode`` and what it implies for idle and step time."""
  d = c.dispatch_s
  last_done = c.micro_batch_s
  seg = [Segment("device", "last micro-batch", 0.0, last_done)]
  host = d  # the host has just dispatched the last micro-batch
  if mode is Mode.STAGE_BEFORE_UPDATE:
    seg.append(Segment("host", "stage", host, host + c.prepare_s))
    host += c.prepare_s
    wait_end = max(host, last_done) + c.wait_floor_s
    seg.append(Segment("host", "wait", host, wait_end))
    host = wait_end
    update_dispatch = host + d
  else:
    update_dispatch = (max(host, last_done) if c.update_waits_for_last else host) + d
  update_start = max(update_dispatch, last_done)
  if c.last_rerun_s:
    seg.append(Segment("device", "re-run", update_start, update_start + c.last_rerun_s))
  update_done = update_start + c.last_rerun_s + c.update_s
  seg.append(Segment("device", "update", update_done - c.update_s, update_done))
  host = update_dispatch
  if mode is Mode.OFF:
    host = max(host, update_done)  # the metrics read waits for the update
    seg.append(Segment("host", "boundary work", host, host + c.boundary_work_s))
    host += c.boundary_work_s
    seg.append(Segment("host", "prepare", host, host + c.prepare_s))
    first_dispatch = host + c.prepare_s + d
  elif mode is Mode.STAGE_BEFORE_UPDATE:
    first_dispatch = host + d
  else:  # PIPELINED maps inside fwd_bwd(first); STAGE_AFTER_UPDATE stages, then dispatches
    seg.append(Segment("host", "stage" if mode is Mode.STAGE_AFTER_UPDATE else "prepare",
                       host, host + c.prepare_s))
    first_dispatch = host + c.prepare_s + d
  idle = max(0.0, first_dispatch - update_done)
  if idle > 0:
    seg.append(Segment("device", "idle", update_done, first_dispatch))
  seg.append(Segment("device", "first micro-batch", max(update_done, first_dispatch),
                     max(update_done, first_dispatch) + c.micro_batch_s))
  update_delay = max(0.0, update_dispatch - last_done)
  # Re-runs of earlier micro-batches sit inside the step; the last one's is already in update_done.
  return Prediction(
      mode=mode,
      boundary_idle_s=idle,
      boundary_idle_strict_s=idle + update_delay,
      step_s=c.compute_bound_s + idle + update_delay,
      update_delay_s=update_delay,
      segments=tuple(seg),
  )


def band(prediction_s: float, *, rel: float, abs_s: float) -> tuple[float, float]:
  """An allowed band around a prediction: ± max(rel × value, abs_s), floored at 0."""
  tol = max(rel * prediction_s, abs_s)
  return max(0.0, prediction_s - tol), prediction_s + tol

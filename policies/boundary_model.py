"""Boundary model: the timeline of one step boundary per mode, from component times.

Pure Python (no JAX), used by the rig to write predictions before its arms run
and by ``run_rl simulate`` as a planning tool.

Model. One device runs its work in dispatch order; one host thread issues it.
Time 0 is the dispatch of step k's last micro-batch, which starts computing at
once (the device was busy with the micro-batch before it). Host costs:
``dispatch_s`` per dispatch, ``prepare_s`` to map and place one micro-batch,
``boundary_work_s`` for metrics, logging, checkpoint and weight sync. Device
costs: ``micro_batch_s``, ``update_s`` and, under dropless re-runs,
``reruns_per_step`` re-runs of ``rerun_s`` each. If ``update_waits_for_last``
(dropless re-runs read an overflow flag; a non-finite check reads the gradient
norm), ``update()`` returns to the host only when the last micro-batch is done,
and dispatches that micro-batch's re-run (when it overflowed) before the update.

Per mode, the host's order is ``policies.call_order.boundary_actions`` — the
same list the program executes — and ``predict`` times it action by action.
``boundary_idle_s`` is the
gap between update k finishing and step k+1's first micro-batch being
dispatched; ``step_s`` adds it, and any delay of the update's start, to the
compute-only bound ``M × micro_batch_s + update_s``.

A device wait that starts while compute still runs costs the larger of the
remaining compute and the wait floor (a remote runtime's round trip overlaps
the compute). ``copy_s`` is the device-side transfer of one micro-batch's
inputs (0: it is inside ``prepare_s``); a staged copy runs beside the compute,
and with ``sync_copy`` an unstaged ``fwd_bwd`` queues its copy behind the
update on the compute stream — there STAGE_AFTER_UPDATE hides more than PIPELINED.

Known biases: with ``copy_s`` 0 it assumes the copy issued by ``prepare`` is
complete when the micro-batch is dispatched, that boundary
work never contends with compute (optimistic on a 2-core CPU, where host work
and XLA share the memory bus), and a wait floor that is paid once per deferred
update (pessimistic for runtimes whose floor overlaps the wait).
"""

from __future__ import annotations

import dataclasses

from policies.call_order import Action, boundary_actions
from policies.step_boundary import BoundaryPlan, Mode


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
  reruns_per_step: float = 0.0  # dropless re-runs per step (on average)
  rerun_s: float = 0.0
  copy_s: float = 0.0  # device-side transfer of one micro-batch's inputs (0: part of prepare_s on the host)
  rollout_wait_s: float = 0.0  # how long the next step's rollouts keep the stage or the first dispatch waiting
  sync_copy: bool = False  # an unstaged fwd_bwd's copy queues on the compute stream, behind the update

  @property
  def compute_bound_s(self) -> float:
    return (self.micro_batches_per_step * self.micro_batch_s + self.reruns_per_step * self.rerun_s
            + self.update_s)

  @property
  def last_rerun_s(self) -> float:
    """Expected re-run of the last micro-batch, which ``update()`` dispatches before the update."""
    share = min(1.0, self.reruns_per_step / max(self.micro_batches_per_step, 1))
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


@dataclasses.dataclass
class _Timeline:
  """Host and device clocks while the model walks one boundary's actions."""

  c: Components
  host: float
  segments: list
  update_dispatch: float | None = None
  update_done: float | None = None
  first_dispatch: float | None = None
  first_inputs_ready: float = 0.0  # when the first micro-batch's inputs are on the device

  @property
  def last_done(self) -> float:
    return self.c.micro_batch_s

  def host_segment(self, name: str, seconds: float) -> None:
    self.segments.append(Segment("host", name, self.host, self.host + seconds))
    self.host += seconds

  def dispatch_update(self, update_dispatch: float) -> None:
    c = self.c
    self.update_dispatch = update_dispatch
    update_start = max(update_dispatch, self.last_done)
    if c.last_rerun_s:
      self.segments.append(Segment("device", "re-run", update_start, update_start + c.last_rerun_s))
    self.update_done = update_start + c.last_rerun_s + c.update_s
    self.segments.append(Segment("device", "update", self.update_done - c.update_s, self.update_done))
    self.host = update_dispatch


def _step(t: _Timeline, action: Action, mode: Mode) -> None:
  """Advances the timeline by one action (actions after the first dispatch hide behind compute)."""
  c, d = t.c, t.c.dispatch_s
  if action is Action.STAGE_FIRST:
    if c.rollout_wait_s:
      t.host_segment("rollout wait", c.rollout_wait_s)
    t.host_segment("stage", c.prepare_s)
    t.first_inputs_ready = t.host + c.copy_s  # a staged copy runs beside the compute
  elif action is Action.WAIT_AND_UPDATE:
    # A wait that starts while compute still runs costs the larger of the remaining compute and the floor.
    wait_end = max(t.last_done, t.host + c.wait_floor_s)
    t.segments.append(Segment("host", "wait", t.host, wait_end))
    t.host = wait_end
    t.dispatch_update(wait_end + d)
  elif action is Action.UPDATE:
    t.dispatch_update((max(t.host, t.last_done) if c.update_waits_for_last else t.host) + d)
  elif action is Action.METRICS:
    t.host = max(t.host, t.update_done)  # the metrics read waits for the update
    t.host_segment("boundary work", c.boundary_work_s)  # metrics, logging, checkpoint and sync
  elif action is Action.DISPATCH_FIRST:  # maps and places inside the call
    if c.rollout_wait_s:
      t.host_segment("rollout wait", c.rollout_wait_s)
    t.host_segment("stage" if mode is Mode.STAGE_AFTER_UPDATE else "prepare", c.prepare_s)
    t.first_dispatch = t.host + d
    # A synchronous copy queues behind the update on the compute stream; an asynchronous one runs beside it.
    t.first_inputs_ready = (max(t.update_done, t.first_dispatch) if c.sync_copy else t.first_dispatch) + c.copy_s
  elif action is Action.DISPATCH_FIRST_STAGED:
    t.first_dispatch = t.host + d


def predict(c: Components, mode: Mode) -> Prediction:
  """The timeline of one boundary in ``mode`` and what it implies for idle and step time.

  Time 0 is the dispatch of step k's last micro-batch; the host has just issued it.
  """
  t = _Timeline(c, c.dispatch_s, [Segment("device", "last micro-batch", 0.0, c.micro_batch_s)])
  for action in boundary_actions(BoundaryPlan.for_mode(0, mode, reason="modelled")):
    if t.first_dispatch is not None:
      break
    _step(t, action, mode)
  first_start = max(t.update_done, t.first_dispatch, t.first_inputs_ready)
  idle = max(0.0, first_start - t.update_done)
  if idle > 0:
    t.segments.append(Segment("device", "idle", t.update_done, first_start))
  t.segments.append(Segment("device", "first micro-batch", first_start, first_start + c.micro_batch_s))
  update_delay = max(0.0, t.update_dispatch - t.last_done)
  # Re-runs of earlier micro-batches sit inside the step; the last one's is already in update_done.
  return Prediction(mode=mode, boundary_idle_s=idle, boundary_idle_strict_s=idle + update_delay,
                    step_s=c.compute_bound_s + idle + update_delay, update_delay_s=update_delay,
                    segments=tuple(t.segments))


def band(prediction_s: float, *, rel: float, abs_s: float) -> tuple[float, float]:
  """An allowed band around a prediction: ± max(rel × value, abs_s), floored at 0."""
  tol = max(rel * prediction_s, abs_s)
  return max(0.0, prediction_s - tol), prediction_s + tol

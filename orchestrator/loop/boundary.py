"""BoundaryState: what the step loop knows about the boundary after one step, filled in as its actions run.

The program opens one per boundary (its plan and action list, from ``policies.call_order``), its actions fill
it in — the stage, the device wait, the metrics, the checkpoint, what the policy judged — and the recorder
turns it into the step's ``BoundaryRecord``. The methods here are the fills that need nothing but the state
and what was measured; the program, which holds the worker, the policy and the agreement, calls them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from orchestrator.contract import RolloutStats, StageReceipt, StepMetrics
from orchestrator.loop.live_waits import SourceFailed
from orchestrator.loop.recorder import Recorder, fwd_bwd_key
from policies import BoundaryPlan, DeviceHeadroom, Observation
from policies.call_order import Action
from policies.units import format_seconds

log = logging.getLogger("step_boundary.program")

#: How long a low-wait stage's update delay waits for the last micro-batch's ready stamp. That micro-batch ran
#: before the update whose metrics were just read, so its stamp comes within the watcher's wake-up; without it
#: the policy states the delay by its bound (the stage's seconds), so a late stamp costs precision, never time.
UPDATE_DELAY_STAMP_WAIT_S = 5.0


def non_finite(metrics: StepMetrics | None) -> bool:
  """Whether the step's loss or gradient norm is a number that is not finite.

  An update the engine skipped (``skip_nonfinite_updates``) is not: it left weights and optimizer state as
  they were, finite, and the run goes on.
  """
  if metrics is None or metrics.skipped_update:
    return False
  return any(x is not None and not math.isfinite(x) for x in (metrics.loss, metrics.grad_norm))


@dataclasses.dataclass(kw_only=True)
class BoundaryState:
  """The boundary after step ``step``, as far as its actions have run.

  Attributes:
    step: the step whose last micro-batch ends at this boundary.
    plan: the policy's plan (None: the run's last step, or a stop's).
    mode: the policy's mode when the boundary was planned (the record's ``mode``).
    actions: what the boundary runs, in order; after a stop or failure while waiting, what did run.
    stop: a stop was asked for: this is the run's last step, checkpointed.
    failed: step k+1's rollouts failed: step k is recorded, then the run raises this failure's error.
    last_dispatched: step k's last micro-batch is dispatched (with one per step, by the boundary before).
    stage: what staging step k+1's first micro-batch did (None: not staged).
    device_wait_s: how long the device still computed after the stage (None: not staged, or not known yet).
    low_wait, transition: what the policy made of the staged boundary (its ``Observation``).
    metrics: step k's metrics, once read.
    checkpoint_path: the checkpoint written after step k (None: none).
    non_finite: step k's loss or gradient norm is not finite: the run ends after its record.
    first_dispatch: when step k+1's first micro-batch was dispatched (``perf_counter`` seconds).
    next_ready: whether step k+1's first micro-batch could exist before the sync (None: the run's last step).
    rollout_wait_s: how long taking step k+1 kept this boundary waiting for its rollouts (a live source).
    rollout: what sampling step k's rollouts measured (a live source).
    per_process: several processes: each one's stage and device wait, in process order.
    headroom: the devices' memory the plan was given (None: not gated).
    observe_after_dispatch: the policy is given the measurements after step k+1's first dispatch, off the
      idle path (an exchange between processes).
    spans: the boundary work's own seconds by name (``metrics_s``, ``checkpoint_s``, the sync's).
  """

  step: int
  plan: BoundaryPlan | None
  mode: str
  actions: tuple[Action, ...]
  stop: bool = False
  failed: SourceFailed | None = None
  last_dispatched: bool = False
  stage: StageReceipt | None = None
  device_wait_s: float | None = None
  low_wait: bool | None = None
  transition: str | None = None
  metrics: StepMetrics | None = None
  checkpoint_path: str | None = None
  non_finite: bool = False
  first_dispatch: float | None = None
  next_ready: bool | None = None
  rollout_wait_s: float | None = None
  rollout: RolloutStats | None = None
  per_process: dict[str, list[Any]] | None = None
  headroom: DeviceHeadroom | None = None
  observe_after_dispatch: bool = False
  spans: dict[str, float] = dataclasses.field(default_factory=dict)

  def metrics_read(self, metrics: StepMetrics, *, started_at: float, ended_at: float, update_ready_at: float
                   ) -> bool:
    """Fills in step k's metrics, read from ``started_at`` to ``ended_at`` behind an update that was done at
    ``update_ready_at``. True where a stage after the update is to be judged now: its device wait is known
    only once the update is."""
    self.metrics = metrics
    # The read's own cost, not the wait for the update in front of it.
    self.spans["metrics_s"] = ended_at - max(started_at, update_ready_at)
    self.spans["metrics_wait_s"] = max(0.0, update_ready_at - started_at)
    self.non_finite = non_finite(metrics)  # the loop ends the run with it (NonFiniteStepError)
    if self.stage is None or self.device_wait_s is not None:
      return False
    # Staged after the update: the device wait is how long the update still ran after the stage.
    self.device_wait_s = max(0.0, update_ready_at - self.stage.ended_at)
    return True

  def measurements(self, recorder: Recorder, micro_batches_per_step: int, threshold_s: float | None
                   ) -> dict[str, float | None]:
    """What this staged boundary measured, for the policy (every process's combined first)."""
    return {"stage_s": self.stage.stage_s, "device_wait_s": self.device_wait_s,
            "update_delay_s": self._update_delay(recorder, micro_batches_per_step, threshold_s),
            "rollout_wait_s": self.rollout_wait_s or 0.0,
            "sampling_on_devices_s": recorder.sampling_on_devices_s(self.step)}

  def judged(self, observation: Observation) -> None:
    """Notes what the policy made of this staged boundary, and logs its ``[boundary]`` line."""
    self.low_wait = observation.low
    self.transition = observation.transition.kind if observation.transition else None
    where = "before" if self.plan.stage_before_update else "after"
    note = " — below the threshold: the stage outlasted the compute" if observation.low else ""
    still = format_seconds(self.device_wait_s, zero="")
    after = f"the device still computed {still} after it" if still else "the device had nothing left to compute"
    log.info("[boundary] step %d STAGED%s %s update in %s; %s%s", self.step, " (re-probe)" if self.plan.probe else "",
             where, format_seconds(self.stage.stage_s), after, note)

  def ended_waiting(self, reason: str, ran: tuple[Action, ...]) -> None:
    """Notes that the boundary ended while it waited for step k+1's rollouts (``reason``: what ended it) after
    running ``ran``: the record says what ran, and why it stopped there."""
    self.actions = ran
    self.plan = self.plan and dataclasses.replace(
        self.plan, reason=f"stopped by {reason} while waiting for step {self.step + 1}'s rollouts")

  def _update_delay(self, recorder: Recorder, micro_batches_per_step: int, threshold_s: float | None
                    ) -> float | None:
    """How long a low-wait stage held the update back (stage end − last micro-batch ready); None otherwise."""
    if threshold_s is None or self.device_wait_s >= threshold_s:
      return None
    last = fwd_bwd_key(self.step, micro_batches_per_step - 1)
    try:
      return max(0.0, self.stage.ended_at - recorder.ready_at(last, timeout_s=UPDATE_DELAY_STAMP_WAIT_S))
    except (KeyError, TimeoutError):
      return None

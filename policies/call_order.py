"""The call order at a step boundary, as one list of actions per plan.

``boundary_actions(plan)`` is the single description of what happens between
step k's last micro-batch and step k+1's first. The program executes the list,
the boundary model (``policies.boundary_model``) times it, and the rig turns it
into the engine calls it expects to see. A new mode is one row of the policy's
mode table plus the actions it takes here. ``docs/design.md`` §5 shows the
lists as a table.

======================  =====================================================================
plan                    actions (k = the step that ends, k+1 = the next)
======================  =====================================================================
OFF (await metrics)     DISPATCH_LAST → UPDATE → METRICS → CHECKPOINT_AND_SYNC → DISPATCH_FIRST
not staged              DISPATCH_LAST → UPDATE → DISPATCH_FIRST → METRICS → CHECKPOINT_AND_SYNC
stage after update      DISPATCH_LAST → UPDATE → STAGE_FIRST → DISPATCH_FIRST_STAGED → METRICS
                        → CHECKPOINT_AND_SYNC
stage before update     DISPATCH_LAST_DEFERRED → STAGE_FIRST → DEFERRED_UPDATE
                        → DISPATCH_FIRST_STAGED → METRICS → CHECKPOINT_AND_SYNC
last step (no plan)     DISPATCH_LAST → UPDATE → METRICS → CHECKPOINT_AND_SYNC
======================  =====================================================================

``sync_before_next_step`` moves CHECKPOINT_AND_SYNC in front of the next
step's first dispatch (for runtimes where a weight transfer would queue behind
that micro-batch); the boundary idle then includes it.

DEFERRED_UPDATE dispatches the owed update before it waits for the last micro-batch to finish (the device
wait the policy judges by), so the update is queued behind that micro-batch as in every other mode: a wait
first would idle the devices while the host noticed the micro-batch had ended and dispatched the update.
"""

from __future__ import annotations

import enum

from policies.step_boundary import BoundaryPlan


class Action(enum.Enum):
  """One thing the program does at a boundary."""

  DISPATCH_LAST = "dispatch last"  # step k's last micro-batch; its update follows separately
  DISPATCH_LAST_DEFERRED = "dispatch last, update deferred"
  STAGE_FIRST = "stage first"  # prepare step k+1's first micro-batch ahead
  DEFERRED_UPDATE = "deferred update, then wait for device"  # the owed update, then the device wait
  UPDATE = "update"  # dispatch step k's update without waiting
  DISPATCH_FIRST = "dispatch first"  # step k+1's first micro-batch, mapped inside the call
  DISPATCH_FIRST_STAGED = "dispatch first (staged)"
  METRICS = "metrics"  # read and log step k's metrics (blocks until update k is done)
  CHECKPOINT_AND_SYNC = "checkpoint and weight sync"  # of step k

  @property
  def dispatches_first(self) -> bool:
    return self in (Action.DISPATCH_FIRST, Action.DISPATCH_FIRST_STAGED)


def boundary_actions(plan: BoundaryPlan | None, *, sync_before_next_step: bool = False) -> tuple[Action, ...]:
  """The ordered actions of the boundary ``plan`` describes (None: the run's last step)."""
  if plan is None:
    return (Action.DISPATCH_LAST, Action.UPDATE, Action.METRICS, Action.CHECKPOINT_AND_SYNC)
  if plan.stage and plan.stage_before_update:
    head = [Action.DISPATCH_LAST_DEFERRED, Action.STAGE_FIRST, Action.DEFERRED_UPDATE]
  elif plan.stage:
    head = [Action.DISPATCH_LAST, Action.UPDATE, Action.STAGE_FIRST]
  else:
    head = [Action.DISPATCH_LAST, Action.UPDATE]
  first = Action.DISPATCH_FIRST_STAGED if plan.stage else Action.DISPATCH_FIRST
  if plan.await_metrics:
    return (*head, Action.METRICS, Action.CHECKPOINT_AND_SYNC, first)
  if sync_before_next_step:
    return (*head, Action.CHECKPOINT_AND_SYNC, first, Action.METRICS)
  return (*head, first, Action.METRICS, Action.CHECKPOINT_AND_SYNC)


#: What each action asks of the engine, in order (the rig checks the engine's call log against it). The deferred
#: update's wait is on the last micro-batch's completion handle, not a call to the engine.
ENGINE_CALLS: dict[Action, tuple[str, ...]] = {
    Action.DISPATCH_LAST: ("fwd_bwd",),
    Action.DISPATCH_LAST_DEFERRED: ("fwd_bwd",),
    Action.STAGE_FIRST: ("prepare",),
    Action.DEFERRED_UPDATE: ("update",),
    Action.UPDATE: ("update",),
    Action.DISPATCH_FIRST: ("fwd_bwd",),
    Action.DISPATCH_FIRST_STAGED: ("fwd_bwd",),
    Action.METRICS: (),
    Action.CHECKPOINT_AND_SYNC: (),
}


def engine_calls_between(actions: tuple[Action, ...]) -> list[str]:
  """The engine calls from just after step k's last ``fwd_bwd`` to just before step k+1's first."""
  calls: list[str] = []
  started = False
  for action in actions:
    if action in (Action.DISPATCH_LAST, Action.DISPATCH_LAST_DEFERRED):
      started = True
      continue
    if action.dispatches_first:
      break
    if started:
      calls += ENGINE_CALLS[action]
  return calls

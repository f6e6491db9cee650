"""BoundaryPlanner: how the step loop plans each boundary before it runs it.

The boundary after step k is planned just before step k's last micro-batch is dispatched (with one micro-batch
per step, inside the boundary before). The planner asks the policy for a ``BoundaryPlan`` with what it plans
by — whether step k+1's rollouts can exist before this boundary's weight sync, the devices' memory headroom,
whether step k+1 is sampled now — and turns the plan into the boundary's action list
(``policies.call_order.boundary_actions``), which the program then runs in order. A stop agreed at this
boundary, or the run's last step, leaves no next step: no plan, the last step's list.
"""

from __future__ import annotations

from orchestrator.loop.boundary import BoundaryState
from orchestrator.loop.feed import StepFeed
from orchestrator.loop.policy_inputs import PolicyInputs
from policies import BoundaryPlan, StepBoundaryPolicy
from policies.call_order import boundary_actions


class BoundaryPlanner:
  """Plans the boundaries of one run.

  Args:
    policy: the run's policy. policy_inputs: what it plans with (the memory headroom).
    feed: the run's ``StepFeed`` (whether the next step can be, or is, sampled).
    config: the loop's ``ProgramConfig`` (steps, the first step, ``sync_before_next_step``).
    first_plan: the plan a resumed run's first boundary was given before the checkpoint (with one micro-batch
      per step it is planned inside the previous boundary), so the policy is not asked twice.
    one_process: the run is one process: only then may a plan depend on this process's sampler
      (``StepFeed.sampled_now``).
  """

  def __init__(self, *, policy: StepBoundaryPolicy, policy_inputs: PolicyInputs, feed: StepFeed, config,
               first_plan: BoundaryPlan | None, one_process: bool):
    self.policy, self.policy_inputs, self.feed, self.config = policy, policy_inputs, feed, config
    self.first_plan, self.one_process = first_plan, one_process

  def plan(self, k: int, *, stop: bool) -> BoundaryState:
    """The boundary after step ``k``, planned (``stop``: a stop was agreed here, so it is the run's last)."""
    has_next = k + 1 < self.config.steps and not stop
    next_ready = self.feed.next_ready(k + 1) if has_next else None
    plan = headroom = None
    if k == self.config.start_step and self.first_plan is not None and not stop:
      plan = self.first_plan
    elif has_next:
      headroom = self.policy_inputs.headroom(k)
      plan = self.policy.plan(k, next_ready=next_ready, headroom=headroom,
                              next_sampled=self.feed.sampled_now(k + 1, next_ready=next_ready,
                                                                 one_process=self.one_process))
    mode = (plan.mode if plan else self.policy.mode).value
    # Rollouts that need this boundary's weights can only be sampled after its sync.
    sync_first = self.config.sync_before_next_step or next_ready is False
    actions = boundary_actions(plan, sync_before_next_step=sync_first)
    return BoundaryState(step=k, plan=plan, mode=mode, actions=actions, stop=stop, next_ready=next_ready,
                         headroom=headroom)

"""The policy's control rows: which boundaries are controls, how they compose with probes, exclusions and the
memory gate, and the measured saving turning staging off (and the re-probe after it)."""

from __future__ import annotations

import logging

import pytest

from policies import BoundaryPlan, DeviceHeadroom, Mode, StepBoundaryPolicy
from policies.saving import MIN_CONTROLS, BoundarySample
from policies.step_boundary import CONTROL_REASON

pytestmark = pytest.mark.spec

STAGED = [Mode.STAGE_AFTER_UPDATE, Mode.STAGE_BEFORE_UPDATE]
FAST, SLOW = BoundarySample(0.0, 1.0), BoundarySample(0.0, 1.2)


def _policy(mode=Mode.STAGE_BEFORE_UPDATE, **kw):
  kw.setdefault("wait_threshold_s", 0.01)
  return StepBoundaryPolicy(mode, **kw)


def _jitter(sample: BoundarySample, step: int) -> BoundarySample:
  return BoundarySample(sample.boundary_idle_s, sample.step_s + 0.001 * (step % 3))


@pytest.mark.parametrize("mode", STAGED)
def test_one_boundary_in_each_k_that_would_stage_runs_pipelined_as_a_control(mode):
  p = _policy(mode, control_every=3)
  plans = [p.plan(s) for s in range(9)]
  assert [s for s, pl in enumerate(plans) if pl.control] == [1, 5, 7]  # one in each of steps 0-2, 3-5, 6-8
  control = plans[1]
  assert control == BoundaryPlan.unstaged(1, mode, reason=CONTROL_REASON, control=True)
  assert (control.stage, control.await_metrics, control.mode) == (False, False, mode)  # PIPELINED's order
  assert p.counters["controls"] == 3 and p.counters["staged_boundaries"] == 6 and p.mode is mode


def test_no_controls_at_zero_and_none_outside_a_staged_mode():
  assert not any(_policy(control_every=0).plan(s).control for s in range(50))
  assert not any(_policy(Mode.PIPELINED, control_every=1).plan(s).control for s in range(5))
  assert not any(_policy(Mode.OFF, control_every=1).plan(s).control for s in range(5))


def test_excluded_gated_and_unready_boundaries_do_not_count_toward_the_next_control():
  p = _policy(control_every=2, excluded_steps=[1])
  short = DeviceHeadroom(free_bytes=0, input_bytes=1 << 20)
  plans = [p.plan(0), p.plan(1), p.plan(2, headroom=short), p.plan(3, next_ready=False), p.plan(4)]
  assert [(pl.stage, pl.control) for pl in plans] == [(True, False), (False, False), (False, False),
                                                      (False, False), (False, True)]


def test_a_probe_is_never_a_control():
  p = _policy(control_every=1, disable_after=1, reprobe_every=2)
  p.observe(0, stage_s=0.1, device_wait_s=0.0)  # staging turns off after step 0 (its plan is not needed)
  probe = p.plan(2)
  assert probe.probe and probe.stage and not probe.control


def _feed(p, samples_by_kind, first_step=0):
  """Plans boundaries from ``first_step`` on and feeds each one's sample (a control's or a staged one's)."""
  step = first_step
  transition = None
  while transition is None and step < first_step + 200 and p.mode.staged:
    plan = p.plan(step)
    sample = samples_by_kind["control" if plan.control else "staged"]
    transition = p.observe_saving(step, _jitter(sample, step), control=plan.control)
    step += 1
  return transition, step


def test_staging_that_costs_time_is_turned_off_once_enough_controls_say_so(caplog):
  p = _policy(control_every=2)
  with caplog.at_level(logging.WARNING, "step_boundary.policy"):
    transition, _ = _feed(p, {"staged": SLOW, "control": FAST})
  assert transition.kind == "saving_disable" and p.mode is Mode.PIPELINED and p.auto_disabled
  assert p.counters["controls"] == MIN_CONTROLS and p.counters["saving_disable"] == 1
  [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert "a step took 200" in warning and "95 % interval" in warning
  assert f"{MIN_CONTROLS} control" in warning and "staging is off for the run" in warning


def test_staging_that_saves_time_stays_on_and_so_does_noise_around_zero():
  saves = _policy(control_every=2)
  assert _feed(saves, {"staged": FAST, "control": SLOW}) == (None, 200)
  noise = _policy(control_every=2)
  assert _feed(noise, {"staged": FAST, "control": FAST}) == (None, 200)
  assert saves.mode is noise.mode is Mode.STAGE_BEFORE_UPDATE
  assert saves.measured_saving.step_s.mean > 0


def test_a_saving_disable_is_reprobed_and_a_good_probe_starts_a_new_window():
  p = _policy(control_every=2, reprobe_every=3)
  transition, _ = _feed(p, {"staged": SLOW, "control": FAST})
  assert "re-probed 3 boundaries later" in transition.reason
  plans = [p.plan(s) for s in range(transition.step + 1, transition.step + 5)]
  assert [pl.probe for pl in plans] == [False, False, True, False]  # 3 boundaries after the disable
  p.observe(plans[2].step, stage_s=0.01, device_wait_s=0.5, probe=True)  # not low: staging back on
  assert p.mode is Mode.STAGE_BEFORE_UPDATE
  assert p.state_dict()["saving_samples"] == {"staged": [], "control": []}  # a new window


def test_samples_outside_a_staged_mode_are_not_kept():
  p = _policy(Mode.PIPELINED)
  assert p.observe_saving(0, SLOW, control=False) is None and p.measured_saving.staged_n == 0


def test_the_samples_and_the_control_count_survive_a_checkpoint():
  p = _policy(control_every=2)
  for step in range(7):
    plan = p.plan(step)
    p.observe_saving(step, _jitter(FAST, step), control=plan.control)
  resumed = _policy(control_every=2)
  resumed.load_state_dict(p.state_dict())
  assert resumed.measured_saving == p.measured_saving
  assert [resumed.plan(s).control for s in range(7, 11)] == [p.plan(s).control for s in range(7, 11)]
  old = p.state_dict()
  del old["saving_samples"]
  old["counters"] = {k: v for k, v in old["counters"].items() if k not in ("controls", "saving_disable")}
  before_controls = _policy(control_every=2)
  before_controls.load_state_dict(old)  # a checkpoint written before controls existed
  assert before_controls.measured_saving.control_n == 0 and before_controls.counters["controls"] == 0

"""StepBoundaryPolicy: every row of the transition table, calibration, and the error texts."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from policies import (MODE_TABLE, BoundaryPlan, DeviceHeadroom, HeadroomRule, LowWaitStreak, MemoryGate, Mode,
                      StagingUnsupportedError, StepBoundaryPolicy, WaitThreshold)
from policies.calibration import CalibrationRule

STAGED = [Mode.STAGE_AFTER_UPDATE, Mode.STAGE_BEFORE_UPDATE]


def _policy(mode=Mode.STAGE_BEFORE_UPDATE, **kw):
  kw.setdefault("wait_threshold_s", 0.01)
  return StepBoundaryPolicy(mode, **kw)


@pytest.mark.e2e
def test_policy_package_does_not_import_jax():
  code = "import sys, policies; assert 'jax' not in sys.modules, 'policies imported jax'; print('ok')"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.spec
@pytest.mark.parametrize(
    "mode,stage,before,await_metrics",
    [
        (Mode.OFF, False, False, True),
        (Mode.PIPELINED, False, False, False),
        (Mode.STAGE_AFTER_UPDATE, True, False, False),
        (Mode.STAGE_BEFORE_UPDATE, True, True, False),
    ],
)
def test_plan_per_mode(mode, stage, before, await_metrics):
  plan = _policy(mode).plan(3)
  assert (plan.step, plan.mode, plan.stage, plan.stage_before_update, plan.await_metrics) == (
      3, mode, stage, before, await_metrics)


@pytest.mark.spec
@pytest.mark.parametrize("mode", STAGED)
def test_unsupported_engine_falls_back_to_pipelined_with_one_warning(mode, caplog):
  with caplog.at_level(logging.WARNING, "step_boundary.policy"):
    p = StepBoundaryPolicy(mode, engine_can_stage=False)
    for step in range(4):
      assert not p.plan(step).stage
  assert p.mode is Mode.PIPELINED and p.requested_mode is mode
  assert [t.kind for t in p.history] == ["unsupported_engine"]
  assert p.counters["unsupported_engine"] == 1
  warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and "lacks prepare_fwd_bwd_input, wait_for_device" in warnings[0].getMessage()


@pytest.mark.spec
@pytest.mark.parametrize("mode", [Mode.OFF, Mode.PIPELINED])
def test_unstaged_modes_ignore_engine_capabilities(mode):
  p = StepBoundaryPolicy(mode, engine_can_stage=False, require_staging=True)
  assert p.mode is mode and p.history == []


@pytest.mark.spec
def test_require_staging_fails_bring_up_with_a_clear_error():
  with pytest.raises(StagingUnsupportedError) as err:
    StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, engine_can_stage=False, require_staging=True)
  text = str(err.value)
  assert "STAGE_BEFORE_UPDATE was required (require_staging)" in text
  assert "lacks prepare_fwd_bwd_input, wait_for_device" in text
  assert "drop require_staging to fall back to PIPELINED" in text


@pytest.mark.spec
def test_calibration_with_a_microsecond_floor():
  p = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE)
  assert p.threshold_s is None
  threshold = p.calibrate([4e-6, 6e-6, 30e-6])
  assert threshold == pytest.approx(30e-6 + 0.002)
  assert p.threshold_s == threshold


@pytest.mark.spec
def test_calibration_with_a_remote_runtime_floor_of_seconds():
  p = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, disable_after=1)
  threshold = p.calibrate([2.7, 2.85, 2.8])
  assert threshold == pytest.approx(2.85 * 1.1)
  # A wait at that floor is low (a fixed 0.05 s threshold would never fire here) ...
  p.observe(0, stage_s=0.1, device_wait_s=2.81)
  assert p.mode is Mode.PIPELINED


@pytest.mark.spec
def test_calibration_at_remote_floor_keeps_real_waits():
  p = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, disable_after=1)
  p.calibrate([2.7, 2.85, 2.8])
  p.observe(0, stage_s=0.1, device_wait_s=7.5)  # the last micro-batch really was still computing
  assert p.mode is Mode.STAGE_BEFORE_UPDATE


@pytest.mark.spec
def test_pinned_threshold_survives_calibration():
  p = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, wait_threshold_s=0.5)
  assert p.calibrate([1e-6]) == 0.5
  assert p.floor_samples == (1e-6,)


@pytest.mark.spec
@pytest.mark.parametrize("samples", [[], [-1.0], [float("nan")], [float("inf")]])
def test_calibration_rejects_bad_samples(samples):
  with pytest.raises(ValueError, match="sample"):
    StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE).calibrate(samples)


@pytest.mark.spec
def test_calibration_rule_is_configurable():
  rule = CalibrationRule(rel_margin=1.0, abs_margin_s=0.0)
  assert StepBoundaryPolicy(Mode.STAGE_AFTER_UPDATE, calibration=rule).calibrate([0.2]) == 0.4


@pytest.mark.spec
def test_without_threshold_waits_are_recorded_not_judged():
  p = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, disable_after=1)
  obs = p.observe(0, stage_s=0.1, device_wait_s=0.0)
  assert obs.low is None and p.mode is Mode.STAGE_BEFORE_UPDATE


@pytest.mark.spec
@pytest.mark.parametrize("mode", STAGED)
def test_auto_disable_after_n_low_waits_in_a_row(mode, caplog):
  p = _policy(mode, disable_after=3)
  with caplog.at_level(logging.WARNING, "step_boundary.policy"):
    for step, wait in enumerate([0.001, 0.002]):
      assert p.observe(step, stage_s=0.3, device_wait_s=wait).transition is None
    assert p.mode is mode
    obs = p.observe(2, stage_s=0.3, device_wait_s=0.003)
  assert obs.transition.kind == "auto_disable" and p.mode is Mode.PIPELINED
  assert not p.plan(3).stage
  assert p.counters["auto_disable"] == 1 and p.counters["stage_outlasted_compute"] == 2
  disable = [r.getMessage() for r in caplog.records if "auto" in r.getMessage() or "in a row" in r.getMessage()]
  assert any("[0.001000, 0.002000, 0.003000]" in m and "0.010000" in m for m in disable)


@pytest.mark.spec
def test_a_low_wait_beside_a_sampling_call_on_the_trainers_devices_is_not_judged():
  """A sampling call on the trainer's devices holds the host or the devices, so the host can reach the wait after
  the micro-batch is done whatever the stage took: such a wait neither grows the low-wait streak nor resets it.
  The same waits without the sampling call turn staging off (the negative control)."""
  p = _policy(disable_after=2)
  for step in range(4):
    obs = p.observe(step, stage_s=0.005, device_wait_s=0.00004, sampling_on_devices_s=0.3)
    assert obs.low is None and obs.transition is None
  assert p.mode is Mode.STAGE_BEFORE_UPDATE and p.counters["sampling_on_devices"] == 4
  assert p.counters["stage_outlasted_compute"] == 0
  p.observe(4, stage_s=0.005, device_wait_s=0.00004)
  p.observe(5, stage_s=0.005, device_wait_s=0.00004, sampling_on_devices_s=0.0)  # none ran: judged
  assert p.mode is Mode.PIPELINED and p.history[-1].kind == "auto_disable"


@pytest.mark.spec
def test_hysteresis_n_minus_one_low_waits_then_a_high_one_resets_the_count():
  p = _policy(disable_after=3)
  waits = [0.001, 0.001, 0.5, 0.001, 0.001, 0.5, 0.001]
  for step, wait in enumerate(waits):
    p.observe(step, stage_s=0.1, device_wait_s=wait)
  assert p.mode is Mode.STAGE_BEFORE_UPDATE and p.history == []
  p.observe(len(waits), stage_s=0.1, device_wait_s=0.001)
  p.observe(len(waits) + 1, stage_s=0.1, device_wait_s=0.001)
  assert p.mode is Mode.PIPELINED


@pytest.mark.spec
def test_a_single_low_wait_is_reported_without_disabling(caplog):
  p = _policy(disable_after=2)
  with caplog.at_level(logging.INFO, "step_boundary.policy"):
    p.observe(5, stage_s=0.25, device_wait_s=0.0001, update_delay_s=0.2)
    p.observe(6, stage_s=0.25, device_wait_s=0.9)
    p.observe(7, stage_s=0.25, device_wait_s=0.0001)
  assert p.mode is Mode.STAGE_BEFORE_UPDATE
  reports = [r for r in caplog.records if "outlasted the last micro-batch" in r.getMessage()]
  assert len(reports) == 2
  assert "delayed the update by about 0.200000 s" in reports[0].getMessage()
  assert "at most 0.250000 s" in reports[1].getMessage()
  # The warning fires once; repeats are informational.
  assert [r.levelno for r in reports] == [logging.WARNING, logging.INFO]


@pytest.mark.spec
def test_wait_exactly_at_threshold_is_not_low():
  p = _policy(disable_after=1)
  p.observe(0, stage_s=0.1, device_wait_s=0.01)
  assert p.mode is Mode.STAGE_BEFORE_UPDATE


@pytest.mark.spec
def test_excluded_boundary_does_not_stage_and_keeps_the_mode():
  p = _policy(excluded_steps=[2, 5])
  plans = [p.plan(s) for s in range(6)]
  assert [pl.stage for pl in plans] == [True, True, False, True, True, False]
  assert plans[2].reason == "boundary excluded by the recipe" and not plans[2].await_metrics
  assert p.mode is Mode.STAGE_BEFORE_UPDATE and p.counters["excluded_boundaries"] == 2


@pytest.mark.spec
def test_observations_in_unstaged_modes_change_nothing():
  p = _policy(Mode.PIPELINED, disable_after=1)
  p.observe(0, stage_s=0.0, device_wait_s=0.0)
  assert p.mode is Mode.PIPELINED and p.history == []


@pytest.mark.spec
def test_reprobe_after_auto_disable_reenables_when_the_wait_is_high():
  p = _policy(disable_after=1, reprobe_every=3)
  p.observe(0, stage_s=0.3, device_wait_s=0.0)
  assert p.mode is Mode.PIPELINED
  assert [p.plan(s).stage for s in (1, 2)] == [False, False]
  probe = p.plan(3)
  assert probe.stage and probe.probe and probe.stage_before_update
  p.observe(3, stage_s=0.01, device_wait_s=0.4, probe=True)
  assert p.mode is Mode.STAGE_BEFORE_UPDATE
  assert [t.kind for t in p.history] == ["auto_disable", "reprobe_enabled"]
  assert p.plan(4).stage and not p.plan(4).probe


@pytest.mark.spec
def test_reprobe_with_a_low_wait_stays_off_for_the_run():
  p = _policy(Mode.STAGE_AFTER_UPDATE, disable_after=1, reprobe_every=2)
  p.observe(0, stage_s=0.3, device_wait_s=0.0)
  probe = p.plan(2)
  assert probe.stage and not probe.stage_before_update
  p.observe(2, stage_s=0.3, device_wait_s=0.0, probe=True)
  assert p.mode is Mode.PIPELINED
  assert not any(p.plan(s).stage for s in range(3, 20))
  assert [t.kind for t in p.history] == ["auto_disable", "reprobe_failed"]
  assert p.counters["probes"] == 1


@pytest.mark.spec
def test_no_reprobe_without_reprobe_every():
  p = _policy(disable_after=1)
  p.observe(0, stage_s=0.3, device_wait_s=0.0)
  assert not any(p.plan(s).stage for s in range(1, 50))


@pytest.mark.spec
def test_no_reprobe_after_unsupported_engine_fallback():
  p = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, engine_can_stage=False, reprobe_every=1)
  assert not any(p.plan(s).stage for s in range(10))


@pytest.mark.spec
@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"disable_after": 0}, "disable_after must be >= 1"),
        ({"reprobe_every": 0}, "reprobe_every must be >= 1"),
        ({"wait_threshold_s": -1.0}, "wait_threshold_s must be a finite number"),
        ({"min_free_device_bytes": -1}, "min_free_device_bytes must be 'auto' or a whole number of bytes >= 0"),
        ({"min_free_device_bytes": "plenty"}, "min_free_device_bytes must be 'auto' or a whole number"),
        ({"min_free_device_bytes": 1.5}, "min_free_device_bytes must be 'auto' or a whole number"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, **kwargs)


@pytest.mark.spec
def test_mode_parse_accepts_names_and_values_and_names_the_choices():
  assert Mode.parse("stage_before_update") is Mode.STAGE_BEFORE_UPDATE
  assert Mode.parse("PIPELINED") is Mode.PIPELINED
  with pytest.raises(ValueError, match="unknown step-boundary mode 'sideways'.*'off'"):
    Mode.parse("sideways")


@pytest.mark.spec
@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.name)
def test_the_policy_plans_each_mode_by_the_one_mode_table(mode):
  """The policy's staged-as-requested plan is the table's row; so is the boundary model's (BoundaryPlan.for_mode)."""
  plan = StepBoundaryPolicy(mode, wait_threshold_s=0.001).plan(0)
  flags = MODE_TABLE[mode]
  assert (plan.stage, plan.stage_before_update, plan.await_metrics) == (
      flags.stage, flags.stage_before_update, flags.await_metrics)
  assert plan == BoundaryPlan.for_mode(0, mode, reason=plan.reason)
  assert mode.staged is flags.stage


@pytest.mark.spec
def test_a_probe_is_pipelined_but_stages_as_the_requested_mode_says():
  plan = BoundaryPlan.for_mode(5, Mode.PIPELINED, staged_as=Mode.STAGE_BEFORE_UPDATE, probe=True, reason="probe")
  assert plan.mode is Mode.PIPELINED and plan.stage and plan.stage_before_update and not plan.await_metrics
  unstaged = BoundaryPlan.unstaged(5, Mode.STAGE_BEFORE_UPDATE, reason="excluded")
  assert not unstaged.stage and not unstaged.await_metrics
  assert BoundaryPlan.unstaged(5, Mode.OFF, reason="off").await_metrics


@pytest.mark.spec
def test_the_policy_reports_without_exposing_its_internals():
  policy = StepBoundaryPolicy(Mode.STAGE_AFTER_UPDATE, disable_after=1)
  policy.calibrate([0.0001, 0.0002])
  policy.plan(0)
  policy.observe(0, stage_s=0.01, device_wait_s=0.0)
  report = policy.report()
  assert report.final_mode is Mode.PIPELINED and report.auto_disables == 1
  assert report.wait_floor_max_s == 0.0002 and report.threshold_s == policy.threshold_s
  assert [t.kind for t in report.transitions] == ["auto_disable"]
  assert report.to_json()["transitions"][0]["to_mode"] == "pipelined"


MiB = 1 << 20
ROOMY, SHORT = DeviceHeadroom(free_bytes=1 << 40, input_bytes=100 * MiB), DeviceHeadroom(free_bytes=150 * MiB,
                                                                                         input_bytes=100 * MiB)


@pytest.mark.spec
def test_the_auto_headroom_is_the_input_plus_ten_percent_at_least_64_mib():
  rule = HeadroomRule()
  assert rule.required_bytes(100 * MiB) == 164 * MiB  # the 64 MiB floor
  assert rule.required_bytes(1000 * MiB) == 1100 * MiB  # 10 %
  assert rule.required_bytes(5, 12345) == 12345  # a number given is the requirement itself


@pytest.mark.spec
@pytest.mark.parametrize("mode", STAGED)
def test_a_boundary_short_of_device_memory_is_pipelined_counted_and_not_judged(mode, caplog):
  p = _policy(mode, disable_after=2)
  with caplog.at_level(logging.INFO, "step_boundary.policy"):
    plans = [p.plan(s, headroom=h) for s, h in enumerate([ROOMY, SHORT, None, SHORT, ROOMY])]
  assert [pl.stage for pl in plans] == [True, False, True, False, True]
  refused = plans[1]
  assert refused.reason.startswith("no_memory_headroom: 150.00 MiB free on the fullest device, below the 164.00 MiB")
  assert (refused.mode, refused.await_metrics) == (mode, False)  # pipelined, the mode unchanged
  assert p.counters["no_memory_headroom"] == 2 and p.counters["staged_boundaries"] == 3
  levels = [r.levelno for r in caplog.records if "no_memory_headroom" in r.getMessage()]
  assert levels == [logging.WARNING, logging.INFO]  # a warning the first time
  # A low wait before the refused boundary and one after it: the refusal is no low wait, and resets nothing.
  p.observe(0, stage_s=0.1, device_wait_s=0.0)
  p.observe(2, stage_s=0.1, device_wait_s=0.0)
  assert [t.kind for t in p.history] == ["auto_disable"]


@pytest.mark.spec
def test_the_memory_gate_takes_a_number_and_turns_off_at_zero():
  fixed = _policy(min_free_device_bytes=200 * MiB)
  assert not fixed.plan(0, headroom=SHORT).stage
  assert fixed.plan(1, headroom=DeviceHeadroom(free_bytes=200 * MiB, input_bytes=100 * MiB)).stage  # enough exactly
  off = _policy(min_free_device_bytes=0)
  assert not off.gates_on_memory and off.plan(0, headroom=DeviceHeadroom(free_bytes=0, input_bytes=MiB)).stage
  assert off.counters["no_memory_headroom"] == 0


@pytest.mark.spec
def test_a_probe_short_of_memory_waits_for_a_boundary_with_room():
  p = _policy(disable_after=1, reprobe_every=1)
  p.observe(0, stage_s=0.3, device_wait_s=0.0)
  assert not p.plan(1, headroom=SHORT).stage and p.counters["probes"] == 0
  probe = p.plan(2, headroom=ROOMY)
  assert probe.stage and probe.probe


@pytest.mark.spec
@pytest.mark.parametrize("mode", [Mode.OFF, Mode.PIPELINED])
def test_unstaged_modes_ignore_the_memory_gate(mode):
  p = _policy(mode)
  assert p.plan(0, headroom=SHORT) == p.plan(0) and p.counters["no_memory_headroom"] == 0


@pytest.mark.spec
def test_a_policy_state_saved_before_the_memory_gate_still_counts_refusals():
  p = _policy()
  state = p.state_dict()
  del state["counters"]["no_memory_headroom"]
  p.load_state_dict(state)
  assert not p.plan(0, headroom=SHORT).stage and p.counters["no_memory_headroom"] == 1


@pytest.mark.spec
@pytest.mark.parametrize("next_sampled", [False, True, None])
def test_a_stage_before_the_update_waits_for_no_rollouts_it_goes_after_the_update_instead(next_sampled):
  """The next step's first micro-batch not sampled yet: staging it before the update would hold the update
  back for the sampler, so that boundary stages after the update; the mode stays, and it is counted."""
  from policies.step_boundary import UPDATE_FIRST_REASON

  policy = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, wait_threshold_s=0.0)
  plan = policy.plan(3, next_sampled=next_sampled)
  assert plan.stage and policy.mode is Mode.STAGE_BEFORE_UPDATE
  assert plan.stage_before_update is (next_sampled is not False)
  assert (plan.reason == UPDATE_FIRST_REASON) is (next_sampled is False)
  assert policy.counters.get("staged_after_update_for_rollouts", 0) == (next_sampled is False)
  after = StepBoundaryPolicy(Mode.STAGE_AFTER_UPDATE, wait_threshold_s=0.0).plan(3, next_sampled=next_sampled)
  assert after.stage and not after.stage_before_update and after.reason != UPDATE_FIRST_REASON


@pytest.mark.spec
def test_the_wait_threshold_judges_nothing_until_calibrated_and_keeps_a_pinned_one():
  calibrated, pinned = WaitThreshold(), WaitThreshold(0.5, CalibrationRule(rel_margin=1.0, abs_margin_s=0.0))
  assert calibrated.is_low(0.0) is None and calibrated.floor_max_s is None
  assert calibrated.calibrate([0.001, 0.003]) == pytest.approx(0.005) and calibrated.floor_max_s == 0.003
  assert calibrated.is_low(0.004) and not calibrated.is_low(0.005)  # at the threshold is not low
  assert pinned.calibrate([0.001]) == 0.5 and pinned.floor_samples == (0.001,) and pinned.is_low(0.4)
  with pytest.raises(ValueError, match="wait_threshold_s must be a finite number >= 0"):
    WaitThreshold(float("inf"))


@pytest.mark.spec
def test_the_low_wait_streak_turns_off_after_n_in_a_row_and_schedules_one_probe():
  streak = LowWaitStreak(disable_after=2, reprobe_every=3)
  assert not streak.extend(0.1) and streak.waits_s == [0.1]
  streak.end()  # a wait that is not low: the streak starts again
  assert not streak.extend(0.2) and streak.extend(0.3)
  assert streak.disable(5) == [0.2, 0.3] and streak.waits_s == [] and streak.disabled_at == 5
  assert [streak.probe_due(step) for step in (6, 7, 8, 9)] == [False, False, True, True]
  streak.probe_used = True
  assert not streak.probe_due(9)  # one probe per auto-disable
  streak.enable()
  assert streak.disabled_at is None and not streak.probe_due(100)
  assert not LowWaitStreak(disable_after=1).probe_due(100)  # never disabled: no probe
  with pytest.raises(ValueError, match="disable_after must be >= 1"):
    LowWaitStreak(disable_after=0)
  with pytest.raises(ValueError, match="reprobe_every must be >= 1 or None"):
    LowWaitStreak(reprobe_every=0)


@pytest.mark.spec
def test_the_memory_gate_refuses_only_a_stage_short_of_room():
  gate = MemoryGate()
  assert gate.refusal(ROOMY) is None and gate.refusal(None) is None
  assert gate.refusal(SHORT).startswith("no_memory_headroom: 150.00 MiB free on the fullest device")
  off = MemoryGate(0)
  assert not off.gates and off.refusal(SHORT) is None
  assert MemoryGate(150 * MiB).refusal(SHORT) is None and MemoryGate(150 * MiB + 1).refusal(SHORT) is not None
  with pytest.raises(ValueError, match="min_free_device_bytes must be 'auto' or a whole number"):
    MemoryGate(-1)


@pytest.mark.spec
def test_a_restored_policy_continues_where_the_saved_one_stopped():
  """Every part's state travels: the threshold and its floor, the streak, the probe schedule, the counters."""
  kw = dict(disable_after=2, reprobe_every=2)
  saved = StepBoundaryPolicy(Mode.STAGE_AFTER_UPDATE, **kw)
  saved.calibrate([0.001])
  for step in (0, 1):
    saved.plan(step)
    saved.observe(step, stage_s=0.01, device_wait_s=0.0)
  restored, fresh = StepBoundaryPolicy(Mode.STAGE_AFTER_UPDATE, **kw), StepBoundaryPolicy(Mode.STAGE_AFTER_UPDATE, **kw)
  restored.load_state_dict(saved.state_dict())
  assert restored.state_dict() == saved.state_dict() and restored.report() == saved.report()
  assert restored.plan(3).probe and saved.plan(3).probe
  assert not fresh.plan(3).probe and fresh.threshold_s is None  # negative control: nothing restored


@pytest.mark.spec
@pytest.mark.parametrize("mode", list(Mode))
def test_a_plan_round_trips_through_its_json_form(mode):
  """What a checkpoint keeps of a boundary planned before it reads back as the same plan, through JSON text."""
  plan = BoundaryPlan.for_mode(7, mode, reason="why", probe=mode.staged)
  data = json.loads(json.dumps(plan.to_json()))
  assert data["mode"] == mode.value
  assert BoundaryPlan.from_json(data) == plan


@pytest.mark.spec
def test_a_plan_of_an_unknown_mode_is_refused():
  """Negative control: a mode no row of the table names does not read back."""
  data = dict(BoundaryPlan.unstaged(2, Mode.PIPELINED, reason="r").to_json(), mode="sideways")
  with pytest.raises(ValueError):
    BoundaryPlan.from_json(data)

"""The summary's closing lines say in words what the scheduler did, why, and what staging saved, measured; a
figure that means "nothing left to wait for" is said in words, not as 0.0 µs."""

from __future__ import annotations

import dataclasses
import types

import pytest

from orchestrator.app import console
from orchestrator.contract import RunSummary, StepTimings
from policies import Mode, PolicyReport
from policies.saving import Interval, SavingEstimate
from policies.step_boundary import COUNTED_EVENTS
from policies.units import format_seconds

pytestmark = pytest.mark.spec

NOT_ENOUGH = SavingEstimate(None, None, staged_n=40, control_n=2)


def _summary(*, mode=Mode.STAGE_BEFORE_UPDATE, steps=51, staged=40, before=37, saving=NOT_ENOUGH, idle_s=0.0,
             **counters) -> RunSummary:
  timings = StepTimings(steps=steps, median_boundary_idle_s=idle_s, median_boundary_idle_strict_s=0.002,
                        median_step_s=0.25, staged_boundaries=staged, staged_before_update=before,
                        measured_saving=saving)
  policy = PolicyReport(requested_mode=mode, final_mode=mode, auto_disables=0, transitions=(),
                        counters=dict(dict.fromkeys(COUNTED_EVENTS, 0), **counters), threshold_s=0.002,
                        wait_floor_max_s=1e-6)
  return RunSummary(timings=timings, policy=policy, final_state_digest="abc")


def test_the_scheduler_line_counts_each_kind_of_boundary_and_says_why():
  line = console.scheduler_line(_summary(staged_after_update_for_rollouts=3, excluded_boundaries=1,
                                         no_memory_headroom=2, controls=2, next_not_ready=0))
  assert line == ("what the scheduler did: of 50 boundaries, 37 staged the next step's first micro-batch before"
                  " the update, 3 after it (3 because the next step's rollouts were not sampled yet); 10 ran"
                  " unstaged (1 for a scored checkpoint, 2 short of device memory, 2 as controls, to measure the"
                  " saving, 5 with staging off)")


def test_a_run_stopped_inside_a_step_counts_its_last_finished_step_s_boundary():
  """Stopped while step 2 waited for a later micro-batch: step 1's boundary staged and dispatched step 2's first
  micro-batch (then dropped), so 2 steps had 2 boundaries; the negative control, without the count, had -1
  boundaries unstaged."""
  stopped = _summary(steps=2, staged=2, before=1, staged_after_update_for_rollouts=1)
  stopped = stopped.replace(timings=dataclasses.replace(stopped.timings, boundaries=2))
  assert console.scheduler_line(stopped) == (
      "what the scheduler did: of 2 boundaries, 1 staged the next step's first micro-batch before the update, 1"
      " after it (1 because the next step's rollouts were not sampled yet); 0 ran unstaged")
  legacy = stopped.replace(timings=dataclasses.replace(stopped.timings, boundaries=None))
  assert "; -1 ran unstaged" in console.scheduler_line(legacy)


def test_a_run_that_never_stages_says_staging_was_off():
  line = console.scheduler_line(_summary(mode=Mode.PIPELINED, staged=0, before=0, saving=None))
  assert line.endswith("0 staged the next step's first micro-batch before the update, 0 after it; 50 ran unstaged"
                       " (staging off)")
  assert console.saving_line(_summary(mode=Mode.PIPELINED, staged=0, before=0, saving=None)) is None


def test_few_controls_say_so_rather_than_give_a_number():
  assert console.saving_line(_summary()) == (
      "measured saving: not enough controls yet (2 of 5, beside 40 staged boundaries; step_boundary.control_every"
      " sets how often)")


@pytest.mark.parametrize("step,verdict,counters", [
    (Interval(0.0012, 0.0004, 0.002), "staging saved time", {}),
    (Interval(-0.21, -0.22, -0.2), "staging cost time", {"saving_disable": 1}),
    (Interval(-0.21, -0.22, -0.2), "staging cost time, though not beyond the policy's stricter looks (design.md"
                                   " §6), so staging stayed on", {}),
    (Interval(0.0001, -0.0003, 0.0005), "no difference beyond the noise", {}),
])
def test_the_saving_line_gives_the_figure_its_interval_and_what_it_means(step, verdict, counters):
  """A cost the policy acted on is said plainly; one it did not (its looks judge at stricter levels) says why
  staging stayed on."""
  saving = SavingEstimate(Interval(0.0, 0.0, 0.0), step, staged_n=40, control_n=6)
  line = console.saving_line(_summary(saving=saving, **counters))
  assert line == (f"measured saving per step: {format_seconds(step.mean)} (95 % interval {format_seconds(step.low)}"
                  f" to {format_seconds(step.high)}): {verdict}; boundary idle saved: none, neither had any; over 40"
                  " staged and 6 control boundaries")


def test_the_summary_says_no_idle_in_words_and_keeps_a_figure_otherwise():
  text = console.format_summary(_summary(idle_s=0.0))
  assert "median boundary idle: none, the device never waited (strict: 2.00 ms)" in text and "0.0 µs" not in text
  assert "what the scheduler did:" in text and "measured saving:" in text
  assert "median boundary idle: 16.00 ms" in console.format_summary(_summary(idle_s=0.016))  # the control


def _record(**fields):
  base = dict(staged=False, stage_before_update=False, control=False, boundary_idle_s=0.001)
  return types.SimpleNamespace(**dict(base, **fields))


@pytest.mark.parametrize("fields,word", [
    ({"staged": True, "stage_before_update": True}, "staged-before-update"),
    ({"staged": True}, "staged-after-update"), ({"control": True}, "control"), ({}, "unstaged"),
    ({"boundary_idle_s": None}, "none"),
])
def test_each_progress_line_says_what_its_boundary_did(fields, word):
  assert console.boundary_word(_record(**fields)) == word


def _device_timings(**fields) -> StepTimings:
  return StepTimings(steps=20, median_boundary_idle_s=0.0, median_boundary_idle_strict_s=0.0, median_step_s=3.3,
                     staged_boundaries=18, **fields)


def test_the_device_line_gives_peak_memory_mfu_and_recompiles_where_known():
  line = console.device_line(_device_timings(peak_device_bytes=12_540_957_696, median_mfu=0.433,
                                             compiles_after_first_step=0))
  assert line == ("devices: peak memory 11.68 GiB on the fullest device; model FLOP utilisation 43.3 % (median"
                  " step; 6 x parameters x positions + attention, over the chips' bf16 peak); nothing compiled after"
                  " the first step")
  recompiled = console.device_line(_device_timings(compiles_after_first_step=2))
  assert recompiled == "devices: 2 programs compiled after the first step (records.jsonl's compiles says when)"


def test_a_cpu_run_that_recompiled_nothing_has_no_device_line():
  assert console.device_line(_device_timings(compiles_after_first_step=0)) is None
  assert console.device_line(_device_timings()) is None


HELD = {"stage_s": 0.0054, "device_wait_s": 0.28, "update_s": 0.0046, "boundary_work_s": 0.0001,
        "control_idle_s": 0.0}


def test_where_staging_made_no_difference_the_closing_lines_say_what_the_boundary_held_and_why():
  """The TPU v5e live run's shape: a 5 ms stage behind 280 ms of queued work, controls that never idled."""
  noise = SavingEstimate(Interval(-0.0008, -0.001, -0.0005), Interval(0.9, -2.8, 4.7), staged_n=107, control_n=6)
  summary = _summary(saving=noise)
  summary = summary.replace(timings=dataclasses.replace(summary.timings, boundary_held=HELD))
  held = console.saving_line(summary).split("\n")[1]
  assert held == ("what the boundary held (medians): a stage of 5.40 ms, an update of 4.60 ms, boundary work of"
                  " 100.0 µs; the device still computed 280.00 ms after a stage; control boundaries idled none: an"
                  " unstaged input's preparation hid behind the device's queued work as well as a staged one's, so"
                  " nothing was left for staging to remove")
  # Controls that idled past the threshold: the parts are said, the conclusion is not drawn.
  idled = summary.replace(timings=dataclasses.replace(summary.timings, boundary_held=dict(HELD, control_idle_s=0.02)))
  assert console.saving_line(idled).endswith("control boundaries idled 20.00 ms")
  # No conclusion where a measurement does not carry it: a device that waited less than the stage took, none
  # measured, no threshold, or an idle saving above zero beyond the noise (staging did remove idle).
  for held, threshold, idle in [(dict(HELD, device_wait_s=0.001), 0.002, noise.boundary_idle_s),
                                (dict(HELD, device_wait_s=None), 0.002, noise.boundary_idle_s),
                                (HELD, None, noise.boundary_idle_s),
                                (HELD, 0.002, Interval(0.003, 0.001, 0.005))]:
    line = console.held_line(held, threshold, idle_saving=idle)
    assert line.startswith("what the boundary held") and "nothing was left" not in line, (held, threshold, idle)
  assert "nothing was left" in console.held_line(HELD, 0.002, idle_saving=noise.boundary_idle_s)
  # A measured saving (or cost) needs no explanation: one line.
  saved = SavingEstimate(Interval(0.01, 0.008, 0.012), Interval(0.01, 0.005, 0.015), staged_n=107, control_n=6)
  assert "\n" not in console.saving_line(summary.replace(
      timings=dataclasses.replace(summary.timings, measured_saving=saved)))


def test_the_recorder_reports_what_the_boundaries_held():
  from orchestrator.loop.recorder import _boundary_held

  def rec(**fields):
    base = dict(staged=True, stage_before_update=True, control=False, stage_s=0.005, device_wait_s=0.3,
                update_s=0.004, metrics_s=0.001,
                checkpoint_s=None, weight_sync_s=0.002, boundary_idle_s=0.0)
    return types.SimpleNamespace(**{**base, **fields})

  records = [rec(), rec(stage_s=0.007, device_wait_s=0.1),
             rec(staged=False, control=True, stage_s=None, device_wait_s=None, boundary_idle_s=0.01),
             # staged after the update: its wait is on the update, not the last micro-batch, and is left out
             rec(stage_before_update=False, stage_s=0.006, device_wait_s=9.0)]
  held = _boundary_held(records)
  assert held["stage_s"] == pytest.approx(0.006) and held["device_wait_s"] == pytest.approx(0.2)
  assert held["boundary_work_s"] == pytest.approx(0.003) and held["control_idle_s"] == pytest.approx(0.01)
  # A step with no part of its boundary work measured (a restored record) counts as unmeasured, not as 0 s.
  unmeasured = dict(metrics_s=None, weight_sync_s=None)
  assert _boundary_held([rec(**unmeasured), rec(**unmeasured), rec()])["boundary_work_s"] == pytest.approx(0.003)
  assert _boundary_held([rec(staged=False)]) is None  # nothing staged: nothing to explain

"""Controls and the measured saving through the program: a fake whose staged boundaries are slower than its
unstaged ones is turned off by the saving, which the wait proxy alone never does (docs/design.md §6)."""

from __future__ import annotations

import logging
import re

import pytest

from orchestrator.loop.program import ProgramConfig, RLProgram
from orchestrator.loop.trainer_worker import TrainerWorker
from policies import Mode, StepBoundaryPolicy
from policies.saving import MIN_CONTROLS
from policies.step_boundary import CONTROL_REASON
from tests.fakes import RecordingEngine, SlowStagingEngine, payload_steps

pytestmark = pytest.mark.spec

STEPS, MICRO = 30, 2
# The fake's stage sleeps this long, its compute takes nothing: a staged boundary is that much slower.
STAGE_S = 0.08


def _no_sync(step, weights):
  """The weight sync of a run with no sampler (the default one copies to host memory with JAX)."""


def _run(engine, *, control_every: int, steps: int = STEPS):
  """A STAGE_BEFORE_UPDATE run whose low-wait threshold (1 ms) lies below the fake's device wait (0.5 s): the
  wait proxy alone never turns staging off."""
  worker = TrainerWorker(engine)
  policy = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, wait_threshold_s=0.001, control_every=control_every)
  program = RLProgram(worker, policy, payload_steps(steps, MICRO),
                      ProgramConfig(steps=steps, micro_batches_per_step=MICRO), weight_sync=_no_sync)
  return program.run(), policy


def test_controls_that_show_staging_costs_time_turn_it_off_with_one_warning(caplog):
  with caplog.at_level(logging.WARNING, logger="step_boundary.policy"):
    # One control in 4: the boundaries around a control stage, so each control sample lacks exactly one stage
    # (at 1 in 2 a neighbour is often a control too, and the samples spread by a whole stage either way).
    result, policy = _run(SlowStagingEngine(STAGE_S), control_every=4, steps=60)
  assert policy.mode is Mode.PIPELINED and policy.counters["saving_disable"] == 1
  [transition] = policy.history
  assert transition.kind == "saving_disable"
  warnings = [r.getMessage() for r in caplog.records if "staging cost time" in r.getMessage()]
  assert len(warnings) == 1 and "95 % interval" in warnings[0]
  assert int(re.search(r"and (\d+) control boundaries", warnings[0]).group(1)) >= MIN_CONTROLS
  # Every control ran PIPELINED's call order. A boundary's sample needs the next step's seconds, so the one
  # after it was planned before the disable; from the next on nothing staged or was a control.
  controls = [r for r in result.records if r.control]
  assert controls and all(not r.staged and r.reason == CONTROL_REASON for r in controls)
  after = [r for r in result.records if r.step > transition.step + 1]
  assert after and not any(r.staged or r.control for r in after)
  saving = result.summary.timings.measured_saving
  assert saving.enough and saving.step_s.below_zero and saving.control_n >= 5
  # The record that completed the deciding sample carries the saving the policy judged by (the dashboards').
  deciding = result.records[transition.step + 1]
  assert deciding.saving_s == pytest.approx(policy.measured_saving.step_s.mean) and deciding.saving_s < 0
  # No figure before MIN_CONTROLS controls have their samples.
  first = next(i for i, r in enumerate(result.records) if r.saving_s is not None)
  assert sum(r.control for r in result.records[:first]) >= MIN_CONTROLS


def test_without_controls_the_wait_proxy_alone_keeps_the_slow_staging_on(caplog):
  with caplog.at_level(logging.WARNING, logger="step_boundary.policy"):
    result, policy = _run(SlowStagingEngine(STAGE_S), control_every=0)
  assert policy.mode is Mode.STAGE_BEFORE_UPDATE and policy.history == []
  assert all(r.staged for r in result.records[:-1]) and not any(r.control for r in result.records)
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
  saving = result.summary.timings.measured_saving
  assert not saving.enough and saving.control_n == 0 and all(r.saving_s is None for r in result.records)


def test_one_boundary_in_each_k_that_would_stage_is_a_control_and_the_run_ends_the_same():
  with_controls, policy = _run(RecordingEngine(), control_every=3, steps=10)
  without, _ = _run(RecordingEngine(), control_every=0, steps=10)
  assert [r.step for r in with_controls.records if r.control] == [1, 5, 7]
  assert policy.counters["controls"] == 3 and policy.counters["staged_boundaries"] == 6
  assert with_controls.summary.final_state_digest == without.summary.final_state_digest


@pytest.mark.parametrize("wait_s,words", [(0.0, "; the device had nothing left to compute"),
                                          (0.5, "; the device still computed 500.00 ms after it")])
def test_the_boundary_line_says_in_words_when_the_device_had_nothing_left(caplog, wait_s, words):
  worker = TrainerWorker(RecordingEngine(wait_s=wait_s))
  policy = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, wait_threshold_s=0.0)
  with caplog.at_level(logging.INFO, logger="step_boundary.program"):
    RLProgram(worker, policy, payload_steps(2, MICRO), ProgramConfig(steps=2, micro_batches_per_step=MICRO),
              weight_sync=_no_sync).run()
  [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[boundary]")]
  assert line.endswith(words) and "0.0 µs" not in line

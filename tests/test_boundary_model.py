"""The boundary model's timeline per mode, and `run_rl simulate`."""

from __future__ import annotations

import pytest

from orchestrator import cli
from policies import Mode
from policies.boundary_model import Components, band, predict

C = Components(micro_batch_s=1.0, prepare_s=0.1, update_s=0.05, boundary_work_s=0.2, dispatch_s=0.001,
               micro_batches_per_step=3)


def test_off_idles_for_boundary_work_and_preparation():
  p = predict(C, Mode.OFF)
  assert p.boundary_idle_s == pytest.approx(0.2 + 0.1 + 0.001)
  assert p.step_s == pytest.approx(C.compute_bound_s + p.boundary_idle_s + p.update_delay_s)


def test_pipelined_maps_the_next_input_while_the_last_micro_batch_runs():
  # update() returns at once, so the next input is mapped (0.1 s) long before the
  # last micro-batch (1 s) and the update finish: no idle.
  assert predict(C, Mode.PIPELINED).boundary_idle_s == 0.0
  assert predict(C, Mode.STAGE_AFTER_UPDATE).boundary_idle_s == 0.0


def test_stage_before_update_hides_preparation_behind_the_last_micro_batch():
  p = predict(C, Mode.STAGE_BEFORE_UPDATE)
  assert p.boundary_idle_s == 0.0
  assert p.step_s == pytest.approx(C.compute_bound_s + p.update_delay_s)


def test_when_update_waits_for_the_last_micro_batch_only_staging_before_hides_the_copy():
  c = Components(micro_batch_s=1.0, prepare_s=0.5, update_s=0.05, boundary_work_s=0.2, dispatch_s=0.0,
                 micro_batches_per_step=3, update_waits_for_last=True)
  before, after, pipelined = (predict(c, m).boundary_idle_s for m in
                              (Mode.STAGE_BEFORE_UPDATE, Mode.STAGE_AFTER_UPDATE, Mode.PIPELINED))
  assert before == 0.0
  assert after == pytest.approx(0.5 - 0.05) and pipelined == pytest.approx(0.5 - 0.05)


def test_a_stage_that_outlasts_the_micro_batch_delays_the_update():
  c = Components(micro_batch_s=0.1, prepare_s=0.3, update_s=0.05, boundary_work_s=0.0, dispatch_s=0.0,
                 micro_batches_per_step=2)
  p = predict(c, Mode.STAGE_BEFORE_UPDATE)
  assert p.update_delay_s == pytest.approx(0.2)
  assert p.step_s == pytest.approx(c.compute_bound_s + 0.2)


def test_wait_floor_is_paid_by_the_deferred_update():
  c = Components(micro_batch_s=1.0, prepare_s=0.1, update_s=0.05, boundary_work_s=0.0, dispatch_s=0.0,
                 wait_floor_s=2.8, micro_batches_per_step=1)
  assert predict(c, Mode.STAGE_BEFORE_UPDATE).update_delay_s == pytest.approx(2.8)


def test_band_is_symmetric_with_a_floor():
  assert band(1.0, rel=0.1, abs_s=0.05) == pytest.approx((0.9, 1.1))
  assert band(0.0, rel=0.5, abs_s=0.002) == (0.0, 0.002)


def test_simulate_prints_every_mode_for_a_production_template(capsys):
  assert cli.main(["simulate", "--recipe", "recipes/prod_moe_128dev.yaml"]) == 0
  out = capsys.readouterr().out
  for mode in Mode:
    assert mode.value in out
  assert "tokens/s/device" in out and "compute-only bound per step" in out


def test_simulate_refuses_a_bad_override(capsys):
  assert cli.main(["simulate", "simulate.micro_batch_s=fast"]) == 2
  assert "simulate.micro_batch_s: expected float" in capsys.readouterr().err

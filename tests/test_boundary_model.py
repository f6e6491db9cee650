"""The boundary model's timeline per mode, and `run_rl simulate`."""

from __future__ import annotations

import pytest

from orchestrator.app import cli
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


def test_a_wait_floor_overlaps_the_remaining_compute():
  """The wait costs max(remaining compute, floor), not their sum: 0.1 s stage + 2.8 s floor vs 1 s compute."""
  c = Components(micro_batch_s=1.0, prepare_s=0.1, update_s=0.05, boundary_work_s=0.0, dispatch_s=0.0,
                 wait_floor_s=2.8, micro_batches_per_step=1)
  assert predict(c, Mode.STAGE_BEFORE_UPDATE).update_delay_s == pytest.approx(0.1 + 2.8 - 1.0)
  short = Components(micro_batch_s=1.0, prepare_s=0.1, update_s=0.05, boundary_work_s=0.0, dispatch_s=0.0,
                     wait_floor_s=0.5, micro_batches_per_step=1)
  assert predict(short, Mode.STAGE_BEFORE_UPDATE).update_delay_s == 0.0  # hidden by the compute


def test_waiting_for_rollouts_delays_whichever_dispatch_or_stage_needs_them():
  c = Components(micro_batch_s=1.0, prepare_s=0.1, update_s=0.05, boundary_work_s=0.0, dispatch_s=0.0,
                 micro_batches_per_step=2, rollout_wait_s=1.5)
  before = predict(c, Mode.STAGE_BEFORE_UPDATE)
  assert before.boundary_idle_s == 0.0 and before.update_delay_s == pytest.approx(1.5 + 0.1 - 1.0)
  assert predict(c, Mode.PIPELINED).boundary_idle_s == pytest.approx(1.5 + 0.1 - 1.05)
  assert predict(Components(**{**c.__dict__, "rollout_wait_s": 0.0}), Mode.PIPELINED).boundary_idle_s == 0.0


def test_a_synchronous_copy_makes_staging_after_the_update_hide_more_than_pipelining():
  c = Components(micro_batch_s=1.0, prepare_s=0.05, update_s=0.3, boundary_work_s=0.0, dispatch_s=0.0,
                 copy_s=0.5, sync_copy=True, micro_batches_per_step=2)
  pipelined, after, before = (predict(c, m).boundary_idle_s for m in
                              (Mode.PIPELINED, Mode.STAGE_AFTER_UPDATE, Mode.STAGE_BEFORE_UPDATE))
  assert pipelined == pytest.approx(0.5)  # the copy waits for the update, then the device waits for the copy
  assert after == 0.0 and before == 0.0  # a staged copy runs beside the last micro-batch and the update
  asynchronous = Components(**{**c.__dict__, "sync_copy": False})
  assert predict(asynchronous, Mode.PIPELINED).boundary_idle_s == 0.0  # an async copy hides the same way


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


def test_simulate_from_a_run_fits_its_components_and_shows_what_it_measured(tmp_path, capsys, monkeypatch):
  from orchestrator import recipe as recipe_lib

  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)
  run = tmp_path / "run"
  assert cli.main(["model=tiny", "rollouts.source=synthetic", "steps=4", "batch.micro_batches_per_step=2",
                   "run.reserve_host_core=false", "--out", str(run)]) == 0
  capsys.readouterr()
  assert cli.main(["simulate", "--from", str(run)]) == 0
  out = capsys.readouterr().out
  lines = {line.split()[0]: line for line in out.splitlines()[3:] if line.strip()}
  assert set(lines) == {m.value for m in Mode}
  assert "%" in lines["stage_before_update"] and lines["off"].rstrip().endswith("-")  # measured only for its mode
  assert lines["stage_before_update"].rstrip().endswith(("yes", "no"))
  assert "2 micro-batches of" in out


def test_simulate_from_a_directory_without_a_run_is_refused(tmp_path, capsys):
  assert cli.main(["simulate", "--from", str(tmp_path)]) == 2
  assert "simulate --from" in capsys.readouterr().err

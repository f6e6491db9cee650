"""The boundary model's timeline per mode, and `run_rl simulate`."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.app import cli, compute_probe
from orchestrator.app.simulate import estimate_from_recipe
from policies import Mode
from policies.boundary_fit import at_own_compute, device_compute, fit
from policies.boundary_model import (Components, Estimate, JobShape, Unknown, band, predict, predict_bounded,
                                     scale)
from tests.conftest import REPO

C = Components(micro_batch_s=1.0, map_s=0.1, update_s=0.05, metrics_s=0.2, dispatch_s=0.001,
               micro_batches_per_step=3)


@pytest.mark.engine
def test_off_idles_for_boundary_work_and_preparation():
  p = predict(C, Mode.OFF)
  assert p.boundary_idle_s == pytest.approx(0.2 + 0.1 + 0.001)
  assert p.step_s == pytest.approx(C.compute_bound_s + p.boundary_idle_s + p.update_delay_s)


@pytest.mark.engine
def test_pipelined_maps_the_next_input_while_the_last_micro_batch_runs():
  # update() returns at once, so the next input is mapped (0.1 s) long before the
  # last micro-batch (1 s) and the update finish: no idle.
  assert predict(C, Mode.PIPELINED).boundary_idle_s == 0.0
  assert predict(C, Mode.STAGE_AFTER_UPDATE).boundary_idle_s == 0.0


@pytest.mark.engine
def test_stage_before_update_hides_preparation_behind_the_last_micro_batch():
  p = predict(C, Mode.STAGE_BEFORE_UPDATE)
  assert p.boundary_idle_s == 0.0
  assert p.step_s == pytest.approx(C.compute_bound_s + p.update_delay_s)


@pytest.mark.engine
def test_when_update_waits_for_the_last_micro_batch_only_staging_before_hides_the_copy():
  c = Components(micro_batch_s=1.0, map_s=0.5, update_s=0.05, metrics_s=0.2, dispatch_s=0.0,
                 micro_batches_per_step=3, update_overlap_share=0.0)
  before, after, pipelined = (predict(c, m).boundary_idle_s for m in
                              (Mode.STAGE_BEFORE_UPDATE, Mode.STAGE_AFTER_UPDATE, Mode.PIPELINED))
  assert before == 0.0
  assert after == pytest.approx(0.5 - 0.05) and pipelined == pytest.approx(0.5 - 0.05)


@pytest.mark.engine
def test_a_stage_that_outlasts_the_micro_batch_delays_the_update():
  c = Components(micro_batch_s=0.1, map_s=0.3, update_s=0.05, metrics_s=0.0, dispatch_s=0.0,
                 micro_batches_per_step=2)
  p = predict(c, Mode.STAGE_BEFORE_UPDATE)
  assert p.update_delay_s == pytest.approx(0.2)
  assert p.step_s == pytest.approx(c.compute_bound_s + 0.2)


@pytest.mark.engine
def test_a_wait_floor_overlaps_the_remaining_compute():
  """The wait costs max(remaining compute, floor), not their sum: 0.1 s stage + 2.8 s floor vs 1 s compute. The
  update, dispatched before the wait, runs at once after the micro-batch; the floor holds the next dispatch."""
  c = Components(micro_batch_s=1.0, map_s=0.1, update_s=0.05, metrics_s=0.0, dispatch_s=0.0,
                 wait_floor_s=2.8, micro_batches_per_step=1)
  p = predict(c, Mode.STAGE_BEFORE_UPDATE)
  assert p.update_delay_s == 0.0
  assert p.boundary_idle_s == pytest.approx(0.1 + 2.8 - 1.0 - 0.05)
  short = Components(micro_batch_s=1.0, map_s=0.1, update_s=0.05, metrics_s=0.0, dispatch_s=0.0,
                     wait_floor_s=0.5, micro_batches_per_step=1)
  assert predict(short, Mode.STAGE_BEFORE_UPDATE).boundary_idle_s == 0.0  # hidden by the compute


@pytest.mark.engine
def test_the_deferred_update_is_queued_behind_the_last_micro_batch():
  """The update goes before the wait, so it starts as the micro-batch ends: no strict idle for its dispatch
  (waiting first would add the dispatch after the micro-batch). Where update() itself waits for the
  micro-batch (a flag read), no second wait follows it, so a large floor costs nothing there."""
  c = Components(micro_batch_s=1.0, map_s=0.1, update_s=0.05, metrics_s=0.0, dispatch_s=0.01,
                 micro_batches_per_step=2)
  p = predict(c, Mode.STAGE_BEFORE_UPDATE)
  assert p.update_delay_s == 0.0 and p.boundary_idle_strict_s == pytest.approx(p.boundary_idle_s)
  flag_read = Components(micro_batch_s=1.0, map_s=0.1, update_s=0.05, metrics_s=0.0, dispatch_s=0.01,
                         wait_floor_s=2.8, update_overlap_share=0.0, micro_batches_per_step=2)
  reads = predict(flag_read, Mode.STAGE_BEFORE_UPDATE)
  assert reads.boundary_idle_s == 0.0 and reads.update_delay_s == pytest.approx(0.01)


@pytest.mark.engine
def test_waiting_for_rollouts_delays_whichever_dispatch_or_stage_needs_them():
  c = Components(micro_batch_s=1.0, map_s=0.1, update_s=0.05, metrics_s=0.0, dispatch_s=0.0,
                 micro_batches_per_step=2, rollout_wait_s=1.5)
  # Not sampled when planned, STAGE_BEFORE_UPDATE stages after the update (stage_order): the device runs the
  # update during the wait instead of idling before it (staged before, the strict idle would be 1.5 + 0.1 - 1.0).
  before = predict(c, Mode.STAGE_BEFORE_UPDATE)
  assert before.update_delay_s == 0.0 and before.boundary_idle_strict_s == pytest.approx(1.5 + 0.1 - 1.05)
  assert predict(c, Mode.PIPELINED).boundary_idle_s == pytest.approx(1.5 + 0.1 - 1.05)
  assert predict(Components(**{**c.__dict__, "rollout_wait_s": 0.0}), Mode.PIPELINED).boundary_idle_s == 0.0


@pytest.mark.engine
def test_a_synchronous_copy_makes_staging_after_the_update_hide_more_than_pipelining():
  c = Components(micro_batch_s=1.0, map_s=0.05, update_s=0.3, metrics_s=0.0, dispatch_s=0.0,
                 copy_s=0.5, sync_copy=True, micro_batches_per_step=2)
  pipelined, after, before = (predict(c, m).boundary_idle_s for m in
                              (Mode.PIPELINED, Mode.STAGE_AFTER_UPDATE, Mode.STAGE_BEFORE_UPDATE))
  assert pipelined == pytest.approx(0.5)  # the copy waits for the update, then the device waits for the copy
  assert after == 0.0 and before == 0.0  # a staged copy runs beside the last micro-batch and the update
  asynchronous = Components(**{**c.__dict__, "sync_copy": False})
  assert predict(asynchronous, Mode.PIPELINED).boundary_idle_s == 0.0  # an async copy hides the same way


@pytest.mark.engine
def test_band_is_symmetric_with_a_floor():
  assert band(1.0, rel=0.1, abs_s=0.05) == pytest.approx((0.9, 1.1))
  assert band(0.0, rel=0.5, abs_s=0.002) == (0.0, 0.002)


@pytest.mark.e2e
def test_simulate_prints_every_mode_for_a_production_template(capsys):
  assert cli.main(["simulate", "--recipe", "recipes/prod_moe_128dev.yaml"]) == 0
  out = capsys.readouterr().out
  for mode in Mode:
    assert mode.value in out
  assert "tokens/s/device" in out and "compute-only bound per step" in out


@pytest.mark.e2e
def test_simulate_refuses_a_bad_override(capsys):
  assert cli.main(["simulate", "simulate.micro_batch_s=fast"]) == 2
  assert "simulate.micro_batch_s: expected float" in capsys.readouterr().err


@pytest.mark.e2e
def test_simulate_from_a_directory_without_a_run_is_refused(tmp_path, capsys):
  assert cli.main(["simulate", "--from", str(tmp_path)]) == 2
  assert "simulate --from" in capsys.readouterr().err


# ------------------------------------------------------------------------ the components that separate modes

@pytest.mark.engine
@pytest.mark.parametrize("copy_s,sync_copy,differ", [(0.0, False, False), (0.0, True, False), (0.4, False, False),
                                                      (0.4, True, True)])
def test_stage_after_update_and_pipelined_differ_exactly_when_a_copy_queues_behind_the_update(copy_s, sync_copy,
                                                                                              differ):
  # dispatch_s 0: the two orders then differ only where the components put the copy.
  c = Components(micro_batch_s=1.0, update_s=0.3, map_s=0.05, copy_s=copy_s, sync_copy=sync_copy, dispatch_s=0.0,
                 micro_batches_per_step=2)
  after, pipelined = predict(c, Mode.STAGE_AFTER_UPDATE), predict(c, Mode.PIPELINED)
  assert (after.boundary_idle_s != pipelined.boundary_idle_s) is differ
  assert (after.step_s != pipelined.step_s) is differ
  if differ:  # the synchronous copy starts when the update ends; the staged one at the stage
    assert pipelined.boundary_idle_s == pytest.approx(copy_s)
    assert after.boundary_idle_s == 0.0


@pytest.mark.engine
def test_when_update_waits_for_the_last_micro_batch_a_staged_copy_still_hides_behind_the_update():
  c = Components(micro_batch_s=1.0, update_s=0.3, map_s=0.05, copy_s=0.4, sync_copy=True, dispatch_s=0.0,
                 micro_batches_per_step=2, update_overlap_share=0.0)
  # update() returns at the end of the last micro-batch: stage + copy (0.45 s) outlast the update (0.3 s).
  after, pipelined = predict(c, Mode.STAGE_AFTER_UPDATE), predict(c, Mode.PIPELINED)
  assert after.boundary_idle_s == pytest.approx(0.05 + 0.4 - 0.3)
  assert pipelined.boundary_idle_s == pytest.approx(0.4)


@pytest.mark.engine
def test_the_update_overlap_share_is_continuous():
  """Staging after update() hides behind what is left of the last micro-batch and the update."""
  idles = []
  for share in (0.0, 0.1, 0.2, 0.5):
    c = Components(micro_batch_s=1.0, update_s=0.05, map_s=0.3, dispatch_s=0.0, micro_batches_per_step=2,
                   update_overlap_share=share)
    idles.append(predict(c, Mode.STAGE_AFTER_UPDATE).boundary_idle_s)
  assert idles == pytest.approx([0.25, 0.15, 0.05, 0.0])


@pytest.mark.engine
def test_gaps_per_dispatch_lengthen_every_mode_by_one_per_micro_batch_after_the_first():
  c = Components(micro_batch_s=1.0, update_s=0.05, map_s=0.1, metrics_s=0.2, dispatch_s=0.0, micro_batches_per_step=4)
  gapped = dataclasses.replace(c, gap_per_dispatch_s=0.01)
  for mode in Mode:
    assert predict(gapped, mode).step_s - predict(c, mode).step_s == pytest.approx(3 * 0.01)


@pytest.mark.engine
def test_each_boundary_work_term_counts_where_its_action_falls():
  c = Components(micro_batch_s=1.0, update_s=0.05, metrics_s=0.01, logging_s=0.02, checkpoint_s=0.04,
                 weight_sync_s=0.08, dispatch_s=0.0, micro_batches_per_step=2)
  assert c.boundary_work_s == pytest.approx(0.15)
  assert predict(c, Mode.OFF).boundary_idle_s == pytest.approx(0.15)
  assert predict(c, Mode.PIPELINED).boundary_idle_s == 0.0  # metrics and sync after the first dispatch
  # Checkpoint and sync in front of the first dispatch: those two count, the metrics read does not.
  assert predict(c, Mode.PIPELINED, sync_before_next_step=True).boundary_idle_s == pytest.approx(0.12)


# ------------------------------------------------------------------------ scaling

SHAPE = JobShape(rows=32, tokens_per_row=64, micro_batches_per_step=3, devices=1, hosts=1, model="tiny")


@pytest.mark.engine
def test_scaling_rules_follow_rows_devices_hosts_and_micro_batches():
  c = Components(micro_batch_s=0.06, update_s=0.004, map_s=0.003, copy_s=0.001, metrics_s=0.001,
                 weight_sync_s=0.002, reruns_per_step=1.5, micro_batches_per_step=3)
  doubled, changes = scale(c, SHAPE, dataclasses.replace(SHAPE, rows=64))
  assert (doubled.micro_batch_s, doubled.map_s, doubled.copy_s) == pytest.approx((0.12, 0.006, 0.002))
  assert (doubled.update_s, doubled.metrics_s, doubled.weight_sync_s) == (0.004, 0.001, 0.002)
  assert {ch.component for ch in changes} == {"micro_batch_s", "map_s", "copy_s"}  # a zero stays zero
  assert all("x2" in ch.rule for ch in changes)
  wide, _ = scale(c, SHAPE, dataclasses.replace(SHAPE, devices=4, hosts=2, micro_batches_per_step=6))
  assert wide.micro_batch_s == pytest.approx(0.015) and wide.update_s == pytest.approx(0.001)
  assert wide.map_s == pytest.approx(0.0015) and wide.weight_sync_s == pytest.approx(0.001)
  assert wide.micro_batches_per_step == 6 and wide.reruns_per_step == pytest.approx(3.0)
  other, changes = scale(c, SHAPE, dataclasses.replace(SHAPE, model="small"))
  assert other.micro_batch_s == c.micro_batch_s and other.update_s == c.update_s
  assert any(ch.component == "micro_batch_s" and ch.rule.startswith("not scaled") for ch in changes)


@pytest.mark.engine
def test_an_unknown_spans_the_predictions_it_allows():
  c = Components(micro_batch_s=1.0, update_s=0.3, map_s=0.05, dispatch_s=0.0, micro_batches_per_step=2)
  est = Estimate(c, {}, (Unknown("copy", "not measured", ({"copy_s": 0.4, "sync_copy": True},)),))
  p = predict_bounded(est, Mode.PIPELINED)
  assert p.point.boundary_idle_s == 0.0 and p.idle_range_s == pytest.approx((0.0, 0.4))
  assert predict_bounded(est, Mode.STAGE_BEFORE_UPDATE).idle_range_s == (0.0, 0.0)
  scaled, _ = est.scaled(SHAPE, dataclasses.replace(SHAPE, rows=64))
  assert scaled.unknowns[0].options[0]["copy_s"] == pytest.approx(0.8)  # the unknown's values scale too


# ------------------------------------------------------------------------ fitting from records

def _record(mode, *, idle, strict=None, stage_s=None, micro=(0.1, 0.1), update_s=0.01, metrics_s=0.002,
            sync_s=0.003, step_s=None, wait=None):
  strict = idle if strict is None else strict
  step = step_s if step_s is not None else sum(micro) + update_s + strict
  return {"mode": mode, "boundary_idle_s": idle, "boundary_idle_strict_s": strict,
          "stage_s": stage_s, "step_s": step, "micro_batch_s": list(micro), "update_s": update_s,
          "metrics_s": metrics_s, "checkpoint_s": None, "weight_sync_s": sync_s, "reruns": 0,
          "rollout_wait_s": wait}


@pytest.mark.engine
def test_an_off_only_fit_keeps_the_serial_cost_and_reports_its_split_unidentified():
  off = [_record("off", idle=0.025) for _ in range(4)]
  est = fit({"off": off}, update_reads_last_flag=False, wait_floor_s=0.0, dispatch_s=0.0).estimate
  # OFF's idle less the metrics read and the weight sync: 20 ms of mapping, copy or logging, never zero.
  c = est.components
  assert c.map_s + c.copy_s + c.logging_s == pytest.approx(0.02)
  assert est.sources["copy_s"] == "unidentified" and {u.name for u in est.unknowns} >= {"map_s + copy_s + logging_s"}
  pipelined = predict_bounded(est, Mode.PIPELINED)
  assert pipelined.idle_range_s[1] > 0  # a synchronous copy of those 20 ms would show
  assert predict_bounded(est, Mode.OFF).point.boundary_idle_s == pytest.approx(0.025)


@pytest.mark.engine
def test_a_staged_arm_identifies_the_mapping_and_a_step_residual_the_gap_per_dispatch():
  off = [_record("off", idle=0.025, step_s=0.235 + 0.004) for _ in range(4)]
  staged = [_record("stage_before_update", idle=0.0, stage_s=0.02, step_s=0.21 + 0.004) for _ in range(4)]
  result = fit({"off": off, "stage_before_update": staged, "pipelined": [_record("pipelined", idle=0.0)] * 3},
               update_reads_last_flag=False, wait_floor_s=0.0, dispatch_s=0.0)
  assert result.used == ("off", "stage_before_update")
  c = result.estimate.components
  assert c.map_s == pytest.approx(0.02) and c.logging_s == pytest.approx(0.0) and c.copy_s == 0.0
  assert c.gap_per_dispatch_s == pytest.approx(0.004)  # 4 ms per step outside the records' parts, 1 gap
  assert result.estimate.unknowns == ()


@pytest.mark.engine
def test_one_micro_batch_per_step_leaves_the_gap_unidentified_and_a_flag_read_shows_in_offs_delay():
  off = [_record("off", idle=0.01, strict=0.012, micro=(0.1,)) for _ in range(3)]
  est = fit({"off": off}, update_reads_last_flag=True, wait_floor_s=0.001, dispatch_s=0.0).estimate
  assert est.sources["gap_per_dispatch_s"] == "unidentified"
  assert est.components.update_overlap_share == 0.0 and est.sources["update_overlap_share"].startswith("fitted")


# ------------------------------------------------------------------------ the recipe's simulate section

def _resolve(path, *overrides):
  return recipe_lib.resolve(REPO / path, overrides=list(overrides), env={})


@pytest.mark.engine
def test_earlier_simulate_keys_still_load_and_a_doubly_spelled_one_is_refused():
  old = _resolve("recipes/default.yaml", "simulate.input_copy_s=0.3", "simulate.update_waits_for_last=true")
  est, _ = estimate_from_recipe(old)
  assert est.components.map_s == 0.3 and est.components.update_overlap_share == 0.0
  assert est.sources["map_s"] == "override (as simulate.input_copy_s)"
  with pytest.raises(recipe_lib.RecipeError, match="simulate.input_copy_s=0.3 and simulate.map_s=0.2 are both set"):
    _resolve("recipes/default.yaml", "simulate.input_copy_s=0.3", "simulate.map_s=0.2")
  with pytest.raises(recipe_lib.RecipeError, match="update_overlap_share=1.5 is out of range"):
    _resolve("recipes/default.yaml", "simulate.update_overlap_share=1.5")


@pytest.mark.engine
def test_the_production_templates_scale_with_rows_and_micro_batches():
  def saving(path, *overrides):
    est, changes = estimate_from_recipe(_resolve(path, *overrides))
    off, before = (predict_bounded(est, m).point.step_s for m in (Mode.OFF, Mode.STAGE_BEFORE_UPDATE))
    return off - before, est, changes

  base, est128, _ = saving("recipes/prod_moe_128dev.yaml")
  wide, est256, changes256 = saving("recipes/prod_moe_256dev.yaml")
  assert est256.components.micro_batches_per_step == 5 and wide != base
  assert any(ch.component == "update_s" for ch in changes256)  # measured on 128 devices, run on 256
  rows2, est_rows2, changes = saving("recipes/prod_moe_128dev.yaml", "batch.rows=128")
  assert est_rows2.components.copy_s == pytest.approx(2 * est128.components.copy_s)
  assert est_rows2.components.micro_batch_s == pytest.approx(2 * est128.components.micro_batch_s)
  assert rows2 > base and {"micro_batch_s", "copy_s", "map_s"} <= {ch.component for ch in changes}
  p = {m: predict_bounded(est128, m).point for m in (Mode.PIPELINED, Mode.STAGE_AFTER_UPDATE)}
  assert p[Mode.PIPELINED].boundary_idle_s > p[Mode.STAGE_AFTER_UPDATE].boundary_idle_s  # a synchronous copy


@pytest.mark.engine
def test_the_production_templates_give_the_copys_share_of_the_step_the_design_reference_measured():
  """Not fitted: the 256-device job's copy is the 128-device one's times the bytes its one feeding host sends
  (128 rows against 64), and staging's saving against PIPELINED is about the copy's share of the step: ~7.2 %
  and ~21.5 % in the reference's measurements."""
  def shares(path):
    est, _ = estimate_from_recipe(_resolve(path))
    p = {m: predict_bounded(est, m).point.step_s for m in (Mode.PIPELINED, Mode.STAGE_BEFORE_UPDATE)}
    return est, (p[Mode.PIPELINED] - p[Mode.STAGE_BEFORE_UPDATE]) / p[Mode.PIPELINED]

  est128, share128 = shares("recipes/prod_moe_128dev.yaml")
  est256, share256 = shares("recipes/prod_moe_256dev.yaml")
  assert est256.components.copy_s == pytest.approx(2 * est128.components.copy_s)
  assert est256.components.map_s == pytest.approx(2 * est128.components.map_s)
  assert abs(share128 - 0.072) <= 0.02 and abs(share256 - 0.215) <= 0.02, (share128, share256)
  # the times were measured with routing replay behind one controller: without them the copy shrinks
  plain, _ = estimate_from_recipe(_resolve("recipes/prod_moe_128dev.yaml", "engine.router_replay=false"))
  assert plain.components.copy_s == pytest.approx(7.7 * 32 / 800)
  per_host, _ = estimate_from_recipe(_resolve("recipes/prod_moe_128dev.yaml", "simulate.single_controller=false"))
  assert per_host.components.copy_s == pytest.approx(7.7 / 16)


@pytest.mark.engine
def test_the_copy_scales_with_the_bytes_each_feeding_host_sends():
  c = Components(micro_batch_s=1.0, update_s=0.1, map_s=0.1, copy_s=0.5)
  ref = JobShape(rows=64, tokens_per_row=1024, micro_batches_per_step=4, devices=128, hosts=16, model="m")
  wide = dataclasses.replace(ref, rows=128, devices=256, hosts=32)
  per_host, _ = scale(c, ref, wide)
  assert per_host.copy_s == pytest.approx(0.5) and per_host.micro_batch_s == pytest.approx(1.0)  # same per host
  one = lambda shape: dataclasses.replace(shape, feeding_hosts=1)
  controller, changes = scale(c, one(ref), one(wide))
  assert controller.copy_s == pytest.approx(1.0) and controller.map_s == pytest.approx(0.2)  # one link: x2
  assert "bytes per token" in {ch.component: ch.rule for ch in changes}["copy_s"]
  routed, _ = scale(c, ref, dataclasses.replace(ref, bytes_per_token=800.0))  # routing ids added to 32 B
  assert routed.copy_s == pytest.approx(0.5 * 25) and routed.micro_batch_s == pytest.approx(1.0)
  assert ref.input_bytes == 64 * 1024 * 32 and ref.input_bytes_per_device == ref.input_bytes / 128


@pytest.mark.engine
def test_a_host_that_runs_ahead_hides_a_copy_longer_than_the_last_micro_batch():
  """A staged copy longer than a micro-batch hides behind the step's queued compute when the host dispatches
  ahead; negative control: with only the last micro-batch queued, the copy's excess is idle."""
  c = Components(micro_batch_s=1.0, update_s=0.05, map_s=0.1, copy_s=1.5, micro_batches_per_step=3,
                 dispatch_s=0.001)
  behind = predict(c, Mode.STAGE_BEFORE_UPDATE)
  ahead = predict(dataclasses.replace(c, host_runs_ahead=True), Mode.STAGE_BEFORE_UPDATE)
  assert behind.boundary_idle_s == pytest.approx(0.1 + 1.5 - 1.0 - 0.05, abs=0.01)
  assert ahead.boundary_idle_s == 0.0
  assert dataclasses.replace(c, host_runs_ahead=True).queued_compute_s == pytest.approx(3 - 2 * 0.101)
  # OFF prepares after the update, and a synchronous copy queues behind it: the queue changes neither.
  for mode, changes in ((Mode.OFF, {}), (Mode.PIPELINED, {"sync_copy": True})):
    assert predict(dataclasses.replace(c, host_runs_ahead=True, **changes), mode).step_s == pytest.approx(
        predict(dataclasses.replace(c, **changes), mode).step_s)


@pytest.mark.engine
def test_a_host_link_gives_the_copy_from_the_bytes_it_carries(capsys):
  est, _ = estimate_from_recipe(_resolve("recipes/prod_moe_128dev.yaml", "simulate.copy_s=0",
                                         "simulate.host_link_gb_s=0.5"))
  assert est.components.copy_s == pytest.approx(64 * 65536 * 800 / 0.5e9)
  assert est.sources["copy_s"].endswith("(as simulate.host_link_gb_s)")
  assert cli.main(["simulate", "--recipe", "recipes/prod_moe_256dev.yaml", "--json"]) == 0
  shown = json.loads(capsys.readouterr().out)["input"]
  assert shown["bytes_per_token"] == 800 and shown["feeding_hosts"] == 1
  assert shown["micro_batch_bytes"] == 128 * 65536 * 800 and shown["link_gb_s"] == pytest.approx(
      64 * 65536 * 800 / 7.7 / 1e9)
  assert cli.main(["simulate", "--recipe", "recipes/default.yaml"]) == 0
  out = capsys.readouterr().out
  assert "32 B per token (input_tokens 4, target_tokens 4," in out and "vs PIPELINED" in out


@pytest.mark.e2e
def test_simulate_json_names_every_component_and_its_source(capsys):
  assert cli.main(["simulate", "--recipe", "recipes/prod_moe_256dev.yaml", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert {r["mode"] for r in out["modes"]} == {m.value for m in Mode}
  assert out["components"]["copy_s"]["source"] == "recipe" and out["components"]["logging_s"]["source"] == "default"
  assert all(set(r) >= {"step_s", "step_range_s", "boundary_idle_s", "boundary_idle_range_s"} for r in out["modes"])
  assert {ch["component"] for ch in out["scaled"]} >= {"update_s"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  run = tmp_path_factory.mktemp("fit") / "run"
  with pytest.MonkeyPatch.context() as mp:
    for name in recipe_lib.ENV_SWITCHES:
      mp.delenv(name, raising=False)
    assert cli.main(["model=tiny", "rollouts.source=synthetic", "steps=4", "batch.micro_batches_per_step=2",
                     "batch.rows=8", "run.reserve_host_core=false", "--out", str(run)]) == 0
  return run


@pytest.mark.e2e
def test_simulate_from_a_run_fits_its_components_and_shows_what_it_measured(tiny_run, capsys):
  capsys.readouterr()
  assert cli.main(["simulate", "--from", str(tiny_run), "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["fitted_on"] and {r["arm"] for r in out["modes"]} >= {m.value for m in Mode}
  measured = [r for r in out["modes"] if "measured" in r]
  assert measured and all(isinstance(r["within"], bool) for r in measured)
  assert all(r["at_own_compute"]["step_s"] > 0 and isinstance(r["at_own_compute"]["within"], bool)
             for r in measured)
  assert out["components"]["micro_batch_s"]["source"] == "fitted"
  for name in ("map_s", "copy_s", "logging_s", "sync_copy", "gap_per_dispatch_s"):
    assert out["components"][name]["source"]  # each says where it came from, unidentified included
  assert cli.main(["simulate", "--from", str(tiny_run)]) == 0
  assert "within (step 5%" in capsys.readouterr().out


@pytest.mark.e2e
def test_simulate_from_a_run_predicts_twice_the_rows_by_the_scaling_rules(tiny_run, capsys, tmp_path):
  """Structure only (speed is never asserted): the prediction at 2R rows is the fit's components scaled by the rules."""
  capsys.readouterr()
  assert cli.main(["simulate", "--from", str(tiny_run), "--json"]) == 0
  fitted = json.loads(capsys.readouterr().out)["components"]
  bigger = tmp_path / "bigger.yaml"
  bigger.write_text("model: tiny\nsteps: 4\nbatch:\n  micro_batches_per_step: 2\n  rows: 16\n")
  assert cli.main(["simulate", "--from", str(tiny_run), "--recipe", str(bigger), "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["components"]["micro_batch_s"]["value"] == pytest.approx(2 * fitted["micro_batch_s"]["value"])
  assert out["components"]["update_s"]["value"] == pytest.approx(fitted["update_s"]["value"])
  rules = {ch["component"]: ch["rule"] for ch in out["scaled"]}
  assert "tokens each device holds" in rules["micro_batch_s"] and "x2" in rules["micro_batch_s"]
  lo, hi = next(r["step_range_s"] for r in out["modes"] if r["mode"] == "stage_before_update")
  assert 0 < lo <= hi


# ------------------------------------------------------------------------ the rollout wait, per mode

# OFF waits 30 ms for rollouts after its boundary work (5 ms) and maps for 20 ms; STAGE_BEFORE_UPDATE asks before
# the update and waits 150 ms, so its update starts 150 + 20 - 100 = 70 ms after the last micro-batch.
OFF_WAIT, STAGED_WAIT = 0.030, 0.150


def _live_arms(off_waits=(OFF_WAIT,) * 4, staged_waits=(STAGED_WAIT,) * 4):
  off = [_record("off", idle=0.005 + w + 0.02, wait=w) for w in off_waits]
  staged = [_record("stage_before_update", idle=0.0, strict=w + 0.02 - 0.1, stage_s=0.02, wait=w)
            for w in staged_waits]
  return {"off": off, "stage_before_update": staged}


def _live_fit(arms):
  return fit(arms, update_reads_last_flag=False, wait_floor_s=0.0, dispatch_s=0.0).estimate


@pytest.mark.engine
def test_each_fitted_mode_waits_its_own_arms_rollout_wait():
  est = _live_fit(_live_arms())
  c = est.components
  assert dict(c.rollout_wait_by_mode) == pytest.approx({"off": OFF_WAIT, "stage_before_update": STAGED_WAIT})
  assert c.map_s == pytest.approx(0.02) and c.logging_s == pytest.approx(0.0)  # OFF's serial cost net of its wait
  off, staged = (predict_bounded(est, m) for m in (Mode.OFF, Mode.STAGE_BEFORE_UPDATE))
  assert off.point.boundary_idle_s == pytest.approx(0.005 + OFF_WAIT + 0.02)  # as the OFF arm measured
  # A staged arm that waited for rollouts staged after the update (stage_order): its wait runs beside the update.
  assert staged.point.update_delay_s == 0.0
  assert staged.point.boundary_idle_s == pytest.approx(STAGED_WAIT + 0.02 - 0.1 - c.update_s)
  waits = {m: [s.end_s - s.start_s for s in predict(c, m).segments if s.name == "rollout wait"]
           for m in (Mode.OFF, Mode.STAGE_BEFORE_UPDATE)}
  assert waits[Mode.OFF] == pytest.approx([OFF_WAIT])
  assert waits[Mode.STAGE_BEFORE_UPDATE] == pytest.approx([STAGED_WAIT])
  assert off.idle_range_s == pytest.approx((off.point.boundary_idle_s,) * 2)  # no unknown moves a fitted mode's wait


@pytest.mark.engine
def test_a_pooled_rollout_wait_mispredicts_both_fitted_modes():
  """Negative control: the same records with one wait for every mode (their median) fail the checks above."""
  arms = _live_arms()
  c = _live_fit(arms).components
  pooled_wait = statistics.median(r["rollout_wait_s"] for rs in arms.values() for r in rs)
  pooled = dataclasses.replace(c, rollout_wait_s=pooled_wait, rollout_wait_by_mode=())
  assert predict(pooled, Mode.OFF).boundary_idle_s != pytest.approx(0.005 + OFF_WAIT + 0.02, abs=0.01)
  assert predict(pooled, Mode.STAGE_BEFORE_UPDATE).boundary_idle_s != pytest.approx(
      STAGED_WAIT + 0.02 - 0.1 - c.update_s, abs=0.01)


@pytest.mark.engine
def test_a_mode_without_an_arm_waits_an_unknown_between_the_fitted_modes():
  est = _live_fit(_live_arms())
  (wait,) = [u for u in est.unknowns if u.name == "rollout_wait_s"]
  assert sorted(o["rollout_wait_s"] for o in wait.options) == pytest.approx([OFF_WAIT, STAGED_WAIT])
  assert "pipelined" in wait.why and est.sources["rollout_wait_s"].startswith("unidentified")
  # PIPELINED asks for the rollouts before the boundary work, as the staged arm did: its point is that wait.
  assert est.components.rollout_wait_s == pytest.approx(STAGED_WAIT)
  p = predict_bounded(est, Mode.PIPELINED)
  # Its first dispatch waits for the rollouts and the mapping; the update is done at 110 ms.
  assert p.point.boundary_idle_s == pytest.approx(STAGED_WAIT + 0.02 - 0.11)
  assert p.idle_range_s == pytest.approx((0.0, STAGED_WAIT + 0.02 - 0.11))  # OFF's 30 ms would hide behind it
  assert p.step_range_s[0] < p.step_range_s[1]


@pytest.mark.engine
def test_one_fitted_mode_leaves_the_others_wait_between_nothing_and_a_step():
  est = _live_fit({"off": _live_arms()["off"]})
  (wait,) = [u for u in est.unknowns if u.name == "rollout_wait_s"]
  step = 0.2 + 0.01 + 0.005 + OFF_WAIT + 0.02
  assert [o["rollout_wait_s"] for o in wait.options] == pytest.approx([0.0, step])
  lo, hi = predict_bounded(est, Mode.STAGE_BEFORE_UPDATE).step_range_s
  assert lo < hi and hi > est.components.compute_bound_s + step - 0.1


@pytest.mark.engine
def test_records_without_a_live_source_wait_for_no_rollouts():
  est = _live_fit({"off": [_record("off", idle=0.025) for _ in range(3)]})
  assert est.components.rollout_wait_s == 0.0 and est.components.rollout_wait_by_mode == ()
  assert est.sources["rollout_wait_s"].startswith("none recorded")
  assert not [u for u in est.unknowns if u.name == "rollout_wait_s"]


@pytest.mark.engine
def test_a_slower_first_micro_batch_is_fitted_apart_and_counted_once_per_step():
  off = [_record("off", idle=0.01, micro=(0.15, 0.1, 0.1)) for _ in range(4)]
  c = fit({"off": off}, update_reads_last_flag=False, wait_floor_s=0.0, dispatch_s=0.0).estimate.components
  assert c.micro_batch_s == pytest.approx(0.1) and c.first_micro_batch_extra_s == pytest.approx(0.05)
  plain = dataclasses.replace(c, first_micro_batch_extra_s=0.0)
  for mode in Mode:
    assert predict(c, mode).step_s - predict(plain, mode).step_s == pytest.approx(0.05)


@pytest.mark.engine
def test_a_faster_first_micro_batch_shortens_the_step_instead_of_counting_as_nothing():
  off = [_record("off", idle=0.01, micro=(0.08, 0.1, 0.1)) for _ in range(4)]
  est = fit({"off": off}, update_reads_last_flag=False, wait_floor_s=0.0, dispatch_s=0.0).estimate
  assert est.components.first_micro_batch_extra_s == pytest.approx(-0.02)
  assert predict(est.components, Mode.OFF).step_s == pytest.approx(off[0]["step_s"])  # as the arm measured


@pytest.mark.engine
def test_an_arm_predicted_at_its_own_compute_keeps_the_fits_boundary_and_drops_the_machines_drift():
  """A PIPELINED arm whose micro-batches ran 20 % slower (another job on the machine) than the fitted arms'."""
  off = [_record("off", idle=0.025) for _ in range(4)]
  staged = [_record("stage_before_update", idle=0.0, stage_s=0.02) for _ in range(4)]
  slow = [_record("pipelined", idle=0.0, micro=(0.12, 0.12), update_s=0.012) for _ in range(4)]
  est = fit({"off": off, "stage_before_update": staged}, update_reads_last_flag=False, wait_floor_s=0.0,
            dispatch_s=0.0).estimate
  measured_step = statistics.median(r["step_s"] for r in slow)
  raw = predict(est.components, Mode.PIPELINED).step_s
  own = predict(at_own_compute(est.components, slow), Mode.PIPELINED)
  assert abs(raw / measured_step - 1) > 0.1  # the raw prediction carries the drift
  assert own.step_s == pytest.approx(measured_step) and own.boundary_idle_s == 0.0
  # Only the compute moves: the boundary components are the fit's.
  kept = {f.name for f in dataclasses.fields(Components)} - set(device_compute(slow))
  assert all(getattr(at_own_compute(est.components, slow), n) == getattr(est.components, n) for n in kept)


# ------------------------------------------------------------------------ the compute probe

@pytest.mark.engine
def test_the_probe_scales_the_fitted_compute_by_its_measured_ratio_not_the_rule():
  fitted = Components(micro_batch_s=0.02, update_s=0.002, rerun_s=0.02, map_s=0.003)
  small = JobShape(rows=16, tokens_per_row=64, micro_batches_per_step=3, devices=1, hosts=1, model="tiny")
  big = dataclasses.replace(small, rows=32)
  scaled, changes = Estimate(fitted, {"micro_batch_s": "fitted"}).scaled(small, big)
  assert scaled.components.micro_batch_s == pytest.approx(0.04)  # the proportional rule: x2
  before = compute_probe.ShapeProbe(rows=16, tokens_per_row=64, micro_batch_s=0.010, update_s=0.001)
  after = compute_probe.ShapeProbe(rows=32, tokens_per_row=64, micro_batch_s=0.033, update_s=0.0015)
  probed, probed_changes = compute_probe.apply_probe(fitted, scaled, changes, small, big, before, after)
  c = probed.components
  assert c.micro_batch_s == pytest.approx(0.066) and c.rerun_s == pytest.approx(0.066)  # 0.02 x 3.3
  assert c.update_s == pytest.approx(0.003) and c.map_s == pytest.approx(0.006)  # map_s keeps its rule
  rules = {ch.component: ch.rule for ch in probed_changes}
  assert "probed" in rules["micro_batch_s"] and "x3.3" in rules["micro_batch_s"]
  assert "instead of compute grows with the tokens each device holds" in rules["micro_batch_s"]
  assert "probed" not in rules["map_s"] and probed.sources["micro_batch_s"] == "fitted, scaled by the probe"


@pytest.mark.engine
def test_the_probe_times_each_jobs_per_device_share_and_refuses_a_batch_the_mesh_does_not_divide():
  shape = JobShape(rows=8, tokens_per_row=256, micro_batches_per_step=2, devices=8, hosts=1, model="tiny",
                   context=4)  # 2 devices split the rows, 4 the tokens
  assert compute_probe.per_device_shape(shape, "the other job") == (4, 64)
  with pytest.raises(ValueError, match="6 rows of 256 tokens per micro-batch, which do not split evenly over 4"):
    compute_probe.per_device_shape(dataclasses.replace(shape, rows=6, context=2), "the other job")


@pytest.mark.engine
def test_the_probe_takes_the_update_to_each_devices_shard_of_the_weights():
  fitted = Components(micro_batch_s=0.02, update_s=0.004)
  one = JobShape(rows=8, tokens_per_row=64, micro_batches_per_step=2, devices=1, hosts=1, model="tiny")
  eight = dataclasses.replace(one, rows=64, devices=8)
  scaled, changes = Estimate(fitted, {}).scaled(one, eight)
  same = compute_probe.ShapeProbe(rows=8, tokens_per_row=64, micro_batch_s=0.01, update_s=0.001)
  probed, _ = compute_probe.apply_probe(fitted, scaled, changes, one, eight, same, same)
  assert probed.components.update_s == pytest.approx(0.004 / 8) and probed.components.micro_batch_s == 0.02


@pytest.mark.engine
def test_a_faster_first_micro_batch_scaled_to_a_shorter_one_never_makes_the_step_shorter_than_its_compute():
  c = Components(micro_batch_s=0.02, first_micro_batch_extra_s=-0.01, update_s=0.001, micro_batches_per_step=2)
  small = JobShape(rows=32, tokens_per_row=64, micro_batches_per_step=2, devices=1, hosts=1, model="tiny")
  scaled, _ = scale(c, small, dataclasses.replace(small, devices=32, rows=32))
  assert scaled.micro_batch_s == pytest.approx(0.02 / 32) and scaled.first_micro_batch_extra_s >= -scaled.micro_batch_s
  one, _ = scale(c, small, dataclasses.replace(small, micro_batches_per_step=1))
  assert one.first_micro_batch_extra_s == 0.0  # inside micro_batch_s at one micro-batch per step


@pytest.mark.e2e
def test_simulate_probe_times_both_shapes_and_cites_them(tiny_run, capsys, tmp_path):
  """Structure only (speed is never asserted): the fitted compute times the probe's ratio, both shapes named."""
  capsys.readouterr()
  assert cli.main(["simulate", "--from", str(tiny_run), "--json"]) == 0
  fitted = json.loads(capsys.readouterr().out)["components"]
  assert cli.main(["simulate", "--from", str(tiny_run), "--recipe", "recipes/default.yaml", "model=tiny",
                   "batch.rows=16", "batch.micro_batches_per_step=2", "--probe", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  run, job = out["probe"]["run"], out["probe"]["job"]
  assert (run["rows"], job["rows"]) == (8, 16) and run["micro_batch_s"] > 0 and job["micro_batch_s"] > 0
  assert out["components"]["micro_batch_s"]["value"] == pytest.approx(
      fitted["micro_batch_s"]["value"] * job["micro_batch_s"] / run["micro_batch_s"])
  assert "probed on one device" in {ch["component"]: ch["rule"] for ch in out["scaled"]}["micro_batch_s"]


@pytest.mark.e2e
def test_simulate_probe_without_a_run_and_another_job_is_refused(capsys):
  assert cli.main(["simulate", "--probe"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "--from RUN_DIR and --recipe" in err


@pytest.mark.engine
def test_a_staged_arm_that_idled_after_staging_behind_the_update_fits_the_hosts_dispatch_seconds():
  """A live arm: the rollouts kept each stage waiting 150 ms, staged after the update; three 2 ms dispatch calls."""
  d, wait, stage = 0.002, 0.150, 0.02
  idle = 3 * d + wait + stage - 0.1 - 0.01  # host's path from the last dispatch less the last micro-batch and update
  staged = [{**_record("stage_before_update", idle=idle, stage_s=stage, wait=wait), "stage_before_update": False}
            for _ in range(4)]
  # OFF: its boundary work (5 ms), its own rollout wait, the mapping and one dispatch.
  off = [_record("off", idle=0.005 + 0.03 + stage + d, wait=0.03) for _ in range(4)]
  est = fit({"off": off, "stage_before_update": staged}, update_reads_last_flag=False, wait_floor_s=0.0).estimate
  assert est.components.dispatch_s == pytest.approx(d) and est.sources["dispatch_s"].startswith("fitted")
  assert predict(est.components, Mode.STAGE_BEFORE_UPDATE).boundary_idle_s == pytest.approx(idle)
  # Negative control: boundaries that staged before the update say nothing of it; the default stays.
  before = [{**r, "stage_before_update": True} for r in staged]
  est = fit({"off": off, "stage_before_update": before}, update_reads_last_flag=False, wait_floor_s=0.0).estimate
  assert est.sources["dispatch_s"] == "default"
  # Negative control: boundary work before the first dispatch (a checkpoint due) is not three dispatch calls.
  synced = [{**r, "actions": ["dispatch last", "update", "stage first", "checkpoint and weight sync",
                              "dispatch first (staged)", "metrics"]} for r in staged]
  est = fit({"off": off, "stage_before_update": synced}, update_reads_last_flag=False, wait_floor_s=0.0).estimate
  assert est.sources["dispatch_s"] == "default"
  # An OFF arm whose update waited for its last micro-batch (share 0) breaks the three-call reading: not fitted.
  delayed = [{**r, "boundary_idle_strict_s": r["boundary_idle_s"] + 0.01} for r in off]
  est = fit({"off": delayed, "stage_before_update": staged}, update_reads_last_flag=False, wait_floor_s=0.0).estimate
  assert est.components.update_overlap_share == 0.0 and est.sources["dispatch_s"] == "default"
  # A rig's calibrated dispatch is kept.
  est = fit({"off": off, "stage_before_update": staged}, update_reads_last_flag=False, wait_floor_s=0.0,
            dispatch_s=0.0004).estimate
  assert est.components.dispatch_s == 0.0004


@pytest.mark.engine
def test_a_stage_slower_than_offs_whole_serial_cost_leaves_off_predicted_as_it_measured():
  """A remote stage waits on the trainer's compute: 30 ms beside it, while OFF's mapping took 20 ms on an idle host."""
  off = [_record("off", idle=0.025) for _ in range(4)]
  staged = [{**_record("stage_before_update", idle=0.0, stage_s=0.03), "stage_before_update": True}
            for _ in range(4)]
  est = fit({"off": off, "stage_before_update": staged}, update_reads_last_flag=False, wait_floor_s=0.0,
            dispatch_s=0.0).estimate
  assert est.components.map_s == pytest.approx(0.02) and "longer than it" in est.sources["map_s"]
  # The same stages on the idle path (staged after the update) are the mapping's cost there: they stand.
  after = [{**r, "stage_before_update": False} for r in staged]
  on_idle_path = fit({"off": off, "stage_before_update": after}, update_reads_last_flag=False, wait_floor_s=0.0,
                     dispatch_s=0.0).estimate
  assert on_idle_path.components.map_s == pytest.approx(0.03)
  assert predict(est.components, Mode.OFF).boundary_idle_s == pytest.approx(0.025)
  assert predict(est.components, Mode.STAGE_BEFORE_UPDATE).boundary_idle_s == 0.0


@pytest.mark.engine
def test_the_probe_counts_the_weights_the_engine_holds():
  import jax  # import here: the rest of this file runs without JAX

  from orchestrator.engine import build_engine
  for preset in ("tiny", "tiny_moe"):
    engine = build_engine(preset, aot=False)
    assert compute_probe.parameter_count(engine.preset) == sum(x.size for x in jax.tree.leaves(engine.export_weights()))


@pytest.mark.e2e
def test_the_probe_refuses_a_model_this_machine_cannot_train_before_building_it(tiny_run, capsys, monkeypatch):
  monkeypatch.setattr(compute_probe, "_memory_here_bytes", lambda: (24 * 2**30, "this machine's available memory"))
  monkeypatch.setattr(compute_probe, "_ShapeUnderTest", lambda *a, **k: pytest.fail("built before refusing"))
  capsys.readouterr()
  assert cli.main(["simulate", "--from", str(tiny_run), "--recipe", "recipes/default.yaml", "model=qwen3_30b_a3b",
                   "batch.rows=8", "--probe"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "qwen3_30b_a3b at 8 x" in err and "GiB to train" in err


@pytest.mark.engine
def test_each_fitted_mode_keeps_its_own_gap_per_dispatch_and_a_mode_without_an_arm_spans_them():
  """A live run: OFF's second micro-batch waited 20 ms for its sampling, STAGE_BEFORE_UPDATE's 5 ms."""
  off = [_record("off", idle=0.025, step_s=0.235 + 0.020) for _ in range(4)]
  staged = [_record("stage_before_update", idle=0.0, stage_s=0.02, step_s=0.21 + 0.005) for _ in range(4)]
  est = fit({"off": off, "stage_before_update": staged}, update_reads_last_flag=False, wait_floor_s=0.0,
            dispatch_s=0.0).estimate
  c = est.components
  assert dict(c.gap_by_mode) == pytest.approx({"off": 0.020, "stage_before_update": 0.005})
  assert predict(c, Mode.OFF).step_s == pytest.approx(0.255)  # each fitted arm as it measured
  assert predict(c, Mode.STAGE_BEFORE_UPDATE).step_s == pytest.approx(0.215)
  (gap,) = [u for u in est.unknowns if u.name == "gap_per_dispatch_s"]
  assert sorted(o["gap_per_dispatch_s"] for o in gap.options) == pytest.approx([0.005, 0.020])
  lo, hi = predict_bounded(est, Mode.PIPELINED).step_range_s
  assert hi - lo == pytest.approx(0.015)
  # Negative control: one pooled gap misses both fitted arms.
  pooled = dataclasses.replace(c, gap_by_mode=())
  assert predict(pooled, Mode.OFF).step_s != pytest.approx(0.255, abs=0.002)
  assert predict(pooled, Mode.STAGE_BEFORE_UPDATE).step_s != pytest.approx(0.215, abs=0.002)


@pytest.mark.e2e
def test_a_runtime_failure_while_probing_is_one_line(tiny_run, capsys, monkeypatch):
  def out_of_memory(*args, **kwargs):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 123 bytes.\nmore detail")

  monkeypatch.setattr(compute_probe._ShapeUnderTest, "time_one_step", out_of_memory)
  capsys.readouterr()
  assert cli.main(["simulate", "--from", str(tiny_run), "--recipe", "recipes/default.yaml", "model=tiny",
                   "batch.rows=16", "--probe"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "probing the run's model failed on this machine (RESOURCE_EXHAUSTED" in err

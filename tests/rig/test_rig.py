"""The reduced rig end to end on the tiny preset, and its negative controls."""

from __future__ import annotations

import ast
import dataclasses
import json

import pytest

from orchestrator import contract
from orchestrator import recipe as recipe_lib
from orchestrator.app import cli
from orchestrator.data.recording import RecordingError, write_recording
from orchestrator.data.synthetic import RolloutShape, generate_groups
from orchestrator.loop.trainer_worker import TrainerWorker
from orchestrator.rig import RigResult, run_rig
from orchestrator.rig.arms import RigError, parse_arms
from orchestrator.rig.checks import CheckKind, cross_arm_checks, prediction_checks
from orchestrator.rig.recording_engine import FORWARDED_PROTOCOLS, CallRecordingEngine, require_snapshots
from orchestrator.rig.remote_host import RigHost
from orchestrator.rig.report import prediction_score, verdict, verdict_line
from tests.conftest import REPO


@pytest.fixture(scope="module")
def rig_inputs(tmp_path_factory):
  root = tmp_path_factory.mktemp("rig")
  shape = RolloutShape(groups=48, generations_per_group=4, prompt_len_median=8, completion_len_median=6,
                       max_tokens=64, vocab_size=512, seed=1)
  write_recording(root / "rec", generate_groups(shape), vocab_size=512, produced_by={"test": True})
  recipe = recipe_lib.resolve(REPO / "recipes" / "replay_small.yaml", overrides=[
      "model=tiny", "steps=4", "batch.micro_batches_per_step=2", "run.reserve_host_core=false",
  ]).recipe
  return recipe, root / "rec", root


def _status(report, name, arm=None):
  return [c["status"] for c in report["checks"] if c["name"] == name and (arm is None or c["arm"] == arm)]


@pytest.fixture(scope="module")
def clean_rig(rig_inputs):
  recipe, rec, root = rig_inputs
  return run_rig(recipe, rec, ["off", "stage_before_update"], root / "clean")


@pytest.mark.engine
def test_rig_end_to_end_two_arms(clean_rig):
  report, out = clean_rig.report, clean_rig.out_dir
  for name in ("report.md", "report.json", "trace.json", "timeline.png", "predictions.json"):
    assert (out / name).is_file(), name
  # Prediction scores depend on this machine's timing; the correctness checks must all pass.
  failed = [c for c in report["checks"] if c["status"] == "fail" and c["kind"] == "correctness"]
  assert failed == [] and clean_rig.exit_code == 0
  # The prediction checks are the ones named prediction_* (the names say the kind to a reader of report.json).
  assert all((c["kind"] == "prediction") == c["name"].startswith("prediction_") for c in report["checks"])
  assert _status(report, "predictions_written_first") == ["pass"]
  assert _status(report, "final_state_identical", "stage_before_update") == ["pass"]
  for arm in ("off", "stage_before_update"):
    for name in ("micro_batches_in_order", "loss_denominators", "update_before_next_step",
                 "stages_where_planned", "no_compile_after_warmup"):
      assert _status(report, name, arm) == ["pass"], (name, arm)
  data = json.loads((out / "report.json").read_text())
  arm = data["arms"][1]
  assert arm["name"] == "stage_before_update" and arm["mode"] == "stage_before_update"
  for key in ("boundary_idle_s", "step_s", "micro_batch_s"):
    assert set(arm[key]) == {"median", "min", "max"}
  for key in ("device_wait_s", "stage_s", "reruns", "final_state_digest"):
    assert key in arm
  assert set(data["verdict"]) == {"pass", "fail", "unscorable"}
  assert data["verdict_line"].startswith("verdict:")
  md = (out / "report.md").read_text()
  assert "## Predictions vs measurements" in md and "## Checks" in md and data["verdict_line"] in md
  # The staged arm's measured saving: 4 steps hold no control yet (one every 20th staged boundary by default).
  assert data["arms"][0]["measured_saving"] is None  # OFF stages nothing
  assert arm["measured_saving"]["control_n"] == 0 and arm["measured_saving"]["step_s"] is None
  assert "| stage_before_update | not enough controls yet (0 of 5) |" in md
  # Every arm again, predicted from components fitted on the OFF arm and the staged arm only.
  fitted = data["fitted_predictions"]
  assert fitted["fitted_on"] == ["off", "stage_before_update"] and "## Predictions from the fit on off" in md
  assert [a["name"] for a in fitted["arms"]] == ["off", "stage_before_update"]
  for a in fitted["arms"]:
    lo, hi = a["step_range_s"]
    assert 0 < lo <= a["step_s"] <= hi and a["measured_step_s"] > 0
    assert a["at_own_compute"]["step_s"] > 0  # the fit's boundary with the arm's own compute, beside it
  assert "at own compute: step" in md


@pytest.mark.engine
def test_predictions_file_was_written_before_the_scored_arms(clean_rig):
  predictions = json.loads((clean_rig.out_dir / "predictions.json").read_text())
  assert [p["name"] for p in predictions["arms"]] == ["off", "stage_before_update"]
  assert predictions["components"]["micro_batch_s"] > 0
  records = json.loads((clean_rig.out_dir / "records.json").read_text())
  assert set(records) == {"off", "stage_before_update"}


@pytest.mark.engine
def test_too_few_boundaries_make_predictions_unscorable_not_failed(clean_rig):
  # 4 steps give 3 boundaries: scorable. The step band needs 3 steps: scorable too.
  statuses = _status(clean_rig.report, "prediction_boundary_idle")
  assert set(statuses) <= {"pass", "fail"}


@pytest.mark.engine
def test_unscorable_with_too_few_boundaries(rig_inputs):
  recipe, rec, root = rig_inputs
  result = run_rig(recipe, rec, ["stage_before_update"], root / "short", steps=2)
  assert _status(result.report, "prediction_boundary_idle") == ["unscorable"]
  assert result.report["predictions_score"]["unscorable"] >= 1


@pytest.mark.engine
def test_a_different_micro_batch_order_is_reported_as_failed(rig_inputs):
  recipe, rec, root = rig_inputs
  result = run_rig(recipe, rec, ["off", "pipelined"], root / "reorder",
                   faults={"pipelined": "reorder_micro_batches"})
  report = result.report
  assert _status(report, "micro_batches_in_order", "pipelined") == ["fail"]
  assert _status(report, "micro_batches_in_order", "off") == ["pass"]
  assert _status(report, "final_state_identical", "pipelined") == ["fail"]
  assert report["verdict"]["fail"] >= 2 and result.exit_code == 1


@pytest.mark.engine
def test_a_skipped_update_is_reported_as_failed(rig_inputs):
  recipe, rec, root = rig_inputs
  result = run_rig(recipe, rec, ["off", "stage_before_update"], root / "skip",
                   faults={"stage_before_update": "skip_update"})
  report = result.report
  assert _status(report, "update_before_next_step", "stage_before_update") == ["fail"]
  assert _status(report, "final_state_identical", "stage_before_update") == ["fail"]


@pytest.mark.engine
def test_arm_names_and_faults_are_checked():
  assert [a.name for a in parse_arms(["off", "stage_before_update", "off"])] == [
      "off", "stage_before_update", "off#2"]
  with pytest.raises(RigError, match="unknown arm 'sideways'"):
    parse_arms(["sideways"])


@pytest.mark.engine
def test_a_recording_too_short_for_the_steps_is_refused_before_a_trainer_is_built(rig_inputs, monkeypatch, tmp_path):
  recipe, rec, _ = rig_inputs
  from orchestrator.rig import rig as rig_module
  monkeypatch.setattr(rig_module, "LocalRigTrainer", lambda recipe: pytest.fail("a trainer was built"))
  with pytest.raises(RecordingError, match="groups.array_record"):
    run_rig(recipe, rec, ["off"], tmp_path / "out", steps=10_000)
  assert not (tmp_path / "out").exists()


@pytest.mark.engine
def test_a_live_recipe_is_replayed_at_the_models_sizes_not_its_tasks(tmp_path):
  """The default recipe samples live, so its own runs fit a micro-batch to the task (32 rows of 17 tokens); the
  rig replays a recording at the model's sizes, the plan packed before the trainer is built included."""
  recipe = recipe_lib.resolve(REPO / "recipes" / "default.yaml",
                              overrides=["batch.rows=32", "run.reserve_host_core=false"]).recipe
  assert recipe.micro_batch_shape()[1] != recipe.model_preset().tokens_per_row  # the two sizes differ
  result = run_rig(recipe, REPO / "recordings" / "rig_small", ["off"], tmp_path / "rig", steps=2)
  assert result.exit_code == 0
  assert {c["status"] for c in result.report["checks"] if c["kind"] == "correctness"} == {"pass"}


def _arm_report(name, *, idle_s, step_s, digest="a" * 64):
  """The parts of an arm's report the cross-arm and prediction checks read."""
  return {"name": name, "boundary_idle_s": {"median": idle_s}, "step_s": {"median": step_s},
          "reruns": [0, 0, 0], "final_state_digest": digest}


def _exit_by_name(checks) -> int:
  """``run_rl rig``'s rule on report.json's checks: a failed check not named prediction_* fails the command."""
  failed = [c for c in (x.to_json() for x in checks)
            if c["status"] == "fail" and not c["name"].startswith("prediction_")]
  return 1 if failed else 0


@pytest.mark.e2e
def test_a_missed_prediction_is_reported_while_a_failed_correctness_check_fails_the_run(tmp_path):
  bands = {"boundary_idle_band_s": (0.0, 0.001), "step_band_s": (0.1, 0.2)}
  reference = _arm_report("off", idle_s=0.0005, step_s=0.15)
  missed = prediction_checks(_arm_report("pipelined", idle_s=0.5, step_s=9.0), bands, n_records=4)
  assert [(c.kind, c.status) for c in missed] == [(CheckKind.PREDICTION, "fail")] * 2
  same = cross_arm_checks(_arm_report("pipelined", idle_s=0.5, step_s=9.0), reference)
  diverged = cross_arm_checks(_arm_report("pipelined", idle_s=0.5, step_s=9.0, digest="b" * 64), reference)
  assert [(c.name, c.kind, c.status) for c in diverged] == [
      ("rerun_counts_equal", CheckKind.CORRECTNESS, "pass"), ("final_state_identical", CheckKind.CORRECTNESS, "fail")]
  for checks, code in ((same + missed, 0), (diverged + missed, 1), (diverged, 1)):
    assert RigResult(tmp_path, {}, [], checks).exit_code == code == _exit_by_name(checks)
  # The verdict counts correctness only; the missed bands are scored apart and change neither it nor the exit.
  assert verdict(diverged + missed) == {"pass": 1, "fail": 1, "unscorable": 0}
  assert verdict(same + missed) == {"pass": 2, "fail": 0, "unscorable": 0}
  assert prediction_score(same + missed) == {"within_band": 0, "scored": 2, "unscorable": 0}
  assert verdict_line(same + missed) == "verdict: 2 passed, 0 failed, 0 unscorable; predictions: 0/2 within band"
  too_few = prediction_checks(_arm_report("pipelined", idle_s=0.5, step_s=9.0), bands, n_records=2)
  assert [c.to_json()["status"] for c in too_few] == ["unscorable"] * 2
  assert RigResult(tmp_path, {}, [], same + too_few).exit_code == 0


class _TrainingOnlyEngine:
  """The methods every engine has, and nothing more (no staging, checkpoints, weights or snapshots)."""

  def fwd_bwd(self, payload_or_prepared, apply_optimizer=False):
    return None

  def update(self):
    return None

  def get_metrics(self):
    return {}


class _StagingEngine(_TrainingOnlyEngine):
  def prepare_fwd_bwd_input(self, payload):
    return payload

  def wait_for_device(self):
    return 0.0


@pytest.mark.engine
def test_the_recording_proxy_can_stage_exactly_when_its_engine_can():
  staging = CallRecordingEngine(_StagingEngine(), {})
  plain = CallRecordingEngine(_TrainingOnlyEngine(), {})
  assert isinstance(staging, contract.StagingEngine) and TrainerWorker(staging).capabilities.can_stage
  assert isinstance(plain, contract.TrainingEngine) and not isinstance(plain, contract.StagingEngine)
  assert contract.missing_methods(plain, contract.StagingEngine) == ("prepare_fwd_bwd_input", "wait_for_device")
  assert not TrainerWorker(plain).capabilities.can_stage
  assert not isinstance(staging, contract.SnapshotEngine)
  staging.prepare_fwd_bwd_input("p")
  staging.fwd_bwd("p")
  staging.wait_for_device()
  assert [kind for kind, _ in staging.events] == ["prepare", "fwd_bwd", "wait"]
  # Each Protocol method is the proxy's own: from Python 3.12, isinstance never reaches __getattr__.
  for protocol in FORWARDED_PROTOCOLS:
    assert contract.missing_methods(CallRecordingEngine, protocol) == (), protocol


@pytest.mark.engine
def test_the_rig_refuses_an_engine_without_snapshots_naming_what_it_lacks():
  with pytest.raises(RigError, match="lacks snapshot, restore"):
    require_snapshots(_StagingEngine())


@pytest.mark.e2e
def test_the_rig_runs_over_a_remote_trainer_with_the_same_verdicts(rig_inputs, clean_rig, capsys):
  """The arms drive a spawned serve-trainer; its host records the calls. A skipped update there still fails."""
  recipe, rec, root = rig_inputs
  remote = dataclasses.replace(recipe, trainer=dataclasses.replace(recipe.trainer, location="remote", spawn=True))
  result = run_rig(remote, rec, ["off", "stage_before_update", "pipelined"], root / "remote",
                   faults={"pipelined": "skip_update"})
  report = result.report
  correctness = [c for c in report["checks"] if c["kind"] == "correctness"]
  assert [c for c in correctness if c["arm"] != "pipelined" and c["status"] != "pass"] == []
  assert _status(report, "update_before_next_step", "pipelined") == ["fail"]
  digests = {a["name"]: a["final_state_digest"] for a in result.arms}
  local = {a["name"]: a["final_state_digest"] for a in clean_rig.arms}
  assert digests["off"] == digests["stage_before_update"] == local["off"]
  assert digests["pipelined"] != local["off"]
  # The fit of that run's records: every arm, with the tolerances it is judged by.
  assert cli.main(["simulate", "--from", str(root / "remote")]) == 0
  out = capsys.readouterr().out
  assert "within (step 5%" in out and "fitted on off, stage_before_update" in out
  assert {"off", "stage_before_update", "pipelined"} <= {line.split()[0] for line in out.splitlines() if line.strip()}
  # The rig keeps its recipe: the fit can be taken to another job (here, twice the rows per micro-batch).
  assert cli.main(["simulate", "--from", str(root / "remote"), "--json", "--recipe",
                   str(REPO / "recipes" / "replay_small.yaml"), "model=tiny", "batch.micro_batches_per_step=2",
                   f"batch.rows={2 * recipe.batch.rows}" if recipe.batch.rows else "batch.rows=64"]) == 0
  assert json.loads(capsys.readouterr().out)["fitted_on"] == ["off", "stage_before_update"]


@pytest.mark.e2e
def test_the_remote_package_imports_nothing_from_the_rig():
  """The server is handed the rig's host (``run_rl serve-trainer`` passes ``RigHost``); it never imports the rig."""
  for path in sorted((REPO / "orchestrator" / "remote").rglob("*.py")):
    tree = ast.parse(path.read_text())
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in modules if m.startswith("orchestrator.rig")], path.name


class _MidStepEngine:
  """Snapshots refuse while micro-batches are accumulated, as the JAX engine's do."""

  def snapshot(self):
    raise RuntimeError("snapshot with 1 micro-batch(es) accumulated; take it at a step boundary")

  def restore(self, snapshot):
    pass

  def wait_for_device(self):
    return 0.0


@pytest.mark.engine
def test_the_trainer_side_rig_host_reports_misuse_as_misuse():
  """A driver's out-of-order rig calls are WorkerUsageError (FAILED_PRECONDITION), an unknown fault is refused."""
  host = RigHost(_MidStepEngine())
  with pytest.raises(ValueError, match="rig fault 'bogus' is none of reorder_micro_batches, skip_update"):
    host.begin_arm("bogus")
  with pytest.raises(contract.WorkerUsageError, match="rig_begin_arm: snapshot with 1 micro-batch"):
    host.begin_arm(None)
  with pytest.raises(contract.WorkerUsageError, match="rig_end_arm without rig_begin_arm"):
    host.end_arm()

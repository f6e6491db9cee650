"""run_rl: precedence of every source, boolean spellings, refusals, --print-config, an end-to-end run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from orchestrator.app import cli
from orchestrator import recipe as recipe_lib
from policies import Mode
from tests.conftest import REPO

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def resolve(argv, env=None):
  args = cli.make_parser().parse_intermixed_args(argv)
  return cli.resolve_from_args(args, env=env or {})


def write(tmp_path, text, name="r.yaml"):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(recipe):
  resolved = resolve(["--recipe", str(recipe)])
  assert resolved.recipe.name == recipe.stem


@pytest.mark.parametrize(
    "pipeline,staging,before,mode",
    [
        (False, None, False, Mode.OFF),
        (True, False, True, Mode.PIPELINED),
        (True, None, True, Mode.STAGE_BEFORE_UPDATE),
        (True, True, False, Mode.STAGE_AFTER_UPDATE),
        (True, None, False, Mode.STAGE_AFTER_UPDATE),
    ],
)
def test_switches_map_to_policy_modes(pipeline, staging, before, mode):
  argv = ["--pipeline_step_boundary" if pipeline else "--no-pipeline_step_boundary"]
  if staging is not None:
    argv.append("--stage_next_microbatch" if staging else "--no-stage_next_microbatch")
  argv.append("--stage_before_update" if before else "--no-stage_before_update")
  assert resolve(argv).recipe.mode is mode


def test_a_stage_asked_for_while_pipelining_is_off_is_refused_not_ignored():
  with pytest.raises(recipe_lib.RecipeError, match="has no effect with step_boundary.pipeline_step_boundary=false"):
    resolve(["--no-pipeline_step_boundary", "--stage_before_update"])
  with pytest.raises(recipe_lib.RecipeError, match=r"\(env STAGE_BEFORE_UPDATE\) has no effect"):
    resolve(["--no-pipeline_step_boundary"], env={"STAGE_BEFORE_UPDATE": "1"})
  assert resolve(["--no-pipeline_step_boundary"]).recipe.mode is Mode.OFF  # the recipe's own value is fine


def test_precedence_recipe_then_env_then_flags_then_overrides(tmp_path):
  path = write(tmp_path, "model: tiny\nsteps: 3\nstep_boundary:\n  stage_before_update: true\n")
  key = "step_boundary.stage_before_update"
  r = resolve(["--recipe", path])
  assert (r.recipe.step_boundary.stage_before_update, r.sources[key]) == (True, "recipe")
  r = resolve(["--recipe", path], env={"STAGE_BEFORE_UPDATE": "false"})
  assert (r.recipe.step_boundary.stage_before_update, r.sources[key]) == (False, "env STAGE_BEFORE_UPDATE")
  r = resolve(["--recipe", path, "--stage_before_update"], env={"STAGE_BEFORE_UPDATE": "false"})
  assert (r.recipe.step_boundary.stage_before_update, r.sources[key]) == (True, "flag --stage_before_update")
  r = resolve(["--recipe", path, "--stage_before_update", f"{key}=no"], env={"STAGE_BEFORE_UPDATE": "0"})
  assert (r.recipe.step_boundary.stage_before_update, r.sources[key]) == (False, "override")
  assert r.sources["steps"] == "recipe" and r.sources["engine.seed"] == "default"


@pytest.mark.parametrize("spelling,value", [
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("Yes", True),
    ("false", False), ("False", False), ("0", False), ("no", False), ("NO", False),
])
def test_boolean_spellings_in_env_and_overrides(spelling, value):
  r = resolve([], env={"PIPELINE_STEP_BOUNDARY": spelling})
  assert r.recipe.step_boundary.pipeline_step_boundary is value
  r = resolve([f"step_boundary.require_staging={spelling}"])
  assert r.recipe.step_boundary.require_staging is value


@pytest.mark.parametrize("env_value", ["-1", "-1.0", " -1 "])
def test_ragged_buffer_factor_minus_one_spellings_are_the_same(env_value):
  r = resolve([], env={"RAGGED_BUFFER_FACTOR": env_value})
  assert r.recipe.engine.ragged_buffer_factor == -1.0
  assert resolve([f"engine.ragged_buffer_factor={env_value.strip()}"]).recipe.engine.ragged_buffer_factor == -1.0


def test_env_switches_each_reach_their_key():
  env = {"PIPELINE_STEP_BOUNDARY": "1", "STAGE_NEXT_MICROBATCH": "0", "STAGE_BEFORE_UPDATE": "0",
         "RAGGED_BUFFER_FACTOR": "1.5"}
  r = resolve([], env=env)
  assert r.recipe.mode is Mode.PIPELINED and r.recipe.engine.ragged_buffer_factor == 1.5
  for name, key in recipe_lib.ENV_SWITCHES.items():
    if name in env:
      assert r.sources[key] == f"env {name}"


def _main(argv, capsys, env=None):
  old = dict(os.environ)
  try:
    for name in recipe_lib.ENV_SWITCHES:
      os.environ.pop(name, None)
    os.environ.update(env or {})
    code = cli.main(argv)
  finally:
    os.environ.clear()
    os.environ.update(old)
  out = capsys.readouterr()
  return code, out.out, out.err


@pytest.mark.parametrize(
    "argv,env,message",
    [
        (["--no-pipeline_step_boundary", "--stage_next_microbatch"], {},
         "stage_next_microbatch=true needs step_boundary.pipeline_step_boundary=true"),
        (["engine.learnin_rate=1"], {}, "unknown key 'engine.learnin_rate'; did you mean 'engine.learning_rate'?"),
        (["steps=three"], {}, "steps: expected int, got 'three'"),
        (["steps=2.5"], {}, "steps: expected a whole number"),
        (["steps=0"], {}, "steps=0 is out of range: it must be >= 1"),
        (["engine.ragged_buffer_factor=0"], {}, "engine.ragged_buffer_factor=0.0 is out of range: use -1"),
        (["engine.ragged_buffer_factor=-2"], {}, "engine.ragged_buffer_factor=-2.0 is out of range"),
        (["--recipe", "no/such/recipe.yaml"], {}, "recipe no/such/recipe.yaml does not exist"),
        (["--no-stage_next_microbatch", "--require_staging"], {}, "require_staging=true but staging is off"),
        (["engine.retry_when_tokens_dropped=true"], {}, "needs an MoE model, but 'tiny' is dense"),
        (["mesh.fsdp=3"], {}, "does not split over mesh.fsdp×mesh.expert=3"),
        (["model=huge"], {}, "model.preset='huge' is not a preset; available:"),
        (["notakeyvalue"], {}, "override 'notakeyvalue' is not key=value"),
        (["--steps", "x"], {}, "argument --steps: invalid int value"),
        ([], {"PIPELINE_STEP_BOUNDARY": "maybe"}, "environment PIPELINE_STEP_BOUNDARY='maybe'"),
        (["engine.backend=torch"], {}, "engine.backend='torch' is not a backend; use one of ['jax', 'tunix_peft']"),
        (["engine.backend=tunix_peft", "mesh.fsdp=2", "rollouts.source=synthetic"], {}, "engine.backend=tunix_peft runs on one device"),
        (["engine.backend=tunix_peft", "model=tiny_moe"], {}, "engine.backend=tunix_peft trains dense models only"),
        (["steps=inf"], {}, "steps: expected a finite number, got 'inf'"),
        (["engine.learning_rate=nan"], {}, "engine.learning_rate: expected a finite number"),
        (["steps=1e400"], {}, "steps: expected a finite number, got '1e400'"),
    ],
    ids=["staging-without-pipeline", "unknown-key", "wrong-type", "not-whole", "out-of-range",
         "factor-zero", "factor-negative", "missing-recipe", "require-staging-off", "retry-dense",
         "mesh-split", "unknown-preset", "bad-override", "bad-flag", "bad-env",
         "unknown-backend", "tunix-mesh", "tunix-moe", "steps-inf", "lr-nan",
         "steps-overflow"],
)
def test_refusals_exit_2_with_one_clear_message(argv, env, message, capsys):
  code, out, err = _main(argv, capsys, env)
  assert code == 2
  assert message in err
  assert "Traceback" not in err and err.count("run_rl: error:") == 1


def test_unknown_recipe_key_is_refused_with_a_suggestion(tmp_path, capsys):
  path = write(tmp_path, "step_boundary:\n  stage_befor_update: true\n")
  code, _, err = _main(["--recipe", path], capsys)
  assert code == 2 and "unknown key 'step_boundary.stage_befor_update'; did you mean 'step_boundary.stage_before_update'?" in err


def test_invalid_yaml_names_line_and_column(tmp_path, capsys):
  path = write(tmp_path, "model: tiny\nsteps: [1, 2\nname: x\n")
  code, _, err = _main(["--recipe", path], capsys)
  assert code == 2 and "is not valid YAML at line 3, column" in err


def test_duplicate_recipe_keys_are_refused(tmp_path, capsys):
  path = write(tmp_path, "model: tiny\nsteps: 2\nsteps: 3\n")
  code, _, err = _main(["--recipe", path], capsys)
  assert code == 2 and "key 'steps' appears twice (first on line 2); keep one" in err
  assert "Traceback" not in err


def test_recipe_path_that_is_a_directory_is_named_as_such(tmp_path, capsys):
  code, _, err = _main(["--recipe", str(tmp_path)], capsys)
  assert code == 2 and "is a directory; pass a recipe YAML file" in err


def test_wrong_type_in_recipe_is_refused(tmp_path, capsys):
  path = write(tmp_path, "step_boundary:\n  disable_after: often\n")
  code, _, err = _main(["--recipe", path], capsys)
  assert code == 2 and "step_boundary.disable_after: expected int, got 'often'" in err


def test_print_config_shows_every_key_and_its_source(capsys):
  code, out, _ = _main(["--print-config", "--steps", "4", "engine.seed=3"], capsys,
                       env={"STAGE_BEFORE_UPDATE": "no"})
  assert code == 0
  lines = {line.split()[0]: line for line in out.splitlines() if not line.startswith("#")}
  assert set(lines) == set(recipe_lib.all_keys())
  assert lines["steps"].split()[1] == "4" and lines["steps"].endswith("# flag --steps")
  assert lines["engine.seed"].endswith("# override")
  assert lines["step_boundary.stage_before_update"].endswith("# env STAGE_BEFORE_UPDATE")
  assert lines["model.preset"].endswith("# recipe") and lines["engine.weight_decay"].endswith("# default")
  assert "# mode: STAGE_AFTER_UPDATE" in out


def test_failure_during_the_run_exits_1_naming_the_step(tmp_path, capsys, monkeypatch):
  from orchestrator.app import runner

  class Boom:
    current_step = 2

    def run(self):
      (tmp_path / "out" / "records.jsonl").write_text('{"step": 0}\n')
      raise RuntimeError("device lost")

    def close(self):
      pass

  monkeypatch.setattr(runner, "build_run", lambda recipe, out, **kw: Boom())
  code, _, err = _main(["model=tiny", "rollouts.source=synthetic", "run.reserve_host_core=false", "--out",
                        str(tmp_path / "out")], capsys)
  assert code == 1
  assert "the run failed at step 2: RuntimeError: device lost" in err
  assert "records written so far are kept" in err and "Traceback" not in err
  assert f"traceback in {tmp_path / 'out' / 'error.log'}" in err
  assert "RuntimeError: device lost" in (tmp_path / "out" / "error.log").read_text()
  assert json.loads((tmp_path / "out" / "summary.json").read_text())["ended"] == "error"
  assert (tmp_path / "out" / "records.jsonl").read_text() == '{"step": 0}\n'


def test_a_learning_rate_that_diverges_stops_the_run_at_that_step_in_one_line(tmp_path):
  """1e30 (a float32 still, unlike 1e300, which the recipe refuses) overflows the first update's weights, so
  step 1's loss is NaN (two steps are the fewest that reach it): exit 1, one line, the checkpoint after step 0
  kept and none of step 1."""
  out = tmp_path / "run"
  env = dict(os.environ, PYTHONPATH=str(REPO))
  for name in recipe_lib.ENV_SWITCHES:
    env.pop(name, None)
  proc = subprocess.run(
      [sys.executable, "-m", "orchestrator.app.cli", "model=tiny", "rollouts.source=synthetic", "steps=2",
       "batch.rows=4", "batch.micro_batches_per_step=1", "checkpoint.every=1", "run.reserve_host_core=false",
       "engine.learning_rate=1e30", "--out", str(out)],
      capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
  )
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  lines = [line for line in proc.stderr.splitlines() if "the run stopped" in line]
  assert len(lines) == 1 and lines[0].startswith("run_rl: the run stopped at step 1: loss nan"), proc.stderr[-3000:]
  line = lines[0]
  assert f"records so far are kept in {out / 'records.jsonl'}" in line
  assert "the last checkpoint is after 1 steps" in line and "none of step 1 or later" in line
  assert "lower engine.learning_rate" in line and f"run_rl --resume {out}" in line
  summary = json.loads((out / "summary.json").read_text())
  assert summary["ended"] == "error" and summary["last_step"] == summary["non_finite_step"] == 1
  assert "NonFiniteStepError" in summary["error"]
  records = [json.loads(r) for r in (out / "records.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [0, 1]
  assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]


def test_run_rl_end_to_end_on_the_tiny_preset(tmp_path):
  out = tmp_path / "run"
  env = dict(os.environ, PYTHONPATH=str(REPO))
  for name in recipe_lib.ENV_SWITCHES:
    env.pop(name, None)
  proc = subprocess.run(
      # The pinned zero threshold keeps staging on however loaded the machine is (the test counts staged boundaries).
      [sys.executable, "-m", "orchestrator.app.cli", "model=tiny", "batch.rows=16", "steps=4",
       "batch.micro_batches_per_step=2", "checkpoint.every=2", f"checkpoint.directory={tmp_path / 'ckpt'}",
       "step_boundary.wait_threshold_s=0", "--out", str(out)],
      capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "median boundary idle:" in proc.stdout and "staged boundaries: 3; auto-disables: 0" in proc.stdout
  assert "final state digest:" in proc.stdout
  # before the update, or after it where step 1's first micro-batch was not sampled yet when boundary 0 was planned
  assert re.search(r"^\[boundary\] step 0 STAGED (before|after) update in", proc.stderr, re.M), proc.stderr[-3000:]
  opening = next(line for line in proc.stderr.splitlines() if line.startswith("run_rl: recipe "))
  assert "; devices: " in opening and " × cpu, the mesh uses 1; JAX " in opening, opening
  records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [0, 1, 2, 3]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["final_state_digest"] in proc.stdout
  assert json.loads((out / "trace.json").read_text())["traceEvents"]
  config = json.loads((out / "config.json").read_text())
  assert config["sources"]["model.preset"] == "override"
  assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == ["2", "4"]


def test_record_writes_a_recording_and_refuses_to_overwrite_one(tmp_path, capsys):
  out = tmp_path / "rec"
  code, stdout, _ = _main(["record", "model=tiny", "rollouts.source=synthetic", "rollouts.groups=8", "--out", str(out)],
                          capsys)
  assert code == 0 and "wrote 8 groups" in stdout
  manifest = json.loads((out / "manifest.json").read_text())
  assert manifest["num_groups"] == 8 and manifest["produced_by"]["tool"] == "run_rl record"
  code, _, err = _main(["record", "model=tiny", "rollouts.source=synthetic", "--out", str(out)], capsys)
  assert code == 2 and "already holds a recording; recordings are read-only" in err


def test_run_with_a_bad_recording_exits_2_naming_it(tmp_path, capsys):
  code, _, err = _main(["model=tiny", "rollouts.source=recording", f"rollouts.recording={tmp_path}",
                        "run.reserve_host_core=false", "--out", str(tmp_path / "out")], capsys)
  assert code == 2 and "no manifest" in err and str(tmp_path) in err


def test_rig_with_a_bad_recording_exits_2(tmp_path, capsys):
  code, _, err = _main(["rig", "model=tiny", "run.reserve_host_core=false", "--recording", str(tmp_path),
                        "--out", str(tmp_path / "out")], capsys)
  assert code == 2 and "run_rl rig: error:" in err and "no manifest" in err


def test_rig_command_runs_and_prints_the_verdict(tmp_path, capsys):
  code, out, _ = _main(["rig", "model=tiny", "batch.rows=16", "steps=2", "batch.micro_batches_per_step=2",
                        "run.reserve_host_core=false", "--recording", "recordings/rig_small",
                        "--arms", "off", "stage_before_update", "--out", str(tmp_path / "rig")], capsys)
  assert code == 0, out
  assert "# Rig report" in out and out.strip().splitlines()[-1].startswith("verdict:")
  assert (tmp_path / "rig" / "timeline.png").is_file()
  report = (tmp_path / "rig" / "report.json").read_bytes()
  code, _, err = _main(["rig", "model=tiny", "batch.rows=16", "steps=2", "run.reserve_host_core=false",
                        "--recording", "recordings/rig_small", "--out", str(tmp_path / "rig")], capsys)
  assert code == 2 and "already holds a rig report" in err
  assert (tmp_path / "rig" / "report.json").read_bytes() == report


def test_recipe_validation_does_not_import_jax():
  """run_rl validates (and reserves the host core) before JAX is imported."""
  code = ("import sys; from orchestrator.app import cli; "
          "assert cli.main(['--print-config']) == 0; assert 'jax' not in sys.modules, 'jax imported'")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                        env=dict(os.environ, PYTHONPATH=str(REPO)))
  assert proc.returncode == 0, proc.stderr[-2000:]


def test_rig_takes_the_recording_from_the_recipe_or_refuses_without_one(tmp_path, capsys):
  code, _, err = _main(["rig", "model=tiny", "rollouts.source=synthetic", "rollouts.recording=null",
                        "--out", str(tmp_path)], capsys)
  assert code == 2 and "no recording: pass --recording DIR or set rollouts.recording" in err


def test_engine_backend_tunix_peft_runs_through_run_rl_and_stages(tmp_path, capsys):
  """The registry's second backend, picked by a recipe key: a stock Tunix PeftTrainer, staging."""
  # The pinned zero threshold keeps staging on however loaded the machine is (the test reads every boundary).
  code, out, err = _main(["model=tiny", "engine.backend=tunix_peft", "steps=3", "batch.micro_batches_per_step=2",
                          "rollouts.source=synthetic", "run.reserve_host_core=false",
                          "step_boundary.wait_threshold_s=0", "--out", str(tmp_path / "out")], capsys)
  assert code == 0, err[-2000:]
  assert "mode: requested stage_before_update, ended stage_before_update" in out
  assert "falling back" not in err
  records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
  assert [r["staged"] for r in records] == [True, True, False] and all(r["loss"] is not None for r in records)

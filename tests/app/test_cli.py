"""run_rl over the recipe (tests/recipe specifies the recipe itself): its flags and switches, refusals in one line
with exit 2, --print-config, subcommands, an end-to-end run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.app import cli, launch, plan
from orchestrator import recipe as recipe_lib
from orchestrator.run_files import run_dir
from policies import Mode
from tests.conftest import REPO

def resolve(argv, env=None):
  args = cli.make_parser().parse_intermixed_args(argv)
  return cli.resolve_from_args(args, env=env or {})


def write(tmp_path, text, name="r.yaml"):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


@pytest.mark.engine
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


@pytest.mark.engine
def test_a_stage_asked_for_while_pipelining_is_off_is_refused_not_ignored():
  with pytest.raises(recipe_lib.RecipeError, match="has no effect with step_boundary.pipeline_step_boundary=false"):
    resolve(["--no-pipeline_step_boundary", "--stage_before_update"])
  with pytest.raises(recipe_lib.RecipeError, match=r"\(env STAGE_BEFORE_UPDATE\) has no effect"):
    resolve(["--no-pipeline_step_boundary"], env={"STAGE_BEFORE_UPDATE": "1"})
  assert resolve(["--no-pipeline_step_boundary"]).recipe.mode is Mode.OFF  # the recipe's own value is fine


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
  """A Hugging Face checkpoint of the tiny_moe preset: its sizes disagree with the default recipe's tiny."""
  # import here: writing a checkpoint builds a model (JAX); the rest of this module validates without it
  from tests.engine.test_hf_checkpoint import write_checkpoint

  directory = tmp_path_factory.mktemp("hf") / "tiny_moe"
  write_checkpoint(directory, "tiny_moe")
  return str(directory)


_IDENTITY = {"STEP_BOUNDARY_PROCESS_ID": "1", "STEP_BOUNDARY_COORDINATOR_ADDRESS": "127.0.0.1:1234"}


def _layered(checkpoint):
  """(recipe file's lines, command line, environment, the key that wins and its value, the keys dropped)."""
  return [
      ("model: tiny", [f"model.checkpoint={checkpoint}"], {}, ("model.checkpoint", checkpoint), ["model.preset"]),
      (f"model:\n  checkpoint: {checkpoint}", ["model=tiny"], {}, ("model.preset", "tiny"), ["model.checkpoint"]),
      ("simulate:\n  input_copy_s: 0.3", ["simulate.map_s=0.2"], {}, ("simulate.map_s", 0.2),
       ["simulate.input_copy_s"]),
      ("simulate:\n  update_overlap_share: 0.5", ["simulate.update_waits_for_last=true"], {},
       ("simulate.update_waits_for_last", True), ["simulate.update_overlap_share"]),
      ("distributed:\n  detect_cluster: true", ["distributed.num_processes=1"], {}, ("distributed.num_processes", 1),
       ["distributed.detect_cluster"]),
      ("distributed:\n  num_processes: 2", ["distributed.detect_cluster=true"], _IDENTITY,
       ("distributed.detect_cluster", True),
       ["distributed.num_processes", "distributed.process_id", "distributed.coordinator_address"]),
  ]


@pytest.mark.engine
def test_a_key_of_a_higher_layer_drops_the_lower_layers_conflicting_key(tmp_path, moe_checkpoint):
  """Every pair of EXCLUSIVE_KEYS, split over two layers: the higher one's key is used, the lower one's is
  dropped and its source says so. Negative controls: both in one layer are still refused, naming both."""
  cases = _layered(moe_checkpoint)
  covered = {frozenset((wins, key)) for *_, (wins, _), dropped in cases for key in dropped}
  assert {frozenset(pair) for pair in recipe_lib.loading.EXCLUSIVE_KEYS} <= covered  # a new pair needs a case
  for text, argv, env, (wins, value), dropped in cases:
    r = resolve(["--recipe", write(tmp_path, f"steps: 3\n{text}\n"), *argv], env=env)
    assert recipe_lib.get(r.recipe, wins) == value, wins
    for key in dropped:
      assert recipe_lib.get(r.recipe, key) == recipe_lib.get(recipe_lib.Recipe(), key), key
      assert r.sources[key].startswith(f"default (dropped: {wins}=") and f"replaces {key}=" in r.sources[key]
    assert len(r.dropped) == len(dropped) and all(phrase.startswith(f"{wins}=") for phrase in r.dropped)
  with pytest.raises(recipe_lib.RecipeError, match=r"model.preset=tiny and model.checkpoint=.*tiny_moe disagree"):
    resolve(["--recipe", write(tmp_path, f"model:\n  preset: tiny\n  checkpoint: {moe_checkpoint}\n")])
  with pytest.raises(recipe_lib.RecipeError, match="simulate.input_copy_s=0.3 and simulate.map_s=0.2 are both"):
    resolve(["simulate.map_s=0.2", "simulate.input_copy_s=0.3"])
  with pytest.raises(recipe_lib.RecipeError, match="distributed.num_processes=2 is set with distributed.detect"):
    resolve(["--recipe", write(tmp_path, "distributed:\n  num_processes: 2\n  detect_cluster: true\n")])


@pytest.mark.e2e
def test_the_default_recipe_runs_a_checkpoint_named_on_the_command_line(moe_checkpoint, capsys):
  """``run_rl model.checkpoint=DIR`` over the default recipe (which names the tiny preset): the checkpoint's model
  is the run's; --print-config says the recipe's preset was dropped for it."""
  code, out, err = _main(["--print-config", f"model.checkpoint={moe_checkpoint}"], capsys)
  assert code == 0, err
  lines = {line.split()[0]: line for line in out.splitlines() if not line.startswith("#")}
  assert lines["model.preset"].split()[1] == "null"
  assert f"# default (dropped: model.checkpoint={moe_checkpoint} (override) replaces model.preset=tiny (recipe))" in (
      lines["model.preset"])


@pytest.mark.e2e
def test_the_first_line_names_what_the_command_line_changed_and_dropped(moe_checkpoint):
  """Negative control: the recipe run as written adds nothing to the first line."""
  assert launch._changed_phrase(resolve([])) == ""
  phrase = launch._changed_phrase(resolve(["--steps", "3", f"model.checkpoint={moe_checkpoint}"]))
  assert phrase == (f" with overrides: model.checkpoint={moe_checkpoint}, steps=3; model.checkpoint={moe_checkpoint}"
                    " (override) replaces model.preset=tiny (recipe)")


def _described_in_help(capsys) -> dict[str, str]:
  """Each name ``run_rl --help`` lists on a line of its own, with the line's text."""
  with pytest.raises(SystemExit) as e:
    cli.main(["--help"])
  assert e.value.code == 0
  return {line.split()[0]: line.split(None, 1)[1] for line in capsys.readouterr().out.splitlines()
          if line.startswith("  ") and not line.startswith("   ") and len(line.split()) > 1}


@pytest.mark.e2e
def test_help_lists_every_subcommand_and_every_environment_variable_one_line_each(capsys, monkeypatch):
  """The lists come from the code: SUBCOMMANDS, ENV_SWITCHES and every STEP_BOUNDARY_* name in orchestrator/, so a
  new one without a line of help fails here. Negative control: a subcommand whose line is taken away is missed."""
  read = set(re.findall(r"STEP_BOUNDARY_[A-Z_]*[A-Z]", "".join(
      path.read_text() for path in (REPO / "orchestrator").rglob("*.py"))))
  expected = {*cli.SUBCOMMANDS, *recipe_lib.ENV_SWITCHES, *read}
  described = _described_in_help(capsys)
  assert "STEP_BOUNDARY_TRAINER_TOKEN" in read and "serve-trainer" in expected
  assert expected <= set(described), sorted(expected - set(described))
  assert all(len(described[name].split()) >= 3 for name in expected)
  monkeypatch.delitem(cli.SUBCOMMAND_HELP, "serve-trainer")
  assert "serve-trainer" not in _described_in_help(capsys)


SUMS = "".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(40))


@pytest.mark.engine
def test_config_json_holds_each_derived_size_with_its_source(tmp_path, monkeypatch):
  """The sizes a run derives are saved as the values it runs with, marked derived; relative output directories
  absolute. Negative controls: a size given keeps its value and source, and the recipe the run builds from
  still leaves the derived ones unset (it derives them as it always did)."""
  (tmp_path / "prompts.jsonl").write_text(SUMS)
  monkeypatch.chdir(tmp_path)
  resolved = resolve(["task.name=dataset", "task.path=prompts.jsonl", "checkpoint.directory=ckpts"])
  config, sources = recipe_lib.saved_config(resolved)
  assert (config["task"]["max_prompt_tokens"], sources["task.max_prompt_tokens"]) == (
      6, "derived: the longest prompt (bos included)")  # "39+1=" and bos
  assert (config["task"]["max_completion_tokens"], sources["task.max_completion_tokens"]) == (
      2, "derived: the longest answer")
  assert (config["batch"]["tokens_per_row"], sources["batch.tokens_per_row"]) == (
      8, "derived: the task's longest trajectory (8 tokens) per trajectory a row holds")
  assert (config["batch"]["rows"], sources["batch.rows"]) == (
      32, "derived: rows for the 32 trajectories a micro-batch samples")
  assert config["checkpoint"]["directory"] == str(tmp_path / "ckpts")
  assert sources["checkpoint.directory"] == "override, ckpts made absolute"
  assert resolved.recipe.task.max_prompt_tokens is None and resolved.recipe.batch.tokens_per_row is None
  config, sources = recipe_lib.saved_config(resolve(["task.name=dataset", "task.path=prompts.jsonl",
                                                     "task.max_prompt_tokens=9", "batch.tokens_per_row=32"]))
  assert (config["task"]["max_prompt_tokens"], sources["task.max_prompt_tokens"]) == (9, "override")
  assert (config["batch"]["tokens_per_row"], sources["batch.tokens_per_row"]) == (32, "override")


@pytest.mark.spec
@pytest.mark.parametrize("overrides, shape", [
    ([], (32, 17)),  # default: 8 groups × 4 generations of up to 16 + 1 tokens, one a row
    (["batch.rows=16"], (16, 34)),  # two trajectories a row
    (["batch.rows=5"], (5, 119)),  # ceil(32 / 5) = 7 a row
    (["batch.tokens_per_row=64"], (11, 64)),  # 3 a row: ceil(32 / 3) rows
    (["batch.rows=7", "batch.tokens_per_row=100"], (7, 100)),  # both given: as given
    (["task.name=reverse"], (32, 20)),  # a longer answer (4 tokens): longer rows
    (["rollouts.groups_per_micro_batch=3"], (12, 17)),
    (["rollouts.source=synthetic"], (4, 64)),  # not live: the preset's
])
def test_a_live_run_sizes_its_micro_batch_to_its_task(overrides, shape):
  """Unset, a live run's rows and tokens per row hold a micro-batch's sampled trajectories with no row of padding
  (the preset's 16 × 64 computed 1,024 positions for 32 trajectories of at most 17 tokens)."""
  recipe = resolve(overrides).recipe
  assert recipe.micro_batch_shape() == shape
  rows, tokens = shape
  if recipe.rollouts.source == "sampler":  # negative control: one row fewer would not hold them
    trajectories, per_trajectory = recipe.live_trajectories()
    assert trajectories <= rows * (tokens // per_trajectory)
    assert trajectories > (rows - 1) * (tokens // per_trajectory) or rows == 1


@pytest.mark.spec
def test_a_derived_shape_splits_over_the_mesh():
  """Rows round up to split over fsdp × expert, tokens over context (the mesh check refuses anything else)."""
  recipe = resolve(["mesh.fsdp=3", "mesh.context=2", "rollouts.groups_per_micro_batch=3"]).recipe
  assert recipe.micro_batch_shape() == (12, 18)


@pytest.mark.spec
def test_a_resume_keeps_the_shape_its_run_derived(tmp_path):
  """A run whose micro-batch shape was derived otherwise at its start (the preset's 16 × 64, before live runs
  fitted theirs to the task) resumes in that shape; negative control: a derived task size still derives anew."""
  config, sources = recipe_lib.saved_config(resolve([]))
  config["batch"]["rows"], config["batch"]["tokens_per_row"] = 16, 64
  sources["batch.rows"], sources["batch.tokens_per_row"] = "recipe", "derived: model.preset tiny's tokens_per_row"
  resumed = plan.resolved_from_saved({"config": config, "sources": sources, "recipe": "x"}, None).recipe
  assert resumed.micro_batch_shape() == (16, 64)
  assert plan._derived_otherwise({"config": config, "sources": sources}, resumed) == []
  config["batch"]["tokens_per_row"], sources["batch.tokens_per_row"] = 99, "derived: the task's longest trajectory"
  assert plan.resolved_from_saved({"config": config, "sources": sources, "recipe": "x"},
                                  None).recipe.micro_batch_shape() == (16, 34)


@pytest.mark.spec
def test_a_decaying_rate_without_decay_steps_decays_over_the_run_and_an_extension_keeps_it():
  """engine.lr_schedule=cosine alone decays over the run's steps after the warm-up (config.json records it as
  derived); a resume extended to 20 steps keeps the schedule its start ran. Negative control: a value given is
  the value run."""
  resolved = resolve(["steps=10", "engine.lr_schedule=cosine", "engine.warmup_steps=2"])
  assert resolved.recipe.engine.decay_steps == 8
  config, sources = recipe_lib.saved_config(resolved)
  assert (config["engine"]["decay_steps"], sources["engine.decay_steps"]) == (
      8, "derived: the run's 10 steps after its warm-up")
  extended = plan.resolved_from_saved({"config": config, "sources": sources, "recipe": "x"}, 20).recipe
  assert (extended.steps, extended.engine.decay_steps) == (20, 8)
  assert resolve(["steps=10", "engine.lr_schedule=linear", "engine.decay_steps=3"]).recipe.engine.decay_steps == 3
  assert resolve(["steps=10"]).recipe.engine.decay_steps is None  # constant: nothing decays


@pytest.mark.e2e
def test_a_resume_refuses_a_size_that_derives_otherwise_now(tmp_path, monkeypatch):
  """A size saved as derived must derive to the saved value again (else the resume would train another
  shape); negative control: the value the run saved passes."""
  (tmp_path / "prompts.jsonl").write_text(SUMS)
  monkeypatch.chdir(tmp_path)
  resolved = resolve(["task.name=dataset", "task.path=prompts.jsonl"])
  config, sources = recipe_lib.saved_config(resolved)
  saved = {"config": config, "sources": sources}
  assert plan._derived_otherwise(saved, resolved.recipe) == []
  config["task"]["max_prompt_tokens"] = 5
  assert plan._derived_otherwise(saved, resolved.recipe) == [
      "task.max_prompt_tokens was 5 at the run's start (derived: the longest prompt (bos included)), now 6"]


@pytest.mark.e2e
def test_a_run_on_a_relative_dataset_with_derived_sizes_resumes_from_another_directory(tmp_path, monkeypatch,
                                                                                         capsys):
  """Started in directory a with task.path relative to it and its sizes derived, resumed from directory b: the
  resume reads the file config.json recorded, derives the same sizes, and reaches the uninterrupted run's
  digest. Negative control: the file changed since, the resume is refused in one line naming it, nothing
  written."""
  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)
  a, b = tmp_path / "a", tmp_path / "b"
  a.mkdir(), b.mkdir()
  (a / "prompts.jsonl").write_text(SUMS)
  monkeypatch.chdir(a)
  argv = ["task.name=dataset", "task.path=prompts.jsonl", "steps=2", "rollouts.groups_per_micro_batch=2",
          "batch.rows=4", "task.eval_prompts=4", "checkpoint.every=1", "run.reserve_host_core=false",
          "rollouts.placement=shared"]  # the sampler in this process: its placement is not what this tests
  assert cli.main([*argv, "--out", str(tmp_path / "whole")]) == 0
  run = tmp_path / "cut"
  assert cli.main([*argv, "--out", str(run)]) == 0
  saved = json.loads((run / "config.json").read_text())
  assert saved["config"]["task"]["path"] == "prompts.jsonl" and saved["config"]["task"]["max_prompt_tokens"] == 6
  assert saved["sources"]["task.max_prompt_tokens"].startswith("derived:")
  shutil.rmtree(run / "checkpoints" / "2")
  monkeypatch.chdir(b)
  capsys.readouterr()
  assert cli.main(["--resume", str(run)]) == 0, capsys.readouterr().err
  digest = json.loads((run_dir.latest_segment(run) / "summary.json").read_text())["final_state_digest"]
  assert digest == json.loads((tmp_path / "whole" / "summary.json").read_text())["final_state_digest"]

  (a / "prompts.jsonl").write_text(SUMS + '{"prompt": "99+1=", "answer": "100"}\n')
  listing = sorted(p.relative_to(run) for p in run.rglob("*"))
  capsys.readouterr()
  assert cli.main(["--resume", str(run), "--steps", "3"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"task.path: {a / 'prompts.jsonl'} changed since the run started" in err
  assert sorted(p.relative_to(run) for p in run.rglob("*")) == listing


@pytest.mark.engine
def test_a_description_changed_by_overrides_says_so():
  """The recipe's description is kept, with what the command line and the environment changed; negative
  controls: a run of the recipe as written keeps it as written, and so does one that changes only where it
  writes (run.out) or that gives its own description."""
  written = resolve([]).recipe.description
  assert "with overrides" not in written and resolve([]).sources["description"] == "recipe"
  r = resolve(["--steps", "3", "engine.seed=4"], env={"RAGGED_BUFFER_FACTOR": "2"})
  assert r.recipe.description == (f"{written} (with overrides: steps=3, engine.seed=4,"
                                  " engine.ragged_buffer_factor=2.0)")
  assert r.sources["description"] == "recipe, with this run's overrides appended"
  assert r.changes == ("steps=3", "engine.seed=4", "engine.ragged_buffer_factor=2.0")
  assert resolve(["--out", "/tmp/elsewhere"]).recipe.description == written
  own = resolve(["steps=3", "description=three steps"])
  assert own.recipe.description == "three steps" and own.sources["description"] == "override"


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


@pytest.mark.e2e
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
        (["mesh.fsdp=3", "batch.rows=16"], {}, "does not split over mesh.fsdp×mesh.expert=3"),
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


@pytest.mark.e2e
def test_print_config_prints_the_resolved_recipe_naming_each_flag_and_switch(capsys):
  """``--print-config`` exits 0 printing ``recipe.format_config`` (tests/recipe/test_precedence.py) of what the
  command line and the environment resolve to: a flag is its key's source as spelled, an environment switch is
  read from the process's environment."""
  argv = ["--steps", "4", "--no-stage_next_microbatch", "engine.seed=3"]
  code, out, _ = _main(["--print-config", *argv], capsys, env={"STAGE_BEFORE_UPDATE": "no"})
  assert code == 0
  assert out == recipe_lib.format_config(resolve(argv, env={"STAGE_BEFORE_UPDATE": "no"})) + "\n"
  lines = {line.split()[0]: line for line in out.splitlines() if not line.startswith("#")}
  assert lines["steps"].split()[1] == "4" and lines["steps"].endswith("# flag --steps")
  assert lines["step_boundary.stage_next_microbatch"].endswith("# flag --no-stage_next_microbatch")
  assert lines["step_boundary.stage_before_update"].endswith("# env STAGE_BEFORE_UPDATE")
  assert lines["engine.seed"].endswith("# override") and "# mode: PIPELINED" in out


@pytest.mark.e2e
def test_failure_during_the_run_exits_1_naming_the_step(tmp_path, capsys, monkeypatch):
  from orchestrator.app import run as app_run

  class Boom:
    current_step, loaded_weights = 2, None

    def stop_keeps(self):
      return "after the first step"

    def run(self):
      (tmp_path / "out" / "records.jsonl").write_text('{"step": 0}\n')
      raise RuntimeError("device lost")

    def close(self):
      pass

  monkeypatch.setattr(app_run, "build_run", lambda recipe, out, **kw: Boom())
  code, _, err = _main(["model=tiny", "rollouts.source=synthetic", "run.reserve_host_core=false", "--out",
                        str(tmp_path / "out")], capsys)
  assert code == 1
  assert "the run failed at step 2: RuntimeError: device lost" in err
  assert "records written so far are kept" in err and "Traceback" not in err
  assert f"traceback in {tmp_path / 'out' / 'error.log'}" in err
  assert "RuntimeError: device lost" in (tmp_path / "out" / "error.log").read_text()
  assert json.loads((tmp_path / "out" / "summary.json").read_text())["ended"] == "error"
  assert (tmp_path / "out" / "records.jsonl").read_text() == '{"step": 0}\n'


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_run_rl_end_to_end_on_the_tiny_preset(tmp_path):
  out = tmp_path / "run"
  env = dict(os.environ, PYTHONPATH=str(REPO))
  for name in recipe_lib.ENV_SWITCHES:
    env.pop(name, None)
  proc = subprocess.run(
      # The pinned zero threshold keeps staging on however loaded the machine is (the test counts staged boundaries);
      # 8 held-out prompts, not the recipe's 64: the evaluations' size is not what this run checks.
      [sys.executable, "-m", "orchestrator.app.cli", "model=tiny", "batch.rows=16", "steps=4",
       "batch.micro_batches_per_step=2", "checkpoint.every=2", f"checkpoint.directory={tmp_path / 'ckpt'}",
       "step_boundary.wait_threshold_s=0", "task.eval_prompts=8", "--out", str(out)],
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
  # the sampler in a process of its own computes on none of the trainer's devices: no step's span is left out
  assert all(r["sampling_on_trainer_devices_s"] is None for r in records)
  summary = json.loads((out / "summary.json").read_text())
  assert summary["final_state_digest"] in proc.stdout
  startup = summary["startup_s"]  # seconds from the process's start, phase by phase (live: first rollouts too)
  assert list(startup) == ["imports", "jax_ready", "weights_placed", "trainer_built", "first_rollout",
                           "first_update"], startup
  assert 0 < startup["imports"] <= startup["jax_ready"] <= startup["trainer_built"] <= startup["first_update"]
  assert startup["first_rollout"] <= startup["first_update"]
  assert "start-up, seconds from the process's start: imports " in proc.stdout
  assert json.loads((out / "trace.json").read_text())["traceEvents"]
  config = json.loads((out / "config.json").read_text())
  assert config["sources"]["model.preset"] == "override"
  assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == ["2", "4"]


@pytest.mark.e2e
def test_record_writes_a_recording_and_refuses_to_overwrite_one(tmp_path, capsys):
  out = tmp_path / "rec"
  code, stdout, _ = _main(["record", "model=tiny", "rollouts.source=synthetic", "rollouts.groups=8", "--out", str(out)],
                          capsys)
  assert code == 0 and "wrote 8 groups" in stdout
  manifest = json.loads((out / "manifest.json").read_text())
  assert manifest["num_groups"] == 8 and manifest["produced_by"]["tool"] == "run_rl record"
  code, _, err = _main(["record", "model=tiny", "rollouts.source=synthetic", "--out", str(out)], capsys)
  assert code == 2 and "already holds a recording; recordings are read-only" in err


@pytest.mark.e2e
def test_run_with_a_bad_recording_exits_2_naming_it(tmp_path, capsys):
  code, _, err = _main(["model=tiny", "rollouts.source=recording", f"rollouts.recording={tmp_path}",
                        "run.reserve_host_core=false", "--out", str(tmp_path / "out")], capsys)
  assert code == 2 and "no manifest" in err and str(tmp_path) in err


@pytest.mark.e2e
def test_rig_with_a_bad_recording_exits_2(tmp_path, capsys):
  code, _, err = _main(["rig", "model=tiny", "run.reserve_host_core=false", "--recording", str(tmp_path),
                        "--out", str(tmp_path / "out")], capsys)
  assert code == 2 and "run_rl rig: error:" in err and "no manifest" in err


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_recipe_validation_does_not_import_jax():
  """run_rl validates (and reserves the host core) before JAX is imported."""
  code = ("import sys; from orchestrator.app import cli; "
          "assert cli.main(['--print-config']) == 0; assert 'jax' not in sys.modules, 'jax imported'")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                        env=dict(os.environ, PYTHONPATH=str(REPO)))
  assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.e2e
def test_rig_takes_the_recording_from_the_recipe_or_refuses_without_one(tmp_path, capsys):
  code, _, err = _main(["rig", "model=tiny", "rollouts.source=synthetic", "rollouts.recording=null",
                        "--out", str(tmp_path)], capsys)
  assert code == 2 and "no recording: pass --recording DIR or set rollouts.recording" in err


@pytest.mark.e2e
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


@pytest.mark.spec
def test_a_run_plan_carries_its_checkpoint_directory_from_the_start(tmp_path, monkeypatch):
  """Computed once, when the run is planned: ``OUT/checkpoints``, or the recipe's ``checkpoint.directory``; a
  claim that keeps the directory keeps it, one that moves the run (process 0's directory) moves it. Negative
  control: an engine that writes no checkpoints has none."""
  monkeypatch.chdir(tmp_path)
  planned = plan.plan_new_run(resolve(["model=tiny"]), Path("run"))
  assert planned.checkpoint_dir == str(tmp_path / "run" / "checkpoints")
  computed = []
  monkeypatch.setattr(plan, "checkpoint_dir_for", lambda *args: computed.append(args))
  assert planned.claimed(run_id="r", out=Path("run"), config_sha256=None).checkpoint_dir == planned.checkpoint_dir
  assert computed == []
  planned.claimed(run_id="r", out=Path("elsewhere"), config_sha256=None)
  assert [out for _, out in computed] == [Path("elsewhere")]
  monkeypatch.undo()
  monkeypatch.chdir(tmp_path)
  assert plan.plan_new_run(resolve(["model=tiny", "checkpoint.directory=ckpts"]), Path("run")).checkpoint_dir == str(
      tmp_path / "ckpts")
  no_checkpoints = resolve(["model=tiny", "engine.backend=tunix_peft", "rollouts.source=synthetic"])
  assert plan.plan_new_run(no_checkpoints, Path("run")).checkpoint_dir is None


@pytest.mark.spec
@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_the_rig_releases_the_cores_it_planned(monkeypatch, fails):
  """``run_rl rig`` pins this process's threads for its arms; however it ends, it puts them back."""
  calls = []
  monkeypatch.setattr(cli, "apply_core_plan", lambda *a, **k: calls.append("plan"))
  monkeypatch.setattr(cli, "release_core_plan", lambda: calls.append("release"))

  def rig(*args):
    calls.append("rig")
    if fails:
      raise RuntimeError("an arm failed")
    return 0

  monkeypatch.setattr(cli, "_rig_on_planned_cores", rig)
  recipe = recipe_lib.Recipe()
  if fails:
    with pytest.raises(RuntimeError, match="an arm failed"):
      cli._run_rig(recipe, "rec", None, "out")
  else:
    assert cli._run_rig(recipe, "rec", None, "out") == 0
  assert calls == ["plan", "rig", "release"]

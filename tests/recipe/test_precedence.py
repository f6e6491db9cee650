"""Precedence and provenance: recipe < environment < flags < ``key=value``, each key remembering where its value
came from, and ``--print-config``'s lines showing every key's value and source."""

from __future__ import annotations

import pytest

from orchestrator import recipe as recipe_lib
from policies import Mode

pytestmark = pytest.mark.spec


def test_precedence_recipe_then_env_then_flags_then_overrides(tmp_path):
  """Each layer overrides the one below it with the opposite value, so a layer that was skipped would show."""
  path = tmp_path / "r.yaml"
  path.write_text("model: tiny\nsteps: 3\nstep_boundary:\n  stage_before_update: true\n")
  key = "step_boundary.stage_before_update"
  flag = {key: (True, "--stage_before_update")}
  r = recipe_lib.resolve(path, env={})
  assert (r.recipe.step_boundary.stage_before_update, r.sources[key]) == (True, "recipe")
  r = recipe_lib.resolve(path, env={"STAGE_BEFORE_UPDATE": "false"})
  assert (r.recipe.step_boundary.stage_before_update, r.sources[key]) == (False, "env STAGE_BEFORE_UPDATE")
  r = recipe_lib.resolve(path, env={"STAGE_BEFORE_UPDATE": "false"}, flags=flag)
  assert (r.recipe.step_boundary.stage_before_update, r.sources[key]) == (True, "flag --stage_before_update")
  r = recipe_lib.resolve(path, env={"STAGE_BEFORE_UPDATE": "0"}, flags=flag, overrides=[f"{key}=no"])
  assert (r.recipe.step_boundary.stage_before_update, r.sources[key]) == (False, "override")
  assert r.sources["steps"] == "recipe" and r.sources["engine.seed"] == "default"


def test_env_switches_each_reach_their_key():
  env = {"PIPELINE_STEP_BOUNDARY": "1", "STAGE_NEXT_MICROBATCH": "0", "STAGE_BEFORE_UPDATE": "0",
         "RAGGED_BUFFER_FACTOR": "1.5"}
  r = recipe_lib.resolve(env=env)
  assert r.recipe.mode is Mode.PIPELINED and r.recipe.engine.ragged_buffer_factor == 1.5
  for name, key in recipe_lib.ENV_SWITCHES.items():
    if name in env:
      assert r.sources[key] == f"env {name}"


def test_print_config_shows_every_key_and_its_source():
  """``format_config`` (what ``run_rl --print-config`` prints): one line per key, its value and where it came
  from, under the recipe's path and the mode the switches select."""
  resolved = recipe_lib.resolve(env={"STAGE_BEFORE_UPDATE": "no"}, flags={"steps": (4, "--steps")},
                                overrides=["engine.seed=3"])
  out = recipe_lib.format_config(resolved)
  lines = {line.split()[0]: line for line in out.splitlines() if not line.startswith("#")}
  assert set(lines) == set(recipe_lib.all_keys())
  assert lines["steps"].split()[1] == "4" and lines["steps"].endswith("# flag --steps")
  assert lines["engine.seed"].endswith("# override")
  assert lines["step_boundary.stage_before_update"].endswith("# env STAGE_BEFORE_UPDATE")
  assert lines["model.preset"].endswith("# recipe") and lines["engine.weight_decay"].endswith("# default")
  assert f"# recipe: {recipe_lib.DEFAULT_RECIPE}" in out and "# mode: STAGE_AFTER_UPDATE" in out


def test_print_config_shows_a_word_key_as_its_word():
  """A key typed by its words (``rollouts.source``, ``step_boundary.wait_threshold_s``'s ``auto``) prints as the
  word; a number given for a word-or-number key prints as the number."""
  lines = {line.split()[0]: line.split()[1] for line in recipe_lib.format_config(recipe_lib.resolve(
      env={})).splitlines() if not line.startswith("#")}
  assert (lines["rollouts.source"], lines["rollouts.placement"], lines["trainer.location"]) == (
      "sampler", "auto", "local")
  assert lines["step_boundary.wait_threshold_s"] == "auto"
  lines = {line.split()[0]: line.split()[1] for line in recipe_lib.format_config(recipe_lib.resolve(
      env={}, overrides=["step_boundary.wait_threshold_s=0.25"])).splitlines() if not line.startswith("#")}
  assert lines["step_boundary.wait_threshold_s"] == "0.25"

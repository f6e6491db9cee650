"""Values as the schema types them: booleans in any spelling, numbers as numbers, a word key's words
(``typing.Literal``), a word-or-number key's word or number; any other value refused in one line naming the
key, the value and what it takes."""

from __future__ import annotations

import typing

import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.live import placement_rule
from orchestrator.recipe import schema

pytestmark = pytest.mark.spec


@pytest.mark.parametrize("spelling,value", [
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("Yes", True),
    ("false", False), ("False", False), ("0", False), ("no", False), ("NO", False),
])
def test_boolean_spellings_in_env_and_overrides(spelling, value):
  r = recipe_lib.resolve(env={"PIPELINE_STEP_BOUNDARY": spelling})
  assert r.recipe.step_boundary.pipeline_step_boundary is value
  r = recipe_lib.resolve(env={}, overrides=[f"step_boundary.require_staging={spelling}"])
  assert r.recipe.step_boundary.require_staging is value


@pytest.mark.parametrize("env_value", ["-1", "-1.0", " -1 "])
def test_ragged_buffer_factor_minus_one_spellings_are_the_same(env_value):
  r = recipe_lib.resolve(env={"RAGGED_BUFFER_FACTOR": env_value})
  assert r.recipe.engine.ragged_buffer_factor == -1.0
  r = recipe_lib.resolve(env={}, overrides=[f"engine.ragged_buffer_factor={env_value.strip()}"])
  assert r.recipe.engine.ragged_buffer_factor == -1.0


def test_wrong_type_in_recipe_is_refused(tmp_path):
  """Negative control: the same key with a whole number resolves."""
  path = tmp_path / "r.yaml"
  path.write_text("step_boundary:\n  disable_after: often\n")
  with pytest.raises(recipe_lib.RecipeError) as e:
    recipe_lib.resolve(path, env={})
  assert str(e.value) == "step_boundary.disable_after: expected int, got 'often'"
  path.write_text("step_boundary:\n  disable_after: 3\n")
  assert recipe_lib.resolve(path, env={}).recipe.step_boundary.disable_after == 3


#: Each word key, its ``Literal`` alias, and for each word the other keys that make a recipe using it whole.
WORD_KEYS = {
    "rollouts.source": (schema.RolloutSource, {"synthetic": [], "sampler": [],
                                               "recording": ["rollouts.recording=recordings/rig_small"]}),
    "rollouts.placement": (placement_rule.Placement, {"auto": [], "shared": [], "split": [], "process": []}),
    "trainer.location": (schema.TrainerLocation, {"local": [], "remote": ["trainer.spawn=true"]}),
}


@pytest.mark.parametrize("key, refusal", [
    ("rollouts.source", "rollouts.source='bogus': use one of 'synthetic', 'recording', 'sampler'"),
    ("rollouts.placement", "rollouts.placement='bogus': use one of auto, shared, split, process"),
    ("trainer.location", "trainer.location='bogus': use local or remote"),
])
def test_a_word_key_refuses_another_word_naming_the_words_it_takes(key, refusal):
  """The key's type is its alias, whose words the refusal names; negative control: each of those words
  resolves (with the keys it needs), taken as written."""
  alias, needs = WORD_KEYS[key]
  section, leaf = key.split(".")
  assert typing.get_type_hints(type(getattr(schema.Recipe(), section)))[leaf] == alias
  with pytest.raises(recipe_lib.RecipeError) as e:
    recipe_lib.resolve(env={}, overrides=[f"{key}=bogus"])
  assert str(e.value) == refusal
  assert set(needs) == set(typing.get_args(alias)) and all(word in refusal for word in typing.get_args(alias))
  for word, companions in needs.items():
    assert recipe_lib.get(recipe_lib.resolve(env={}, overrides=[f"{key}={word}", *companions]).recipe, key) == word


def test_a_word_key_takes_its_value_as_written_and_refuses_a_list(tmp_path):
  """``null`` does not unset a word key (it has no unset value): it is a word it does not take; a list in the
  recipe file is not a word at all."""
  with pytest.raises(recipe_lib.RecipeError) as e:
    recipe_lib.resolve(env={}, overrides=["rollouts.source=null"])
  assert str(e.value) == "rollouts.source='null': use one of 'synthetic', 'recording', 'sampler'"
  path = tmp_path / "r.yaml"
  path.write_text("rollouts:\n  placement: [auto]\n")
  with pytest.raises(recipe_lib.RecipeError) as e:
    recipe_lib.resolve(path, env={})
  assert str(e.value) == "rollouts.placement: expected a string, got list"


@pytest.mark.parametrize("given, taken", [("auto", "auto"), ("AUTO", "auto"), ("0.25", 0.25), ("0", 0.0)])
def test_the_wait_threshold_is_auto_or_seconds(given, taken):
  r = recipe_lib.resolve(env={}, overrides=[f"step_boundary.wait_threshold_s={given}"])
  assert r.recipe.step_boundary.wait_threshold_s == taken
  assert r.recipe.wait_threshold == (None if taken == "auto" else taken)


@pytest.mark.parametrize("given, refusal", [
    ("soon", "step_boundary.wait_threshold_s: expected float, got 'soon'"),
    ("-1", "step_boundary.wait_threshold_s=-1.0 is out of range: use 'auto' or a number >= 0"),
    ("null", "step_boundary.wait_threshold_s: a value is required"),
])
def test_the_wait_threshold_refuses_another_word_a_negative_number_and_none(given, refusal):
  with pytest.raises(recipe_lib.RecipeError) as e:
    recipe_lib.resolve(env={}, overrides=[f"step_boundary.wait_threshold_s={given}"])
  assert str(e.value) == refusal

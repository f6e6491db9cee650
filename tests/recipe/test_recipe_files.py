"""A recipe file: every shipped one validates; a key it does not know is refused with a suggestion, a key given
twice, YAML that does not parse and a directory each in one line naming where."""

from __future__ import annotations

import pytest

from orchestrator import recipe as recipe_lib
from tests.conftest import REPO

pytestmark = pytest.mark.spec

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def _write(tmp_path, text: str):
  path = tmp_path / "r.yaml"
  path.write_text(text)
  return path


def _refusal(path) -> str:
  with pytest.raises(recipe_lib.RecipeError) as e:
    recipe_lib.resolve(path, env={})
  return str(e.value)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(recipe):
  """A recipe for a model the user imports (its description says model.checkpoint=DIR) is refused without
  one, naming the key; every other validates as shipped."""
  if "model.checkpoint=DIR" in recipe.read_text():
    with pytest.raises(recipe_lib.RecipeError, match="needs model.checkpoint=DIR"):
      recipe_lib.resolve(recipe, env={})
    return
  resolved = recipe_lib.resolve(recipe, env={})
  assert resolved.recipe.name == recipe.stem


def test_unknown_recipe_key_is_refused_with_a_suggestion(tmp_path):
  """Negative control: spelled right, the key resolves."""
  path = _write(tmp_path, "step_boundary:\n  stage_befor_update: true\n")
  assert _refusal(path) == (f"recipe {path}: unknown key 'step_boundary.stage_befor_update'; did you mean"
                            " 'step_boundary.stage_before_update'?")
  _write(tmp_path, "step_boundary:\n  stage_before_update: true\n")
  assert recipe_lib.resolve(path, env={}).sources["step_boundary.stage_before_update"] == "recipe"


def test_duplicate_recipe_keys_are_refused(tmp_path):
  """Negative control: given once, the key resolves to that value."""
  path = _write(tmp_path, "model: tiny\nsteps: 2\nsteps: 3\n")
  refusal = _refusal(path)
  assert "key 'steps' appears twice (first on line 2); keep one" in refusal and "\n" not in refusal
  _write(tmp_path, "model: tiny\nsteps: 3\n")
  assert recipe_lib.resolve(path, env={}).recipe.steps == 3


def test_invalid_yaml_names_line_and_column(tmp_path):
  path = _write(tmp_path, "model: tiny\nsteps: [1, 2\nname: x\n")
  refusal = _refusal(path)
  assert refusal.startswith(f"recipe {path} is not valid YAML at line 3, column") and "\n" not in refusal


def test_recipe_path_that_is_a_directory_is_named_as_such(tmp_path):
  assert _refusal(tmp_path) == f"recipe {tmp_path} is a directory; pass a recipe YAML file"

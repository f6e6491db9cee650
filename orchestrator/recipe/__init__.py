"""Recipes: a typed schema, loading, layered overrides with provenance, and validation.

Precedence, lowest first: the recipe file (over the schema's defaults) <
environment switches < command-line flags < ``key=value`` overrides. Every
resolved key remembers where its value came from (``--print-config``).

Every problem a user can cause raises ``RecipeError`` with one message naming
the key, the value and the fix; nothing starts before validation passes.

The parts: ``schema`` (the plain sections, ``Recipe`` and its validation),
``model_section`` and ``task_section`` (the two sections validated by loading
files: checkpoints and tokenizers; datasets and rewards), ``checks``
(``RecipeError`` and the range checks the sections share), ``keys`` (dotted
keys over the schema: their types, coercion, ``build`` and ``get``) and
``loading`` (the file, environment switches, layering, ``resolve`` and the
printed and saved forms). Callers use the names re-exported here.
"""

from __future__ import annotations

from orchestrator.recipe.checks import RecipeError
from orchestrator.recipe.keys import all_keys, build, canonical, coerce, flatten, get, parse_bool, suggest
from orchestrator.recipe.loading import (DEFAULT_RECIPE, DERIVED, ENV_SWITCHES, PROCESS_IDENTITY_KEYS, RECIPES_DIR,
                                         ResolvedRecipe, format_config, read_recipe_file, resolve, run_config_dict,
                                         saved_config, to_dict)
from orchestrator.recipe.model_section import ModelSection
from orchestrator.recipe.schema import (PLACEMENTS, ROLLOUT_SOURCES, BatchSection, CheckpointSection,
                                        DistributedSection, MeshSection, Recipe, RolloutsSection, RunSection,
                                        SimulateSection, StepBoundarySection, TrainerSection, validate)
from orchestrator.recipe.task_section import TaskSection

__all__ = [
    "BatchSection", "CheckpointSection", "DEFAULT_RECIPE", "DERIVED", "DistributedSection", "ENV_SWITCHES",
    "MeshSection", "ModelSection", "PLACEMENTS", "PROCESS_IDENTITY_KEYS", "RECIPES_DIR", "ROLLOUT_SOURCES", "Recipe", "RecipeError",
    "ResolvedRecipe", "RolloutsSection", "RunSection", "SimulateSection", "StepBoundarySection", "TaskSection",
    "TrainerSection", "all_keys", "build", "canonical", "coerce", "flatten", "format_config", "get", "parse_bool",
    "read_recipe_file", "resolve", "run_config_dict", "saved_config", "suggest", "to_dict", "validate",
]

"""Recipes: a typed schema, loading, layered overrides with provenance, and validation.

Precedence, lowest first: the recipe file (over the schema's defaults) <
environment switches < command-line flags < ``key=value`` overrides. Every
resolved key remembers where its value came from (``--print-config``).

Every problem a user can cause raises ``RecipeError`` with one message naming
the key, the value and the fix; nothing starts before validation passes.

The parts: ``schema`` (the sections, ``Recipe`` and its validation), ``keys``
(dotted keys over the schema: their types, coercion, ``build`` and ``get``) and
``loading`` (the file, environment switches, layering, ``resolve`` and the
printed and saved forms). Callers use the names re-exported here.
"""

from __future__ import annotations

from orchestrator.recipe.keys import all_keys, build, canonical, coerce, flatten, get, parse_bool, suggest
from orchestrator.recipe.loading import (DEFAULT_RECIPE, DERIVED, ENV_SWITCHES, PROCESS_IDENTITY_KEYS, RECIPES_DIR,
                                         ResolvedRecipe, format_config, read_recipe_file, resolve, run_config_dict,
                                         saved_config, to_dict)
from orchestrator.recipe.schema import (PLACEMENTS, ROLLOUT_SOURCES, BatchSection, CheckpointSection,
                                        DistributedSection, MeshSection, ModelSection, Recipe, RecipeError,
                                        RolloutsSection, RunSection, SimulateSection, StepBoundarySection, TaskSection,
                                        TrainerSection, validate)

__all__ = [
    "BatchSection", "CheckpointSection", "DEFAULT_RECIPE", "DERIVED", "DistributedSection", "ENV_SWITCHES",
    "MeshSection", "ModelSection", "PLACEMENTS", "PROCESS_IDENTITY_KEYS", "RECIPES_DIR", "ROLLOUT_SOURCES", "Recipe", "RecipeError",
    "ResolvedRecipe", "RolloutsSection", "RunSection", "SimulateSection", "StepBoundarySection", "TaskSection",
    "TrainerSection", "all_keys", "build", "canonical", "coerce", "flatten", "format_config", "get", "parse_bool",
    "read_recipe_file", "resolve", "run_config_dict", "saved_config", "suggest", "to_dict", "validate",
]

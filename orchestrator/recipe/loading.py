"""Loading a recipe: the file, environment switches, flags and overrides, layered with provenance.

Precedence, lowest first: the recipe file (over the schema's defaults) <
environment switches < command-line flags < ``key=value`` overrides. Every
resolved key remembers where its value came from (``--print-config``), and the
result is validated before anything starts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from orchestrator.recipe.keys import all_keys, build, canonical, coerce, flatten, get, is_text_key, suggest
from orchestrator.recipe.checks import RecipeError
from orchestrator.recipe.schema import LIVE_ONLY_KEYS, Recipe, validate

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_RECIPE = RECIPES_DIR / "default.yaml"


class _UniqueKeyLoader(yaml.SafeLoader):
  """A safe loader that refuses a key given twice in one mapping (the last would silently win)."""


def _mapping_without_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
  seen: dict[Any, int] = {}
  for key_node, _ in node.value:
    key = loader.construct_object(key_node, deep=deep)
    if key in seen:
      raise yaml.constructor.ConstructorError(
          None, None, f"key {key!r} appears twice (first on line {seen[key] + 1}); keep one", key_node.start_mark)
    seen[key] = key_node.start_mark.line
  return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def read_recipe_file(path: str | Path) -> dict[str, Any]:
  """The recipe file's keys (dotted); RecipeError for a missing file or bad YAML."""
  path = Path(path)
  if path.is_dir():
    raise RecipeError(f"recipe {path} is a directory; pass a recipe YAML file")
  if not path.is_file():
    available = ", ".join(sorted(p.name for p in RECIPES_DIR.glob("*.yaml")))
    raise RecipeError(f"recipe {path} does not exist; shipped recipes in {RECIPES_DIR}: {available}")
  try:
    text = path.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise RecipeError(f"recipe {path} is not UTF-8 text (byte {e.start}); save it as UTF-8 YAML") from None
  except OSError as e:
    raise RecipeError(f"recipe {path} cannot be read: {e.strerror}; check its permissions") from None
  try:
    raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
  except yaml.MarkedYAMLError as e:
    mark = e.problem_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
    raise RecipeError(f"recipe {path} is not valid YAML at {where}: {e.problem}") from None
  except yaml.YAMLError as e:
    raise RecipeError(f"recipe {path} is not valid YAML: {e}") from None
  if raw is None:
    raw = {}
  if not isinstance(raw, dict):
    raise RecipeError(f"recipe {path} must be a mapping of keys, got {type(raw).__name__}")
  return flatten(raw, where=f"recipe {path}")


#: The environment variable that names a process's place in a job started elsewhere.
PROCESS_ID_ENV = "STEP_BOUNDARY_PROCESS_ID"
ENV_SWITCHES = {
    "PIPELINE_STEP_BOUNDARY": "step_boundary.pipeline_step_boundary",
    "STAGE_NEXT_MICROBATCH": "step_boundary.stage_next_microbatch",
    "STAGE_BEFORE_UPDATE": "step_boundary.stage_before_update",
    "RAGGED_BUFFER_FACTOR": "engine.ragged_buffer_factor",
    "RETRY_WHEN_TOKENS_DROPPED": "engine.retry_when_tokens_dropped",
    # A process's identity in a job started elsewhere (a launcher sets these per process).
    PROCESS_ID_ENV: "distributed.process_id",
    "STEP_BOUNDARY_COORDINATOR_ADDRESS": "distributed.coordinator_address",
}
#: Keys that name one process, never the run: not saved with it, taken anew (environment) on resume.
PROCESS_IDENTITY_KEYS = ("distributed.process_id", "distributed.coordinator_address")
#: Keys the processes of one job may set differently: their identity, and the outputs only process 0 writes
#: (its run directory becomes every process's when it claims it; it alone writes a recording). Not
#: ``checkpoint.directory``: every process writes its shards of each checkpoint there, so it must be one
#: directory every process names alike.
PER_PROCESS_KEYS = (*PROCESS_IDENTITY_KEYS, "run.out", "rollouts.record_to")


#: Pairs of keys a recipe sets at most one of: the same thing named two ways (a model by its preset or its
#: checkpoint, an earlier spelling and its successor), or a key the other reads from elsewhere (a cluster that
#: is detected names the job's size and each process itself). A key counts as set when it differs from its
#: default. Given in different layers (the recipe file, the environment, a flag, a ``key=value``), the higher
#: layer's key wins and the lower one's is dropped; given in one layer, the recipe's checks decide (a preset
#: beside a checkpoint must agree with it; the others are refused, naming both).
EXCLUSIVE_KEYS = (
    ("model.preset", "model.checkpoint"),
    ("simulate.map_s", "simulate.input_copy_s"),
    ("simulate.update_overlap_share", "simulate.update_waits_for_last"),
    ("distributed.detect_cluster", "distributed.num_processes"),
    ("distributed.detect_cluster", "distributed.process_id"),
    ("distributed.detect_cluster", "distributed.coordinator_address"),
)
#: Each layer's rank by the first word of its keys' source, lowest first.
LAYER_RANKS = {"recipe": 0, "env": 1, "flag": 2, "override": 3}


@dataclasses.dataclass
class ResolvedRecipe:
  """A recipe with each key's source; what the command line changed of the file, and what it dropped of it.

  Attributes:
    sources: dotted key -> "default" | "recipe" | "env NAME" | "flag --x" | "override", or for a key dropped
      for a higher layer's, "default (dropped ...)"; a size derived at the run's start, "derived: ...".
    changes: ``key=value`` for each key the environment or the command line set (not one process's keys).
    dropped: one phrase per key dropped for another key of a higher layer (``EXCLUSIVE_KEYS``).
  """

  recipe: Recipe
  sources: dict[str, str]
  path: str
  changes: tuple[str, ...] = ()
  dropped: tuple[str, ...] = ()


def _override_value(key: str, raw: str) -> Any:
  """An override's value: as written for a text key (a regular expression such as ``[0-9]+`` or ``#### \\d+``, a
  path, a name: ``null`` or ``none`` still unset an optional one), else as YAML reads it (``[1, 2]`` is a
  list), text YAML cannot read taken as written (the key's type checks it).

  Raises:
    RecipeError: no value (``key=``: an unset shell variable, most likely), which would unset the key silently.
  """
  if not raw.strip():
    raise RecipeError(f"override {key}= has no value; give one, or {key}=null to leave it unset")
  if is_text_key(key):
    return raw
  try:
    return yaml.safe_load(raw)
  except yaml.YAMLError:
    return raw


def resolve(
    recipe_path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    overrides: list[str] | None = None,
) -> ResolvedRecipe:
  """Layers defaults < recipe < environment < flags < ``key=value`` and validates the result.

  ``recipe_path`` None reads ``DEFAULT_RECIPE``; ``env`` None reads ``os.environ``. ``flags`` maps dotted
  keys to ``(value, flag)``, the flag's name (``--steps``) recorded as the key's source.

  Raises:
    RecipeError: an unreadable recipe, an unknown key, a value of the wrong type, or a recipe that fails validation.
  """
  path = Path(recipe_path) if recipe_path else DEFAULT_RECIPE
  values: dict[str, Any] = {}
  sources: dict[str, str] = {}
  for key, value in read_recipe_file(path).items():
    values[key], sources[key] = coerce(key, value), "recipe"
  env = os.environ if env is None else env
  for name, key in ENV_SWITCHES.items():
    if name in env and env[name] != "":
      try:
        values[key] = coerce(key, env[name])
      except RecipeError as e:
        raise RecipeError(f"environment {name}={env[name]!r}: {e}") from None
      sources[key] = f"env {name}"
  for key, (value, flag) in (flags or {}).items():
    values[key], sources[key] = coerce(key, value), f"flag {flag}"
  for item in overrides or []:
    if "=" not in item:
      raise RecipeError(f"override {item!r} is not key=value (e.g. engine.learning_rate=3e-4)")
    key, raw = item.split("=", 1)
    key = canonical(key.strip())
    if key not in set(all_keys()):
      raise RecipeError(f"override {item!r}: unknown key {key!r}{suggest(key)}")
    values[key] = coerce(key, _override_value(key, raw))
    sources[key] = "override"
  dropped = _drop_outranked(values, sources) + _drop_live_keys_of_a_replaced_sampler(values, sources)
  changes = _changes(values, sources)
  _mark_description(values, sources, changes)
  recipe = build(values)
  _derive_decay(recipe, sources)
  for key in all_keys():
    sources.setdefault(key, "default")
  validate(recipe)
  _refuse_ignored_switches(recipe, sources)
  return ResolvedRecipe(recipe, sources, str(path), changes=changes, dropped=dropped)


def _derive_decay(recipe: Recipe, sources: dict[str, str]) -> None:
  """A decaying learning rate without ``engine.decay_steps`` decays over the run's steps after the warm-up (at
  least one); config.json records the value as derived, and a resume keeps it (an extended run's schedule is the
  one its start ran)."""
  engine = recipe.engine
  if engine.lr_schedule != "constant" and engine.decay_steps is None:
    engine.decay_steps = max(1, recipe.steps - engine.warmup_steps)
    sources["engine.decay_steps"] = f"{DERIVED} the run's {recipe.steps} steps after its warm-up"


def _shown(value: Any) -> str:
  """A value as one short line of YAML (as ``--print-config`` shows it)."""
  return yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip().removesuffix("...").strip()


def _is_set(key: str, value: Any) -> bool:
  return value != get(Recipe(), key)


def _drop_live_keys_of_a_replaced_sampler(values: dict[str, Any], sources: dict[str, str]) -> tuple[str, ...]:
  """A live recipe whose sampler the environment or the command line replaces (``rollouts.source=synthetic`` on
  the default recipe): the recipe file's live-only keys go back to their defaults, each source saying why, as
  its other live settings (staleness, groups) go unread. The same keys given in the layer that replaces the
  sampler, or above it, are still refused (they would be ignored)."""
  source_layer = sources.get("rollouts.source", "default").split()[0]
  if values.get("rollouts.source", "synthetic") == "sampler" or source_layer in ("default", "recipe"):
    return ()
  dropped = []
  for key in LIVE_ONLY_KEYS:
    if key in values and sources.get(key) == "recipe" and _is_set(key, values[key]):
      dropped.append(_drop(values, sources, key, f"rollouts.source={_shown(values['rollouts.source'])}"
                                                 f" ({sources['rollouts.source']}) samples nothing, so the recipe's"
                                                 f" {key}={_shown(values[key])} is not read"))
  return tuple(dropped)


def _drop(values: dict[str, Any], sources: dict[str, str], key: str, phrase: str) -> str:
  """``key`` back to its default, its source saying why (``phrase``, returned)."""
  del values[key]
  sources[key] = f"default (dropped: {phrase})"
  return phrase


def _drop_outranked(values: dict[str, Any], sources: dict[str, str]) -> tuple[str, ...]:
  """For each pair of ``EXCLUSIVE_KEYS`` both set, in different layers: the lower layer's key is dropped (back
  to its default, its source saying why). Returns what was dropped, one phrase each."""
  dropped = []
  for pair in EXCLUSIVE_KEYS:
    if not all(key in values and _is_set(key, values[key]) for key in pair):
      continue
    lower, higher = sorted(pair, key=lambda key: LAYER_RANKS[sources[key].split()[0]])
    if LAYER_RANKS[sources[lower].split()[0]] == LAYER_RANKS[sources[higher].split()[0]]:
      continue  # one layer names both: the recipe's checks refuse it (or check that they agree)
    dropped.append(_drop(values, sources, lower, f"{higher}={_shown(values[higher])} ({sources[higher]}) replaces"
                                                 f" {lower}={_shown(values[lower])} ({sources[lower]})"))
  return tuple(dropped)


def _changes(values: Mapping[str, Any], sources: Mapping[str, str]) -> tuple[str, ...]:
  """``key=value`` for each key the environment, a flag or an override set, in the schema's order; not the keys
  that name one process or its outputs (``PER_PROCESS_KEYS``: they change where a run writes, not what it is)."""
  return tuple(f"{key}={_shown(values[key])}" for key in all_keys()
               if key in values and sources[key] != "recipe" and key not in (*PER_PROCESS_KEYS, "description"))


def _mark_description(values: dict[str, Any], sources: dict[str, str], changes: tuple[str, ...]) -> None:
  """The recipe file's description, with what the environment or the command line changed appended: as
  written it describes the recipe, which this run is not (a description given on the command line is kept)."""
  if sources.get("description") != "recipe" or not values["description"] or not changes:
    return
  values["description"] = f"{values['description']} (with overrides: {', '.join(changes)})"
  sources["description"] = "recipe, with this run's overrides appended"


def _refuse_ignored_switches(recipe: Recipe, sources: Mapping[str, str]) -> None:
  """A switch given on the command line or in the environment that the mode would silently ignore."""
  sb = recipe.step_boundary
  given = sources.get("step_boundary.stage_before_update", "default")
  if not sb.pipeline_step_boundary and sb.stage_before_update and given not in ("default", "recipe"):
    raise RecipeError(
        f"step_boundary.stage_before_update ({given}) has no effect with"
        f" step_boundary.pipeline_step_boundary=false ({sources.get('step_boundary.pipeline_step_boundary')}):"
        " the mode is OFF, which stages nothing; drop one of the two")


def to_dict(recipe: Recipe) -> dict[str, Any]:
  """The recipe as nested plain data (one dict per section)."""
  return dataclasses.asdict(recipe)


def run_config_dict(recipe: Recipe) -> dict[str, Any]:
  """The recipe as a run saves it (``config.json``): without the keys that name one process of a job."""
  out = to_dict(recipe)
  for key in PROCESS_IDENTITY_KEYS:
    section, leaf = key.split(".")
    out[section][leaf] = None
  return out


#: How a size's source starts in config.json when the run derived its value (``Recipe.derived_sizes``).
DERIVED = "derived:"


#: Directories a run writes that a recipe may name relative to the working directory: config.json holds them
#: absolute, so a resume from another directory writes where the run wrote.
OUTPUT_PATH_KEYS = ("checkpoint.directory", "rollouts.record_to")


def saved_config(resolved: ResolvedRecipe) -> tuple[dict[str, Any], dict[str, str]]:
  """What config.json holds of a run: its recipe (``run_config_dict``) with the value of each size it derives
  and its output directories absolute, and each key's source (a derived one's ``"derived: ..."``)."""
  config, sources = run_config_dict(resolved.recipe), dict(resolved.sources)
  for key, (value, source) in resolved.recipe.derived_sizes().items():
    section, leaf = key.split(".")
    config[section][leaf], sources[key] = value, source
  for key in OUTPUT_PATH_KEYS:
    section, leaf = key.split(".")
    given = config[section][leaf]
    if given is not None and not Path(given).expanduser().is_absolute():
      config[section][leaf] = str(Path(given).expanduser().absolute())
      sources[key] = f"{sources[key]}, {given} made absolute"
  return config, sources


def job_settings(recipe: Recipe) -> dict[str, Any]:
  """Every key of ``recipe`` that the processes of a job must agree on, in the schema's order, with its value
  (all but ``PER_PROCESS_KEYS``, and the description: prose that carries the overrides, so two processes whose
  keys differ are named by the key itself, not by their descriptions)."""
  return {key: get(recipe, key) for key in all_keys() if key not in (*PER_PROCESS_KEYS, "description")}


def format_config(resolved: ResolvedRecipe) -> str:
  """Every key with its value and where the value came from (for ``--print-config``)."""
  lines = [f"# recipe: {resolved.path}", f"# mode: {resolved.recipe.mode.name}"]
  width = max(len(k) for k in all_keys())
  for key in all_keys():
    shown = _shown(get(resolved.recipe, key))
    lines.append(f"{key:<{width}}  {shown:<24}  # {resolved.sources[key]}")
  return "\n".join(lines)

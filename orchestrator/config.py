"""Recipes: a typed schema, loading, layered overrides with provenance, and validation.

Precedence, lowest first: the recipe file (over the schema's defaults) <
environment switches < command-line flags < ``key=value`` overrides. Every
resolved key remembers where its value came from (``--print-config``).

Every problem a user can cause raises ``RecipeError`` with one message naming
the key, the value and the fix; nothing starts before validation passes.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from orchestrator.engine.options import EngineOptions
from policies import Mode

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_RECIPE = RECIPES_DIR / "default.yaml"


class RecipeError(ValueError):
  """A recipe, flag, override or environment switch that cannot be used as given."""


@dataclasses.dataclass
class MeshSection:
  """Device mesh axis sizes; their product is the number of devices."""

  fsdp: int = 1
  context: int = 1
  expert: int = 1


@dataclasses.dataclass
class BatchSection:
  """The shape of one optimizer step."""

  micro_batches_per_step: int = 3
  rows: int | None = None  # None: the model preset's
  tokens_per_row: int | None = None


_ENGINE = EngineOptions()


@dataclasses.dataclass
class EngineSection:
  """Optimizer, loss and in-flight settings of the training engine (defaults: EngineOptions')."""

  learning_rate: float = _ENGINE.learning_rate
  weight_decay: float = _ENGINE.weight_decay
  max_grad_norm: float = _ENGINE.max_grad_norm
  clip_eps_low: float = _ENGINE.clip_eps_low
  clip_eps_high: float = _ENGINE.clip_eps_high
  max_inflight: int = _ENGINE.max_inflight
  seed: int = _ENGINE.seed
  ragged_buffer_factor: float = _ENGINE.ragged_buffer_factor  # -1: fully dropless MoE routing
  retry_when_tokens_dropped: bool = _ENGINE.retry_when_tokens_dropped
  skip_nonfinite_updates: bool = _ENGINE.skip_nonfinite_updates


@dataclasses.dataclass
class RolloutsSection:
  """Where each step's trajectories come from."""

  source: str = "synthetic"  # synthetic | recording
  recording: str | None = None
  seed: int = 0
  generations_per_group: int = 4
  fill: float = 0.85
  # Shape of recordings made by `run_rl record` (log-normal lengths, medians in tokens).
  groups: int = 256
  prompt_len_median: float = 24.0
  completion_len_median: float = 16.0


@dataclasses.dataclass
class CheckpointSection:
  """Checkpoint directory, cadence, and the steps whose checkpoints are scored."""

  directory: str | None = None
  every: int = 0  # 0: only the scored steps
  scored_steps: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StepBoundarySection:
  """The switches of the step-boundary scheduler (README: one section each)."""

  pipeline_step_boundary: bool = True
  stage_next_microbatch: bool | None = None  # None: follows pipeline_step_boundary
  stage_before_update: bool = True
  require_staging: bool = False
  wait_threshold_s: float | str = "auto"
  disable_after: int = 2
  reprobe_every: int | None = None
  exclude_checkpoint_boundaries: bool = True
  sync_before_next_step: bool = False
  calibration_samples: int = 8


@dataclasses.dataclass
class SimulateSection:
  """Component times for ``run_rl simulate`` (seconds), in place of a calibration."""

  micro_batch_s: float = 1.0
  input_copy_s: float = 0.07
  update_s: float = 0.05
  metrics_s: float = 0.2
  wait_floor_s: float = 0.0
  dispatch_s: float = 0.0005
  update_waits_for_last: bool = False
  tokens_per_device: int | None = None  # None: rows × tokens_per_row ÷ devices


@dataclasses.dataclass
class RunSection:
  """Where outputs go and how the host is set up."""

  out: str | None = None  # None: runs/<recipe name>-<time>
  reserve_host_core: bool = True


@dataclasses.dataclass
class Recipe:
  """A full run description; ``recipes/*.yaml`` set any subset of it."""

  name: str = "unnamed"
  description: str = ""
  model: str = "small"
  steps: int = 6
  mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
  batch: BatchSection = dataclasses.field(default_factory=BatchSection)
  engine: EngineSection = dataclasses.field(default_factory=EngineSection)
  rollouts: RolloutsSection = dataclasses.field(default_factory=RolloutsSection)
  checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
  step_boundary: StepBoundarySection = dataclasses.field(default_factory=StepBoundarySection)
  simulate: SimulateSection = dataclasses.field(default_factory=SimulateSection)
  run: RunSection = dataclasses.field(default_factory=RunSection)

  # ---------------------------------------------------------------- derived
  @property
  def staging_requested(self) -> bool:
    sb = self.step_boundary
    return sb.pipeline_step_boundary if sb.stage_next_microbatch is None else sb.stage_next_microbatch

  @property
  def mode(self) -> Mode:
    """The policy mode the switches select."""
    sb = self.step_boundary
    if not sb.pipeline_step_boundary:
      return Mode.OFF
    if not self.staging_requested:
      return Mode.PIPELINED
    return Mode.STAGE_BEFORE_UPDATE if sb.stage_before_update else Mode.STAGE_AFTER_UPDATE

  @property
  def wait_threshold(self) -> float | None:
    t = self.step_boundary.wait_threshold_s
    return None if t == "auto" else float(t)

  @property
  def excluded_steps(self) -> list[int]:
    """Boundaries (by step index) the policy must not stage across."""
    if not self.step_boundary.exclude_checkpoint_boundaries:
      return []
    return sorted({n - 1 for n in self.checkpoint.scored_steps})


# ------------------------------------------------------------------ schema walking
def _fields(cls) -> dict[str, dataclasses.Field]:
  return {f.name: f for f in dataclasses.fields(cls)}


def _hints(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def all_keys(cls=Recipe, prefix: str = "") -> list[str]:
  """Every dotted leaf key of the schema."""
  keys = []
  hints = _hints(cls)
  for name in _fields(cls):
    t = hints[name]
    if dataclasses.is_dataclass(t):
      keys += all_keys(t, f"{prefix}{name}.")
    else:
      keys.append(prefix + name)
  return keys


def _leaf_type(path: str):
  cls = Recipe
  parts = path.split(".")
  for part in parts[:-1]:
    cls = _hints(cls)[part]
  return _hints(cls)[parts[-1]]


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_bool(value: Any, key: str) -> bool:
  if isinstance(value, bool):
    return value
  if isinstance(value, int) and value in (0, 1):
    return bool(value)
  text = str(value).strip().lower()
  if text in _TRUE:
    return True
  if text in _FALSE:
    return False
  raise RecipeError(f"{key}: expected a boolean (true/false/1/0/yes/no), got {value!r}")


def _parse_number(value: Any, kind: type, key: str):
  if isinstance(value, bool):
    raise RecipeError(f"{key}: expected {kind.__name__}, got boolean {value}")
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    number = value
  else:
    try:
      number = float(str(value).strip())
    except ValueError:
      raise RecipeError(f"{key}: expected {kind.__name__}, got {value!r}") from None
  if kind is int:
    if float(number) != int(float(number)):
      raise RecipeError(f"{key}: expected a whole number, got {value!r}")
    return int(float(number))
  return float(number)


def coerce(key: str, value: Any) -> Any:
  """``value`` (from YAML, an env var or the command line) as the schema's type for ``key``."""
  t = _leaf_type(key)
  origin = typing.get_origin(t)
  args = typing.get_args(t)
  if origin in (typing.Union, types.UnionType):
    options = [a for a in args if a is not type(None)]
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
      if type(None) in args:
        return None
      raise RecipeError(f"{key}: a value is required")
    if key == "step_boundary.wait_threshold_s":
      if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
      return _parse_number(value, float, key)
    errors = []
    for option in options:
      try:
        return _coerce_plain(key, option, value)
      except RecipeError as e:
        errors.append(str(e))
    raise RecipeError(errors[0])
  return _coerce_plain(key, t, value)


def _coerce_plain(key: str, t: Any, value: Any) -> Any:
  if t is bool:
    return parse_bool(value, key)
  if t in (int, float):
    return _parse_number(value, t, key)
  if t is str:
    if isinstance(value, (dict, list)):
      raise RecipeError(f"{key}: expected a string, got {type(value).__name__}")
    return str(value)
  if typing.get_origin(t) is list:
    (item,) = typing.get_args(t)
    if isinstance(value, str):
      value = [v for v in value.replace(",", " ").split() if v]
    if not isinstance(value, list):
      raise RecipeError(f"{key}: expected a list, got {value!r}")
    return [_coerce_plain(f"{key}[{i}]", item, v) for i, v in enumerate(value)]
  raise RecipeError(f"{key}: unsupported type {t}")  # pragma: no cover


def suggest(key: str) -> str:
  close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
  if not close:
    leaf = key.rsplit(".", 1)[-1]
    close = [k for k in all_keys() if k.rsplit(".", 1)[-1] == leaf]
  return f"; did you mean {close[0]!r}?" if close else ""


def flatten(tree: Mapping[str, Any], prefix: str = "", where: str = "recipe") -> dict[str, Any]:
  """Dotted keys of a nested mapping, refusing keys the schema does not know."""
  out = {}
  known = set(all_keys())
  for name, value in tree.items():
    key = f"{prefix}{name}"
    if isinstance(value, Mapping) and key in _section_paths():
      out.update(flatten(value, f"{key}.", where))
    elif key in known:
      out[key] = value
    else:
      raise RecipeError(f"{where}: unknown key {key!r}{suggest(key)}")
  return out


def _section_paths() -> set[str]:
  return {k.rsplit(".", 1)[0] for k in all_keys() if "." in k}


# ------------------------------------------------------------------ loading
def read_recipe_file(path: str | Path) -> dict[str, Any]:
  """The recipe file's keys (dotted); RecipeError for a missing file or bad YAML."""
  path = Path(path)
  if not path.is_file():
    available = ", ".join(sorted(p.name for p in RECIPES_DIR.glob("*.yaml")))
    raise RecipeError(f"recipe {path} does not exist; shipped recipes in {RECIPES_DIR}: {available}")
  try:
    raw = yaml.safe_load(path.read_text())
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


ENV_SWITCHES = {
    "PIPELINE_STEP_BOUNDARY": "step_boundary.pipeline_step_boundary",
    "STAGE_NEXT_MICROBATCH": "step_boundary.stage_next_microbatch",
    "STAGE_BEFORE_UPDATE": "step_boundary.stage_before_update",
    "RAGGED_BUFFER_FACTOR": "engine.ragged_buffer_factor",
    "RETRY_WHEN_TOKENS_DROPPED": "engine.retry_when_tokens_dropped",
}


@dataclasses.dataclass
class ResolvedRecipe:
  recipe: Recipe
  sources: dict[str, str]  # dotted key -> "default" | "recipe" | "env NAME" | "flag --x" | "override"
  path: str


def resolve(
    recipe_path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    overrides: list[str] | None = None,
) -> ResolvedRecipe:
  """Layers defaults < recipe < environment < flags < ``key=value`` and validates the result.

  ``flags`` maps dotted keys to values with the flag's name in ``flag_names``.
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
    key = key.strip()
    if key not in set(all_keys()):
      raise RecipeError(f"override {item!r}: unknown key {key!r}{suggest(key)}")
    values[key] = coerce(key, yaml.safe_load(raw) if raw.strip() else raw)
    sources[key] = "override"
  recipe = build(values)
  for key in all_keys():
    sources.setdefault(key, "default")
  validate(recipe)
  return ResolvedRecipe(recipe, sources, str(path))


def build(values: Mapping[str, Any]) -> Recipe:
  recipe = Recipe()
  for key, value in values.items():
    target = recipe
    *parents, leaf = key.split(".")
    for part in parents:
      target = getattr(target, part)
    setattr(target, leaf, value)
  return recipe


def get(recipe: Recipe, key: str) -> Any:
  target = recipe
  for part in key.split("."):
    target = getattr(target, part)
  return target


# ------------------------------------------------------------------ validation
def validate(recipe: Recipe) -> None:
  """Raises RecipeError for out-of-range values and contradictory settings."""
  def at_least(key, minimum):
    value = get(recipe, key)
    if value is not None and value < minimum:
      raise RecipeError(f"{key}={value} is out of range: it must be >= {minimum}")

  for key in ("steps", "batch.micro_batches_per_step", "mesh.fsdp", "mesh.context", "mesh.expert",
              "engine.max_inflight", "step_boundary.disable_after", "step_boundary.calibration_samples",
              "rollouts.generations_per_group"):
    at_least(key, 1)
  for key in ("batch.rows", "batch.tokens_per_row", "step_boundary.reprobe_every", "rollouts.groups",
              "rollouts.prompt_len_median", "rollouts.completion_len_median"):
    at_least(key, 1)
  for key in ("checkpoint.every",):
    at_least(key, 0)
  for key in ("engine.learning_rate", "engine.max_grad_norm"):
    if get(recipe, key) <= 0:
      raise RecipeError(f"{key}={get(recipe, key)} is out of range: it must be > 0")
  for key in ("engine.clip_eps_low", "engine.clip_eps_high", "engine.weight_decay"):
    at_least(key, 0)
  if not 0 < recipe.rollouts.fill <= 1:
    raise RecipeError(f"rollouts.fill={recipe.rollouts.fill} is out of range: it must be in (0, 1]")
  t = recipe.step_boundary.wait_threshold_s
  if t != "auto" and t < 0:
    raise RecipeError(f"step_boundary.wait_threshold_s={t} is out of range: use 'auto' or a number >= 0")
  factor = recipe.engine.ragged_buffer_factor
  if factor != -1 and factor <= 0:
    raise RecipeError(
        f"engine.ragged_buffer_factor={factor} is out of range: use -1 (fully dropless) or a"
        " capacity factor > 0"
    )
  sb = recipe.step_boundary
  if sb.stage_next_microbatch and not sb.pipeline_step_boundary:
    raise RecipeError(
        "step_boundary.stage_next_microbatch=true needs step_boundary.pipeline_step_boundary=true:"
        " staging moves work across a pipelined boundary; turn pipelining on, or staging off"
    )
  if sb.require_staging and not recipe.staging_requested:
    raise RecipeError(
        "step_boundary.require_staging=true but staging is off"
        f" ({'pipeline_step_boundary' if not sb.pipeline_step_boundary else 'stage_next_microbatch'}"
        "=false); turn staging on or drop require_staging"
    )
  if recipe.rollouts.source not in ("synthetic", "recording"):
    raise RecipeError(
        f"rollouts.source={recipe.rollouts.source!r}: use 'synthetic' or 'recording'"
    )
  if recipe.rollouts.source == "recording" and not recipe.rollouts.recording:
    raise RecipeError("rollouts.source=recording needs rollouts.recording=DIR")
  bad_scored = [n for n in recipe.checkpoint.scored_steps if not 1 <= n <= recipe.steps]
  if bad_scored:
    raise RecipeError(
        f"checkpoint.scored_steps {bad_scored} are outside the run's steps 1..{recipe.steps}"
    )
  if (recipe.checkpoint.every or recipe.checkpoint.scored_steps) and not recipe.checkpoint.directory:
    raise RecipeError(
        "checkpoints are asked for (checkpoint.every or checkpoint.scored_steps) but"
        " checkpoint.directory is unset; set a directory"
    )
  from orchestrator.engine.presets import available_presets, load_preset  # no JAX import

  if recipe.model not in available_presets():
    raise RecipeError(
        f"model={recipe.model!r} is not a preset; available: {', '.join(available_presets())}"
    )
  preset = load_preset(recipe.model)
  if recipe.engine.retry_when_tokens_dropped and not preset.is_moe:
    raise RecipeError(
        f"engine.retry_when_tokens_dropped=true needs an MoE model, but {recipe.model!r} is"
        " dense; pick an MoE preset or turn the retry off"
    )
  if recipe.engine.retry_when_tokens_dropped and factor == -1:
    raise RecipeError(
        "engine.retry_when_tokens_dropped=true with engine.ragged_buffer_factor=-1 (fully"
        " dropless) has nothing to retry; set a capacity factor > 0 or turn the retry off"
    )
  rows = recipe.batch.rows or preset.rows
  tokens = recipe.batch.tokens_per_row or preset.tokens_per_row
  row_shards = recipe.mesh.fsdp * recipe.mesh.expert
  if rows % row_shards:
    raise RecipeError(
        f"batch.rows={rows} does not split over mesh.fsdp×mesh.expert={row_shards};"
        f" use a multiple of {row_shards}"
    )
  if tokens % recipe.mesh.context:
    raise RecipeError(
        f"batch.tokens_per_row={tokens} does not split over mesh.context={recipe.mesh.context}"
    )


def to_dict(recipe: Recipe) -> dict[str, Any]:
  return dataclasses.asdict(recipe)


def format_config(resolved: ResolvedRecipe) -> str:
  """Every key with its value and where the value came from (for ``--print-config``)."""
  lines = [f"# recipe: {resolved.path}", f"# mode: {resolved.recipe.mode.name}"]
  width = max(len(k) for k in all_keys())
  for key in all_keys():
    value = get(resolved.recipe, key)
    lines.append(f"{key:<{width}}  {yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip():<24}  # {resolved.sources[key]}")
  return "\n".join(lines)

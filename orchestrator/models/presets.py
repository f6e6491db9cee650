"""Model presets: named model configurations (Qwen3 unless ``family`` says otherwise) read from
``configs/model/*.yaml``."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import yaml

from orchestrator.models.families import DEFAULT_FAMILY, FAMILIES

#: Where presets are looked up unless ``STEP_BOUNDARY_CONFIGS`` names another folder.
DEFAULT_CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
#: The environment variable that names another folder of presets.
CONFIGS_ENV = "STEP_BOUNDARY_CONFIGS"


def configs_dir() -> Path:
  """The folder holding ``model/*.yaml``: ``$STEP_BOUNDARY_CONFIGS`` or the repository's ``configs/``."""
  override = os.environ.get(CONFIGS_ENV)
  return Path(override) if override else DEFAULT_CONFIGS_DIR


@dataclasses.dataclass(frozen=True)
class ModelPreset:
  """One model preset: the model's family and shape plus the batch shape it is sized for."""

  name: str
  num_layers: int
  vocab_size: int
  embed_dim: int
  hidden_dim: int
  num_heads: int
  head_dim: int
  num_kv_heads: int
  rope_theta: float = 1_000_000
  norm_eps: float = 1e-6
  use_tied_embedding: bool = False
  num_experts: int | None = None
  num_experts_per_tok: int | None = None
  family: str = DEFAULT_FAMILY  # a key of orchestrator.models.families.FAMILIES
  # Families with sliding-window layers between global ones (Gemma 3; ``families.Family.local_global_attention``):
  # the window in tokens, the local layers' rotary base, the global layers' linear rotary scaling and the
  # number the query is scaled by the inverse square root of. Unused by other families.
  sliding_window: int | None = None
  local_rope_theta: float = 10_000.0
  global_rope_scale: float = 1.0
  query_pre_attn_scalar: int | None = None
  rows: int = 4
  tokens_per_row: int = 64
  # A Hugging Face checkpoint directory the weights are loaded from (None: seeded random weights). Set by
  # ``hf_checkpoint.preset_from_config`` from the recipe's ``model.checkpoint``, never by a preset file.
  checkpoint: str | None = None
  # The KL term's reference weights (engine.kl_beta > 0), a checkpoint of the same family and sizes; None: the
  # weights the run starts from. Set from the recipe's ``model.reference_checkpoint``.
  reference_checkpoint: str | None = None

  @property
  def is_moe(self) -> bool:
    return bool(self.num_experts)


def available_presets() -> list[str]:
  return sorted(p.stem for p in (configs_dir() / "model").glob("*.yaml"))


def load_preset(name: str, **overrides: Any) -> ModelPreset:
  """Reads ``configs/model/<name>.yaml``; ``overrides`` replace single fields.

  Raises:
    ValueError: the preset does not exist, or has a key ModelPreset does not know.
  """
  path = configs_dir() / "model" / f"{name}.yaml"
  if not path.is_file():
    raise ValueError(
        f"model preset {name!r} not found at {path}; available presets:"
        f" {', '.join(available_presets()) or '(none)'}"
    )
  with path.open() as f:
    raw = yaml.safe_load(f) or {}
  raw.update(overrides)
  known = {f.name for f in dataclasses.fields(ModelPreset)} - {"checkpoint"}
  unknown = sorted(set(raw) - known)
  if unknown:
    raise ValueError(
        f"model preset {path}: unknown keys {unknown}; known keys: {sorted(known - {'name'})}"
    )
  raw.setdefault("name", name)
  for field in _NUMBER_FIELDS & set(raw):
    raw[field] = _number(raw[field], field, path)
  if raw.get("family", DEFAULT_FAMILY) not in FAMILIES:
    raise ValueError(f"model preset {path}: family={raw['family']!r} is not one the engine runs; families:"
                     f" {', '.join(FAMILIES)}")
  preset = ModelPreset(**raw)
  _check_family_settings(preset, path)
  return preset


#: Fields given as numbers with a fraction; YAML reads ``1e-6`` (no dot) as a string, so one is read as a number.
_NUMBER_FIELDS = {"rope_theta", "norm_eps", "local_rope_theta", "global_rope_scale"}


def _number(value: Any, field: str, path: Path) -> float:
  if isinstance(value, str):
    try:
      value = float(value)
    except ValueError:
      pass
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ValueError(f"model preset {path}: {field}={value!r} must be a finite number")
  return float(value)


#: The preset field of each config.json setting a family may run one value of only.
_FIELDS_OF_CONFIG_KEYS = {"tie_word_embeddings": "use_tied_embedding", "rms_norm_eps": "norm_eps"}


def _check_family_settings(preset: ModelPreset, path: Path) -> None:
  """The preset's settings are ones its family's Tunix model runs (a preset file's, as a checkpoint's are).

  Raises:
    ValueError: naming the field, its value and the one the model runs.
  """
  family = FAMILIES[preset.family]
  for key, field in _FIELDS_OF_CONFIG_KEYS.items():
    if key in family.unsupported and getattr(preset, field) != family.unsupported[key]:
      raise ValueError(f"model preset {path}: {field}={getattr(preset, field)!r}, but Tunix's {family.model_class}"
                       f" runs {field}={family.unsupported[key]!r}; set it so")
  if family.local_global_attention:
    window, scale = preset.sliding_window, preset.global_rope_scale
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
      raise ValueError(f"model preset {path}: sliding_window={window!r} must be a whole number of tokens >= 1")
    if not scale >= 1:
      raise ValueError(f"model preset {path}: global_rope_scale={preset.global_rope_scale!r} must be >= 1 (a"
                       " linear scaling divides positions by it)")

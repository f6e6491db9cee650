"""Sliding-window layers between global ones (Gemma 3): the settings ``config.json`` gives them, checked
against what Tunix's model runs, and written back.

Tunix's Gemma3 cycles five sliding-window layers and one global layer
(``GEMMA3_ATTENTION_PATTERN``); its local layers rotate with their own base and
no scaling, its global layers with ``rope_theta`` and a linear scaling factor;
it scales the query by the inverse square root of the head size, or of the
width per head, and of nothing else. A checkpoint that asks for anything else
is refused by name here, before anything is built. Nothing here imports JAX:
``tunix_config_values`` is handed the model's module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from orchestrator.models.presets import ModelPreset

#: Every sixth layer attends globally, the others within the sliding window (Tunix's Gemma3 pattern).
LAYERS_PER_GLOBAL = 6
LOCAL, GLOBAL = "sliding_attention", "full_attention"  # config.json's ``layer_types`` names
#: transformers' Gemma 3 defaults where config.json gives none.
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_LOCAL_ROPE_THETA = 10_000.0
DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
MAX_SLIDING_WINDOW = 1 << 24


def layer_types(num_layers: int) -> list[str]:
  """Each layer's attention, as config.json's ``layer_types`` names it, in the pattern Tunix's model runs."""
  return [GLOBAL if (layer + 1) % LAYERS_PER_GLOBAL == 0 else LOCAL for layer in range(num_layers)]


def _positive(config: Mapping[str, Any], name: str, default: float, where: str) -> float:
  value = config.get(name, default)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
    raise ValueError(f"{where}: {name}={value!r} must be a finite number > 0")
  return float(value)


def _rope_scale(config: Mapping[str, Any], where: str) -> float:
  """The global layers' linear rotary scaling factor (1: none)."""
  scaling = config.get("rope_scaling")
  if scaling is None:
    return 1.0
  kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
  factor = scaling.get("factor") if isinstance(scaling, dict) else None
  others = set(scaling) - {"rope_type", "type", "factor"} if isinstance(scaling, dict) else set()
  if (kind != "linear" or others or isinstance(factor, bool) or not isinstance(factor, (int, float))
      or not math.isfinite(factor) or factor < 1):
    raise ValueError(f"{where}: rope_scaling={scaling!r}; Tunix's Gemma3 scales its global layers' rotary"
                     " positions linearly only: use {\"rope_type\": \"linear\", \"factor\": F} with F >= 1, or none")
  return float(factor)


def settings_from_config(config: Mapping[str, Any], sizes: Mapping[str, int], where: str) -> dict[str, Any]:
  """The preset fields of the sliding-window settings ``config`` gives (``sizes``: the preset's sizes).

  Raises:
    ValueError: a setting out of range, a layer pattern, rotary scaling or query scale Tunix's Gemma3 does
      not run (the message names the key, its value and what runs).
  """
  window = config.get("sliding_window", DEFAULT_SLIDING_WINDOW)
  if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_SLIDING_WINDOW:
    raise ValueError(f"{where}: sliding_window={window!r} must be a whole number of tokens in"
                     f" [1, {MAX_SLIDING_WINDOW:,}]")
  expected = layer_types(sizes["num_layers"])
  given = config.get("layer_types")
  if given is not None and not (isinstance(given, list) and all(isinstance(kind, str) for kind in given)):
    raise ValueError(f"{where}: layer_types={given!r} must be a list of {LOCAL!r} and {GLOBAL!r}, one a layer")
  if given is not None and len(given) != len(expected):
    raise ValueError(f"{where}: layer_types gives {len(given)} entries for num_hidden_layers={len(expected)}"
                     " layers; restore the checkpoint's config.json")
  if given is not None and given != expected:
    first = next(i for i, (a, b) in enumerate(zip(given, expected)) if a != b)
    raise ValueError(f"{where}: layer_types gives layer {first} {given[first]} where Tunix's Gemma3 runs"
                     f" {expected[first]}"
                     f" (every {LAYERS_PER_GLOBAL}th layer global, the rest sliding); use a checkpoint of that"
                     " pattern")
  pattern = config.get("sliding_window_pattern", LAYERS_PER_GLOBAL)
  if pattern != LAYERS_PER_GLOBAL:
    raise ValueError(f"{where}: sliding_window_pattern={pattern!r}; Tunix's Gemma3 makes every"
                     f" {LAYERS_PER_GLOBAL}th layer global: use a checkpoint with sliding_window_pattern="
                     f"{LAYERS_PER_GLOBAL}")
  scalar = config.get("query_pre_attn_scalar", DEFAULT_QUERY_PRE_ATTN_SCALAR)
  runs = {sizes["head_dim"], sizes["embed_dim"] // sizes["num_heads"]}
  if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar not in runs:
    default = "" if "query_pre_attn_scalar" in config else " (transformers' default: config.json gives none)"
    raise ValueError(f"{where}: query_pre_attn_scalar={scalar!r}{default}; Tunix's Gemma3 scales queries by the"
                     " head size"
                     f" or the width per head ({' or '.join(str(n) for n in sorted(runs))} here): use a"
                     " checkpoint with one of those")
  return {"sliding_window": window, "global_rope_scale": _rope_scale(config, where),
          "local_rope_theta": _positive(config, "rope_local_base_freq", DEFAULT_LOCAL_ROPE_THETA, where),
          "query_pre_attn_scalar": int(scalar)}


def window(preset: ModelPreset) -> int:
  return DEFAULT_SLIDING_WINDOW if preset.sliding_window is None else preset.sliding_window


def query_pre_attn_scalar(preset: ModelPreset) -> int:
  return preset.head_dim if preset.query_pre_attn_scalar is None else preset.query_pre_attn_scalar


#: The config.json key of each setting's preset field.
CONFIG_KEYS = {"sliding_window": "sliding_window", "local_rope_theta": "rope_local_base_freq",
               "global_rope_scale": "rope_scaling.factor", "query_pre_attn_scalar": "query_pre_attn_scalar"}


def settings(preset: ModelPreset) -> dict[str, Any]:
  """The preset's sliding-window settings as the model runs them (defaults filled in), by preset field."""
  return {"sliding_window": window(preset), "local_rope_theta": preset.local_rope_theta,
          "global_rope_scale": preset.global_rope_scale, "query_pre_attn_scalar": query_pre_attn_scalar(preset)}


def config_entries(preset: ModelPreset) -> dict[str, Any]:
  """The ``config.json`` entries of the preset's sliding-window settings (``settings_from_config``'s inverse)."""
  runs = settings(preset)
  scale = runs["global_rope_scale"]
  return {"sliding_window": runs["sliding_window"], "layer_types": layer_types(preset.num_layers),
          "rope_local_base_freq": runs["local_rope_theta"], "query_pre_attn_scalar": runs["query_pre_attn_scalar"],
          "rope_scaling": None if scale == 1.0 else {"rope_type": "linear", "factor": scale},
          "hidden_activation": "gelu_pytorch_tanh"}


def tunix_config_values(preset: ModelPreset, module: ModuleType) -> dict[str, Any]:
  """The Tunix Gemma3 ``ModelConfig`` fields of the preset's settings (``module``: ``tunix.models.gemma3.model``).

  Raises:
    ValueError: a query scale the model cannot run (a preset file's).
  """
  scale = module.QueryPreAttentionNormalisation
  scalar = query_pre_attn_scalar(preset)
  if scalar == preset.head_dim:
    norm = scale.BY_ONE_OVER_SQRT_HEAD_DIM
  elif scalar == preset.embed_dim // preset.num_heads:
    norm = scale.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS
  else:
    raise ValueError(f"model {preset.name}: query_pre_attn_scalar={scalar}; Tunix's Gemma3 scales queries by"
                     f" head_dim={preset.head_dim} or embed_dim/num_heads={preset.embed_dim // preset.num_heads}:"
                     " set query_pre_attn_scalar to one of those in the preset")
  return {"num_embed": preset.vocab_size, "sliding_window_size": window(preset),
          "local_base_frequency": preset.local_rope_theta, "global_base_frequency": preset.rope_theta,
          "global_scale_factor": preset.global_rope_scale, "query_pre_attn_norm": norm}

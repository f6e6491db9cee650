"""Rotary settings as transformers 5 saves them (``rope_parameters``), read as the keys transformers 4 wrote.

transformers 5 writes a model's rotary base and scaling into one
``rope_parameters`` object (per layer kind for a model with sliding-window
layers: ``{"full_attention": {...}, "sliding_attention": {...}}``) and no
longer writes ``rope_theta``, ``rope_scaling`` or ``rope_local_base_freq``.
Every check and every export here reads and writes those older keys, which
transformers 5 still reads; ``as_legacy_keys`` turns the newer form into them
before anything reads a config, so a base or a scaling given only there is
never skipped (the model would rotate with a default and train wrong, silently).
Where both forms are given they must agree. Nothing here imports JAX.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KEY = "rope_parameters"
#: The per-layer-kind entries of a model with sliding-window layers, with the older key of each one's base.
LAYER_KIND_BASES = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}
#: Entries of one kind's parameters that are neither its base nor its scaling's kind.
_BASE_AND_KIND = ("rope_theta", "rope_type", "type")
#: Entries that change nothing at their value here: transformers 5 copies a model's ``partial_rotary_factor``
#: into its rotary parameters, and a factor of 1 rotates the whole head, as every model here does.
_NEUTRAL = {"partial_rotary_factor": 1.0}


def _scaling(parameters: Mapping[str, Any]) -> dict[str, Any] | None:
  """The older ``rope_scaling`` of one kind's parameters: None for plain rotary with nothing else set."""
  kind = parameters.get("rope_type", parameters.get("type", "default"))
  rest = {name: value for name, value in parameters.items()
          if name not in _BASE_AND_KIND and not (name in _NEUTRAL and value == _NEUTRAL[name])}
  if kind == "default" and not rest:
    return None
  return {"rope_type": kind, **rest}


def _set(out: dict[str, Any], name: str, value: Any, where: str, given: str) -> None:
  """``out[name] = value``, refusing an older key the config also gives with another value."""
  if name in out and out[name] != value:
    raise ValueError(f"{where}: {name}={out[name]!r} but {given} gives {value!r}; the two forms must agree: keep"
                     f" {KEY} and remove {name}")
  out[name] = value


def as_legacy_keys(config: Mapping[str, Any], where: str) -> dict[str, Any]:
  """``config`` with ``rope_parameters`` read into ``rope_theta``, ``rope_scaling`` and (per-layer-kind
  parameters) ``rope_local_base_freq``, and removed; a config without it comes back as it is.

  Raises:
    ValueError: ``rope_parameters`` is not an object of parameters, or disagrees with an older key the config
      also gives (the message names both).
  """
  parameters = config.get(KEY)
  out = {name: value for name, value in config.items() if name != KEY}
  if parameters is None:
    return out
  if not isinstance(parameters, dict) or not parameters:
    raise ValueError(f"{where}: {KEY}={parameters!r} must be an object of rotary parameters (rope_theta,"
                     " rope_type, …), or per layer kind; restore the checkpoint's config.json")
  if set(parameters) <= set(LAYER_KIND_BASES):
    kinds = parameters
  elif not set(parameters) & set(LAYER_KIND_BASES):
    kinds = {"full_attention": parameters}
  else:
    raise ValueError(f"{where}: {KEY} mixes per-layer-kind entries with others ({sorted(parameters)}); restore the"
                     " checkpoint's config.json")
  for kind, given in kinds.items():
    if not isinstance(given, dict):
      raise ValueError(f"{where}: {KEY}.{kind}={given!r} must be an object of rotary parameters")
    name = f"{KEY}.{kind}" if kinds is parameters else KEY
    if "rope_theta" in given:
      _set(out, LAYER_KIND_BASES[kind], given["rope_theta"], where, f"{name}.rope_theta")
    scaling = _scaling(given)
    if kind == "sliding_attention":
      if scaling is not None:  # transformers never scales a model's sliding layers; Tunix's Gemma3 neither
        raise ValueError(f"{where}: {name}={given!r} scales the sliding-window layers' rotary positions, which"
                         " Tunix's Gemma3 does not: use a checkpoint whose sliding layers are unscaled")
    else:
      legacy = out.get("rope_scaling")
      if legacy is not None and (not isinstance(legacy, dict) or _scaling(legacy) != scaling):
        raise ValueError(f"{where}: rope_scaling={legacy!r} but {name} gives {scaling!r}; the two forms must agree:"
                         f" keep {KEY} and remove rope_scaling")
      out["rope_scaling"] = scaling
  return out

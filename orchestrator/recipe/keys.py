"""Dotted keys over the schema: every leaf key, its type, and values coerced to it.

A key such as ``step_boundary.wait_threshold_s`` names one field of one section;
``flatten`` turns a nested mapping into such keys (refusing unknown ones, with a
suggestion), ``coerce`` types a value from YAML, the environment or the command
line, ``build`` makes a ``Recipe`` of them and ``get`` reads one back.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from orchestrator.recipe.checks import RecipeError
from orchestrator.recipe.schema import Recipe


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


def _is_text(t: Any) -> bool:
  """Whether values of type ``t`` are text: ``str``, or a ``Literal`` of words (``rollouts.source``)."""
  return t is str or (typing.get_origin(t) is typing.Literal and all(isinstance(a, str) for a in typing.get_args(t)))


def is_text_key(key: str) -> bool:
  """Whether ``key`` holds text (``str``, a ``Literal`` of words, either or None, or a boolean or text): its value
  from the command line is taken as written. Not a number or a word (``float | Literal["auto"]``): YAML reads it."""
  t = _leaf_type(key)
  if typing.get_origin(t) in (typing.Union, types.UnionType):
    args = typing.get_args(t)
    return any(_is_text(a) for a in args) and not {int, float} & set(args)
  return _is_text(t)


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_bool(value: Any, key: str) -> bool:
  """``value`` as a boolean (true/false/1/0/yes/no/on/off, any case); RecipeError naming ``key`` otherwise."""
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
  if kind is int:  # a whole number given as one is kept exactly (a float keeps 53 bits: seeds would change)
    if isinstance(value, int):
      return value
    try:
      return int(str(value).strip())
    except ValueError:
      pass
  if isinstance(value, (int, float)):
    number = value
  else:
    try:
      number = float(str(value).strip())
    except ValueError:
      raise RecipeError(f"{key}: expected {kind.__name__}, got {value!r}") from None
  if not math.isfinite(number):
    raise RecipeError(f"{key}: expected a finite number, got {value!r}")
  if kind is int:
    if float(number) != int(float(number)):
      raise RecipeError(f"{key}: expected a whole number, got {value!r}")
    return int(float(number))
  return float(number)


#: Keys whose value is a word or a number: (the word, the number's type, what the error says is expected; None:
#: the number's own error).
WORD_OR_NUMBER_KEYS = {
    "step_boundary.wait_threshold_s": ("auto", float, None),
    "step_boundary.min_free_device_bytes": ("auto", int, "'auto' or a whole number of bytes (0: no memory gate)"),
    "rollouts.micro_batches_per_call": ("batch", int, "'batch' (a whole sampled batch per call) or a whole number"
                                                      " of micro-batches"),
}


#: List keys whose items are text exactly as written: a stop string may hold spaces or commas, and a lone string
#: is not split into several; a list is kept as given for the section's check (which refuses non-strings).
EXACT_TEXT_LIST_KEYS = ("rollouts.stop",)


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
    if key in WORD_OR_NUMBER_KEYS:
      word, kind, expected = WORD_OR_NUMBER_KEYS[key]
      if isinstance(value, str) and value.strip().lower() == word:
        return word
      try:
        return _parse_number(value, kind, key)
      except RecipeError:
        if expected is None:
          raise
        raise RecipeError(f"{key}: expected {expected}, got {value!r}") from None
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
  if _is_text(t):  # a Literal's words are its section's to check: its refusal names the ones it takes
    if isinstance(value, (dict, list)):
      raise RecipeError(f"{key}: expected a string, got {type(value).__name__}")
    return str(value)
  if typing.get_origin(t) is list:
    (item,) = typing.get_args(t)
    if key in EXACT_TEXT_LIST_KEYS:
      if not isinstance(value, list):
        raise RecipeError(f"{key}={value!r} is not a list of strings; give one, e.g. {key}=['</answer>'], or []"
                          " for none")
      return list(value)
    if isinstance(value, str):
      value = [v for v in value.replace(",", " ").split() if v]
    if not isinstance(value, list):
      raise RecipeError(f"{key}: expected a list, got {value!r}")
    return [_coerce_plain(f"{key}[{i}]", item, v) for i, v in enumerate(value)]
  raise RecipeError(f"{key}: unsupported type {t}")  # pragma: no cover


#: Short forms a recipe, an override or a saved run may use for a key: ``model: tiny`` is ``model.preset: tiny``;
#: ``moe: {router_replay: true}`` is ``engine.router_replay`` (beside the engine's other MoE keys).
ALIASES = {"model": "model.preset", "moe.router_replay": "engine.router_replay"}


def canonical(key: str) -> str:
  """The schema's key for ``key`` (itself, or what its short form stands for)."""
  return ALIASES.get(key, key)


def suggest(key: str) -> str:
  """``"; did you mean 'KEY'?"`` for the closest known key (or one with the same leaf name), else ``""``."""
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
    if key in ALIASES and not isinstance(value, Mapping):
      out[ALIASES[key]] = value
    elif isinstance(value, Mapping) and (key in _section_paths() or any(a.startswith(f"{key}.") for a in ALIASES)):
      section = flatten(value, f"{key}.", where)
      twice = sorted(set(section) & set(out))  # a key and its short form, in two sections
      if twice:
        short = {v: k for k, v in ALIASES.items()}
        raise RecipeError(f"{where}: {twice[0]} is given twice ({short.get(twice[0], twice[0])} is its short form);"
                          " keep one")
      out.update(section)
    elif key in known:
      out[key] = value
    else:
      raise RecipeError(f"{where}: unknown key {key!r}{suggest(key)}")
  return out


def _section_paths() -> set[str]:
  return {k.rsplit(".", 1)[0] for k in all_keys() if "." in k}


def build(values: Mapping[str, Any]) -> Recipe:
  """A ``Recipe`` of the defaults with each dotted key in ``values`` set (already coerced; not validated)."""
  recipe = Recipe()
  for key, value in values.items():
    target = recipe
    *parents, leaf = key.split(".")
    for part in parents:
      target = getattr(target, part)
    setattr(target, leaf, value)
  return recipe


def get(recipe: Recipe, key: str) -> Any:
  """The value of one dotted key of ``recipe``."""
  target = recipe
  for part in key.split("."):
    target = getattr(target, part)
  return target

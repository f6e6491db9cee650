"""What the recipe's sections refuse with: ``RecipeError``, and the range checks several sections share.

Every section module (``schema``, ``model_section``, ``task_section``) builds on this one, which imports
nothing of the project.
"""

from __future__ import annotations

from typing import Any


class RecipeError(ValueError):
  """A recipe, flag, override or environment switch that cannot be used as given."""


def at_least(section: str, obj: Any, keys: tuple[str, ...], minimum: float) -> None:
  """Each of ``keys`` of ``obj`` (the ``section``'s; "" for the recipe's own keys) that is set is at least
  ``minimum``; RecipeError naming the key and the range otherwise."""
  for key in keys:
    value = getattr(obj, key)
    if value is not None and value < minimum:
      raise RecipeError(f"{section}{'.' if section else ''}{key}={value} is out of range: it must be >= {minimum}")


def at_most(section: str, obj: Any, keys: tuple[str, ...], maximum: float) -> None:
  """Absurd sizes are refused up front rather than failing hours later (or exhausting memory)."""
  for key in keys:
    value = getattr(obj, key)
    if value is not None and value > maximum:
      raise RecipeError(f"{section}{'.' if section else ''}{key}={value} is out of range: it must be <= {maximum:,}")

"""A new output directory a command writes (``export --out``, ``import-gguf --out``), its missing parents made as
``mkdir -p`` would and removed again if the write fails."""

from __future__ import annotations

import os
from pathlib import Path


def nearest_existing(out: Path) -> Path:
  """The closest directory above ``out`` that exists (or a link there): what must be writable for ``out`` and its
  missing parents to be made."""
  existing = out.absolute().parent
  while not existing.exists() and not existing.is_symlink():
    existing = existing.parent
  return existing


def writable_above(out: Path) -> Path | None:
  """None where ``out`` can be made (its nearest existing parent is a directory this user may write), else that
  parent, for the refusal to name."""
  existing = nearest_existing(out)
  return None if existing.is_dir() and os.access(existing, os.W_OK) else existing


def missing_parents(out: Path) -> list[Path]:
  """The directories above ``out`` that do not exist yet, outermost first."""
  missing = []
  parent = out.absolute().parent
  while not parent.exists() and not parent.is_symlink():
    missing.append(parent)
    parent = parent.parent
  return missing[::-1]


def remove_empty(made_parents: list[Path]) -> None:
  """Removes the parents a write made, innermost first, where nothing else was put in them meanwhile."""
  for directory in reversed(made_parents):
    try:
      directory.rmdir()
    except OSError:
      return

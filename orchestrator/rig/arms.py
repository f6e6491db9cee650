"""What the rig runs: its arms (one mode each), the faults injected as negative controls, and its refusals."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from policies import Mode

ARM_MODES = {mode.value: mode for mode in Mode}
FAULTS = ("reorder_micro_batches", "skip_update")


class RigError(ValueError):
  """A rig invocation that cannot run (bad arm name, too few steps, ...)."""


@dataclasses.dataclass
class Arm:
  """One side of the A/B: a mode, run over the replayed steps from the common start, maybe with a fault."""

  name: str
  mode: Mode
  fault: str | None = None


def parse_arms(names: Sequence[str]) -> list[Arm]:
  """Arm names are mode names; a repeated mode gets a ``#2`` suffix."""
  arms, seen = [], {}
  for raw in names:
    key = raw.strip().lower()
    if key not in ARM_MODES:
      raise RigError(f"unknown arm {raw!r}; arms are modes: {', '.join(ARM_MODES)}")
    seen[key] = seen.get(key, 0) + 1
    arms.append(Arm(key if seen[key] == 1 else f"{key}#{seen[key]}", ARM_MODES[key]))
  if not arms:
    raise RigError("the rig needs at least one arm")
  return arms


def apply_faults(arms: list[Arm], faults: dict[str, str] | None) -> None:
  """Sets each named arm's fault (``faults`` maps arm names to one of ``FAULTS``); refuses unknown ones."""
  for name, fault in (faults or {}).items():
    if fault not in FAULTS:
      raise RigError(f"unknown fault {fault!r}; faults are {FAULTS}")
    matches = [a for a in arms if a.name == name]
    if not matches:
      raise RigError(f"fault for arm {name!r}, which is not among {[a.name for a in arms]}")
    matches[0].fault = fault


def arm_steps(arm: Arm, steps: list) -> list:
  """The steps ``arm`` is fed: ``steps`` itself, or a reordered copy under ``reorder_micro_batches``.

  The copy has step 1's first two micro-batches swapped; ``skip_update`` is
  injected on the engine side and changes no input.
  """
  if arm.fault != "reorder_micro_batches":
    return steps
  reordered = [list(s) for s in steps]
  reordered[1][0], reordered[1][1] = reordered[1][1], reordered[1][0]
  return reordered

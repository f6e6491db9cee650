"""The memory gate: whether the devices have room for a stage.

A stage holds one more micro-batch's input on the devices while the last one
computes. ``MemoryGate`` refuses it when the fullest device's free bytes are
below what ``HeadroomRule`` (or a fixed ``min_free_device_bytes``) requires;
the formula is in ``policies.step_boundary``'s docstring.
"""

from __future__ import annotations

import dataclasses
import math

from policies.units import format_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceHeadroom:
  """What a stage would have room for, as the devices report it when a boundary is planned.

  Attributes:
    free_bytes: the least free memory of any device (its limit less what is in use; over every
      process of a job).
    input_bytes: what one staged micro-batch's input holds on one device (the most on any device).
  """

  free_bytes: int
  input_bytes: int


@dataclasses.dataclass(frozen=True)
class HeadroomRule:
  """The free device memory a stage needs under ``min_free_device_bytes="auto"``: the staged input's own
  bytes and a margin of ``rel_margin`` of them, at least ``abs_margin_bytes`` (allocator rounding and
  fragmentation, and the small buffers the next dispatch allocates)."""

  rel_margin: float = 0.1
  abs_margin_bytes: int = 64 << 20

  def required_bytes(self, input_bytes: int, setting: int | str = "auto") -> int:
    """The free bytes a stage of ``input_bytes`` per device needs under ``setting`` (a number is itself)."""
    if setting != "auto":
      return int(setting)
    return input_bytes + max(math.ceil(input_bytes * self.rel_margin), self.abs_margin_bytes)


def checked_min_free(value: int | str) -> int | str:
  """``min_free_device_bytes`` as given, once it is ``"auto"`` or a whole number of bytes >= 0."""
  if value != "auto" and not (type(value) is int and value >= 0):
    raise ValueError(f"min_free_device_bytes must be 'auto' or a whole number of bytes >= 0 (0: no memory gate),"
                     f" got {value!r}")
  return value


def no_headroom_reason(headroom: DeviceHeadroom, required_bytes: int, setting: int | str) -> str:
  """The plan reason of a stage refused for memory, with its numbers."""
  return (f"no_memory_headroom: {format_bytes(headroom.free_bytes)} free on the fullest device, below the"
          f" {format_bytes(required_bytes)} a stage needs (min_free_device_bytes={setting}; the staged input"
          f" holds {format_bytes(headroom.input_bytes)} per device)")


class MemoryGate:
  """Refuses a stage the devices have no room for.

  Args:
    min_free_device_bytes: ``"auto"`` (``rule`` applied to the staged input's size), a number of bytes,
      or 0 (no gate).
    rule: what ``"auto"`` requires.

  Raises:
    ValueError: a setting that is neither ``"auto"`` nor a whole number of bytes >= 0.
  """

  def __init__(self, min_free_device_bytes: int | str = "auto", rule: HeadroomRule = HeadroomRule()):
    self.min_free_device_bytes, self.rule = checked_min_free(min_free_device_bytes), rule

  @property
  def gates(self) -> bool:
    """Whether a ``DeviceHeadroom`` can refuse a stage (``min_free_device_bytes`` is not 0)."""
    return self.min_free_device_bytes != 0

  def refusal(self, headroom: DeviceHeadroom | None) -> str | None:
    """Why a stage does not fit in ``headroom``, with its numbers; None when it fits, when the devices
    cannot tell (``headroom`` None) or when nothing is gated."""
    if headroom is None or not self.gates:
      return None
    required = self.rule.required_bytes(headroom.input_bytes, self.min_free_device_bytes)
    return None if headroom.free_bytes >= required else no_headroom_reason(headroom, required,
                                                                            self.min_free_device_bytes)

"""The low-wait threshold: what device wait says a stage had nothing left to hide behind.

The device wait has a floor — what ``wait_for_device`` reads with nothing in
flight. A ``CalibrationRule`` turns the largest floor sample into a threshold
(the formula is in ``policies.step_boundary``'s docstring); a pinned threshold
skips it. ``WaitThreshold`` holds the one a policy judges its waits by.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

from policies.units import format_seconds

log = logging.getLogger("step_boundary.policy")


@dataclasses.dataclass(frozen=True)
class CalibrationRule:
  rel_margin: float = 0.1
  abs_margin_s: float = 0.002

  def threshold(self, floor_max_s: float) -> float:
    return max(floor_max_s * (1 + self.rel_margin), floor_max_s + self.abs_margin_s)


class WaitThreshold:
  """The threshold below which a staged boundary's device wait is low: pinned, or calibrated from wait-floor
  samples by ``rule``. Until there is one, waits are not judged (``is_low`` answers None).

  Attributes:
    rule: the rule that turns a wait floor into a threshold.
    pinned: the threshold was given; calibrating keeps it (and stores the samples for reports).
    threshold_s: the threshold (None: not calibrated yet).
    floor_samples: the wait-floor samples of the last calibration (() before one).

  Raises:
    ValueError: a pinned threshold that is negative or not finite.
  """

  def __init__(self, pinned_s: float | None = None, rule: CalibrationRule = CalibrationRule()):
    if pinned_s is not None and not (pinned_s >= 0 and math.isfinite(pinned_s)):
      raise ValueError(f"wait_threshold_s must be a finite number >= 0, got {pinned_s}")
    self.rule = rule
    self.pinned = pinned_s is not None
    self.threshold_s = pinned_s
    self.floor_samples: tuple[float, ...] = ()

  @property
  def floor_max_s(self) -> float | None:
    """The largest wait-floor sample (None: not sampled)."""
    return max(self.floor_samples) if self.floor_samples else None

  def is_low(self, device_wait_s: float) -> bool | None:
    """Whether ``device_wait_s`` is below the threshold; None while there is none."""
    return None if self.threshold_s is None else device_wait_s < self.threshold_s

  def calibrate(self, floor_samples: Sequence[float]) -> float | None:
    """Sets the threshold from wait-floor samples (a pinned one is kept); returns it.

    Raises:
      ValueError: no samples, or a negative or non-finite one.
    """
    samples = tuple(float(s) for s in floor_samples)
    if not samples:
      raise ValueError("calibrate needs at least one wait-floor sample")
    bad = [s for s in samples if not (s >= 0 and math.isfinite(s))]
    if bad:
      raise ValueError(f"wait-floor samples must be finite and >= 0, got {bad[:3]}")
    self.floor_samples = samples
    if not self.pinned:
      self.threshold_s = self.rule.threshold(max(samples))
    log.info(
        "[policy] wait floor max %s over %d samples; low-wait threshold %s (%s)",
        format_seconds(max(samples)), len(samples), format_seconds(self.threshold_s),
        "pinned" if self.pinned else "calibrated",
    )
    return self.threshold_s

  def restore(self, threshold_s: float | None, floor_samples: Sequence[float]) -> None:
    """Continues from a saved threshold and its samples (a resumed run)."""
    self.threshold_s = None if threshold_s is None else float(threshold_s)
    self.floor_samples = tuple(float(x) for x in floor_samples)

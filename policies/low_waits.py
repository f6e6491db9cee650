"""The low-wait streak: when staging stops paying, and when an auto-disabled run tries it again.

A staged boundary whose device wait is low (below the ``WaitThreshold``) had
nothing left to hide behind: the stage outlasted the last micro-batch.
``disable_after`` of them in a row turn staging off; ``reprobe_every``
boundaries later one boundary is staged as a probe. ``LowWaitStreak`` keeps
that count and schedule; the policy changes the mode by what it answers.
"""

from __future__ import annotations


class LowWaitStreak:
  """The staged boundaries' low device waits in a row, and the re-probe schedule after an auto-disable.

  Args:
    disable_after: low waits in a row that turn staging off (>= 1).
    reprobe_every: after an auto-disable, stage one probe boundary this many boundaries later; None
      never probes.

  Attributes:
    waits_s: the device waits of the current streak.
    disabled_at: the step after which staging turned itself off (None: on, or turned back on by a probe).
    probe_used: the one re-probe since that auto-disable was planned.
    reported: a low wait was reported already (later ones are logged quietly).

  Raises:
    ValueError: ``disable_after`` or ``reprobe_every`` below 1.
  """

  def __init__(self, *, disable_after: int = 2, reprobe_every: int | None = None):
    if disable_after < 1:
      raise ValueError(f"disable_after must be >= 1, got {disable_after}")
    if reprobe_every is not None and reprobe_every < 1:
      raise ValueError(f"reprobe_every must be >= 1 or None, got {reprobe_every}")
    self.disable_after, self.reprobe_every = disable_after, reprobe_every
    self.waits_s: list[float] = []
    self.disabled_at: int | None = None
    self.probe_used = False
    self.reported = False

  def probe_due(self, step: int) -> bool:
    """Whether the boundary after ``step`` is the re-probe of an auto-disabled run."""
    return (self.disabled_at is not None and self.reprobe_every is not None and not self.probe_used
            and step - self.disabled_at >= self.reprobe_every)

  def extend(self, device_wait_s: float) -> bool:
    """Adds a low wait; whether the streak is now long enough to turn staging off."""
    self.waits_s.append(device_wait_s)
    return len(self.waits_s) >= self.disable_after

  def end(self) -> None:
    """A wait that is not low ends the streak."""
    self.waits_s = []

  def disable(self, step: int) -> list[float]:
    """Staging turned off after ``step``: the probe schedule starts there; returns the streak's waits."""
    waits, self.waits_s = self.waits_s, []
    self.disabled_at, self.probe_used = step, False
    return waits

  def enable(self) -> None:
    """A probe turned staging back on: no probe is due any more, a new streak starts."""
    self.disabled_at, self.waits_s = None, []

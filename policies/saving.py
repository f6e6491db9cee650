"""What staging saved, measured: control boundaries against staged ones, with a 95 % interval.

One in each ``control_every`` boundaries at which the policy would stage runs unstaged instead (a *control*,
``ControlSchedule``: at a position within each block drawn from the block's index), so a run gives up at most
1/K of its saving to measure it. Each staged or control boundary k yields one ``BoundarySample``
(``boundary_sample``): its boundary idle, and the seconds of the two steps around it, k and k + 1 — all that a
boundary's staging can change: before the update it runs during step k's last micro-batch and may delay update
k; its input shortens the idle and the first micro-batch of step k + 1. Controls are sparse and placed at random
within their blocks, so the boundaries next to a control stage as those next to a staged one do: the difference
of the two-step sums is what staging at one boundary changes, and counts every effect it has (a span of the
boundary alone missed what a stage costs its micro-batch's neighbours). The saving is the mean difference
control − staged, with a 95 % Welch interval (``welch_interval``); ``MeasuredSaving`` holds the samples the
policy judges by, and says when staging costs time (docs/design.md §6).

The policy does not act on the 95 % interval each time a control arrives: over a run's many controls some
interval would lie below zero by chance. It looks at fixed counts of controls — ``MIN_CONTROLS``, then each
doubling (5, 10, 20, 40, …), once, as the control that completes the count arrives — and at look j asks for the interval at a level that spends half the error the
looks before it left: a one-sided error of 2.5 % / 2^(j + 1) (1.25 %, 0.625 %, …), so within a window of
samples (since staging last turned on) the chance that staging which saves nothing is turned off stays within
2.5 % (``decision_level``); a re-probe that turns it on again opens a new window with a new budget.

The t quantile comes from a table (df 1–30, 40, 60, 120, ∞) with the Welch–Satterthwaite degrees of freedom
rounded down to the nearest entry: the interval is never narrower than the exact one.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

#: Controls the policy needs before it acts on the measured saving (and before a report gives a figure).
MIN_CONTROLS = 5
#: Staged samples a figure needs beside the controls (a variance needs two).
MIN_STAGED = 2
#: ``step_boundary.control_every``'s default: one control in 20 staged boundaries gives up at most 5 % of the
#: saving to measure it.
DEFAULT_CONTROL_EVERY = 20

# Two-sided 95 % quantiles of Student's t (0.975), by degrees of freedom.
_T975_DF = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28,
            29, 30, 40, 60, 120)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
         2.021, 2.000, 1.980)
_Z975 = 1.960


#: The one-sided error every look of the policy together may spend (``decision_level``).
DECISION_ERROR = 0.025


def decision_level(control_n: int) -> float | None:
  """The two-sided level of the interval the policy judges by at ``control_n`` controls: at the j-th look
  (``MIN_CONTROLS`` × 2^j controls) one that leaves a one-sided error of ``DECISION_ERROR`` / 2^(j + 1); None
  between looks."""
  if control_n < MIN_CONTROLS or control_n % MIN_CONTROLS:
    return None
  doublings = control_n // MIN_CONTROLS
  if doublings & (doublings - 1):
    return None
  return 1.0 - 2.0 * DECISION_ERROR / (2 * doublings)


def t_two_sided_mass(t: float, n: int) -> float:
  """P(|T| < t) for Student's t with ``n`` (whole) degrees of freedom: the closed forms of Abramowitz and Stegun
  26.7.3–4, sums in cos θ with θ = atan(t / √n)."""
  theta = math.atan(t / math.sqrt(n))
  c2, term, total = math.cos(theta) ** 2, 1.0, 1.0
  if n % 2:  # odd: (2/π)(θ + sin θ cos θ (1 + 2/3 cos²θ + …))
    for k in range(1, (n - 1) // 2):
      term *= c2 * (2 * k) / (2 * k + 1)
      total += term
    return 2 / math.pi * (theta + (math.sin(theta) * math.cos(theta) * total if n > 1 else 0.0))
  for k in range(1, n // 2):  # even: sin θ (1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + …)
    term *= c2 * (2 * k - 1) / (2 * k)
    total += term
  return math.sin(theta) * total


def t_quantile(p: float, df: float) -> float:
  """Student's t quantile ``p`` (> 0.5) at ``df`` degrees of freedom rounded down (a larger quantile:
  conservative), by bisection on ``t_two_sided_mass`` to 1e-9; the normal's at ∞.

  Raises:
    ValueError: ``df`` below 1 or ``p`` outside (0.5, 1).
  """
  if not df >= 1 or not 0.5 < p < 1:
    raise ValueError(f"a t quantile needs df >= 1 and 0.5 < p < 1, got df={df}, p={p}")
  if df == math.inf or df > 1e6:
    return statistics.NormalDist().inv_cdf(p)
  n, mass = math.floor(df), 2 * p - 1
  low, high = 0.0, 1.0
  while t_two_sided_mass(high, n) < mass:
    high *= 2
  while high - low > 1e-9 * high:
    middle = (low + high) / 2
    low, high = (middle, high) if t_two_sided_mass(middle, n) < mass else (low, middle)
  return high


def t_quantile_975(df: float) -> float:
  """Student's t 0.975 quantile at ``df`` degrees of freedom, from the table, ``df`` rounded down to an entry
  (a larger quantile: conservative); the normal's at ∞ alone.

  Raises:
    ValueError: ``df`` below 1.
  """
  if not df >= 1:
    raise ValueError(f"degrees of freedom must be >= 1, got {df}")
  if df == math.inf:
    return _Z975
  return _T975[bisect.bisect_right(_T975_DF, df) - 1]


@dataclasses.dataclass(frozen=True)
class Interval:
  """A mean difference and its 95 % interval, in seconds."""

  mean: float
  low: float
  high: float

  @property
  def below_zero(self) -> bool:
    """The whole interval lies below zero: the difference is negative, beyond the noise."""
    return self.high < 0

  def to_json(self) -> dict[str, float]:
    return {"mean": self.mean, "low": self.low, "high": self.high}


def welch_interval(control: Sequence[float], staged: Sequence[float], *, level: float = 0.95) -> Interval:
  """mean(control) − mean(staged), with Welch's interval at ``level`` (unequal variances; 95 %: the table's
  quantile, else ``t_quantile``'s).

  Raises:
    ValueError: fewer than two values on a side.
  """
  if len(control) < 2 or len(staged) < 2:
    raise ValueError(f"a Welch interval needs two values a side, got {len(control)} and {len(staged)}")
  diff = statistics.fmean(control) - statistics.fmean(staged)
  var_c, var_s = statistics.variance(control) / len(control), statistics.variance(staged) / len(staged)
  se = math.sqrt(var_c + var_s)
  if se == 0:
    return Interval(diff, diff, diff)
  df = (var_c + var_s) ** 2 / (var_c ** 2 / (len(control) - 1) + var_s ** 2 / (len(staged) - 1))
  df = max(1.0, df)
  half = (t_quantile_975(df) if level == 0.95 else t_quantile(0.5 + level / 2, df)) * se
  return Interval(diff, diff - half, diff + half)


@dataclasses.dataclass(frozen=True)
class BoundarySample:
  """What one staged or control boundary k measured: its idle, and ``step_s``: the seconds of steps k and k + 1
  together (update k − 1 ready to update k + 1 ready), what staging at k can change."""

  boundary_idle_s: float
  step_s: float


# How far apart two stamps of one clock may read after the subtractions that made them (perf_counter seconds).
_CLOCK_TOLERANCE_S = 1e-6


def _continues(before: Any, record: Any) -> bool:
  """Whether ``record``'s times count from ``before``'s update (one segment's clock), not from the segment's
  first dispatch (a resumed segment's first step: compilation included)."""
  if before.t_update_ready is None or record.t_update_ready is None or record.step_s is None:
    return False
  return abs(record.t_update_ready - record.step_s - before.t_update_ready) <= _CLOCK_TOLERANCE_S


def boundary_sample(before: Any, record: Any, after: Any) -> BoundarySample | None:
  """The sample of the boundary after ``record``'s step (``before``, ``after``: the records of the steps
  around it; records are ``BoundaryRecord``s or anything with their fields). None where the boundary neither
  staged nor was a control, where the boundary before it did not stage (a control's or an unstaged boundary's
  effect on step k would count against this one: both kinds of sample follow a staged boundary), where a time
  is not known, or where a step's times do not count from the update before it (the step then was its
  segment's first, compilation included: a first update, a first stage)."""
  if not (record.staged or record.control) or not before.staged:
    return None
  return boundary_span(before, record, after)


def boundary_span(before: Any, record: Any, after: Any) -> BoundarySample | None:
  """What the boundary after ``record``'s step measured, whatever it did (an A/B between runs compares these):
  None where a time is not known, a step's times do not count from the update before it, or a step of the span
  held work staging does not change: it waited for an evaluation (``eval_s``: one at the boundary before it), or
  a sampling call ran on the trainer's devices (``sampling_on_trainer_devices_s`` > 0: a shared placement's
  sampler, whose generation lands in whichever steps it overlaps, so a span holding one is slower whatever its
  boundary did, and where the controls fall would decide how many of them hold one)."""
  if not (_continues(before, record) and _continues(record, after)):
    return None
  if getattr(before, "eval_s", None) is not None or getattr(record, "eval_s", None) is not None:
    return None
  if any(getattr(r, "sampling_on_trainer_devices_s", None) for r in (record, after)):
    return None
  if record.boundary_idle_s is None:
    return None
  return BoundarySample(record.boundary_idle_s, record.step_s + after.step_s)


@dataclasses.dataclass(frozen=True)
class SavingEstimate:
  """The measured saving: control − staged, per boundary (idle) and per step (the boundary's span).

  ``boundary_idle_s`` and ``step_s`` are None until there are ``MIN_CONTROLS`` controls and ``MIN_STAGED``
  staged samples (``enough``). ``decision`` is the step saving's interval at this look's ``decision_level``
  (None between looks): what the policy acts on.
  """

  boundary_idle_s: Interval | None
  step_s: Interval | None
  staged_n: int
  control_n: int
  decision: Interval | None = None
  decision_level: float | None = None

  @property
  def enough(self) -> bool:
    return self.boundary_idle_s is not None

  @property
  def costs_time(self) -> bool:
    """At a look, the controls show staging costs time: the step saving's whole interval at the look's level
    lies below zero."""
    return self.decision is not None and self.decision.below_zero

  def to_json(self) -> dict[str, Any]:
    return {"boundary_idle_s": self.boundary_idle_s and self.boundary_idle_s.to_json(),
            "step_s": self.step_s and self.step_s.to_json(), "staged_n": self.staged_n,
            "control_n": self.control_n, "min_controls": MIN_CONTROLS,
            "decision": self.decision and self.decision.to_json(), "decision_level": self.decision_level}

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> "SavingEstimate":
    def interval(d):
      return None if d is None else Interval(d["mean"], d["low"], d["high"])
    return cls(interval(data["boundary_idle_s"]), interval(data["step_s"]), int(data["staged_n"]),
               int(data["control_n"]), interval(data.get("decision")), data.get("decision_level"))


def estimate(staged: Sequence[BoundarySample], control: Sequence[BoundarySample], *,
             look: bool = False) -> SavingEstimate:
  """The saving the samples show (no figure with fewer than ``MIN_CONTROLS`` controls); with ``look``, and where
  the control count is a look's, the interval the policy judges by too."""
  if len(control) < MIN_CONTROLS or len(staged) < MIN_STAGED:
    return SavingEstimate(None, None, len(staged), len(control))
  control_steps, staged_steps = [c.step_s for c in control], [s.step_s for s in staged]
  level = decision_level(len(control)) if look else None
  return SavingEstimate(
      welch_interval([c.boundary_idle_s for c in control], [s.boundary_idle_s for s in staged]),
      welch_interval(control_steps, staged_steps), len(staged), len(control),
      None if level is None else welch_interval(control_steps, staged_steps, level=level), level)


def estimate_from_records(records: Sequence[Any]) -> SavingEstimate:
  """The saving a run's records show, in step order (``boundary_sample`` says which count)."""
  staged, control = [], []
  for before, record, after in zip(records, records[1:], records[2:]):
    sample = boundary_sample(before, record, after)
    if sample is not None:
      (control if record.control else staged).append(sample)
  return estimate(staged, control)


def _mix64(value: int) -> int:
  """SplitMix64's finaliser: a fixed, well-spread function of an integer (the same in every process and run)."""
  z = (value + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
  return z ^ (z >> 31)


class ControlSchedule:
  """Which boundaries that would stage run unstaged as controls: one in each block of ``control_every`` of them,
  counted over the run, at a position within the block drawn from the block's index (a fixed function of the
  boundary sequence, the same in every process).

  Not simply every K-th: a run's boundaries have periods of their own (a sampled batch every
  ``rollouts.batch_steps`` steps, a checkpoint every ``checkpoint.every``), and every K-th would put each control
  at the same phase of such a period whenever K is a multiple of it, comparing one kind of boundary with all kinds.

  Raises:
    ValueError: ``control_every`` below 0 (0: no controls).
  """

  def __init__(self, control_every: int):
    if type(control_every) is not int or control_every < 0:
      raise ValueError(f"control_every must be a whole number >= 0, got {control_every!r}")
    self.control_every = control_every

  def is_control(self, would_stage_count: int) -> bool:
    """Whether the ``would_stage_count``-th boundary that would stage (counted from 1) is a control."""
    if self.control_every == 0:
      return False
    block, position = divmod(would_stage_count - 1, self.control_every)
    return position == _mix64(block) % self.control_every


class MeasuredSaving:
  """The samples the policy judges staging by, since staging last turned on (agreed between a job's
  processes before they are added).

  Attributes:
    staged, control: the samples of the current window (staging on).
  """

  def __init__(self):
    self.staged: list[BoundarySample] = []
    self.control: list[BoundarySample] = []

  def add(self, sample: BoundarySample, *, control: bool) -> SavingEstimate:
    """Adds one boundary's sample; returns the estimate the window now shows, judged (``decision``) when this
    control brings the count to a look (each look is taken once: staged samples that arrive after it do not
    take it again)."""
    (self.control if control else self.staged).append(sample)
    return estimate(self.staged, self.control, look=control)

  def estimate(self) -> SavingEstimate:
    return estimate(self.staged, self.control)

  def restart(self) -> None:
    """Staging turned on again: a new window (the old samples measured another period)."""
    self.staged, self.control = [], []

  def state_dict(self) -> dict[str, list[list[float]]]:
    return {"staged": [[s.boundary_idle_s, s.step_s] for s in self.staged],
            "control": [[s.boundary_idle_s, s.step_s] for s in self.control]}

  def load_state_dict(self, state: dict[str, list[list[float]]]) -> None:
    self.staged = [BoundarySample(float(a), float(b)) for a, b in state["staged"]]
    self.control = [BoundarySample(float(a), float(b)) for a, b in state["control"]]

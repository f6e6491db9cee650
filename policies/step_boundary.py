"""StepBoundaryPolicy: what a trainer does at each optimizer-step boundary, and when to stop staging.

Pure Python, no JAX: it is fed measurements and answers plans, so it can be
tested in microseconds and reused by any engine.

Modes (``policies.call_order`` gives the call order of each; docs/design.md §5):

====================  =====  ======================  ===============
mode                  stage  stage before update()?  await metrics?
====================  =====  ======================  ===============
OFF                   no     —                       yes
PIPELINED             no     —                       no
STAGE_AFTER_UPDATE    yes    no                      no
STAGE_BEFORE_UPDATE   yes    yes                     no
====================  =====  ======================  ===============

Transitions. ``staged`` is STAGE_AFTER_UPDATE or STAGE_BEFORE_UPDATE; ``low``
means a device wait below ``threshold_s``; ``N`` is ``disable_after``. Every
row that changes the mode is logged once as a warning with its numbers,
appended to ``history`` and counted in ``counters``; ``_apply`` is the one
function that applies them.

===================  ===================================  ====================================  ==================
in mode              event                                guard                                 next mode
===================  ===================================  ====================================  ==================
staged (requested)   bring-up                             engine lacks staging methods,         PIPELINED
                                                          ``require_staging`` unset             (``unsupported_engine``)
staged (requested)   bring-up                             engine lacks staging methods,         error at bring-up
                                                          ``require_staging`` set               (StagingUnsupportedError)
staged               ``plan(step)``                       ``step`` in ``excluded_steps``        unchanged; no stage there
staged, or a probe   ``plan(step, next_ready=False)``     the next step's rollouts wait for     unchanged; no stage there
                                                          this boundary's weight sync           (``next_not_ready``)
STAGE_BEFORE_UPDATE  ``plan(step, next_sampled=False)``   the next step's first micro-batch     unchanged; staged after the
                                                          is not sampled yet                    update there (``staged_after_
                                                                                                update_for_rollouts``)
staged, or a probe   ``plan(step, headroom=…)``           the devices' free bytes are below     unchanged; no stage there
                                                          ``min_free_device_bytes``             (``no_memory_headroom``)
staged               ``plan(step)``                       one in each ``control_every``         unchanged; a control: no
                                                          boundaries that would stage           stage there (``controls``)
staged               ``observe`` (stage waited for        —                                     unchanged; not judged
                     rollouts)                                                                  (``rollout_waits``)
staged               ``observe`` (a sampling call ran     —                                     unchanged; not judged
                     on the trainer's devices)                                                  (``sampling_on_devices``)
staged               ``observe`` (not low)                —                                     unchanged; low count → 0
staged               ``observe`` (low)                    fewer than N low in a row             unchanged; reported
                                                                                                (``stage_outlasted_compute``)
staged               ``observe`` (low)                    N low in a row                        PIPELINED (``auto_disable``)
staged               ``observe_saving``                   fewer than ``MIN_CONTROLS``           unchanged; the sample is kept
                                                          controls, or the step saving's
                                                          interval reaches 0 or above
staged               ``observe_saving``                   ``MIN_CONTROLS`` controls and the     PIPELINED (``saving_disable``)
                                                          step saving's 95 % interval lies
                                                          below zero: staging costs time
PIPELINED            ``plan(step)``                       auto-disabled (either kind),          unchanged; this one boundary
(auto-disabled)                                           ``reprobe_every`` boundaries since,   is staged as a probe
                                                          no probe used yet
PIPELINED            ``observe`` (probe, not low)         —                                     the requested staged mode
(auto-disabled)                                                                                 (``reprobe_enabled``)
PIPELINED            ``observe`` (probe, low)             —                                     PIPELINED for the rest of the
(auto-disabled)                                                                                 run (``reprobe_failed``)
OFF, PIPELINED       ``plan(step)``                       —                                     unchanged; no stage
===================  ===================================  ====================================  ==================

Calibration (``calibrate``): the device wait has a floor — what
``wait_for_device`` reads with nothing in flight: microseconds on a local CPU,
~2.8 s on one remote-device runtime. A wait at that floor means the stage had
nothing left to hide behind. The threshold is::

    threshold_s = max(floor_max × (1 + rel_margin), floor_max + abs_margin)

with ``rel_margin = 0.1`` and ``abs_margin = 0.002`` s by default: a wait must
clear the noisiest floor sample by 10 %, and by at least 2 ms (scheduler noise
on a local runtime). A pinned ``wait_threshold_s`` skips calibration. Until
there is a threshold, waits are recorded but not judged.

Controls and the measured saving (``policies.saving``): one in each ``control_every`` boundaries that would
stage (``ControlSchedule``) runs unstaged, PIPELINED's call order, as a control. ``observe_saving`` is fed each staged or control
boundary's sample (its idle, and its span to the next step's first micro-batch); with ``MIN_CONTROLS`` controls
since staging last turned on, a step saving (control − staged) whose whole 95 % interval lies below zero
turns staging off as a low-wait streak does, and ``reprobe_every`` re-probes it the same way.

Memory headroom (``HeadroomRule``): a stage holds one more micro-batch's input
on the devices while the last one computes. Where the engine reports its
devices' memory, ``plan`` is given a ``DeviceHeadroom`` (the free bytes of the
fullest device, and what a staged input holds on one device) and stages only
if the free bytes reach::

    required_bytes = input_bytes + max(input_bytes × rel_margin, abs_margin_bytes)

with ``rel_margin = 0.1`` and ``abs_margin_bytes = 64 MiB`` for
``min_free_device_bytes="auto"`` (the default), or the number given; ``0`` turns
the gate off. A refused stage is a PIPELINED boundary: nothing is observed, so
it neither extends nor resets the low-wait streak. Without a ``DeviceHeadroom``
(the engine cannot tell) nothing is gated.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable, Sequence

from policies.calibration import CalibrationRule, WaitThreshold
from policies.headroom import DeviceHeadroom, HeadroomRule, MemoryGate
from policies.low_waits import LowWaitStreak
from policies.saving import DEFAULT_CONTROL_EVERY, BoundarySample, ControlSchedule, MeasuredSaving, SavingEstimate
from policies.units import format_seconds

log = logging.getLogger("step_boundary.policy")


class Mode(enum.Enum):
  OFF = "off"
  PIPELINED = "pipelined"
  STAGE_AFTER_UPDATE = "stage_after_update"
  STAGE_BEFORE_UPDATE = "stage_before_update"

  @property
  def staged(self) -> bool:
    return self.flags.stage

  @property
  def flags(self) -> "ModeFlags":
    """This mode's row of the mode table (``MODE_TABLE``)."""
    return MODE_TABLE[self]

  @classmethod
  def parse(cls, value: "Mode | str") -> "Mode":
    if isinstance(value, Mode):
      return value
    key = str(value).strip().lower()
    for mode in cls:
      if key in (mode.value, mode.name.lower()):
        return mode
    raise ValueError(
        f"unknown step-boundary mode {value!r}; choose one of {[m.value for m in cls]}"
    )


class StagingUnsupportedError(RuntimeError):
  """A staged mode was required but the engine cannot stage."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModeFlags:
  """What a boundary does in a mode when it stages as the mode says (a row of the table at the top)."""

  stage: bool
  stage_before_update: bool
  await_metrics: bool


#: The mode table, written once: the policy, the boundary model and the rig read it through ``Mode.flags``
#: and ``BoundaryPlan.for_mode``; ``policies.call_order`` turns a plan into its call order.
MODE_TABLE: dict[Mode, ModeFlags] = {
    Mode.OFF: ModeFlags(stage=False, stage_before_update=False, await_metrics=True),
    Mode.PIPELINED: ModeFlags(stage=False, stage_before_update=False, await_metrics=False),
    Mode.STAGE_AFTER_UPDATE: ModeFlags(stage=True, stage_before_update=False, await_metrics=False),
    Mode.STAGE_BEFORE_UPDATE: ModeFlags(stage=True, stage_before_update=True, await_metrics=False),
}

def stage_order(mode: Mode, next_sampled: bool | None) -> Mode:
  """The mode whose call order a staged boundary in ``mode`` follows: its own, except STAGE_BEFORE_UPDATE's when
  the next step's first micro-batch is not sampled yet (``next_sampled`` False) — staged before the update, the
  wait for it would hold the update back — which follows STAGE_AFTER_UPDATE's. The policy plans by it, and the
  boundary model times by it."""
  return Mode.STAGE_AFTER_UPDATE if mode is Mode.STAGE_BEFORE_UPDATE and next_sampled is False else mode


#: Why a boundary that would have staged did not (``control_every``).
CONTROL_REASON = "control: run unstaged to measure what staging saves"

#: Why a STAGE_BEFORE_UPDATE boundary staged after the update (``plan(next_sampled=False)``).
UPDATE_FIRST_REASON = ("the next step's first micro-batch was not sampled yet: staged after the update, so waiting"
                       " for it does not hold the update back")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoundaryPlan:
  """What to do at the boundary after optimizer step ``step``.

  Attributes:
    step: the step whose last micro-batch ends at this boundary.
    mode: the policy's mode when the plan was made.
    stage: prepare the next step's first micro-batch ahead.
    stage_before_update: stage between the last ``fwd_bwd`` and ``update()``
      (the update is deferred); otherwise after ``update()``.
    await_metrics: read metrics, log, checkpoint and sync weights before the
      next step's first micro-batch is dispatched (OFF); otherwise after it.
    probe: this staged boundary is a re-probe while staging is auto-disabled.
    reason: why, in words.
    control: a boundary that would have staged runs unstaged, to measure what staging saves.
  """

  step: int
  mode: Mode
  stage: bool
  stage_before_update: bool
  await_metrics: bool
  reason: str
  probe: bool = False
  control: bool = False

  @classmethod
  def for_mode(cls, step: int, mode: Mode, *, reason: str, staged_as: Mode | None = None,
               probe: bool = False, control: bool = False) -> "BoundaryPlan":
    """The plan of a boundary in ``mode`` that does what ``staged_as``'s row says (default: ``mode``'s own).

    A re-probe while auto-disabled is ``mode=PIPELINED, staged_as=<the requested mode>``.
    """
    flags = (staged_as or mode).flags
    return cls(step=step, mode=mode, stage=flags.stage, stage_before_update=flags.stage_before_update,
               await_metrics=flags.await_metrics, reason=reason, probe=probe, control=control)

  @classmethod
  def unstaged(cls, step: int, mode: Mode, *, reason: str, control: bool = False) -> "BoundaryPlan":
    """A boundary in ``mode`` that stages nothing (pipelined unless the mode is OFF)."""
    return cls.for_mode(step, mode, reason=reason, staged_as=Mode.OFF if mode is Mode.OFF else Mode.PIPELINED,
                        control=control)

  def to_json(self) -> dict:
    """The plan as JSON (the mode by its value): what a checkpoint keeps of a boundary planned before it."""
    return dict(dataclasses.asdict(self), mode=self.mode.value)

  @classmethod
  def from_json(cls, data: dict) -> "BoundaryPlan":
    """The plan ``to_json`` wrote."""
    return cls(**dict(data, mode=Mode(data["mode"])))


@dataclasses.dataclass(frozen=True)
class Transition:
  step: int | None
  from_mode: Mode
  to_mode: Mode
  kind: str
  reason: str

  def to_json(self) -> dict:
    return dict(dataclasses.asdict(self), from_mode=self.from_mode.value, to_mode=self.to_mode.value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyReport:
  """What the policy did over a run, for the run's summary (``StepBoundaryPolicy.report``).

  Attributes:
    requested_mode, final_mode: the mode asked for and the mode at the end.
    auto_disables: how often staging turned itself off (low waits or the measured saving).
    transitions: every mode change, in order.
    counters: every counted event by name (the table at the top names them).
    threshold_s: the low-wait threshold (None: not calibrated, waits not judged).
    wait_floor_max_s: the largest wait-floor sample (None: not sampled).
  """

  requested_mode: Mode
  final_mode: Mode
  auto_disables: int
  transitions: tuple[Transition, ...]
  counters: dict[str, int]
  threshold_s: float | None
  wait_floor_max_s: float | None

  def to_json(self) -> dict:
    return {"requested_mode": self.requested_mode.value, "final_mode": self.final_mode.value,
            "auto_disables": self.auto_disables, "transitions": [t.to_json() for t in self.transitions],
            "policy_counters": dict(self.counters), "threshold_s": self.threshold_s,
            "wait_floor_max_s": self.wait_floor_max_s}


@dataclasses.dataclass(frozen=True)
class Observation:
  """What the policy made of one staged boundary's measurements."""

  step: int
  stage_s: float
  device_wait_s: float
  low: bool | None  # None: no threshold yet
  consecutive_low: int
  transition: Transition | None


#: Every event the policy counts, by name (the transition table at the top says when each happens); a resumed
#: run's counters are the saved ones.
COUNTED_EVENTS = ("unsupported_engine", "auto_disable", "reprobe_enabled", "reprobe_failed", "stage_outlasted_compute",
                  "excluded_boundaries", "staged_boundaries", "probes", "next_not_ready", "rollout_waits",
                  "no_memory_headroom", "controls", "saving_disable", "sampling_on_devices")


class StepBoundaryPolicy:
  """Plans each step boundary and turns staging off when it stops paying.

  It holds the mode and applies the transition table at the top (``_apply``); what it judges by is held by
  one part each: the low-wait threshold (``WaitThreshold``: calibration), the low-wait streak and re-probe
  schedule (``LowWaitStreak``: measurements) and the memory gate (``MemoryGate``: headroom).

  Args:
    mode: the requested mode (``Mode`` or its name).
    engine_can_stage: whether the engine has ``prepare_fwd_bwd_input`` and
      ``wait_for_device`` (``TrainerWorker.capabilities.can_stage``).
    require_staging: fail bring-up instead of falling back when it cannot.
    wait_threshold_s: pin the low-wait threshold; None calibrates it.
    disable_after: consecutive low waits that turn staging off (>= 1).
    reprobe_every: after an auto-disable, stage one probe boundary this many
      boundaries later; None never probes.
    excluded_steps: boundaries (by step) where no stage happens.
    calibration: the rule that turns a wait floor into a threshold.
    min_free_device_bytes: the free device memory a stage needs: ``"auto"`` (``headroom_rule`` applied
      to the staged input's size), a number of bytes, or 0 (no memory gate).
    headroom_rule: what ``"auto"`` requires.
    control_every: one in each K boundaries that would stage runs unstaged as a control (0: none).

  Raises:
    StagingUnsupportedError: a staged mode with ``require_staging`` on an
      engine that cannot stage.
    ValueError: bad arguments.
  """

  def __init__(self, mode: Mode | str, *, engine_can_stage: bool = True, require_staging: bool = False,
               wait_threshold_s: float | None = None, disable_after: int = 2, reprobe_every: int | None = None,
               excluded_steps: Iterable[int] = (), calibration: CalibrationRule = CalibrationRule(),
               engine_missing: Sequence[str] = ("prepare_fwd_bwd_input", "wait_for_device"),
               min_free_device_bytes: int | str = "auto", headroom_rule: HeadroomRule = HeadroomRule(),
               control_every: int = DEFAULT_CONTROL_EVERY):
    self.requested_mode = Mode.parse(mode)
    self._controls = ControlSchedule(control_every)
    self._saving = MeasuredSaving()
    self._judged_saving = self._saving.estimate()  # what the last sample was judged with
    self._streak = LowWaitStreak(disable_after=disable_after, reprobe_every=reprobe_every)
    self._wait_threshold = WaitThreshold(wait_threshold_s, calibration)
    self._memory_gate = MemoryGate(min_free_device_bytes, headroom_rule)
    self.excluded_steps = frozenset(int(s) for s in excluded_steps)
    self.mode = self.requested_mode
    self.reason = "requested"
    self.history: list[Transition] = []
    self.counters: dict[str, int] = dict.fromkeys(COUNTED_EVENTS, 0)
    if self.requested_mode.staged and not engine_can_stage:
      missing = ", ".join(engine_missing)
      if require_staging:
        raise StagingUnsupportedError(
            f"{self.requested_mode.name} was required (require_staging) but the engine"
            f" lacks {missing}; use an engine with the staging methods, or drop"
            " require_staging to fall back to PIPELINED"
        )
      self._apply(
          None,
          Mode.PIPELINED,
          "unsupported_engine",
          f"{self.requested_mode.name} requested but the engine lacks {missing};"
          " falling back to PIPELINED (the boundary is still pipelined, nothing is staged)",
      )

  @property
  def threshold_s(self) -> float | None:
    """The low-wait threshold (None: not calibrated yet, waits not judged)."""
    return self._wait_threshold.threshold_s

  @property
  def floor_samples(self) -> tuple[float, ...]:
    """The wait-floor samples of the last ``calibrate`` (() before one)."""
    return self._wait_threshold.floor_samples

  @property
  def auto_disabled(self) -> bool:
    return self._streak.disabled_at is not None

  @property
  def gates_on_memory(self) -> bool:
    """Whether a ``DeviceHeadroom`` given to ``plan`` can refuse a stage (``min_free_device_bytes`` is not 0)."""
    return self._memory_gate.gates

  def _apply(self, step: int | None, to_mode: Mode, kind: str, reason: str) -> Transition:
    """The one place the mode changes: records, counts and logs the transition."""
    transition = Transition(step, self.mode, to_mode, kind, reason)
    self.history.append(transition)
    self.counters[kind] = self.counters.get(kind, 0) + 1
    self.mode, self.reason = to_mode, reason
    self._saving.restart()  # the samples measured the mode before
    where = "at bring-up" if step is None else f"after step {step}"
    log.warning("[policy] %s → %s %s: %s", transition.from_mode.name, to_mode.name, where, reason)
    return transition

  def report(self) -> PolicyReport:
    """What the policy did so far: modes, transitions, counters, threshold and floor."""
    return PolicyReport(requested_mode=self.requested_mode, final_mode=self.mode,
                        auto_disables=self.counters.get("auto_disable", 0) + self.counters.get("saving_disable", 0),
                        transitions=tuple(self.history),
                        counters=dict(self.counters), threshold_s=self.threshold_s,
                        wait_floor_max_s=self._wait_threshold.floor_max_s)

  def state_dict(self) -> dict:
    """Everything the policy learned during a run, JSON-able (saved with each checkpoint).

    The settings (requested mode, thresholds given, ``disable_after``, ...)
    come from the recipe and are not part of it.
    """
    streak = self._streak
    return {
        "mode": self.mode.value, "reason": self.reason, "threshold_s": self.threshold_s,
        "floor_samples": list(self.floor_samples), "low_waits": list(streak.waits_s),
        "counters": dict(self.counters), "disabled_at": streak.disabled_at, "probe_used": streak.probe_used,
        "reported_low": streak.reported, "saving_samples": self._saving.state_dict(),
        "history": [{"step": t.step, "from_mode": t.from_mode.value, "to_mode": t.to_mode.value,
                     "kind": t.kind, "reason": t.reason} for t in self.history],
    }

  def load_state_dict(self, state: dict) -> None:
    """Continues from ``state_dict()``'s output (a resumed run); logs nothing, counts nothing new.

    Raises:
      ValueError: the state is not one this policy wrote (names the key).
    """
    streak = self._streak
    try:
      self.mode, self.reason = Mode.parse(state["mode"]), str(state["reason"])
      self._wait_threshold.restore(state["threshold_s"], state["floor_samples"])
      streak.waits_s = [float(x) for x in state["low_waits"]]
      self.counters = {str(k): int(v) for k, v in state["counters"].items()}
      streak.disabled_at = None if state["disabled_at"] is None else int(state["disabled_at"])
      streak.probe_used, streak.reported = bool(state["probe_used"]), bool(state["reported_low"])
      # A checkpoint of a version before controls has no samples and did not count them.
      self._saving.load_state_dict(state.get("saving_samples", {"staged": [], "control": []}))
      self._judged_saving = self._saving.estimate()
      self.counters = dict(dict.fromkeys(COUNTED_EVENTS, 0), **self.counters)
      self.history = [Transition(h["step"], Mode.parse(h["from_mode"]), Mode.parse(h["to_mode"]), h["kind"],
                                 h["reason"]) for h in state["history"]]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      raise ValueError(f"policy state cannot be restored: {type(e).__name__}: {e}") from None

  def calibrate(self, floor_samples: Sequence[float]) -> float | None:
    """Sets the low-wait threshold from wait-floor samples (a pinned one is kept); returns it.

    Raises:
      ValueError: no samples, or a negative or non-finite one.
    """
    return self._wait_threshold.calibrate(floor_samples)

  def plan(self, step: int, *, next_ready: bool = True, next_sampled: bool | None = None,
           headroom: DeviceHeadroom | None = None) -> BoundaryPlan:
    """What to do at the boundary after ``step``.

    ``next_ready`` False says the next step's first micro-batch cannot exist
    before this boundary's weight sync (on-policy rollouts): nothing can be
    staged, whatever the mode, and the boundary is not judged. ``next_sampled``
    False says it can, but is not sampled yet: staged before the update, the
    wait for it would hold the update back, so it is staged after the update
    (``staged_after_update_for_rollouts``; None: nobody can tell). ``headroom``
    is the devices' free memory (None: the engine cannot tell): below what a
    stage needs, the boundary is pipelined instead (``no_memory_headroom``).
    """
    mode = self.mode
    if mode is Mode.OFF:
      return BoundaryPlan.for_mode(step, mode, reason="pipelining off")
    probe = mode is Mode.PIPELINED and self._streak.probe_due(step)
    if not next_ready and (mode.staged or probe):
      self.counters["next_not_ready"] += 1
      return BoundaryPlan.unstaged(step, mode,
                                   reason="the next step's rollouts need this boundary's weight sync (on-policy)")
    if not (mode.staged or probe):
      return BoundaryPlan.for_mode(step, mode, reason=self.reason)
    if mode.staged and step in self.excluded_steps:
      self.counters["excluded_boundaries"] += 1
      return BoundaryPlan.unstaged(step, mode, reason="boundary excluded by the recipe")
    refusal = self._memory_gate.refusal(headroom)
    if refusal is not None:  # counted, logged (a warning the first time), pipelined; the mode stays
      self.counters["no_memory_headroom"] = self.counters.get("no_memory_headroom", 0) + 1
      log.log(logging.WARNING if self.counters["no_memory_headroom"] == 1 else logging.INFO,
              "[policy] step %d: %s; pipelined instead", step, refusal)
      return BoundaryPlan.unstaged(step, mode, reason=refusal)
    if not probe and self._controls.is_control(self.counters["staged_boundaries"] + self.counters["controls"] + 1):
      self.counters["controls"] += 1
      return BoundaryPlan.unstaged(step, mode, reason=CONTROL_REASON, control=True)
    if probe:
      self._streak.probe_used = True
      self.counters["probes"] += 1
      return BoundaryPlan.for_mode(step, mode, staged_as=self.requested_mode, probe=True,
                                   reason=f"re-probe {self._streak.reprobe_every} boundaries after auto-disable")
    self.counters["staged_boundaries"] += 1
    if stage_order(mode, next_sampled) is not mode:
      self.counters["staged_after_update_for_rollouts"] = self.counters.get("staged_after_update_for_rollouts", 0) + 1
      return BoundaryPlan.for_mode(step, mode, staged_as=stage_order(mode, next_sampled), reason=UPDATE_FIRST_REASON)
    return BoundaryPlan.for_mode(step, mode, reason=self.reason)

  def observe(self, step: int, *, stage_s: float, device_wait_s: float, probe: bool = False,
              update_delay_s: float | None = None, rollout_wait_s: float = 0.0,
              sampling_on_devices_s: float | None = None) -> Observation:
    """Feeds one staged boundary's stage seconds and device wait; may change the mode.

    ``update_delay_s``, when the caller knows it (from completion times), is how
    long the update was held up after the last micro-batch finished; without
    it the report bounds the delay by the stage seconds. ``rollout_wait_s`` > 0
    says the stage first waited for the next step's rollouts: a low device wait
    then says nothing about staging, and the boundary is not judged. Nor is it
    where ``sampling_on_devices_s`` > 0: a sampling call ran on the trainer's
    devices during the step, holding the host or the devices, so the host can
    reach the wait after the last micro-batch is done whatever the stage took
    (the measured saving leaves those steps out too).
    """
    streak, threshold = self._streak, self.threshold_s
    if rollout_wait_s > 0 and not probe:
      self.counters["rollout_waits"] += 1
      return Observation(step, stage_s, device_wait_s, None, len(streak.waits_s), None)
    if sampling_on_devices_s and not probe:
      self.counters["sampling_on_devices"] += 1
      return Observation(step, stage_s, device_wait_s, None, len(streak.waits_s), None)
    low = self._wait_threshold.is_low(device_wait_s)
    if probe:
      transition = self._observe_probe(step, device_wait_s, low)
      return Observation(step, stage_s, device_wait_s, low, len(streak.waits_s), transition)
    if not self.mode.staged or low is None:
      return Observation(step, stage_s, device_wait_s, low, len(streak.waits_s), None)
    if not low:
      streak.end()
      return Observation(step, stage_s, device_wait_s, False, 0, None)
    if streak.extend(device_wait_s):
      waits = streak.disable(step)
      transition = self._apply(
          step, Mode.PIPELINED, "auto_disable",
          f"{len(waits)} staged boundaries in a row had device waits [{', '.join(f'{w:.6f}' for w in waits)}] s"
          f" below the threshold {threshold:.6f} s: the stage ({stage_s:.6f} s last time)"
          " outlasted the last micro-batch, so staging is off for the run",
      )
      return Observation(step, stage_s, device_wait_s, True, len(waits), transition)
    self.counters["stage_outlasted_compute"] += 1
    level = logging.INFO if streak.reported else logging.WARNING
    streak.reported = True
    delay = f"about {update_delay_s:.6f} s" if update_delay_s is not None else f"at most {stage_s:.6f} s"
    log.log(
        level,
        "[policy] step %d: the stage (%.6f s) outlasted the last micro-batch and delayed"
        " the update by %s (device wait %.6f s < threshold %.6f s; %d of %d low waits"
        " before staging turns off)",
        step, stage_s, delay, device_wait_s, threshold, len(streak.waits_s), streak.disable_after,
    )
    return Observation(step, stage_s, device_wait_s, True, len(streak.waits_s), None)

  def observe_saving(self, step: int, sample: BoundarySample, *, control: bool) -> Transition | None:
    """Feeds one staged (or, ``control``, control) boundary's sample; turns staging off where enough controls
    show it costs time (``saving_disable``). Samples from outside a staged mode (a probe) are not kept."""
    if not self.mode.staged:
      return None
    saving = self._judged_saving = self._saving.add(sample, control=control)
    if not saving.costs_time:
      return None
    self._streak.disable(step)
    s = format_seconds
    return self._apply(
        step, Mode.PIPELINED, "saving_disable",
        f"staging cost time: a step took {s(-saving.step_s.mean)} longer staged than unstaged (saving"
        f" {s(saving.step_s.mean)}, 95 % interval {s(saving.step_s.low)} to {s(saving.step_s.high)}; at this look's"
        f" {saving.decision_level:.2%} interval, {s(saving.decision.low)} to {s(saving.decision.high)}; boundary idle"
        f" saving {s(saving.boundary_idle_s.mean, zero='none')}) over {saving.staged_n} staged and {saving.control_n} control"
        " boundaries, so staging is off" + (f"; re-probed {self._streak.reprobe_every} boundaries later"
                                            if self._streak.reprobe_every else " for the run"))

  @property
  def measured_saving(self) -> SavingEstimate:
    """What the last sample was judged with: the samples then since staging last turned on."""
    return self._judged_saving

  def _observe_probe(self, step: int, device_wait_s: float, low: bool | None) -> Transition:
    """A re-probe's verdict: staging back on unless its wait was low too."""
    threshold = self.threshold_s
    if low:
      return self._apply(step, Mode.PIPELINED, "reprobe_failed",
                         f"re-probe wait {device_wait_s:.6f} s still below {threshold:.6f} s; staging stays off")
    self._streak.enable()
    return self._apply(step, self.requested_mode, "reprobe_enabled",
                       f"re-probe wait {device_wait_s:.6f} s is above {threshold:.6f} s; staging back on")

"""Fitting the boundary model's components from a run's records: what they identify, and what they leave open.

Pure Python over record dicts (``BoundaryRecord.to_json``), so ``run_rl
simulate --from`` and the rig share one fit. docs/rig.md says what each
arm identifies:

- any arm: micro-batch compute (a step's first micro-batch apart: it computes
  beside the host's work after the boundary), the update, the metrics read, checkpoint and
  weight sync (timed apart by the program), re-runs, and the
  device time lost per dispatch inside a step (step seconds less everything
  else the record timed, per micro-batch after the first) — for each arm's own
  mode, since in a live run it is mostly the wait for the next micro-batch's
  sampling, which the sampler's pace beside each mode sets;
- each arm, for its own mode: the rollout wait (the median of its records'
  ``rollout_wait_s``). Waits are never pooled over modes: OFF asks for the next
  step's rollouts after the boundary work, which overlaps the sampler, the
  other modes before it, and a sampler that sets the pace locks the trainer's
  cycle to it, so one arm's wait says little about another mode's. A mode
  without an arm waits an ``Unknown`` spanning the fitted modes' waits (its
  point: a fitted mode that asks for the rollouts on the same side of the
  boundary work); with one fitted mode, from nothing to that arm's step;
- an OFF arm: the serial boundary cost — OFF's idle less the boundary work
  timed apart, OFF's own rollout wait and one dispatch: the input's mapping, its copy and the logging
  (what the program does between the metrics read and the first dispatch);
- a staged arm besides: the host's mapping (the stage's own seconds), so the
  rest of OFF's serial cost is the copy and the logging — their split, and
  whether the copy queues behind the update, stay unknown;
- an OFF arm's update delay: whether ``update()`` waited for the last
  micro-batch (a delay: share 0); without one the engine's settings say;
- a staged arm's boundaries that staged after the update and still idled (a
  live run whose sampler is behind): the host's seconds per dispatch call,
  where the run calibrated none (a rig calibrates it; a sampler thread in the
  same process makes those calls slower than an idle host's).

Whatever is not identified becomes an ``Unknown`` with the values it may take,
and predictions span them; nothing unknown is quietly set to zero.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence

from policies.boundary_model import Components, Estimate, Unknown
from policies.call_order import Action, boundary_actions
from policies.step_boundary import BoundaryPlan, Mode

DEFAULT_DISPATCH_S = Components.__dataclass_fields__["dispatch_s"].default


def _median(xs) -> float | None:
  xs = [x for x in xs if x is not None]
  return statistics.median(xs) if xs else None


@dataclasses.dataclass(frozen=True)
class Fit:
  """An estimate fitted from some arms of a run; ``used`` names them, in the run's order."""

  estimate: Estimate
  used: tuple[str, ...]


def fitting_arms(arms: Mapping[str, Sequence[Mapping]]) -> tuple[str, ...]:
  """The arms a fit reads: the first OFF arm and the first arm that staged (either may be missing);
  every arm when neither exists."""
  off = next((n for n, rs in arms.items() if rs and rs[0]["mode"] == "off"), None)
  staged = next((n for n, rs in arms.items() if rs and rs[0]["mode"] != "off"
                 and any(r.get("stage_s") is not None for r in rs)), None)
  used = tuple(n for n in arms if n in (off, staged))
  return used or tuple(n for n, rs in arms.items() if rs)


def _in_step_gaps(records: Sequence[Mapping]) -> list[float]:
  """Per step with a boundary before and after it: step seconds less its micro-batches, the update, the idle
  before its first micro-batch and the delay of its update — the device time outside any computation."""
  out = []
  for prev, r in zip(records, records[1:]):
    if prev.get("boundary_idle_s") is None or r.get("boundary_idle_strict_s") is None:
      continue
    delay = r["boundary_idle_strict_s"] - r["boundary_idle_s"]
    out.append(r["step_s"] - sum(r["micro_batch_s"]) - r["update_s"] - prev["boundary_idle_s"] - delay)
  return out


def device_compute(records: Sequence[Mapping]) -> dict:
  """The device's compute as ``records`` timed it: micro-batch, the first micro-batch's extra, update, re-run.

  A step's first micro-batch computes beside the host's work after the boundary, so it is timed apart from
  the others. These are the components a busy machine moves between arms (another job's load, the clock),
  while the boundary components are what the modes change.
  """
  m = min(len(r["micro_batch_s"]) for r in records)  # a shorter record (an earlier run's) is read as far as it goes
  micro = (_median(x for r in records for x in r["micro_batch_s"][1:]) if m > 1
           else _median(r["micro_batch_s"][0] for r in records))
  # Negative where the first runs faster (in OFF the host is idle beside it; later ones share the cores with the
  # next input's mapping on a CPU), never below nothing.
  extra = (max(-micro, _median(r["micro_batch_s"][0] - statistics.mean(r["micro_batch_s"][1:]) for r in records))
           if m > 1 else 0.0)
  return {"micro_batch_s": micro, "first_micro_batch_extra_s": extra,
          "update_s": _median(r["update_s"] for r in records), "rerun_s": micro}


def at_own_compute(components: Components, records: Sequence[Mapping]) -> Components:
  """``components`` with the device compute ``records`` measured: what the boundary model predicts for an arm
  once the machine's drift in compute between arms is taken out (the boundary components stay the fit's)."""
  return dataclasses.replace(components, **device_compute(records))


def fit(arms: Mapping[str, Sequence[Mapping]], *, update_reads_last_flag: bool, wait_floor_s: float | None,
        dispatch_s: float | None = None, wait_floor_source: str = "calibrated by the run",
        dispatch_source: str = "calibrated by the run") -> Fit:
  """Components from the records of ``fitting_arms(arms)``; see the module docstring.

  ``update_reads_last_flag``: the engine's settings make ``update()`` read the
  last micro-batch's flag (dropless re-runs, a non-finite check). ``wait_floor_s``
  and ``dispatch_s``: what the run calibrated (None: not known).

  Raises:
    ValueError: fewer than 2 records in the arms it reads.
  """
  used = fitting_arms(arms)
  pooled = [r for n in used for r in arms[n]]
  if len(pooled) < 2:
    raise ValueError(f"a fit needs at least 2 records; the arms {list(used)} hold {len(pooled)}")
  sources: dict[str, str] = {}
  unknowns: list[Unknown] = []
  m = len(pooled[0]["micro_batch_s"])
  values = {
      **device_compute(pooled),
      # The program times the metrics read net of its wait for the update (the model charges the update).
      "metrics_s": _median(r.get("metrics_s") or 0.0 for r in pooled),
      "checkpoint_s": _median(r.get("checkpoint_s") or 0.0 for r in pooled),
      "weight_sync_s": _median(r.get("weight_sync_s") or 0.0 for r in pooled),
      "reruns_per_step": _median(r.get("reruns") or 0 for r in pooled),
  }
  sources.update({k: "fitted" for k in values})
  values.update(_rollout_waits(arms, used, sources, unknowns))
  if m == 1:
    sources["first_micro_batch_extra_s"] = "inside micro_batch_s (one micro-batch per step)"
  if wait_floor_s is None:
    wait_floor_s, sources["wait_floor_s"] = 0.0, "default (the run calibrated none)"
  else:
    sources["wait_floor_s"] = wait_floor_source
  off = [n for n in used if arms[n][0]["mode"] == "off"]
  staged = [n for n in used if arms[n][0]["mode"] != "off"]
  values["update_overlap_share"] = _overlap_share(arms, off, update_reads_last_flag, sources, unknowns)
  if dispatch_s is None:
    # The host-paced boundaries say one dispatch's seconds only where update() returns at once (share 1).
    paced = (_dispatch_where_the_host_set_the_pace(arms, staged) if values["update_overlap_share"] == 1.0
             else None)
    dispatch_s, sources["dispatch_s"] = paced or (DEFAULT_DISPATCH_S, "default")
  else:
    sources["dispatch_s"] = dispatch_source
  values.update(wait_floor_s=wait_floor_s, dispatch_s=dispatch_s)

  values.update(_gaps(arms, used, m, wait_floor_s + dispatch_s, sources, unknowns))

  stage_s = _median(r.get("stage_s") for n in staged for r in arms[n])
  # A stage that ran beside the last micro-batch's compute (before the update), apart from those on the idle path.
  stage_beside_s = _median(r.get("stage_s") for n in staged for r in arms[n] if _staged_before_update(r) is True)
  serial = None
  if off:
    work = values["metrics_s"] + values["checkpoint_s"] + values["weight_sync_s"]
    serial = _median(r["boundary_idle_s"] for r in arms[off[0]][:-1])
    # OFF's own rollout wait, as the prediction adds it back: a staged arm's would misstate the serial cost.
    off_wait = dict(values["rollout_wait_by_mode"]).get(Mode.OFF.value, values["rollout_wait_s"])
    serial = None if serial is None else max(0.0, serial - work - off_wait - dispatch_s)
  _split_serial_cost(values, sources, unknowns, serial, stage_s, stage_beside_s)
  sources["micro_batches_per_step"] = "the records"
  components = Components(micro_batches_per_step=m, **values)
  return Fit(Estimate(components, sources, tuple(unknowns)), used)


def _staged_before_update(record: Mapping) -> bool | None:
  """Whether the record's boundary staged before the update (None: it did not stage, or an earlier record does
  not say; a STAGE_AFTER_UPDATE boundary always stages after it)."""
  if record.get("stage_s") is None:
    return None
  if record["mode"] == Mode.STAGE_AFTER_UPDATE.value:
    return False
  return record.get("stage_before_update")


#: What a record's ``actions`` call the boundary work and the staged dispatch (``policies.call_order``).
_BOUNDARY_WORK = (Action.METRICS.value, Action.CHECKPOINT_AND_SYNC.value)


def _host_paced(record: Mapping) -> bool:
  """A boundary that staged after the update, idled, and ran no boundary work before its first dispatch (a
  checkpoint due, or ``sync_before_next_step``, puts it there): the host's dispatch calls set its idle."""
  if _staged_before_update(record) is not False or not record.get("boundary_idle_s"):
    return False
  actions = record.get("actions") or []
  first = actions.index(Action.DISPATCH_FIRST_STAGED.value) if Action.DISPATCH_FIRST_STAGED.value in actions else 0
  return not any(a in _BOUNDARY_WORK for a in actions[:first])


def _dispatch_where_the_host_set_the_pace(arms, staged) -> tuple[float, str] | None:
  """One dispatch call's host seconds, from a staged arm's boundaries where the host alone set the pace.

  There (``_host_paced``), from the last micro-batch's dispatch the host made three dispatch calls (that
  micro-batch, the update, the first staged micro-batch) besides waiting for rollouts and staging, so idle =
  3 dispatches + rollout wait + stage - last micro-batch - update (update() returns at once: the caller checks
  the overlap share is 1). What it measures is every host second on that path but the wait and the stage —
  the calls, taking the rollouts, the record — charged wherever a dispatch falls. A sampler thread in the same
  process makes it longer than an idle host's, which a rig's calibration cannot see. None: no such boundary.
  """
  calls = [(r["boundary_idle_s"] + r["micro_batch_s"][-1] + r["update_s"] - (r.get("rollout_wait_s") or 0.0)
            - r["stage_s"]) / 3 for n in staged for r in arms[n][:-1] if _host_paced(r)]
  if not calls:
    return None
  return max(0.0, statistics.median(calls)), (
      f"fitted (a third of the host's seconds beyond the rollout wait and the stage at {len(calls)} boundaries"
      " that staged after the update and idled)")


def _gaps(arms, used, m: int, assumed_s: float, sources: dict, unknowns: list) -> dict:
  """The device time lost per dispatch inside a step, pooled and per fitted mode (see the module docstring);
  ``assumed_s`` its bound where one micro-batch per step leaves none to measure (a wait floor and a dispatch)."""
  out: dict = {}
  by_mode: dict[str, list[float]] = {}
  for n in used:
    by_mode.setdefault(arms[n][0]["mode"], []).extend(_in_step_gaps(arms[n]))
  gaps = [g for mode_gaps in by_mode.values() for g in mode_gaps]
  if m > 1 and gaps:
    out["gap_per_dispatch_s"] = max(0.0, statistics.median(gaps) / (m - 1))
    sources["gap_per_dispatch_s"] = "fitted (every fitted arm's, for a mode no arm ran)"
    out["gap_by_mode"] = tuple((mode.value, max(0.0, statistics.median(by_mode[mode.value]) / (m - 1)))
                               for mode in Mode if by_mode.get(mode.value))
    sources["gap_by_mode"] = "fitted (each arm's median, for its own mode)"
    fitted_gaps = dict(out["gap_by_mode"])
    missing = [mode.value for mode in Mode if mode.value not in fitted_gaps]
    lo, hi = min(fitted_gaps.values()), max(fitted_gaps.values())
    if missing and hi - lo > 1e-9:  # a nanosecond apart is one gap (the records' float sums)
      span = ", ".join(f"{mode} {g:.6f} s" for mode, g in out["gap_by_mode"])
      unknowns.append(Unknown("gap_per_dispatch_s", f"no arm ran {', '.join(missing)}: its gap per dispatch lies"
                              f" between the fitted modes' ({span})",
                              ({"gap_per_dispatch_s": lo}, {"gap_per_dispatch_s": hi})))
  else:
    out["gap_per_dispatch_s"] = 0.0
    sources["gap_per_dispatch_s"] = "unidentified"
    sources["gap_by_mode"] = "unidentified (as gap_per_dispatch_s)"
    unknowns.append(Unknown("gap_per_dispatch_s", "one micro-batch per step has no gap inside a step to measure;"
                            " assumed at most a wait floor and a dispatch",
                            ({"gap_per_dispatch_s": assumed_s},)))
  return out


def _asks_before_boundary_work(mode: Mode) -> bool:
  """Whether ``mode``'s call order needs the next step's rollouts before the boundary work (the metrics read)."""
  actions = boundary_actions(BoundaryPlan.for_mode(0, mode, reason="modelled"))
  need = next(i for i, a in enumerate(actions) if a in (Action.STAGE_FIRST, Action.DISPATCH_FIRST))
  return need < actions.index(Action.METRICS)


def _rollout_waits(arms, used, sources: dict, unknowns: list) -> dict:
  """Each fitted arm's rollout wait for its mode, and what a mode without an arm waits (module docstring)."""
  waits: dict[str, list[float]] = {}
  steps: dict[str, list[float]] = {}
  for n in used:
    these = [r["rollout_wait_s"] for r in arms[n] if r.get("rollout_wait_s") is not None]
    if these:
      waits.setdefault(arms[n][0]["mode"], []).extend(these)
      steps.setdefault(arms[n][0]["mode"], []).extend(r["step_s"] for r in arms[n])
  if not waits:
    none = "none recorded (no arm has a live source to wait for)"
    sources.update(rollout_wait_s=none, rollout_wait_by_mode=none)
    return {"rollout_wait_s": 0.0, "rollout_wait_by_mode": ()}
  fitted = {mode: statistics.median(w) for mode, w in waits.items()}
  by_mode = tuple((m.value, fitted[m.value]) for m in Mode if m.value in fitted)  # in the modes' order
  sources["rollout_wait_by_mode"] = "fitted (each arm's median, for its own mode)"
  missing = [m for m in Mode if m.value not in fitted]
  if not missing:
    sources["rollout_wait_s"] = "irrelevant (every mode has an arm)"
    return {"rollout_wait_s": 0.0, "rollout_wait_by_mode": by_mode}
  sides = {_asks_before_boundary_work(m) for m in missing}
  near = [w for mode, w in fitted.items() if _asks_before_boundary_work(Mode(mode)) in sides] or list(fitted.values())
  point = statistics.median(near)
  names = ", ".join(m.value for m in missing)
  sources["rollout_wait_s"] = (f"unidentified for {names} (no arm): the fitted wait of a mode that asks for the"
                               " rollouts on the same side of the boundary work")
  if len(fitted) > 1:
    span = ", ".join(f"{mode} {w:.6f} s" for mode, w in by_mode)
    unknowns.append(Unknown("rollout_wait_s", f"no arm ran {names}: its rollout wait lies between the fitted"
                            f" modes' ({span}); where a mode asks for the rollouts changes how long it waits",
                            tuple({"rollout_wait_s": w} for w in sorted(set(fitted.values())))))
  else:
    mode, step = next((m, statistics.median(s)) for m, s in steps.items())  # the one fitted mode
    unknowns.append(Unknown("rollout_wait_s", f"only {mode} has an arm: one mode's rollout wait does not tell"
                            f" {names}'s (asking earlier can wait up to about a step, {step:.6f} s, where the"
                            " sampler sets the pace; asking later, nothing)",
                            ({"rollout_wait_s": 0.0}, {"rollout_wait_s": step})))
  return {"rollout_wait_s": point, "rollout_wait_by_mode": by_mode}


def _split_serial_cost(values: dict, sources: dict, unknowns: list, serial: float | None,
                       stage_s: float | None, stage_beside_s: float | None) -> None:
  """Mapping, copy and logging from OFF's serial cost and a stage's seconds (see the module docstring);
  ``stage_beside_s``: the stages that ran beside the last micro-batch's compute (None: none did)."""
  sync = Unknown("sync_copy", "no arm tells whether an unstaged copy queues behind the update",
                 ({"sync_copy": False}, {"sync_copy": True}))
  values["sync_copy"], sources["sync_copy"] = False, "unidentified"
  if serial is not None and stage_beside_s is not None and stage_beside_s > serial:
    stage_s = stage_beside_s
    # The stage ran beside the compute and took longer than OFF's whole serial cost, mapping on an idle host:
    # the host's mapping slows beside the compute (shared cores, a remote call waiting on the trainer). OFF's
    # cost is the mapping's own, and beside the compute the stage hides unless it outlasts the micro-batch.
    values.update(map_s=serial, copy_s=0.0, logging_s=0.0)
    sources.update(map_s=f"fitted as OFF's serial cost (the staged arm's stage took {stage_s:.6f} s beside the"
                         " compute, longer than it: a stage that outlasts a micro-batch is under-predicted)",
                   copy_s="fitted (nothing beyond the mapping)", logging_s="fitted (nothing beyond the mapping)",
                   sync_copy="irrelevant (no copy beyond the mapping)")
    return
  if serial is not None and stage_s is not None:
    values["map_s"], sources["map_s"] = stage_s, "fitted (the staged arm's stage seconds)"
    rest = max(0.0, serial - stage_s)
    # The point puts the rest on the host (logging); the unknown spans moving it to the copy.
    values.update(copy_s=0.0, logging_s=rest)
    if rest == 0:
      none = "fitted (OFF's serial cost is within the stage's seconds: nothing beyond the mapping)"
      sources.update(copy_s=none, logging_s=none, sync_copy="irrelevant (no copy beyond the mapping)")
      return
    sources.update(copy_s="unidentified", logging_s="unidentified")
    unknowns.append(Unknown("copy_s + logging_s", f"OFF's serial cost beyond the stage ({rest:.6f} s) is a copy"
                            " or logging; no arm splits them",
                            ({"copy_s": rest, "logging_s": 0.0}, {"copy_s": rest / 2, "logging_s": rest / 2})))
    unknowns.append(sync)
    return
  if serial is not None:
    values.update(map_s=serial, copy_s=0.0, logging_s=0.0)
    sources.update(map_s="fitted as OFF's whole serial cost (split unidentified)", copy_s="unidentified",
                   logging_s="unidentified")
    if serial > 0:
      unknowns.append(Unknown("map_s + copy_s + logging_s", f"OFF's serial cost ({serial:.6f} s) is mapping, copy"
                              " and logging; only a staged arm separates the mapping",
                              ({"map_s": 0.0, "copy_s": serial}, {"map_s": 0.0, "logging_s": serial},
                               {"map_s": serial / 3, "copy_s": serial / 3, "logging_s": serial / 3})))
      unknowns.append(sync)
    return
  stage = stage_s or 0.0
  values.update(map_s=stage, copy_s=0.0, logging_s=0.0)
  sources.update(map_s="fitted (stage seconds)" if stage_s is not None else "unidentified",
                 copy_s="unidentified", logging_s="unidentified")
  # Without an OFF arm nothing measures the serial cost; assume it at most a stage's seconds again.
  unknowns.append(Unknown("copy_s + logging_s", "no OFF arm measures the serial cost; assumed at most one"
                          " stage's seconds beyond the mapping",
                          ({"copy_s": stage}, {"logging_s": stage})))
  unknowns.append(sync)


def _overlap_share(arms, off: list[str], reads_flag: bool, sources: dict, unknowns: list) -> float:
  """Whether update() waited for the last micro-batch: OFF's update delay says; else the engine's settings."""
  if off:
    delays = [r["boundary_idle_strict_s"] - r["boundary_idle_s"] for r in arms[off[0]][:-1]
              if r.get("boundary_idle_strict_s") is not None and r.get("boundary_idle_s") is not None]
    delay = _median(delays)
    if delay is not None and delay > 0:
      sources["update_overlap_share"] = f"fitted (OFF's update started {delay:.6f} s after its last micro-batch)"
      return 0.0
    if delay is not None and not reads_flag:
      sources["update_overlap_share"] = "fitted (OFF's update was dispatched before its last micro-batch ended)"
      return 1.0
  if not reads_flag:
    sources["update_overlap_share"] = "engine settings (update() reads no flag)"
    return 1.0
  sources["update_overlap_share"] = "engine settings (update() reads the last micro-batch's flag); unconfirmed"
  unknowns.append(Unknown("update_overlap_share", "no OFF arm shows whether update() waited for the last"
                          " micro-batch", ({"update_overlap_share": 0.5}, {"update_overlap_share": 1.0})))
  return 0.0

"""``run_rl simulate``: the boundary model as a planning tool, fed from a recipe.

The recipe's ``simulate`` section gives component times (micro-batch, input
copy, update, metrics and other boundary work, wait floor, dispatch) and
whether ``update()`` waits for the last micro-batch; the batch section gives
micro-batches per step and the token count. See ``policies.boundary_model`` for
the model's assumptions and where it is pessimistic or optimistic.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

from orchestrator.app import run_dir
from policies import Mode
from policies.boundary_model import Components, predict
from policies.step_boundary import format_seconds


def components_from_recipe(recipe) -> Components:
  s = recipe.simulate
  return Components(
      micro_batch_s=s.micro_batch_s,
      prepare_s=s.input_copy_s,
      update_s=s.update_s,
      boundary_work_s=s.metrics_s,
      dispatch_s=s.dispatch_s,
      wait_floor_s=s.wait_floor_s,
      micro_batches_per_step=recipe.batch.micro_batches_per_step,
      update_waits_for_last=s.update_waits_for_last,
  )


def tokens_per_device_per_step(recipe) -> float:
  if recipe.simulate.tokens_per_device:
    per_micro = recipe.simulate.tokens_per_device
  else:
    preset = recipe.model_preset()
    rows = recipe.batch.rows or preset.rows
    tokens = recipe.batch.tokens_per_row or preset.tokens_per_row
    devices = recipe.mesh.fsdp * recipe.mesh.context * recipe.mesh.expert
    per_micro = rows * tokens / devices
  return per_micro * recipe.batch.micro_batches_per_step


def simulate(recipe) -> list[dict]:
  c = components_from_recipe(recipe)
  tokens = tokens_per_device_per_step(recipe)
  off = predict(c, Mode.OFF)
  rows = []
  for mode in Mode:
    p = predict(c, mode)
    rows.append({
        **p.as_dict(),
        "tokens_per_s_per_device": tokens / p.step_s,
        "saves_vs_off_s": off.step_s - p.step_s,
        "saves_vs_off_share": (off.step_s - p.step_s) / off.step_s,
        "idle_share_of_step": p.boundary_idle_s / p.step_s,
    })
  return rows


def format_simulation(recipe, rows) -> str:
  c = components_from_recipe(recipe)
  lines = [
      f"simulate: {recipe.name} — {c.micro_batches_per_step} micro-batches of {format_seconds(c.micro_batch_s)},"
      f" input copy {format_seconds(c.prepare_s)}, update {format_seconds(c.update_s)},"
      f" boundary work {format_seconds(c.boundary_work_s)}, wait floor {format_seconds(c.wait_floor_s)},"
      f" update waits for the last micro-batch: {'yes' if c.update_waits_for_last else 'no'}",
      f"compute-only bound per step: {c.compute_bound_s:.3f} s",
      "",
      f"{'mode':<20} {'boundary idle':>14} {'idle/step':>10} {'step':>10} {'tokens/s/device':>16} {'saves vs OFF':>14}",
  ]
  for r in rows:
    lines.append(
        f"{r['mode']:<20} {format_seconds(r['boundary_idle_s']):>14} {r['idle_share_of_step']:>10.1%}"
        f" {r['step_s']:>9.3f}s {r['tokens_per_s_per_device']:>16,.0f} {r['saves_vs_off_share']:>13.1%}")
  return "\n".join(lines)


def _median(xs) -> float:
  xs = list(xs)
  return statistics.median(xs) if xs else 0.0


def _fit(records: list[dict], *, wait_floor_s: float, update_waits_for_last: bool, dispatch_s: float | None = None
         ) -> Components:
  """Component times from boundary records: medians of what each record measured."""
  stages = [r["stage_s"] for r in records if r.get("stage_s") is not None]
  fitted = Components(
      micro_batch_s=_median(x for r in records for x in r["micro_batch_s"]),
      prepare_s=_median(stages),
      update_s=_median(r["update_s"] for r in records),
      # The host's own boundary work: a metrics read that waited for the update counts only its work
      # (the model charges the update itself).
      boundary_work_s=_median(max(0.0, (r.get("metrics_s") or 0) - (r.get("metrics_wait_s") or 0))
                              + (r.get("checkpoint_s") or 0) + (r.get("weight_sync_s") or 0) for r in records),
      wait_floor_s=wait_floor_s,
      micro_batches_per_step=len(records[0]["micro_batch_s"]),
      update_waits_for_last=update_waits_for_last,
      reruns_per_step=_median(r.get("reruns") or 0 for r in records),
      rerun_s=_median(x for r in records for x in r["micro_batch_s"]),
      rollout_wait_s=_median(r["rollout_wait_s"] for r in records if r.get("rollout_wait_s") is not None),
  )
  return fitted if dispatch_s is None else dataclasses.replace(fitted, dispatch_s=dispatch_s)


def _measured(records: list[dict], mode: str) -> dict:
  idles = [r["boundary_idle_s"] for r in records[:-1] if r.get("boundary_idle_s") is not None]
  return {"mode": mode, "boundary_idle_s": _median(idles), "step_s": _median(r["step_s"] for r in records),
          "steps": len(records)}


def components_from_run(path) -> tuple[Components, dict]:
  """Component times fitted from a run's (or a rig's) records, and what it measured per mode (or per arm).

  A ``run_rl`` run directory: micro-batch, update and boundary-work seconds are
  the records' medians; the preparation is the median stage (0 when the run
  never staged); the wait floor is the one the run calibrated. A ``run_rl rig``
  directory: the same fit over every arm's records (``records.json``), the
  rig's calibrated wait floor and dispatch, and each arm measured on its own.

  Raises:
    RunDirError / ValueError: neither a run nor a rig directory, or one without records.
  """
  path = Path(path)
  if (path / "records.json").is_file() and (path / "predictions.json").is_file():
    arms = json.loads((path / "records.json").read_text())
    calibrated = json.loads((path / "predictions.json").read_text())["components"]
    pooled = [r for records in arms.values() for r in records]
    if len(pooled) < 2:
      raise run_dir.RunDirError(f"simulate --from {path}: the rig's records.json holds {len(pooled)} records")
    components = _fit(pooled, wait_floor_s=calibrated["wait_floor_s"], dispatch_s=calibrated["dispatch_s"],
                      update_waits_for_last=calibrated["update_waits_for_last"])
    return components, {name: _measured(records, records[0]["mode"]) for name, records in arms.items() if records}
  config = run_dir.read_config(path, flag="simulate --from")
  segments = run_dir.segments(path, config)
  records = run_dir.run_records(segments, needed=sys.maxsize)  # every step, across the segments
  if len(records) < 2:
    raise run_dir.RunDirError(f"simulate --from {path}: it holds {len(records)} records; at least 2 are needed")
  summary_path = segments[-1].path / run_dir.SUMMARY
  summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
  engine = config["config"].get("engine", {})
  components = _fit(records, wait_floor_s=summary.get("wait_floor_max_s") or 0.0,
                    update_waits_for_last=bool(engine.get("retry_when_tokens_dropped")
                                               or engine.get("skip_nonfinite_updates")))
  modes = {r["mode"] for r in records}
  return components, {mode: _measured([r for r in records if r["mode"] == mode], mode) for mode in modes}


#: How close a fit must come to call a prediction good: step within 5 %; idle within the larger
#: of 5 % of a micro-batch and 2 ms.
STEP_TOLERANCE = 0.05
IDLE_TOLERANCE_S = 0.002


def format_fit(path, components: Components, measured: dict) -> str:
  """Each measured mode's (or arm's) prediction from the fitted components, beside what was measured."""
  c = components
  idle_tol = max(STEP_TOLERANCE * c.micro_batch_s, IDLE_TOLERANCE_S)
  lines = [
      f"simulate --from {path}: {c.micro_batches_per_step} micro-batches of {format_seconds(c.micro_batch_s)},"
      f" stage {format_seconds(c.prepare_s)}, update {format_seconds(c.update_s)}, boundary work"
      f" {format_seconds(c.boundary_work_s)}, wait floor {format_seconds(c.wait_floor_s)}, rollout wait"
      f" {format_seconds(c.rollout_wait_s)} (fitted from its records)",
      "",
      f"{'mode':<20} {'predicted idle':>15} {'predicted step':>15} {'measured idle':>14} {'measured step':>14}"
      f" {'step error':>11} {'idle error':>11}  within (step 5%, idle {format_seconds(idle_tol)})",
  ]
  rows = dict(measured)
  for mode in Mode:
    if not any(m["mode"] == mode.value for m in measured.values()):
      rows[mode.value] = None
  for name, m in rows.items():
    p = predict(c, Mode(m["mode"] if m else name))
    if m is None:
      lines.append(f"{name:<20} {format_seconds(p.boundary_idle_s):>15} {format_seconds(p.step_s):>15}"
                   f" {'-':>14} {'-':>14} {'-':>11} {'-':>11}  -")
      continue
    step_err = (p.step_s - m["step_s"]) / m["step_s"]
    idle_err = p.boundary_idle_s - m["boundary_idle_s"]
    ok = abs(step_err) <= STEP_TOLERANCE and abs(idle_err) <= idle_tol
    lines.append(f"{name:<20} {format_seconds(p.boundary_idle_s):>15} {format_seconds(p.step_s):>15}"
                 f" {format_seconds(m['boundary_idle_s']):>14} {format_seconds(m['step_s']):>14}"
                 f" {step_err:>+10.1%} {format_seconds(idle_err):>11}  {'yes' if ok else 'no'}")
  return "\n".join(lines)

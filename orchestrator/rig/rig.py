"""The reduced rig: several arms over the same recorded steps, from the same start, checked and scored.

Order of a rig run (docs/rig.md):

1. build the engine once; replay the recording into steps of micro-batch payloads;
   snapshot the initial state;
2. a warm-up arm (absorbs compiles; not scored);
3. a calibration pass: per-micro-batch compute, input preparation, dispatch,
   update, boundary work (metrics, logging, weight sync) and the wait floor;
4. predictions from ``policies.boundary_model``, written to ``predictions.json``
   before the first scored arm starts;
5. the arms, each restored to the snapshot, each through the real
   ``RLProgram`` and ``TrainerWorker`` over a call-recording engine proxy;
6. checks and scores; ``report.md``, ``report.json``, ``trace.json``, ``timeline.png``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from orchestrator.data.recording import open_recording
from orchestrator.recipe.loading import run_config_dict
from orchestrator.rig.arms import Arm, RigError, apply_faults, arm_steps, parse_arms
from orchestrator.rig.checks import (Check, check_arm, cross_arm_checks, failing_checks, prediction_checks,
                                     predictions_written_first)
from orchestrator.rig.replay import replay_plan
from orchestrator.rig.report import write_reports
from orchestrator.rig.trainers import BatchShape, LocalRigTrainer, RemoteRigTrainer, recipe_batch_shape
from policies import Mode
from policies.boundary_fit import at_own_compute, fit
from policies.boundary_model import Components, band, predict, predict_bounded

__all__ = ["RigError", "RigResult", "run_rig"]


@dataclasses.dataclass
class RigResult:
  """A finished rig run: its directory, ``report.json``'s content, the arms' reports and the checks."""

  out_dir: Path
  report: dict
  arms: list[dict]
  checks: list[Check] = dataclasses.field(default_factory=list)

  @property
  def exit_code(self) -> int:
    """``run_rl rig``'s exit status: 1 when a correctness check failed; a missed prediction band is reported only."""
    return 1 if failing_checks(self.checks) else 0


def _stats(xs: Sequence[float]) -> dict | None:
  xs = [x for x in xs if x is not None]
  if not xs:
    return None
  return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _predictions(arms, components: Components, noise: float, recipe) -> dict:
  predictions = {
      # The job the arms run, so `simulate --from` can take a fit of them to another job's shape.
      "recipe_config": run_config_dict(recipe),
      "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "written_at_monotonic_s": time.monotonic(),
      "components": dataclasses.asdict(components),
      "compute_bound_step_s": components.compute_bound_s,
      "micro_batch_relative_spread": noise,
      "arms": [],
  }
  idle_tol = max(0.002, 3 * components.dispatch_s)
  for arm in arms:
    p = predict(components, arm.mode)
    predictions["arms"].append({
        "name": arm.name, **p.as_dict(),
        "boundary_idle_band_s": band(p.boundary_idle_s, rel=0.5, abs_s=idle_tol),
        # ±5 %, or twice the micro-batch spread the calibration saw on this machine.
        "step_band_s": band(p.step_s, rel=max(0.05, 2 * noise), abs_s=0.005),
    })
  return predictions


def fitted_predictions(arm_reports: list[dict], calibrated: Components, recipe) -> dict:
  """Every arm predicted from components fitted on the OFF arm and the first staged arm only (the rest are
  true predictions), beside what each measured; the fit's sources and unknowns with it."""
  arms = {a["name"]: a["records"] for a in arm_reports if a["records"]}
  try:
    result = fit(arms, update_reads_last_flag=recipe.engine.retry_when_tokens_dropped
                 or recipe.engine.skip_nonfinite_updates, wait_floor_s=calibrated.wait_floor_s,
                 dispatch_s=calibrated.dispatch_s, wait_floor_source="calibrated by the rig",
                 dispatch_source="calibrated by the rig")
  except ValueError as e:  # too few records: the report says why instead
    return {"fitted_on": [], "error": str(e), "arms": []}
  estimate = result.estimate
  rows = []
  for a in arm_reports:
    p = predict_bounded(estimate, Mode(a["mode"]))
    measured_idle = a["boundary_idle_s"]["median"] if a["boundary_idle_s"] else None
    # The fit's boundary components with this arm's own compute: the model's error without the machine's drift.
    own = predict(at_own_compute(estimate.components, a["records"]), Mode(a["mode"])) if a["records"] else None
    rows.append({"name": a["name"], "fitted_on": a["name"] in result.used, **p.as_dict(),
                 "measured_step_s": a["step_s"]["median"], "measured_boundary_idle_s": measured_idle,
                 "measured_micro_batch_s": a["micro_batch_s"]["median"],
                 "at_own_compute": (None if own is None else
                                    {"step_s": own.step_s, "boundary_idle_s": own.boundary_idle_s})})
  return {"fitted_on": list(result.used), "components": dataclasses.asdict(estimate.components),
          "sources": dict(estimate.sources), "unidentified": [u.as_dict() for u in estimate.unknowns],
          "arms": rows}


def _arm_report(arm: Arm, result, components: Components) -> dict:
  records, summary = result.records, result.summary
  boundaries = records[:-1]
  report = {
      "name": arm.name, "mode": arm.mode.value, "fault": arm.fault, "final_mode": summary.policy.final_mode.value,
      "boundary_idle_s": _stats([r.boundary_idle_s for r in boundaries]),
      "boundary_idle_strict_s": _stats([r.boundary_idle_strict_s for r in boundaries]),
      "step_s": _stats([r.step_s for r in records]),
      "micro_batch_s": _stats([x for r in records for x in r.micro_batch_s]),
      "update_s": _stats([r.update_s for r in records]),
      "device_wait_s": _stats([r.device_wait_s for r in boundaries]),
      "stage_s": _stats([r.stage_s for r in boundaries]),
      "boundary_work_s": _stats([(r.metrics_s or 0) + (r.checkpoint_s or 0) + (r.weight_sync_s or 0)
                                 for r in records]),
      "reruns": [r.reruns or 0 for r in records],
      "auto_disables": summary.policy.auto_disables,
      # Control boundaries against staged ones (policies.saving); None where the arm's mode does not stage.
      "measured_saving": (summary.timings.measured_saving.to_json() if arm.mode.staged
                          and summary.timings.measured_saving is not None else None),
      "final_state_digest": summary.final_state_digest,
      "records": [r.to_json() for r in records],
  }
  stage = report["stage_s"]["median"] if report["stage_s"] else components.map_s
  report["prepare_share_of_micro_batch"] = stage / report["micro_batch_s"]["median"]
  return report


def run_rig(recipe, recording_dir: str | Path, arm_names: Sequence[str], out_dir: str | Path, *,
            steps: int | None = None, faults: dict[str, str] | None = None, warmup_steps: int = 2,
            progress=None) -> RigResult:
  """Runs the rig; see the module docstring. ``faults`` maps arm names to an injected fault."""
  out = Path(out_dir)
  arms = parse_arms(arm_names)
  apply_faults(arms, faults)
  steps = steps or recipe.steps
  if steps < 2:
    raise RigError(f"the rig needs at least 2 steps (a boundary), got {steps}")
  if recipe.engine.backend != "jax" and recipe.trainer.location == "local":
    raise RigError(f"the rig drives the JAX engine (it snapshots and times its parts);"
                   f" engine.backend={recipe.engine.backend!r} is not supported here")
  m = recipe.batch.micro_batches_per_step
  preset = recipe.model_preset()  # the recording is checked before a trainer is built
  recording = open_recording(recording_dir, vocab_size=preset.vocab_size,
                             routing=recipe.engine.routing_shape(preset))
  # The steps are packed before a trainer is built, so a recording that cannot fill them is refused at once,
  # not after minutes of compiling; a trainer that packs another shape (a remote one's own sizes) is planned for
  # again once it is known.
  asked = recipe_batch_shape(recipe)
  plan = replay_plan(asked, recording, m, steps)
  say = _timed(progress)
  say("building the trainer (compiling its programs)")
  trainer = RemoteRigTrainer(recipe, out) if recipe.trainer.location == "remote" else LocalRigTrainer(recipe)
  try:
    if _packing(trainer.shape) != _packing(asked):
      plan = replay_plan(trainer.shape, recording, m, steps)
    say(f"trainer built{_compile_note(trainer)}")
    return _run_arms(recipe, trainer, recording, plan, arms, out, steps, warmup_steps, say)
  finally:
    trainer.close()


def _packing(shape: BatchShape) -> tuple:
  """What a plan's payloads and digests depend on (not whether the engine re-runs dropped tokens)."""
  return shape.rows, shape.tokens_per_row, shape.vocab_size, shape.routing


def _timed(progress):
  """``progress`` with the seconds since the rig started before each message (a rig cut short shows where its
  time went); a no-op without ``progress``."""
  start = time.monotonic()

  def say(message: str) -> None:
    if progress:
      progress(f"[{time.monotonic() - start:.0f} s] {message}")
  return say


def _compile_note(trainer) -> str:
  engine = getattr(trainer, "engine", None)  # a remote trainer compiles on its own host
  seconds = getattr(engine, "compile_s", None)
  if not seconds:
    return ""
  parts = ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items())
  return f" (compiled side by side: {parts})"


def _run_arms(recipe, trainer, recording, plan, arms, out: Path, steps: int, warmup_steps: int,
              say) -> RigResult:
  out.mkdir(parents=True, exist_ok=True)
  m = recipe.batch.micro_batches_per_step

  def run_arm(arm: Arm, steps_fed, n_steps):
    return trainer.run_arm(arm, steps_fed, n_steps, plan.digest_by_payload)

  run_arm(Arm("warmup", Mode.STAGE_BEFORE_UPDATE), plan.steps, min(warmup_steps, steps))  # absorbs compiles
  say("warm-up arm done; calibrating")
  components, noise = trainer.calibrate(plan.steps)
  say(f"calibrated: micro-batch {components.micro_batch_s * 1e3:.1f} ms, input map {components.map_s * 1e3:.1f}"
      f" ms, update {components.update_s * 1e3:.1f} ms")
  predictions = _predictions(arms, components, noise, recipe)
  (out / "predictions.json").write_text(json.dumps(predictions, indent=2))  # before any scored arm

  arm_reports, checks, traces = [], [], []
  first_arm_started = time.monotonic()
  for index, arm in enumerate(arms):
    say(f"arm {index + 1}/{len(arms)}: {arm.name}")
    result, events, compiles_delta = run_arm(arm, arm_steps(arm, plan.steps), steps)
    checks += check_arm(arm, result, events, compiles_delta, plan.expected_digests, plan.expected_tokens, m)
    report = _arm_report(arm, result, components)
    if arm_reports:
      checks += cross_arm_checks(report, arm_reports[0])
    arm_reports.append(report)
    traces.append((arm.name, result))
    pred = next(p for p in predictions["arms"] if p["name"] == arm.name)
    checks += prediction_checks(report, pred, len(result.records))
  checks.insert(0, predictions_written_first(predictions, first_arm_started))
  fitted = fitted_predictions(arm_reports, components, recipe)
  report = write_reports(out, arm_reports, predictions, checks, components, traces, recipe, recording, fitted)
  return RigResult(out, report, arm_reports, checks)

"""The reduced rig: several arms over the same recorded steps, from the same start, checked and scored.

Order of a rig run (docs/design.md §7):

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
from typing import Any

import jax

from orchestrator.data.packing import content_digest, count_loss_tokens, pack_payload
from orchestrator.loop.weight_sync import HostWeightStore
from policies import BoundaryPlan, Mode
from policies.boundary_model import Components, band, predict
from policies.call_order import boundary_actions, engine_calls_between

ARM_MODES = {mode.value: mode for mode in Mode}
FAULTS = ("reorder_micro_batches", "skip_update")


class RigError(ValueError):
  """A rig invocation that cannot run (bad arm name, too few steps, ...)."""


@dataclasses.dataclass
class Arm:
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


class CallRecordingEngine:
  """Passes every call to the engine and logs (kind, content digest) — for the rig's checks.

  ``fault`` injects a bug for negative controls: ``skip_update`` drops the
  update of step 1.
  """

  def __init__(self, engine, digests: dict[int, str], fault: str | None = None, digest_of=None):
    self._engine = engine
    self._digests = digests
    self._digest_of = digest_of  # payload -> content digest, for payloads ``digests`` does not know
    self._fault = fault
    self.events: list[tuple[str, Any]] = []  # (kind, payload or prepared input); see digest_events
    self._updates_seen = 0

  def __getattr__(self, name):
    return getattr(self._engine, name)

  def digest_events(self) -> list[tuple[str, str | None]]:
    """The call log with content digests (prepared inputs are hashed here, after the arm)."""
    def digest(x):
      known = getattr(x, "digest", None) or self._digests.get(id(x))
      return known if known or x is None or self._digest_of is None else self._digest_of(x)

    return [(kind, digest(x)) for kind, x in self.events]

  def fwd_bwd(self, x, apply_optimizer=False):
    self.events.append(("fwd_bwd", x))
    result = self._engine.fwd_bwd(x)
    if apply_optimizer:
      self.update()
    return result

  def update(self):
    self._updates_seen += 1
    if self._fault == "skip_update" and self._updates_seen == 2:
      return None  # the injected bug: no update at all
    self.events.append(("update", None))
    return self._engine.update()

  def prepare_fwd_bwd_input(self, payload):
    prepared = self._engine.prepare_fwd_bwd_input(payload)
    self.events.append(("prepare", prepared))
    return prepared

  def wait_for_device(self):
    self.events.append(("wait", None))
    return self._engine.wait_for_device()


@dataclasses.dataclass
class RigResult:
  out_dir: Path
  report: dict
  arms: list[dict]


def _stats(xs: Sequence[float]) -> dict | None:
  xs = [x for x in xs if x is not None]
  if not xs:
    return None
  return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _time_parts(engine, steps) -> dict[str, list]:
  """Each part of every step alone on the device: prepare, dispatch, micro-batch, re-run, update, work."""
  parts = {k: [] for k in ("micro", "prepare", "dispatch", "update", "work", "rerun", "reruns")}
  store = HostWeightStore()

  def rerun_if_overflowed() -> int:  # times a re-run apart from the micro-batch after it
    t0 = time.perf_counter()
    if not engine.resolve_pending_overflow():
      return 0
    engine.wait_for_device()
    parts["rerun"].append(time.perf_counter() - t0)
    return 1

  for payloads in steps:  # every step: re-run counts vary from step to step
    step_reruns = 0
    for p in payloads:
      engine.wait_for_device()
      t0 = time.perf_counter()
      prepared = engine.prepare_fwd_bwd_input(p)
      jax.block_until_ready(prepared.arrays)
      t1 = time.perf_counter()
      receipt = engine.fwd_bwd(prepared)
      t2 = time.perf_counter()
      receipt.ready.block_until_ready()
      parts["prepare"].append(t1 - t0)
      parts["dispatch"].append(t2 - t1)
      parts["micro"].append(time.perf_counter() - t1)
      if engine.rerun_dropped:
        step_reruns += rerun_if_overflowed()
    parts["reruns"].append(step_reruns)
    t0 = time.perf_counter()
    engine.update().ready.block_until_ready()
    parts["update"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    engine.get_metrics()
    store(engine.train_step, engine.export_weights())
    parts["work"].append(time.perf_counter() - t0)
  return parts


def _back_to_back_spacing(engine, steps) -> list[float]:
  """The steady-state spacing of completions with every micro-batch of a step queued at once.

  Back to back, a micro-batch is slower than alone on an idle device (the host's
  work shares the memory bus); step time is made of this spacing.
  """
  spacing = []
  for payloads in steps:
    prepared = [engine.prepare_fwd_bwd_input(p) for p in payloads]
    jax.block_until_ready([x.arrays for x in prepared])
    done = [engine.fwd_bwd(x) for x in prepared]
    done[0].ready.block_until_ready()
    t_first = time.perf_counter()
    done[-1].ready.block_until_ready()
    spacing.append((time.perf_counter() - t_first) / (len(done) - 1))
    engine.update()
    engine.wait_for_device()
  return spacing


def calibrate(engine, steps, snapshot, *, floor_samples: int = 8) -> tuple[Components, float]:
  """Measures component times on unstaged, serialised steps (device idle between parts).

  Runs every step of the plan once, each part alone on the device (re-runs
  timed apart from the micro-batch after them), then restores ``snapshot``.
  Returns the components and the relative spread (stdev / mean) of the
  micro-batch samples: how noisy this machine is right now.
  """
  parts = _time_parts(engine, steps)
  engine.wait_for_device()
  floor = [engine.wait_for_device() for _ in range(floor_samples)]
  engine.restore(snapshot)
  spacing = []
  # Under dropless re-runs each fwd_bwd first reads the previous flag, so micro-batches
  # never queue back to back; the serial figure is the right one there.
  if len(steps[0]) > 1 and not engine.rerun_dropped:
    spacing = _back_to_back_spacing(engine, steps)
    engine.restore(snapshot)
  samples = spacing if len(spacing) > 1 else parts["micro"]
  noise = statistics.stdev(samples) / statistics.mean(samples) if len(samples) > 1 else 0.0
  return Components(
      micro_batch_s=statistics.median(spacing) if spacing else statistics.median(parts["micro"]),
      prepare_s=statistics.median(parts["prepare"]),
      update_s=statistics.median(parts["update"]),
      boundary_work_s=statistics.median(parts["work"]),
      dispatch_s=statistics.median(parts["dispatch"]),
      wait_floor_s=max(floor),
      micro_batches_per_step=len(steps[0]),
      update_waits_for_last=engine.rerun_dropped,
      # The arms are scored on median step seconds: predict the typical step.
      reruns_per_step=statistics.median(parts["reruns"]) if parts["reruns"] else 0.0,
      rerun_s=statistics.median(parts["rerun"]) if parts["rerun"] else 0.0,
  ), noise


def _record_plan(r) -> BoundaryPlan:
  """The plan a record was made under (its mode and whether, and where, it staged)."""
  mode = Mode(r.mode)
  return BoundaryPlan(r.step, mode, r.staged, r.stage_before_update, mode is Mode.OFF, r.reason, r.probe)


def _expected_windows(arm_records, steps_digests) -> list[list[tuple[str, str | None]]]:
  """The engine calls ``policies.call_order`` puts between step k's last fwd_bwd and step k+1's first."""
  windows = []
  for r in arm_records:
    k = r.step
    has_next = k + 1 < len(steps_digests)
    nxt = steps_digests[k + 1][0] if has_next else None
    calls = engine_calls_between(boundary_actions(_record_plan(r) if has_next else None))
    windows.append([(call, nxt if call == "prepare" else None) for call in calls])
  return windows


def _windows(events, m) -> tuple[list[list], list[list[str | None]]]:
  """Splits a call log into per-step fwd_bwd digests and the calls after each step's last one."""
  steps, windows = [], []
  current, window, in_window = [], [], False
  for kind, d in events:
    if kind == "fwd_bwd":
      if in_window:
        windows.append(window)
        window, in_window = [], False
      current.append(d)
      if len(current) == m:
        steps.append(current)
        current, in_window = [], True
    elif in_window:
      window.append((kind, d))
    # calls before a step's last micro-batch (none in any mode) are ignored here
  if in_window:
    windows.append(window)
  if current:
    steps.append(current)
  return steps, windows


def check_arm(arm: Arm, result, events, compiles_delta, expected_digests, expected_tokens, m) -> list[dict]:
  checks = []

  def add(name, ok, detail):
    checks.append({"name": name, "arm": arm.name, "status": "pass" if ok else "fail", "detail": detail})

  got_steps, windows = _windows(events, m)
  flat_got = [d for s in got_steps for d in s]
  flat_expected = [d for s in expected_digests for d in s]
  add("micro_batches_in_order", flat_got == flat_expected,
      f"{sum(a == b for a, b in zip(flat_got, flat_expected))}/{len(flat_expected)} micro-batches"
      f" match the recording's order (got {len(flat_got)})")
  tokens = [r.tokens for r in result.records]
  add("loss_denominators", tokens == expected_tokens,
      f"summed loss denominators per step {tokens} vs expected {expected_tokens}")
  updates_per_window = [sum(1 for kind, _ in w if kind == "update") for w in windows]
  add("update_before_next_step", updates_per_window == [1] * len(expected_digests),
      f"updates after each step's last micro-batch: {updates_per_window}")
  expected_windows = _expected_windows(result.records, expected_digests)
  add("stages_where_planned", windows == expected_windows,
      "calls between each step's last micro-batch and the next step's first follow the"
      f" mode's call order ({sum(a == b for a, b in zip(windows, expected_windows))}/{len(expected_windows)}"
      " boundaries)")
  add("no_compile_after_warmup", compiles_delta == 0, f"{compiles_delta} compiles during the arm")
  return checks


def _score(name, arm, measured, lo, hi, n, min_n=3):
  if measured is None or n < min_n:
    return {"name": name, "arm": arm, "status": "unscorable",
            "detail": f"{n} boundaries measured; at least {min_n} are needed to score a band"}
  ok = lo <= measured <= hi
  return {"name": name, "arm": arm, "status": "pass" if ok else "fail",
          "detail": f"measured median {measured:.6f} s, predicted band [{lo:.6f}, {hi:.6f}] s"}


@dataclasses.dataclass
class _Plan:
  """What every arm replays, and what it must produce."""

  steps: list
  expected_digests: list[list[str]]
  expected_tokens: list[int]
  digest_by_payload: dict[int, str]


def payload_digest(payload, *, rows: int, tokens_per_row: int, vocab_size: int) -> str:
  """The content digest of a payload as the engine packs it (what a prepared input's ``digest`` gives)."""
  return content_digest(pack_payload(payload, rows=rows, tokens_per_row=tokens_per_row, vocab_size=vocab_size))


def _replay_plan(shape, recording, m: int, steps: int) -> _Plan:
  from orchestrator.data.replay import replay_steps

  plan = replay_steps(recording, rows=shape.rows, tokens_per_row=shape.tokens_per_row,
                      micro_batches_per_step=m, steps=steps)
  expected = [[payload_digest(p, rows=shape.rows, tokens_per_row=shape.tokens_per_row,
                              vocab_size=shape.vocab_size) for p in step]
              for step in plan]
  # Each payload's true content digest, by identity: an arm fed another order shows it.
  by_payload = {id(p): d for step, ds in zip(plan, expected) for p, d in zip(step, ds)}
  return _Plan(plan, expected, [sum(count_loss_tokens(p) for p in step) for step in plan], by_payload)


def _predictions(arms, components: Components, noise: float) -> dict:
  predictions = {
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


def _arm_report(arm: Arm, result, policy, components: Components) -> dict:
  records = result.records
  boundaries = records[:-1]
  report = {
      "name": arm.name, "mode": arm.mode.value, "fault": arm.fault, "final_mode": policy.mode.value,
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
      "auto_disables": policy.counters.get("auto_disable", 0),
      "final_state_digest": result.summary["final_state_digest"],
      "records": [r.to_json() for r in records],
  }
  stage = report["stage_s"]["median"] if report["stage_s"] else components.prepare_s
  report["prepare_share_of_micro_batch"] = stage / report["micro_batch_s"]["median"]
  return report


def _cross_arm_checks(report: dict, reference: dict) -> list[dict]:
  same_reruns = report["reruns"] == reference["reruns"]
  same_state = report["final_state_digest"] == reference["final_state_digest"]
  return [
      {"name": "rerun_counts_equal", "arm": report["name"], "status": "pass" if same_reruns else "fail",
       "detail": f"re-runs per step {report['reruns']} vs {reference['name']} {reference['reruns']}"},
      {"name": "final_state_identical", "arm": report["name"], "status": "pass" if same_state else "fail",
       "detail": f"state digest {report['final_state_digest'][:16]}… vs {reference['name']}"
                 f" {reference['final_state_digest'][:16]}…"},
  ]


def _prediction_checks(report: dict, pred: dict, n_records: int) -> list[dict]:
  idle = report["boundary_idle_s"]["median"] if report["boundary_idle_s"] else None
  return [_score("prediction_boundary_idle", report["name"], idle, *pred["boundary_idle_band_s"], n_records - 1),
          _score("prediction_step_s", report["name"], report["step_s"]["median"], *pred["step_band_s"], n_records)]


def _apply_faults(arms: list[Arm], faults: dict[str, str] | None) -> None:
  for name, fault in (faults or {}).items():
    if fault not in FAULTS:
      raise RigError(f"unknown fault {fault!r}; faults are {FAULTS}")
    matches = [a for a in arms if a.name == name]
    if not matches:
      raise RigError(f"fault for arm {name!r}, which is not among {[a.name for a in arms]}")
    matches[0].fault = fault


def run_rig(recipe, recording_dir: str | Path, arm_names: Sequence[str], out_dir: str | Path, *,
            steps: int | None = None, faults: dict[str, str] | None = None, warmup_steps: int = 2,
            progress=None) -> RigResult:
  """Runs the rig; see the module docstring. ``faults`` maps arm names to an injected fault."""
  from orchestrator.data.recording import open_recording

  out = Path(out_dir)
  arms = parse_arms(arm_names)
  _apply_faults(arms, faults)
  steps = steps or recipe.steps
  if steps < 2:
    raise RigError(f"the rig needs at least 2 steps (a boundary), got {steps}")
  if recipe.engine.backend != "jax" and recipe.trainer.location == "local":
    raise RigError(f"the rig drives the JAX engine (it snapshots and times its parts);"
                   f" engine.backend={recipe.engine.backend!r} is not supported here")
  m = recipe.batch.micro_batches_per_step
  from orchestrator.rig.trainers import LocalRigTrainer, RemoteRigTrainer

  trainer = RemoteRigTrainer(recipe, out) if recipe.trainer.location == "remote" else LocalRigTrainer(recipe)
  try:
    return _run_arms(recipe, trainer, open_recording(recording_dir, vocab_size=trainer.shape.vocab_size),
                     arms, out, steps, m, warmup_steps, progress)
  finally:
    trainer.close()


def _run_arms(recipe, trainer, recording, arms, out: Path, steps: int, m: int, warmup_steps: int,
              progress) -> RigResult:
  plan = _replay_plan(trainer.shape, recording, m, steps)
  out.mkdir(parents=True, exist_ok=True)

  def run_arm(arm: Arm, arm_steps, n_steps):
    return trainer.run_arm(arm, arm_steps, n_steps, plan.digest_by_payload)

  run_arm(Arm("warmup", Mode.STAGE_BEFORE_UPDATE), plan.steps, min(warmup_steps, steps))  # absorbs compiles
  components, noise = trainer.calibrate(plan.steps)
  predictions = _predictions(arms, components, noise)
  (out / "predictions.json").write_text(json.dumps(predictions, indent=2))  # before any scored arm

  arm_reports, checks, traces = [], [], []
  first_arm_started = time.monotonic()
  for index, arm in enumerate(arms):
    arm_steps = plan.steps
    if arm.fault == "reorder_micro_batches":
      arm_steps = [list(s) for s in plan.steps]
      arm_steps[1][0], arm_steps[1][1] = arm_steps[1][1], arm_steps[1][0]
    if progress:
      progress(f"arm {index + 1}/{len(arms)}: {arm.name}")
    result, events, compiles_delta, policy = run_arm(arm, arm_steps, steps)
    checks += check_arm(arm, result, events, compiles_delta, plan.expected_digests, plan.expected_tokens, m)
    report = _arm_report(arm, result, policy, components)
    if arm_reports:
      checks += _cross_arm_checks(report, arm_reports[0])
    arm_reports.append(report)
    traces.append((arm.name, result))
    pred = next(p for p in predictions["arms"] if p["name"] == arm.name)
    checks += _prediction_checks(report, pred, len(result.records))
  checks.insert(0, {
      "name": "predictions_written_first", "arm": "*",
      "status": "pass" if predictions["written_at_monotonic_s"] <= first_arm_started else "fail",
      "detail": f"predictions.json written at {predictions['written_at']}, before the first scored arm",
  })
  from orchestrator.rig.report import write_reports

  report = write_reports(out, arm_reports, predictions, checks, components, traces, recipe, recording)
  return RigResult(out, report, arm_reports)

"""The reduced rig: several arms over the same recorded steps, from the same start, checked and scored.

Order of a rig run (DESIGN.md §6):

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

from orchestrator.engine import backend_compile_count
from orchestrator.engine.engine import PreparedFwdBwdInput, content_digest
from orchestrator.engine.inputs import count_loss_tokens, pack_payload
from orchestrator.program import HostWeightStore, ProgramConfig, RLProgram
from orchestrator.trainer_worker import TrainerWorker
from policies import Mode, StepBoundaryPolicy
from policies.boundary_model import Components, band, predict

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

  def __init__(self, engine, digests: dict[int, str], fault: str | None = None):
    self._engine = engine
    self._digests = digests
    self._fault = fault
    self.events: list[tuple[str, Any]] = []  # (kind, payload or prepared input); see digest_events
    self._updates_seen = 0

  def __getattr__(self, name):
    return getattr(self._engine, name)

  def digest_events(self) -> list[tuple[str, str | None]]:
    """The call log with content digests (prepared inputs are hashed here, after the arm)."""
    return [(kind, x.digest if isinstance(x, PreparedFwdBwdInput) else self._digests.get(id(x)))
            for kind, x in self.events]

  def fwd_bwd(self, x, apply_optimizer=False):
    self.events.append(("fwd_bwd", x))
    result = self._engine.fwd_bwd(x)
    if apply_optimizer:
      self.update()
    return result

  def update(self):
    self._updates_seen += 1
    if self._fault == "skip_update" and self._updates_seen == 2:
      return self._engine.train_step  # the injected bug: no update at all
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


def calibrate(engine, steps, snapshot, *, floor_samples: int = 8) -> tuple[Components, float]:
  """Measures component times on unstaged, serialised steps (device idle between parts).

  Runs every step of the plan once, each part alone on the device (re-runs
  timed apart from the micro-batch after them), then restores ``snapshot``.
  Returns the components and the relative spread (stdev / mean) of the
  micro-batch samples: how noisy this machine is right now.
  """
  import jax

  micro, prepare, dispatch, update, work, rerun, replays = [], [], [], [], [], [], []
  store = HostWeightStore()
  replay = bool(getattr(engine, "replay", False))
  for payloads in steps:  # every step: replay counts vary from step to step
    step_replays = 0
    for i, p in enumerate(payloads):
      engine.wait_for_device()
      t0 = time.perf_counter()
      prepared = engine.prepare_fwd_bwd_input(p)
      jax.block_until_ready(prepared.arrays)
      t1 = time.perf_counter()
      c = engine.fwd_bwd(prepared)
      t2 = time.perf_counter()
      c.ready.block_until_ready()
      t3 = time.perf_counter()
      prepare.append(t1 - t0)
      dispatch.append(t2 - t1)
      micro.append(t3 - t1)
      if replay and i < len(payloads) - 1:  # time a re-run apart from the next micro-batch
        t4 = time.perf_counter()
        if engine.resolve_pending_overflow():
          engine.wait_for_device()
          rerun.append(time.perf_counter() - t4)
          step_replays += 1
    if replay:
      t4 = time.perf_counter()
      if engine.resolve_pending_overflow():
        engine.wait_for_device()
        rerun.append(time.perf_counter() - t4)
        step_replays += 1
    replays.append(step_replays)
    t0 = time.perf_counter()
    engine.update()
    engine.last_dispatch.ready.block_until_ready()
    update.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    engine.get_metrics()
    store(engine.train_step, engine.params)
    work.append(time.perf_counter() - t0)
  engine.wait_for_device()
  floor = [engine.wait_for_device() for _ in range(floor_samples)]
  engine.restore(snapshot)
  # Back to back, as the arms run them, a micro-batch is slower than alone on an idle
  # device (the host's work shares the memory bus): the steady-state spacing of
  # completions is what the step time is made of.
  spacing = []
  rerun_s = statistics.median(rerun) if rerun else 0.0
  # Under replay each fwd_bwd first reads the previous flag, so micro-batches never
  # queue back to back; the serial figure is the right one there.
  if len(steps[0]) > 1 and not replay:
    for payloads in steps:
      prepared = [engine.prepare_fwd_bwd_input(p) for p in payloads]
      jax.block_until_ready([x.arrays for x in prepared])
      done = [engine.fwd_bwd(x) for x in prepared]
      done[0].ready.block_until_ready()
      t_first = time.perf_counter()
      done[-1].ready.block_until_ready()
      t_last = time.perf_counter()
      spacing.append((t_last - t_first) / (len(done) - 1))
      engine.update()
      engine.wait_for_device()
    engine.restore(snapshot)
  samples = spacing if len(spacing) > 1 else micro
  noise = statistics.stdev(samples) / statistics.mean(samples) if len(samples) > 1 else 0.0
  return Components(
      micro_batch_s=statistics.median(spacing) if spacing else statistics.median(micro),
      prepare_s=statistics.median(prepare),
      update_s=statistics.median(update),
      boundary_work_s=statistics.median(work),
      dispatch_s=statistics.median(dispatch),
      wait_floor_s=max(floor),
      micro_batches_per_step=len(steps[0]),
      update_waits_for_last=replay,
      # The arms are scored on median step seconds: predict the typical step.
      replays_per_step=statistics.median(replays) if replays else 0.0,
      rerun_s=rerun_s,
  ), noise


def _expected_windows(arm_records, steps_digests, m) -> list[list[tuple[str, str | None]]]:
  """The calls the design table puts between step k's last fwd_bwd and step k+1's first."""
  windows = []
  for r in arm_records:
    k = r["step"]
    nxt = steps_digests[k + 1][0] if k + 1 < len(steps_digests) else None
    if r["staged"] and r["stage_before_update"]:
      windows.append([("prepare", nxt), ("wait", None), ("update", None)])
    elif r["staged"]:
      windows.append([("update", None), ("prepare", nxt)])
    else:
      windows.append([("update", None)])
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
  tokens = [r["tokens"] for r in result.records]
  add("loss_denominators", tokens == expected_tokens,
      f"summed loss denominators per step {tokens} vs expected {expected_tokens}")
  updates_per_window = [sum(1 for kind, _ in w if kind == "update") for w in windows]
  add("update_before_next_step", updates_per_window == [1] * len(expected_digests),
      f"updates after each step's last micro-batch: {updates_per_window}")
  expected_windows = _expected_windows(result.records, expected_digests, m)
  add("stages_where_planned", windows == expected_windows,
      "calls between each step's last micro-batch and the next step's first follow the"
      f" mode's table ({sum(a == b for a, b in zip(windows, expected_windows))}/{len(expected_windows)} boundaries)")
  add("no_compile_after_warmup", compiles_delta == 0, f"{compiles_delta} compiles during the arm")
  return checks


def _score(name, arm, measured, lo, hi, n, min_n=3):
  if measured is None or n < min_n:
    return {"name": name, "arm": arm, "status": "unscorable",
            "detail": f"{n} boundaries measured; at least {min_n} are needed to score a band"}
  ok = lo <= measured <= hi
  return {"name": name, "arm": arm, "status": "pass" if ok else "fail",
          "detail": f"measured median {measured:.6f} s, predicted band [{lo:.6f}, {hi:.6f}] s"}


def run_rig(
    recipe,
    recording_dir: str | Path,
    arm_names: Sequence[str],
    out_dir: str | Path,
    *,
    steps: int | None = None,
    faults: dict[str, str] | None = None,
    warmup_steps: int = 2,
    progress=None,
) -> RigResult:
  """Runs the rig; see the module docstring. ``faults`` maps arm names to an injected fault."""
  from orchestrator.data.recording import open_recording
  from orchestrator.data.replay import replay_steps
  from orchestrator.engine import build_engine
  from orchestrator.runner import engine_options

  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  arms = parse_arms(arm_names)
  for name, fault in (faults or {}).items():
    if fault not in FAULTS:
      raise RigError(f"unknown fault {fault!r}; faults are {FAULTS}")
    matches = [a for a in arms if a.name == name]
    if not matches:
      raise RigError(f"fault for arm {name!r}, which is not among {[a.name for a in arms]}")
    matches[0].fault = fault
  steps = steps or recipe.steps
  if steps < 2:
    raise RigError(f"the rig needs at least 2 steps (a boundary), got {steps}")
  m = recipe.batch.micro_batches_per_step

  engine = build_engine(recipe.model, mesh=dataclasses.asdict(recipe.mesh), **engine_options(recipe, None))
  recording = open_recording(recording_dir, vocab_size=engine.preset.vocab_size)
  plan = replay_steps(recording, rows=engine.rows, tokens_per_row=engine.tokens_per_row,
                      micro_batches_per_step=m, steps=steps)
  expected_digests = [
      [content_digest(pack_payload(p, rows=engine.rows, tokens_per_row=engine.tokens_per_row,
                                   vocab_size=engine.preset.vocab_size)) for p in step]
      for step in plan
  ]
  expected_tokens = [sum(count_loss_tokens(p) for p in step) for step in plan]
  # Each payload's true content digest, by identity: an arm fed another order shows it.
  digest_by_payload = {id(p): d for step, ds in zip(plan, expected_digests) for p, d in zip(step, ds)}
  snapshot = engine.snapshot()

  def run_arm(arm: Arm, arm_steps, n_steps):
    engine.restore(snapshot)
    proxy = CallRecordingEngine(engine, digest_by_payload, arm.fault)
    worker = TrainerWorker(proxy)
    sb = recipe.step_boundary
    policy = StepBoundaryPolicy(
        arm.mode, engine_can_stage=worker.capabilities.can_stage, wait_threshold_s=recipe.wait_threshold,
        disable_after=sb.disable_after, reprobe_every=sb.reprobe_every,
    )
    program = RLProgram(worker, policy, arm_steps[:n_steps],
                        ProgramConfig(steps=n_steps, micro_batches_per_step=m,
                                      calibration_samples=sb.calibration_samples,
                                      sync_before_next_step=sb.sync_before_next_step))
    compiles = backend_compile_count()
    result = program.run()
    engine.wait_for_device()
    compiles = backend_compile_count() - compiles
    return result, proxy.digest_events(), compiles, policy

  # 2. warm-up arm
  run_arm(Arm("warmup", Mode.STAGE_BEFORE_UPDATE), plan, min(warmup_steps, steps))
  # 3. calibration
  components, noise = calibrate(engine, plan, snapshot)
  # 4. predictions, written before any scored arm
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
  (out / "predictions.json").write_text(json.dumps(predictions, indent=2))

  # 5. arms
  arm_reports, checks, traces = [], [], []
  first_arm_started = None
  reference = None
  for index, arm in enumerate(arms):
    arm_steps = plan
    if arm.fault == "reorder_micro_batches":
      arm_steps = [list(s) for s in plan]
      arm_steps[1][0], arm_steps[1][1] = arm_steps[1][1], arm_steps[1][0]
    if first_arm_started is None:
      first_arm_started = time.monotonic()
    if progress:
      progress(f"arm {index + 1}/{len(arms)}: {arm.name}")
    result, events, compiles_delta, policy = run_arm(arm, arm_steps, steps)
    checks += check_arm(arm, result, events, compiles_delta, expected_digests, expected_tokens, m)
    records = result.records
    boundaries = records[:-1]
    replays = [r["replays"] or 0 for r in records]
    report = {
        "name": arm.name,
        "mode": arm.mode.value,
        "fault": arm.fault,
        "final_mode": policy.mode.value,
        "boundary_idle_s": _stats([r["boundary_idle_s"] for r in boundaries]),
        "boundary_idle_strict_s": _stats([r["boundary_idle_strict_s"] for r in boundaries]),
        "step_s": _stats([r["step_s"] for r in records]),
        "micro_batch_s": _stats([x for r in records for x in r["micro_batch_s"]]),
        "update_s": _stats([r["update_s"] for r in records]),
        "device_wait_s": _stats([r["device_wait_s"] for r in boundaries]),
        "stage_s": _stats([r["stage_s"] for r in boundaries]),
        "boundary_work_s": _stats([
            (r["metrics_s"] or 0) + (r["checkpoint_s"] or 0) + (r["weight_sync_s"] or 0) for r in records]),
        "replays": replays,
        "auto_disables": policy.counters.get("auto_disable", 0),
        "final_state_digest": result.summary["final_state_digest"],
        "records": records,
    }
    stage = report["stage_s"]["median"] if report["stage_s"] else components.prepare_s
    report["prepare_share_of_micro_batch"] = stage / report["micro_batch_s"]["median"]
    arm_reports.append(report)
    traces.append((arm.name, result))
    if reference is None:
      reference = report
    else:
      checks.append({
          "name": "replay_counts_equal", "arm": arm.name,
          "status": "pass" if replays == reference["replays"] else "fail",
          "detail": f"replays per step {replays} vs {reference['name']} {reference['replays']}",
      })
      checks.append({
          "name": "final_state_identical", "arm": arm.name,
          "status": "pass" if report["final_state_digest"] == reference["final_state_digest"] else "fail",
          "detail": f"state digest {report['final_state_digest'][:16]}… vs {reference['name']}"
                    f" {reference['final_state_digest'][:16]}…",
      })
    pred = next(p for p in predictions["arms"] if p["name"] == arm.name)
    n = len(boundaries)
    checks.append(_score("prediction_boundary_idle", arm.name,
                         report["boundary_idle_s"]["median"] if report["boundary_idle_s"] else None,
                         *pred["boundary_idle_band_s"], n))
    checks.append(_score("prediction_step_s", arm.name, report["step_s"]["median"],
                         *pred["step_band_s"], len(records)))
  checks.insert(0, {
      "name": "predictions_written_first", "arm": "*",
      "status": "pass" if predictions["written_at_monotonic_s"] <= first_arm_started else "fail",
      "detail": f"predictions.json written at {predictions['written_at']}, before the first scored arm",
  })
  from orchestrator.rig.report import write_reports

  report = write_reports(out, arm_reports, predictions, checks, components, traces, recipe, recording)
  return RigResult(out, report, arm_reports)

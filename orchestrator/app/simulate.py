"""``run_rl simulate``: the boundary model as a planning tool, fed from a recipe or fitted from a run.

Three uses: the recipe's ``simulate`` section (component times, scaled from the
job they were measured on to this recipe's batch and mesh when
``simulate.reference_*`` name it); ``--from RUN_DIR`` (components fitted from a
run's or a rig's records, each prediction beside what the run measured); and
``--from RUN_DIR --recipe OTHER.yaml`` (the fitted components taken to another
job by the scaling rules, each change with the rule it rests on; with
``--probe`` the compute by its ratio timed at both shapes, ``compute_probe``).
A fitted arm's row also gives the prediction at the arm's own measured compute.
``policies.boundary_model`` holds the model, its assumptions and the rules;
``policies.boundary_fit`` what a run identifies.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

from orchestrator.app import compute_probe
from orchestrator.data import packing
from orchestrator.recipe import keys as recipe_keys
from orchestrator.recipe.schema import Recipe
from orchestrator.run_files import run_dir
from policies import Mode
from policies.boundary_fit import Fit, at_own_compute, fit
from policies.boundary_model import Components, Estimate, JobShape, ScaledChange, predict, predict_bounded
from policies.units import format_seconds

#: How close a fit must come to call a prediction good: step within 5 %; idle within the larger
#: of 5 % of a micro-batch and 2 ms.
STEP_TOLERANCE = 0.05
IDLE_TOLERANCE_S = 0.002

#: Recipe keys read under another name (the earlier spellings ``SimulateSection`` still accepts).
_SPELLINGS = {"map_s": ("map_s", "input_copy_s"), "update_overlap_share": ("update_overlap_share",
                                                                           "update_waits_for_last")}


def job_shape(recipe) -> JobShape:
  """The recipe's batch, mesh and model as the scaling rules read them."""
  rows, tokens_per_row = recipe.micro_batch_shape()
  s = recipe.simulate
  return JobShape(rows=rows, tokens_per_row=tokens_per_row,
                  micro_batches_per_step=recipe.batch.micro_batches_per_step,
                  devices=recipe.mesh.fsdp * recipe.mesh.context * recipe.mesh.expert,
                  hosts=s.hosts or recipe.distributed.num_processes or 1,
                  model=recipe.model.name, context=recipe.mesh.context,
                  bytes_per_token=s.bytes_per_token or sum(_bytes_by_field(recipe).values()),
                  feeding_hosts=1 if s.single_controller else None)


def _bytes_by_field(recipe) -> dict[str, int]:
  """The packed fields' bytes per token, routing included where the engine replays it."""
  return packing.bytes_per_token_by_field(recipe.engine.routing_shape(recipe.model_preset()))


def estimate_from_recipe(resolved) -> tuple[Estimate, list[ScaledChange]]:
  """The recipe's ``simulate`` components, with each one's source, scaled from ``simulate.reference_*``."""
  recipe, s = resolved.recipe, resolved.recipe.simulate
  target = job_shape(recipe)
  single = s.single_controller if s.reference_single_controller is None else s.reference_single_controller
  reference = dataclasses.replace(target, rows=s.reference_rows or target.rows,
                                  tokens_per_row=s.reference_tokens_per_row or target.tokens_per_row,
                                  devices=s.reference_devices or target.devices,
                                  hosts=s.reference_hosts or target.hosts,
                                  bytes_per_token=s.reference_bytes_per_token or target.bytes_per_token,
                                  feeding_hosts=1 if single else None)
  # A link's copy is the reference job's bytes through it; the copy rule then takes it to this job, as a given
  # copy_s.
  copy_s = reference.input_bytes_per_feeding_host / (s.host_link_gb_s * 1e9) if s.host_link_gb_s else s.copy_s
  c = Components(
      micro_batch_s=s.micro_batch_s, first_micro_batch_extra_s=s.first_micro_batch_extra_s, update_s=s.update_s,
      map_s=s.resolved_map_s, copy_s=copy_s,
      sync_copy=s.sync_copy, host_runs_ahead=s.host_runs_ahead, metrics_s=s.metrics_s, logging_s=s.logging_s, checkpoint_s=s.checkpoint_s,
      weight_sync_s=s.weight_sync_s, update_overlap_share=s.resolved_update_overlap_share,
      dispatch_s=s.dispatch_s, gap_per_dispatch_s=s.gap_per_dispatch_s, wait_floor_s=s.wait_floor_s,
      rollout_wait_s=s.rollout_wait_s, micro_batches_per_step=recipe.batch.micro_batches_per_step,
      reruns_per_step=s.reruns_per_step, rerun_s=s.micro_batch_s if s.rerun_s is None else s.rerun_s)
  sources = {}
  for f in dataclasses.fields(c):
    names = _SPELLINGS.get(f.name, (f.name,))
    given = [(n, resolved.sources.get(f"simulate.{n}", "default")) for n in names]
    set_ = [(n, src) for n, src in given if src != "default"]
    sources[f.name] = (set_[0][1] if set_[0][0] == f.name else f"{set_[0][1]} (as simulate.{set_[0][0]})"
                       ) if set_ else "default"
  sources["micro_batches_per_step"] = "recipe batch"
  if s.host_link_gb_s:
    sources["copy_s"] = f"{resolved.sources.get('simulate.host_link_gb_s', 'recipe')} (as simulate.host_link_gb_s)"
  return Estimate(c, sources).scaled(reference, target)


def tokens_per_device_per_step(recipe) -> float:
  per_micro = recipe.simulate.tokens_per_device or job_shape(recipe).tokens_per_device
  return per_micro * recipe.batch.micro_batches_per_step


def mode_rows(estimate: Estimate, tokens_per_step: float | None = None) -> list[dict]:
  """Per mode: the bounded prediction, and what it saves against OFF and against PIPELINED (the staging
  switches' own saving: the boundary's other work overlaps the next step either way)."""
  off, pipelined = (predict_bounded(estimate, m).point for m in (Mode.OFF, Mode.PIPELINED))
  rows = []
  for mode in Mode:
    p = predict_bounded(estimate, mode)
    row = {**p.as_dict(), "saves_vs_off_s": off.step_s - p.point.step_s,
           "saves_vs_off_share": (off.step_s - p.point.step_s) / off.step_s,
           "saves_vs_pipelined_s": pipelined.step_s - p.point.step_s,
           "saves_vs_pipelined_share": (pipelined.step_s - p.point.step_s) / pipelined.step_s,
           "idle_share_of_step": p.point.boundary_idle_s / p.point.step_s}
    if tokens_per_step:
      row["tokens_per_s_per_device"] = tokens_per_step / p.point.step_s
    rows.append(row)
  return rows


def _range(value: float, rng, fmt=format_seconds) -> str:
  lo, hi = rng
  return fmt(value) if hi - lo <= 1e-9 else f"{fmt(value)} [{fmt(lo)}–{fmt(hi)}]"


def _step_fmt(x: float) -> str:
  return f"{x:.4f}s"


def _shown(name: str, value) -> str:
  if isinstance(value, tuple):  # (mode, seconds) pairs: rollout_wait_by_mode
    return ", ".join(f"{mode} {format_seconds(s)}" for mode, s in value) or "-"
  return (format_seconds(value) if name.endswith("_s") else
          (f"{value:g}" if isinstance(value, float) else str(value)))


def _json_value(value):
  return dict(value) if isinstance(value, tuple) else value  # (mode, seconds) pairs as an object


def _components_lines(estimate: Estimate, changes=()) -> list[str]:
  c = estimate.components
  lines = ["components (value, source):"]
  for f in dataclasses.fields(c):
    shown = _shown(f.name, getattr(c, f.name))
    lines.append(f"  {f.name:<22} {shown:>12}  {estimate.sources.get(f.name, 'default')}")
  for u in estimate.unknowns:
    lines.append(f"  unidentified: {u.name} — {u.why}")
  if changes:
    lines.append("scaled to this job:")
    lines += [f"  {ch.component:<22} {ch.rule}" for ch in changes]
  return lines


def input_bytes(recipe, estimate: Estimate) -> dict:
  """What a micro-batch's mapping and copy carry: bytes per token (by field, or as the recipe states them), per
  micro-batch, per device and per feeding host, and the link speed the copy's seconds imply."""
  shape = job_shape(recipe)
  by_field = None if recipe.simulate.bytes_per_token else _bytes_by_field(recipe)
  copy_s = estimate.components.copy_s
  return {"bytes_per_token": shape.bytes_per_token, "bytes_per_token_by_field": by_field,
          "micro_batch_bytes": shape.input_bytes, "bytes_per_device": shape.input_bytes_per_device,
          "feeding_hosts": shape.input_hosts, "bytes_per_feeding_host": shape.input_bytes_per_feeding_host,
          "link_gb_s": shape.input_bytes_per_feeding_host / copy_s / 1e9 if copy_s else None}


def _bytes(n: float) -> str:
  return next(f"{n / scale:.1f} {unit}" for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B"))
              if n >= scale or unit == "B")


def _input_lines(shown: dict) -> list[str]:
  by_field = shown["bytes_per_token_by_field"]
  fields = (" (" + ", ".join(f"{name} {n}" for name, n in by_field.items()) + ")" if by_field
            else " (simulate.bytes_per_token)")
  hosts = shown["feeding_hosts"]
  lines = ["staged input per micro-batch:",
           f"  {shown['bytes_per_token']:g} B per token{fields}",
           f"  {_bytes(shown['micro_batch_bytes'])}; {_bytes(shown['bytes_per_device'])} per device;"
           f" {_bytes(shown['bytes_per_feeding_host'])} through each of {hosts} feeding host{'s' * (hosts > 1)}"]
  if shown["link_gb_s"]:
    lines.append(f"  copy_s carries it at {shown['link_gb_s']:.3g} GB/s per feeding host")
  return lines


def format_simulation(recipe, estimate: Estimate, changes, rows) -> str:
  c = estimate.components
  lines = [f"simulate: {recipe.name} — {c.micro_batches_per_step} micro-batches per step",
           *_components_lines(estimate, changes), *_input_lines(input_bytes(recipe, estimate)),
           f"compute-only bound per step: {c.compute_bound_s:.3f} s", "",
           f"{'mode':<20} {'boundary idle':>14} {'idle/step':>10} {'step':>10} {'tokens/s/device':>16}"
           f" {'saves vs OFF':>13} {'vs PIPELINED':>13}"]
  for r in rows:
    lines.append(f"{r['mode']:<20} {_range(r['boundary_idle_s'], r['boundary_idle_range_s']):>14}"
                 f" {r['idle_share_of_step']:>10.1%} {_range(r['step_s'], r['step_range_s'], _step_fmt):>10}"
                 f" {r.get('tokens_per_s_per_device', 0):>16,.0f} {r['saves_vs_off_share']:>13.1%}"
                 f" {r['saves_vs_pipelined_share']:>13.1%}")
  return "\n".join(lines)


def simulation_json(name: str, estimate: Estimate, changes, rows, measured=None, used=(), probe=None,
                    input_bytes_shown=None) -> dict:
  c = estimate.components
  return {
      **({"probe": probe} if probe else {}),
      **({"input": input_bytes_shown} if input_bytes_shown else {}),
      "job": name,
      "components": {f.name: {"value": _json_value(getattr(c, f.name)),
                              "source": estimate.sources.get(f.name, "default")}
                     for f in dataclasses.fields(c)},
      "unidentified": [u.as_dict() for u in estimate.unknowns],
      "scaled": [ch.as_dict() for ch in changes],
      "fitted_on": list(used),
      "modes": rows,
      "measured": measured or {},
  }


# ---------------------------------------------------------------------------------------------- from a run

def _median(xs) -> float:
  xs = [x for x in xs if x is not None]
  return statistics.median(xs) if xs else 0.0


def measured(records: list[dict]) -> dict:
  """What an arm (or a mode of a run) measured: median idle over its boundaries, median step."""
  return {"mode": records[0]["mode"],
          "boundary_idle_s": _median(r.get("boundary_idle_s") for r in records[:-1]),
          "step_s": _median(r["step_s"] for r in records), "steps": len(records),
          "micro_batch_s": _median(x for r in records for x in r["micro_batch_s"])}


def _recipe_from_config(config: dict):
  return recipe_keys.build(recipe_keys.flatten(config, where="the run's config"))


@dataclasses.dataclass
class RunFit:
  """A run's (or a rig's) records, the fit on them, what each arm measured and the job it ran."""

  fit: Fit
  arms: dict[str, dict]  # arm name → what it measured (``measured``)
  records: dict[str, list[dict]]  # arm name → its records
  shape: JobShape | None  # None: a rig written before it saved its recipe
  recipe: Recipe | None = None  # the run's recipe (None, as ``shape``)


def _reads_flag(engine: dict) -> bool:
  return bool(engine.get("retry_when_tokens_dropped") or engine.get("skip_nonfinite_updates"))


def _rig_arms(path: Path) -> tuple[dict, dict, dict | None]:
  """A rig directory's arms, its calibrated components and its recipe (None: written before it kept one)."""
  arms = json.loads((path / "records.json").read_text())
  saved = json.loads((path / "predictions.json").read_text())
  return {n: rs for n, rs in arms.items() if rs}, saved["components"], saved.get("recipe_config")


def _run_arms(path: Path) -> tuple[dict, dict, dict]:
  """A run directory's modes as arms (each mode's records in step order), its summary and its recipe."""
  config = run_dir.read_config(path, flag="simulate --from")
  segments = run_dir.segments(path, config)
  records = run_dir.run_records(segments, needed=sys.maxsize)  # every step, across the segments
  if len(records) < 2:
    raise run_dir.RunDirError(f"simulate --from {path}: it holds {len(records)} records; at least 2 are needed")
  summary_path = segments[-1].path / run_dir.SUMMARY
  summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
  arms: dict[str, list[dict]] = {}
  for r in records:
    arms.setdefault(r["mode"], []).append(r)
  return arms, summary, config["config"]


def fit_run(paths) -> RunFit:
  """Components fitted from run directories (their modes as arms) or rig directories (their arms), together.

  Several directories pool their arms (a name seen twice is suffixed with its
  directory's name); the job and the engine settings are the first one's.

  Raises:
    RunDirError / ValueError: neither a run nor a rig directory, or one without records.
  """
  arms: dict[str, list[dict]] = {}
  first = None
  floors, dispatches = [], []
  for path in (Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)):
    if (path / "records.json").is_file() and (path / "predictions.json").is_file():
      these, calibrated, config = _rig_arms(path)
      floors.append(calibrated["wait_floor_s"])
      dispatches.append(calibrated["dispatch_s"])
    else:
      these, summary, config = _run_arms(path)
      floors.append(summary.get("wait_floor_max_s"))
    first = first or (config, path)
    for name, records in these.items():
      arms[name if name not in arms else f"{name}@{path.name}"] = records
  config, path = first
  rigs = bool(dispatches)
  floor = max((f for f in floors if f is not None), default=None)
  result = fit(arms, update_reads_last_flag=_reads_flag(config["engine"]) if config else False, wait_floor_s=floor,
               dispatch_s=statistics.median(dispatches) if dispatches else None,
               wait_floor_source="calibrated by the rig" if rigs else "calibrated by the run",
               dispatch_source="calibrated by the rig")
  recipe = _recipe_from_config(config) if config else None
  shape = job_shape(recipe) if recipe is not None else None
  return RunFit(result, {n: measured(rs) for n, rs in arms.items()}, arms, shape, recipe)


def fit_rows(run: RunFit) -> list[dict]:
  """Per measured arm, then per mode no arm ran: the prediction beside the measurement, and whether it is within
  ``STEP_TOLERANCE`` of the step and the larger of 5 % of a micro-batch and ``IDLE_TOLERANCE_S`` of the idle."""
  estimate = run.fit.estimate
  idle_tol = max(STEP_TOLERANCE * estimate.components.micro_batch_s, IDLE_TOLERANCE_S)
  rows = []
  names = list(run.arms) + [m.value for m in Mode if not any(a["mode"] == m.value for a in run.arms.values())]
  for name in names:
    m = run.arms.get(name)
    p = predict_bounded(estimate, Mode(m["mode"] if m else name))
    row = {"arm": name, "fitted_on": name in run.fit.used, **p.as_dict()}
    if m:
      step_err = (p.point.step_s - m["step_s"]) / m["step_s"]
      idle_err = p.point.boundary_idle_s - m["boundary_idle_s"]
      # The same boundary components with the compute this arm measured: the model's error once the
      # machine's drift in compute between arms is taken out.
      own = predict(at_own_compute(estimate.components, run.records[name]), Mode(m["mode"]))
      own_step_err = (own.step_s - m["step_s"]) / m["step_s"]
      own_idle_err = own.boundary_idle_s - m["boundary_idle_s"]
      row.update(measured=m, step_error=step_err, idle_error_s=idle_err,
                 within=abs(step_err) <= STEP_TOLERANCE and abs(idle_err) <= idle_tol,
                 at_own_compute={"step_s": own.step_s, "boundary_idle_s": own.boundary_idle_s,
                                 "step_error": own_step_err, "idle_error_s": own_idle_err,
                                 "within": abs(own_step_err) <= STEP_TOLERANCE and abs(own_idle_err) <= idle_tol})
    rows.append(row)
  return rows


def format_fit(path, run: RunFit, rows: list[dict]) -> str:
  estimate = run.fit.estimate
  idle_tol = max(STEP_TOLERANCE * estimate.components.micro_batch_s, IDLE_TOLERANCE_S)
  lines = [f"simulate --from {path}: {estimate.components.micro_batches_per_step} micro-batches per step,"
           f" fitted on {', '.join(run.fit.used)}",
           *_components_lines(estimate), "",
           f"{'arm':<26} {'predicted idle':>15} {'predicted step':>15} {'measured idle':>14} {'measured step':>14}"
           f" {'step error':>11} {'idle error':>11}  within (step 5%, idle {format_seconds(idle_tol)})"
           f"  {'at own compute: step':>20} {'error':>7} {'within':>6}"]
  for r in rows:
    name = r["arm"] + (" (fit)" if r["fitted_on"] else "")
    head = (f"{name:<26} {_range(r['boundary_idle_s'], r['boundary_idle_range_s']):>15}"
            f" {_range(r['step_s'], r['step_range_s'], _step_fmt):>15}")
    m = r.get("measured")
    if m is None:
      lines.append(f"{head} {'-':>14} {'-':>14} {'-':>11} {'-':>11}  -")
      continue
    own = r["at_own_compute"]
    lines.append(f"{head} {format_seconds(m['boundary_idle_s']):>14} {m['step_s']:>13.4f}s"
                 f" {r['step_error']:>+10.1%} {format_seconds(r['idle_error_s']):>11}"
                 f"  {'yes' if r['within'] else 'no':<31}  {own['step_s']:>19.4f}s {own['step_error']:>+7.1%}"
                 f" {'yes' if own['within'] else 'no':>6}")
  lines += ["", "at own compute: the fitted boundary components with the device compute each arm measured (its"
            " micro-batches and update), so the machine's drift in compute between arms is taken out."]
  return "\n".join(lines)


def predict_other_job(run: RunFit, path, resolved, *, probe: bool = False
                      ) -> tuple[Estimate, list[ScaledChange], dict | None]:
  """The run's fitted components taken to ``resolved``'s job by the scaling rules, and with ``probe`` the device
  compute scaled by its measurement at both shapes instead (``compute_probe``; the third item says what it timed).

  Raises:
    ValueError: the run does not say what job it ran (a rig written before it saved its recipe), or the probe
      cannot time a shape.
  """
  if run.shape is None:
    raise ValueError(f"simulate --from {path} --recipe: this rig directory does not record its recipe's batch and"
                     " mesh (written by an earlier version); run the rig again to predict another job from it")
  target = job_shape(resolved.recipe)
  scaled, changes = run.fit.estimate.scaled(run.shape, target)
  if not probe:
    return scaled, changes, None
  source_probe, target_probe = compute_probe.probe_both(run.recipe, run.shape, resolved.recipe, target)
  estimate, changes = compute_probe.apply_probe(run.fit.estimate.components, scaled, changes, run.shape, target,
                                                source_probe, target_probe)
  return estimate, changes, {"run": source_probe.as_dict(), "job": target_probe.as_dict()}

"""``run_rl simulate``: the boundary model as a planning tool, fed from a recipe.

The recipe's ``simulate`` section gives component times (micro-batch, input
copy, update, metrics and other boundary work, wait floor, dispatch) and
whether ``update()`` waits for the last micro-batch; the batch section gives
micro-batches per step and the token count. See ``policies.boundary_model`` for
the model's assumptions and where it is pessimistic or optimistic.
"""

from __future__ import annotations

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
  from orchestrator.engine.presets import load_preset

  if recipe.simulate.tokens_per_device:
    per_micro = recipe.simulate.tokens_per_device
  else:
    preset = load_preset(recipe.model)
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


def components_from_run(path) -> tuple[Components, dict]:
  """Component times fitted from a run directory's records, and the run's own medians per mode.

  Micro-batch, update and boundary-work seconds are the records' medians; the
  preparation is the median stage (0 when the run never staged: it cannot be
  seen apart from the dispatch); the wait floor is the one the run calibrated.

  Raises:
    RunDirError / ValueError: not a run directory, or one without records.
  """
  import json  # pylint: disable=import-outside-toplevel
  import statistics  # pylint: disable=import-outside-toplevel
  from pathlib import Path  # pylint: disable=import-outside-toplevel

  from orchestrator import run_dir  # pylint: disable=import-outside-toplevel

  path = Path(path)
  config = run_dir.read_config(path, flag="simulate --from")
  lines = (path / run_dir.RECORDS).read_text().splitlines() if (path / run_dir.RECORDS).exists() else []
  records = [json.loads(line) for line in lines if line.strip()]
  if len(records) < 2:
    raise run_dir.RunDirError(f"simulate --from {path}: it holds {len(records)} records; at least 2 are needed")
  summary_path = path / run_dir.SUMMARY
  summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
  med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
  engine = config["config"].get("engine", {})
  stages = [r["stage_s"] for r in records if r.get("stage_s") is not None]
  components = Components(
      micro_batch_s=med([x for r in records for x in r["micro_batch_s"]]),
      prepare_s=med(stages),
      update_s=med([r["update_s"] for r in records]),
      boundary_work_s=med([(r.get("metrics_s") or 0) + (r.get("checkpoint_s") or 0) + (r.get("weight_sync_s") or 0)
                           for r in records]),
      wait_floor_s=summary.get("wait_floor_max_s") or 0.0,
      micro_batches_per_step=len(records[0]["micro_batch_s"]),
      update_waits_for_last=bool(engine.get("retry_when_tokens_dropped") or engine.get("skip_nonfinite_updates")),
      reruns_per_step=med([r.get("reruns") or 0 for r in records]),
      rerun_s=med([x for r in records for x in r["micro_batch_s"]]),
      rollout_wait_s=med([r["rollout_wait_s"] for r in records if r.get("rollout_wait_s") is not None]),
  )
  measured = {}
  for mode in {r["mode"] for r in records}:
    mine = [r for r in records if r["mode"] == mode]
    idles = [r["boundary_idle_s"] for r in mine if r.get("boundary_idle_s") is not None]
    measured[mode] = {"boundary_idle_s": med(idles), "step_s": med([r["step_s"] for r in mine]), "steps": len(mine)}
  return components, measured


def format_fit(path, components: Components, measured: dict) -> str:
  """Each mode's prediction from a run's fitted components, beside what the run measured in its own mode(s)."""
  c = components
  lines = [
      f"simulate --from {path}: {c.micro_batches_per_step} micro-batches of {format_seconds(c.micro_batch_s)},"
      f" stage {format_seconds(c.prepare_s)}, update {format_seconds(c.update_s)}, boundary work"
      f" {format_seconds(c.boundary_work_s)}, wait floor {format_seconds(c.wait_floor_s)}, rollout wait"
      f" {format_seconds(c.rollout_wait_s)} (fitted from its records)",
      "",
      f"{'mode':<20} {'predicted idle':>15} {'predicted step':>15} {'measured idle':>14} {'measured step':>14}"
      f" {'step error':>11}",
  ]
  for mode in Mode:
    p = predict(c, mode)
    m = measured.get(mode.value)
    seen = (f" {format_seconds(m['boundary_idle_s']):>14} {format_seconds(m['step_s']):>14}"
            f" {(p.step_s - m['step_s']) / m['step_s']:>+10.1%}") if m else f" {'-':>14} {'-':>14} {'-':>11}"
    lines.append(f"{mode.value:<20} {format_seconds(p.boundary_idle_s):>15} {format_seconds(p.step_s):>15}{seen}")
  return "\n".join(lines)

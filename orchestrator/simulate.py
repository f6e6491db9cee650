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

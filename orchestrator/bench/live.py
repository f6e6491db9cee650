"""Live-loop benchmark: per sampler placement, per boundary mode, at staleness 0 and 1, on one compiled engine.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m orchestrator.bench.live \
        [--recipe recipes/default.yaml] [--steps 40] [--placements shared split]

``shared`` samples on the trainer's devices; ``split`` on one device of its own
after the mesh's (``rollouts.devices=1``), which needs a spare device: without
one its arms are skipped, with a note. Every arm starts from the same weights
and samples the same rollouts (they are a function of the step and the
staleness; a sampler's weights are replicated wherever it runs, so the
placements sample alike). Prints, per arm: median boundary idle and strict
idle, median step seconds, median rollout wait (at the boundary, for the next
step's first micro-batch) and wait inside the step for its later micro-batches
(they stream in), median weight-sync seconds and
bytes moved to the sampler's devices, sampled tokens per second, the share of
boundaries staged, and the last 10 steps' mean reward; then one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys

from orchestrator import recipe as recipe_lib
from orchestrator.recipe import RecipeError
from orchestrator.assembly import build_engine_from_recipe, live_source, policy_from_recipe, program_config
from orchestrator.host.host_threads import reserve_host_core
from orchestrator.loop.program import RLProgram
from orchestrator.loop.trainer_worker import TrainerWorker
from policies import Mode


def _arm(recipe, engine, start, initial, sampler, mode, staleness: int, steps: int, placement: str) -> dict:
  from orchestrator.live.rollouts import LiveRollouts, LiveShape  # import here: JAX starts after reserve_host_core

  engine.restore(start)
  sampler.sync(initial, 0)
  r = recipe.rollouts
  source = LiveRollouts(sampler, recipe.live_task(), LiveShape(
      steps, recipe.batch.micro_batches_per_step, r.groups_per_micro_batch, r.generations_per_group, staleness,
      r.temperature, r.seed))
  worker = TrainerWorker(engine)
  policy = policy_from_recipe(recipe, worker.capabilities, mode=mode)
  try:
    result = RLProgram(worker, policy, source, program_config(recipe, None, steps=steps),
                       weight_sync=source.sync).run()
  finally:
    source.close()
  records, boundaries = result.records, result.records[:-1]
  median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
  return {
      "placement": placement, "mode": mode.value, "max_staleness": staleness,
      "median_boundary_idle_s": median([x.boundary_idle_s for x in boundaries]),
      "median_boundary_idle_strict_s": median([x.boundary_idle_strict_s for x in boundaries]),
      "median_weight_sync_s": median([x.weight_sync_s for x in records if x.weight_sync_s is not None]),
      "weight_sync_bytes": median([x.weight_sync_bytes for x in records if x.weight_sync_bytes is not None]),
      "median_step_s": median([x.step_s for x in records]),
      "median_rollout_wait_s": median([x.rollout_wait_s for x in boundaries if x.rollout_wait_s is not None]),
      "median_micro_batch_wait_s": median([x.micro_batch_wait_s for x in records if x.micro_batch_wait_s is not None]),
      "sampled_tokens_per_s": median([x.sampled_tokens_per_s for x in records[1:] if x.sampled_tokens_per_s]),
      "staged_share": sum(x.staged for x in boundaries) / max(1, len(boundaries)),
      "reward_last_10": statistics.fmean(x.reward_mean for x in records[-10:]),
      "final_state_digest": result.summary.final_state_digest,
  }


def _samplers(recipe, placements) -> tuple[dict, list[str]]:
  """One compiled sampler per placement that fits the visible devices; notes for those that do not."""
  samplers, notes = {}, []
  for placement in placements:
    placed = dataclasses.replace(recipe, rollouts=dataclasses.replace(
        recipe.rollouts, placement=placement, devices=1 if placement == "split" else None))
    try:
      samplers[placement] = live_source(placed).sampler
    except RecipeError as e:  # e.g. no spare device for a split sampler: those arms are skipped
      notes.append(f"placement {placement} skipped: {e}")
  return samplers, notes


def _print_rows(rows) -> None:
  fmt = lambda x, w, p: f"{x:>{w}.{p}f}" if x is not None else f"{'-':>{w}}"  # noqa: E731
  print(f"{'placement':<9} {'mode':<20} {'S':>2} {'idle_s':>9} {'strict_s':>9} {'step_s':>8} {'rollout_wait_s':>14}"
        f" {'mb_wait_s':>9} {'sync_s':>8} {'sync_bytes':>10} {'tokens/s':>9} {'staged':>7} {'reward':>7}")
  for r in rows:
    print(f"{r['placement']:<9} {r['mode']:<20} {r['max_staleness']:>2} {fmt(r['median_boundary_idle_s'], 9, 5)}"
          f" {fmt(r['median_boundary_idle_strict_s'], 9, 5)} {fmt(r['median_step_s'], 8, 4)}"
          f" {fmt(r['median_rollout_wait_s'], 14, 5)} {fmt(r['median_micro_batch_wait_s'], 9, 5)}"
          f" {fmt(r['median_weight_sync_s'], 8, 5)}"
          f" {fmt(r['weight_sync_bytes'], 10, 0)} {fmt(r['sampled_tokens_per_s'], 9, 0)} {r['staged_share']:>7.0%}"
          f" {r['reward_last_10']:>7.3f}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--recipe", default=None, help="a live-loop recipe (default: recipes/default.yaml)")
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--placements", nargs="+", choices=recipe_lib.PLACEMENTS, default=list(recipe_lib.PLACEMENTS))
  args = parser.parse_args(argv)
  recipe = recipe_lib.resolve(args.recipe, env={}).recipe
  if recipe.rollouts.source != "sampler":
    print("bench.live: the recipe must have rollouts.source: sampler", file=sys.stderr)
    return 2
  reservation = reserve_host_core()
  logging.basicConfig(level=logging.WARNING, format="%(message)s")

  engine = build_engine_from_recipe(recipe)
  samplers, notes = _samplers(recipe, args.placements)
  start, initial = engine.snapshot(), engine.export_weights()
  rows = []
  for placement, sampler in samplers.items():
    _arm(recipe, engine, start, initial, sampler, Mode.STAGE_BEFORE_UPDATE, 1, 3, placement)  # warm-up: compiles
    rows += [_arm(recipe, engine, start, initial, sampler, mode, s, args.steps, placement)
             for s in (0, 1) for mode in Mode]
  _print_rows(rows)
  for note in notes:
    print(note)
  for s in (0, 1):
    digests = {r["final_state_digest"] for r in rows if r["max_staleness"] == s}
    print(f"staleness {s}: final state identical across modes and placements: {len(digests) == 1}")
  print(json.dumps({"recipe": recipe.name, "steps": args.steps, "arms": rows, "skipped": notes,
                    "host_core_reservation": reservation.reason}))
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Live-loop benchmark: per boundary mode, at staleness 0 and 1, on one compiled engine and sampler.

    python -m orchestrator.bench.live [--recipe recipes/default.yaml] [--steps 40]

Every arm starts from the same weights and samples the same rollouts (they are
a function of the step and the staleness). Prints, per arm: median boundary
idle, median step seconds, median rollout wait, sampled tokens per second, the
share of boundaries staged, and the last 10 steps' mean reward; then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys

from orchestrator import recipe as recipe_lib
from orchestrator.app.runner import build_engine_from_recipe, live_source, policy_from_recipe, program_config
from orchestrator.engine.host_threads import reserve_host_core
from orchestrator.loop.program import RLProgram
from orchestrator.loop.trainer_worker import TrainerWorker
from policies import Mode


def _arm(recipe, engine, start, initial, sampler, mode, staleness: int, steps: int) -> dict:
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
      "mode": mode.value, "max_staleness": staleness,
      "median_boundary_idle_s": median([x.boundary_idle_s for x in boundaries]),
      "median_step_s": median([x.step_s for x in records]),
      "median_rollout_wait_s": median([x.rollout_wait_s for x in boundaries if x.rollout_wait_s is not None]),
      "sampled_tokens_per_s": median([x.sampled_tokens_per_s for x in records[1:] if x.sampled_tokens_per_s]),
      "staged_share": sum(x.staged for x in boundaries) / max(1, len(boundaries)),
      "reward_last_10": statistics.fmean(x.reward_mean for x in records[-10:]),
      "final_state_digest": result.summary.final_state_digest,
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--recipe", default=None, help="a live-loop recipe (default: recipes/default.yaml)")
  parser.add_argument("--steps", type=int, default=40)
  args = parser.parse_args(argv)
  recipe = recipe_lib.resolve(args.recipe, env={}).recipe
  if recipe.rollouts.source != "sampler":
    print("bench.live: the recipe must have rollouts.source: sampler", file=sys.stderr)
    return 2
  reservation = reserve_host_core()
  logging.basicConfig(level=logging.WARNING, format="%(message)s")

  engine = build_engine_from_recipe(recipe)
  sampler = live_source(recipe).sampler
  start, initial = engine.snapshot(), engine.export_weights()
  _arm(recipe, engine, start, initial, sampler, Mode.STAGE_BEFORE_UPDATE, 1, 3)  # warm-up: compiles
  rows = [_arm(recipe, engine, start, initial, sampler, mode, s, args.steps) for s in (0, 1) for mode in Mode]
  print(f"{'mode':<20} {'S':>2} {'idle_s':>9} {'step_s':>8} {'rollout_wait_s':>14} {'tokens/s':>9} {'staged':>7}"
        f" {'reward':>7}")
  for r in rows:
    fmt = lambda x, w, p: f"{x:>{w}.{p}f}" if x is not None else f"{'-':>{w}}"  # noqa: E731
    print(f"{r['mode']:<20} {r['max_staleness']:>2} {fmt(r['median_boundary_idle_s'], 9, 5)}"
          f" {fmt(r['median_step_s'], 8, 4)} {fmt(r['median_rollout_wait_s'], 14, 5)}"
          f" {fmt(r['sampled_tokens_per_s'], 9, 0)} {r['staged_share']:>7.0%} {r['reward_last_10']:>7.3f}")
  for s in (0, 1):
    digests = {r["final_state_digest"] for r in rows if r["max_staleness"] == s}
    print(f"staleness {s}: final state identical across modes: {len(digests) == 1}")
  print(json.dumps({"recipe": recipe.name, "steps": args.steps, "arms": rows,
                    "host_core_reservation": reservation.reason}))
  return 0


if __name__ == "__main__":
  sys.exit(main())

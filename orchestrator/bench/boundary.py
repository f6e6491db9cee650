"""Boundary benchmark: per mode, median boundary idle and step seconds on one compiled engine.

    python -m orchestrator.bench.boundary [--preset small] [--steps 4] [--micro-batches 3] [--disable-after N]

Runs every mode from the same initial state over the same synthetic rollouts
(a warm-up run first), then times the policy's own per-boundary overhead
(``plan`` + ``observe``, µs). Prints a table and one JSON object. The policy
has the recipe's defaults, so a staged mode can turn its staging off where the
stage outlasts the compute (the output says so, with the counts);
``--disable-after`` pins it for a comparison of the modes as such.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

from orchestrator.host.host_threads import reserve_host_core
from policies import Mode, PolicyReport, StepBoundaryPolicy


def policy_overhead_us(iterations: int = 20000) -> float:
  policy = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, wait_threshold_s=0.001, disable_after=3)
  start = time.perf_counter()
  for step in range(iterations):
    plan = policy.plan(step)
    if plan.stage:
      policy.observe(step, stage_s=0.001, device_wait_s=0.5)
  return (time.perf_counter() - start) / iterations * 1e6


def mode_row(mode: Mode, records: list, policy: PolicyReport, digest: str | None) -> dict:
  """One mode's medians from its run's records (the last step has no boundary).

  The stage's median is over the boundaries that staged: where the policy turned staging off
  (it auto-disables on a machine where the stage outlasts the compute), the later boundaries
  have no stage time, and the row says how many staged and why the rest did not.
  """
  boundaries = records[:-1]
  staged = [r for r in boundaries if r.staged]
  row = {
      "mode": mode.value,
      "median_boundary_idle_s": statistics.median(r.boundary_idle_s for r in boundaries),
      "median_boundary_idle_strict_s": statistics.median(r.boundary_idle_strict_s for r in boundaries),
      "median_step_s": statistics.median(r.step_s for r in records),
      "median_micro_batch_s": statistics.median(x for r in records for x in r.micro_batch_s),
      "median_stage_s": statistics.median(r.stage_s for r in staged) if staged else None,
      "boundaries": len(boundaries), "staged_boundaries": len(staged),
      "auto_disables": policy.auto_disables, "final_mode": policy.final_mode.value,
      "final_state_digest": digest, "staging_note": None,
  }
  if mode.staged and len(staged) < len(boundaries):
    off = (f"staging turned off by the policy (auto-disables: {policy.auto_disables}, final mode"
           f" {policy.final_mode.value})" if policy.auto_disables else f"final mode {policy.final_mode.value}")
    row["staging_note"] = (
        f"{len(staged)} of {len(boundaries)} boundaries staged, {off}; stage_s is the median over the"
        f" {len(staged)} staged; --disable-after 1000 pins the policy to compare the modes as such")
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="small")
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--micro-batches", type=int, default=3)
  parser.add_argument("--rows", type=int, default=None)
  parser.add_argument("--tokens-per-row", type=int, default=None)
  parser.add_argument("--disable-after", type=int, default=None,
                      help="low waits in a row that turn staging off (default: the recipe's; a large value pins"
                           " the modes)")
  args = parser.parse_args(argv)
  if args.steps < 2:
    parser.error(f"--steps {args.steps}: a boundary lies between two steps; use >= 2")
  if args.disable_after is not None and args.disable_after < 1:
    parser.error(f"--disable-after {args.disable_after}: staging turns off after that many low waits; use >= 1")

  reservation = reserve_host_core()
  logging.basicConfig(level=logging.WARNING, format="%(message)s")
  # import here: numpy's and JAX's threads start after reserve_host_core pins this process
  from orchestrator.assembly import policy_from_recipe
  from orchestrator.data.synthetic import SyntheticRollouts
  from orchestrator.engine import build_engine
  from orchestrator.loop.program import ProgramConfig, RLProgram
  from orchestrator.loop.trainer_worker import TrainerWorker
  from orchestrator.recipe import Recipe
  from orchestrator.recipe.schema import StepBoundarySection

  sections = {} if args.disable_after is None else {"disable_after": args.disable_after}
  recipe = Recipe(step_boundary=StepBoundarySection(**sections))  # otherwise the recipe's defaults
  engine = build_engine(args.preset, rows=args.rows, tokens_per_row=args.tokens_per_row)
  source = SyntheticRollouts(engine.preset.vocab_size, engine.rows, engine.tokens_per_row, seed=11)
  start = engine.snapshot()

  def run(mode: Mode, steps: int) -> dict:
    engine.restore(start)
    worker = TrainerWorker(engine)
    policy = policy_from_recipe(recipe, worker.capabilities, mode=mode)
    config = ProgramConfig(steps=steps, micro_batches_per_step=args.micro_batches)
    return RLProgram(worker, policy, source.steps(steps, args.micro_batches), config).run()

  run(Mode.STAGE_BEFORE_UPDATE, 2)  # warm-up: first-run costs land here
  rows = []
  for mode in Mode:
    result = run(mode, args.steps)
    rows.append(mode_row(mode, result.records, result.summary.policy, result.summary.final_state_digest))
  overhead = policy_overhead_us()
  print(f"{'mode':<20} {'idle_s':>10} {'strict_s':>10} {'step_s':>9} {'micro_s':>9} {'stage_s':>9}")
  for r in rows:
    stage = "-" if r["median_stage_s"] is None else f"{r['median_stage_s']:.5f}"
    print(f"{r['mode']:<20} {r['median_boundary_idle_s']:>10.5f} {r['median_boundary_idle_strict_s']:>10.5f}"
          f" {r['median_step_s']:>9.4f} {r['median_micro_batch_s']:>9.4f} {stage:>9}")
  for r in rows:
    if r["staging_note"]:
      print(f"{r['mode']}: {r['staging_note']}")
  print(f"policy overhead per boundary: {overhead:.2f} µs")
  identical = len({r["final_state_digest"] for r in rows}) == 1
  print(f"final state identical across modes: {identical}")
  print(json.dumps({
      "preset": args.preset, "rows": engine.rows, "tokens_per_row": engine.tokens_per_row,
      "steps": args.steps, "micro_batches": args.micro_batches,
      "disable_after": recipe.step_boundary.disable_after, "modes": rows, "policy_overhead_us": overhead, "identical_final_state": identical,
      "host_core_reservation": reservation.reason,
  }))
  return 0


if __name__ == "__main__":
  sys.exit(main())

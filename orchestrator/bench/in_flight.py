"""In-flight weight updates against batch-boundary updates: seconds to a reward, the sampler's pause for weights,
tokens per second and reward at equal steps, arms interleaved over rounds, with ranges.

    python -m orchestrator.bench.in_flight [--recipe recipes/live_in_flight.yaml] [--steps 60] [--seeds 0 1 2]
        [--reward 0.25] [--out DIR]

Each arm is one ``run_rl`` of the recipe with its overrides (``ARMS``), in a process of its own, so every arm
starts alike (the compilation cache on disk is shared). A round runs every arm once on one seed (``engine.seed``
and ``rollouts.seed``: the initial weights and what is sampled), the rounds one after another, so a change in the
machine's load falls on every arm and the ranges hold the seeds' spread; then every arm runs once more on the
first seed, which must reach that round's digest (in-flight updates are placed by counts, not time). From each
run's records:

- seconds to reward: from the first step's start to the update of the first step at which the mean reward of the
  last ``--window`` steps reaches ``--reward`` (None: not reached within the steps);
- the sampler's pause: the seconds it waited for a version's weight sync over the run (``sampler_sync_wait_s``:
  before a batch, and with in-flight updates between decode chunks), and its share of the run's seconds;
- tokens per second: the completion tokens sampled over the run's seconds (first step's start to last update);
- the trainer's wait for rollouts: at the boundary and inside the step (``rollout_wait_s``, ``micro_batch_wait_s``),
  the other side of the sampler's pause: a sampler ahead of the trainer waits for weights, one behind keeps the
  trainer waiting;
- reward at equal steps: the mean reward of the last ``--window`` steps, and the held-out accuracy at the end;
- the final state digest, which the rerun on the first seed must reach again.

Prints a line per run, a table (medians over the seeds, [min-max]) and, last, one JSON object (the summary);
writes ``report.json`` (every run's figures too) and every run's directory under ``--out`` (a new directory;
default ``runs/in_flight-bench-<time>``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from orchestrator import recipe as recipe_lib
from orchestrator.recipe import RecipeError

DEFAULT_RECIPE = str(recipe_lib.RECIPES_DIR / "live_in_flight.yaml")
#: arm -> the overrides it runs the recipe with: batch-boundary updates at staleness 0 and 1, in-flight at 1 and 2.
ARMS = {
    "boundary_s0": ["rollouts.in_flight_updates=false", "rollouts.max_staleness=0"],
    "boundary_s1": ["rollouts.in_flight_updates=false", "rollouts.max_staleness=1"],
    "in_flight_s1": ["rollouts.in_flight_updates=true", "rollouts.max_staleness=1"],
    "in_flight_s2": ["rollouts.in_flight_updates=true", "rollouts.max_staleness=2"],
}
#: One run of the default recipe takes well under a minute on two cores; half an hour means it hung.
RUN_TIMEOUT_S = 1800


def run_metrics(run_dir: Path, *, reward: float, window: int, completions_per_step: int, batch_steps: int = 1,
                epochs: int = 1) -> dict:
  """What one run measured, from its ``records.jsonl`` and ``summary.json`` (``completions_per_step``: the
  recipe's micro-batches a step times its completions a micro-batch; ``batch_steps`` and ``epochs``: its
  ``rollouts.batch_steps`` and ``engine.epochs``, so a batch's sampling counts once, at its first pass's steps,
  though a later pass's records repeat it)."""
  records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines() if line.strip()]
  summary = json.loads((run_dir / "summary.json").read_text())
  start = records[0]["t_update_ready"] - records[0]["step_s"]  # the first step's start
  at = lambda r: r["t_update_ready"] - start  # noqa: E731  # seconds from the first step's start to r's update
  rewards = [r["reward_mean"] for r in records]
  reached = next((i for i in range(window - 1, len(records))
                  if statistics.fmean(rewards[i - window + 1:i + 1]) >= reward), None)
  run_s = at(records[-1])
  sampling = [r for r in records if r["step"] % (batch_steps * epochs) < batch_steps]  # first passes
  sampled_tokens = sum(r["completion_tokens_mean"] * completions_per_step for r in sampling)
  pause_s = sum(r["sampler_sync_wait_s"] or 0.0 for r in sampling)
  return {
      "seconds_to_reward": None if reached is None else at(records[reached]),
      "step_reward_reached": reached,
      "sampler_pause_s": pause_s,
      "sampler_pause_share": pause_s / run_s,
      "tokens_per_s": sampled_tokens / run_s,
      "trainer_rollout_wait_s": sum((r["rollout_wait_s"] or 0.0) + (r["micro_batch_wait_s"] or 0.0) for r in records),
      "run_s": run_s,
      "median_step_s": statistics.median(r["step_s"] for r in records),
      "reward_last_steps": statistics.fmean(rewards[-window:]),
      "eval_accuracy_end": summary.get("eval_accuracy_end"),
      "final_state_digest": summary["final_state_digest"],
  }


def _seeded(seed: int) -> list[str]:
  return [f"engine.seed={seed}", f"rollouts.seed={seed}"]


def _arm_overrides(arm: str, seed: int, steps: int | None) -> list[str]:
  return [*ARMS[arm], *_seeded(seed), *([f"steps={steps}"] if steps is not None else [])]


class ArmFailed(Exception):
  """A run of an arm did not end well; the message names it and its output."""


def _run(recipe: str, arm: str, seed: int, steps: int, run_dir: Path) -> None:
  command = [sys.executable, "-m", "orchestrator.app.cli", "--recipe", recipe, "--out", str(run_dir),
             *_arm_overrides(arm, seed, steps)]
  # The arms run as the recipe and their overrides say, as checked: no switch from this shell's environment.
  env = {k: v for k, v in os.environ.items() if k not in recipe_lib.ENV_SWITCHES}
  log_path = run_dir.with_suffix(".log")
  try:
    with open(log_path, "w") as log:
      done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=RUN_TIMEOUT_S,
                            check=False)
  except subprocess.TimeoutExpired as e:
    raise ArmFailed(f"arm {arm}, seed {seed}: run_rl ran past {RUN_TIMEOUT_S} s; its output: {log_path}") from e
  if done.returncode != 0:
    raise ArmFailed(f"arm {arm}, seed {seed}: run_rl exited {done.returncode}; its output: {log_path}")


def _spread(values: list) -> dict | None:
  values = [v for v in values if v is not None]
  if not values:
    return None
  return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(runs: dict[str, list[dict]], reruns: dict[str, dict]) -> dict[str, dict]:
  """Per arm: each metric's median and range over its rounds (one a seed), and whether its rerun on the first
  round's seed reached that round's digest."""
  keys = ("seconds_to_reward", "sampler_pause_s", "sampler_pause_share", "tokens_per_s", "trainer_rollout_wait_s",
          "run_s", "median_step_s",
          "reward_last_steps", "eval_accuracy_end")
  out = {}
  for arm, rounds in runs.items():
    first, again = rounds[0]["final_state_digest"], reruns[arm]["final_state_digest"]
    out[arm] = {k: _spread([r[k] for r in rounds]) for k in keys}
    out[arm].update(rounds=len(rounds), reward_reached=sum(r["seconds_to_reward"] is not None for r in rounds),
                    digests=[r["final_state_digest"] for r in rounds], rerun_digest=again,
                    rerun_same_digest=first == again)
  return out


def _cell(spread: dict | None, fmt: str) -> str:
  if spread is None:
    return "-"
  return f"{spread['median']:{fmt}} [{spread['min']:{fmt}}-{spread['max']:{fmt}}]"


def print_table(summary: dict[str, dict], reward: float) -> None:
  print(f"{'arm':<14} {'s to reward ' + str(reward):>24} {'sampler pause s':>22} {'pause share':>20} "
        f"{'tokens/s':>22} {'trainer wait s':>20} {'reward, last':>20} {'held-out end':>20}  rerun: digest")
  for arm, m in summary.items():
    to_reward = _cell(m["seconds_to_reward"], ".2f") + f" ({m['reward_reached']}/{m['rounds']})"
    print(f"{arm:<14} {to_reward:>24} {_cell(m['sampler_pause_s'], '.2f'):>22} "
          f"{_cell(m['sampler_pause_share'], '.3f'):>20} {_cell(m['tokens_per_s'], '.1f'):>22} "
          f"{_cell(m['trainer_rollout_wait_s'], '.2f'):>20} "
          f"{_cell(m['reward_last_steps'], '.3f'):>20} {_cell(m['eval_accuracy_end'], '.3f'):>20}  "
          + (f"same {m['rerun_digest'][:16]}" if m["rerun_same_digest"]
             else f"DIFFERS: {m['digests'][0][:8]} then {m['rerun_digest'][:8]}"))


def _refusal(args) -> str | dict:
  """What is wrong with the arguments or the recipe under each arm and seed (one line), before anything runs;
  else each arm's recipe (on the first seed)."""
  if len(set(args.seeds)) != len(args.seeds) or any(s < 0 for s in args.seeds):
    return f"--seeds {' '.join(map(str, args.seeds))}: distinct seeds, none below 0"
  if args.steps is not None and args.steps < 1:
    return f"--steps {args.steps}: must be at least 1"
  if args.window < 1:
    return f"--window {args.window}: must be at least 1"
  if not 0.0 < args.reward <= 1.0:
    return f"--reward {args.reward}: a mean reward to reach, in (0, 1]"
  if args.out and Path(args.out).exists():
    return f"--out {args.out}: exists; name a new directory (a benchmark never writes over another's runs)"
  recipes = {}
  for arm in ARMS:
    for seed in reversed(args.seeds):  # the first seed's last: the one kept
      try:
        recipes[arm] = recipe_lib.resolve(args.recipe, overrides=_arm_overrides(arm, seed, args.steps),
                                          env={}).recipe
      except RecipeError as e:
        return f"the recipe under arm {arm}, seed {seed}: {e}"
    if args.window > recipes[arm].steps:
      return f"--window {args.window}: more than the {recipes[arm].steps} steps an arm runs"
  return recipes


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--recipe", default=DEFAULT_RECIPE, help="a live-loop recipe (default: recipes/live_in_flight.yaml)")
  parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the recipe's)")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                      help="a round of every arm on each seed, interleaved (default 0 1 2)")
  parser.add_argument("--reward", type=float, default=0.25, help="the mean reward to reach (default 0.25)")
  parser.add_argument("--window", type=int, default=10, help="steps the reward is averaged over (default 10)")
  parser.add_argument("--out", help="a new directory for the runs and report.json")
  args = parser.parse_args(argv)
  recipes = _refusal(args)
  if isinstance(recipes, str):
    print(f"bench.in_flight: {recipes}", file=sys.stderr)
    return 2
  recipe = next(iter(recipes.values()))  # the arms differ in rollouts' in-flight updates and staleness only
  steps = recipe.steps
  shape = dict(completions_per_step=(recipe.batch.micro_batches_per_step * recipe.rollouts.groups_per_micro_batch
                                     * recipe.rollouts.generations_per_group),
               batch_steps=recipe.rollouts.batch_steps, epochs=recipe.engine.epochs)
  out = Path(args.out or f"runs/in_flight-bench-{time.strftime('%Y%m%d-%H%M%S')}")
  out.mkdir(parents=True)
  try:
    runs, reruns = _rounds(args, steps, shape, out)
  except ArmFailed as e:
    print(f"bench.in_flight: {e}", file=sys.stderr)
    return 1
  summary = summarize(runs, reruns)
  print_table(summary, args.reward)
  load = os.getloadavg()
  report = {"recipe": args.recipe, "steps": steps, "seeds": args.seeds, "reward": args.reward,
            "window": args.window, "arms": {arm: ARMS[arm] for arm in ARMS}, "summary": summary, "runs": runs,
            "reruns": reruns, "load_average_at_end": load}
  (out / "report.json").write_text(json.dumps(report, indent=1))
  print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; every run's figures: "
        f"{out / 'report.json'}")
  print(json.dumps({k: v for k, v in report.items() if k not in ("runs", "reruns")}))
  return 0


def _rounds(args, steps: int, shape: dict, out: Path) -> tuple[dict[str, list[dict]], dict[str, dict]]:
  """A round of every arm per seed, then every arm on the first seed again: each run's metrics, printed as it
  ends."""
  runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
  reruns: dict[str, dict] = {}
  for name, seed in [*((f"seed{seed}", seed) for seed in args.seeds), (f"rerun-seed{args.seeds[0]}", args.seeds[0])]:
    for arm in ARMS:
      run_dir = out / f"{name}-{arm}"
      _run(args.recipe, arm, seed, steps, run_dir)
      metrics = dict(run_metrics(run_dir, reward=args.reward, window=args.window, **shape), seed=seed,
                     run_dir=str(run_dir))
      if name.startswith("rerun"):
        reruns[arm] = metrics
      else:
        runs[arm].append(metrics)
      print(f"{name} {arm}: {json.dumps({k: v for k, v in metrics.items() if k != 'run_dir'})}", flush=True)
  return runs, reruns


if __name__ == "__main__":
  sys.exit(main())

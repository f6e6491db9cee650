"""The accelerator checks, one process at a time, into one JSON: what a user of one TPU (or GPU) host runs first.

    python -m orchestrator.bench.tpu [--out DIR] [--only NAME ... | --all] [--minutes 10]

Each check is a command of its own (an accelerator takes one process at a time,
so they run in turn, never side by side), with a share of the time budget.
Without ``--only`` or ``--all`` it runs ``DEFAULT_CHECKS``, about ten minutes:

* ``default``: the default ``run_rl`` (the live loop; ``rollouts.placement=auto``
  shares the trainer's accelerator), and ``default_again``, the same shapes
  again for 20 steps, whose start shows the persistent compilation cache;
* ``smollm2_shape`` and ``qwen3_shape``: ``recipes/tpu_smollm2_shape.yaml`` and
  ``recipes/tpu_qwen3_0p6b_shape.yaml``, real models' shapes at 32 × 1,024 tokens
  a micro-batch, 20 steps;
* ``moe24_record``, ``moe24_compile``, ``moe24_rig``: a recording made for ``recipes/tpu_moe24_rig.yaml`` (24
  layers, top-8, routing replay, dropless re-runs), its programs compiled, and the rig's four modes over it;
* ``moe24_rows2_record``, ``moe24_rows2_compile``, ``moe24_rows2_rig``: the same at twice the rows (128 × 512
  tokens a micro-batch: twice the routing bytes staged), the shape ``run_rl simulate --from`` the rig's directory
  predicts;
* ``live_saving``: ``recipes/tpu_live_saving.yaml``, the live loop where the trainer sets the pace, 240 steps:
  the share of boundaries staged before the update and the saving the run measured on its own controls;
* ``tunix_grpo``: ``python -m orchestrator.bench.tunix_grpo`` on the accelerator, stock Tunix GRPO and the
  add-on alternating, four optimizer steps a global step on one mesh (the split layout needs a second device);
* ``accelerator``: ``python -m orchestrator.bench.accelerator`` at its small preset;
* ``saving_rule``: ``python -m orchestrator.bench.saving`` on the default recipe, PIPELINED and
  STAGE_BEFORE_UPDATE twice each, with the low-wait rule pinned off (``step_boundary.wait_threshold_s=0``) and a
  control every 4th boundary, so the only rule that can turn staging off is the one on the controls' measured
  saving: what it decided on the chip, against the A/B between the runs;
* ``startup_cache`` and ``startup``: ``python -m orchestrator.bench.startup``, the peer benchmark (``run_rl``,
  ``run_rl`` at staleness 0 and stock Tunix GRPO set up alike), a short round that fills the compilation cache,
  then two rounds of 100 steps.

For each: the command, its exit code and seconds, the last lines it printed, and
from the run's ``summary.json`` and records the figures docs/benchmarks.md quotes
(median step, peak device memory, MFU, compiles after the first step, start-up
phases, reward and held-out accuracy, the weight sync's seconds). Writes
``DIR/tpu.json`` (default ``runs/tpu-<time>``); exit 0 when every check exited 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: The checks in the order they run: name → (the command's arguments after the Python interpreter, budget share).
#: The shares follow what each took on a TPU v5e (docs/benchmarks.md): about 60, 30, 100, 165 and 25 s for the
#: first five; the MoE rig's compile check 414 s, its ten arms 394 s from the compiled programs (455 s with loading
#: them); at twice the rows the recording 51 s, the compile check over 437 s, its eight arms 540 s with loading; the
#: live loop 313 s; bench.accelerator takes what it is given.
CHECKS = {
    "default": (["-m", "orchestrator.app.cli", "--out", "{dir}/default"], 0.08),
    "default_again": (["-m", "orchestrator.app.cli", "steps=20", "--out", "{dir}/default_again"], 0.04),
    "smollm2_shape": (["-m", "orchestrator.app.cli", "--recipe", "recipes/tpu_smollm2_shape.yaml",
                       "--out", "{dir}/smollm2_shape"], 0.13),
    "qwen3_shape": (["-m", "orchestrator.app.cli", "--recipe", "recipes/tpu_qwen3_0p6b_shape.yaml",
                     "--out", "{dir}/qwen3_shape"], 0.21),
    "moe24_record": (["-m", "orchestrator.app.cli", "record", "--recipe", "recipes/tpu_moe24_rig.yaml",
                      "--out", "{dir}/moe24_recording", "rollouts.groups=512"], 0.08),
    # the rig's programs compiled into the persistent cache with one short arm (about 350 s on a fresh TPU v5e
    # host): a machine that allows ten minutes a command runs it, then moe24_record and moe24_rig, in two
    "moe24_compile": (["-m", "orchestrator.app.cli", "rig", "--recipe", "recipes/tpu_moe24_rig.yaml",
                       "--recording", "{dir}/moe24_recording", "--out", "{dir}/moe24_compile", "--steps", "2",
                       "--arms", "pipelined"], 0.55),
    # three interleaved rounds of OFF, STAGE_BEFORE_UPDATE and PIPELINED (so each of their comparisons is over
    # three arms' medians a side, the drift between arms counted), then STAGE_AFTER_UPDATE
    "moe24_rig": (["-m", "orchestrator.app.cli", "rig", "--recipe", "recipes/tpu_moe24_rig.yaml",
                   "--recording", "{dir}/moe24_recording", "--out", "{dir}/moe24_rig", "--arms",
                   *["off", "stage_before_update", "pipelined"] * 3, "stage_after_update"], 0.60),
    # the second shape the boundary model is asked to predict from the rig above (`run_rl simulate --from` its
    # directory with `--recipe recipes/tpu_moe24_rig.yaml batch.rows=128`): twice the rows, so twice the routing
    # bytes a micro-batch stages and twice its compute; its own programs, compiled apart as above
    "moe24_rows2_record": (["-m", "orchestrator.app.cli", "record", "--recipe", "recipes/tpu_moe24_rig.yaml",
                            "--out", "{dir}/moe24_rows2_recording", "rollouts.groups=1024"], 0.08),
    "moe24_rows2_compile": (["-m", "orchestrator.app.cli", "rig", "--recipe", "recipes/tpu_moe24_rig.yaml",
                             "--recording", "{dir}/moe24_rows2_recording", "--out", "{dir}/moe24_rows2_compile",
                             "batch.rows=128", "--steps", "2", "--arms", "pipelined"], 0.62),
    "moe24_rows2_rig": (["-m", "orchestrator.app.cli", "rig", "--recipe", "recipes/tpu_moe24_rig.yaml",
                         "--recording", "{dir}/moe24_rows2_recording", "--out", "{dir}/moe24_rows2_rig", "batch.rows=128",
                         "--arms", *["off", "stage_before_update", "pipelined"] * 2, "off", "stage_before_update"],
                        0.80),
    "live_saving": (["-m", "orchestrator.app.cli", "--recipe", "recipes/tpu_live_saving.yaml",
                     "--out", "{dir}/live_saving"], 0.40),
    # four optimizer steps a global step on the one mesh: what a single device can stage (four child processes,
    # about 165 s on a TPU v5e)
    "tunix_grpo": (["-m", "orchestrator.bench.tunix_grpo", "--configs", "c_shared_four_mini_batches",
                    "--global-steps", "8", "--repeats", "2"], 0.25),
    "accelerator": (["-m", "orchestrator.bench.accelerator", "--minutes", "{minutes}",
                     "--out", "{dir}/accelerator.json"], 0.18),
    # the default run is host-bound on the chip, so the low-wait rule turns staging off after two stages; pinned
    # off, only the controls' measured saving can (four runs of 300 steps)
    "saving_rule": (["-m", "orchestrator.bench.saving", "--rounds", "2", "--variants", "default", "--modes",
                     "pipelined", "stage_before_update", "--set", "step_boundary.wait_threshold_s=0",
                     "step_boundary.control_every=4", "--out", "{dir}/saving_rule"], 0.40),
    # every arm reaches the reward by step 74 on the chip (2026-12-07): 100 steps, after a round that compiles
    "startup_cache": (["-m", "orchestrator.bench.startup", "--rounds", "1", "--steps", "24", "--arms",
                       "run_rl,tunix"], 0.15),
    "startup": (["-m", "orchestrator.bench.startup", "--rounds", "2", "--steps", "100", "--arms",
                 "run_rl,run_rl_sync,tunix"], 0.45),
}
#: What a run without ``--only`` or ``--all`` checks, in about ten minutes on a fresh TPU v5e host (measured: 60,
#: 30, 100 and 165 s for the first four, and bench.accelerator what is left). The MoE rig (six minutes of compiling
#: alone the first time), the live loop at a device-bound size and bench.tunix_grpo run with ``--all`` or by name.
DEFAULT_CHECKS = ("default", "default_again", "smollm2_shape", "qwen3_shape", "accelerator")
#: Lines of each command's output kept in the JSON.
TAIL_LINES = 25


def figures(run_dir: Path) -> dict:
  """What docs/benchmarks.md quotes from a finished run's directory (an empty dict where it wrote none)."""
  out: dict = {}
  summary_path = run_dir / "summary.json"
  if summary_path.is_file():
    summary = json.loads(summary_path.read_text())
    keys = ("steps", "final_state_digest", "median_step_s", "median_boundary_idle_s", "peak_device_bytes",
            "median_mfu", "compiles_after_first_step", "startup_s", "reward_first_step", "reward_last_10_steps",
            "eval_accuracy_start", "eval_accuracy_end", "final_mode", "boundaries", "staged_boundaries",
            "staged_before_update", "measured_saving", "median_rollout_wait_s", "boundaries_next_not_ready")
    out.update({key: summary.get(key) for key in keys if key in summary})
  rig_report = run_dir / "report.json"
  if rig_report.is_file():  # a rig's directory
    report = json.loads(rig_report.read_text())
    out["verdict_line"] = report.get("verdict_line")
    out["components"] = report.get("components")
    out["comparisons"] = report.get("comparisons")
    out["arms"] = {a["name"]: {key: a.get(key) for key in ("step_s", "boundary_idle_s", "micro_batch_s", "stage_s",
                                                          "reruns", "final_mode", "final_state_digest")}
                   for a in report.get("arms", [])}
  records_path = run_dir / "records.jsonl"
  if records_path.is_file():
    records = [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]
    syncs = [r["weight_sync_s"] for r in records if r.get("weight_sync_s") is not None]
    out["median_weight_sync_s"] = statistics.median(syncs) if syncs else None
    out["compiles_by_step"] = [r.get("compiles") for r in records]
    out["first_step_s"] = records[0]["step_s"] if records else None
  return out


def recording_writer(name: str) -> str | None:
  """The check that writes the recording check ``name`` replays (``--recording {dir}/X`` is what ``--out
  {dir}/X`` writes), or None where it replays none."""
  args = CHECKS[name][0]
  if "--recording" not in args:
    return None
  recording = args[args.index("--recording") + 1]
  return next(other for other, (other_args, _) in CHECKS.items()
              if "--out" in other_args and other_args[other_args.index("--out") + 1] == recording)


def run_check(name: str, args: list[str], timeout_s: float, out_dir: Path) -> dict:
  """Runs one check's command (its own process) within ``timeout_s``, its output streamed to ``DIR/NAME.log`` (a
  check cut short still leaves what it printed); returns what the JSON keeps of it."""
  command = [sys.executable, *args]
  log_path = out_dir / f"{name}.log"
  start = time.perf_counter()
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  with open(log_path, "w") as log:
    # a session of its own: a check cut short is ended with every process it started (a sampler, a trainer)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
      code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      os.killpg(process.pid, signal.SIGKILL)
      process.wait()
      code = None
  seconds = time.perf_counter() - start
  output = log_path.read_text(errors="replace")
  result = {"command": " ".join(["python", *args]), "exit_code": code, "seconds": round(seconds, 1),
            "timed_out": code is None, "tail": output.splitlines()[-TAIL_LINES:]}
  target = args[args.index("--out") + 1] if "--out" in args else None  # the run's directory (not its inputs)
  if target is not None and Path(target).is_dir():
    result["figures"] = figures(Path(target))
  print(f"[tpu] {name}: exit {code} in {seconds:.0f} s", file=sys.stderr, flush=True)
  return result


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m orchestrator.bench.tpu", description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=None, help="the directory to write (default runs/tpu-<time>)")
  parser.add_argument("--only", nargs="+", choices=sorted(CHECKS), default=None, help="these checks alone")
  parser.add_argument("--all", action="store_true",
                      help="every check (about 56 minutes on a fresh TPU v5e host: give --minutes 56)")
  parser.add_argument("--minutes", type=float, default=10.0, help="the whole budget (default 10)")
  args = parser.parse_args(argv)
  if args.only and args.all:
    parser.error("--only and --all: give one of them")
  if not args.minutes > 0:
    parser.error(f"--minutes {args.minutes}: give a number of minutes > 0")
  chosen = args.only or (list(CHECKS) if args.all else list(DEFAULT_CHECKS))
  for name in chosen:  # a recording lives in this run's directory: the check that writes it runs first, here
    writer = recording_writer(name)
    if writer is not None and writer not in chosen[:chosen.index(name)]:
      parser.error(f"--only {' '.join(chosen)}: {name} replays the recording {writer} writes into this --out;"
                   f" name {writer} before it")
  out_dir = Path(args.out or f"runs/tpu-{datetime.datetime.now():%Y%m%d-%H%M%S}")
  if out_dir.exists() and any(out_dir.iterdir()):
    parser.error(f"--out {out_dir} already holds files; choose a new directory")
  out_dir.mkdir(parents=True, exist_ok=True)
  budget_s = args.minutes * 60
  shares = sum(CHECKS[name][1] for name in chosen)
  deadline = time.monotonic() + budget_s
  results: dict = {"started": datetime.datetime.now().isoformat(timespec="seconds"), "checks": {}}
  for name in chosen:
    template, share = CHECKS[name]
    timeout_s = min(budget_s * share / shares, deadline - time.monotonic())
    if timeout_s < 10:
      results["checks"][name] = {"skipped": "the budget ran out"}
      continue
    minutes = f"{max(1.0, timeout_s / 60 - 0.5):.1f}"
    command = [a.format(dir=out_dir, minutes=minutes) for a in template]
    results["checks"][name] = run_check(name, command, timeout_s, out_dir)
    (out_dir / "tpu.json").write_text(json.dumps(results, indent=1))
  failed = [n for n, r in results["checks"].items() if r.get("exit_code") != 0]
  print(f"[tpu] {len(chosen) - len(failed)} of {len(chosen)} checks exited 0; {out_dir / 'tpu.json'}",
        file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())

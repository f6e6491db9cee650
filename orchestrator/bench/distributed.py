"""What several processes cost at a boundary: 1 against 2 processes on the same global mesh.

    python -m orchestrator.bench.distributed [--steps 20] [--repeats 2] [--rows 16]

The same synthetic run (tiny model, 4 CPU devices as fsdp 2 × context 2, two
micro-batches per step) goes through ``run_rl`` as a job of one process with
four devices and as a job of two processes with two devices each (both over
Gloo's CPU collectives), in OFF and STAGE_BEFORE_UPDATE. From each run's
summary and records: median step, median boundary idle, median stage seconds
(process 0, and the slowest process per boundary), and the agreement's
overhead per boundary — the host seconds each boundary spends exchanging the
stop flag and the policy's measurements through the coordinator, including
any wait for the slower process to arrive (a job of one process exchanges
without a round trip). Medians over
``--repeats``; the first two steps are left out (compiles, warm-up). Then one
JSON object. On a 2-core machine the two processes share the cores, so step
times compare the same work under more contention, not a faster job.

With ``--live`` the run is the live loop instead (the default recipe on fsdp 2:
one process of two devices against two of one, every process sampling every
step on its first device), and the table adds the weight sync's median
seconds and, where the weights are gathered across processes, the gather's
(``weight_transfer_s``), and the median rollout wait.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from orchestrator.recipe import RECIPES_DIR

WARMUP_STEPS = 2
MODES = {"off": ["--no-pipeline_step_boundary", "--no-stage_before_update"], "stage_before_update": []}


SYNTHETIC = ["--recipe", str(RECIPES_DIR / "mesh_4dev.yaml"), "rollouts.source=synthetic", "mesh.fsdp=2",
             "mesh.context=2", "mesh.expert=1"]
LIVE = ["--recipe", str(RECIPES_DIR / "default.yaml"), "mesh.fsdp=2", "task.eval_prompts=8",
        "run.reserve_host_core=false"]


def _run(out: Path, processes: int, mode: str, steps: int, rows: int, live: bool = False) -> dict:
  args = [*(LIVE if live else SYNTHETIC), f"batch.rows={rows}", f"steps={steps}",
          f"distributed.num_processes={processes}", "--out", str(out), *MODES[mode]]
  done = subprocess.run([sys.executable, "-m", "orchestrator.app.cli", *args], capture_output=True, text=True, check=False)
  if done.returncode != 0:
    raise SystemExit(f"run failed ({processes} processes, {mode}): {done.stderr.strip().splitlines()[-1:]}")
  summary = json.loads((out / "summary.json").read_text())
  records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()][WARMUP_STEPS:]

  def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None

  boundaries = max(1, len(records) - 1 + WARMUP_STEPS)
  agreement = summary.get("agreement") or {}
  exchanges_per_boundary = (agreement.get("exchanges") or 0) / boundaries
  return {
      "step_s": median(r["step_s"] for r in records),
      "boundary_idle_s": median(r["boundary_idle_s"] for r in records),
      "stage_s": median(r["stage_s"] for r in records),
      "stage_s_slowest_process": median(max(r["per_process"]["stage_s"]) if r.get("per_process") and
                                        r["per_process"]["stage_s"][0] is not None else r["stage_s"]
                                        for r in records),
      "exchange_s": agreement.get("median_s"),
      "exchanges_per_boundary": exchanges_per_boundary,
      "agreement_s_per_boundary": (agreement.get("median_s") or 0.0) * exchanges_per_boundary,
      "weight_sync_s": median(r["weight_sync_s"] for r in records),
      "weight_transfer_s": median(r.get("weight_transfer_s") for r in records),
      "rollout_wait_s": median(r.get("rollout_wait_s") for r in records),
      "digest": summary["final_state_digest"][:12],
  }


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m orchestrator.bench.distributed", description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--rows", type=int, default=16)
  p.add_argument("--live", action="store_true", help="the live loop (rollouts.source=sampler) instead")
  args = p.parse_args(argv)
  results: dict = {}
  with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
    for repeat in range(args.repeats):
      for processes in (1, 2):
        for mode in MODES:
          run = _run(Path(tmp) / f"{processes}-{mode}-{repeat}", processes, mode, args.steps, args.rows, args.live)
          results.setdefault(f"{processes}:{mode}", []).append(run)
          print(f"repeat {repeat}: {processes} process(es), {mode}: step {run['step_s'] * 1e3:.1f} ms, idle"
                f" {run['boundary_idle_s'] * 1e3:.2f} ms, agreement {run['agreement_s_per_boundary'] * 1e3:.2f}"
                " ms/boundary", file=sys.stderr)
  table = {}
  for key, runs in results.items():
    row = {}
    for field in runs[0]:
      values = [r[field] for r in runs if r[field] is not None]
      row[field] = values[0] if field == "digest" else (statistics.median(values) if values else None)
    row["digests_equal_across_repeats"] = len({r["digest"] for r in runs}) == 1
    table[key] = row
  print(f"{'processes':>9} {'mode':<20} {'step ms':>8} {'idle ms':>8} {'stage ms':>9} {'stage max':>9}"
        f" {'agree ms/bdy':>12} {'exch/bdy':>8} {'sync ms':>8} {'gather ms':>9} {'rollout ms':>10}  digest")
  for key, row in table.items():
    processes, mode = key.split(":")
    fmt = lambda v: "-" if v is None else f"{v * 1e3:.2f}"  # noqa: E731
    print(f"{processes:>9} {mode:<20} {fmt(row['step_s']):>8} {fmt(row['boundary_idle_s']):>8} {fmt(row['stage_s']):>9}"
          f" {fmt(row['stage_s_slowest_process']):>9} {fmt(row['agreement_s_per_boundary']):>12}"
          f" {row['exchanges_per_boundary']:>8.1f} {fmt(row['weight_sync_s']):>8} {fmt(row['weight_transfer_s']):>9}"
          f" {fmt(row['rollout_wait_s']):>10}  {row['digest']}")
  print(json.dumps({"steps": args.steps, "repeats": args.repeats, "rows": args.rows, "live": args.live,
                    "results": table}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())

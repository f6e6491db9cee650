"""How a run ends, in words and files: its report, a stop, a refusal, a failure.

Each ending prints what it says once (process 0 on the run's terminal, the
other processes of a job in their logs), writes ``summary.json`` (and
``error.log`` for a failure) into this segment's directory, and returns the
exit code: 0 done, 130/143 stopped by a signal with a checkpoint to resume
from, 4 stopped by one with nothing to resume (``signals.EXIT_NOTHING_TO_RESUME``),
2 refused, 1 failed, 3 a lost peer (``Job.end_for_peer``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from orchestrator.app import locks
from orchestrator.app.console import format_summary, format_table
from orchestrator.app.plan import RunPlan
from orchestrator.app.signals import EXIT_CODES, EXIT_NOTHING_TO_RESUME, StopSignals
from orchestrator.data.recording import LIVE_LOOP_TOOL, write_recording
from orchestrator.contract import live_part
from orchestrator.distributed import job as job_lib
from orchestrator.distributed.launcher import LAUNCHED_ENV
from orchestrator.live.plot import plot_rewards
from orchestrator.loop.program import NonFiniteStepError, StoppedWithoutCheckpointError
from orchestrator.run_files import run_dir


def end_run_on_lost_peer(writes_to: list, job: job_lib.Job, line: str) -> None:
  """What a process of a run does when the watchdog reports a lost peer: one line, the summary (process 0, in
  this segment's directory once it has one: never an earlier segment's), exit 3 (``Job.end_for_peer``)."""
  step = job.current_step()
  where = "during bring-up" if step is None else f"at step {step}"
  kept, out = "", writes_to[0]
  if job.is_primary and out is not None:
    run_dir.write_summary(out, {"ended": "error", "last_step": step, "error": line})
    kept = f"; records so far are kept in {out / run_dir.RECORDS}"
  if os.environ.get(LAUNCHED_ENV) != "1":  # else the launcher says it, once, with how the process ended
    print(f"run_rl: {job.label}{line}; ending this process {where}{kept}", file=sys.stderr, flush=True)
  job.end_for_peer()


def refuse(e: Exception | str, *, job=None, code: int = 2) -> int:
  """One line, exit 2 (nothing was started or written). In a job every process refuses together; process 0
  says why on the run's terminal and the others in their logs."""
  print(f"run_rl: error: {e}", file=sys.stderr, flush=True)
  if job is not None:
    job.finish(succeeded=True)
  return code


def record_rollouts(recipe, source, result, write_dir: Path) -> None:
  """A live run with ``rollouts.record_to`` writes what it trained on, replayable as a recording, holding the
  recording directory's lock. A resumed segment never writes over the recording an earlier one wrote: it
  writes its own steps' into ``write_dir/recording``."""
  record_to = recipe.rollouts.record_to
  live = live_part(source)
  recorded = live.recorded_steps() if live is not None else None
  if not record_to or recorded is None:
    return
  # import here: JAX-side (after setup_host)
  from orchestrator.assembly import recorded_distribution
  from orchestrator.live.rollouts import recorded_groups

  target = Path(record_to)
  if (target / "manifest.json").exists():
    target = write_dir / "recording"
  with locks.lock(target, flag="rollouts.record_to", create=True):
    manifest = write_recording(target, recorded_groups(recorded, recipe.rollouts.generations_per_group),
                               vocab_size=recipe.model_preset().vocab_size,
                               produced_by={"tool": LIVE_LOOP_TOOL, "recipe": recipe.name,
                                            "task": dataclasses.asdict(recipe.task), "steps": result.last_step + 1},
                               sampled=recorded_distribution(recipe))
  record_to = str(target)
  result.summary = result.summary.replace(
      run=dict(result.summary.run, recording={"path": record_to, "groups": manifest["num_groups"]}))
  print(f"run_rl: wrote the {manifest['num_groups']} groups this run trained on to {record_to}"
        f" (replay them with rollouts.source=recording rollouts.recording={record_to})", file=sys.stderr)


def previous_trace(plan: RunPlan) -> list:
  """The trace events of the run so far: the latest earlier segment's trace holds every segment's before it."""
  for segment in reversed(plan.segments):
    events = run_dir.read_trace_events(segment.path)
    if events:
      return events
  return []


def _segments_view(plan: RunPlan) -> dict[str, Any]:
  """What a resumed segment's summary says about the run's segments (its own included)."""
  def entry(segment: run_dir.Segment) -> dict[str, Any]:
    return {"segment": segment.index, "summary": str(segment.path / run_dir.SUMMARY),
            "first_step": segment.first_step, "resumed_from_checkpoint": segment.resumed_from}

  earlier = [entry(s) for s in plan.segments if s.path != plan.write_dir]
  return {"segment": len(earlier), "segments": [*earlier, {"segment": len(earlier),
                                                           "summary": str(plan.write_dir / run_dir.SUMMARY)}]}


def report(plan: RunPlan, result, stop: StopSignals) -> int:
  """Process 0's ending of a run that ran to its end or to a stop: the summary, the table and the summary lines;
  a stop says its signal and where to continue. Returns the exit code (0, or the signal's)."""
  out, write_dir = plan.out, plan.write_dir
  run = dict(result.summary.run, run_id=plan.run_id, **(_segments_view(plan) if plan.resumes else {}))
  modes = " → ".join(dict.fromkeys(r.mode for r in result.records))
  plot = plot_rewards(result.records, write_dir / "reward.png", title=f"{out.name}: reward per step ({modes})")
  if plot:
    run["reward_plot"] = str(plot)
  summary = result.summary.replace(run=run)
  stopped = result.ended == "stopped"  # a signal that came after the last step changes nothing
  if stopped:
    # In a job of several processes the signal may have reached another process: the program agreed on it.
    received = stop.stopped_by(result.stop_reason)
    summary = summary.replace(ended="signal", run=dict(run, signal=received.name,
                                                       resume_command=f"run_rl --resume {out}"))
  run_dir.write_summary(write_dir, summary.to_json())
  print(format_table(result.records))
  print()
  print(format_summary(summary))
  if not stopped:
    if result.checkpoint_path:
      print(f"final weights: checkpoint {result.checkpoint_path} (`run_rl export {out} --out DIR` writes them as a"
            " Hugging Face checkpoint)")
    return 0
  where = (f"checkpoint {result.checkpoint_path}; continue with `run_rl --resume {out}`"
           if result.checkpoint_path else "no checkpoint (this engine cannot write one); it cannot be resumed")
  print(f"run_rl: stopped by {received.name} after step {result.last_step}: {where}", file=sys.stderr)
  return EXIT_CODES[received] if result.checkpoint_path else EXIT_NOTHING_TO_RESUME


def stopped_without_checkpoint(write_dir: Path, error: StoppedWithoutCheckpointError, stop: StopSignals,
                               job) -> int:
  """A stop while the loop waited for rollouts it could not checkpoint without: one line naming the checkpoint
  to resume from, and the signal's exit code; ``EXIT_NOTHING_TO_RESUME`` where there is none. The summary
  says so."""
  received = stop.received or signal.SIGTERM
  if job.is_primary and write_dir is not None:
    run_dir.write_summary(write_dir, {"ended": "signal", "signal": received.name, "checkpoint_path": None,
                                      "error": f"{type(error).__name__}: {error}"})
  print(f"run_rl: {job.label}{error}", file=sys.stderr)  # the error says what stopped it, where, and what is left
  return EXIT_CODES[received] if error.resumable else EXIT_NOTHING_TO_RESUME


def stopped_non_finite(out: Path, write_dir: Path, error: NonFiniteStepError, job) -> int:
  """Step k's loss or gradient norm is not finite: exit 1, one line; records and earlier checkpoints kept (the
  error log and summary go in this segment's ``write_dir``)."""
  resume = ""
  if error.checkpoint_steps is None:
    last = "no checkpoint was written"
  else:
    where = f" ({error.checkpoint_path})" if error.checkpoint_path else ""
    last = f"the last checkpoint is after {error.checkpoint_steps} steps{where}, none of step {error.step} or later"
    resume = f", or `run_rl --resume {out}` from that checkpoint if the cause was transient"
  if job.is_primary:
    (write_dir / run_dir.ERROR_LOG).write_text("".join(traceback.format_exception(error)), encoding="utf-8")
    run_dir.write_summary(write_dir, {"ended": "error", "last_step": error.step, "non_finite_step": error.step,
                                      "error": f"NonFiniteStepError: {error}", "checkpoint_path": error.checkpoint_path})
  print(f"run_rl: {job.label}the run stopped at step {error.step}: loss {error.loss}, gradient norm"
        f" {error.grad_norm} (not finite); records so far are kept in {write_dir / run_dir.RECORDS}; {last};"
        f" lower engine.learning_rate (or set engine.skip_nonfinite_updates=true)"
        f" and start a new run{resume}", file=sys.stderr)
  return 1


def fail(out: Path | None, error: Exception, step: int | None, job) -> int:
  """An unexpected failure: exit 1, one line, the traceback in error.log (process 0), the records kept. In a job
  the other processes were told first (``Job.report_failure``)."""
  where = "during bring-up" if step is None else f"at step {step}"
  if not job.is_primary:  # its log is the launcher's (or the host's) to keep
    traceback.print_exception(error)
    print(f"run_rl: {job.label}the run failed {where}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    return 1
  if out is None:  # no segment of this run's own to write into: an earlier segment's files stay as they were
    traceback.print_exception(error)
    print(f"run_rl: the run failed {where}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    return 1
  log_path = out / run_dir.ERROR_LOG
  log_path.write_text("".join(traceback.format_exception(error)), encoding="utf-8")
  run_dir.write_summary(out, {"ended": "error", "last_step": step, "error": f"{type(error).__name__}: {error}"})
  print(f"run_rl: {job.label}the run failed {where}: {type(error).__name__}: {error}\n"
        f"run_rl: records written so far are kept in {out / run_dir.RECORDS}; traceback in {log_path}",
        file=sys.stderr)
  return 1

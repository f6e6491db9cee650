"""Continuing a run: the checkpoint it resumes from, the segment it writes into, and undoing that segment.

``--resume DIR`` continues from the latest complete checkpoint in a new
segment of the run (``run_dir``), after the checkpoint, the records it covers
and the saved recipe are checked; ``--from-checkpoint N`` continues from an
earlier one, the checkpoints after it moved aside into the segment. A resume
that fails before its first step leaves the run as it was.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import sys
import traceback
from pathlib import Path

from orchestrator.app.plan import RunPlan
from orchestrator.data.packing import validate_payload
from orchestrator.distributed import job as job_lib
from orchestrator.run_files import checkpoint_check, run_dir
from orchestrator.run_files.run_dir import RunDirError


@dataclasses.dataclass(kw_only=True)
class ResumePoint:
  """Where a stopped run continues: a checked checkpoint and the records it covers.

  Attributes:
    checkpoint_step: the checkpoint's step (the steps it covers).
    metadata: its metadata, checked (``checkpoint_check``).
    previous_records: the records of steps 0 to ``checkpoint_step - 1``, from the run's segments.
    restored_record: the last of them when it came from the checkpoint (the run was killed before writing
      it), else None.
    superseded_checkpoints: later checkpoints (``--from-checkpoint``), moved aside when the resume starts.
    earlier_valid: the newest valid checkpoint before this one (what to resume from if this one cannot be
      restored), or None.
  """

  checkpoint_step: int
  metadata: dict
  previous_records: list
  restored_record: dict | None = None
  superseded_checkpoints: list = dataclasses.field(default_factory=list)
  earlier_valid: int | None = None

  @property
  def steps_done(self) -> int:
    return int(self.metadata["step"])


def resume_point(plan: RunPlan, source) -> ResumePoint:
  """The checkpoint a resume continues from, checked, with the records it covers.

  Every checkpoint's metadata is checked (``checkpoint_check``); the latest is
  used unless ``plan.from_checkpoint`` names another. The records of the steps
  it covers must be intact in the run's segments; step ``N - 1``'s, if a kill
  came between the checkpoint and its line, is restored from the checkpoint.

  Raises:
    RunDirError: no complete checkpoint, a bad one (named, with the newest valid one to resume from instead),
      records that do not cover it, or nothing left to run.
  """
  # import here: gRPC and the engines load after setup_host (a refusal loads neither)
  from orchestrator.assembly import batch_shape
  from orchestrator.engine.checkpointing import read_checkpoints  # import here: JAX-side (after setup_host)

  recipe, path, ckpt_dir = plan.recipe, plan.out, plan.checkpoint_dir
  checkpoints = read_checkpoints(ckpt_dir) if ckpt_dir else {}
  if not checkpoints:
    again = (f"start it again with the same --out {path} (it holds only the run's claim, which the new run takes"
             " over)" if run_dir.abandoned_claim(path) is not None
             else "start it again with a new --out (this directory keeps what it recorded)")
    raise RunDirError(f"--resume {path}: no complete checkpoint in {ckpt_dir}; the run ended before its first"
                      f" one, so there is nothing to resume from: {again}")
  vocab_size, _, tokens_per_row = batch_shape(recipe)
  problems = checkpoint_check.problems(
      checkpoints, run_id=plan.run_id, source=source, config_sha256=plan.config_sha256,
      payload_check=functools.partial(validate_payload, tokens_per_row=tokens_per_row, vocab_size=vocab_size))
  problems = {step: checkpoint_check.files_problem(Path(ckpt_dir) / str(step)) or problem  # orbax's files first
              for step, problem in problems.items()}
  valid = sorted(step for step, problem in problems.items() if problem is None)
  instead = (f"resume from checkpoint {valid[-1]}, the newest valid one, with `run_rl --resume {path}"
             f" --from-checkpoint {valid[-1]}` (the checkpoints after it are moved aside, not deleted)" if valid
             else "no checkpoint of the run is valid; start a new run with --out")
  step = max(checkpoints) if plan.from_checkpoint is None else plan.from_checkpoint
  if step not in checkpoints:
    raise RunDirError(f"--from-checkpoint {step}: {ckpt_dir} holds no complete checkpoint {step} (it holds"
                      f" {', '.join(map(str, sorted(checkpoints)))})")
  if problems[step] is not None:
    raise RunDirError(f"--resume {path}: checkpoint {step} in {ckpt_dir} {problems[step]}; {instead}")
  if step >= recipe.steps:
    raise RunDirError(f"--resume {path}: the run already did {step} of {recipe.steps} steps;"
                      f" pass --steps N with N > {step} to extend it")
  metadata = checkpoints[step]
  records = run_dir.run_records(list(plan.segments), step)
  restored = None
  pending = metadata.get("pending_record")
  if len(records) == step - 1 and pending is not None:  # killed between the checkpoint and its record
    restored = dict(pending, restored_from_checkpoint=step)
    records.append(restored)
  if len(records) < step:
    earlier = [s for s in valid if s <= len(records)]
    fix = (f"resume from checkpoint {earlier[-1]} with --from-checkpoint {earlier[-1]}" if earlier
           else "restore the records files, or start a new run with --out")
    raise RunDirError(f"--resume {path}: the run's records end after step {len(records) - 1}, but checkpoint"
                      f" {step} covers steps 0 to {step - 1}; {fix}")
  superseded = sorted(s for s in checkpoints if s > step)
  earlier = [s for s in valid if s < step]
  return ResumePoint(checkpoint_step=step, metadata=metadata, previous_records=records, restored_record=restored,
                     superseded_checkpoints=superseded, earlier_valid=earlier[-1] if earlier else None)


def open_segment(plan: RunPlan, point, job: job_lib.Job) -> tuple[RunPlan, str | None]:
  """Process 0 opens the resume's segment (``run_dir.new_segment``): its records begin with a restored one,
  if any, and the checkpoints after the one resumed from move into it. Every process waits for that. Returns
  the plan writing into the segment and why it could not be opened (None: opened)."""
  opened = {"write_dir": None, "refusal": None}
  if job.is_primary:
    try:
      first_step = point.steps_done - (1 if point.restored_record is not None else 0)
      segment = run_dir.new_segment(plan.out, first_step=first_step, steps=plan.recipe.steps,
                                    resumed_from=point.checkpoint_step)
    except RunDirError as e:
      opened["refusal"] = str(e)
    else:
      if point.restored_record is not None:
        (segment.path / run_dir.RECORDS).write_text(json.dumps(point.restored_record) + "\n", encoding="utf-8")
      if point.superseded_checkpoints:
        _move_aside(plan, point.superseded_checkpoints, segment.path / run_dir.SUPERSEDED_CHECKPOINTS)
      opened["write_dir"] = str(segment.path)
  opened = job.agreement.broadcast("segment", opened)
  write_dir = opened["write_dir"]
  return dataclasses.replace(plan, write_dir=Path(write_dir) if write_dir else None), opened["refusal"]


def _move_aside(plan: RunPlan, steps: list[int], into: Path) -> None:
  """Moves the checkpoints after the one a resume continues from into ``into`` (kept, not deleted): the
  resumed run writes its own checkpoints of those steps."""
  ckpt_dir = Path(plan.checkpoint_dir)
  into.mkdir(parents=True)
  for step in steps:
    shutil.move(str(ckpt_dir / str(step)), str(into / str(step)))
  print(f"run_rl: moved checkpoints {', '.join(map(str, steps))} (after the one resumed from) to {into}",
        file=sys.stderr)


def set_aside_late_checkpoints(point: ResumePoint, held, *, run_id: str, checkpoint_dir: str,
                               segment: Path) -> list[int]:
  """Moves into ``segment`` this run's checkpoints after the one resumed from that were not there when it was
  chosen.

  A trainer served by ``run_rl serve-trainer`` finishes the call it was running
  when its driver died, a checkpoint's save among them, and takes the next
  driver only after that (``remote.server``): a resume that chose its
  checkpoint meanwhile would retrain those steps into a checkpoint of a step
  already held, which the trainer refuses. Such a checkpoint of this run
  (``run_id``) is kept, beside the ones ``--from-checkpoint`` moves aside, and
  goes back if the resume fails before its first step (``withdraw_segment``); a
  later checkpoint of another run stays where it is (the save of its step then
  refuses, naming the directory). ``held``: the complete checkpoints in
  ``checkpoint_dir`` now, step → metadata (``read_checkpoints``). Returns the
  steps moved.
  """
  late = sorted(int(step) for step, metadata in held.items() if step > point.checkpoint_step
                and step not in point.superseded_checkpoints and metadata.get("run_id") == run_id)
  if not late:
    return []
  into = segment / run_dir.SUPERSEDED_CHECKPOINTS
  into.mkdir(exist_ok=True)
  for step in late:
    shutil.move(str(Path(checkpoint_dir) / str(step)), str(into / str(step)))
    point.superseded_checkpoints = sorted([*point.superseded_checkpoints, step])  # each as it moves: see withdraw
  first, last = point.checkpoint_step, late[-1]
  print(f"run_rl: checkpoint{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} of this run appeared in"
        f" {checkpoint_dir} after this resume chose checkpoint {first} (the trainer finished the last driver's"
        f" save after it left); moved to {into}: the run retrains steps {first} to {last - 1} and writes"
        f" checkpoint {last} again", file=sys.stderr)
  return late


def undo_segment(plan: RunPlan, point) -> None:
  """Leaves the run as it was before this resume's segment: the checkpoints it moved aside go back, and the
  segment loses its ``segment.json`` (``run_dir.segments`` then skips it)."""
  aside = plan.write_dir / run_dir.SUPERSEDED_CHECKPOINTS
  for step in point.superseded_checkpoints:
    if (aside / str(step)).exists():  # a move aside that failed part-way left the rest where they were
      shutil.move(str(aside / str(step)), str(Path(plan.checkpoint_dir) / str(step)))
  (plan.write_dir / run_dir.SEGMENT).unlink()


def withdraw_segment(plan: RunPlan, point, error: Exception) -> int:
  """A resume that failed before its first step (its checkpoint could not be restored, or the run not built)
  leaves the run as it was: the checkpoints it moved aside go back, and its segment loses its
  ``segment.json``, so the run's view stays the segment before (``run_dir.segments`` skips it); the traceback
  stays in the segment's ``error.log``. One line, exit 1, naming the checkpoint and the one to try instead."""
  segment = plan.write_dir
  log_path = segment / run_dir.ERROR_LOG
  log_path.write_text("".join(traceback.format_exception(error)), encoding="utf-8")
  undo_segment(plan, point)
  text = " ".join(str(error).split())
  text = text if len(text) <= 300 else text[:300] + "..."
  step = point.checkpoint_step
  instead = (f"; if checkpoint {step} is damaged, resume from checkpoint {point.earlier_valid}, the newest intact"
             f" one before it: `run_rl --resume {plan.out} --from-checkpoint {point.earlier_valid}`"
             if point.earlier_valid is not None else "")
  print(f"run_rl: error: the resume could not restore checkpoint {step} and build the run: {type(error).__name__}:"
        f" {text}; the run is as it was (traceback in {log_path}){instead}", file=sys.stderr, flush=True)
  return 1

"""Starting and resuming a run: the part of ``run_rl`` that owns a run directory, in the order a run takes.

A new run and a resumed one are each first a ``RunPlan`` (``plan``: the
recipe, the run directory, its checkpoint directory, the run's id, whether it
resumes), and ``execute`` runs either. Order of a run, so that bad input is
refused before anything is built or written:

1. the recipe is resolved and validated (``orchestrator.recipe``; a resumed
   run's from its ``config.json``, ``plan.plan_resume``);
2. the job is joined, its processes admitted (the same recipe and version);
3. the checks, agreed by every process (``preflight.checks``): a new run's
   output directory (``run_dir.check_new``), the host core reserved, the
   rollout source opened (a recording is verified and must hold the steps),
   the mesh's devices counted, the checkpoint directory holding no other
   run's checkpoints; a resumed run's checkpoint (``resume.resume_point``);
4. only then is a new run's directory claimed (``config.json``, with the run's
   id) or a resumed run's segment opened, the engine built and the program
   run (``orchestrator.app.run.build_run``), under ``signals.StopSignals``;
5. the run ends in ``outcome``: its report, a stop, a refusal or a failure.

The process that runs, resumes or launches a run holds its directory's lock
(``locks``) from before it reads anything there to its exit.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

from orchestrator import recipe as recipe_lib
from orchestrator.app import inputs, locks, outcome
from orchestrator.app.console import Progress
from orchestrator.app.plan import RunPlan, plan_new_run, plan_resume
from orchestrator.app.preflight import checks
from orchestrator.app.resume import open_segment, undo_segment, withdraw_segment
from orchestrator.app.signals import EXIT_CODES, EXIT_NOTHING_TO_RESUME, StopSignals
from orchestrator.contract import SourceStateError
from orchestrator.data.recording import RecordingError
from orchestrator.distributed import job as job_lib
from orchestrator.distributed.admission import JobMismatchError
from orchestrator.distributed.agreement import AgreementError, ProcessLostError
from orchestrator.distributed.bringup import DistributedError
from orchestrator.distributed.launcher import LocalJob
from orchestrator.loop.program import NonFiniteStepError, StoppedWithoutCheckpointError
from orchestrator.recipe.loading import job_settings
from orchestrator.run_files import run_dir
from orchestrator.run_files.run_dir import RunDirError

# What a user's input can cause before the run starts: one line, exit 2.
REFUSALS = (recipe_lib.RecipeError, RunDirError, RecordingError, SourceStateError)


def start(resolved: recipe_lib.ResolvedRecipe, out: Path | None, *, argv: list[str] | None = None) -> int:
  """A new run of ``resolved`` in ``out`` (default ``runs/<name>-<time>``); returns the exit code.

  With ``distributed.num_processes`` and no identity, starts that many local
  processes running ``argv`` (``orchestrator.distributed.launcher``); with an
  identity, this process joins its job (docs/distributed.md).
  """
  return execute(plan_new_run(resolved, out, argv or ()))


def resume(path: Path, steps: int | None, from_checkpoint: int | None = None) -> int:
  """Continues the run in ``path`` from its latest complete checkpoint (or ``from_checkpoint``); ``steps``
  may extend it. The run directory's lock is taken before anything there is read."""
  try:
    held = locks.lock_run_if_holder(path, flag="--resume")
  except REFUSALS as e:
    return outcome.refuse(e)
  with held:
    try:
      plan = plan_resume(path, steps, from_checkpoint)
    except REFUSALS as e:
      return outcome.refuse(e)
    return execute(plan)


def execute(plan: RunPlan) -> int:
  """Runs ``plan`` (see ``_execute``), releasing the lock a new run took on its directory when it ends."""
  with contextlib.ExitStack() as held:
    return _execute(plan, held)


def _execute(plan: RunPlan, held: contextlib.ExitStack) -> int:
  """Runs ``plan`` in this process, or in the local processes it asks for; returns the exit code.

  The same order for a new run and a resumed one: join the job (exit 1 if that
  fails); its processes compared (one line, exit 2, if their recipes differ);
  the checks, agreed by every process (one line, exit 2, on a refusal); a new
  run claims its directory; process 0 says what runs; the run.
  """
  if plan.recipe.distributed.launches_local:
    return _launch_local(plan, held)
  writes_to: list[Path | None] = [None]  # where a lost peer's summary goes, once this segment has a directory
  try:
    job = _join(plan.recipe, writes_to)
  except DistributedError as e:
    return outcome.refuse(e, code=1)
  try:
    return _in_job(plan, job, held, writes_to)
  except (ProcessLostError, AgreementError) as e:  # an exchange before the run: a process is not there, or elsewhere
    return job.leave_failed(outcome.refuse(f"{job.label}{e}", code=1))
  except Exception as e:  # pylint: disable=broad-except  # not a refusal: the other processes are told first
    job.report_failure(e)
    return job.leave_failed(outcome.fail(None, e, None, job))


def _in_job(plan: RunPlan, job: job_lib.Job, held: contextlib.ExitStack, writes_to: list) -> int:
  """``_execute``'s steps once this process is in its job (alone or one of several)."""
  code = _admit(job, plan.recipe)
  if code is not None:
    return code
  checked, code = _agreed(job, lambda: checks(plan, job, held))
  if code is not None:
    return code
  host, point, source, devices = checked
  plan, refusal = open_segment(plan, point, job) if plan.resumes else _claim(plan, job, held)
  if refusal is not None:
    return outcome.refuse(refusal, job=job)
  writes_to[0] = plan.write_dir
  if job.is_primary:
    print(_opening_line(plan, job, host=host, point=point, devices=devices,
                        sampler=getattr(source, "sampler_where", None)), file=sys.stderr)
  return _run_program(plan, source=source, resume=point, job=job)


def _admit(job: job_lib.Job, recipe) -> int | None:
  """Every process of a job runs the same recipe and version, checked before any device work: None, or the
  exit code — 2 in every process for a difference (they leave the job together), 1 for a process that did
  not come to be compared."""
  try:
    job.admit(job_settings(recipe))
  except JobMismatchError as e:
    return outcome.refuse(e, job=job)
  except (ProcessLostError, AgreementError) as e:  # that process is not at admission: leave without it
    return job.leave_failed(outcome.refuse(f"{job.label}{e}", code=1))
  return None


def _agreed(job, checks):
  """Runs ``checks`` (which may refuse) in every process and exchanges the refusals, so that every process
  goes on or refuses together: ``(what checks returned, None)`` or ``(None, exit code)``."""
  try:
    result, refusal = checks(), None
  except REFUSALS as e:
    result, refusal = None, e
  refusal = job.first_refusal(refusal)
  return (result, None) if refusal is None else (None, outcome.refuse(refusal, job=job))


def _claim(plan: RunPlan, job: job_lib.Job, held: contextlib.ExitStack) -> tuple[RunPlan, str | None]:
  """Process 0 locks a new run's directory (held in ``held``) and claims it (``config.json``); every process
  then takes process 0's run id and directory, since every process writes checkpoints under them. Returns the
  claimed plan and why the claim failed (None: claimed)."""
  claimed = {"run_id": plan.run_id, "out": str(plan.out), "config_sha256": plan.config_sha256, "refusal": None}
  if job.is_primary:
    try:
      held.enter_context(locks.lock_if_holder(plan.out, flag="--out", create=True))
      if plan.recipe.rollouts.record_to:  # the recording directory too, until the run has written it
        held.enter_context(locks.lock_if_holder(Path(plan.recipe.rollouts.record_to), flag="rollouts.record_to",
                                                create=True))
      config, sources = plan.saved
      run_dir.claim_new(plan.out, {"run_id": plan.run_id, "recipe": plan.resolved.path, "config": config,
                                   "sources": sources, "inputs": inputs.fingerprints(plan.recipe)})
    except RunDirError as e:  # another run claimed or holds the directory since the check
      claimed["refusal"] = str(e)
  claimed = job.agreement.broadcast("claim", claimed)
  return (plan.claimed(run_id=claimed["run_id"], out=Path(claimed["out"]), config_sha256=claimed["config_sha256"]),
          claimed["refusal"])


def _opening_line(plan: RunPlan, job: job_lib.Job, *, host: str, point, devices: str,
                  sampler: str | None = None) -> str:
  """What process 0 says before the run: the recipe and where it writes, or where a resumed run continues; the
  devices JAX found; and for a live run where its sampler runs and why."""
  recipe = plan.recipe
  if sampler:
    devices = f"{devices}; sampler: {sampler}"
  if plan.resumes:
    return (f"run_rl: resuming {plan.out} ({recipe.name}, mode {recipe.mode.name}) after step {point.steps_done - 1}"
            f" from checkpoint {point.checkpoint_step}; {recipe.steps - point.steps_done} steps to go; {devices}")
  processes = f"; {job.identity.num_processes} processes" if job.distributed else ""
  return (f"run_rl: recipe {plan.resolved.path} ({recipe.name}){_changed_phrase(plan.resolved)}, mode"
          f" {recipe.mode.name}, model {recipe.model.name}, {recipe.steps} steps ×"
          f" {recipe.batch.micro_batches_per_step} micro-batches; out {plan.out}; cores:"
          f" {host}{processes}; {devices}")


def _changed_phrase(resolved: recipe_lib.ResolvedRecipe) -> str:
  """What the environment and the command line changed of the recipe file, and what they dropped of it."""
  phrase = f" with overrides: {', '.join(resolved.changes)}" if resolved.changes else ""
  return phrase + "".join(f"; {dropped}" for dropped in resolved.dropped)


def _launch_local(plan: RunPlan, held: contextlib.ExitStack) -> int:
  """Starts ``distributed.num_processes`` local processes of this run (``launcher.LocalJob``); a new run's
  directory is checked and locked first (a resumed one was locked before it was read). The launcher holds the
  lock for its processes."""
  if not plan.resumes:
    try:
      run_dir.check_new(plan.out)
      held.enter_context(locks.lock_if_holder(plan.out, flag="--out", create=True))
    except RunDirError as e:
      return outcome.refuse(e)
  recipe, d = plan.recipe, plan.recipe.distributed
  return LocalJob(list(plan.launch_argv), num_processes=d.num_processes,
                  devices_per_process=recipe.mesh.num_devices // d.num_processes, out=plan.out,
                  timeout_s=d.timeout_s).run()


def _join(recipe, writes_to: list) -> job_lib.Job:
  """This process's job: alone, or joined to the one ``recipe.distributed`` names (before JAX starts)."""
  if not recipe.distributed.enabled:
    return job_lib.single()
  return job_lib.join_job(recipe.distributed, on_lost_peer=functools.partial(outcome.end_run_on_lost_peer, writes_to))


def _note_loaded_weights(out: Path, loaded: dict, *, resumed: bool) -> None:
  """A new run records the digests of the weights it loaded in config.json; a resumed one compares its own
  with them and says, in one line, which changed since the run started (its model.checkpoint's are then the
  KL reference's start, not the run's)."""
  if not resumed:
    run_dir.record_in_config(out, "loaded_weights", loaded)
    return
  recorded = run_dir.read_config(out).get("loaded_weights") or {}
  for key, directory in (("weights_digest", "model.checkpoint"), ("reference_weights_digest",
                                                                    "model.reference_checkpoint")):
    if recorded.get(key) and loaded.get(key) and recorded[key] != loaded[key]:
      print(f"run_rl: warning: the weights of {directory}={loaded[directory]} differ from those the run loaded"
            f" at its start ({key} {recorded[key][:12]}… then, {loaded[key][:12]}… now): the run continues from its"
            " checkpoint, but a KL reference taken from them is another model now", file=sys.stderr)


def _run_program(plan: RunPlan, *, source, resume, job: job_lib.Job) -> int:
  """Builds the run and runs it to its end, a stop or a failure; process 0 writes what it ends with."""
  recipe, out, run_id, write_dir = plan.recipe, plan.out, plan.run_id, plan.write_dir
  with StopSignals(out, quiet=not job.is_primary) as stop:  # held to the end: a late Ctrl-C gets no traceback
    handle, code = None, None
    stop.keeps = lambda: "kept" if resume is not None else "after the first step"  # until the run is built
    try:
      # import here: gRPC and the engines load after setup_host (a refusal loads neither)
      from orchestrator.app.run import build_run

      previous_trace = outcome.previous_trace(plan) if resume and job.is_primary else []
      handle = build_run(recipe, out, source=source, run_id=run_id, checkpoint_dir=plan.checkpoint_dir,
                         resume=resume, stop_requested=stop.requested,
                         progress=functools.partial(Progress, recipe.name, total=recipe.steps), job=job,
                         write_dir=write_dir, config_sha256=plan.config_sha256)
      job.current_step = lambda: handle.current_step  # the step a lost peer's line names
      stop.keeps = handle.stop_keeps
      if handle.loaded_weights is not None and job.is_primary:  # the closing lines print it
        _note_loaded_weights(out, handle.loaded_weights, resumed=resume is not None)
      result = handle.run()
    except recipe_lib.RecipeError as e:
      if handle is None and resume is not None and job.is_primary and write_dir is not None:
        undo_segment(plan, resume)  # refused while the run was built: the run stays as it was
      code = outcome.refuse(e)
    except NonFiniteStepError as e:  # the training diverged, the code did not fail: one line, no traceback
      handle.close()  # the progress bar ends first, so the line stands alone (a second close does nothing)
      code = outcome.stopped_non_finite(out, write_dir, e, job)
    except StoppedWithoutCheckpointError as e:  # a stop that came while the sampler held the run: as asked
      if handle is not None:
        handle.close()
      code = outcome.stopped_without_checkpoint(write_dir, e, stop, job)
    except Exception as e:  # pylint: disable=broad-except
      job.report_failure(e)  # where a peer failed or died first, this process ends here, naming it
      if handle is None and resume is not None and job.is_primary and write_dir is not None:
        code = withdraw_segment(plan, resume, e)
      else:
        code = outcome.fail(write_dir, e, None if handle is None else handle.current_step, job)
    finally:
      if handle is not None:
        handle.close()
    if code is not None:
      return job.leave_failed(code)
    if not job.is_primary:
      job.finish(succeeded=True)
      if result.ended != "stopped":
        return 0
      return EXIT_CODES[stop.stopped_by(result.stop_reason)] if result.checkpoint_path else EXIT_NOTHING_TO_RESUME
    if previous_trace:
      run_dir.merge_trace(write_dir, previous_trace, resumed_at=resume.steps_done)
    recorded = True
    try:
      outcome.record_rollouts(recipe, handle.program.source, result, write_dir)
    except (RunDirError, OSError) as e:
      print(f"run_rl: error: the rollouts were not recorded: {e}", file=sys.stderr)
      recorded = False
    code = outcome.report(plan, result, stop)
    code = code if code or recorded else 1
    job.finish(succeeded=True)
    return code

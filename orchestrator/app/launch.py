"""Starting, stopping and resuming a run: the part of ``run_rl`` that owns a run directory.

A new run and a resumed one are each first a ``RunPlan`` (``plan_new_run``,
``plan_resume``: the recipe, the run directory, the run's id, whether it
resumes), and ``execute`` runs either. Order of a run, so that bad input is
refused before anything is built or written:

1. the recipe is resolved and validated (``orchestrator.recipe``; a resumed
   run's from its ``config.json``);
2. a new run's output directory is checked (``run_dir.check_new``), the host
   core reserved; a resumed run's latest complete checkpoint is found;
3. preflight: the rollout source is opened (a recording is verified and must
   hold the steps), the mesh's devices are counted, the checkpoint directory
   must hold no other run's checkpoints;
4. only then is a new run's directory claimed (``config.json``, with the run's
   id), the engine built and the program run.

SIGINT or SIGTERM asks the program to stop at the next boundary: the step in
flight finishes, its update is applied, a checkpoint is written, ``summary.json``
says ``"ended": "signal"``, and the exit code is 130 or 143. A second signal
stops at once. ``--resume DIR`` continues from the latest complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator import recipe as recipe_lib
from orchestrator.app import run_dir
from orchestrator.app.console import format_summary, format_table
from orchestrator.app.host import setup_host
from orchestrator.app.run_dir import RunDirError
from orchestrator.data.recording import RecordingError, write_recording
from orchestrator.contract import SourceStateError, live_part
from orchestrator.distributed import job as job_lib
from orchestrator.distributed.admission import JobMismatchError
from orchestrator.distributed.agreement import AgreementError, ProcessLostError
from orchestrator.distributed.bringup import DistributedError
from orchestrator.distributed.launcher import LAUNCHED_ENV, LocalJob, resume_hint
from orchestrator.engine.presets import load_preset
from orchestrator.live.plot import plot_rewards
from orchestrator.loop.program import NonFiniteStepError
from orchestrator.recipe.loading import job_settings
from orchestrator.remote import protocol

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
# What a user's input can cause before the run starts: one line, exit 2.
REFUSALS = (recipe_lib.RecipeError, RunDirError, RecordingError, SourceStateError)


class StopSignals:
  """First SIGINT/SIGTERM: stop at the next boundary. Second: stop at once, with one line."""

  def __init__(self, out: Path, *, quiet: bool = False):
    self.out, self.quiet = out, quiet
    self.received: signal.Signals | None = None
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> "StopSignals":
    for sig in EXIT_CODES:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _handle(self, signum: int, frame) -> None:
    del frame
    sig = signal.Signals(signum)
    if self.received is None:
      self.received = sig
      if self.quiet:  # another process of the job tells the terminal
        return
      print(f"\nrun_rl: {sig.name} received: stopping after the step in flight (its update applied and"
            f" checkpointed); {sig.name} again stops at once", file=sys.stderr, flush=True)
      return
    print(f"run_rl: second {sig.name}: stopped at once; {resume_hint(self.out)}", file=sys.stderr, flush=True)
    os._exit(EXIT_CODES.get(sig, 130))

  def requested(self) -> str | None:
    """The signal's name once one came (truthy), else None; the program stops at the next boundary."""
    return self.received.name if self.received is not None else None


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """One run as decided before anything starts: what it trains, where, and whether it continues a run.

  Attributes:
    resolved: the recipe, with each key's source and the recipe file it came from.
    out: the run directory: a new run claims it, a resumed run continues the run in it.
    run_id: the run's id: a new one, or the resumed run's (checkpoints of other runs are refused).
    resumes: continue the run in ``out`` from its latest complete checkpoint instead of starting one.
    launch_argv: the ``run_rl`` arguments of each local process when the recipe asks for
      ``distributed.num_processes`` processes on this host (the run's directory pinned).
  """

  resolved: recipe_lib.ResolvedRecipe
  out: Path
  run_id: str
  resumes: bool
  launch_argv: tuple[str, ...]

  @property
  def recipe(self) -> recipe_lib.Recipe:
    return self.resolved.recipe


def plan_new_run(resolved: recipe_lib.ResolvedRecipe, out: Path | None, argv: Sequence[str] = ()) -> RunPlan:
  """A new run of ``resolved`` in ``out`` (default ``run.out``, else ``runs/<name>-<time>``) with a new id; local
  processes are started with ``argv``. Writes nothing."""
  recipe = resolved.recipe
  out = out or (Path(recipe.run.out) if recipe.run.out else run_dir.default_out(recipe.name))
  return RunPlan(resolved, out, run_id=run_dir.new_run_id(), resumes=False, launch_argv=(*argv, f"run.out={out}"))


def plan_resume(path: Path, steps: int | None) -> RunPlan:
  """Continuing the run in ``path`` as it was configured, ``steps`` extending it if given. Writes nothing.

  Raises:
    RunDirError / RecipeError: no run there, or its config.json no longer makes a valid recipe.
  """
  config = run_dir.read_config(path)
  resolved = resolved_from_saved(config, steps)
  return RunPlan(resolved, path, run_id=config["run_id"], resumes=True,
                 launch_argv=("--resume", str(path), *([f"--steps={steps}"] if steps else [])))


def resolved_from_saved(config: dict, steps: int | None) -> recipe_lib.ResolvedRecipe:
  """The recipe a run directory's config.json describes, with ``steps`` extended if given."""
  values = recipe_lib.flatten(config["config"], where="config.json")
  if steps is not None:
    values["steps"] = steps
  for name, key in recipe_lib.ENV_SWITCHES.items():  # a process's identity is never saved: it comes anew
    if key in recipe_lib.PROCESS_IDENTITY_KEYS and os.environ.get(name):
      values[key] = os.environ[name]
  recipe = build_checked(values)
  sources = dict(config.get("sources", {}))
  if steps is not None:
    sources["steps"] = "flag --steps (resume)"
  return recipe_lib.ResolvedRecipe(recipe, sources, str(config.get("recipe")))


def build_checked(values: dict):
  """A recipe from saved values (plus an identity from the environment), validated."""
  recipe = recipe_lib.build({k: recipe_lib.coerce(k, v) for k, v in values.items()})
  recipe.validate()
  return recipe


def start(resolved: recipe_lib.ResolvedRecipe, out: Path | None, *, argv: list[str] | None = None) -> int:
  """A new run of ``resolved`` in ``out`` (default ``runs/<name>-<time>``); returns the exit code.

  With ``distributed.num_processes`` and no identity, starts that many local
  processes running ``argv`` (``orchestrator.distributed.launcher``); with an
  identity, this process joins its job (docs/design.md §12).
  """
  return execute(plan_new_run(resolved, out, argv or ()))


def resume(path: Path, steps: int | None) -> int:
  """Continues the run in ``path`` from its latest complete checkpoint; ``steps`` may extend it."""
  try:
    plan = plan_resume(path, steps)
  except REFUSALS as e:
    return _refuse(e)
  return execute(plan)


def execute(plan: RunPlan) -> int:
  """Runs ``plan`` in this process, or in the local processes it asks for; returns the exit code.

  The same order for a new run and a resumed one: join the job (exit 1 if that
  fails); its processes compared (one line, exit 2, if their recipes differ);
  the checks, agreed by every process (one line, exit 2, on a refusal); a new
  run claims its directory; process 0 says what runs; the run.
  """
  if plan.recipe.distributed.launches_local:
    return _launch_local(plan)
  try:
    job = _join(plan.recipe, plan.out)
  except DistributedError as e:
    return _refuse(e, code=1)
  code = _admit(job, plan.recipe)
  if code is not None:
    return code
  checked, code = _agreed(job, lambda: _checks(plan, job))
  if code is not None:
    return code
  host, point, source = checked
  if not plan.resumes:
    plan, refusal = _claim(plan, job)
    if refusal is not None:
      return _refuse(refusal, job=job)
  if job.is_primary:
    print(_opening_line(plan, job, host=host, point=point), file=sys.stderr)
  return _run_program(plan, source=source, resume=point, job=job)


def _admit(job: job_lib.Job, recipe) -> int | None:
  """Every process of a job runs the same recipe and version, checked before any device work: None, or the
  exit code — 2 in every process for a difference (they leave the job together), 1 for a process that did
  not come to be compared."""
  try:
    job.admit(job_settings(recipe))
  except JobMismatchError as e:
    return _refuse(e, job=job)
  except (ProcessLostError, AgreementError) as e:  # that process is not at admission: leave without it
    job.finish(succeeded=False)
    return _refuse(f"{job.label}{e}", code=1)
  return None


def _checks(plan: RunPlan, job: job_lib.Job):
  """Everything that may refuse the run, in order: a new run's directory (process 0), the host settings, a
  resumed run's checkpoint, the preflight. Returns (host core reserved, resume point or None, rollout source)."""
  recipe = plan.recipe
  if not plan.resumes and job.is_primary:  # process 0 owns the run directory
    _check_new_out(plan)
  host = setup_host(recipe, distributed=job.distributed)
  point = resume_point(recipe, plan.out, plan.run_id, primary=job.is_primary) if plan.resumes else None
  source = preflight(recipe, plan.out, run_id=plan.run_id, steps=recipe.steps if plan.resumes else None,
                     distributed=job.distributed, primary=job.is_primary)
  return host, point, source


def _check_new_out(plan: RunPlan) -> None:
  """A new run's directory must hold no run, and its ``rollouts.record_to`` must not exist yet."""
  run_dir.check_new(plan.out)
  record_to = plan.recipe.rollouts.record_to
  if record_to and Path(record_to).exists():
    raise RunDirError(f"rollouts.record_to={record_to} already exists; recordings are read-only, choose a new"
                      " directory")


def preflight(recipe, out: Path, *, run_id: str | None, steps: int | None = None, distributed: bool = False,
              primary: bool = True):
  """Everything that can refuse the run before it writes: the source, the devices, the checkpoints.

  In a job of several processes every process opens its source and counts the
  job's devices; process 0 (``primary``) checks the checkpoint directory.
  Returns the rollout source. Raises RecipeError / RecordingError / RunDirError (exit 2).
  """
  # import here: gRPC and the engines load after setup_host (a refusal loads neither)
  from orchestrator.app.runner import checkpoint_dir_for, rollout_source
  from orchestrator.engine.checkpointing import read_checkpoints  # import here: JAX-side (after setup_host)

  source = rollout_source(recipe, steps=steps)
  remote = recipe.trainer.location == "remote"
  if not remote:  # a remote trainer checks its own devices
    _check_devices(recipe, distributed)
  else:
    _check_trainer_token(recipe)
  ckpt_dir = checkpoint_dir_for(recipe, out) if not remote or recipe.trainer.spawn else None
  if ckpt_dir and primary:
    foreign = {step: meta.get("run_id") for step, meta in read_checkpoints(ckpt_dir).items()
               if meta.get("run_id") != run_id or run_id is None}
    if foreign:
      raise RunDirError(
          f"checkpoint directory {ckpt_dir} holds checkpoints of another run (steps {sorted(foreign)}, run"
          f" {sorted(set(map(str, foreign.values())))[0]}); use a new checkpoint.directory, or continue that"
          " run with `run_rl --resume` on its run directory")
  return source


def _check_devices(recipe, distributed: bool) -> None:
  """The mesh needs its devices; in a job of several processes it must cover every device of the job."""
  from orchestrator.engine.mesh import check_devices  # import here: JAX-side (after setup_host)

  try:
    check_devices(recipe.mesh)
  except ValueError as e:
    raise recipe_lib.RecipeError(str(e)) from None
  if distributed:
    import jax  # import here: JAX-side (after setup_host)

    total, local = jax.device_count(), jax.local_device_count()
    if total != recipe.mesh.num_devices:
      raise recipe_lib.RecipeError(
          f"the mesh {recipe.mesh.fsdp}×{recipe.mesh.context}×{recipe.mesh.expert} (fsdp×context×expert) has"
          f" {recipe.mesh.num_devices} devices but the job has {total} ({jax.process_count()} processes ×"
          f" {local}); size the mesh to the job's devices")


def _check_trainer_token(recipe) -> None:
  """A remote trainer off loopback is reached with a token: one must be readable before anything starts."""
  t = recipe.trainer
  try:
    token = protocol.read_token(t.token_file)
  except protocol.AddressError as e:
    raise recipe_lib.RecipeError(f"trainer.token_file: {e}") from None
  if not t.spawn and token is None and not protocol.is_loopback(protocol.split_address(t.address)[0]):
    raise recipe_lib.RecipeError(
        f"trainer.address={t.address} is not loopback and no token is set; give the server's token with"
        f" trainer.token_file=FILE or ${protocol.TOKEN_ENV}")


def resume_point(recipe, path: Path, run_id: str, *, primary: bool = True):
  """The latest complete checkpoint of run ``run_id`` and the records it covers.

  Raises:
    RunDirError: no complete checkpoint, one of another run, or nothing left to run.
  """
  # import here: gRPC and the engines load after setup_host (a refusal loads neither)
  from orchestrator.app.runner import ResumePoint, checkpoint_dir_for
  from orchestrator.engine.checkpointing import read_checkpoints  # import here: JAX-side (after setup_host)

  ckpt_dir = checkpoint_dir_for(recipe, path)
  checkpoints = read_checkpoints(ckpt_dir) if ckpt_dir else {}
  if not checkpoints:
    raise RunDirError(f"--resume {path}: no complete checkpoint in {ckpt_dir}; nothing to resume from"
                      " (start a new run with --out)")
  step = max(checkpoints)
  metadata = checkpoints[step]
  if metadata.get("run_id") != run_id:
    raise RunDirError(f"--resume {path}: checkpoint {step} in {ckpt_dir} belongs to another run"
                      f" ({metadata.get('run_id')!r}, not {run_id!r}); it cannot continue this one")
  if "policy_state" not in metadata or "source_state" not in metadata:
    raise RunDirError(f"--resume {path}: checkpoint {step} holds no run state (written by an older version)")
  done = int(metadata["step"])
  if done >= recipe.steps:
    raise RunDirError(f"--resume {path}: the run already did {done} of {recipe.steps} steps;"
                      f" pass --steps N with N > {done} to extend it")
  if not primary:  # process 0 cuts records.jsonl; the others only read what the checkpoint covers
    return ResumePoint(step, metadata, run_dir.read_records(path, int(metadata["records_count"])))
  kept = run_dir.keep_records(path, int(metadata["records_count"]))
  if len(kept) < int(metadata["records_count"]):
    logging.getLogger("step_boundary.run").warning(
        "run_rl: records.jsonl holds %d of the %d records checkpoint %d covers (the run was killed between"
        " the checkpoint and its record); the missing step's record is lost", len(kept),
        metadata["records_count"], step)
  return ResumePoint(step, metadata, kept)


def _agreed(job, checks):
  """Runs ``checks`` (which may refuse) in every process and exchanges the refusals, so that every process
  goes on or refuses together: ``(what checks returned, None)`` or ``(None, exit code)``."""
  try:
    result, refusal = checks(), None
  except REFUSALS as e:
    result, refusal = None, e
  refusal = job.first_refusal(refusal)
  return (result, None) if refusal is None else (None, _refuse(refusal, job=job))


def _claim(plan: RunPlan, job: job_lib.Job) -> tuple[RunPlan, str | None]:
  """Process 0 claims a new run's directory (``config.json``); every process then takes process 0's run id and
  directory, since every process writes checkpoints under them. Returns the claimed plan and why the claim
  failed (None: claimed)."""
  claimed = {"run_id": plan.run_id, "out": str(plan.out), "refusal": None}
  if job.is_primary:
    try:
      run_dir.claim_new(plan.out, {"run_id": plan.run_id, "recipe": plan.resolved.path,
                                   "config": recipe_lib.run_config_dict(plan.recipe), "sources": plan.resolved.sources})
    except RunDirError as e:  # another run claimed the directory between the check and now
      claimed["refusal"] = str(e)
  claimed = job.agreement.broadcast("claim", claimed)
  return dataclasses.replace(plan, run_id=claimed["run_id"], out=Path(claimed["out"])), claimed["refusal"]


def _opening_line(plan: RunPlan, job: job_lib.Job, *, host: str, point) -> str:
  """What process 0 says before the run: the recipe and where it writes, or where a resumed run continues."""
  recipe = plan.recipe
  if plan.resumes:
    return (f"run_rl: resuming {plan.out} ({recipe.name}, mode {recipe.mode.name}) after step {point.steps_done - 1}"
            f" from checkpoint {point.checkpoint_step}; {recipe.steps - point.steps_done} steps to go")
  processes = f"; {job.identity.num_processes} processes" if job.distributed else ""
  return (f"run_rl: recipe {plan.resolved.path} ({recipe.name}), mode {recipe.mode.name}, model {recipe.model},"
          f" {recipe.steps} steps × {recipe.batch.micro_batches_per_step} micro-batches; out {plan.out};"
          f" host core reserved: {host}{processes}")


def _launch_local(plan: RunPlan) -> int:
  """Starts ``distributed.num_processes`` local processes of this run (``launcher.LocalJob``); a new run's
  directory is checked first."""
  if not plan.resumes:
    try:
      run_dir.check_new(plan.out)
    except RunDirError as e:
      return _refuse(e)
  recipe, d = plan.recipe, plan.recipe.distributed
  return LocalJob(list(plan.launch_argv), num_processes=d.num_processes,
                  devices_per_process=recipe.mesh.num_devices // d.num_processes, out=plan.out,
                  timeout_s=d.timeout_s).run()


def _end_run_on_lost_peer(out: Path, job: job_lib.Job, line: str) -> None:
  """What a process of a run does when the watchdog reports a lost peer: one line, the summary (process 0),
  exit 1."""
  step = job.current_step()
  where = "during bring-up" if step is None else f"at step {step}"
  kept = ""
  if job.is_primary and (out / run_dir.CONFIG).is_file():
    run_dir.write_summary(out, {"ended": "error", "last_step": step, "error": line})
    kept = f"; records so far are kept in {out / run_dir.RECORDS}"
  if os.environ.get(LAUNCHED_ENV) != "1":  # else the launcher says it, once, with how the process ended
    print(f"run_rl: {job.label}{line} {where}; ending this process{kept}", file=sys.stderr, flush=True)
  os._exit(1)


def _join(recipe, out: Path) -> job_lib.Job:
  """This process's job: alone, or joined to the one ``recipe.distributed`` names (before JAX starts)."""
  if not recipe.distributed.enabled:
    return job_lib.single()
  return job_lib.join_job(recipe.distributed, on_lost_peer=functools.partial(_end_run_on_lost_peer, out))


def _refuse(e: Exception | str, *, job=None, code: int = 2) -> int:
  """One line, exit 2 (nothing was started or written). In a job every process refuses together; process 0
  says why on the run's terminal and the others in their logs."""
  print(f"run_rl: error: {e}", file=sys.stderr, flush=True)
  if job is not None:
    job.finish(succeeded=True)
  return code


def _run_program(plan: RunPlan, *, source, resume, job: job_lib.Job) -> int:
  """Builds the run and runs it to its end, a stop or a failure; process 0 writes what it ends with."""
  recipe, out, run_id = plan.recipe, plan.out, plan.run_id
  with StopSignals(out, quiet=not job.is_primary) as stop:  # held to the end: a late Ctrl-C gets no traceback
    handle, code = None, None
    try:
      # import here: gRPC and the engines load after setup_host (a refusal loads neither)
      from orchestrator.app.runner import build_run

      previous_trace = run_dir.read_trace_events(out) if resume and job.is_primary else []
      handle = build_run(recipe, out, source=source, run_id=run_id, resume=resume, stop_requested=stop.requested,
                         job=job)
      job.current_step = lambda: handle.current_step  # the step a lost peer's line names
      result = handle.run()
    except recipe_lib.RecipeError as e:
      code = _refuse(e)
    except NonFiniteStepError as e:  # the training diverged, the code did not fail: one line, no traceback
      handle.close()  # the progress bar ends first, so the line stands alone (a second close does nothing)
      code = _stopped_non_finite(out, e, job)
    except Exception as e:  # pylint: disable=broad-except
      if job.watchdog is not None:  # a collective failed because a peer died? Then the watchdog names it.
        job.watchdog.wait_for_loss()
      code = _fail(out, e, None if handle is None else handle.current_step, job)
    finally:
      if handle is not None:
        handle.close()
    if code is not None:
      job.finish(succeeded=False)
      return code
    if not job.is_primary:
      job.finish(succeeded=True)
      return EXIT_CODES[stop.received or _signal_named(result.stop_reason)] if result.ended == "stopped" else 0
    if previous_trace:
      run_dir.merge_trace(out, previous_trace, resumed_at=resume.steps_done)
    _write_recording(recipe, handle.program.source, result)
    code = _report(out, result, run_id, stop)
    job.finish(succeeded=True)
    return code


def _write_recording(recipe, source, result) -> None:
  """A live run with ``rollouts.record_to`` writes what it trained on, replayable as a recording."""
  record_to = recipe.rollouts.record_to
  live = live_part(source)
  recorded = live.recorded_steps() if live is not None else None
  if not record_to or recorded is None:
    return
  from orchestrator.live.rollouts import recorded_groups  # import here: JAX-side (after setup_host)

  manifest = write_recording(Path(record_to), recorded_groups(recorded, recipe.rollouts.generations_per_group),
                             vocab_size=load_preset(recipe.model).vocab_size,
                             produced_by={"tool": "run_rl (live loop)", "recipe": recipe.name,
                                          "task": dataclasses.asdict(recipe.task), "steps": result.last_step + 1})
  result.summary = result.summary.replace(
      run=dict(result.summary.run, recording={"path": record_to, "groups": manifest["num_groups"]}))
  print(f"run_rl: wrote the {manifest['num_groups']} groups this run trained on to {record_to}"
        f" (replay them with rollouts.source=recording rollouts.recording={record_to})", file=sys.stderr)


def _report(out: Path, result, run_id: str, stop: StopSignals) -> int:
  run = dict(result.summary.run, run_id=run_id)
  modes = " → ".join(dict.fromkeys(r.mode for r in result.records))
  plot = plot_rewards(result.records, out / "reward.png", title=f"{out.name}: reward per step ({modes})")
  if plot:
    run["reward_plot"] = str(plot)
  summary = result.summary.replace(run=run)
  stopped = result.ended == "stopped"  # a signal that came after the last step changes nothing
  if stopped:
    # In a job of several processes the signal may have reached another process: the program agreed on it.
    received = stop.received or _signal_named(result.stop_reason)
    summary = summary.replace(ended="signal", run=dict(run, signal=received.name,
                                                       resume_command=f"run_rl --resume {out}"))
  run_dir.write_summary(out, summary.to_json())
  print(format_table(result.records))
  print()
  print(format_summary(summary))
  if not stopped:
    return 0
  where = (f"checkpoint {result.checkpoint_path}; continue with `run_rl --resume {out}`"
           if result.checkpoint_path else "no checkpoint (this engine cannot write one); it cannot be resumed")
  print(f"run_rl: stopped by {received.name} after step {result.last_step}: {where}", file=sys.stderr)
  return EXIT_CODES[received]


def _signal_named(name: str | None) -> signal.Signals:
  try:
    return signal.Signals[name]
  except KeyError:
    return signal.SIGTERM  # a stop asked for by other means ends like a polite termination


def _stopped_non_finite(out: Path, error: NonFiniteStepError, job) -> int:
  """Step k's loss or gradient norm is not finite: exit 1, one line; records and earlier checkpoints kept."""
  resume = ""
  if error.checkpoint_steps is None:
    last = "no checkpoint was written"
  else:
    where = f" ({error.checkpoint_path})" if error.checkpoint_path else ""
    last = f"the last checkpoint is after {error.checkpoint_steps} steps{where}, none of step {error.step} or later"
    resume = f", or `run_rl --resume {out}` from that checkpoint if the cause was transient"
  if job.is_primary:
    (out / run_dir.ERROR_LOG).write_text("".join(traceback.format_exception(error)), encoding="utf-8")
    run_dir.write_summary(out, {"ended": "error", "last_step": error.step, "error": f"NonFiniteStepError: {error}",
                                "checkpoint_path": error.checkpoint_path})
  print(f"run_rl: {job.label}the run stopped at step {error.step}: loss {error.loss}, gradient norm"
        f" {error.grad_norm} (not finite); records so far are kept in {out / run_dir.RECORDS}; {last};"
        f" lower engine.learning_rate (or set engine.skip_nonfinite_updates=true)"
        f" and start a new run{resume}", file=sys.stderr)
  return 1


def _fail(out: Path, error: Exception, step: int | None, job) -> int:
  """An unexpected failure: exit 1, one line, the traceback in error.log (process 0), the records kept."""
  where = "during bring-up" if step is None else f"at step {step}"
  if not job.is_primary:  # its log is the launcher's (or the host's) to keep
    traceback.print_exception(error)
    print(f"run_rl: {job.label}the run failed {where}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    return 1
  log_path = out / run_dir.ERROR_LOG
  log_path.write_text("".join(traceback.format_exception(error)), encoding="utf-8")
  run_dir.write_summary(out, {"ended": "error", "last_step": step, "error": f"{type(error).__name__}: {error}"})
  print(f"run_rl: {job.label}the run failed {where}: {type(error).__name__}: {error}\n"
        f"run_rl: records written so far are kept in {out / run_dir.RECORDS}; traceback in {log_path}",
        file=sys.stderr)
  return 1

"""Starting, stopping and resuming a run: the part of ``run_rl`` that owns a run directory.

A new run and a resumed one are each first a ``RunPlan`` (``plan_new_run``,
``plan_resume``: the recipe, the run directory, its checkpoint directory, the
run's id, whether it resumes), and ``execute`` runs either. Order of a run, so that bad input is
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

The process that runs, resumes or launches a run holds its directory's lock
(``run_dir.lock``) from before it reads anything there to its exit; a second
one is refused naming the holder.

SIGINT or SIGTERM asks the program to stop at the next boundary: the step in
flight finishes, its update is applied, a checkpoint is written, ``summary.json``
says ``"ended": "signal"``, and the exit code is 130 or 143. Signals within
``SIGNAL_WINDOW_S`` of the first are the same stop (a wrapper that forwards the
terminal's signal delivers it twice); a later one stops at once. ``--resume DIR``
continues from the latest complete checkpoint in a new segment of the run
(``run_dir``), after the checkpoint, the records it covers and the saved recipe
are checked; ``--from-checkpoint N`` continues from an earlier one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator import recipe as recipe_lib
from orchestrator.app import checkpoint_check, inputs, run_dir
from orchestrator.app.console import Progress, format_summary, format_table
from orchestrator.app.host import setup_host
from orchestrator.app.run_dir import RunDirError
from orchestrator.data.packing import validate_payload
from orchestrator.data.recording import RecordingError, write_recording
from orchestrator.contract import SourceStateError, live_part
from orchestrator.distributed import job as job_lib
from orchestrator.distributed.admission import JobMismatchError
from orchestrator.distributed.agreement import AgreementError, ProcessLostError
from orchestrator.distributed.bringup import DistributedError
from orchestrator.distributed.launcher import LAUNCHED_ENV, LocalJob, resume_hint
from orchestrator.engine.options import CHECKPOINTING_BACKENDS
from orchestrator.live.plot import plot_rewards
from orchestrator.loop.program import NonFiniteStepError, StoppedWithoutCheckpointError
from orchestrator.recipe.loading import PROCESS_ID_ENV, job_settings
from orchestrator.remote import protocol

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
# Signals this soon after the first are that one stop: `timeout` at a terminal, or any wrapper that forwards
# the terminal's SIGINT, delivers one Ctrl-C to the process group and again to its child.
SIGNAL_WINDOW_S = 1.0
# What a user's input can cause before the run starts: one line, exit 2.
REFUSALS = (recipe_lib.RecipeError, RunDirError, RecordingError, SourceStateError)


class StopSignals:
  """First SIGINT/SIGTERM: stop at the next boundary. Another within ``SIGNAL_WINDOW_S``: the same stop.
  One after that: stop at once, with one line."""

  def __init__(self, out: Path, *, quiet: bool = False):
    self.out, self.quiet = out, quiet
    self.received: signal.Signals | None = None
    self._first_at = 0.0
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
    now = time.monotonic()
    if self.received is not None and now - self._first_at < SIGNAL_WINDOW_S:
      return  # the same stop delivered twice (to the process group and again to this process)
    if self.received is None:
      self.received, self._first_at = sig, now
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


def checkpoint_dir_for(recipe: recipe_lib.Recipe, out: Path) -> str | None:
  """Where the run in ``out`` keeps its checkpoints: the recipe's directory, else ``OUT/checkpoints``; None for
  a backend that cannot checkpoint."""
  if recipe.engine.backend not in CHECKPOINTING_BACKENDS:
    return None
  return str(Path(recipe.checkpoint.directory or out / run_dir.CHECKPOINTS).absolute())


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """One run as decided before anything starts: what it trains, where, and whether it continues a run.

  Attributes:
    resolved: the recipe, with each key's source and the recipe file it came from.
    out: the run directory: a new run claims it, a resumed run continues the run in it.
    run_id: the run's id: a new one, or the resumed run's (checkpoints of other runs are refused).
    resumes: continue the run in ``out`` from a checkpoint instead of starting one.
    launch_argv: the ``run_rl`` arguments of each local process when the recipe asks for
      ``distributed.num_processes`` processes on this host (the run's directory pinned).
    checkpoint_dir: where the run's checkpoints are (``checkpoint_dir_for``; None: its engine writes none).
    segments: a resumed run's segments so far (``run_dir.segments``).
    from_checkpoint: the checkpoint to resume from (None: the latest).
    write_dir: where this segment writes its records, summary and trace: ``out`` for a new run, the new
      segment's directory for a resume (set once the resume is checked).
    config_sha256: the digest of the recipe as config.json holds it (as read now, for a resume); every
      checkpoint carries it.
    saved: a new run's config.json recipe and sources (``recipe_lib.saved_config``: the derived sizes' values).
  """

  resolved: recipe_lib.ResolvedRecipe
  out: Path
  run_id: str
  resumes: bool
  launch_argv: tuple[str, ...]
  checkpoint_dir: str | None
  segments: tuple[run_dir.Segment, ...] = ()
  from_checkpoint: int | None = None
  write_dir: Path | None = None
  config_sha256: str | None = None
  saved: tuple[dict[str, Any], dict[str, str]] | None = None

  @property
  def recipe(self) -> recipe_lib.Recipe:
    return self.resolved.recipe

  def claimed(self, *, run_id: str, out: Path, config_sha256: str | None) -> RunPlan:
    """This new run as process 0 claimed it: its id and directory (the same here, unless another process of the
    job chose another directory), where this run then writes."""
    checkpoint_dir = self.checkpoint_dir if out == self.out else checkpoint_dir_for(self.recipe, out)
    return dataclasses.replace(self, run_id=run_id, out=out, write_dir=out, config_sha256=config_sha256,
                               checkpoint_dir=checkpoint_dir)


def plan_new_run(resolved: recipe_lib.ResolvedRecipe, out: Path | None, argv: Sequence[str] = ()) -> RunPlan:
  """A new run of ``resolved`` in ``out`` (default ``run.out``, else ``runs/<name>-<time>``) with a new id; local
  processes are started with ``argv``. Writes nothing."""
  recipe = resolved.recipe
  out = out or (Path(recipe.run.out) if recipe.run.out else run_dir.default_out(recipe.name))
  saved = recipe_lib.saved_config(resolved)
  return RunPlan(resolved, out, run_id=run_dir.new_run_id(), resumes=False, launch_argv=(*argv, f"run.out={out}"),
                 checkpoint_dir=checkpoint_dir_for(recipe, out), write_dir=out,
                 config_sha256=run_dir.recipe_sha256(saved[0]), saved=saved)


def plan_resume(path: Path, steps: int | None, from_checkpoint: int | None = None) -> RunPlan:
  """Continuing the run in ``path`` as it was configured, ``steps`` extending it if given (else the length its
  latest segment ran to). Writes nothing.

  Raises:
    RunDirError / RecipeError: no run there, its config.json was edited or no longer makes a valid recipe.
  """
  config = run_dir.read_config(path)
  run_dir.check_layout(path, flag="--resume")
  run_dir.check_writable_dirs(path, flag="--resume", names=(run_dir.CHECKPOINTS,))  # the resume writes there
  edited = run_dir.edited_keys(config)
  if edited:
    raise RunDirError(
        f"--resume {path}: {path / run_dir.CONFIG} was edited after the run wrote it ({', '.join(edited)});"
        " a resume runs the recipe the run started with: restore the file (only --steps may change, on the"
        " command line), or start a new run with the new recipe")
  if edited is None:
    logging.getLogger("step_boundary.run").warning(
        "run_rl: %s carries no recipe digest (written by an older version); it is resumed as it reads",
        path / run_dir.CONFIG)
  segs = tuple(run_dir.segments(path, config))
  resolved = resolved_from_saved(config, steps, saved_steps=segs[-1].steps)
  changed = inputs.changed(config.get("inputs"), resolved.recipe) or _derived_otherwise(config, resolved.recipe)
  if changed:
    raise RunDirError(f"--resume {path}: {changed[0]}; a resume reads what the run read (its prompts, tokenizer"
                      " and rollouts would differ): restore it, or start a new run")
  argv = ("--resume", str(path), *([f"--steps={steps}"] if steps else []),
          *([f"--from-checkpoint={from_checkpoint}"] if from_checkpoint is not None else []))
  return RunPlan(resolved, path, run_id=config["run_id"], resumes=True, launch_argv=argv,
                 checkpoint_dir=checkpoint_dir_for(resolved.recipe, path), segments=segs,
                 from_checkpoint=from_checkpoint, config_sha256=run_dir.recipe_sha256(config["config"]))


def _derived_otherwise(config: dict, recipe) -> list[str]:
  """Each size the run derived at its start (config.json records the value) that derives otherwise now, in words."""
  saved = recipe_lib.flatten(config["config"], where="config.json")
  sources = config.get("sources") or {}
  return [f"{key} was {saved.get(key)} at the run's start ({sources[key]}), now {value}"
          for key, (value, _) in recipe.derived_sizes().items()
          if str(sources.get(key, "")).startswith(recipe_lib.DERIVED) and saved.get(key) != value]


def resolved_from_saved(config: dict, steps: int | None, *, saved_steps: int | None = None
                        ) -> recipe_lib.ResolvedRecipe:
  """The recipe a run directory's config.json describes, run to ``steps`` if given, else to ``saved_steps``
  (the length the latest segment ran to). A size the run derived (config.json records its value) is left
  unset, to be derived as the run derived it; a file the run read is the one it read, by the absolute path
  config.json records (a relative one named the working directory's)."""
  values = recipe_lib.flatten(config["config"], where="config.json")
  sources = dict(config.get("sources") or {})
  for key, source in sources.items():
    if str(source).startswith(recipe_lib.DERIVED) and key in values:
      values[key] = None
  for key, path in inputs.recorded_paths(config.get("inputs")).items():
    if key in values and values[key] != path:
      values[key], sources[key] = path, f"{sources.get(key, 'recipe')}, as the run resolved it"
  steps_source = "flag --steps (resume)"
  if steps is None and saved_steps is not None and saved_steps != values.get("steps"):
    steps, steps_source = saved_steps, "flag --steps (an earlier resume)"
  if steps is not None:
    values["steps"] = steps
  for name, key in recipe_lib.ENV_SWITCHES.items():  # a process's identity is never saved: it comes anew
    if key in recipe_lib.PROCESS_IDENTITY_KEYS and os.environ.get(name):
      values[key] = os.environ[name]
  recipe = build_checked(values)
  if steps is not None:
    sources["steps"] = steps_source
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


def resume(path: Path, steps: int | None, from_checkpoint: int | None = None) -> int:
  """Continues the run in ``path`` from its latest complete checkpoint (or ``from_checkpoint``); ``steps``
  may extend it. The run directory's lock is taken before anything there is read."""
  try:
    held = run_dir.lock_run(path, flag="--resume") if _holds_the_lock() else contextlib.nullcontext()
  except REFUSALS as e:
    return _refuse(e)
  with held:
    try:
      plan = plan_resume(path, steps, from_checkpoint)
    except REFUSALS as e:
      return _refuse(e)
    return execute(plan)


def _holds_the_lock() -> bool:
  """Whether this process takes the run directory's lock: not a process the launcher started (the launcher
  holds it), nor a process other than 0 of a job started by hand (process 0 owns the directory)."""
  return os.environ.get(LAUNCHED_ENV) != "1" and os.environ.get(PROCESS_ID_ENV, "0").strip() in ("", "0")


def _lock(path: Path, *, flag: str, create: bool = False):
  """``path``'s lock (``run_dir.lock``), or nothing to hold where another process holds it for this one."""
  return run_dir.lock(path, flag=flag, create=create) if _holds_the_lock() else contextlib.nullcontext()


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
    return _refuse(e, code=1)
  try:
    return _in_job(plan, job, held, writes_to)
  except (ProcessLostError, AgreementError) as e:  # an exchange before the run: a process is not there, or elsewhere
    return job.leave_failed(_refuse(f"{job.label}{e}", code=1))
  except Exception as e:  # pylint: disable=broad-except  # not a refusal: the other processes are told first
    job.report_failure(e)
    return job.leave_failed(_fail(None, e, None, job))


def _in_job(plan: RunPlan, job: job_lib.Job, held: contextlib.ExitStack, writes_to: list) -> int:
  """``_execute``'s steps once this process is in its job (alone or one of several)."""
  code = _admit(job, plan.recipe)
  if code is not None:
    return code
  checked, code = _agreed(job, lambda: _checks(plan, job, held))
  if code is not None:
    return code
  host, point, source, devices = checked
  plan, refusal = _open_segment(plan, point, job) if plan.resumes else _claim(plan, job, held)
  if refusal is not None:
    return _refuse(refusal, job=job)
  writes_to[0] = plan.write_dir
  if job.is_primary:
    print(_opening_line(plan, job, host=host, point=point, devices=devices), file=sys.stderr)
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
    return job.leave_failed(_refuse(f"{job.label}{e}", code=1))
  return None


def _checks(plan: RunPlan, job: job_lib.Job, held: contextlib.ExitStack):
  """Everything that may refuse the run, in order: a new run's directory (process 0), the host settings, a
  checkpoint directory of the recipe's own (locked by process 0, held in ``held``), the preflight, a resumed
  run's checkpoint. Returns (host core reserved, resume point or None, rollout source, the devices found)."""
  recipe = plan.recipe
  if not plan.resumes and job.is_primary:  # process 0 owns the run directory
    _check_new_out(plan)
  host = setup_host(recipe, distributed=job.distributed)
  if job.is_primary:
    _lock_checkpoint_directory(plan, held)
  source = preflight(plan, distributed=job.distributed, primary=job.is_primary)
  point = resume_point(plan, source) if plan.resumes else None
  return host, point, source, _devices_found(recipe)


def _devices_found(recipe) -> str:
  """The devices the run computes on, as the opening line names them (JAX is up: the preflight counted them)."""
  if recipe.trainer.location == "remote":  # this process runs no JAX; the trainer's host names its devices
    return "devices: the remote trainer's (its serve-trainer line names them)"
  from orchestrator.engine.mesh import describe_devices  # import here: JAX-side (after setup_host)

  return describe_devices(recipe.mesh)


def _lock_checkpoint_directory(plan: RunPlan, held: contextlib.ExitStack) -> None:
  """A checkpoint directory outside the run directory (``checkpoint.directory``) is locked as well: two runs
  (or two copies of one run directory) must never write the same checkpoints."""
  if plan.recipe.trainer.location == "remote" and not plan.recipe.trainer.spawn:
    return  # a remote trainer's own checkpoints: its server holds them
  ckpt_dir = plan.checkpoint_dir
  if ckpt_dir is None or Path(ckpt_dir).resolve().is_relative_to(plan.out.resolve()):
    return
  held.enter_context(_lock(Path(ckpt_dir), flag="checkpoint.directory", create=True))


def _check_new_out(plan: RunPlan) -> None:
  """A new run's directory must hold no run, and its ``rollouts.record_to`` must not exist yet."""
  run_dir.check_new(plan.out)
  record_to = plan.recipe.rollouts.record_to
  if record_to and Path(record_to).exists() and not run_dir.holds_only_its_lock(Path(record_to)):
    raise RunDirError(f"rollouts.record_to={record_to} already exists; recordings are read-only, choose a new"
                      " directory")


def preflight(plan: RunPlan, *, distributed: bool = False, primary: bool = True):
  """Everything that can refuse the run before it writes: the source, the devices, the checkpoints.

  In a job of several processes every process opens its source and counts the
  job's devices; process 0 (``primary``) checks the checkpoint directory.
  Returns the rollout source. Raises RecipeError / RecordingError / RunDirError (exit 2).
  """
  # import here: gRPC and the engines load after setup_host (a refusal loads neither)
  from orchestrator.assembly import rollout_source
  from orchestrator.engine.checkpointing import read_checkpoints  # import here: JAX-side (after setup_host)

  recipe, run_id = plan.recipe, plan.run_id
  steps = recipe.steps if plan.resumes else None
  source = rollout_source(recipe, steps=steps)
  remote = recipe.trainer.location == "remote"
  if not remote or (recipe.trainer.spawn and recipe.rollouts.source == "sampler"):
    # A remote trainer checks its own devices, except one this run spawns: it starts on this host with this
    # environment, so it sees these devices, and a live driver has started JAX for its sampler already (a
    # driver that samples nothing starts no JAX; its spawned trainer refuses a mesh it lacks as it starts).
    _check_devices(recipe, distributed)
  if remote:
    _check_trainer_token(recipe)
  ckpt_dir = plan.checkpoint_dir if not remote or recipe.trainer.spawn else None
  if ckpt_dir and primary:
    checkpoints = read_checkpoints(ckpt_dir)
    foreign = {step: meta["run_id"] for step, meta in checkpoints.items()
               if isinstance(meta, dict) and isinstance(meta.get("run_id"), str) and meta["run_id"] != run_id}
    if steps is None and checkpoints and not foreign:  # a new run: a damaged checkpoint is no one's to reuse
      raise RunDirError(
          f"checkpoint directory {ckpt_dir} holds checkpoints this run did not write (steps {sorted(checkpoints)});"
          " use a new checkpoint.directory")
    if foreign:  # a damaged one is the resume's to report (resume_point), by name
      raise RunDirError(
          f"checkpoint directory {ckpt_dir} holds checkpoints of another run (steps {sorted(foreign)}, run"
          f" {sorted(set(foreign.values()))[0]}); use a new checkpoint.directory, or continue that"
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


def resume_point(plan: RunPlan, source):
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
  from orchestrator.assembly import ResumePoint, batch_shape
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


def _open_segment(plan: RunPlan, point, job: job_lib.Job) -> tuple[RunPlan, str | None]:
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


def _agreed(job, checks):
  """Runs ``checks`` (which may refuse) in every process and exchanges the refusals, so that every process
  goes on or refuses together: ``(what checks returned, None)`` or ``(None, exit code)``."""
  try:
    result, refusal = checks(), None
  except REFUSALS as e:
    result, refusal = None, e
  refusal = job.first_refusal(refusal)
  return (result, None) if refusal is None else (None, _refuse(refusal, job=job))


def _claim(plan: RunPlan, job: job_lib.Job, held: contextlib.ExitStack) -> tuple[RunPlan, str | None]:
  """Process 0 locks a new run's directory (held in ``held``) and claims it (``config.json``); every process
  then takes process 0's run id and directory, since every process writes checkpoints under them. Returns the
  claimed plan and why the claim failed (None: claimed)."""
  claimed = {"run_id": plan.run_id, "out": str(plan.out), "config_sha256": plan.config_sha256, "refusal": None}
  if job.is_primary:
    try:
      held.enter_context(_lock(plan.out, flag="--out", create=True))
      if plan.recipe.rollouts.record_to:  # the recording directory too, until the run has written it
        held.enter_context(_lock(Path(plan.recipe.rollouts.record_to), flag="rollouts.record_to", create=True))
      config, sources = plan.saved
      run_dir.claim_new(plan.out, {"run_id": plan.run_id, "recipe": plan.resolved.path, "config": config,
                                   "sources": sources, "inputs": inputs.fingerprints(plan.recipe)})
    except RunDirError as e:  # another run claimed or holds the directory since the check
      claimed["refusal"] = str(e)
  claimed = job.agreement.broadcast("claim", claimed)
  return (plan.claimed(run_id=claimed["run_id"], out=Path(claimed["out"]), config_sha256=claimed["config_sha256"]),
          claimed["refusal"])


def _opening_line(plan: RunPlan, job: job_lib.Job, *, host: str, point, devices: str) -> str:
  """What process 0 says before the run: the recipe and where it writes, or where a resumed run continues; and
  the devices JAX found."""
  recipe = plan.recipe
  if plan.resumes:
    return (f"run_rl: resuming {plan.out} ({recipe.name}, mode {recipe.mode.name}) after step {point.steps_done - 1}"
            f" from checkpoint {point.checkpoint_step}; {recipe.steps - point.steps_done} steps to go; {devices}")
  processes = f"; {job.identity.num_processes} processes" if job.distributed else ""
  return (f"run_rl: recipe {plan.resolved.path} ({recipe.name}){_changed_phrase(plan.resolved)}, mode"
          f" {recipe.mode.name}, model {recipe.model.name}, {recipe.steps} steps ×"
          f" {recipe.batch.micro_batches_per_step} micro-batches; out {plan.out}; host core reserved:"
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
      held.enter_context(_lock(plan.out, flag="--out", create=True))
    except RunDirError as e:
      return _refuse(e)
  recipe, d = plan.recipe, plan.recipe.distributed
  return LocalJob(list(plan.launch_argv), num_processes=d.num_processes,
                  devices_per_process=recipe.mesh.num_devices // d.num_processes, out=plan.out,
                  timeout_s=d.timeout_s).run()


def _end_run_on_lost_peer(writes_to: list, job: job_lib.Job, line: str) -> None:
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


def _join(recipe, writes_to: list) -> job_lib.Job:
  """This process's job: alone, or joined to the one ``recipe.distributed`` names (before JAX starts)."""
  if not recipe.distributed.enabled:
    return job_lib.single()
  return job_lib.join_job(recipe.distributed, on_lost_peer=functools.partial(_end_run_on_lost_peer, writes_to))


def _refuse(e: Exception | str, *, job=None, code: int = 2) -> int:
  """One line, exit 2 (nothing was started or written). In a job every process refuses together; process 0
  says why on the run's terminal and the others in their logs."""
  print(f"run_rl: error: {e}", file=sys.stderr, flush=True)
  if job is not None:
    job.finish(succeeded=True)
  return code


def _run_program(plan: RunPlan, *, source, resume, job: job_lib.Job) -> int:
  """Builds the run and runs it to its end, a stop or a failure; process 0 writes what it ends with."""
  recipe, out, run_id, write_dir = plan.recipe, plan.out, plan.run_id, plan.write_dir
  with StopSignals(out, quiet=not job.is_primary) as stop:  # held to the end: a late Ctrl-C gets no traceback
    handle, code = None, None
    try:
      # import here: gRPC and the engines load after setup_host (a refusal loads neither)
      from orchestrator.assembly import build_run

      previous_trace = _previous_trace(plan) if resume and job.is_primary else []
      handle = build_run(recipe, out, source=source, run_id=run_id, checkpoint_dir=plan.checkpoint_dir,
                         resume=resume, stop_requested=stop.requested,
                         progress=functools.partial(Progress, recipe.name, total=recipe.steps), job=job,
                         write_dir=write_dir, config_sha256=plan.config_sha256)
      job.current_step = lambda: handle.current_step  # the step a lost peer's line names
      result = handle.run()
    except recipe_lib.RecipeError as e:
      code = _refuse(e)
    except NonFiniteStepError as e:  # the training diverged, the code did not fail: one line, no traceback
      handle.close()  # the progress bar ends first, so the line stands alone (a second close does nothing)
      code = _stopped_non_finite(out, write_dir, e, job)
    except StoppedWithoutCheckpointError as e:  # a stop that came while the sampler held the run: as asked
      if handle is not None:
        handle.close()
      code = _stopped_without_checkpoint(write_dir, e, stop, job)
    except Exception as e:  # pylint: disable=broad-except
      job.report_failure(e)  # where a peer failed or died first, this process ends here, naming it
      if handle is None and resume is not None and job.is_primary and write_dir is not None:
        code = _withdraw_segment(plan, resume, e)
      else:
        code = _fail(write_dir, e, None if handle is None else handle.current_step, job)
    finally:
      if handle is not None:
        handle.close()
    if code is not None:
      return job.leave_failed(code)
    if not job.is_primary:
      job.finish(succeeded=True)
      return EXIT_CODES[stop.received or _signal_named(result.stop_reason)] if result.ended == "stopped" else 0
    if previous_trace:
      run_dir.merge_trace(write_dir, previous_trace, resumed_at=resume.steps_done)
    recorded = True
    try:
      _write_recording(recipe, handle.program.source, result, write_dir)
    except (RunDirError, OSError) as e:
      print(f"run_rl: error: the rollouts were not recorded: {e}", file=sys.stderr)
      recorded = False
    code = _report(plan, result, stop)
    code = code if code or recorded else 1
    job.finish(succeeded=True)
    return code


def _write_recording(recipe, source, result, write_dir: Path) -> None:
  """A live run with ``rollouts.record_to`` writes what it trained on, replayable as a recording, holding the
  recording directory's lock. A resumed segment never writes over the recording an earlier one wrote: it
  writes its own steps' into ``write_dir/recording``."""
  record_to = recipe.rollouts.record_to
  live = live_part(source)
  recorded = live.recorded_steps() if live is not None else None
  if not record_to or recorded is None:
    return
  from orchestrator.live.rollouts import recorded_groups  # import here: JAX-side (after setup_host)

  target = Path(record_to)
  if (target / "manifest.json").exists():
    target = write_dir / "recording"
  with run_dir.lock(target, flag="rollouts.record_to", create=True):
    manifest = write_recording(target, recorded_groups(recorded, recipe.rollouts.generations_per_group),
                               vocab_size=recipe.model_preset().vocab_size,
                               produced_by={"tool": "run_rl (live loop)", "recipe": recipe.name,
                                            "task": dataclasses.asdict(recipe.task), "steps": result.last_step + 1})
  record_to = str(target)
  result.summary = result.summary.replace(
      run=dict(result.summary.run, recording={"path": record_to, "groups": manifest["num_groups"]}))
  print(f"run_rl: wrote the {manifest['num_groups']} groups this run trained on to {record_to}"
        f" (replay them with rollouts.source=recording rollouts.recording={record_to})", file=sys.stderr)


def _previous_trace(plan: RunPlan) -> list:
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


def _report(plan: RunPlan, result, stop: StopSignals) -> int:
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
    received = stop.received or _signal_named(result.stop_reason)
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
  return EXIT_CODES[received]


def _signal_named(name: str | None) -> signal.Signals:
  try:
    return signal.Signals[name]
  except KeyError:
    return signal.SIGTERM  # a stop asked for by other means ends like a polite termination


def _stopped_without_checkpoint(write_dir: Path, error: Exception, stop: StopSignals, job) -> int:
  """A stop while the loop waited for rollouts it could not checkpoint without: the signal's exit code, one
  line naming the checkpoint to resume from; the summary says so."""
  received = stop.received or signal.SIGTERM
  if job.is_primary and write_dir is not None:
    run_dir.write_summary(write_dir, {"ended": "signal", "signal": received.name, "checkpoint_path": None,
                                      "error": f"{type(error).__name__}: {error}"})
  print(f"run_rl: {job.label}{error}", file=sys.stderr)  # the error says what stopped it, where, and what is left
  return EXIT_CODES[received]


def _stopped_non_finite(out: Path, write_dir: Path, error: NonFiniteStepError, job) -> int:
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


def _withdraw_segment(plan: RunPlan, point, error: Exception) -> int:
  """A resume that failed before its first step (its checkpoint could not be restored, or the run not built)
  leaves the run as it was: the checkpoints it moved aside go back, and its segment loses its
  ``segment.json``, so the run's view stays the segment before (``run_dir.segments`` skips it); the traceback
  stays in the segment's ``error.log``. One line, exit 1, naming the checkpoint and the one to try instead."""
  segment = plan.write_dir
  log_path = segment / run_dir.ERROR_LOG
  log_path.write_text("".join(traceback.format_exception(error)), encoding="utf-8")
  aside = segment / run_dir.SUPERSEDED_CHECKPOINTS
  for step in point.superseded_checkpoints:
    shutil.move(str(aside / str(step)), str(Path(plan.checkpoint_dir) / str(step)))
  (segment / run_dir.SEGMENT).unlink()
  text = " ".join(str(error).split())
  text = text if len(text) <= 300 else text[:300] + "..."
  step = point.checkpoint_step
  instead = (f"; if checkpoint {step} is damaged, resume from checkpoint {point.earlier_valid}, the newest intact"
             f" one before it: `run_rl --resume {plan.out} --from-checkpoint {point.earlier_valid}`"
             if point.earlier_valid is not None else "")
  print(f"run_rl: error: the resume could not restore checkpoint {step} and build the run: {type(error).__name__}:"
        f" {text}; the run is as it was (traceback in {log_path}){instead}", file=sys.stderr, flush=True)
  return 1


def _fail(out: Path | None, error: Exception, step: int | None, job) -> int:
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

"""Everything that may refuse a run before it writes, in order (``checks``).

A new run's directory must hold no run; the host is set up; a checkpoint
directory of the recipe's own is locked; the rollout source is opened (a
recording is verified and must hold the steps), the mesh's devices are
counted, the checkpoint directory must hold no other run's checkpoints; a
resumed run's checkpoint is found and checked (``resume.resume_point``). A
refusal raises RecipeError / RecordingError / RunDirError (one line, exit 2).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from orchestrator import recipe as recipe_lib
from orchestrator.app import locks
from orchestrator.app.host import setup_host
from orchestrator.app.memory_bound import check_training_fits
from orchestrator.app.plan import RunPlan
from orchestrator.app.resume import resume_point
from orchestrator.distributed import job as job_lib
from orchestrator.remote import protocol
from orchestrator.run_files import run_dir
from orchestrator.run_files.run_dir import RunDirError


def checks(plan: RunPlan, job: job_lib.Job, held: contextlib.ExitStack):
  """Everything that may refuse the run, in order: a new run's directory (process 0), the host settings, a
  checkpoint directory of the recipe's own (locked by process 0, held in ``held``), the preflight, a resumed
  run's checkpoint. Returns (the core plan in words, resume point or None, rollout source, the devices found)."""
  recipe = plan.recipe
  if not plan.resumes and job.is_primary:  # process 0 owns the run directory
    _check_new_out(plan)
  host = setup_host(recipe, distributed=job.distributed, held=held, host_after_start_up=True)
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
  held.enter_context(locks.lock_if_holder(Path(ckpt_dir), flag="checkpoint.directory", create=True))


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
  if recipe.trainer.location == "local":
    _check_attention(recipe)
    check_training_fits(recipe)  # before the sampler (a live source's) is built
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


def _check_attention(recipe) -> None:
  """``engine.attention=splash`` is a TPU kernel: refused where the trainer's devices are not a TPU's."""
  if recipe.engine.attention != "splash":
    return
  import jax  # import here: JAX-side (after setup_host)

  from orchestrator.assembly import batch_shape  # import here: beside the engine's modules

  if jax.default_backend() != "tpu":
    raise recipe_lib.RecipeError(f"engine.attention=splash runs Tunix's Pallas splash kernel, on a TPU only; this"
                                 f" run's devices are {jax.default_backend()}: set engine.attention=xla")
  tokens_per_row = batch_shape(recipe)[2]
  if tokens_per_row % 128:
    raise recipe_lib.RecipeError(f"engine.attention=splash computes rows in blocks of 128 tokens, but"
                                 f" batch.tokens_per_row is {tokens_per_row}; set a multiple of 128 or"
                                 " engine.attention=xla")


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

"""Turn a validated recipe into the objects a run is made of: engine, rollouts, worker, policy, program settings.

``run_rl`` (``orchestrator.app.run``), the rig and the benches build from
here: ``policy_from_recipe`` is the one place a recipe becomes a
``StepBoundaryPolicy``, ``make_worker`` the one place it becomes a trainer
(here or remote), ``rollout_source`` the one place it becomes a step source,
and ``program_config`` the program's settings. Where a run's files go is the
caller's to say (its checkpoint directory, the directory it writes into): this
module knows no run directory's layout.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from orchestrator import recipe as recipe_lib
from orchestrator.data.recording import (RecordingError, live_recording_without_distribution, open_recording,
                                         read_manifest)
from orchestrator.data.sources import ReplaySteps, SyntheticSteps
from orchestrator.data.synthetic import SyntheticRollouts
from orchestrator.engine import build_backend
from orchestrator.host import host_threads
from orchestrator.tasks.tasks import max_generation_steps
from orchestrator.tasks.tokenizer import sampled_token_ids
from orchestrator.loop.program import ProgramConfig
from orchestrator.loop.trainer_worker import TrainerWorker, WorkerCapabilities
from orchestrator.recipe import RECIPES_DIR, Recipe, RecipeError
from orchestrator.recipe.schema import decode_chunk_size, decode_chunks
from orchestrator.remote import protocol
from orchestrator.remote.client import RemoteTrainerWorker
from orchestrator.remote.spawn import SpawnedTrainer
from policies import Mode, StagingUnsupportedError, StepBoundaryPolicy

#: The least time a spawned trainer is given to listen (``trainer.timeout_s`` where that is longer). Before it
#: listens the child starts Python, imports JAX and gRPC and checks its devices: tens of seconds on a cold or
#: busy host, longer than the deadline a recipe may set for each call.
SPAWN_LISTEN_MIN_S = 60.0


def policy_from_recipe(recipe: Recipe, capabilities: WorkerCapabilities, *, mode: Mode | None = None,
                       steps: int | None = None) -> StepBoundaryPolicy:
  """The policy the recipe's ``step_boundary`` section describes, for a worker with ``capabilities``.

  ``mode`` overrides the switches' mode (the rig's arms); ``steps`` bounds the
  excluded boundaries to a shorter run.

  Raises:
    RecipeError: a staged mode with ``require_staging`` on an engine that cannot stage.
  """
  sb = recipe.step_boundary
  excluded = [s for s in recipe.excluded_steps if steps is None or s < steps]
  try:
    return StepBoundaryPolicy(
        mode or recipe.mode,
        engine_can_stage=capabilities.can_stage,
        require_staging=sb.require_staging,
        wait_threshold_s=recipe.wait_threshold,
        disable_after=sb.disable_after,
        reprobe_every=sb.reprobe_every,
        excluded_steps=excluded,
        engine_missing=capabilities.missing_staging_methods,
        min_free_device_bytes=sb.min_free_device_bytes,
        control_every=sb.control_every,
    )
  except StagingUnsupportedError as e:
    raise RecipeError(str(e)) from None


def build_engine_from_recipe(recipe: Recipe, *, checkpoint_dir: str | None = None):
  """The engine ``engine.backend`` names, with the recipe's model, mesh, batch shape and options, and the
  distribution its rollouts are sampled from."""
  rows, tokens_per_row = recipe.micro_batch_shape()
  return build_backend(recipe.model_preset(), recipe.engine, mesh=dataclasses.asdict(recipe.mesh),
                       rows=rows, tokens_per_row=tokens_per_row,
                       checkpoint_dir=checkpoint_dir,
                       micro_batches_per_step=recipe.batch.micro_batches_per_step,
                       sampled=sampled_distribution(recipe))


def sampled_distribution(recipe: Recipe):
  """What the rollouts were sampled from (a temperature, the ids the sampler may emit), for the trainer's loss
  to take its log-probs the same way: the live sampler's, or what a recording says its sampler's was; None for
  synthetic rollouts and recordings of the model's own distribution."""
  # import here: it imports JAX, which starts after the host settings (see live_source)
  from orchestrator.engine.loss import SampledDistribution

  if recipe.rollouts.source == "recording":
    stored = read_manifest(resolve_path(recipe.rollouts.recording)).get("sampled_distribution")
    if stored is None:
      return None
    ids = stored["token_ids"]
    return SampledDistribution(float(stored["temperature"]), None if ids is None else tuple(ids))
  if recipe.rollouts.source != "sampler":
    return None
  return SampledDistribution(float(recipe.rollouts.temperature),
                             tuple(sampled_token_ids(recipe.model.tokenizer(), recipe.live_task().answer_alphabet)))


def recorded_distribution(recipe: Recipe) -> dict[str, Any]:
  """The live sampler's distribution as a recording stores it (``data.recording``'s ``sampled_distribution``):
  its ids listed only where they are not the whole vocabulary."""
  sampled = sampled_distribution(recipe)
  ids = sorted(set(sampled.token_ids))
  whole = len(ids) >= recipe.model_preset().vocab_size
  return {"temperature": sampled.temperature, "token_ids": None if whole else ids,
          "top_p": float(recipe.rollouts.top_p), "top_k": int(recipe.rollouts.top_k)}


def batch_shape(recipe: Recipe) -> tuple[int, int, int]:
  """(vocab size, rows, tokens per row) the recipe's model and batch section give (no JAX)."""
  preset = recipe.model_preset()
  return (preset.vocab_size, *recipe.micro_batch_shape())


def rollout_source(recipe: Recipe, *, steps: int | None = None):
  """The step source the recipe names, with a position that can be saved (``orchestrator.data.sources``).

  A recording is opened and verified, and must hold ``steps`` steps (default
  the recipe's): a bad or short recording is refused here, before anything runs.

  Raises:
    RecordingError: the recording cannot be replayed for this run.
  """
  vocab_size, rows, tokens_per_row = batch_shape(recipe)
  r, m = recipe.rollouts, recipe.batch.micro_batches_per_step
  routing = recipe.engine.routing_shape(recipe.model_preset())
  if r.source == "sampler":
    return live_source(recipe, steps=steps)
  if r.source == "synthetic":
    return SyntheticSteps(SyntheticRollouts(vocab_size, rows, tokens_per_row, generations_per_group=r.generations_per_group,
                                            fill=r.fill, seed=r.seed, routing=routing), m)
  recording = open_recording(resolve_path(r.recording), vocab_size=vocab_size, routing=routing)
  if live_recording_without_distribution(recording.manifest):
    raise RecordingError(
        f"rollouts.recording={r.recording}: the live loop recorded it before recordings kept the distribution"
        " their rollouts were sampled from (manifest key sampled_distribution: the temperature and the ids the"
        " sampler could emit), so the loss cannot take the trainer's log-probs the same way; record it again"
        " (rollouts.record_to)")
  source = ReplaySteps(recording, rows=rows, tokens_per_row=tokens_per_row, micro_batches_per_step=m)
  source.require_steps(steps or recipe.steps)
  return source


def live_source(recipe: Recipe, *, steps: int | None = None):
  """The live loop's source: a sampler over the trained model (same preset and seed), on the recipe's task."""
  # import here: the sampler imports JAX, which starts after the host settings; the benchmarks and the rig
  # import this module before them
  import jax
  from orchestrator.live.placement import sampler_placement
  from orchestrator.live.placement_rule import choose_placement
  from orchestrator.live.rollouts import LiveRollouts, LiveShape
  from orchestrator.live.sampler import LiveSampler

  from orchestrator.live.sampler_process import SamplerProcess, SamplerSpec

  task, r = recipe.live_task(), recipe.rollouts
  local = recipe.trainer.location == "local"
  kind, where = choose_placement(r.placement, platform=jax.default_backend(), processes=jax.process_count(),
                                 trainer_local=local)
  placement = None
  if local:  # a remote trainer's driver samples on its own default device
    try:
      placement = sampler_placement("shared" if kind == "process" else kind, recipe.mesh, r.devices)
    except ValueError as e:  # too few devices: refused before anything is built or written
      raise RecipeError(str(e)) from None
  spec = SamplerSpec(preset=recipe.model_preset(), model=recipe.model, seed=recipe.engine.seed,
                     max_prompt_length=task.max_prompt_tokens, max_generation_steps=max_generation_steps(task),
                     alphabet=task.answer_alphabet, dtype=recipe.engine.dtype,
                     xla_threads=host_threads.APPLIED["plan"].host_threads if "plan" in host_threads.APPLIED else None,
                     routing=recipe.engine.routing_shape(recipe.model_preset()))
  if kind == "process":  # started first: it imports and builds while this process builds the trainer
    sampler = SamplerProcess(spec, recipe.model.tokenizer())
  else:
    sampler = LiveSampler(spec.preset, spec.model.tokenizer(), seed=spec.seed,
                          max_prompt_length=spec.max_prompt_length, max_generation_steps=spec.max_generation_steps,
                          alphabet=spec.alphabet, dtype=spec.dtype, placement=placement, routing=spec.routing)
  shape = LiveShape(steps or recipe.steps, recipe.batch.micro_batches_per_step, r.groups_per_micro_batch,
                    r.generations_per_group, r.max_staleness, r.temperature, r.seed, r.batch_steps,
                    recipe.engine.epochs, recipe.micro_batches_per_call(), top_p=r.top_p, top_k=r.top_k,
                    stop=tuple(r.stop), advantage_scaling=r.advantage_scaling, **in_flight_shape(recipe),
                    vocab_size=recipe.model_preset().vocab_size)
  # Only process 0 writes a recording (launch._run_program): the others of a job keep no steps for one.
  record = bool(r.record_to) and jax.process_index() == 0
  return LiveRollouts(sampler, task, shape, record=record, reward=recipe.task.make_reward(task), sampler_where=where,
                      on_trainer_devices=local and kind == "shared")


def in_flight_shape(recipe: Recipe) -> dict[str, Any]:
  """``LiveShape``'s in-flight keys for ``recipe``: none without in-flight updates (a generation decodes whole),
  else its decode chunks' size and count over the task's completion limit."""
  r = recipe.rollouts
  if not r.in_flight_updates:
    return {}
  limit = max_generation_steps(recipe.live_task())
  return {"in_flight_updates": True, "decode_chunk_tokens": decode_chunk_size(r.decode_chunk_tokens, limit),
          "decode_chunks": decode_chunks(r.decode_chunk_tokens, limit)}


def resolve_path(path: str) -> Path:
  """A recipe path: as given if it exists, else relative to the repository root."""
  given = Path(path)
  if given.exists() or given.is_absolute():
    return given
  return RECIPES_DIR.parent / given


def program_config(recipe: Recipe, out: Path | None, *, steps: int | None = None, start_step: int = 0,
                   run_id: str | None = None, config_sha256: str | None = None) -> ProgramConfig:
  sb, ckpt = recipe.step_boundary, recipe.checkpoint
  return ProgramConfig(
      steps=steps or recipe.steps, micro_batches_per_step=recipe.batch.micro_batches_per_step,
      checkpoint_every=ckpt.every, scored_checkpoint_steps=tuple(ckpt.scored_steps),
      sync_before_next_step=sb.sync_before_next_step, calibration_samples=sb.calibration_samples,
      out_dir=str(out) if out else None, start_step=start_step, run_id=run_id, config_sha256=config_sha256,
  )


def make_worker(recipe: Recipe, closers: list, *, checkpoint_dir: str | None, write_dir: Path):
  """The trainer the recipe names: a ``TrainerWorker`` here, or a ``RemoteTrainerWorker`` (spawning its server,
  whose recipe and log go in ``write_dir``). A trainer built here or spawned keeps its checkpoints in
  ``checkpoint_dir`` (None: it writes none).

  Appends what must be closed after the run to ``closers``; returns ``(worker, trainer_info)``.
  """
  t = recipe.trainer
  if t.location == "local":
    return TrainerWorker(build_engine_from_recipe(recipe, checkpoint_dir=checkpoint_dir)), None
  limits = protocol.Limits(max_message_bytes=t.max_message_bytes, timeout_s=t.timeout_s)
  address, token = t.address, protocol.read_token(t.token_file)
  if t.spawn:
    child = SpawnedTrainer(recipe_lib.to_dict(recipe), recipe_path=write_dir / "trainer_recipe.json",
                           checkpoint_dir=checkpoint_dir, address=address or "127.0.0.1:0",
                           timeout_s=max(t.timeout_s, SPAWN_LISTEN_MIN_S), log_path=write_dir / "trainer.log")
    closers.append(child.stop)
    address, token = child.address, child.token
  worker = RemoteTrainerWorker(address, recipe_digest=protocol.recipe_digest(recipe), token=token, limits=limits,
                               micro_batches_per_step=recipe.batch.micro_batches_per_step)
  closers.append(worker.close)
  return worker, {"location": "remote", "address": address, "spawned": t.spawn,
                  "clock_offset_s": worker.offset_s, "clock_offset_error_s": worker.offset_error_s}



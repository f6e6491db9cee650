"""Turn a validated recipe into a running program: engine, rollouts, worker, policy, progress."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from orchestrator.config import Recipe, RecipeError
from orchestrator.program import ProgramConfig, RLProgram
from orchestrator.trainer_worker import TrainerWorker
from policies import StagingUnsupportedError, StepBoundaryPolicy


def engine_options(recipe: Recipe, checkpoint_dir: str | None) -> dict:
  e = recipe.engine
  return {
      "rows": recipe.batch.rows,
      "tokens_per_row": recipe.batch.tokens_per_row,
      "learning_rate": e.learning_rate,
      "weight_decay": e.weight_decay,
      "max_grad_norm": e.max_grad_norm,
      "clip_eps_low": e.clip_eps_low,
      "clip_eps_high": e.clip_eps_high,
      "max_inflight": e.max_inflight,
      "seed": e.seed,
      "checkpoint_dir": checkpoint_dir,
      "ragged_buffer_factor": e.ragged_buffer_factor,
      "retry_when_tokens_dropped": e.retry_when_tokens_dropped,
      "skip_nonfinite_updates": e.skip_nonfinite_updates,
  }


def rollout_source(recipe: Recipe, engine):
  """The per-step payload iterable the recipe names."""
  r = recipe.rollouts
  if r.source == "synthetic":
    from orchestrator.data.synthetic import SyntheticRollouts

    return SyntheticRollouts(
        engine.preset.vocab_size, engine.rows, engine.tokens_per_row,
        generations_per_group=r.generations_per_group, fill=r.fill, seed=r.seed,
    ).steps(recipe.steps, recipe.batch.micro_batches_per_step)
  from orchestrator.data.recording import open_recording
  from orchestrator.data.replay import replay_steps

  recording = open_recording(resolve_path(r.recording), vocab_size=engine.preset.vocab_size)
  return replay_steps(recording, rows=engine.rows, tokens_per_row=engine.tokens_per_row,
                      micro_batches_per_step=recipe.batch.micro_batches_per_step, steps=recipe.steps)


def resolve_path(path: str) -> Path:
  """A recipe path: as given if it exists, else relative to the repository root."""
  given = Path(path)
  if given.exists() or given.is_absolute():
    return given
  from orchestrator.config import RECIPES_DIR

  return RECIPES_DIR.parent / given


@dataclasses.dataclass
class RunHandle:
  """A built run: ``run()`` it; ``current_step`` names the step if it fails."""

  program: RLProgram
  progress: object | None

  def run(self):
    if self.progress is None:
      return self.program.run()
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm():
      return self.program.run()

  @property
  def current_step(self):
    return self.program.current_step

  def close_progress(self):
    if self.progress is not None:
      self.progress.close()


def build_run(recipe: Recipe, out: Path, *, progress: bool = True) -> RunHandle:
  from orchestrator.engine import build_engine

  ckpt = recipe.checkpoint
  checkpoint_dir = str(Path(ckpt.directory).absolute()) if ckpt.directory else None
  engine = build_engine(
      recipe.model, mesh=dataclasses.asdict(recipe.mesh), **engine_options(recipe, checkpoint_dir)
  )
  worker = TrainerWorker(engine)
  sb = recipe.step_boundary
  try:
    policy = StepBoundaryPolicy(
        recipe.mode,
        engine_can_stage=worker.capabilities.can_stage,
        require_staging=sb.require_staging,
        wait_threshold_s=recipe.wait_threshold,
        disable_after=sb.disable_after,
        reprobe_every=sb.reprobe_every,
        excluded_steps=recipe.excluded_steps,
        engine_missing=worker.capabilities.missing_staging_methods,
    )
  except StagingUnsupportedError as e:
    raise RecipeError(str(e)) from None
  bar = None
  on_step = None
  if progress:
    from tqdm import tqdm

    bar = tqdm(total=recipe.steps, desc=f"{recipe.name} [{recipe.mode.value}]", unit="step")

    def on_step(record):
      idle = record["boundary_idle_s"]
      bar.set_postfix(step_s=f"{record['step_s']:.3f}",
                      idle_s="-" if idle is None else f"{idle:.4f}",
                      loss=f"{record['loss']:.4f}" if record["loss"] is not None else "-")
      bar.update(1)

  program = RLProgram(
      worker, policy, rollout_source(recipe, engine),
      ProgramConfig(
          steps=recipe.steps,
          micro_batches_per_step=recipe.batch.micro_batches_per_step,
          checkpoint_every=ckpt.every,
          scored_checkpoint_steps=tuple(ckpt.scored_steps),
          sync_before_next_step=sb.sync_before_next_step,
          calibration_samples=sb.calibration_samples,
          out_dir=str(out),
      ),
      on_step=on_step,
  )
  return RunHandle(program, bar)

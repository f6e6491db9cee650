"""Turn a validated recipe into a running program: engine, rollouts, worker, policy, progress.

``policy_from_recipe`` is the one place a recipe becomes a ``StepBoundaryPolicy``
(``run_rl``, the rig and the benches all use it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from orchestrator.config import RECIPES_DIR, Recipe, RecipeError
from orchestrator.program import ProgramConfig, RLProgram
from orchestrator.trainer_worker import TrainerWorker, WorkerCapabilities
from policies import Mode, StagingUnsupportedError, StepBoundaryPolicy


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
    )
  except StagingUnsupportedError as e:
    raise RecipeError(str(e)) from None


def build_engine_from_recipe(recipe: Recipe, *, checkpoint_dir: str | None = None):
  """The engine ``engine.backend`` names, with the recipe's model, mesh, batch shape and options."""
  from orchestrator.engine import build_backend

  return build_backend(recipe.model, recipe.engine, mesh=dataclasses.asdict(recipe.mesh),
                       rows=recipe.batch.rows, tokens_per_row=recipe.batch.tokens_per_row,
                       checkpoint_dir=checkpoint_dir,
                       micro_batches_per_step=recipe.batch.micro_batches_per_step)


def rollout_source(recipe: Recipe, *, vocab_size: int, rows: int, tokens_per_row: int, steps: int | None = None):
  """The per-step payloads the recipe names (``steps`` of them; default the recipe's)."""
  r = recipe.rollouts
  steps = steps or recipe.steps
  m = recipe.batch.micro_batches_per_step
  if r.source == "synthetic":
    from orchestrator.data.synthetic import SyntheticRollouts

    return SyntheticRollouts(vocab_size, rows, tokens_per_row, generations_per_group=r.generations_per_group,
                             fill=r.fill, seed=r.seed).steps(steps, m)
  from orchestrator.data.recording import open_recording
  from orchestrator.data.replay import replay_steps

  recording = open_recording(resolve_path(r.recording), vocab_size=vocab_size)
  return replay_steps(recording, rows=rows, tokens_per_row=tokens_per_row, micro_batches_per_step=m, steps=steps)


def resolve_path(path: str) -> Path:
  """A recipe path: as given if it exists, else relative to the repository root."""
  given = Path(path)
  if given.exists() or given.is_absolute():
    return given
  return RECIPES_DIR.parent / given


def program_config(recipe: Recipe, out: Path | None, *, steps: int | None = None) -> ProgramConfig:
  sb, ckpt = recipe.step_boundary, recipe.checkpoint
  return ProgramConfig(
      steps=steps or recipe.steps, micro_batches_per_step=recipe.batch.micro_batches_per_step,
      checkpoint_every=ckpt.every, scored_checkpoint_steps=tuple(ckpt.scored_steps),
      sync_before_next_step=sb.sync_before_next_step, calibration_samples=sb.calibration_samples,
      out_dir=str(out) if out else None,
  )


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
  ckpt = recipe.checkpoint
  engine = build_engine_from_recipe(
      recipe, checkpoint_dir=str(Path(ckpt.directory).absolute()) if ckpt.directory else None)
  worker = TrainerWorker(engine)
  policy = policy_from_recipe(recipe, worker.capabilities)
  bar = on_step = None
  if progress:
    from tqdm import tqdm

    from orchestrator.console import progress_postfix

    bar = tqdm(total=recipe.steps, desc=f"{recipe.name} [{recipe.mode.value}]", unit="step")

    def on_step(record):
      bar.set_postfix(progress_postfix(record))
      bar.update(1)

  source = rollout_source(recipe, vocab_size=engine.preset.vocab_size, rows=engine.rows,
                          tokens_per_row=engine.tokens_per_row)
  program = RLProgram(worker, policy, source, program_config(recipe, out), on_step=on_step)
  return RunHandle(program, bar)

"""A run as decided before anything starts: the ``RunPlan`` of a new run or of a resumed one.

``plan_new_run`` and ``plan_resume`` each read what they need (a resumed run's
``config.json``, checked against its recipe and the files it read) and write
nothing; the plan carries the run's facts from then on, computed once: its
recipe, directory, id, checkpoint directory, where this segment writes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator import recipe as recipe_lib
from orchestrator.app import inputs
from orchestrator.engine.options import CHECKPOINTING_BACKENDS
from orchestrator.run_files import run_dir
from orchestrator.run_files.run_dir import RunDirError


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


def _kept_as_run(key: str, source: str, values: dict) -> bool:
  """Whether a resume keeps a size the run derived at the value it ran with: a live run's micro-batch shape that
  came from the model's sizes ("derived: model.preset tiny's rows"), which a live run no longer derives, and the
  learning rate's decay (the schedule the run's start derived from its length: an extended run keeps it)."""
  if key == "engine.decay_steps":
    return True
  leaf = key.removeprefix("batch.")
  return (key in ("batch.rows", "batch.tokens_per_row") and values.get("rollouts.source") == "sampler"
          and source.endswith(f"'s {leaf}"))


def resolved_from_saved(config: dict, steps: int | None, *, saved_steps: int | None = None
                        ) -> recipe_lib.ResolvedRecipe:
  """The recipe a run directory's config.json describes, run to ``steps`` if given, else to ``saved_steps``
  (the length the latest segment ran to). A size the run derived (config.json records its value) is left
  unset, to be derived as the run derived it, but a live run's micro-batch shape taken from its model's sizes
  (before live runs fitted theirs to their task) keeps the value it ran with; a file the run read is the one it
  read, by the absolute path config.json records (a relative one named the working directory's)."""
  values = recipe_lib.flatten(config["config"], where="config.json")
  sources = dict(config.get("sources") or {})
  for key, source in sources.items():
    if str(source).startswith(recipe_lib.DERIVED) and key in values and not _kept_as_run(key, str(source), values):
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

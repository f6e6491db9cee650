"""``run_rl export RUN_DIR --out DIR``: a run's trained weights as a Hugging Face checkpoint directory.

The weights come from the run's newest checkpoint that is its own (its run id,
step and recipe digest checked; a foreign one is passed over and said so) and
whose params can be read (the files orbax reads for them checked first,
``checkpoint_state``; a damaged one is passed over and named), or from the one
``--checkpoint N`` names (refused if damaged, naming the command that exports
the newest intact one). A run that ended on a non-finite loss is refused
unless ``--checkpoint`` names one written before that step, and weights that
are not finite are never written. ``DIR`` gets ``model.safetensors`` and
``config.json`` (the source checkpoint's, with the sizes set) and the
tokenizer the run sampled with: the source checkpoint's files, or the
character tokenizer of a preset's live run. Nothing is written into an existing
directory: the export is written into a hidden sibling of ``DIR`` and renamed
to ``DIR`` once complete; a failed write removes it and names the path and the
error. ``export.json``, written last, marks a finished one. The run's lock is
held meanwhile (taken only once ``RUN_DIR`` is known to hold a run), so no
resume writes checkpoints under the export. ``export.json`` names the run, the
checkpoint and the weights' digest, which a run loading ``DIR``
(``model.checkpoint: DIR``) reproduces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator import recipe as recipe_lib
from orchestrator.app import inputs, locks
from orchestrator.app.plan import checkpoint_dir_for
from orchestrator.app.arguments import UsageError, UsageErrorParser
from orchestrator.app.new_directory import (Terminated, make_partial, missing_parents, remove_empty,
                                            remove_stale_partials, sigterm_raises, writable_above)
from orchestrator.models import hf_checkpoint
from orchestrator.models.presets import ModelPreset, load_preset
from orchestrator.recipe import RecipeError
from orchestrator.recipe.model_section import DEFAULT_PRESET
from orchestrator.run_files import checkpoint_state, run_dir
from orchestrator.run_files.run_dir import RunDirError
from orchestrator.user_files import MIB, UserFileError, read_regular_text

WEIGHTS_FILE = "model.safetensors"
EXPORT_FILE = "export.json"
MAX_SUMMARY_BYTES = 64 * MIB


class ExportError(ValueError):
  """An export that cannot be made as asked; the message names the run, the checkpoint or the output."""


def export_main(argv: list[str]) -> int:
  """``run_rl export``: exit 0 with the written directory, or 2 after one line saying why not."""
  p = UsageErrorParser(prog="run_rl export",
                       description="Write a run's trained weights as a Hugging Face checkpoint directory.")
  p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (as given to --resume)")
  p.add_argument("--out", required=True, help="a new directory for config.json, model.safetensors, tokenizer")
  p.add_argument("--checkpoint", type=int, metavar="N", help="the run's checkpoint after step N (default: newest)")
  try:
    args = p.parse_intermixed_args(argv)
    path = Path(args.run_dir)
    with sigterm_raises(), (locks.lock_run(path, flag="run_rl export") if path.is_dir()
                            else contextlib.nullcontext()):
      source = _source(path, args.checkpoint, args.out)  # the run's lock: no resume or run writes checkpoints meanwhile
      out = _check_out(Path(args.out), path, Path(source["checkpoints"]))
      summary = export(source, out)
  except (UsageError, ExportError, RunDirError, RecipeError, UserFileError, OSError) as e:
    print(f"run_rl export: error: {e}", file=sys.stderr)
    return 2
  except Terminated:
    done = (Path(args.out) / EXPORT_FILE).is_file()  # the SIGTERM came after the rename into place
    print("run_rl export: stopped by SIGTERM; " + (f"the export at {args.out} was complete before it" if done else
                                                   "nothing is at --out (the partial export was removed)"),
          file=sys.stderr)
    return 143
  print(f"run_rl export: wrote {out} from {source['checkpoint_path']} (after step {source['step']});"
        f" weights digest {summary['weights_digest']}")
  return 0


def _saved_recipe(path: Path, config: dict[str, Any]):
  """The run's recipe as config.json holds it, not validated again: an export needs none of the files the run
  read but the model checkpoint's config and tokenizer (checked against their fingerprints)."""
  values = recipe_lib.flatten(config["config"], where=f"{path / run_dir.CONFIG}")
  return recipe_lib.build({key: recipe_lib.coerce(key, value) for key, value in values.items()})


def _model(path: Path, config: dict[str, Any], recipe) -> tuple[ModelPreset, str | None]:
  """The run's model sizes, and the checkpoint directory its config and tokenizer are copied from (as the run
  read it: its fingerprint's absolute path, unchanged since)."""
  if not recipe.model.checkpoint:
    return load_preset(recipe.model.preset or DEFAULT_PRESET), None
  saved = (config.get("inputs") or {}).get("model.checkpoint") or {}
  directory = saved.get("path") or str(Path(recipe.model.checkpoint).expanduser().absolute())
  pinned = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, checkpoint=directory))
  changed = inputs.changed({"model.checkpoint": saved} if saved else {}, pinned)
  if changed:
    raise ExportError(f"{changed[0]}; the export copies the config and tokenizer the run trained with: restore"
                      " them")
  try:
    return hf_checkpoint.preset_from_config(directory, hf_checkpoint.read_config(directory)), directory
  except hf_checkpoint.CheckpointDirError as e:
    raise ExportError(f"the run's model checkpoint: {e}") from None


def _source(path: Path, step: int | None, out: str) -> dict[str, Any]:
  """The run's recipe, model and the checkpoint to export, checked: its metadata, and the files a read of its
  params touches (``checkpoint_state``); nothing else is read. ``out``: the --out a refusal's command names."""
  # import here: the checkpoints' reader pulls in orbax (JAX); the CLI's other commands start without it
  from orchestrator.engine.checkpointing import read_checkpoints

  config = run_dir.read_config(path, flag="run_rl export")
  run_dir.check_layout(path, flag="run_rl export")
  edited = run_dir.edited_keys(config)
  if edited:
    raise ExportError(f"{path / run_dir.CONFIG} was edited after the run wrote it ({', '.join(edited)}); the"
                      " checkpoints were trained with the recipe as it was: restore the file")
  recipe = _saved_recipe(path, config)
  preset, model_dir = _model(path, config, recipe)
  directory = checkpoint_dir_for(recipe, path)
  if directory is None:
    raise ExportError(f"the run in {path} used engine.backend={recipe.engine.backend}, which writes no"
                      " checkpoints: there are no trained weights to export")
  found = read_checkpoints(directory)
  digest = run_dir.recipe_sha256(config["config"])
  why = {n: _not_this_runs(n, md, config["run_id"], digest) for n, md in found.items()}
  candidates = _Candidates(path, Path(directory), sorted(n for n, problem in why.items() if problem is None), out,
                           diverged=_non_finite_step(path))
  if step is not None:
    if step not in found:
      held = ", ".join(map(str, sorted(found))) or "none"
      raise ExportError(f"--checkpoint {step}: {directory} holds no checkpoint after step {step} (it holds {held})")
    if why[step] is not None:
      raise ExportError(f"--checkpoint {step}: checkpoint {directory}/{step} {why[step]}")
    chosen = candidates.named(step)
  elif not candidates.own:
    passed = "; ".join(f"{n} {problem}" for n, problem in sorted(why.items())) or "it holds none"
    raise ExportError(f"{path}: no checkpoint of this run in {directory} ({passed}); a run writes one after its"
                      " last step, at checkpoint.every / checkpoint.scored_steps and when it is stopped")
  else:
    chosen = candidates.newest()
  skipped = sorted(n for n in found if n > chosen and why[n] is not None)
  if skipped:
    print(f"run_rl export: passing over checkpoint(s) {', '.join(map(str, skipped))} in {directory}: "
          + "; ".join(f"{n} {why[n]}" for n in skipped), file=sys.stderr)
  return {"run_dir": str(path.absolute()), "run_id": config["run_id"], "recipe": recipe, "preset": preset,
          "model_dir": model_dir, "step": chosen, "checkpoints": directory,
          "checkpoint_path": str(Path(directory) / str(chosen)), "candidates": candidates}


@dataclasses.dataclass
class _Candidates:
  """The run's own checkpoints (their metadata checked) and which of them an export may read.

  Attributes:
    run: the run directory. directory: its checkpoint directory. own: the run's own checkpoints, in order.
    out: the --out a refusal's command names.
    diverged: the step whose loss or gradient norm was not finite, where the run ended, and the summary that
      says so (None: it did not end so). A checkpoint after that many steps holds the weights that step
      trained on.
  """

  run: Path
  directory: Path
  own: list[int]
  out: str
  diverged: tuple[int, Path] | None = None

  def problem(self, step: int) -> str | None:
    """What keeps checkpoint ``step``'s params from being read (``checkpoint_state``), or None."""
    return checkpoint_state.params_problem(self.directory / str(step))

  def earlier(self, before: int) -> str:
    """The newest checkpoint before ``before`` steps whose params can be read, as the command exporting it."""
    for step in reversed([n for n in self.own if n < before]):
      if self.problem(step) is None:
        return (f"export checkpoint {step}, written before, with"
                f" `run_rl export {self.run} --checkpoint {step} --out {self.out}`")
    return f"the run holds no intact checkpoint before it in {self.directory}"

  def _diverged_line(self) -> str:
    step, summary = self.diverged
    return f"the run ended at step {step}, whose loss or gradient norm was not finite ({summary} says so)"

  def named(self, step: int) -> int:
    """``--checkpoint step``, refused when it is damaged or not before the divergence (a warning if before)."""
    if self.diverged is not None and step >= self.diverged[0]:
      raise ExportError(f"--checkpoint {step}: {self._diverged_line()}; checkpoint {step} holds the weights that"
                        f" step trained on; {self.earlier(self.diverged[0])}")
    problem = self.problem(step)
    if problem is not None:
      raise ExportError(f"--checkpoint {step}: checkpoint {self.directory}/{step} {problem}; {self.earlier(step)}")
    if self.diverged is not None:
      print(f"run_rl export: warning: {self._diverged_line()}; checkpoint {step} was written before it",
            file=sys.stderr)
    return step

  def newest(self) -> int:
    """The newest of the run's checkpoints whose params can be read; a damaged newer one is named and passed
    over. A run that ended on a non-finite step is refused, naming the checkpoint from before it."""
    if self.diverged is not None:
      raise ExportError(f"{self._diverged_line()}: its weights are not exported unasked;"
                        f" {self.earlier(self.diverged[0])}")
    damaged = []
    for step in reversed(self.own):
      problem = self.problem(step)
      if problem is None:
        if damaged:
          print(f"run_rl export: passing over damaged checkpoint(s) in {self.directory}: "
                + "; ".join(f"{n} {why}" for n, why in damaged), file=sys.stderr)
        return step
      damaged.append((step, problem))
    raise ExportError(f"{self.run}: every checkpoint of this run in {self.directory} is damaged: "
                      + "; ".join(f"{n} {why}" for n, why in damaged))


def _non_finite_step(path: Path) -> tuple[int, Path] | None:
  """The step a run ended on with a non-finite loss or gradient norm and the summary saying so; else None."""
  try:
    where = run_dir.latest_segment(path) / run_dir.SUMMARY
    summary = json.loads(read_regular_text(where, what="the run's summary", max_bytes=MAX_SUMMARY_BYTES))
  except (RunDirError, UserFileError, ValueError):
    return None  # no summary (a killed run) says nothing of how it ended
  if not isinstance(summary, dict):
    return None
  step = summary.get("non_finite_step")
  if step is None and str(summary.get("error", "")).startswith("NonFiniteStepError"):  # an older run's summary
    step = summary.get("last_step")
  return (step, where) if isinstance(step, int) and not isinstance(step, bool) else None


def _not_this_runs(step: int, metadata: Any, run_id: str, digest: str) -> str | None:
  """Why checkpoint ``step`` is not one this run wrote, or None."""
  if not isinstance(metadata, dict) or not metadata:
    return "has no readable metadata (damaged, or not written by run_rl)"
  if metadata.get("run_id") != run_id:
    return f"belongs to another run ({metadata.get('run_id')!r})"
  if metadata.get("step") != step:
    return f"says it is after step {metadata.get('step')!r}: its metadata is damaged"
  saved = metadata.get("config_sha256")
  if saved is not None and saved != digest:
    return "was written with another recipe than config.json's"
  return None


def _check_out(out: Path, run: Path, checkpoints: Path) -> Path:
  if out.exists() or out.is_symlink():
    raise ExportError(f"--out {out} already exists; an export never writes into an existing path: choose a new one")
  where = out.absolute().parent.resolve() / out.name
  for inside, what in ((run, "the run directory"), (checkpoints, "the run's checkpoint directory")):
    if where.is_relative_to(inside.resolve()):
      raise ExportError(f"--out {out} is inside {what} {inside}; the run's files are its own: choose a --out"
                        " outside it")
  existing = writable_above(out)  # missing parents are made at the write, as `mkdir -p` would
  if existing is not None:
    raise ExportError(f"--out {out}: {existing} is not a writable directory; choose a --out you can write")
  return out


def export(source: dict[str, Any], out: Path) -> dict[str, Any]:
  """Writes the checkpoint's weights, config and tokenizer into the new directory ``out``; returns
  ``export.json``'s content, written last. Everything is written into a hidden sibling of ``out`` first and
  renamed into place once complete, so ``out`` never holds a partial export; a failed write removes it."""
  # import here: the digest's JAX loads only for an export that passed its checks
  from orchestrator.engine.diagnostics import tree_digest

  params = _restore_params(source)
  _check_finite(params, source)
  for stale in remove_stale_partials(out):
    print(f"run_rl export: removed {stale}, the partial folder of an export to {out} that was killed before it"
          " finished", file=sys.stderr)
  made_parents = missing_parents(out)
  try:
    for directory in made_parents:
      _write(directory, directory.mkdir)
    partial, held = _write(out, lambda: make_partial(out))  # locked while written: not stale
  except BaseException:
    remove_empty(made_parents)
    raise
  try:
    summary = {"run_dir": source["run_dir"], "run_id": source["run_id"], "checkpoint": source["checkpoint_path"],
               "step": source["step"], "weights_digest": tree_digest(params)}
    summary["tokenizer"] = _write_files(source, params, partial, out)
    _write(out / EXPORT_FILE, lambda: (partial / EXPORT_FILE).write_text(json.dumps(summary, indent=1)))
    if out.exists() or out.is_symlink():  # appeared since the check: never replaced, never written into
      raise ExportError(f"--out {out} appeared while the export was written; choose a new --out")
    _write(out, lambda: os.rename(partial, out))
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)  # made here just now: nothing of anyone else's is in it
    remove_empty(made_parents)
    raise
  finally:
    os.close(held)
  return summary


def _write_files(source: dict[str, Any], params: dict[str, Any], into: Path, out: Path) -> str | None:
  """The weights, config.json and the tokenizer, into ``into`` (renamed to ``out`` once complete); returns
  what the tokenizer was."""
  from safetensors.numpy import save_file  # import here: only an export that passed its checks writes one

  preset = source["preset"]
  tensors = hf_checkpoint.export_tensors(params, preset)
  _write(out / WEIGHTS_FILE, lambda: save_file(tensors, str(into / WEIGHTS_FILE), metadata={"format": "pt"}))
  base = hf_checkpoint.read_config(source["model_dir"]) if source["model_dir"] else None
  tokenizer, special_ids = _write(out, lambda: _write_tokenizer(source["recipe"], source["model_dir"], into))
  config = dict(hf_checkpoint.export_config(preset, base), **special_ids)
  _write(out / hf_checkpoint.CONFIG_FILE,
         lambda: (into / hf_checkpoint.CONFIG_FILE).write_text(json.dumps(config, indent=1)))
  return tokenizer


def _write(shown: Path, write: Callable[[], Any]) -> Any:
  """``write()``; a failed write (a full disk, a read-only directory) is an ``ExportError`` naming ``shown``,
  the path as the finished export would hold it."""
  try:
    return write()
  except Exception as e:  # pylint: disable=broad-except  # safetensors reports a failed write as its own error
    if not isinstance(e, OSError) and type(e).__name__ != "SafetensorError":
      raise
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    raise ExportError(f"writing {shown} failed ({why}); the partial export was removed, nothing is at --out:"
                      " free space or choose a --out you can write, then export again") from None


def _check_finite(params: dict[str, Any], source: dict[str, Any]) -> None:
  """Refuses weights that are not all finite, naming the first such array and the checkpoint from before."""
  for name, value in _leaves(params):
    bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
    if bad:
      step = source["step"]
      raise ExportError(f"checkpoint {source['checkpoint_path']} holds weights that are not finite ({name}: {bad:,}"
                        f" of {np.size(value):,} values are NaN or infinite); {source['candidates'].earlier(step)}")


def _leaves(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
  out = []
  for key, value in tree.items():
    name = f"{prefix}.{key}" if prefix else str(key)
    out.extend(_leaves(value, name) if isinstance(value, dict) else [(name, value)])
  return out


def _write_tokenizer(recipe, model_dir: str | None, into: Path) -> tuple[str | None, dict[str, int]]:
  """The tokenizer the run sampled with, into ``into``: what it was (None: the run sampled no text), and the
  special ids ``config.json`` should name for it."""
  from orchestrator.tasks.hf_tokenizer import char_tokenizer_json  # import here: only an export writes one
  from orchestrator.tasks.tokenizer import BOS, EOS, PAD

  if model_dir:
    copied = [name for name in hf_checkpoint.TOKENIZER_FILES if (Path(model_dir) / name).is_file()]
    for name in copied:
      shutil.copyfile(Path(model_dir) / name, into / name)
    return (f"copied from {model_dir}: {', '.join(copied)}" if copied else None), {}
  if recipe.rollouts.source == "sampler":
    char_tokenizer_json(into)
    return "the live loop's character tokenizer", {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
  return None, {}


def _restore_params(source: dict[str, Any]) -> dict[str, Any]:
  """The params of the source's checkpoint as a nested dict of host numpy arrays: only the params are read
  (not the optimizer's moments), onto no device, whatever mesh wrote them. Their files were checked
  (``checkpoint_state``); a read that fails all the same is refused naming the checkpoint."""
  try:
    return _read_params(Path(source["checkpoint_path"]) / checkpoint_state.STATE)
  except Exception as e:  # pylint: disable=broad-except  # orbax and tensorstore fail in many ways on bad data
    line = str(e).splitlines()[0] if str(e) else ""
    raise ExportError(f"checkpoint {source['checkpoint_path']} cannot be read ({type(e).__name__}: {line});"
                      f" {source['candidates'].earlier(source['step'])}") from None


def _no_missing_metadata_note(record: logging.LogRecord) -> bool:
  """Drops orbax's "Metadata file does not exist" warning: reading a state directory on its own (not through the
  checkpoint manager that wrote it) never finds the step's optional metadata file, which says nothing to a user
  whose export goes on to succeed."""
  return not record.getMessage().startswith("Metadata file does not exist")


def _read_params(state_dir: Path) -> dict[str, Any]:
  """The params under a checkpoint's ``state_dir``, read by orbax (see ``_restore_params``)."""
  import orbax.checkpoint as ocp  # import here: an export that fails its checks never loads orbax

  checkpointer = ocp.PyTreeCheckpointer()
  absl_log = logging.getLogger("absl")  # orbax logs through absl
  absl_log.addFilter(_no_missing_metadata_note)
  try:
    metadata = checkpointer.metadata(state_dir)
    tree = getattr(metadata, "item_metadata", metadata)
    tree = dict(getattr(tree, "tree", tree))
    keys = [key for key in tree if key[5:].startswith("['params']")]  # key: 5-digit position, then the path
    item = {key: np.zeros(tree[key].shape, tree[key].dtype) for key in keys}
    flat = checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(
        item=item, restore_args={key: ocp.RestoreArgs(restore_type=np.ndarray) for key in keys},
        partial_restore=True))
  finally:
    absl_log.removeFilter(_no_missing_metadata_note)
  params: dict[str, Any] = {}
  for key, value in flat.items():
    parts = [a if a else int(b) for a, b in _KEY.findall(key[5:])]
    node = params
    for part in parts[1:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = np.asarray(value)
  return params


_KEY = re.compile(r"\['([^']*)'\]|\[(\d+)\]")

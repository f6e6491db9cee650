"""``run_rl export RUN_DIR --out DIR``: a run's trained weights as a Hugging Face checkpoint directory.

The weights come from the run's newest checkpoint that is its own (its run id,
step and recipe digest checked; a foreign or damaged one is passed over and
said so) or the one ``--checkpoint N`` names. ``DIR`` gets ``model.safetensors``
and ``config.json`` (the source checkpoint's, with the sizes set) and the
tokenizer the run sampled with: the source checkpoint's files, or the
character tokenizer of a preset's live run. Nothing is written into an existing
directory: the files are written into a new one beside ``DIR`` and renamed
into place once complete, so a failed export leaves nothing behind.
``export.json`` names the run, the checkpoint and the weights' digest, which a
run loading ``DIR`` (``model.checkpoint: DIR``) reproduces.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from orchestrator.app import run_dir
from orchestrator.app.arguments import UsageError, UsageErrorParser
from orchestrator.app.run_dir import RunDirError
from orchestrator.engine import hf_checkpoint
from orchestrator.recipe import RecipeError

WEIGHTS_FILE = "model.safetensors"
EXPORT_FILE = "export.json"


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
    source = _source(Path(args.run_dir), args.checkpoint)
    out = _check_out(Path(args.out))
  except (UsageError, ExportError, RunDirError, RecipeError) as e:
    print(f"run_rl export: error: {e}", file=sys.stderr)
    return 2
  summary = export(source, out)
  print(f"run_rl export: wrote {out} from {source['checkpoint_path']} (after step {source['step']});"
        f" weights digest {summary['weights_digest']}")
  return 0


def _source(path: Path, step: int | None) -> dict[str, Any]:
  """The run's recipe, model and the checkpoint to export, checked; nothing is read but metadata."""
  # import here: launch pulls in the program (JAX); the CLI's other commands start without it
  from orchestrator.app.launch import resolved_from_saved
  from orchestrator.app.runner import checkpoint_dir_for
  from orchestrator.engine.checkpointing import read_checkpoints

  config = run_dir.read_config(path, flag="run_rl export")
  edited = run_dir.edited_keys(config)
  if edited:
    raise ExportError(f"{path / run_dir.CONFIG} was edited after the run wrote it ({', '.join(edited)}); the"
                      " checkpoints were trained with the recipe as it was: restore the file")
  recipe = resolved_from_saved(config, None).recipe
  directory = checkpoint_dir_for(recipe, path)
  if directory is None:
    raise ExportError(f"the run in {path} used engine.backend={recipe.engine.backend}, which writes no"
                      " checkpoints: there are no trained weights to export")
  found = read_checkpoints(directory)
  digest = run_dir.recipe_sha256(config["config"])
  why = {n: _not_this_runs(n, md, config["run_id"], digest) for n, md in found.items()}
  own = sorted(n for n, problem in why.items() if problem is None)
  if step is not None:
    if step not in found:
      held = ", ".join(map(str, sorted(found))) or "none"
      raise ExportError(f"--checkpoint {step}: {directory} holds no checkpoint after step {step} (it holds {held})")
    if why[step] is not None:
      raise ExportError(f"--checkpoint {step}: checkpoint {directory}/{step} {why[step]}")
  elif not own:
    passed = "; ".join(f"{n} {problem}" for n, problem in sorted(why.items())) or "it holds none"
    raise ExportError(f"{path}: no checkpoint of this run in {directory} ({passed}); a run writes one at"
                      " checkpoint.every / checkpoint.scored_steps and when it is stopped")
  chosen = step if step is not None else own[-1]
  skipped = sorted(n for n in found if n > chosen and why[n] is not None)
  if skipped:
    print(f"run_rl export: passing over checkpoint(s) {', '.join(map(str, skipped))} in {directory}: "
          + "; ".join(f"{n} {why[n]}" for n in skipped), file=sys.stderr)
  return {"run_dir": str(path.absolute()), "run_id": config["run_id"], "recipe": recipe, "step": chosen,
          "checkpoints": directory, "checkpoint_path": str(Path(directory) / str(chosen))}


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


def _check_out(out: Path) -> Path:
  if out.exists() or out.is_symlink():
    raise ExportError(f"--out {out} already exists; an export never writes into an existing path: choose a new one")
  parent = out.absolute().parent
  if not parent.is_dir() or not os.access(parent, os.W_OK):
    raise ExportError(f"--out {out}: {parent} is not a writable directory; choose a --out you can write")
  return out


def export(source: dict[str, Any], out: Path) -> dict[str, Any]:
  """Writes the checkpoint's weights, config and tokenizer into the new directory ``out``; returns
  ``export.json``'s content."""
  # import here: JAX and orbax load only for an export that passed its checks
  from safetensors.numpy import save_file

  from orchestrator.engine.diagnostics import tree_digest

  recipe = source["recipe"]
  preset = recipe.model_preset()
  params = _restore_params(source["checkpoints"], source["step"])
  staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.absolute().parent))
  try:
    save_file(hf_checkpoint.export_tensors(params, preset), str(staging / WEIGHTS_FILE),
              metadata={"format": "pt"})
    base = hf_checkpoint.read_config(preset.checkpoint) if preset.checkpoint else None
    (staging / hf_checkpoint.CONFIG_FILE).write_text(json.dumps(hf_checkpoint.export_config(preset, base), indent=1))
    tokenizer = _write_tokenizer(recipe, preset, staging)
    summary = {"run_dir": source["run_dir"], "run_id": source["run_id"], "checkpoint": source["checkpoint_path"],
               "step": source["step"], "weights_digest": tree_digest(params), "tokenizer": tokenizer}
    (staging / EXPORT_FILE).write_text(json.dumps(summary, indent=1))
    os.rename(staging, out)  # fails if something appeared at --out meanwhile: nothing is overwritten
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return summary


def _write_tokenizer(recipe, preset, into: Path) -> str | None:
  """The tokenizer the run sampled with, into ``into``; what it was (None: the run sampled no text)."""
  from orchestrator.live.hf_tokenizer import char_tokenizer_json  # import here: only an export writes one

  if preset.checkpoint:
    copied = [name for name in hf_checkpoint.TOKENIZER_FILES if (Path(preset.checkpoint) / name).is_file()]
    for name in copied:
      shutil.copyfile(Path(preset.checkpoint) / name, into / name)
    return f"copied from {preset.checkpoint}: {', '.join(copied)}" if copied else None
  if recipe.rollouts.source == "sampler":
    char_tokenizer_json(into)
    return "the live loop's character tokenizer"
  return None


_KEY = re.compile(r"\['([^']*)'\]|\[(\d+)\]")


def _restore_params(directory: str, step: int) -> dict[str, Any]:
  """The params of checkpoint ``step`` as a nested dict of numpy arrays, read onto this process's first device
  (whatever mesh wrote them)."""
  import jax  # import here: an export that fails its checks never starts JAX
  import orbax.checkpoint as ocp

  from orchestrator.engine.checkpointing import Checkpointer

  checkpointer = Checkpointer(directory)
  path = checkpointer.step_path(step)
  state_dir = path / "state"
  metadata = ocp.StandardCheckpointer().metadata(state_dir)
  tree = getattr(metadata, "item_metadata", metadata)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=device) for k, v in dict(tree).items()}
  flat = ocp.StandardCheckpointer().restore(state_dir, target)
  params: dict[str, Any] = {}
  for key, value in flat.items():
    parts = [a if a else int(b) for a, b in _KEY.findall(key[5:])]  # key: 5-digit position, then the path
    if not parts or parts[0] != "params":
      continue
    node = params
    for part in parts[1:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = jax.device_get(value)
  return params

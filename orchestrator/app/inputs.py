"""The files a run reads besides its recipe, fingerprinted in ``config.json`` so a resume reads the same ones.

A recipe names its prompt files (``task.path``, ``task.eval_path``), a model
checkpoint's directory (``model.checkpoint``: its ``config.json`` and tokenizer
files; the weights are restored from the run's own checkpoint on resume), the KL
reference's (``model.reference_checkpoint``: its ``config.json`` and weights,
which no checkpoint of the run holds) and a recording (``rollouts.recording``:
its manifest). A resume that found any of
them changed would train on other prompts, another tokenizer or other rollouts
while claiming to continue the run, so it is refused, naming the file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.models.hf_checkpoint import CONFIG_FILE, TOKENIZER_FILES
from orchestrator.tasks import datasets

#: How many bytes are hashed at a time (a prompt file may be large).
CHUNK_BYTES = 1 << 20


def _files(recipe) -> dict[str, tuple[Path, list[Path]]]:
  """Each input key the recipe uses → where it is and the files that make it up, as they resolve now."""
  # import here: the assembly imports the program and gRPC; this module is read before a run is planned
  from orchestrator.assembly import resolve_path

  files: dict[str, tuple[Path, list[Path]]] = {}
  task = recipe.task
  if recipe.rollouts.source == "sampler" and task.name == "dataset":
    for key in ("path", "eval_path"):
      if getattr(task, key):
        path = datasets.resolve_path(getattr(task, key))
        files[f"task.{key}"] = (path, [path])
  if recipe.model.checkpoint:
    directory = Path(recipe.model.checkpoint).expanduser()
    files["model.checkpoint"] = (directory, [directory / name for name in (CONFIG_FILE, *TOKENIZER_FILES)
                                             if (directory / name).is_file()])
  if recipe.model.reference_checkpoint:  # its weights too: no checkpoint of the run holds them
    directory = Path(recipe.model.reference_checkpoint).expanduser()
    listed = sorted(directory.iterdir()) if directory.is_dir() else []  # gone: a resume says so
    files["model.reference_checkpoint"] = (directory, [
        path for path in listed if path.is_file() and (path.name == CONFIG_FILE or path.name.endswith(
            (".safetensors", ".safetensors.index.json")))])
  if recipe.rollouts.source == "recording" and recipe.rollouts.recording:
    manifest = resolve_path(recipe.rollouts.recording) / FINGERPRINTED_INSIDE["rollouts.recording"]
    files["rollouts.recording"] = (manifest, [manifest])
  return files


def _sha256(paths: list[Path]) -> str:
  digest = hashlib.sha256()
  for path in paths:
    digest.update(path.name.encode() + b"\0")
    with path.open("rb") as f:
      while chunk := f.read(CHUNK_BYTES):
        digest.update(chunk)
  return digest.hexdigest()


def fingerprints(recipe) -> dict[str, dict[str, Any]]:
  """What ``config.json`` keeps of each input: where it was read and the sha256 of its files."""
  return {key: {"path": str(where.absolute()), "files": [p.name for p in paths], "sha256": _sha256(paths)}
          for key, (where, paths) in _files(recipe).items() if paths}


#: Inputs fingerprinted by a file inside the directory the key names (the rest by the file or directory itself).
FINGERPRINTED_INSIDE = {"rollouts.recording": "manifest.json"}


def recorded_paths(saved: Any) -> dict[str, str]:
  """Each input key's value as the run resolved it at its start, an absolute path (from its fingerprint): a
  resume reads these, whatever its working directory. {} for a run that predates fingerprints."""
  if not isinstance(saved, Mapping):
    return {}
  out = {}
  for key, before in saved.items():
    path = before.get("path") if isinstance(before, Mapping) else None
    if isinstance(path, str) and Path(path).is_absolute():
      out[key] = str(Path(path).parent) if key in FINGERPRINTED_INSIDE else path
  return out


def changed(saved: Any, recipe) -> list[str]:
  """Each input that is not what the run read at its start, in words; [] when all are (or the run predates
  fingerprints)."""
  if not isinstance(saved, Mapping):
    return []
  now = _files(recipe)
  out = []
  for key, before in saved.items():
    if not isinstance(before, Mapping):
      continue
    _, paths = now.get(key, (None, []))
    missing = [p for p in paths if not p.is_file()]
    if missing or not paths:
      out.append(f"{key}: {missing[0] if missing else before.get('path')} is gone")
    elif [p.name for p in paths] != before.get("files") or _sha256(paths) != before.get("sha256"):
      out.append(f"{key}: {before.get('path')} changed since the run started")
  return out

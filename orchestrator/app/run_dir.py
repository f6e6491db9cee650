"""A run's directory: what it holds, how a new run claims one, and how a stopped run is found again.

    DIR/config.json     the resolved recipe, each key's source, the run's id (written first)
    DIR/records.jsonl   one BoundaryRecord per step, appended as steps finish
    DIR/summary.json    how the run ended and its medians (written at the end, or at a stop)
    DIR/trace.json      the Perfetto trace (one process group per run segment)
    DIR/checkpoints/    checkpoints, unless the recipe names another directory
    DIR/error.log       the traceback of an unexpected failure, if there was one

A run never writes into a directory that holds another run: ``claim_new``
refuses it, and ``--resume DIR`` continues the run that is there.
"""

from __future__ import annotations

import datetime
import json
import os
import uuid
from pathlib import Path
from typing import Any

CONFIG = "config.json"
RECORDS = "records.jsonl"
SUMMARY = "summary.json"
TRACE = "trace.json"
ERROR_LOG = "error.log"
CHECKPOINTS = "checkpoints"
RUN_FILES = (CONFIG, RECORDS, SUMMARY, TRACE)


class RunDirError(ValueError):
  """A run directory that cannot be used as asked (the message names it and the fix)."""


def new_run_id() -> str:
  return uuid.uuid4().hex


def holds_a_run(path: Path) -> bool:
  return path.is_dir() and any((path / name).exists() for name in RUN_FILES)


def _nearest_existing(path: Path) -> Path:
  path = path.absolute()
  while not path.exists():
    path = path.parent
  return path


def check_new(path: Path) -> None:
  """Refuses an output directory a new run cannot use; writes nothing.

  Raises:
    RunDirError: ``path`` is a file, holds a run, or cannot be created or written.
  """
  if path.exists() and not path.is_dir():
    raise RunDirError(f"--out {path} is a file, not a directory; choose a directory for the run's outputs")
  if holds_a_run(path):
    raise RunDirError(f"--out {path} already holds a run; continue it with `run_rl --resume {path}`"
                      " or choose a new --out")
  existing = _nearest_existing(path)
  if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
    raise RunDirError(f"--out {path}: {existing} is not a writable directory; choose a --out you can write")


def default_out(name: str, root: Path = Path("runs")) -> Path:
  """``runs/<name>-<time>``, with a suffix when that directory is already taken."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  path = root / f"{name}-{stamp}"
  n = 2
  while path.exists():
    path = root / f"{name}-{stamp}-{n}"
    n += 1
  return path


def claim_new(path: Path, config: dict[str, Any]) -> None:
  """Creates the run directory and writes ``config.json`` (fails if another run got there first)."""
  path.mkdir(parents=True, exist_ok=True)
  try:
    with (path / CONFIG).open("x") as f:
      json.dump(config, f, indent=2, default=str)
  except FileExistsError:
    raise RunDirError(f"--out {path} already holds a run (it appeared while this one started);"
                      " choose a new --out") from None


def read_config(path: Path, flag: str = "--resume") -> dict[str, Any]:
  """The config of the run in ``path`` (for ``--resume``, or ``flag``).

  Raises:
    RunDirError: no run there, or its config.json is unreadable.
  """
  if not path.is_dir():
    raise RunDirError(f"{flag} {path}: no such run directory")
  config_path = path / CONFIG
  if not config_path.is_file():
    raise RunDirError(f"{flag} {path}: it holds no run ({CONFIG} is missing); start one with --out {path}")
  try:
    config = json.loads(config_path.read_text(encoding="utf-8"))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise RunDirError(f"{flag} {path}: {config_path} cannot be read ({e})") from None
  if not isinstance(config, dict) or not isinstance(config.get("config"), dict) or not config.get("run_id"):
    raise RunDirError(f"{flag} {path}: {config_path} is not a run config written by run_rl")
  return config


def read_records(path: Path, count: int) -> list[dict[str, Any]]:
  """The first ``count`` records of ``records.jsonl``, read only (a torn line ends them)."""
  records_path = path / RECORDS
  lines = records_path.read_text(encoding="utf-8").splitlines() if records_path.exists() else []
  kept = []
  for line in lines[:count]:
    try:
      kept.append(json.loads(line))
    except json.JSONDecodeError:
      break
  return kept


def keep_records(path: Path, count: int) -> list[dict[str, Any]]:
  """Cuts ``records.jsonl`` to its first ``count`` records (the steps a checkpoint covers); returns them.

  Records after them belong to steps the resumed run will run again. A torn
  last line (a kill mid-write) is dropped.
  """
  kept = read_records(path, count)
  (path / RECORDS).write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
  return kept


def read_trace_events(path: Path) -> list[dict[str, Any]]:
  """The events of an earlier segment's trace, or none if it was never written (a killed run)."""
  try:
    return list(json.loads((path / TRACE).read_text(encoding="utf-8"))["traceEvents"])
  except (OSError, ValueError, KeyError, TypeError):
    return []


def write_summary(path: Path, summary: dict[str, Any]) -> None:
  tmp = path / (SUMMARY + ".tmp")
  tmp.write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
  tmp.replace(path / SUMMARY)


def merge_trace(path: Path, previous_events: list[dict[str, Any]], *, resumed_at: int) -> None:
  """Puts the earlier segments' events back in front of this segment's trace, as separate processes."""
  current = read_trace_events(path)
  offset = 10 * (max((int(e.get("pid", 0)) for e in previous_events), default=0) // 10 + 1)
  for event in current:
    event["pid"] = int(event.get("pid", 0)) + offset
    if event.get("name") == "process_name":
      event["args"] = {"name": f"{event['args']['name']} (resumed after step {resumed_at - 1})"}
  (path / TRACE).write_text(json.dumps({"traceEvents": previous_events + current, "displayTimeUnit": "ms"}),
                            encoding="utf-8")

"""A run's directory: what it holds, who may write it, and how a stopped run is found again.

    DIR/config.json     the resolved recipe, each key's source, the run's id and the recipe's digest
                        (written once, by the run that claims DIR)
    DIR/run.lock        held (an OS file lock, ``app.locks``) by the one process that runs, resumes or records into DIR
    DIR/records.jsonl   one BoundaryRecord per step of the run as started (segment 0), appended as steps finish
    DIR/summary.json    how segment 0 ended and its medians (written at its end, or at a stop)
    DIR/trace.json      segment 0's Perfetto trace
    DIR/tensorboard/    segment 0's TensorBoard event file: each step's scalars (``metrics.backends``)
    DIR/checkpoints/    checkpoints, unless the recipe names another directory
    DIR/error.log       the traceback of an unexpected failure of segment 0, if there was one
    DIR/segments/N/     resume N: segment.json (where it starts), then its own records.jsonl, summary.json,
                        trace.json, tensorboard/ and error.log (and checkpoints it moved aside with
                        --from-checkpoint)

A run never writes into a directory that holds another run (``claim_new``
refuses it), and nothing a segment completed is ever rewritten: a resume
writes a new segment, whose records begin where its checkpoint left off. The
run's records are every segment's, in order, a later segment's replacing an
earlier one's from its first step on (``run_records``); a segment's
``summary.json`` covers the whole run up to its end (the combined view), the
latest segment's being the run's.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import stat
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.user_files import MIB, UserFileError, kind_of, read_regular_bytes, read_regular_text

CONFIG = "config.json"
RECORDS = "records.jsonl"
SUMMARY = "summary.json"
TRACE = "trace.json"
ERROR_LOG = "error.log"
CHECKPOINTS = "checkpoints"
LOCK = "run.lock"
SEGMENTS = "segments"
SEGMENT = "segment.json"
SUPERSEDED_CHECKPOINTS = "superseded_checkpoints"
TENSORBOARD = "tensorboard"  # the metrics log's directory (``loop.metrics_log.TENSORBOARD_DIR``)
WANDB = "wandb"
RUN_FILES = (CONFIG, RECORDS, SUMMARY, TRACE)
# The files of a run directory (and of each segment) that a resume or an export reads, and the directories:
# each must be of its kind where it exists (a FIFO would block the read, a directory would make it fail).
FILES_READ = (CONFIG, RECORDS, SUMMARY, TRACE, SEGMENT)
DIRS_READ = (CHECKPOINTS, SEGMENTS)
# The directories a new run (or a segment) writes into beside its files: each must be one it can write.
DIRS_WRITTEN = (CHECKPOINTS, TENSORBOARD, WANDB)
# Bounds on what is read of a run's files: far above what a run writes (records: about 2 KB a step).
CONFIG_MAX_BYTES = 16 * MIB
SEGMENT_MAX_BYTES = 1 * MIB
RECORDS_MAX_BYTES = 1024 * MIB
TRACE_MAX_BYTES = 1024 * MIB
# Fields every record has (a line without them was not written by a run).
RECORD_FIELDS = ("step", "mode", "staged", "reason", "actions", "update_s", "step_s", "micro_batch_s")


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
  if holds_a_run(path) and abandoned_claim(path) is None:
    raise RunDirError(f"--out {path} already holds a run; continue it with `run_rl --resume {path}`"
                      " or choose a new --out")
  existing = _nearest_existing(path)
  if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
    raise RunDirError(f"--out {path}: {existing} is not a writable directory; choose a --out you can write")
  check_writable_dirs(path, flag="--out")


def check_writable_dirs(path: Path, *, flag: str, names: tuple[str, ...] = DIRS_WRITTEN) -> None:
  """The directories a run writes inside ``path`` (``names``: its checkpoints, TensorBoard and W&B logs) are,
  where they exist already, directories it can write; checked before anything is written (else the run would
  fail at bring-up, its directory claimed)."""
  for name in names:
    inside = path / name
    if not inside.exists() and not inside.is_symlink():
      continue
    if not inside.is_dir():
      raise RunDirError(f"{flag} {path}: {inside} is {_kind_at(inside)}, where the run writes its {name}"
                        f" directory; move it out of {path}, or choose another {flag}")
    if not os.access(inside, os.W_OK | os.X_OK):
      raise RunDirError(f"{flag} {path}: {inside} is not writable, and the run writes its {name} there; make it"
                        f" writable, or choose another {flag}")


def _kind_at(path: Path) -> str:
  """What ``path`` is, in words (a link that leads nowhere included)."""
  try:
    mode = path.stat().st_mode
  except OSError:
    return "a link that leads nowhere" if path.is_symlink() else "unreadable"
  return "a file" if stat.S_ISREG(mode) else kind_of(mode)


def check_layout(path: Path, *, flag: str) -> None:
  """Every path a resume or an export reads in the run directory ``path`` is of its kind where it exists:
  ``FILES_READ`` regular files, ``DIRS_READ`` directories, each numbered entry of ``segments/`` a segment
  directory, and each segment's own files regular files. Reads no file's content.

  Raises:
    RunDirError: naming the path, what it is and the fix.
  """
  places = [path]
  root = path / SEGMENTS
  if root.is_dir():
    for entry in sorted(root.iterdir()):
      if entry.name.isdigit() and not entry.is_dir():
        raise RunDirError(f"{flag} {path}: {entry} is {_kind_at(entry)}, where a segment directory (resume"
                          f" {entry.name}) belongs; move it out of {root}")
      if entry.name.isdigit():
        places.append(entry)
  for place in places:
    for name in FILES_READ:
      where = place / name
      if (where.exists() or where.is_symlink()) and not where.is_file():
        raise RunDirError(f"{flag} {path}: {where} is {_kind_at(where)}, not the file a run writes there; move it"
                          " out of the run directory, or restore the run's file")
  for name in DIRS_READ:
    where = path / name
    if (where.exists() or where.is_symlink()) and not where.is_dir():
      raise RunDirError(f"{flag} {path}: {where} is {_kind_at(where)}, not the directory a run writes there; move"
                        " it out of the run directory, or restore the run's directory")


def default_out(name: str, root: Path = Path("runs")) -> Path:
  """``runs/<name>-<time>``, with a suffix when that directory is already taken."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  path = root / f"{name}-{stamp}"
  n = 2
  while path.exists():
    path = root / f"{name}-{stamp}-{n}"
    n += 1
  return path


def abandoned_claim(path: Path) -> dict[str, Any] | None:
  """The claim (``config.json``) of a run that ended before its first step, if that is all ``path`` holds.

  Between its claim and its first record a run builds its engine (seconds to
  minutes); a kill then leaves ``config.json`` (beside its lock, and the empty
  or step-less ``checkpoints/`` and ``tensorboard/`` bring-up made) and nothing
  else: no record, no summary, no error log, no checkpoint, no segment. Such a
  directory holds no output of anyone's, so a new run may claim it again
  (``claim_new``, under the lock: a run still bringing itself up holds it and
  is refused by ``app.locks.lock``). Returns the abandoned ``config.json`` (for the note
  that says so), or None for anything else, which stays a run's.
  """
  if not path.is_dir() or not (path / CONFIG).is_file():
    return None
  leftovers = {p.name for p in path.iterdir()} - {CONFIG, LOCK}
  if not leftovers <= {CHECKPOINTS, TENSORBOARD} or not all((path / name).is_dir() for name in leftovers):
    return None
  if CHECKPOINTS in leftovers and any((path / CHECKPOINTS).iterdir()):
    return None
  try:
    config = json.loads(read_regular_text(path / CONFIG, what="the run's config", max_bytes=CONFIG_MAX_BYTES))
  except (UserFileError, ValueError):
    return None
  return config if isinstance(config, dict) and isinstance(config.get("run_id"), str) else None


def claim_new(path: Path, config: dict[str, Any]) -> None:
  """Writes a new run's ``config.json``, with the recipe's digest (fails if another run got there first).

  The caller holds ``path``'s lock (``app.locks.lock``), which created the directory. A
  claim a killed run left with nothing after it (``abandoned_claim``) is taken
  over, with a note naming the run that left it.
  """
  config = dict(config, digest=config_digest(config["config"]))
  abandoned = abandoned_claim(path)
  if abandoned is not None:
    (path / CONFIG).unlink()
    print(f"run_rl: note: --out {path} held only the claim of run {abandoned['run_id']}, which ended before its"
          " first step (nothing else of it is there); this run takes the directory", file=sys.stderr)
  try:
    with (path / CONFIG).open("x") as f:
      json.dump(config, f, indent=2, default=str)
  except FileExistsError:
    raise RunDirError(f"--out {path} already holds a run (it appeared while this one started);"
                      " choose a new --out") from None


def record_in_config(path: Path, key: str, value: Any) -> None:
  """Adds ``key`` (beside the recipe, which its digest covers: never inside it) to the run's ``config.json``,
  written whole to a sibling and renamed over it, so a kill leaves the old file or the new one."""
  config_path = path / CONFIG
  config = json.loads(config_path.read_text(encoding="utf-8"))
  config[key] = value
  partial = path / f".{CONFIG}.{uuid.uuid4().hex[:8]}.partial"
  partial.write_text(json.dumps(config, indent=2, default=str), encoding="utf-8")
  os.replace(partial, config_path)


def holds_only_its_lock(path: Path) -> bool:
  """Whether ``path`` is a directory that holds nothing but a lock file (taken, nothing written yet)."""
  return path.is_dir() and [p.name for p in path.iterdir()] in ([], [LOCK])


# ---------------------------------------------------------------------------- the recipe's digest
def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for name, value in tree.items():
    if isinstance(value, Mapping):
      out.update(_flat(value, f"{prefix}{name}."))
    else:
      out[f"{prefix}{name}"] = value
  return out


def _sha256(value: Any) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def recipe_sha256(config: Mapping[str, Any]) -> str:
  """The digest of a run's recipe as ``config.json`` holds it (every checkpoint of the run carries it too)."""
  return _sha256(config)


def config_digest(config: Mapping[str, Any]) -> dict[str, Any]:
  """The recipe's digest as ``config.json`` keeps it: the whole recipe's, and each key's (to name an edit)."""
  return {"sha256": _sha256(config), "keys": {key: _sha256(value)[:16] for key, value in _flat(config).items()}}


def edited_keys(config: dict[str, Any]) -> list[str] | None:
  """The recipe keys of ``config.json`` changed since the run wrote it ([] for none), or None when it carries
  no digest (a run of an older version)."""
  digest = config.get("digest")
  if not isinstance(digest, dict) or not isinstance(digest.get("keys"), dict):
    return None
  if digest.get("sha256") == _sha256(config["config"]):
    return []
  now = {key: _sha256(value)[:16] for key, value in _flat(config["config"]).items()}
  saved = digest["keys"]
  return sorted(k for k in set(now) | set(saved) if now.get(k) != saved.get(k)) or ["(the recipe's layout)"]


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
    config = json.loads(read_regular_text(config_path, what="the run's config", max_bytes=CONFIG_MAX_BYTES))
  except UserFileError as e:
    raise RunDirError(f"{flag} {path}: {e}") from None
  except json.JSONDecodeError as e:
    raise RunDirError(f"{flag} {path}: {config_path} cannot be read ({e})") from None
  if (not isinstance(config, dict) or not isinstance(config.get("config"), dict)
      or not isinstance(config.get("run_id"), str) or not config["run_id"]
      or not isinstance(config.get("sources", {}), dict)):
    raise RunDirError(f"{flag} {path}: {config_path} is not a run config written by run_rl (another tool's"
                      " file, or a run's damaged or edited): give a directory run_rl --out made, or restore it")
  return config


# ---------------------------------------------------------------------------- segments
@dataclasses.dataclass(frozen=True)
class Segment:
  """One stretch of a run: the run as started (index 0, files in DIR) or one resume (``DIR/segments/N``).

  Attributes:
    index: 0 for the run as started, N for the N-th resume.
    path: the directory holding its records, summary, trace and error log.
    first_step: the step of its first record (a later segment's records replace earlier ones from here on).
    steps: the run's length as this segment ran it (``--steps`` extends it).
    resumed_from: the checkpoint (steps done) it continued from; None for segment 0.
  """

  index: int
  path: Path
  first_step: int
  steps: int | None
  resumed_from: int | None = None

  @property
  def records_path(self) -> Path:
    return self.path / RECORDS


def segments(path: Path, config: dict[str, Any]) -> list[Segment]:
  """The run's segments in order. A segment directory without its ``segment.json`` (a resume that
  ended before it began) holds nothing and is skipped.

  Raises:
    RunDirError: a ``segment.json`` that is damaged.
  """
  steps = _flat(config.get("config", {})).get("steps")
  out = [Segment(0, path, 0, steps if isinstance(steps, int) else None)]
  for index in _segment_numbers(path):
    where = path / SEGMENTS / str(index) / SEGMENT
    if not where.exists():
      continue
    try:
      data = json.loads(read_regular_text(where, what="the segment's description", max_bytes=SEGMENT_MAX_BYTES))
      segment = Segment(index, where.parent, _count(data["first_step"]), _count(data["steps"]),
                        _count(data["resumed_from"]))
    except (ValueError, KeyError, TypeError) as e:  # UserFileError is a ValueError
      raise RunDirError(f"--resume {path}: {where} is damaged ({type(e).__name__}: {e}); restore it, or copy the"
                        " run without that segment") from None
    out.append(segment)
  return out


def _count(value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"{value!r} is not a step count")
  return value


def _segment_numbers(path: Path) -> list[int]:
  root = path / SEGMENTS
  if not root.is_dir():
    return []
  return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def new_segment(path: Path, *, first_step: int, steps: int, resumed_from: int) -> Segment:
  """Creates the next segment's directory and its ``segment.json`` (after the resume was validated).

  Raises:
    RunDirError: the directory cannot be made (``check_layout`` refused what it could foresee).
  """
  taken = [int(p.name) for p in (path / SEGMENTS).iterdir() if p.name.isdigit()] if (path / SEGMENTS).is_dir() else []
  index = max(taken, default=0) + 1  # past any numbered entry, a directory or not: a segment is never shared
  where = path / SEGMENTS / str(index)
  try:
    where.mkdir(parents=True)  # never exist_ok: a segment is never shared
  except OSError as e:
    raise RunDirError(f"--resume {path}: cannot create the new segment {where} ({e.strerror}); move what is"
                      f" there out of {path / SEGMENTS}, or make it writable") from None
  segment = Segment(index, where, first_step, steps, resumed_from)
  tmp = where / (SEGMENT + ".tmp")
  tmp.write_text(json.dumps({"first_step": first_step, "steps": steps, "resumed_from": resumed_from,
                             "started": datetime.datetime.now().isoformat(timespec="seconds")}), encoding="utf-8")
  tmp.replace(where / SEGMENT)
  return segment


def latest_segment(path: Path) -> Path:
  """The directory of the run's latest segment: its ``summary.json`` is the run's combined view."""
  return segments(path, read_config(path, flag="run directory"))[-1].path


def all_records(path: Path) -> list[dict[str, Any]]:
  """Every step's record as the run's segments now hold them (a later segment's replacing an earlier one's)."""
  return run_records(segments(path, read_config(path, flag="run directory")), needed=sys.maxsize)


# ---------------------------------------------------------------------------- records
@dataclasses.dataclass
class _Line:
  record: dict[str, Any] | None
  where: str  # "FILE line N"
  problem: str | None = None


def run_records(segs: list[Segment], needed: int) -> list[dict[str, Any]]:
  """The records of steps 0..``needed``-1 as the run's segments hold them, read only.

  Each segment's file holds consecutive steps from its ``first_step``; a later
  segment's records replace an earlier one's from its first step on. A torn
  last line of a file (a kill mid-write) is no record. Returns fewer records
  than ``needed`` when the files end before (the caller decides).

  Raises:
    RunDirError: a record the run needs is damaged (names the file and line).
  """
  by_step: dict[int, _Line] = {}
  for seg in segs:
    by_step = {step: line for step, line in by_step.items() if step < seg.first_step}
    for offset, line in enumerate(_read_lines(seg.records_path)):
      by_step[seg.first_step + offset] = line
  out = []
  for step in range(needed):
    line = by_step.get(step)
    if line is None:
      break
    if line.problem is None and line.record.get("step") != step:
      line.problem = f"it holds step {line.record.get('step')!r} where step {step} belongs"
    if line.problem is not None:
      raise RunDirError(f"{line.where} is damaged ({line.problem}); the resume needs it (step {step}): restore the"
                        " file, or resume from a checkpoint before that step with --from-checkpoint")
    out.append(line.record)
  return out


def _read_lines(records_path: Path) -> list[_Line]:
  """A records file's lines, each parsed or with its problem; a torn last line (no newline) is dropped."""
  if not records_path.exists() and not records_path.is_symlink():
    return []
  try:
    data = read_regular_bytes(records_path, what="the run's records", max_bytes=RECORDS_MAX_BYTES)
  except UserFileError as e:
    raise RunDirError(str(e)) from None
  raw = data.split(b"\n")
  torn = raw.pop()  # after the last newline: empty, or a line cut short by a kill
  del torn
  lines = []
  for number, text in enumerate(raw, start=1):
    lines.append(_parse_line(text, f"{records_path} line {number}"))
  return lines


def _parse_line(text: bytes, where: str) -> _Line:
  try:
    record = json.loads(text.decode("utf-8"))
  except UnicodeDecodeError as e:
    return _Line(None, where, f"not UTF-8 at byte {e.start}")
  except json.JSONDecodeError as e:
    return _Line(None, where, f"not JSON: {e.msg} at column {e.colno}")
  if not isinstance(record, dict):
    return _Line(None, where, f"a JSON {type(record).__name__}, not a record")
  missing = [f for f in RECORD_FIELDS if f not in record]
  if missing:
    return _Line(None, where, f"no {', '.join(missing)}")
  if isinstance(record["step"], bool) or not isinstance(record["step"], int):
    return _Line(None, where, f"step {record['step']!r} is not a step number")
  return _Line(record, where)


def read_trace_events(path: Path) -> list[dict[str, Any]]:
  """The events of a segment's trace (every earlier segment's too), or none if it was never written (a killed
  run)."""
  try:
    return list(json.loads(read_regular_text(path / TRACE, what="the trace", max_bytes=TRACE_MAX_BYTES))[
        "traceEvents"])
  except (ValueError, KeyError, TypeError):  # UserFileError (missing, not a file, too large) is a ValueError
    return []


def write_summary(path: Path, summary: dict[str, Any]) -> None:
  tmp = path / (SUMMARY + ".tmp")
  tmp.write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
  tmp.replace(path / SUMMARY)


def merge_trace(path: Path, previous_events: list[dict[str, Any]], *, resumed_at: int) -> None:
  """Puts the earlier segments' events in front of this segment's trace (in ``path``), as separate processes."""
  current = read_trace_events(path)
  offset = 10 * (max((int(e.get("pid", 0)) for e in previous_events), default=0) // 10 + 1)
  for event in current:
    event["pid"] = int(event.get("pid", 0)) + offset
    if event.get("name") == "process_name":
      event["args"] = {"name": f"{event['args']['name']} (resumed after step {resumed_at - 1})"}
  (path / TRACE).write_text(json.dumps({"traceEvents": previous_events + current, "displayTimeUnit": "ms"}),
                            encoding="utf-8")

"""A checkpoint's metadata, checked as the input it is before a resume trusts it.

A checkpoint holds, beside the engine's state, the whole run's state as JSON
(``BoundaryWork.metadata``): the step, the run's id, the policy's
state, the rollout source's position, the next boundary's plan and step
``step - 1``'s record as known at the save. Anything in a file can be damaged
or edited, so each field is typed, range-checked and cross-checked here: the
step against the checkpoint's own number and its records count, the source's
position against the step (a replayed recording is replayed again to the
same step and compared), the policy's state by loading it. ``problem`` says
what is wrong in words a refusal can carry; the resume refuses a bad latest
checkpoint by name and names the newest valid one to resume from instead.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.contract import SourceStateError
from orchestrator.data.sources import ReplaySteps, SyntheticSteps
from orchestrator.run_files.run_dir import RECORD_FIELDS
from orchestrator.user_files import MIB, UserFileError, read_regular_text
from policies import BoundaryPlan, Mode, StepBoundaryPolicy

# The keys every checkpoint of this version holds, and what each must be.
_REQUIRED = ("step", "run_id", "mode", "records_count", "source_state", "policy_state")
# The JSON files orbax reads to restore a checkpoint (relative to its step's directory): required, or read when
# there. A checkpoint's metadata grows with the model's leaves, far below this bound.
_JSON_REQUIRED = ("metadata/metadata", "state/_METADATA")
_JSON_IF_PRESENT = ("_CHECKPOINT_METADATA", "state/_sharding")
METADATA_MAX_BYTES = 256 * MIB  # as engine.checkpointing's (not imported: it loads JAX, which a refusal never does)


def files_problem(step_dir: Path) -> str | None:
  """What is missing or damaged among the files orbax reads to restore the checkpoint in ``step_dir``, or None.

  Every JSON file it parses must parse to an object (``_CHECKPOINT_METADATA``,
  the run's ``metadata/metadata``, ``state/_METADATA`` with its tree,
  ``state/_sharding``, ``state/array_metadatas/*``); ``state/`` must hold its
  OCDBT manifest, each process's manifest and data files, none of them empty.
  Only the metadata is read: a data file is checked by its kind and size.
  """
  if not (step_dir / "state").is_dir():
    return "has no state/ directory (the saved weights and optimizer state): it is incomplete or damaged"
  arrays = step_dir / "state" / "array_metadatas"
  listed = sorted(p.relative_to(step_dir).as_posix() for p in arrays.iterdir()) if arrays.is_dir() else []
  tree = None
  for name in (*_JSON_REQUIRED, *_JSON_IF_PRESENT, *listed):
    if name in _JSON_IF_PRESENT and not (step_dir / name).exists():
      continue
    value, problem = _read_json(step_dir / name)
    if problem is not None:
      return f"has a damaged {name} ({problem})"
    tree = value.get("tree_metadata") if name == "state/_METADATA" else tree
  if not isinstance(tree, dict) or not tree:
    return "has a damaged state/_METADATA (it lists no saved arrays)"
  return _data_problem(step_dir / "state")


def _read_json(path: Path) -> tuple[dict | None, str | None]:
  """A JSON object file's content, or what is wrong with it."""
  if not path.exists():
    return None, "it is missing"
  try:
    value = json.loads(read_regular_text(path, what="the file", max_bytes=METADATA_MAX_BYTES))
  except UserFileError as e:
    return None, str(e).removeprefix(f"the file {path} ").split(":")[0]
  except json.JSONDecodeError as e:
    return None, f"not JSON: {e.msg} at line {e.lineno} column {e.colno}"
  return (value, None) if isinstance(value, dict) else (None, f"a JSON {type(value).__name__}, not an object")


def _data_problem(state: Path) -> str | None:
  """The OCDBT database under ``state``: its manifests and data files, present and not empty."""
  manifests = [state / "manifest.ocdbt", *sorted(state.glob("ocdbt.process_*/manifest.ocdbt"))]
  data = [p for d in (state / "d", *sorted(state.glob("ocdbt.process_*/d"))) if d.is_dir() for p in d.iterdir()]
  if not data:
    return "has no data files in state/ (the saved arrays): it is incomplete or damaged"
  for path in (*manifests, *sorted(data)):
    try:
      info = path.stat()
    except OSError:
      return f"lacks {path.relative_to(state.parent)} (the saved arrays need it): it is incomplete or damaged"
    if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
      what = "is empty" if stat.S_ISREG(info.st_mode) else "is not a regular file"
      return f"has a damaged {path.relative_to(state.parent)} (it {what}): the saved arrays cannot be read"
  return None


def problems(checkpoints: Mapping[int, Any], *, run_id: str, source, config_sha256: str | None = None,
             payload_check=None) -> dict[int, str | None]:
  """For each checkpoint (its step → metadata): what is wrong with it, or None for one a resume can use.
  ``payload_check`` raises ValueError for a payload the engine cannot train on (rollouts a checkpoint
  carries)."""
  expected = _expected_positions(source, checkpoints)
  return {step: problem(step, metadata, run_id=run_id, source=source, expected_position=expected.get(step),
                        config_sha256=config_sha256, payload_check=payload_check)
          for step, metadata in checkpoints.items()}


def problem(step: int, metadata: Any, *, run_id: str, source, expected_position: Any = None,
            config_sha256: str | None = None, payload_check=None) -> str | None:
  """What is wrong with checkpoint ``step``'s metadata for run ``run_id`` and ``source``, or None.
  ``config_sha256``: the digest of the recipe config.json holds now (a checkpoint names the one it ran)."""
  if not isinstance(metadata, dict) or not metadata:
    return "has no metadata a resume can read (damaged, or not written by run_rl)"
  missing = [key for key in _REQUIRED if key not in metadata]
  if missing:
    return f"lacks {', '.join(missing)} in its metadata (damaged, or written by an older version)"
  if metadata["run_id"] != run_id:
    return f"belongs to another run ({metadata['run_id']!r}, not {run_id!r})"
  saved_step = metadata["step"]
  if not _is_count(saved_step) or saved_step != step:
    return f"says it is after step {saved_step!r}, but it is checkpoint {step}: its metadata is damaged"
  if step < 1:
    return "is before the first step (0 steps done): there is nothing to resume"
  if metadata["records_count"] != step or not _is_count(metadata["records_count"]):
    return f"covers {metadata['records_count']!r} records, but a checkpoint after {step} steps covers {step}"
  if not isinstance(metadata["mode"], str) or metadata["mode"] not in {m.value for m in Mode}:
    return f"names mode {metadata['mode']!r}, which is none of {', '.join(m.value for m in Mode)}"
  if "scored" in metadata and not isinstance(metadata["scored"], bool):
    return f"has scored={metadata['scored']!r}, not true or false"
  try:
    StepBoundaryPolicy(Mode.OFF).load_state_dict(metadata["policy_state"])
  except (ValueError, TypeError) as e:
    return f"holds a policy state that cannot be restored ({e})"
  if metadata.get("next_plan") is not None:
    try:
      BoundaryPlan.from_json(metadata["next_plan"])
    except (TypeError, ValueError, KeyError) as e:
      return f"holds a next-boundary plan that cannot be read ({type(e).__name__}: {e})"
  pending = metadata.get("pending_record")
  if pending is not None:
    if not isinstance(pending, dict) or pending.get("step") != step - 1:
      return f"holds a pending record that is not step {step - 1}'s"
    missing = [f for f in RECORD_FIELDS if f not in pending]
    if missing:
      return f"holds a pending record of step {step - 1} without {', '.join(missing)}"
  digest = metadata.get("config_sha256")
  if digest is not None and config_sha256 is not None and digest != config_sha256:
    return ("was written by the run's recipe as it was, not as config.json now reads (config.json was edited"
            " since): restore config.json")
  return _position_problem(step, metadata["source_state"], source, expected_position, payload_check)


def _is_count(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _expected_positions(source, checkpoints: Mapping[int, Any]) -> dict[int, Any]:
  """Where a source that can tell says it stands before each checkpoint's step (as JSON), else nothing."""
  if isinstance(source, (ReplaySteps, SyntheticSteps)):
    return {step: _as_json(state) for step, state in source.positions_at(checkpoints).items()}
  return {}


def _as_json(value: Any) -> Any:
  return json.loads(json.dumps(value))


def _position_problem(step: int, state: Any, source, expected: Any, payload_check=None) -> str | None:
  """A saved source position must be this source's, before ``step``; restoring it must work."""
  kind = getattr(source, "kind", None)
  if not isinstance(state, dict) or state.get("kind") != kind:
    got = state.get("kind") if isinstance(state, dict) else type(state).__name__
    return f"holds a rollout position of kind {got!r}, but the run's source is {kind!r}"
  next_step = state.get("next_step", step)
  if not _is_count(next_step) or next_step != step:
    return f"holds a rollout position before step {next_step!r}, but it is after step {step - 1}"
  if expected is not None and _as_json(state) != expected:
    return (f"holds a rollout position that is not where the recording stands before step {step} (the"
            " recording replayed again gives another): the position or the recording was changed")
  try:
    source.set_state(state)  # the source's own checks (a live source: the sampled steps it carries)
  except SourceStateError as e:
    return f"holds a rollout position that cannot be restored ({e})"
  except Exception as e:  # pylint: disable=broad-except  # a damaged position can fail anywhere in grain
    return f"holds a rollout position that cannot be restored ({type(e).__name__}: {e})"
  carried = getattr(source, "carried_payloads", None)  # a live source's sampled batches, trained on next
  if carried is not None and payload_check is not None:
    for carried_batch, micro, payload in carried():  # the batch named ("step 4"), a micro-batch of it
      try:
        payload_check(payload)
      except ValueError as e:
        return f"carries rollouts of {carried_batch} that cannot be trained on (micro-batch {micro}: {e})"
  return None

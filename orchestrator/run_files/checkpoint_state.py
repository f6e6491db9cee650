"""The files a read of a checkpoint's params touches, checked before they are read.

A checkpoint's engine state is orbax's OCDBT layout under ``CHECKPOINT/state``:
``_METADATA`` (JSON: every array's name), the manifests (``manifest.ocdbt``,
one per writing process) and their B-tree nodes, which name, for each array's
chunk, the data file under ``d/`` and the byte range holding it. Any of them
can be missing, cut short or replaced; orbax then fails deep inside
tensorstore, or blocks on a FIFO. ``params_problem`` says what is wrong in
words a refusal can carry, reading only the metadata, the manifests and the
B-tree nodes, each a regular file of bounded size: every data file a params
chunk lies in must be a regular file that holds its byte range.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

from orchestrator.user_files import MIB, UserFileError, check_regular, read_regular_text

STATE = "state"
METADATA = "_METADATA"
MAX_METADATA_BYTES = 256 * MIB
# A data file is never read whole (only the byte ranges the B-tree names); the bound only refuses a device.
MAX_DATA_FILE_BYTES = 1 << 44
PARAMS = "['params']"


def params_problem(checkpoint: Path) -> str | None:
  """What keeps the params of the checkpoint in ``checkpoint`` from being read, or None."""
  state = checkpoint / STATE
  if not state.is_dir():
    return f"has no {STATE}/ directory (its weights are gone)"
  try:
    sizes = _file_sizes(state)
    names = _param_names(state / METADATA)
  except (UserFileError, ValueError) as e:
    return f"has a damaged state: {e}"
  if not names:
    return f"has no params in {state / METADATA}"
  try:
    chunks = _chunks(state, names)
  except Exception as e:  # pylint: disable=broad-except  # tensorstore's errors for a damaged manifest vary
    return f"has a damaged state: its OCDBT manifest in {state} cannot be read ({_first_line(e)})"
  missing = sorted(names - {name for name, _, _ in chunks})
  if missing:
    return f"has a damaged state: {state} holds no data for {missing[0]}" + (
        f" (and {len(missing) - 1} more arrays)" if len(missing) > 1 else "")
  for name, file, end in chunks:
    if not file:  # stored inline in the B-tree node, read already
      continue
    if file not in sizes:
      return f"has a damaged state: {state / file} (data of {name}) is missing"
    if sizes[file] < end:
      return (f"has a damaged state: {state / file} (data of {name}) is {sizes[file]:,} bytes, cut short of the"
              f" {end:,} its manifest names")
  return None


def _file_sizes(state: Path) -> dict[str, int]:
  """Every file under ``state`` (relative path → bytes), each checked to be a regular file."""
  return {str(path.relative_to(state)): check_regular(path, what="the checkpoint file", max_bytes=MAX_DATA_FILE_BYTES)
          for path in sorted(state.rglob("*")) if not path.is_dir()}


def _param_names(metadata: Path) -> set[str]:
  """The names of the params arrays ``_METADATA`` lists (``00012['params']['layers']...``)."""
  text = read_regular_text(metadata, what="the checkpoint's array list", max_bytes=MAX_METADATA_BYTES)
  try:
    tree = json.loads(text)["tree_metadata"]
    keys = [ast.literal_eval(key)[0] for key in tree]
  except (ValueError, KeyError, TypeError, SyntaxError, IndexError) as e:
    raise ValueError(f"{metadata} is not the array list orbax wrote ({type(e).__name__}: {e})") from None
  return {key for key in keys if isinstance(key, str) and key[5:].startswith(PARAMS)}


def _chunks(state: Path, names: set[str]) -> list[tuple[str, str, int]]:
  """Each B-tree entry of a params array: (array name, its data file relative to ``state``, the end of its
  byte range); an entry stored inline in the node has no data file ("", 0)."""
  import tensorstore as ts  # import here: only an export that passed its other checks reads a manifest

  store = ts.KvStore.open({"driver": "file", "path": f"{state}/"}).result()
  versions = ts.ocdbt.dump(store).result().get("versions") or []
  if not versions:
    raise ValueError("the manifest lists no version")
  out: list[tuple[str, str, int]] = []
  pending = [versions[-1]["root"]["location"]]
  while pending:
    for entry in ts.ocdbt.dump(store, pending.pop()).result().get("entries", []):
      children = [v for v in _strings(entry) if v.startswith("btreenode:")]  # an interior node's entry
      pending.extend(children)
      name = _array_name(entry.get("key", ""))
      if children or name not in names:
        continue
      where = entry.get("indirect_value")
      out.append((name, *_data_range(where)) if where else (name, "", 0))
  return out


def _strings(value: Any) -> list[str]:
  if isinstance(value, str):
    return [value]
  if isinstance(value, dict):
    return [s for v in value.values() for s in _strings(v)]
  if isinstance(value, list):
    return [s for v in value for s in _strings(v)]
  return []


def _array_name(key: bytes | str) -> str:
  """``b"00012['params']['w']/0.0"`` (an entry's key: the array's name, then its chunk) → ``00012['params']['w']``."""
  text = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
  return text.rsplit("/", 1)[0]


def _data_range(location: str) -> tuple[str, int]:
  """``value:PREFIX:d/FILE:OFFSET:LENGTH`` → (``PREFIX`` + ``d/FILE``, OFFSET + LENGTH)."""
  _, prefix, file, offset, length = location.split(":")
  return prefix + file, int(offset) + int(length)


def _first_line(error: Any) -> str:
  return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

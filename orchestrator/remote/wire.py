"""The byte layout of every message between a remote trainer and its driver.

A message is one JSON header and any number of raw arrays, never pickle::

    offset  size  field
    0       4     magic b"SBT1" (the layout's version is the digit)
    4       4     header length H, unsigned little-endian
    8       H     header: UTF-8 JSON object; its "arrays" entry lists each
                  array as {"name", "dtype", "shape", "nbytes"} in order
    8+H     ...   the arrays' bytes, C order, little-endian, back to back

Dtypes come from a fixed list of plain numeric types; shapes, sizes and the
total length must agree exactly, or the message is refused. A message travels
as a stream of chunks of at most ``CHUNK_BYTES`` (gRPC caps one message), and
the receiver refuses a stream whose total passes its limit before reading on.
Trajectory payloads and weight trees have their own encodings on top
(``encode_payload``, ``encode_tree``) that round-trip bit for bit.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from orchestrator.data.trajectory import Trajectory

MAGIC = b"SBT1"
CHUNK_BYTES = 1 << 20
MAX_HEADER_BYTES = 4 << 20
DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                    "float16", "float32", "float64", "bfloat16"})


class WireError(ValueError):
  """A message that does not follow the layout (the text says which part, and what was expected)."""


class MessageTooLarge(WireError):
  """A message longer than the receiver's limit."""


def _dtype(name: str) -> np.dtype:
  if name not in DTYPES:
    raise WireError(f"array dtype {name!r} is not one of the plain numeric types {sorted(DTYPES)}")
  if name == "bfloat16":
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name).newbyteorder("<")


def encode_parts(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None) -> list:
  """One message as a list of buffers (the arrays' own memory, not copied); ``encode`` joins them."""
  specs, blobs = [], []
  for name, value in (arrays or {}).items():
    array = np.asarray(value)
    dtype = array.dtype.name
    _dtype(dtype)
    if dtype != "bfloat16" and array.dtype.byteorder == ">":
      array = array.astype(array.dtype.newbyteorder("<"))
    # Viewed as bytes, not copied (a uint8 view also carries dtypes the buffer protocol lacks, e.g. bfloat16).
    blob = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)) if array.size else b""
    specs.append({"name": name, "dtype": dtype, "shape": list(array.shape), "nbytes": len(blob)})
    blobs.append(blob)
  head = json.dumps({**header, "arrays": specs}, allow_nan=False, separators=(",", ":")).encode()
  return [MAGIC + struct.pack("<I", len(head)) + head, *blobs]


def encode(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None) -> bytes:
  """One message: ``header`` (JSON-able, without an "arrays" key) and ``arrays`` by name."""
  return b"".join(encode_parts(header, arrays))


def message_size(parts: list) -> int:
  return sum(len(p) for p in parts)


def decode(message: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """``(header, arrays)`` of one message; read-only arrays that view ``message``.

  Raises:
    WireError: a bad magic, header, dtype, shape or length (named).
  """
  view = memoryview(message)
  if len(view) < 8 or bytes(view[:4]) != MAGIC:
    raise WireError(f"not a trainer message: it starts {bytes(view[:4])!r}, expected {MAGIC!r}"
                    " (a different layout version or another protocol)")
  (size,) = struct.unpack("<I", view[4:8])
  if size > MAX_HEADER_BYTES or 8 + size > len(view):
    raise WireError(f"header length {size} is out of range for a {len(view)}-byte message")
  try:
    header = json.loads(bytes(view[8:8 + size]).decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise WireError(f"the header is not UTF-8 JSON: {e}") from None
  if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
    raise WireError("the header must be a JSON object with an 'arrays' list")
  arrays, offset = {}, 8 + size
  for spec in header.pop("arrays"):
    try:
      name, dtype, shape, nbytes = spec["name"], _dtype(spec["dtype"]), tuple(spec["shape"]), spec["nbytes"]
    except (KeyError, TypeError) as e:
      raise WireError(f"an array entry lacks {e}") from None
    if not all(isinstance(d, int) and d >= 0 for d in shape) or not isinstance(nbytes, int):
      raise WireError(f"array {name!r}: shape {list(shape)} / nbytes {nbytes!r} are not non-negative integers")
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != nbytes or offset + nbytes > len(view):
      raise WireError(f"array {name!r}: shape {list(shape)} of {dtype.name} does not match its {nbytes} bytes"
                      f" (or runs past the message's {len(view)} bytes)")
    arrays[name] = np.frombuffer(view[offset:offset + nbytes], dtype=dtype).reshape(shape)
    offset += nbytes
  if offset != len(view):
    raise WireError(f"{len(view) - offset} bytes follow the last array")
  return header, arrays


def chunks(message, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
  """A message (bytes, or ``encode_parts``' buffers) cut into pieces gRPC will carry, one copy each.

  Small buffers are packed together; one empty chunk stands for an empty message.
  """
  parts = [message] if isinstance(message, (bytes, bytearray, memoryview)) else message
  pending = bytearray()
  sent = False
  for part in parts:
    view = memoryview(part).cast("B") if not isinstance(part, bytes) else memoryview(part)
    while len(view):
      if not pending and len(view) >= chunk_bytes:
        yield bytes(view[:chunk_bytes])
        sent = True
        view = view[chunk_bytes:]
        continue
      take = min(len(view), chunk_bytes - len(pending))
      pending += view[:take]
      view = view[take:]
      if len(pending) == chunk_bytes:
        yield bytes(pending)
        sent = True
        pending = bytearray()
  if pending or not sent:
    yield bytes(pending)


def join(pieces: Iterable[bytes], max_bytes: int) -> bytes:
  """The message from its chunks, refused as soon as it passes ``max_bytes``.

  Raises:
    MessageTooLarge: the chunks add up to more than ``max_bytes``.
  """
  out, total = [], 0
  for piece in pieces:
    total += len(piece)
    if total > max_bytes:
      raise MessageTooLarge(f"a message passed the {max_bytes:,}-byte limit (trainer.max_message_bytes);"
                            " raise the limit on both sides or send smaller micro-batches")
    out.append(piece)
  return b"".join(out)


# ------------------------------------------------------------------ typed payloads
def encode_payload(method: str, payload: list, **header) -> list:
  """A micro-batch's trajectories (``encode_parts`` buffers), each array under ``t<i>.<field>``; scalars in the header."""
  arrays, rows = {}, []
  for i, t in enumerate(payload):
    arrays[f"t{i}.prompt_ids"] = t.prompt_ids
    arrays[f"t{i}.completion_ids"] = t.completion_ids
    if t.old_logprobs is not None:
      arrays[f"t{i}.old_logprobs"] = t.old_logprobs
    rows.append({"advantage": float(t.advantage), "group_id": int(t.group_id)})
  return encode_parts({"method": method, "trajectories": rows, **header}, arrays)


def decode_payload(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> list:
  rows = header.get("trajectories")
  if not isinstance(rows, list):
    raise WireError("a payload message needs a 'trajectories' list")
  out = []
  for i, row in enumerate(rows):
    try:
      out.append(Trajectory(arrays[f"t{i}.prompt_ids"], arrays[f"t{i}.completion_ids"], float(row["advantage"]),
                            arrays.get(f"t{i}.old_logprobs"), int(row["group_id"])))
    except (KeyError, TypeError, ValueError) as e:
      raise WireError(f"trajectory {i} is incomplete: {e}") from None
  return out


def encode_tree(tree: Any, **header) -> list:
  """A nested dict of arrays (weights): leaf i is array ``w<i>``, its key path (ints kept ints) in the header."""
  arrays, paths = {}, []

  def walk(node, path):
    if isinstance(node, Mapping):
      for key, value in node.items():
        if not isinstance(key, (str, int)):
          raise WireError(f"weight key {key!r} at {list(path)} is neither a string nor an integer")
        walk(value, (*path, key))
    else:
      arrays[f"w{len(paths)}"] = np.asarray(node)
      paths.append(list(path))

  walk(tree, ())
  return encode_parts({**header, "paths": paths}, arrays)


def decode_tree(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> dict:
  paths = header.get("paths")
  if not isinstance(paths, list) or len(paths) != len(arrays):
    raise WireError("a weights message needs one key path per array")
  tree: dict = {}
  for i, path in enumerate(paths):
    if not path or not all(isinstance(k, (str, int)) for k in path):
      raise WireError(f"weight {i}: key path {path!r} is not a list of strings and integers")
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = arrays[f"w{i}"]
  return tree

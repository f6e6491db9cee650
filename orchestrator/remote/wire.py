"""The byte layout of every message between a remote trainer and its driver.

A message is one JSON header and any number of raw arrays, never pickle::

    offset  size  field
    0       4     magic b"SBT1" (the layout's version is the digit)
    4       4     header length H, unsigned little-endian
    8       H     header: UTF-8 JSON object; its "arrays" entry lists each
                  array as {"name", "dtype", "shape", "nbytes"} in order
    8+H     ...   the arrays' bytes, C order, little-endian, back to back

Dtypes come from a fixed list of plain numeric types; shapes, sizes and the
total length must agree exactly, or the message is refused. The decoder's
limits, each refused as a ``WireError`` that names it: a header of at most
``MAX_HEADER_BYTES`` nested at most ``MAX_HEADER_DEPTH`` deep (the header
object is depth 1) without NaN or infinities; an array entry is an object with
a unique string name, a listed dtype, a shape of at most ``MAX_ARRAY_DIMS``
non-negative integers whose element and byte counts fit a 64-bit size, and a
byte count equal to the shape's. The ``read_*`` functions check one header field
of a request the same way (a flag is a JSON boolean, an id a non-negative
integer, a timeout a bounded positive number). A message travels
as a stream of chunks of at most ``CHUNK_BYTES`` (gRPC caps one message), and
the receiver refuses a stream whose total passes its limit before reading on.
Trajectory payloads and weight trees have their own encodings on top
(``encode_payload``, ``encode_tree``) that round-trip bit for bit.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from orchestrator.data.trajectory import Trajectory

MAGIC = b"SBT1"
CHUNK_BYTES = 1 << 20
MAX_HEADER_BYTES = 4 << 20
MAX_HEADER_DEPTH = 32  # a run's deepest header, save_checkpoint with the run's state as metadata, nests 4
MAX_ARRAY_DIMS = 32  # numpy 1.x's own limit (2.x allows 64), so a message decodes the same on both
MAX_ARRAY_BYTES = (1 << 63) - 1  # numpy refuses an array whose non-zero dimensions pass this, even when empty
DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                    "float16", "float32", "float64", "bfloat16"})


class WireError(ValueError):
  """A message that does not follow the layout (the text says which part, and what was expected)."""


class MessageTooLarge(WireError):
  """A message longer than the receiver's limit."""


def _dtype(name: Any) -> np.dtype:
  if not isinstance(name, str) or name not in DTYPES:
    raise WireError(f"array dtype {_shown(name)} is not one of the plain numeric types {sorted(DTYPES)}")
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


def _shown(value: Any, limit: int = 80) -> str:
  """``value``'s repr, cut to ``limit`` characters (a refusal quotes what it refused, not all of it)."""
  text = repr(value)
  return text if len(text) <= limit else f"{text[:limit]}..."


def _refuse_constant(name: str) -> None:
  raise WireError(f"the header holds {name}; send finite numbers only (encoders use allow_nan=False)")


def _depth_past_limit(value: Any) -> bool:
  """True when ``value`` nests deeper than ``MAX_HEADER_DEPTH`` (walked without recursion)."""
  stack = [(value, 1)]
  while stack:
    node, depth = stack.pop()
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
    if children is None:
      continue
    if depth > MAX_HEADER_DEPTH:
      return True
    stack.extend((child, depth + 1) for child in children)
  return False


def _parse_header(raw: bytes) -> dict[str, Any]:
  """The header object, within the limits in the module docstring."""
  too_deep = (f"the header nests deeper than {MAX_HEADER_DEPTH} levels (wire.MAX_HEADER_DEPTH); send a flatter"
              " header")
  try:
    header = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
  except WireError:
    raise
  except RecursionError:  # the parser's own guard stopped it, far past the limit: refused like any deep header
    raise WireError(too_deep) from None
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise WireError(f"the header is not UTF-8 JSON: {e}") from None
  except ValueError as e:  # e.g. an integer literal of more digits than Python converts
    raise WireError(f"the header holds a value JSON cannot carry here: {e}") from None
  if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
    raise WireError("the header must be a JSON object with an 'arrays' list")
  if _depth_past_limit(header):
    raise WireError(too_deep)
  return header


def _array_spec(index: int, spec: Any, seen: set[str]) -> tuple[str, np.dtype, tuple[int, ...], int]:
  """(name, dtype, shape, nbytes) of one "arrays" entry, checked; ``seen`` holds the names before it."""
  if not isinstance(spec, dict):
    raise WireError(f"array entry {index} is {_shown(spec)}, not an object with name, dtype, shape and nbytes")
  missing = [key for key in ("name", "dtype", "shape", "nbytes") if key not in spec]
  if missing:
    raise WireError(f"array entry {index} lacks {', '.join(missing)}")
  name, shape, nbytes = spec["name"], spec["shape"], spec["nbytes"]
  if not isinstance(name, str) or name in seen:
    raise WireError(f"array entry {index}: name {_shown(name)} is not a string, or names an earlier array too")
  dtype = _dtype(spec["dtype"])
  if (not isinstance(shape, list) or len(shape) > MAX_ARRAY_DIMS
      or not all(type(d) is int and d >= 0 for d in shape)):  # type(): a JSON true is no dimension
    raise WireError(f"array {name!r}: shape {_shown(shape)} is not a list of at most {MAX_ARRAY_DIMS}"
                    " non-negative integers")
  if type(nbytes) is not int or nbytes < 0:
    raise WireError(f"array {name!r}: nbytes {_shown(nbytes)} is not a non-negative integer")
  # Python integers, so neither count can wrap; numpy also refuses an empty array whose other dimensions overflow.
  if math.prod(max(d, 1) for d in shape) * dtype.itemsize > MAX_ARRAY_BYTES:
    raise WireError(f"array {name!r}: shape {_shown(shape)} of {dtype.name} overflows a 64-bit size")
  if math.prod(shape) * dtype.itemsize != nbytes:
    raise WireError(f"array {name!r}: shape {_shown(shape)} of {dtype.name} does not match its {nbytes} bytes")
  return name, dtype, tuple(shape), nbytes


def decode(message: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """``(header, arrays)`` of one message; read-only arrays that view ``message``.

  Raises:
    WireError: a bad magic, header (size, depth, JSON), dtype, shape or length, named; the limits are in the
      module docstring.
  """
  view = memoryview(message)
  if len(view) < 8 or bytes(view[:4]) != MAGIC:
    raise WireError(f"not a trainer message: it starts {bytes(view[:4])!r}, expected {MAGIC!r}"
                    " (a different layout version or another protocol)")
  (size,) = struct.unpack("<I", view[4:8])
  if size > MAX_HEADER_BYTES or 8 + size > len(view):
    raise WireError(f"header length {size} is out of range for a {len(view)}-byte message"
                    f" (at most wire.MAX_HEADER_BYTES={MAX_HEADER_BYTES:,})")
  header = _parse_header(bytes(view[8:8 + size]))
  arrays: dict[str, np.ndarray] = {}
  offset = 8 + size
  for index, spec in enumerate(header.pop("arrays")):
    name, dtype, shape, nbytes = _array_spec(index, spec, set(arrays))
    if offset + nbytes > len(view):
      raise WireError(f"array {name!r} does not match the message: its {nbytes} bytes run past the message's"
                      f" {len(view)} bytes")
    arrays[name] = np.frombuffer(view[offset:offset + nbytes], dtype=dtype).reshape(shape)
    offset += nbytes
  if offset != len(view):
    raise WireError(f"{len(view) - offset} bytes follow the last array")
  return header, arrays


# ------------------------------------------------------------------ request fields
def read_flag(header: Mapping[str, Any], key: str) -> bool:
  """Header field ``key`` as a flag: absent or null is False; anything but a JSON boolean is refused."""
  value = header.get(key)
  if value is None:
    return False
  if not isinstance(value, bool):
    raise WireError(f"header field {key!r} is {_shown(value)}; give true or false")
  return value


def read_int(header: Mapping[str, Any], key: str, *, required: bool = False) -> int | None:
  """Header field ``key`` as a non-negative integer (an id, a step); absent or null is None unless ``required``."""
  value = header.get(key)
  if value is None and not required:
    return None
  if type(value) is not int or value < 0:
    raise WireError(f"header field {key!r} is {_shown(value)}; give a non-negative integer")
  return value


def read_seconds(header: Mapping[str, Any], key: str, *, default_s: float, maximum_s: float) -> float:
  """Header field ``key`` as a positive number of seconds up to ``maximum_s``; absent or null is ``default_s``."""
  value = header.get(key)
  if value is None:
    return default_s
  if type(value) not in (int, float) or not 0 < value <= maximum_s:
    raise WireError(f"header field {key!r} is {_shown(value)}; give a number of seconds in (0, {maximum_s:g}]")
  return float(value)


def read_text(header: Mapping[str, Any], key: str) -> str | None:
  """Header field ``key`` as a string; absent or null is None."""
  value = header.get(key)
  if value is not None and not isinstance(value, str):
    raise WireError(f"header field {key!r} is {_shown(value)}; give a string")
  return value


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
  """A micro-batch's trajectories (``encode_parts`` buffers), each array under ``t<i>.<field>``; scalars in the
  header."""
  arrays, rows = {}, []
  for i, t in enumerate(payload):
    arrays[f"t{i}.prompt_ids"] = t.prompt_ids
    arrays[f"t{i}.completion_ids"] = t.completion_ids
    if t.old_logprobs is not None:
      arrays[f"t{i}.old_logprobs"] = t.old_logprobs
    if t.routing is not None:
      arrays[f"t{i}.routing"] = t.routing
    rows.append({"advantage": float(t.advantage), "group_id": int(t.group_id)})
  return encode_parts({"method": method, "trajectories": rows, **header}, arrays)


def _token_ids(arrays: Mapping[str, np.ndarray], name: str) -> np.ndarray:
  array = arrays.get(name)
  if array is None:
    raise WireError(f"the payload lacks array {name!r}")
  if array.ndim != 1 or array.dtype.kind not in "iu":
    raise WireError(f"array {name!r} is {array.dtype.name}{list(array.shape)}; token ids are one integer row")
  return array


def _trajectory(i: int, row: Any, arrays: Mapping[str, np.ndarray]) -> Trajectory:
  """Trajectory ``i`` of a payload, every field checked (the engine then checks it fits the batch)."""
  if not isinstance(row, dict):
    raise WireError(f"trajectory {i} is {_shown(row)}, not an object with advantage and group_id")
  advantage, group_id = row.get("advantage"), row.get("group_id")
  if type(advantage) not in (int, float) or not math.isfinite(advantage):
    raise WireError(f"trajectory {i}: advantage {_shown(advantage)} is not a finite number")
  if type(group_id) is not int:
    raise WireError(f"trajectory {i}: group_id {_shown(group_id)} is not an integer")
  prompt, completion = _token_ids(arrays, f"t{i}.prompt_ids"), _token_ids(arrays, f"t{i}.completion_ids")
  old_logprobs = arrays.get(f"t{i}.old_logprobs")
  if old_logprobs is not None and (old_logprobs.shape != completion.shape or old_logprobs.dtype.kind not in "fV"):
    raise WireError(f"array 't{i}.old_logprobs' is {old_logprobs.dtype.name}{list(old_logprobs.shape)}; it needs"
                    f" one float per completion token ({len(completion)})")
  routing = arrays.get(f"t{i}.routing")  # its shape and ids are the engine's to check (packing.validate_routing)
  if routing is not None and (routing.ndim != 3 or routing.dtype.kind not in "iu"):
    raise WireError(f"array 't{i}.routing' is {routing.dtype.name}{list(routing.shape)}; routing is integer"
                    " expert ids [tokens, layers, top_k]")
  return Trajectory(prompt, completion, float(advantage), old_logprobs, group_id, routing)


def decode_payload(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> list:
  """The trajectories ``encode_payload`` sent, every field checked.

  Raises:
    WireError: a missing or mistyped field or array, named.
  """
  rows = header.get("trajectories")
  if not isinstance(rows, list):
    raise WireError("a payload message needs a 'trajectories' list")
  return [_trajectory(i, row, arrays) for i, row in enumerate(rows)]


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
  """The tree ``encode_tree`` sent.

  Raises:
    WireError: paths that do not match the arrays, or that put a leaf where another path needs a subtree.
  """
  paths = header.get("paths")
  if not isinstance(paths, list) or len(paths) != len(arrays):
    raise WireError("a weights message needs one key path per array")
  tree: dict = {}
  for i, path in enumerate(paths):
    if not isinstance(path, list) or not path or not all(type(k) in (str, int) for k in path):
      raise WireError(f"weight {i}: key path {_shown(path)} is not a list of strings and integers")
    if f"w{i}" not in arrays:
      raise WireError(f"weight {i}: the message has no array 'w{i}'")
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
      if not isinstance(node, dict):
        raise WireError(f"weight {i}: key path {_shown(path)} runs through another weight's leaf")
    if path[-1] in node:
      raise WireError(f"weight {i}: key path {_shown(path)} is given twice, or is another weight's subtree")
    node[path[-1]] = arrays[f"w{i}"]
  return tree

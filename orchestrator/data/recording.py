"""Recorded rollouts: trajectory groups in ArrayRecord files with a manifest, replayed through grain.

Layout of a recording directory::

    manifest.json            schema version, counts, shapes, per-record digests, producer, and the
                             distribution the rollouts were sampled from (``sampled_distribution``)
    groups.array_record      one record per trajectory group (prompt × generations)

A record is an uncompressed ``.npz`` of the group's arrays (no pickled objects):
``prompt_ids``, ``completion_ids`` (all generations concatenated),
``completion_lengths``, ``rewards``, ``advantages``, ``old_logprobs`` (optional,
concatenated like the completions), ``generation_ids``, ``group_id``,
``policy_version``, and for rollout routing replay ``routing`` (optional): each
generation's ``[prompt + completion tokens, layers, top_k]`` int16 expert ids,
concatenated along the tokens (the manifest's ``routing`` gives layers and
top_k; null without).

The manifest's ``sampled_distribution`` — ``{"temperature": T, "token_ids": [...] or null, "top_p": p,
"top_k": k}`` — is the distribution the sampler drew from, whose log-probs are the ``old_logprobs``; replay
takes the trainer's log-probs the same way (``engine.loss.SampledDistribution``), so a replayed step's ratio
is 1 on the sampler's weights. null: the rollouts' log-probs are the model's own distribution's (synthetic
ones). A recording of the live loop written before the key existed is refused where its log-probs are used
(``live_recording_without_distribution``).

Recordings are read-only inputs: replay opens them for reading only. Every
problem with one raises ``RecordingError`` naming the file and the record.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from orchestrator.data import packing
from orchestrator.data.trajectory import TrajectoryGroup

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
DATA_FILE = "groups.array_record"
#: What a live run's recording names as its producer (``produced_by.tool``).
LIVE_LOOP_TOOL = "run_rl (live loop)"


class RecordingError(ValueError):
  """A recording that cannot be replayed (the message names the file and the record)."""


# ------------------------------------------------------------------ encoding
def encode_group(group: TrajectoryGroup) -> bytes:
  arrays = {
      "prompt_ids": np.asarray(group.prompt_ids, np.int32),
      "completion_ids": np.concatenate(group.completions).astype(np.int32),
      "completion_lengths": np.array([len(c) for c in group.completions], np.int32),
      "rewards": np.asarray(group.rewards, np.float32),
      "advantages": np.asarray(group.advantages, np.float32),
      "generation_ids": np.asarray(group.generation_ids, np.int32),
      "group_id": np.array(group.group_id, np.int64),
      "policy_version": np.array(group.policy_version, np.int64),
  }
  if group.old_logprobs is not None:
    arrays["old_logprobs"] = np.concatenate(group.old_logprobs).astype(np.float32)
  if group.routing is not None:
    arrays["routing"] = np.concatenate(group.routing).astype(packing.ROUTING_DTYPE)
  buf = io.BytesIO()
  np.savez(buf, **arrays)
  return buf.getvalue()


def decode_group(data: bytes) -> TrajectoryGroup:
  with np.load(io.BytesIO(data), allow_pickle=False) as z:
    lengths = z["completion_lengths"]
    splits = np.cumsum(lengths)[:-1]
    completions = np.split(z["completion_ids"], splits)
    old = np.split(z["old_logprobs"], splits) if "old_logprobs" in z.files else None
    routing = None
    if "routing" in z.files:  # each generation's prompt and completion tokens
      routing = np.split(z["routing"], np.cumsum(lengths + len(z["prompt_ids"]))[:-1])
    return TrajectoryGroup(
        group_id=int(z["group_id"]),
        prompt_ids=z["prompt_ids"],
        completions=completions,
        rewards=z["rewards"],
        advantages=z["advantages"],
        old_logprobs=old,
        generation_ids=z["generation_ids"],
        policy_version=int(z["policy_version"]),
        routing=routing,
    )


def digest(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def write_recording(out_dir: str | Path, groups: Iterator[TrajectoryGroup], *,
                    vocab_size: int, produced_by: dict[str, Any], sampled: dict[str, Any] | None = None) -> dict:
  """Writes groups to ``out_dir`` (ArrayRecord + manifest); returns the manifest. ``sampled``: the distribution
  the rollouts were sampled from (the module docstring's ``sampled_distribution``; None: the model's own)."""
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  writer = ArrayRecordWriter(str(out / DATA_FILE), "group_size:1")
  digests, prompt_lens, completion_lens, generations = [], [], [], set()
  has_old = None
  routing_shapes = set()
  try:
    for group in groups:
      routing_shapes |= {r.shape[1:] for r in group.routing or ()} or {None}
      data = encode_group(group)
      writer.write(data)
      digests.append(digest(data))
      prompt_lens.append(len(group.prompt_ids))
      completion_lens.extend(len(c) for c in group.completions)
      generations.add(len(group.completions))
      has_old = group.old_logprobs is not None if has_old is None else has_old
  finally:
    writer.close()

  if len(routing_shapes) > 1:
    raise ValueError(f"the groups' routing differs in shape ({sorted(map(str, routing_shapes))}): a recording"
                     " carries routing for every trajectory or none, of one model")
  routing = next(iter(routing_shapes), None)

  def stats(xs):
    return {"min": int(min(xs)), "max": int(max(xs)), "mean": float(np.mean(xs))} if xs else None

  manifest = {
      "schema_version": SCHEMA_VERSION,
      "format": "array_record",
      "files": [{"path": DATA_FILE, "records": len(digests)}],
      "num_groups": len(digests),
      "num_trajectories": len(completion_lens),
      "generations_per_group": sorted(generations),
      "vocab_size": vocab_size,
      "prompt_len": stats(prompt_lens),
      "completion_len": stats(completion_lens),
      "has_old_logprobs": bool(has_old),
      "routing": None if routing is None else {"layers": int(routing[0]), "top_k": int(routing[1])},
      "record_digests": digests,
      "produced_by": produced_by,
      "sampled_distribution": sampled,
      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
  return manifest


# ------------------------------------------------------------------ reading
@dataclasses.dataclass(frozen=True)
class Recording:
  """A validated recording directory."""

  path: Path
  manifest: dict

  @property
  def data_path(self) -> Path:
    return self.path / self.manifest["files"][0]["path"]

  @property
  def num_groups(self) -> int:
    return self.manifest["num_groups"]


def live_recording_without_distribution(manifest: dict) -> bool:
  """Whether the live loop wrote this recording before recordings stored ``sampled_distribution``: its
  ``old_logprobs`` are of a distribution (a temperature, the ids the sampler could emit) no one can know now."""
  produced_by = manifest.get("produced_by")
  tool = produced_by.get("tool") if isinstance(produced_by, dict) else None
  return tool == LIVE_LOOP_TOOL and manifest.get("has_old_logprobs") and "sampled_distribution" not in manifest


def _distribution_problem(sampled: Any, vocab_size: Any) -> str | None:
  """What is wrong with a manifest's ``sampled_distribution`` (None when nothing is)."""
  if sampled is None:
    return None
  if not isinstance(sampled, dict) or set(sampled) != {"temperature", "token_ids", "top_p", "top_k"}:
    return "sampled_distribution must be null or {\"temperature\", \"token_ids\", \"top_p\", \"top_k\"}"
  temperature, ids = sampled["temperature"], sampled["token_ids"]
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < 1e6:
    return f"sampled_distribution.temperature must be a number above 0, got {temperature!r}"
  if ids is not None:
    limit = vocab_size if isinstance(vocab_size, int) else None
    if not isinstance(ids, list) or not ids or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i and (limit is None or i < limit) for i in ids):
      return (f"sampled_distribution.token_ids must be null or a non-empty list of token ids below the"
              f" vocab_size {vocab_size}")
  return None


def _manifest_problem(manifest: Any, root: Path) -> str | None:
  """What is wrong with a manifest's shape (None when nothing is): keys, types, counts, paths."""
  if not isinstance(manifest, dict):
    return f"must be a JSON object, got {type(manifest).__name__}"
  required = {"schema_version": int, "files": list, "num_groups": int, "num_trajectories": int,
              "record_digests": list}
  for key, kind in required.items():
    if key not in manifest:
      return f"lacks the key {key!r}"
    if not isinstance(manifest[key], kind) or isinstance(manifest[key], bool):
      return f"{key} must be a {kind.__name__}, got {type(manifest[key]).__name__}"
  if manifest["schema_version"] != SCHEMA_VERSION:
    return (f"schema_version {manifest['schema_version']!r} is not supported (this build reads"
            f" {SCHEMA_VERSION}); re-record it with this version")
  files = manifest["files"]
  if len(files) != 1 or not isinstance(files[0], dict) or not isinstance(files[0].get("path"), str) \
      or not isinstance(files[0].get("records"), int):
    return "files must list exactly one {\"path\": str, \"records\": int}"
  data = (root / files[0]["path"]).resolve()
  if not data.is_relative_to(root.resolve()):
    return f"its data file {files[0]['path']!r} lies outside the recording directory"
  records = files[0]["records"]
  if manifest["num_groups"] != records:
    return f"num_groups {manifest['num_groups']} disagrees with files[0].records {records}"
  digests = manifest["record_digests"]
  if len(digests) != records or not all(isinstance(d, str) and len(d) == 64 for d in digests):
    return f"record_digests must hold {records} sha256 hex digests, one per record (it holds {len(digests)})"
  return _distribution_problem(manifest.get("sampled_distribution"), manifest.get("vocab_size"))


def _routing_problem(manifest: dict, routing: packing.RoutingShape) -> str | None:
  """Why a recording cannot be replayed with ``routing`` (None: it can)."""
  recorded = manifest.get("routing")
  if recorded is None:
    return ("was recorded without routing, but engine.router_replay is on: record it again with"
            " engine.router_replay=true, or turn the replay off")
  if recorded != {"layers": routing.layers, "top_k": routing.top_k}:
    return (f"carries routing for {recorded} (layers, experts per token), but the model has"
            f" {routing.layers} MoE layers of top-{routing.top_k}: record it with this model")
  return None


def _check_routing(group: TrajectoryGroup, routing: packing.RoutingShape, where: str) -> None:
  if group.routing is None or len(group.routing) != len(group.completions):
    raise RecordingError(f"{where}: carries no routing for its trajectories; the manifest says it does")
  for g, (completion, ids) in enumerate(zip(group.completions, group.routing)):
    try:
      packing.validate_routing(ids, len(group.prompt_ids) + len(completion), routing, f"generation {g}")
    except ValueError as e:
      raise RecordingError(f"{where} {e}") from None
    ordered = np.sort(ids, axis=-1)
    if np.any(ordered[..., 1:] == ordered[..., :-1]):
      raise RecordingError(f"{where} generation {g} routing gives one token the same expert twice in a layer;"
                           " a token's experts in a layer are distinct")


def _verify_records(source, manifest: dict, data_path: Path, vocab_size: int | None,
                    routing: packing.RoutingShape | None = None) -> None:
  """Every record's digest, token ids and (with ``routing``) routing, and the trajectory count the manifest
  claims."""
  digests = manifest["record_digests"]
  trajectories = 0
  for i in range(len(digests)):
    try:
      data = source[i]
    except Exception as e:  # pylint: disable=broad-except
      raise RecordingError(f"{data_path} record {i}: unreadable (truncated or corrupt): {e}") from None
    if digest(data) != digests[i]:
      raise RecordingError(f"{data_path} record {i}: content digest does not match the manifest (the file"
                           " changed after it was recorded)")
    try:
      group = decode_group(data)
    except Exception as e:  # pylint: disable=broad-except
      raise RecordingError(f"{data_path} record {i}: not a trajectory group ({type(e).__name__}: {e})") from None
    trajectories += len(group.completions)
    if routing is not None:
      _check_routing(group, routing, f"{data_path} record {i} (group {group.group_id})")
    if vocab_size is None:
      continue
    for name, ids in [("prompt_ids", group.prompt_ids)] + [
        (f"completion {g}", c) for g, c in enumerate(group.completions)]:
      if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids.min() if ids.min() < 0 else ids.max())
        raise RecordingError(f"{data_path} record {i} (group {group.group_id}) {name}: token id {bad} is"
                             f" outside the model's vocabulary [0, {vocab_size})")
  if trajectories != manifest["num_trajectories"]:
    raise RecordingError(f"{data_path}: holds {trajectories} trajectories but the manifest says"
                         f" {manifest['num_trajectories']}")


def read_manifest(path: str | Path) -> Any:
  """The recording directory ``path``'s manifest as parsed JSON, unchecked (``open_recording`` checks it).

  Raises:
    RecordingError: no manifest, or not JSON.
  """
  root = Path(path)
  manifest_path = root / MANIFEST
  if not manifest_path.is_file():
    raise RecordingError(f"{manifest_path}: no manifest; record one with `run_rl record --out {root}`")
  try:
    return json.loads(manifest_path.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise RecordingError(f"{manifest_path}: not valid JSON ({e})") from None


def open_recording(path: str | Path, *, vocab_size: int | None = None, verify: bool = True,
                   routing: packing.RoutingShape | None = None) -> Recording:
  """Reads and checks the manifest (and, with ``verify``, every record's digest and token ids, and with
  ``routing`` — the engine replays routing — that every trajectory carries routing of that shape).

  Raises:
    RecordingError: missing manifest, unknown schema version, missing or
      truncated data file, digest mismatch, token ids outside ``vocab_size``,
      routing missing, of another shape or naming experts the model lacks.
  """
  root = Path(path)
  manifest_path = root / MANIFEST
  manifest = read_manifest(root)
  problem = _manifest_problem(manifest, root)
  problem = problem or (_routing_problem(manifest, routing) if routing is not None else None)
  if problem:
    raise RecordingError(f"{manifest_path}: {problem}")
  recording = Recording(root, manifest)
  data_path = recording.data_path
  if not data_path.is_file():
    raise RecordingError(f"{data_path}: data file missing (the manifest lists it)")
  expected = manifest["files"][0]["records"]
  try:
    # import here: recordings are checked before JAX starts (run_rl refuses a bad one first); grain imports JAX
    from grain.sources import ArrayRecordDataSource

    source = ArrayRecordDataSource([str(data_path)])
    count = len(source)
  except Exception as e:  # array_record raises its own error types for corrupt files
    raise RecordingError(f"{data_path}: cannot be read as ArrayRecord (truncated or corrupt): {e}") from None
  if count != expected:
    raise RecordingError(
        f"{data_path}: holds {count} records but the manifest says {expected} (truncated?)"
    )
  if verify:
    _verify_records(source, manifest, data_path, vocab_size, routing)
  return recording

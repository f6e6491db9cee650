"""Packing: validate trajectories and pack them into fixed ``[rows, tokens_per_row]`` arrays.

Each trajectory becomes one segment (prompt then completion) in a row; rows are
filled first-fit in payload order, so the same payload always packs the same
way. Arrays are aligned on *targets*: position ``t`` holds the input token and
the token it predicts (``t + 1`` of the same segment); ``loss_mask`` marks the
positions whose target is a completion token.

Every call returns freshly allocated arrays: on CPU ``jax.device_put`` of an
aligned numpy array may alias it, so a reused buffer would change inputs that
are already "on the device".
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from orchestrator.data.trajectory import Trajectory

#: Names and dtypes of the packed arrays, in the order the compiled step takes them.
FIELDS: dict[str, np.dtype] = {
    "input_tokens": np.dtype(np.int32),
    "target_tokens": np.dtype(np.int32),
    "segment_ids": np.dtype(np.int32),
    "positions": np.dtype(np.int32),
    "loss_mask": np.dtype(np.float32),
    "advantages": np.dtype(np.float32),
    "old_logprobs": np.dtype(np.float32),
    "old_logprobs_mask": np.dtype(np.float32),
}


#: Rollout routing replay's field, packed only when the engine replays routing: [rows, tokens_per_row, layers,
#: top_k] expert ids (int16 holds any expert count a model has; padding positions hold 0 and are not routed).
ROUTING = "routing"
ROUTING_DTYPE = np.dtype(np.int16)


@dataclasses.dataclass(frozen=True)
class RoutingShape:
  """What a replayed routing array holds per token: ``layers`` × ``top_k`` ids in [0, ``num_experts``)."""

  layers: int
  top_k: int
  num_experts: int


def bytes_per_token_by_field(routing: RoutingShape | None = None) -> dict[str, int]:
  """Each packed field's bytes per token of a micro-batch (every field holds its values per token)."""
  out = {name: dtype.itemsize for name, dtype in FIELDS.items()}
  if routing is not None:
    out[ROUTING] = routing.layers * routing.top_k * ROUTING_DTYPE.itemsize
  return out


#: Group-normalised advantages are a few units; past this a float32 loss sum over a long step overflows.
MAX_ABS_ADVANTAGE = 1e6


#: How far above 0 a sampled log-probability may round (float32 log-softmax of a near-certain token).
LOGPROB_TOLERANCE = 1e-3


def validate_routing(routing: Any, tokens: int, shape: RoutingShape, where: str) -> None:
  """Raises ValueError naming ``where`` unless ``routing`` is [tokens, layers, top_k] integer expert ids in
  [0, num_experts)."""
  expected = (tokens, shape.layers, shape.top_k)
  if routing is None:
    raise ValueError(f"{where} carries no routing, but the engine replays the sampler's routing"
                     " (engine.router_replay): record the rollouts with routing, or turn the replay off")
  if not isinstance(routing, np.ndarray) or routing.shape != expected:
    got = getattr(routing, "shape", type(routing).__name__)
    raise ValueError(f"{where} routing has shape {got}; it must be {expected} (tokens, MoE layers, experts per"
                     " token)")
  if not np.issubdtype(routing.dtype, np.integer):
    raise ValueError(f"{where} routing has dtype {routing.dtype}; expert ids must be integers")
  lo, hi = int(routing.min()), int(routing.max())
  if lo < 0 or hi >= shape.num_experts:
    raise ValueError(f"{where} routing holds expert id {lo if lo < 0 else hi}, outside the model's"
                     f" {shape.num_experts} experts [0, {shape.num_experts})")


def validate_payload(
    payload: Sequence[Trajectory], *, tokens_per_row: int, vocab_size: int, routing: RoutingShape | None = None
) -> None:
  """Raises ValueError naming the trajectory and the limit for anything that cannot be packed; with
  ``routing``, each trajectory's routing is checked against it.

  The values are checked over the whole payload at once (a few numpy reductions, not a few per trajectory: this
  runs on the host for every micro-batch); where anything fails, the trajectories are checked one at a time, so
  the error names the first faulty trajectory and its first fault, as a check in payload order would.
  """
  if isinstance(payload, (Trajectory, str, bytes)) or not isinstance(payload, Sequence):
    raise ValueError(
        f"payload must be a list of Trajectory, got {type(payload).__name__}"
    )
  if len(payload) == 0:
    raise ValueError("payload is empty: a micro-batch needs at least one trajectory")
  if not _valid_at_once(payload, tokens_per_row=tokens_per_row, vocab_size=vocab_size, routing=routing):
    _raise_first_invalid(payload, tokens_per_row=tokens_per_row, vocab_size=vocab_size, routing=routing)


#: The values the whole-payload check reads as they are; anything else (a Python int, a Fraction, a long double, a
#: masked array, timedelta ids) is left to the check one trajectory at a time, which decides as it always did.
_PLAIN_ADVANTAGES = (float, np.float64, np.float32, np.float16)
_PLAIN_LOGPROBS = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16))


def _valid_at_once(payload: Sequence[Trajectory], *, tokens_per_row: int, vocab_size: int,
                   routing: RoutingShape | None) -> bool:
  """Whether every check of ``_raise_first_invalid`` passes, with the values' checks over the whole payload; False
  also for any value of a kind other than the plain ones it reads (the check one at a time then decides)."""
  ids, logprobs, advantages = [], [], []
  for traj in payload:
    if not isinstance(traj, Trajectory):
      return False
    for arr in (traj.prompt_ids, traj.completion_ids):
      if not (type(arr) is np.ndarray and arr.ndim == 1 and len(arr) and arr.dtype.kind in "iu"):
        return False
      ids.append(arr)
    if len(traj.prompt_ids) + len(traj.completion_ids) > tokens_per_row:
      return False
    if type(traj.advantage) not in _PLAIN_ADVANTAGES:
      return False
    advantages.append(traj.advantage)
    old = traj.old_logprobs
    if old is not None:
      if not (type(old) is np.ndarray and old.shape == traj.completion_ids.shape and old.dtype in _PLAIN_LOGPROBS):
        return False
      logprobs.append(old)
  every_id = np.concatenate(ids)
  if every_id.min() < 0 or every_id.max() >= vocab_size:
    return False
  advantage = np.asarray(advantages, np.float64)
  if not np.all(np.isfinite(advantage)) or np.any(np.abs(advantage) > MAX_ABS_ADVANTAGE):
    return False
  if logprobs:
    every_logprob = np.concatenate(logprobs)
    if not np.all(np.isfinite(every_logprob)) or np.any(every_logprob > LOGPROB_TOLERANCE):
      return False
  if routing is not None:
    try:
      for i, traj in enumerate(payload):
        validate_routing(traj.routing, traj.num_tokens, routing, f"payload[{i}]")
    except ValueError:
      return False
  return True


def _raise_first_invalid(payload: Sequence[Trajectory], *, tokens_per_row: int, vocab_size: int,
                         routing: RoutingShape | None) -> None:
  """Checks one trajectory at a time, in payload order: raises for the first fault (``validate_payload``'s
  messages), or returns where there is none."""
  for i, traj in enumerate(payload):
    if not isinstance(traj, Trajectory):
      raise ValueError(
          f"payload[{i}] is a {type(traj).__name__}, expected a Trajectory"
      )
    for name in ("prompt_ids", "completion_ids"):
      ids = traj.__getattribute__(name)
      if not isinstance(ids, np.ndarray) or ids.ndim != 1:
        raise ValueError(f"payload[{i}].{name} must be a 1-D numpy array")
      if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"payload[{i}].{name} has dtype {ids.dtype}; token ids must be integers"
        )
      if len(ids) == 0:
        raise ValueError(f"payload[{i}].{name} is empty; it needs at least one token")
      lo, hi = int(ids.min()), int(ids.max())
      if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"payload[{i}].{name} holds token id {bad}, outside the model's"
            f" vocabulary [0, {vocab_size})"
        )
    if traj.num_tokens > tokens_per_row:
      raise ValueError(
          f"payload[{i}] has {traj.num_tokens} tokens (prompt"
          f" {len(traj.prompt_ids)} + completion {len(traj.completion_ids)}),"
          f" more than tokens_per_row={tokens_per_row}"
      )
    if not np.isfinite(traj.advantage):
      raise ValueError(f"payload[{i}].advantage is {traj.advantage}; it must be finite")
    if abs(traj.advantage) > MAX_ABS_ADVANTAGE:
      raise ValueError(f"payload[{i}].advantage is {traj.advantage}; |advantage| must be <= {MAX_ABS_ADVANTAGE:g}"
                       " (larger values overflow the float32 loss sums); normalise advantages per group")
    if traj.old_logprobs is not None:
      old = traj.old_logprobs
      if not isinstance(old, np.ndarray) or old.shape != traj.completion_ids.shape:
        got = getattr(old, "shape", type(old).__name__)
        raise ValueError(
            f"payload[{i}].old_logprobs has shape {got}; it must match"
            f" completion_ids {traj.completion_ids.shape}"
        )
      if not np.issubdtype(old.dtype, np.floating):
        raise ValueError(f"payload[{i}].old_logprobs has dtype {old.dtype}; expected float")
      if not np.all(np.isfinite(old)):
        raise ValueError(f"payload[{i}].old_logprobs holds non-finite values; log-probs must be finite")
      if np.any(old > LOGPROB_TOLERANCE):
        raise ValueError(f"payload[{i}].old_logprobs holds {float(old.max()):g}; a log-probability is <= 0")
    if routing is not None:
      validate_routing(traj.routing, traj.num_tokens, routing, f"payload[{i}]")


@dataclasses.dataclass(frozen=True)
class RowAssignment:
  """Where first-fit put each trajectory.

  Attributes:
    placement: (row, offset) of each trajectory placed, in payload order.
    unplaced: index of the first trajectory that found no room; None when all fit.
  """

  placement: list[tuple[int, int]]
  unplaced: int | None

  @property
  def fits(self) -> bool:
    return self.unplaced is None


def first_fit_rows(lengths: Sequence[int], *, rows: int, tokens_per_row: int) -> RowAssignment:
  """First-fit in payload order into ``rows`` rows of ``tokens_per_row`` tokens."""
  used = [0] * rows
  placement = []
  for i, n in enumerate(lengths):
    for r in range(rows):
      if used[r] + n <= tokens_per_row:
        placement.append((r, used[r]))
        used[r] += n
        break
    else:
      return RowAssignment(placement, i)
  return RowAssignment(placement, None)


def fits(trajectories: Sequence[Trajectory], *, rows: int, tokens_per_row: int) -> bool:
  """Whether ``trajectories`` pack, in order, into ``rows`` rows of ``tokens_per_row`` tokens."""
  lengths = [t.num_tokens for t in trajectories]
  return first_fit_rows(lengths, rows=rows, tokens_per_row=tokens_per_row).fits


def pack_payload(
    payload: Sequence[Trajectory], *, rows: int, tokens_per_row: int, vocab_size: int,
    row_range: tuple[int, int] | None = None, routing: RoutingShape | None = None,
) -> dict[str, np.ndarray]:
  """Validates ``payload`` and packs it into new ``[rows, tokens_per_row]`` arrays (see FIELDS), and with
  ``routing`` each trajectory's routing into ``[rows, tokens_per_row, layers, top_k]`` (``ROUTING``).

  With ``row_range=(start, stop)`` only those rows are written (arrays of
  ``stop - start`` rows): the rows one process of several holds. Which row each
  trajectory goes to is decided over the whole payload first, so a process's
  rows are exactly those rows of the whole micro-batch.
  """
  validate_payload(payload, tokens_per_row=tokens_per_row, vocab_size=vocab_size, routing=routing)
  lengths = [t.num_tokens for t in payload]
  assignment = first_fit_rows(lengths, rows=rows, tokens_per_row=tokens_per_row)
  if not assignment.fits:
    i = assignment.unplaced
    raise ValueError(
        f"payload does not fit: payload[{i}] ({lengths[i]} tokens) finds no room in"
        f" {rows} rows of {tokens_per_row} tokens ({sum(lengths)} tokens in"
        f" {len(lengths)} trajectories); send fewer trajectories per micro-batch"
        " or raise rows / tokens_per_row"
    )
  placement = assignment.placement
  first, stop = row_range if row_range is not None else (0, rows)
  if not 0 <= first < stop <= rows:
    raise ValueError(f"row_range {row_range} is not within the micro-batch's {rows} rows")
  out = {name: np.zeros((stop - first, tokens_per_row), dtype) for name, dtype in FIELDS.items()}
  if routing is not None:
    out[ROUTING] = np.zeros((stop - first, tokens_per_row, routing.layers, routing.top_k), ROUTING_DTYPE)
  segments_in_row = [0] * rows
  for traj, (row, off) in zip(payload, placement):
    if not first <= row < stop:
      continue
    r = row - first
    prompt_len = len(traj.prompt_ids)
    n = traj.num_tokens
    seq = np.concatenate([traj.prompt_ids, traj.completion_ids]).astype(np.int32)
    span = slice(off, off + n)
    segments_in_row[r] += 1
    out["input_tokens"][r, span] = seq
    out["target_tokens"][r, off : off + n - 1] = seq[1:]
    out["segment_ids"][r, span] = segments_in_row[r]
    out["positions"][r, span] = np.arange(n, dtype=np.int32)
    # Position t predicts token t+1: completion targets start at t = prompt_len-1.
    targets = slice(off + prompt_len - 1, off + n - 1)
    out["loss_mask"][r, targets] = 1.0
    out["advantages"][r, targets] = np.float32(traj.advantage)
    if traj.old_logprobs is not None:
      out["old_logprobs"][r, targets] = traj.old_logprobs.astype(np.float32)
      out["old_logprobs_mask"][r, targets] = 1.0
    if routing is not None:
      out[ROUTING][r, span] = traj.routing
  return out


def count_loss_tokens(payload: Sequence[Trajectory]) -> int:
  """The loss denominator a payload contributes: its completion tokens."""
  return sum(len(t.completion_ids) for t in payload)


def content_digest(host_arrays: Mapping[str, np.ndarray]) -> str:
  """A digest of packed arrays (every field, in ``FIELDS`` order, then the routing where packed): same payload →
  same digest."""
  h = hashlib.blake2b(digest_size=16)
  for name in [*FIELDS, *([ROUTING] if ROUTING in host_arrays else [])]:
    h.update(name.encode())
    h.update(np.ascontiguousarray(host_arrays[name]).tobytes())
  return h.hexdigest()

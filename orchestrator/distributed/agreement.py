"""Host-side agreement between the processes of a job: every process passes the same exchanges in order.

An exchange posts this process's value under a key of the round and reads
every other process's, each within the timeout, through the coordinator's
key-value store. It never touches a device, so it never waits behind queued
compute. Rounds are numbered in call order, and each value carries the
round's tag: two processes that reach different exchanges (their paths
diverged — a bug) fail at once with both tags rather than exchanging the
wrong things.

``SingleProcess`` is the same interface for a run of one process: each
exchange returns this process's value alone.

What the step loop's processes agree on at a boundary — a stop, the
measurements the policy judges, the memory headroom it plans with — is
written here once (``agree_on_stop``, ``agree_on_measurements``,
``agree_on_headroom``), so every process combines the same way.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.contract import DeviceMemory
from policies import DeviceHeadroom

_NAMESPACE = "step_boundary"


class ProcessLostError(RuntimeError):
  """Another process did not reach an exchange in time (the message names it and the exchange)."""


class AgreementError(RuntimeError):
  """The processes reached different exchanges: their paths diverged."""


def combine_max(values: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Per key: any() of booleans, the max of numbers (None ignored; None if every value is), element-wise
  max of equal-length lists. What the policy sees when every process measured the same thing."""
  out: dict[str, Any] = {}
  for key in values[0]:
    column = [v[key] for v in values]
    present = [c for c in column if c is not None]
    if not present:
      out[key] = None
    elif isinstance(present[0], bool):
      out[key] = any(present)
    elif isinstance(present[0], list):
      out[key] = [max(items) for items in zip(*present)]
    else:
      out[key] = max(present)
  return out


class SingleProcess:
  """The agreement of a run of one process: nothing to exchange."""

  process_id = 0
  num_processes = 1
  is_primary = True

  def exchange(self, tag: str, value: Any) -> list[Any]:
    del tag
    return [value]

  def combine(self, tag: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """This process's values (see ``combine_max`` for a job of several)."""
    return combine_max(self.exchange(tag, dict(values)))

  def broadcast(self, tag: str, value: Any = None) -> Any:
    return self.exchange(tag, value)[0]


class KeyValueAgreement(SingleProcess):
  """Exchanges through the job's coordinator (``jax.distributed``'s key-value store).

  Args:
    client: the distributed runtime client (``bringup.key_value_client()``).
    process_id, num_processes: this process and the job's size.
    timeout_s: how long a process may be late to an exchange before it counts as lost.
  """

  def __init__(self, client, process_id: int, num_processes: int, *, timeout_s: float):
    self._client = client
    self.process_id, self.num_processes = process_id, num_processes
    self.is_primary = process_id == 0
    self.timeout_s = timeout_s
    self._rounds = itertools.count()
    self.exchanges = 0
    self.exchange_s: list[float] = []  # seconds per exchange (the overhead it adds)

  def exchange(self, tag: str, value: Any) -> list[Any]:
    """Every process's ``value`` for this round, in process order (JSON-serialisable values).

    Raises:
      ProcessLostError: a process did not post its value within ``timeout_s``.
      AgreementError: a process posted under another tag.
    """
    start = time.perf_counter()
    if self.num_processes == 1:  # nobody to agree with: no round trip
      self.exchanges += 1
      self.exchange_s.append(time.perf_counter() - start)
      return [value]
    round_index = next(self._rounds)
    key = f"{_NAMESPACE}/round/{round_index}/"
    self._client.key_value_set(key + str(self.process_id), json.dumps({"tag": tag, "value": value}))
    out = []
    for peer in range(self.num_processes):
      if peer == self.process_id:
        out.append(value)
        continue
      try:
        posted = json.loads(self._client.blocking_key_value_get(key + str(peer), int(self.timeout_s * 1000)))
      except Exception as e:  # pylint: disable=broad-except  # the client raises its runtime's error types
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise ProcessLostError(f"process {peer} of {self.num_processes} did not reach {tag!r} within"
                               f" {self.timeout_s:g} s ({reason})") from None
      if posted["tag"] != tag:
        raise AgreementError(f"process {peer} is at {posted['tag']!r} while process {self.process_id} is at"
                             f" {tag!r}: the processes' paths diverged")
      out.append(posted["value"])
    # Every process posted this round after reading the one before: process 0 deletes that round's keys.
    if self.is_primary and round_index > 0:
      self._client.key_value_delete(f"{_NAMESPACE}/round/{round_index - 1}")
    self.exchanges += 1
    self.exchange_s.append(time.perf_counter() - start)
    return out


def agree_on_stop(agreement: SingleProcess, k: int, asked: Any) -> str | None:
  """What asked for a stop after step k in any process (a signal's name, or "stop"), or None."""
  local = (asked if isinstance(asked, str) else "stop") if asked else None
  reasons = [r for r in agreement.exchange(f"stop after step {k}", local) if r]
  return reasons[0] if reasons else None


def agree_on_measurements(agreement: SingleProcess, step: int, measured: dict, threshold: float | None):
  """Every process's measurements of one boundary, combined as the policy sees them (the max: the slowest
  process decides, and every process decides the same); also each process's, in order (None alone)."""
  per_process = agreement.exchange(f"observe step {step}", measured)
  seen = combine_max(per_process)
  if threshold is not None and seen["device_wait_s"] >= threshold:
    seen["update_delay_s"] = None  # the slowest process did not wait below the threshold
  keys = ("stage_s", "device_wait_s")
  return seen, ({key: [m[key] for m in per_process] for key in keys} if len(per_process) > 1 else None)


def agree_on_headroom(agreement: SingleProcess, step: int, memory: DeviceMemory | None) -> DeviceHeadroom | None:
  """The headroom every process plans boundary ``step`` with: the least free memory of any device of any
  process and the most a staged input holds on one device; None where no process reports its memory."""
  local = None if memory is None else {"free_bytes": memory.free_bytes, "input_bytes": max(memory.input_bytes)}
  reports = [r for r in agreement.exchange(f"headroom step {step}", local) if r is not None]
  if not reports:
    return None
  return DeviceHeadroom(free_bytes=min(r["free_bytes"] for r in reports),
                        input_bytes=max(r["input_bytes"] for r in reports))

"""Chrome/Perfetto trace (``trace.json``) of a run: device work, idle, and host-side spans."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DEVICE_PID, HOST_PID = 1, 2


def _us(t: float, origin: float) -> float:
  return (t - origin) * 1e6


def chrome_trace(watched: Sequence[Any], host_spans: Sequence[Any], records: Sequence[Any],
                 origin: float) -> dict:
  """Trace events: one "X" event per micro-batch (``fwd_bwd``) and update (``update``) on the device
  track, named by kind with the step and micro-batch as args (so Perfetto groups every micro-batch
  as one slice name); one per boundary idle gap (device track); one per host ``Span`` (stage,
  dispatch, metrics, checkpoint, sync), on the thread of its lane; and counter tracks ("C") of
  each step's loss and, for a live run, its mean reward and how long its boundary waited for the
  next step's rollouts, at the step's update-ready time. ``records`` are ``BoundaryRecord``.

  Device start times are inferred as max(dispatch, previous ready): one device
  runs its computations in dispatch order. The rollout wait is a counter, not a
  slice: the record measures how long it was, not when it began.
  """
  events: list[dict] = [
      {"ph": "M", "pid": DEVICE_PID, "name": "process_name", "args": {"name": "device"}},
      {"ph": "M", "pid": HOST_PID, "name": "process_name", "args": {"name": "host"}},
      {"ph": "M", "pid": HOST_PID, "tid": 0, "name": "thread_name", "args": {"name": "step loop"}},
      {"ph": "M", "pid": HOST_PID, "tid": 1, "name": "thread_name", "args": {"name": "boundary work"}},
  ]
  prev_ready = None
  for item in watched:
    if item.ready_at is None:
      continue
    start = item.dispatched_at if prev_ready is None else max(item.dispatched_at, prev_ready)
    events.append({
        "ph": "X", "pid": DEVICE_PID, "tid": 0, "name": item.kind, "cat": item.kind,
        "ts": _us(start, origin), "dur": max(0.0, (item.ready_at - start) * 1e6),
        "args": {"step": item.step, "micro_step": item.micro_step},
    })
    prev_ready = item.ready_at
  for r in records:
    if r.boundary_idle_s:
      events.append({
          "ph": "X", "pid": DEVICE_PID, "tid": 0, "name": f"idle after step {r.step}", "cat": "idle",
          "ts": r.t_update_ready * 1e6, "dur": r.boundary_idle_s * 1e6, "args": {"mode": r.mode},
      })
  events += _counters(records)
  for span in host_spans:
    events.append({
        "ph": "X", "pid": HOST_PID, "tid": int(span.lane), "name": span.name, "cat": "host",
        "ts": _us(span.start, origin), "dur": max(0.0, (span.end - span.start) * 1e6),
        **({"args": span.args} if getattr(span, "args", None) else {}),
    })
  return {"traceEvents": events, "displayTimeUnit": "ms"}


#: The counter tracks of the trace: a track's name and the record field it plots, one value per step.
COUNTERS = (("loss", "loss"), ("reward", "reward_mean"), ("rollout wait (s)", "rollout_wait_s"))


def _counters(records: Sequence[Any]) -> list[dict]:
  """One "C" event per step and counter that the step's record has a value for, at its update-ready time."""
  return [{"ph": "C", "pid": DEVICE_PID, "name": track, "ts": r.t_update_ready * 1e6, "args": {track: value}}
          for r in records for track, field in COUNTERS if (value := getattr(r, field)) is not None]

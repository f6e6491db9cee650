"""A job of several processes: every process's timings into process 0's summary and trace.

Each process measures its own boundaries; at the end of the run they exchange
their timings (and the others their trace events) through the job's agreement,
and process 0 writes one summary and one trace that hold every process.
"""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.contract import AgreementCost, ProcessTimings, RunSummary
from orchestrator.distributed.agreement import SingleProcess
from orchestrator.loop.recorder import Recorder

#: Trace events each process sends process 0 (the last ones of a long run): keeps each exchange small.
MERGED_TRACE_EVENTS = 5000


def merge_process_timings(agreement: SingleProcess, recorder: Recorder, summary: RunSummary,
                          trace_path: str | None) -> RunSummary:
  """``summary`` with every process's own timings and what agreeing cost; process 0's trace gets every
  process's events."""
  mine = dict(recorder.process_timings(), wall_start=recorder.wall_start)
  # Process 0's own events are in its trace file already; the others send theirs.
  mine["trace_events"] = [] if agreement.is_primary else recorder.trace_events(MERGED_TRACE_EVENTS)
  timings = agreement.exchange("process timings", mine)
  if agreement.is_primary and trace_path and len(timings) > 1:
    merge_traces(trace_path, timings)
  processes = tuple(ProcessTimings(process_id=i, **{k: v for k, v in t.items() if k != "trace_events"})
                    for i, t in enumerate(timings))
  seconds = sorted(agreement.exchange_s)
  cost = AgreementCost(exchanges=len(seconds), median_s=seconds[len(seconds) // 2] if seconds else None,
                       max_s=seconds[-1] if seconds else None)
  return summary.replace(processes=processes, agreement=cost)


def merge_traces(trace_path: str, timings: list[dict]) -> None:
  """Adds processes 1.. to process 0's trace: their own device and host tracks, named, on process 0's
  time axis (lined up by each process's wall clock at the start of the run)."""
  path = Path(trace_path)
  trace = json.loads(path.read_text())
  for event in trace["traceEvents"]:
    if event.get("name") == "process_name":
      event["args"] = {"name": f"process 0: {event['args']['name']}"}
  for process_id, t in enumerate(timings[1:], start=1):
    shift_us = (t["wall_start"] - timings[0]["wall_start"]) * 1e6
    for event in t["trace_events"]:
      event = dict(event, pid=event["pid"] + 100 * process_id)
      if event.get("name") == "process_name":
        event["args"] = {"name": f"process {process_id}: {event['args']['name']}"}
      if "ts" in event:
        event["ts"] += shift_us
      trace["traceEvents"].append(event)
  path.write_text(json.dumps(trace))

"""The live loop with its trainer behind gRPC: the weight sync's export is the wire transfer, and it is recorded."""

from __future__ import annotations

import pytest

from orchestrator.contract import WeightTransfer
from orchestrator.loop.recorder import Lane
from orchestrator.loop.weight_sync import timed_sync


class _Spans:
  """What ``timed_sync`` hands the recorder: its spans."""

  def __init__(self):
    self.spans = []

  def span(self, name, start, end, lane):
    self.spans.append((name, start, end, lane))


class _Worker:
  def __init__(self, clock, wired: bool):
    self._clock = clock
    self.wired = wired

  def export_weights(self):
    start = self._clock.tick()
    end = self._clock.tick()
    if self.wired:  # what RemoteTrainerWorker keeps of each export
      self.last_export = WeightTransfer(bytes=1234, seconds=end - start, started_at=start, ended_at=end)
    return {"w": 1}


class _Clock:
  def __init__(self):
    self.now = 0.0

  def tick(self):
    self.now += 1.0
    return self.now

  __call__ = tick


@pytest.mark.parametrize("wired", [True, False], ids=["remote", "local"])
def test_the_weight_sync_records_a_remote_export_as_its_wire_part(wired):
  """A worker whose export crosses a wire (``WeightsOverWire``) gets its bytes, seconds and a span inside the
  sync's; a worker in this process (the negative control) gets none of them."""
  clock, recorder, spans, synced = _Clock(), _Spans(), {}, []
  worker = _Worker(clock, wired)
  timed_sync(lambda version, weights: synced.append((version, weights)), worker, recorder, clock, spans, 3)
  assert synced == [(3, {"w": 1})] and spans["weight_sync_s"] == 3.0
  if not wired:
    assert "weight_sync_wire_bytes" not in spans and [s[0] for s in recorder.spans] == ["weight sync 3"]
    return
  assert spans["weight_sync_wire_bytes"] == 1234 and spans["weight_sync_wire_s"] == 1.0
  assert [s[0] for s in recorder.spans] == ["weight sync 3", "weight wire transfer 3"]
  assert recorder.spans[0][1] < recorder.spans[1][1] < recorder.spans[1][2] < recorder.spans[0][2]
  assert {s[3] for s in recorder.spans} == {Lane.BOUNDARY_WORK}

"""The live loop with its trainer behind gRPC: the weight sync's export is the wire transfer, and it is recorded;
a remote trainer on a mesh trains what a local one on that mesh trains.

The spawned-trainer run (one child process with two forced host devices, driving a spawned serve-trainer on a
2-device fsdp mesh beside a local run on the same mesh) is the slow part; the recording of the wire part is
checked without one too.
"""

from __future__ import annotations

import json

import pytest

from orchestrator.contract import WeightTransfer
from orchestrator.loop.recorder import Lane
from orchestrator.loop.boundary_work import BoundaryWork
from orchestrator.remote import wire
from tests.conftest import run_child

LIVE = ["steps=6", "rollouts.groups_per_micro_batch=2", "batch.rows=4", "task.eval_prompts=4",
        "run.reserve_host_core=false"]


class _Spans:
  """What ``BoundaryWork.sync`` hands the recorder: its spans."""

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


@pytest.mark.engine
@pytest.mark.parametrize("wired", [True, False], ids=["remote", "local"])
def test_the_weight_sync_records_a_remote_export_as_its_wire_part(wired):
  """A worker whose export crosses a wire (``WeightsOverWire``) gets its bytes, seconds and a span inside the
  sync's; a worker in this process (the negative control) gets none of them."""
  clock, recorder, spans, synced = _Clock(), _Spans(), {}, []
  worker = _Worker(clock, wired)
  BoundaryWork(worker=worker, recorder=recorder, clock=clock,
               weight_sync=lambda version, weights: synced.append((version, weights))).sync(spans, 3)
  assert synced == [(3, {"w": 1})] and spans["weight_sync_s"] == 3.0
  if not wired:
    assert "weight_sync_wire_bytes" not in spans and [s[0] for s in recorder.spans] == ["weight sync 3"]
    return
  assert spans["weight_sync_wire_bytes"] == 1234 and spans["weight_sync_wire_s"] == 1.0
  assert [s[0] for s in recorder.spans] == ["weight sync 3", "weight wire transfer 3"]
  assert recorder.spans[0][1] < recorder.spans[1][1] < recorder.spans[1][2] < recorder.spans[0][2]
  assert {s[3] for s in recorder.spans} == {Lane.BOUNDARY_WORK}


_CHILD = '''
import contextlib, io, json, os, sys
from orchestrator.app import cli
from orchestrator import recipe as recipe_lib
for name in recipe_lib.ENV_SWITCHES:
  os.environ.pop(name, None)
LIVE, OUT = {live!r}, {out!r}
out = {{}}
for name, extra in (("local", []), ("remote", ["trainer.location=remote", "trainer.spawn=true"])):
  with contextlib.redirect_stdout(io.StringIO()):
    code = cli.main([*LIVE, "mesh.fsdp=2", *extra, "--out", f"{{OUT}}/{{name}}"])
  assert code == 0, (name, code)
  summary = json.load(open(f"{{OUT}}/{{name}}/summary.json"))
  records = [json.loads(line) for line in open(f"{{OUT}}/{{name}}/records.jsonl")]
  trace = json.load(open(f"{{OUT}}/{{name}}/trace.json"))["traceEvents"]
  out[name] = {{"summary": summary, "records": records,
               "spans": [e for e in trace if e.get("name", "").startswith("weight")]}}
print("RESULT " + json.dumps(out))
print("CHILD-OK")
'''


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
  """A live run on a 2-device fsdp mesh, local and over a spawned trainer (one child process, two devices)."""
  out = tmp_path_factory.mktemp("live-remote")
  stdout = run_child(_CHILD.format(live=LIVE, out=str(out)), devices=2)
  line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
  return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def weights_message_bytes(tiny_engine_and_start):
  """The bytes of an export's reply for the tiny model: its weights and the header that lists them (the
  parameters' shapes do not depend on the mesh, the batch or their values)."""
  import jax

  engine, _ = tiny_engine_and_start
  weights = jax.device_get(engine.export_weights())
  return wire.message_size(wire.encode_tree(weights)), sum(leaf.nbytes for leaf in jax.tree.leaves(weights))


@pytest.mark.e2e
@pytest.mark.slow
def test_a_spawned_trainer_on_an_fsdp_mesh_trains_the_local_run_and_records_the_wire(fsdp_runs,
                                                                                     weights_message_bytes):
  local, remote = fsdp_runs["local"], fsdp_runs["remote"]
  assert remote["summary"]["trainer"]["spawned"] is True and remote["summary"]["ended"] == "completed"
  # The same rollouts (the driver's sampler got every version over the wire) and the same training.
  assert [r["reward_mean"] for r in remote["records"]] == [r["reward_mean"] for r in local["records"]]
  assert remote["summary"]["final_state_digest"] == local["summary"]["final_state_digest"]

  # Every step's sync moved the whole reply: the parameters' bytes and the header naming them.
  message, params = weights_message_bytes
  assert params < message < params + 16384
  records = remote["records"]
  assert [r["weight_sync_wire_bytes"] for r in records] == [message] * len(records)
  assert all(0 < r["weight_sync_wire_s"] <= r["weight_sync_s"] for r in records)
  assert all(r["weight_sync_bytes"] is None and r["weight_transfer_s"] is None for r in records)  # no split
  # Each wire transfer is a span inside its sync's.
  spans = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in remote["spans"]}
  for step in range(1, len(records) + 1):
    (sync_start, sync_end), (wire_start, wire_end) = spans[f"weight sync {step}"], spans[f"weight wire transfer {step}"]
    assert sync_start <= wire_start <= wire_end <= sync_end

  # Negative control: a trainer in this process moves nothing over a wire.
  assert all(r["weight_sync_wire_bytes"] is None and r["weight_sync_wire_s"] is None for r in local["records"])
  assert not [e for e in local["spans"] if e["name"].startswith("weight wire")]

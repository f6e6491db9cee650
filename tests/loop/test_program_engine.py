"""RLProgram on the real tiny engine: modes train identically; staging removes boundary idle."""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import pytest

from orchestrator.contract import CheckpointingEngine, DeviceMemory, StagingEngine, TrainingEngine, WeightSource
from orchestrator.data.trajectory import Trajectory
from orchestrator.loop.program import ProgramConfig, RLProgram
from orchestrator.loop.trainer_worker import TrainerWorker
from policies import BoundaryPlan, Mode, StepBoundaryPolicy, boundary_actions

pytestmark = pytest.mark.engine

STEPS, MICRO = 4, 2


def _run(engine, source, mode, *, out_dir=None, steps=STEPS, weight_sync=None, wait_threshold_s=0.0, **policy_kw):
  """Runs the program. The pinned zero threshold never judges a wait low, so no staged mode here turns its
  staging off because the machine is loaded; the auto-disable test passes its own (and a fake's waits)."""
  worker = TrainerWorker(engine)
  policy = StepBoundaryPolicy(mode, engine_can_stage=worker.capabilities.can_stage,
                              wait_threshold_s=wait_threshold_s, **policy_kw)
  program = RLProgram(
      worker, policy, source.steps(steps, MICRO),
      ProgramConfig(steps=steps, micro_batches_per_step=MICRO, out_dir=out_dir),
      weight_sync=weight_sync,
  )
  return program.run(), policy


@pytest.fixture(scope="module")
def digests_per_mode(tiny_engine_and_start, tiny_source):
  engine, start = tiny_engine_and_start
  out = {}
  for mode in Mode:
    engine.restore(start)
    result, _ = _run(engine, tiny_source, mode)
    out[mode] = (result.summary.final_state_digest, [r.loss for r in result.records])
  return out


@pytest.mark.parametrize("mode", [m for m in Mode if m is not Mode.OFF], ids=lambda m: m.name)
def test_every_mode_trains_bit_identically_to_off(digests_per_mode, mode):
  assert digests_per_mode[mode] == digests_per_mode[Mode.OFF]


def test_control_boundaries_train_to_the_same_digest(digests_per_mode, tiny_engine_and_start, tiny_source):
  engine, start = tiny_engine_and_start
  engine.restore(start)
  result, policy = _run(engine, tiny_source, Mode.STAGE_BEFORE_UPDATE, control_every=2)
  assert [r.control for r in result.records] == [False, True, False, False]  # the second boundary that would stage
  assert not result.records[1].staged and policy.counters["controls"] == 1
  assert (result.summary.final_state_digest, [r.loss for r in result.records]) == digests_per_mode[
      Mode.STAGE_BEFORE_UPDATE]


def test_records_trace_and_summary_are_written(tiny_engine, tiny_source, tmp_path):
  result, _ = _run(tiny_engine, tiny_source, Mode.STAGE_BEFORE_UPDATE, out_dir=str(tmp_path))
  lines = (tmp_path / "records.jsonl").read_text().splitlines()
  records = [json.loads(line) for line in lines]
  assert [r["step"] for r in records] == list(range(STEPS))
  for r in records[:-1]:
    assert r["staged"] and r["stage_before_update"] and r["stage_s"] > 0
    assert r["device_wait_s"] is not None and r["boundary_idle_s"] >= 0
    assert r["boundary_idle_strict_s"] >= r["boundary_idle_s"]
    assert len(r["micro_batch_s"]) == MICRO and r["step_s"] > 0
    assert r["staged_digest"]
  assert records[-1]["boundary_idle_s"] is None  # no next step
  # what a staged input holds, by field: the placed arrays' bytes, in the record, the stage's span and the summary
  by_field = tiny_engine.prepare_fwd_bwd_input(tiny_source.micro_batch(1, 0)).bytes_by_field
  assert sum(by_field.values()) == sum(records[0]["staged_bytes_per_device"])
  assert all(r["staged_bytes_by_field"] == by_field for r in records[:-1])
  assert records[-1]["staged_bytes_by_field"] is None
  trace = json.loads((tmp_path / "trace.json").read_text())
  events = trace["traceEvents"]
  assert {"fwd_bwd", "update", "stage"} <= {e["name"] for e in events}
  stages = [e for e in events if e["name"] == "stage"]
  assert len(stages) == STEPS - 1 and all(e["args"]["bytes"] == sum(by_field.values()) for e in stages)
  assert stages[0]["args"]["bytes input_tokens"] == by_field["input_tokens"]
  assert result.summary.timings.staged_bytes_by_field == by_field
  slices = {(e["name"], e["args"]["step"], e["args"]["micro_step"]) for e in events
            if e.get("cat") in ("fwd_bwd", "update")}
  assert {("fwd_bwd", 0, 0), ("update", 0, -1), ("fwd_bwd", 3, 1)} <= slices
  loss = [e for e in events if e["ph"] == "C" and e["name"] == "loss"]
  assert [e["args"]["loss"] for e in loss] == [r["loss"] for r in records]
  s = result.summary
  assert s.timings.staged_boundaries == STEPS - 1 and s.final_state_digest == tiny_engine.state_digest()
  assert s.records_path.endswith("records.jsonl") and s.trace_path.endswith("trace.json")


def test_staged_micro_batch_is_the_next_steps_first(tiny_engine, tiny_source):
  result, policy = _run(tiny_engine, tiny_source, Mode.STAGE_AFTER_UPDATE)
  assert [r.staged for r in result.records] == [True] * (STEPS - 1) + [False] and policy.history == []
  for r in result.records[:-1]:
    expected = tiny_engine.prepare_fwd_bwd_input(tiny_source.micro_batch(r.step + 1, 0)).digest
    assert r.staged_digest == expected


class _Forwarding:
  """The tiny engine behind a proxy whose every contract method is a real method (a ``__getattr__`` that
  forwards them is not seen by ``isinstance`` against a Protocol from Python 3.12 on)."""

  def __init__(self, engine):
    self._engine = engine

  def fwd_bwd(self, payload_or_prepared, apply_optimizer=False):
    return self._engine.fwd_bwd(payload_or_prepared, apply_optimizer=apply_optimizer)

  def update(self):
    return self._engine.update()

  def get_metrics(self):
    return self._engine.get_metrics()

  def prepare_fwd_bwd_input(self, payload):
    return self._engine.prepare_fwd_bwd_input(payload)

  def wait_for_device(self):
    return self._engine.wait_for_device()

  def save_checkpoint(self, metadata=None):
    return self._engine.save_checkpoint(metadata)

  def restore_checkpoint(self, step=None):
    return self._engine.restore_checkpoint(step)

  def export_weights(self):
    return self._engine.export_weights()

  def state_digest(self):
    return self._engine.state_digest()


class _StageOutlastsCompute(_Forwarding):
  """The tiny engine with a stage that outlasts the compute by construction, whatever the machine's speed.

  Its prepare first waits until the queued micro-batches are done; its device wait then blocks as the
  engine's does but reports 0 s (nothing was left to hide behind), below any calibrated threshold.
  """

  def prepare_fwd_bwd_input(self, payload):
    self._engine.wait_for_device()
    return self._engine.prepare_fwd_bwd_input(payload)

  def wait_for_device(self):
    self._engine.wait_for_device()
    return 0.0


def test_auto_disable_fires_when_the_stage_outlasts_the_last_micro_batch(tiny_engine, tiny_source):
  engine = _StageOutlastsCompute(tiny_engine)
  for protocol in (TrainingEngine, StagingEngine, CheckpointingEngine, WeightSource):
    assert isinstance(engine, protocol), protocol.__name__
  # Calibrated (no pinned threshold): the floor the fake reports is 0 s, so the threshold is the 2 ms margin.
  result, policy = _run(engine, tiny_source, Mode.STAGE_BEFORE_UPDATE, steps=5, disable_after=2,
                        wait_threshold_s=None)
  assert policy.threshold_s == 0.002
  assert [r.staged for r in result.records] == [True, True, False, False, False]
  assert [t.kind for t in policy.history] == ["auto_disable"]
  assert result.summary.policy.final_mode.value == "pipelined"
  assert all(r.low_wait for r in result.records[:2])


def test_stage_before_update_records_less_boundary_idle_than_off(tiny_engine_and_start, tiny_source):
  """Compares the records of two runs (no wall-clock bound): OFF's boundary holds the
  metrics read and a weight sync; STAGE_BEFORE_UPDATE's holds only a dispatch."""
  engine, start = tiny_engine_and_start

  def slow_sync(step, weights):
    time.sleep(0.05)  # a sampler weight transfer

  idle = {}
  for mode in (Mode.OFF, Mode.STAGE_BEFORE_UPDATE):
    engine.restore(start)
    result, _ = _run(engine, tiny_source, mode, steps=5, weight_sync=slow_sync)
    idle[mode] = statistics.median(r.boundary_idle_s for r in result.records[:-1])
  assert idle[Mode.STAGE_BEFORE_UPDATE] < idle[Mode.OFF]
  assert idle[Mode.STAGE_BEFORE_UPDATE] < 0.5 * idle[Mode.OFF]


@pytest.fixture(scope="module")
def moe_rerun_digests_per_mode():
  from orchestrator.data.synthetic import SyntheticRollouts
  from orchestrator.engine import build_engine

  engine = build_engine("tiny_moe", ragged_buffer_factor=0.9, retry_when_tokens_dropped=True)
  source = SyntheticRollouts(engine.preset.vocab_size, engine.rows, engine.tokens_per_row, seed=5)
  start = engine.snapshot()
  out = {}
  for mode in Mode:
    engine.restore(start)
    result, _ = _run(engine, source, mode)
    out[mode] = (
        result.summary.final_state_digest,
        [r.loss for r in result.records],
        [r.reruns for r in result.records],
    )
  return out


@pytest.mark.parametrize("mode", [m for m in Mode if m is not Mode.OFF], ids=lambda m: m.name)
def test_every_mode_trains_bit_identically_with_moe_reruns(moe_rerun_digests_per_mode, mode):
  assert moe_rerun_digests_per_mode[mode] == moe_rerun_digests_per_mode[Mode.OFF]
  assert sum(moe_rerun_digests_per_mode[Mode.OFF][2]) > 0  # re-runs really happened


def test_stock_tunix_trainer_stages_and_trains_the_same_in_every_mode(tiny_source):
  """The trainer users already have: a stock Tunix PeftTrainer behind the adapter, which stages."""
  from orchestrator.contract import StagingEngine
  from orchestrator.engine.tunix_adapter import TunixTrainerEngine

  digests = {}
  for mode in Mode:
    engine = TunixTrainerEngine("tiny", micro_batches_per_step=MICRO)
    assert isinstance(engine, StagingEngine)
    result, policy = _run(engine, tiny_source, mode, steps=3)
    digests[mode] = (result.summary.final_state_digest, tuple(r.loss for r in result.records))
    assert policy.mode is mode and [r.staged for r in result.records] == [mode.staged] * 2 + [False]
    if mode.staged:  # the staged input is the next step's first micro-batch
      for r in result.records[:-1]:
        assert r.staged_digest == engine.prepare_fwd_bwd_input(tiny_source.micro_batch(r.step + 1, 0)).digest
        assert r.staged_bytes_per_device is None and r.device_bytes_in_use is None  # the adapter does not say
  assert len(set(digests.values())) == 1


def test_staging_the_wrong_micro_batch_on_the_tunix_adapter_changes_training(tiny_source):
  """Negative control for the test above: a prepared input really is what trains."""
  from orchestrator.engine.tunix_adapter import TunixTrainerEngine

  results = []
  for swap in (False, True):
    engine = TunixTrainerEngine("tiny", micro_batches_per_step=MICRO)
    steps = [tiny_source.step(k, MICRO) for k in range(2)]
    for k, payloads in enumerate(steps):
      first = engine.prepare_fwd_bwd_input(payloads[1 if swap and k == 1 else 0])
      engine.fwd_bwd(first)
      engine.fwd_bwd(payloads[1])
      engine.wait_for_device()
      engine.update()
    results.append(engine.state_digest())
  assert results[0] != results[1]


def _held_per_device(prepared) -> list[int]:
  """What a prepared input's arrays really hold on each device: their shards' bytes, by device id."""
  held: dict[int, int] = {}
  for array in prepared.arrays.values():
    for shard in array.addressable_shards:
      held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
  return [held[i] for i in sorted(held)]


@pytest.mark.parametrize("mode", [Mode.STAGE_BEFORE_UPDATE, Mode.STAGE_AFTER_UPDATE], ids=lambda m: m.name)
def test_every_staged_boundary_records_what_its_input_holds_on_the_devices(tiny_engine, tiny_source, mode):
  result, _ = _run(tiny_engine, tiny_source, mode)
  staged = [r for r in result.records if r.staged]
  assert len(staged) == STEPS - 1
  for r in staged:
    expected = _held_per_device(tiny_engine.prepare_fwd_bwd_input(tiny_source.micro_batch(r.step + 1, 0)))
    assert r.staged_bytes_per_device == expected and sum(expected) > 0
    assert r.device_bytes_in_use is None and r.device_bytes_limit is None  # CPU reports no allocator statistics
    assert r.device_free_bytes is None  # so nothing was gated
  assert result.records[-1].staged_bytes_per_device is None
  timings = result.summary.timings
  assert timings.peak_staged_bytes_per_device == max(max(r.staged_bytes_per_device) for r in staged)
  assert timings.peak_device_bytes_in_use is None
  summary = result.summary.to_json()
  assert list(summary)[-9:] == ["peak_staged_bytes_per_device", "peak_device_bytes_in_use", "staged_bytes_by_field",
                                "staged_before_update", "measured_saving", "peak_device_bytes", "median_mfu",
                                "compiles_after_first_step", "boundary_held"]


GiB = 1 << 30


class _ReportsMemory(_Forwarding):
  """The tiny engine as it is, plus a memory report: 1 GiB per device with 100 MiB in use, or — while step
  ``short_at_step`` runs — all but 1 MiB in use. A fake only in what it reports: the training is the engine's."""

  def __init__(self, engine, short_at_step=None):
    super().__init__(engine)
    self.short_at_step = short_at_step
    self.input_bytes = tuple(engine.prepare_fwd_bwd_input(
        [Trajectory(np.array([1], np.int32), np.array([2], np.int32), 0.0)]).bytes_per_device)

  def device_memory(self):
    in_use = GiB - (1 << 20) if self._engine.train_step == self.short_at_step else 100 << 20
    return DeviceMemory(bytes_in_use=(in_use,), bytes_limit=(GiB,), input_bytes=self.input_bytes)


@pytest.fixture(scope="module")
def ungated_digest(tiny_engine_and_start, tiny_source):
  engine, start = tiny_engine_and_start
  engine.restore(start)
  result, _ = _run(engine, tiny_source, Mode.STAGE_BEFORE_UPDATE, steps=5)
  return result.summary.final_state_digest


@pytest.mark.parametrize("short_at_step", [2, None], ids=["short-at-boundary-2", "never-short"])
def test_a_boundary_short_of_device_memory_is_pipelined_and_trains_the_same(
    tiny_engine_and_start, tiny_source, ungated_digest, short_at_step):
  engine, start = tiny_engine_and_start
  engine.restore(start)
  memory = _ReportsMemory(engine, short_at_step)
  result, policy = _run(memory, tiny_source, Mode.STAGE_BEFORE_UPDATE, steps=5)
  records = result.records
  refused = {2} if short_at_step == 2 else set()
  assert [r.staged for r in records] == [s not in refused for s in range(4)] + [False]
  for r in records[:-1]:
    assert r.device_free_bytes == (1 << 20 if r.step in refused else GiB - (100 << 20))
    if r.step in refused:
      assert r.reason.startswith("no_memory_headroom: 1.00 MiB free on the fullest device")
      assert r.actions == [a.value for a in boundary_actions(BoundaryPlan.unstaged(2, Mode.PIPELINED, reason=""))]
      assert r.low_wait is None and r.device_wait_s is None and r.staged_bytes_per_device is None
    else:
      assert r.staged_bytes_per_device == list(memory.input_bytes)
      assert (r.device_bytes_in_use, r.device_bytes_limit) == ([100 << 20], [GiB])
  assert policy.counters["no_memory_headroom"] == len(refused)
  assert policy.counters["staged_boundaries"] == 4 - len(refused) and policy.history == []
  assert result.summary.final_state_digest == ungated_digest  # a refused stage trains the same micro-batches
  assert result.summary.timings.peak_device_bytes_in_use == 100 << 20

"""TrainerWorker and RLProgram with a recording fake engine: the exact call order per mode."""

from __future__ import annotations

import json
import logging
import math

import pytest

from orchestrator.contract import DeviceMemory
from orchestrator.distributed.agreement import agree_on_headroom
from orchestrator.loop.program import NonFiniteStepError, ProgramConfig, RLProgram
from orchestrator.loop.trainer_worker import TrainerWorker, WorkerUsageError
from policies import DeviceHeadroom, Mode, StepBoundaryPolicy
from tests.fakes import DivergingEngine, NoStagingEngine, RecordingEngine, StuckLiveSource, payload_steps

# docs/design.md §5's table, boundary by boundary, for the boundary after step k (M = 2).
EXPECTED_BOUNDARY = {
    Mode.OFF: ["fwd_bwd:s{k}m1", "update", "metrics:{n}", "sync:{n}", "fwd_bwd:s{n}m0"],
    Mode.PIPELINED: ["fwd_bwd:s{k}m1", "update", "fwd_bwd:s{n}m0", "metrics:{n}", "sync:{n}"],
    Mode.STAGE_AFTER_UPDATE: [
        "fwd_bwd:s{k}m1", "update", "prepare:s{n}m0", "fwd_bwd:prepared:s{n}m0", "metrics:{n}", "sync:{n}"],
    Mode.STAGE_BEFORE_UPDATE: [
        "fwd_bwd:s{k}m1", "prepare:s{n}m0", "wait", "update", "fwd_bwd:prepared:s{n}m0",
        "metrics:{n}", "sync:{n}"],
}


def _run(engine, mode, steps=4, micro=2, threshold_s=0.0, **config):
  """Runs the program; a 0 s threshold never judges a wait low (the fake computes nothing)."""
  worker = TrainerWorker(engine)
  policy = StepBoundaryPolicy(
      mode, engine_can_stage=worker.capabilities.can_stage, wait_threshold_s=threshold_s)

  def sync(step, weights):
    engine.calls.append(f"sync:{step}")

  program = RLProgram(
      worker, policy, payload_steps(steps, micro),
      ProgramConfig(steps=steps, micro_batches_per_step=micro, calibration_samples=2, **config),
      weight_sync=sync,
  )
  result = program.run()
  first = engine.calls.index("fwd_bwd:s0m0")
  return engine.calls[first:], result, policy


def _expected(mode, steps, checkpoint_every=0):
  calls = ["fwd_bwd:s0m0"]
  for k in range(steps - 1):
    seq = [c.format(k=k, n=k + 1) for c in EXPECTED_BOUNDARY[mode]]
    if checkpoint_every and (k + 1) % checkpoint_every == 0:
      seq.insert(seq.index(f"sync:{k + 1}"), f"checkpoint:{k + 1}")
    calls += seq
  last = steps - 1
  calls += [f"fwd_bwd:s{last}m1", "update", f"metrics:{steps}"]
  if checkpoint_every and steps % checkpoint_every == 0:
    calls.append(f"checkpoint:{steps}")
  return calls + [f"sync:{steps}"]


@pytest.mark.spec
@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.name)
def test_call_sequence_per_mode_matches_the_design_table(mode):
  calls, result, _ = _run(RecordingEngine(), mode)
  assert calls == _expected(mode, 4)
  assert [r.staged for r in result.records] == [mode.staged] * 3 + [False]


@pytest.mark.spec
def test_checkpoints_follow_the_cadence_inside_the_boundary_work():
  calls, _, _ = _run(RecordingEngine(), Mode.STAGE_BEFORE_UPDATE, steps=4, checkpoint_every=2)
  assert calls == _expected(Mode.STAGE_BEFORE_UPDATE, 4, checkpoint_every=2)


@pytest.mark.spec
def test_sync_before_next_step_moves_checkpoint_and_sync_before_the_dispatch():
  calls, _, _ = _run(RecordingEngine(), Mode.STAGE_BEFORE_UPDATE, steps=2, sync_before_next_step=True)
  assert calls == [
      "fwd_bwd:s0m0", "fwd_bwd:s0m1", "prepare:s1m0", "wait", "update", "sync:1",
      "fwd_bwd:prepared:s1m0", "metrics:1", "fwd_bwd:s1m1", "update", "metrics:2", "sync:2",
  ]


@pytest.mark.spec
def test_single_micro_batch_steps_stage_every_first_micro_batch():
  """With M = 1 the first micro-batch is the last: the previous step's metrics are read
  before this step's update, and the final step's update follows that read."""
  calls, _, _ = _run(RecordingEngine(), Mode.STAGE_BEFORE_UPDATE, steps=3, micro=1)
  assert calls == [
      "fwd_bwd:s0m0", "prepare:s1m0", "wait", "update",
      "fwd_bwd:prepared:s1m0", "metrics:1", "sync:1", "prepare:s2m0", "wait", "update",
      "fwd_bwd:prepared:s2m0", "metrics:2", "sync:2", "update", "metrics:3", "sync:3",
  ]


@pytest.mark.spec
def test_single_micro_batch_pipelined_reads_each_steps_own_metrics():
  calls, _, _ = _run(RecordingEngine(), Mode.PIPELINED, steps=3, micro=1)
  assert calls == [
      "fwd_bwd:s0m0", "update", "fwd_bwd:s1m0", "metrics:1", "sync:1", "update",
      "fwd_bwd:s2m0", "metrics:2", "sync:2", "update", "metrics:3", "sync:3",
  ]


@pytest.mark.spec
@pytest.mark.parametrize("mode", [Mode.STAGE_AFTER_UPDATE, Mode.STAGE_BEFORE_UPDATE], ids=lambda m: m.name)
def test_engine_without_staging_falls_back_to_pipelined_order(mode, caplog):
  with caplog.at_level(logging.WARNING):
    calls, result, policy = _run(NoStagingEngine(), mode)
  assert calls == _expected(Mode.PIPELINED, 4)
  assert policy.mode is Mode.PIPELINED
  assert result.summary.policy.final_mode.value == "pipelined"
  warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1 and "lacks prepare_fwd_bwd_input, wait_for_device" in warnings[0].getMessage()


@pytest.mark.spec
def test_auto_disable_switches_the_call_order_mid_run():
  engine = RecordingEngine(wait_s=0.0)  # every wait at the floor: the stage outlasted compute
  calls, result, policy = _run(engine, Mode.STAGE_BEFORE_UPDATE, steps=5, threshold_s=0.1)
  assert [r.staged for r in result.records] == [True, True, False, False, False]
  assert result.summary.policy.auto_disables == 1
  assert calls.count("wait") == 2
  assert [r.transition for r in result.records][:2] == [None, "auto_disable"]


# ----------------------------------------------------------------- a non-finite step
@pytest.mark.spec
@pytest.mark.parametrize("sync_first", [False, True], ids=["sync_after", "sync_before_next_step"])
@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.name)
def test_a_non_finite_step_ends_the_run_after_its_record_and_is_never_checkpointed(mode, micro, sync_first,
                                                                                   tmp_path):
  engine = DivergingEngine(from_step=2)
  with pytest.raises(NonFiniteStepError) as excinfo:
    _run(engine, mode, steps=5, micro=micro, checkpoint_every=1, sync_before_next_step=sync_first,
         out_dir=str(tmp_path))
  error = excinfo.value
  assert (error.step, error.checkpoint_steps, error.checkpoint_path) == (2, 2, "ckpt/2")
  assert math.isnan(error.loss) and math.isnan(error.grad_norm)
  assert "step 2's loss is nan" in str(error) and "ckpt/2" in str(error)
  # Records 0..2 are written, step 2's with its non-finite loss; nothing of step 3 or later.
  records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [0, 1, 2] and math.isnan(records[2]["loss"])
  # Checkpoints after 1 and 2 steps only: none holds step 2's update or a later one, whatever the call order.
  assert [c for c in engine.calls if c.startswith("checkpoint")] == ["checkpoint:1", "checkpoint:2"]
  assert "metrics:3" in engine.calls and "sync:3" not in engine.calls


@pytest.mark.spec
def test_updates_the_engine_skipped_are_not_a_non_finite_state_and_the_run_goes_on():
  """Negative control: under skip_nonfinite_updates the weights stayed finite, so every checkpoint is written."""
  engine = DivergingEngine(from_step=2, skipped=True)
  calls, result, _ = _run(engine, Mode.STAGE_BEFORE_UPDATE, steps=5, checkpoint_every=1)
  assert [c for c in calls if c.startswith("checkpoint")] == [f"checkpoint:{n}" for n in range(1, 6)]
  assert [r.step for r in result.records] == [0, 1, 2, 3, 4] and math.isnan(result.records[4].loss)


@pytest.mark.spec
def test_sync_before_next_step_reads_the_metrics_before_a_checkpoint():
  calls, _, _ = _run(RecordingEngine(), Mode.STAGE_BEFORE_UPDATE, steps=2, sync_before_next_step=True,
                     checkpoint_every=1)
  assert calls == [
      "fwd_bwd:s0m0", "fwd_bwd:s0m1", "prepare:s1m0", "wait", "update", "metrics:1", "checkpoint:1", "sync:1",
      "fwd_bwd:prepared:s1m0", "fwd_bwd:s1m1", "update", "metrics:2", "checkpoint:2", "sync:2",
  ]


@pytest.mark.spec
@pytest.mark.parametrize("every, expected", [(0, [4]), (3, [3, 4]), (2, [2, 4])],
                         ids=["no_cadence", "cadence_misses_the_end", "cadence_ends_on_it"])
def test_a_completed_run_checkpoints_its_last_step_once(every, expected):
  calls, result, _ = _run(RecordingEngine(), Mode.STAGE_BEFORE_UPDATE, steps=4, checkpoint_every=every,
                          checkpoint_last_step=True)
  assert [c for c in calls if c.startswith("checkpoint")] == [f"checkpoint:{n}" for n in expected]
  assert calls[-3:] == ["metrics:4", "checkpoint:4", "sync:4"]  # after the last update, before its sync
  assert result.checkpoint_path == result.summary.checkpoint_path == "ckpt/4"


@pytest.mark.spec
def test_without_checkpoint_last_step_a_run_keeps_only_its_cadence():
  """Negative control: the last step's checkpoint is the switch's, not the cadence's."""
  calls, result, _ = _run(RecordingEngine(), Mode.STAGE_BEFORE_UPDATE, steps=4, checkpoint_every=3)
  assert [c for c in calls if c.startswith("checkpoint")] == ["checkpoint:3"]
  assert result.summary.checkpoint_path == "ckpt/3"


class _NoCheckpointEngine(RecordingEngine):
  save_checkpoint = restore_checkpoint = None


@pytest.mark.spec
def test_an_engine_that_cannot_checkpoint_completes_without_one():
  calls, result, _ = _run(_NoCheckpointEngine(), Mode.OFF, steps=2, checkpoint_last_step=True)
  assert not [c for c in calls if c.startswith("checkpoint")] and result.checkpoint_path is None


# ----------------------------------------------------------------- misuse


@pytest.mark.spec
def test_second_stage_with_one_pending_is_refused():
  w = TrainerWorker(RecordingEngine())
  w.stage_fwd_bwd("a")
  with pytest.raises(WorkerUsageError, match="already staged; dispatch it with fwd_bwd_staged"):
    w.stage_fwd_bwd("b")


@pytest.mark.spec
def test_staged_dispatch_with_nothing_staged_is_refused():
  with pytest.raises(WorkerUsageError, match="nothing is staged"):
    TrainerWorker(RecordingEngine()).fwd_bwd_staged()


@pytest.mark.spec
def test_deferred_update_with_none_owed_is_refused():
  with pytest.raises(WorkerUsageError, match="no update is owed"):
    TrainerWorker(RecordingEngine()).apply_deferred_update()


@pytest.mark.spec
def test_new_step_while_an_update_is_owed_is_refused():
  w = TrainerWorker(RecordingEngine())
  w.fwd_bwd("a", defer_update=True)
  with pytest.raises(WorkerUsageError, match="still owed; call apply_deferred_update"):
    w.fwd_bwd("b")
  w.stage_fwd_bwd("b")  # staging while owed is the point of STAGE_BEFORE_UPDATE
  with pytest.raises(WorkerUsageError, match="still owed"):
    w.fwd_bwd_staged()
  assert w.apply_deferred_update().device_wait_s == 0.5
  w.fwd_bwd_staged()


@pytest.mark.spec
def test_staging_on_an_engine_without_staging_is_refused():
  w = TrainerWorker(NoStagingEngine())
  assert not w.capabilities.can_stage
  assert w.capabilities.missing_staging_methods == ("prepare_fwd_bwd_input", "wait_for_device")
  with pytest.raises(WorkerUsageError, match="lacks prepare_fwd_bwd_input"):
    w.stage_fwd_bwd("a")


@pytest.mark.spec
def test_worker_refuses_an_engine_without_required_methods():
  with pytest.raises(TypeError, match="lacks fwd_bwd, update, get_metrics"):
    TrainerWorker(object())


@pytest.mark.spec
def test_program_refuses_a_source_with_the_wrong_micro_batch_count():
  w = TrainerWorker(RecordingEngine())
  p = RLProgram(w, StepBoundaryPolicy(Mode.PIPELINED), [["a"]] * 3, ProgramConfig(steps=3, micro_batches_per_step=2))
  with pytest.raises(ValueError, match="step 0 has 1 micro-batch payloads; micro_batches_per_step is 2"):
    p.run()


@pytest.mark.engine
def test_program_refuses_a_source_that_runs_out():
  w = TrainerWorker(RecordingEngine())
  p = RLProgram(w, StepBoundaryPolicy(Mode.PIPELINED), payload_steps(2, 1), ProgramConfig(steps=3, micro_batches_per_step=1))
  with pytest.raises(ValueError, match="ran out after 2 steps; 3 were asked for"):
    p.run()


def _four_steps_with_one_pipelined(engine, policy, pipelined_at: int):
  """Runs 4 steps of 2 micro-batches with a weight sync that logs; returns the result and asserts the calls
  are every boundary staged before the update but ``pipelined_at``'s, which runs PIPELINED."""
  worker = TrainerWorker(engine)

  def sync(step, weights):
    engine.calls.append(f"sync:{step}")

  result = RLProgram(worker, policy, payload_steps(4, 2), ProgramConfig(steps=4, micro_batches_per_step=2),
                     weight_sync=sync).run()
  calls = engine.calls[engine.calls.index("fwd_bwd:s0m0"):]
  expected = ["fwd_bwd:s0m0"]
  for k in range(3):
    mode = Mode.PIPELINED if k == pipelined_at else Mode.STAGE_BEFORE_UPDATE
    expected += [c.format(k=k, n=k + 1) for c in EXPECTED_BOUNDARY[mode]]
  assert calls == expected + ["fwd_bwd:s3m1", "update", "metrics:4", "sync:4"]
  return result


@pytest.mark.spec
def test_excluded_boundary_runs_pipelined_and_the_rest_stay_staged():
  policy = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, wait_threshold_s=0.0, excluded_steps=[1])
  result = _four_steps_with_one_pipelined(RecordingEngine(), policy, pipelined_at=1)
  assert [r.staged for r in result.records] == [True, False, True, False]
  assert result.records[1].reason == "boundary excluded by the recipe"
  assert policy.mode is Mode.STAGE_BEFORE_UPDATE


@pytest.mark.spec
def test_checkpoint_of_step_k_while_step_k_plus_1_defers_its_update():
  """M = 1 under STAGE_BEFORE_UPDATE: step k's boundary work (and checkpoint) runs right
  after step k+1's only micro-batch was dispatched with its update deferred."""
  calls, _, _ = _run(RecordingEngine(), Mode.STAGE_BEFORE_UPDATE, steps=3, micro=1, checkpoint_every=1)
  assert calls == [
      "fwd_bwd:s0m0", "prepare:s1m0", "wait", "update",
      "fwd_bwd:prepared:s1m0", "metrics:1", "checkpoint:1", "sync:1", "prepare:s2m0", "wait", "update",
      "fwd_bwd:prepared:s2m0", "metrics:2", "checkpoint:2", "sync:2", "update", "metrics:3",
      "checkpoint:3", "sync:3",
  ]


class _MemoryEngine(RecordingEngine):
  """The recording engine with a memory report per step: ``in_use[step]`` of 1000 bytes in use on each of two
  devices (the second fuller), 10 bytes an input."""

  def __init__(self, in_use):
    super().__init__()
    self.in_use = in_use

  def device_memory(self):
    used = self.in_use.get(self.step, 0)
    return DeviceMemory(bytes_in_use=(used // 2, used), bytes_limit=(1000, 1000), input_bytes=(10, 10))


@pytest.mark.spec
def test_the_memory_gate_pipelines_the_boundary_the_devices_are_too_full_for():
  engine = _MemoryEngine({2: 995})
  assert TrainerWorker(engine).capabilities.can_report_memory
  policy = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, wait_threshold_s=0.0, min_free_device_bytes=100)
  result = _four_steps_with_one_pipelined(engine, policy, pipelined_at=2)
  records = result.records
  assert [r.staged for r in records] == [True, True, False, False]
  assert [r.device_free_bytes for r in records] == [1000, 1000, 5, None]  # the fullest device; none after the last
  assert records[2].reason.startswith("no_memory_headroom: 5 B free") and records[2].low_wait is None
  assert records[0].device_bytes_in_use == [0, 0] and records[0].device_bytes_limit == [1000, 1000]
  assert records[0].staged_bytes_per_device is None  # the fake's prepared input does not say what it holds
  assert policy.counters["no_memory_headroom"] == 1 and policy.mode is Mode.STAGE_BEFORE_UPDATE


@pytest.mark.spec
def test_engines_that_cannot_tell_record_no_device_memory():
  _, result, _ = _run(RecordingEngine(), Mode.STAGE_BEFORE_UPDATE)
  assert not TrainerWorker(RecordingEngine()).capabilities.can_report_memory
  fields = ("staged_bytes_per_device", "device_bytes_in_use", "device_bytes_limit", "device_free_bytes")
  assert all(getattr(r, f) is None for r in result.records for f in fields)
  assert result.summary.timings.peak_staged_bytes_per_device is None


class _TwoProcesses:
  """An agreement of two processes whose other process posts ``other``."""

  def __init__(self, other):
    self.other, self.tags = other, []

  def exchange(self, tag, value):
    self.tags.append(tag)
    return [value, self.other]


@pytest.mark.spec
def test_every_process_plans_with_the_least_free_memory_of_the_job():
  mine = DeviceMemory(bytes_in_use=(100, 300), bytes_limit=(1000, 1000), input_bytes=(8, 8))
  agreement = _TwoProcesses({"free_bytes": 500, "input_bytes": 16})
  assert agree_on_headroom(agreement, 3, mine) == DeviceHeadroom(free_bytes=500, input_bytes=16)
  assert agree_on_headroom(_TwoProcesses(None), 3, mine) == DeviceHeadroom(free_bytes=700, input_bytes=8)
  assert agree_on_headroom(_TwoProcesses(None), 3, None) is None
  assert agreement.tags == ["headroom step 3"]


class _CountingLiveSource(StuckLiveSource):
  """A live source whose every micro-batch is sampled, counting each wait for a micro-batch (an ask with a
  timeout: ``ready`` for a step's first, ``micro_batch_ready`` for a later one) and each fetch of one from a
  taken step. A fetch before its wait is refused, as the real source's access would block without the stop
  in view."""

  kind = "counting-live"

  def __init__(self, steps: int, micro: int):
    super().__init__(steps, micro, stuck_at=steps)
    self.waits: dict[tuple[int, int], int] = {}
    self.fetches: dict[tuple[int, int], int] = {}

  def _count(self, counts, step, index):
    counts[(step, index)] = counts.get((step, index), 0) + 1

  def __next__(self):
    step, source = self.next_step, self

    class Streamed(list):
      def __getitem__(self, index):
        assert (step, index) in source.waits, f"step {step}'s micro-batch {index} was fetched before its wait"
        source._count(source.fetches, step, index)
        return super().__getitem__(index)

    return Streamed(super().__next__())

  def ready(self, step, timeout_s):
    if timeout_s > 0:  # a zero timeout only looks (the plan asks whether the step is sampled): no wait
      self._count(self.waits, step, 0)
    return super().ready(step, timeout_s)

  def micro_batch_ready(self, step, index, timeout_s):
    self._count(self.waits, step, index)
    return super().micro_batch_ready(step, index, timeout_s)


@pytest.mark.spec
@pytest.mark.parametrize("micro", [1, 2, 3])
@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.name)
def test_each_micro_batch_is_waited_for_once_and_fetched_once(mode, micro):
  """The feed waits for each micro-batch once, with the stop in view, and fetches it once; a staged dispatch
  sends what the stage prepared and fetches nothing (it would drop it). Negative control: a loop that fetched
  the staged payload again for its dispatch counts two fetches of every staged step's first micro-batch."""
  source, steps = _CountingLiveSource(4, micro), 4
  engine = RecordingEngine()
  worker = TrainerWorker(engine)
  policy = StepBoundaryPolicy(mode, engine_can_stage=worker.capabilities.can_stage, wait_threshold_s=0.0)
  RLProgram(worker, policy, source, ProgramConfig(steps=steps, micro_batches_per_step=micro, calibration_samples=2)
            ).run()
  every = {(k, i): 1 for k in range(steps) for i in range(micro)}
  assert source.waits == every
  assert source.fetches == every
  staged = [c for c in engine.calls if c.startswith("fwd_bwd:prepared:")]
  assert len(staged) == (steps - 1 if mode.staged else 0)  # the staged dispatches ran, with no fetch of their own

"""The deferred update of STAGE_BEFORE_UPDATE: dispatched before the wait for the last micro-batch, the device
wait it measures (policies.call_order's DEFERRED_UPDATE), and what the policy is told beside it."""

from __future__ import annotations

import pytest

from orchestrator.contract import Receipt
from orchestrator.loop.program import ProgramConfig, RLProgram
from orchestrator.loop.recorder import Recorder, fwd_bwd_key
from orchestrator.loop.trainer_worker import TrainerWorker
from policies import Mode, StepBoundaryPolicy
from tests.fakes import HandleEngine, RecordingEngine, payload_steps

pytestmark = pytest.mark.spec

COMPUTE_S = 0.2  # what the fake's last micro-batch still computes after its dispatch


def _deferred(engine, *, stage_s: float = 0.0):
  """One step of two micro-batches whose update is deferred past a stage of ``stage_s``; the applied update."""
  worker = TrainerWorker(engine)
  worker.fwd_bwd("s0m0")
  worker.fwd_bwd("s0m1", defer_update=True)
  worker.stage_fwd_bwd("s1m0")
  if stage_s:
    import time  # import here: only this helper sleeps, standing in for a stage that outlasts the compute
    time.sleep(stage_s)
  return worker.apply_deferred_update()


def test_the_update_is_dispatched_before_the_wait_for_the_last_micro_batch():
  engine = HandleEngine(COMPUTE_S)
  applied = _deferred(engine)
  assert engine.calls[-3:] == ["prepare:s1m0", "update", "ready:s0m1"]
  assert "wait" not in engine.calls  # the handle is waited on, not the whole device
  assert applied.update_returned_at is not None
  assert applied.wait_started_at <= applied.update_returned_at


def test_an_engine_without_handles_waits_first_as_before():
  engine = RecordingEngine(wait_s=0.5)
  applied = _deferred(engine)
  assert engine.calls[-3:] == ["prepare:s1m0", "wait", "update"]
  assert applied.device_wait_s == 0.5 and applied.update_returned_at is None


def test_the_device_wait_is_what_the_last_micro_batch_still_computed():
  applied = _deferred(HandleEngine(COMPUTE_S))
  assert 0.8 * COMPUTE_S <= applied.device_wait_s <= COMPUTE_S + 0.5


def test_a_stage_that_outlasts_the_micro_batch_measures_no_wait():
  applied = _deferred(HandleEngine(0.05), stage_s=0.3)
  assert applied.device_wait_s < 0.05


@pytest.mark.parametrize("reports", [True, False], ids=["host_wait_reported", "host_wait_unknown"])
def test_an_update_that_blocks_on_the_last_micro_batch_counts_its_block_as_device_wait(reports):
  """A dropless update reads the overflow flag first, so the wait after it finds the micro-batch done: the
  update's block is the device wait (counted whole where the engine does not say how it splits)."""
  engine = HandleEngine(COMPUTE_S, update_blocks=True, report_host_wait=reports)
  applied = _deferred(engine)
  assert applied.device_wait_s >= 0.8 * COMPUTE_S
  assert applied.update.host_wait_s is None or applied.update.host_wait_s >= 0.8 * COMPUTE_S


def test_a_blocking_update_that_reports_no_block_reads_as_no_wait():
  """The negative control of the test above: the measure relies on the update's report, so an update that
  blocks and says it did not is measured at the floor."""

  class Unreported(HandleEngine):
    def update(self):
      receipt = super().update()
      return type(receipt)(**{**receipt.__dict__, "host_wait_s": 0.0})

  applied = _deferred(Unreported(COMPUTE_S, update_blocks=True))
  assert applied.device_wait_s < 0.05


def test_the_program_runs_stage_before_update_with_the_update_ahead_of_the_wait():
  engine = HandleEngine(0.0)
  worker = TrainerWorker(engine)
  policy = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, engine_can_stage=True, wait_threshold_s=0.0)
  config = ProgramConfig(steps=3, micro_batches_per_step=2, calibration_samples=2)
  result = RLProgram(worker, policy, payload_steps(3, 2), config, weight_sync=lambda step, weights: None).run()
  calls = engine.calls[engine.calls.index("fwd_bwd:s0m0"):]
  boundary = calls[calls.index("fwd_bwd:s0m1"):calls.index("fwd_bwd:prepared:s1m0") + 1]
  assert boundary == [
      "fwd_bwd:s0m1", "prepare:s1m0", "update", "ready:s0m1", "fwd_bwd:prepared:s1m0"]
  assert [r.staged for r in result.records] == [True, True, False]
  assert all(r.actions[2] == "deferred update, then wait for device" for r in result.records[:2])


def test_the_recorder_reports_sampling_on_the_trainers_devices_from_the_steps_first_dispatch():
  """What the policy is told beside a staged boundary's wait (``sampling_on_devices_s``): the live source's
  sampling seconds over [step k's first dispatch, now]; None where the sampler computes elsewhere."""
  now = [10.0]
  asked = []

  def sampling(start, end):
    asked.append((start, end))
    return 0.25

  recorder = Recorder(lambda: now[0], 2, sampling_on_devices=sampling)
  recorder.start()
  try:
    receipt = Receipt(kind="fwd_bwd", step=3, micro_step=0, ready=None, dispatched_at=7.5)
    recorder.watch(fwd_bwd_key(3, 0), receipt, kind="fwd_bwd", step=3, micro_step=0)
    assert recorder.sampling_on_devices_s(3) == 0.25 and asked == [(7.5, 10.0)]
    assert recorder.sampling_on_devices_s(4) is None  # step 4 has not started
  finally:
    recorder.close()
  assert Recorder(lambda: now[0], 2).sampling_on_devices_s(3) is None

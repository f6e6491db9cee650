"""The typed engine contract: Protocols, receipts, and engines that satisfy only part of it."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from orchestrator.contract import (
    CheckpointingEngine, Receipt, StagingEngine, TrainingEngine, WeightSource, missing_methods)
from orchestrator.loop.program import ProgramConfig, RLProgram
from orchestrator.loop.recorder import Lane
from orchestrator.loop.trainer_worker import TrainerWorker
from policies import Mode, StepBoundaryPolicy
from tests.fakes import NoStagingEngine, RecordingEngine, payload_steps


class MinimalEngine:
  """Only the three required methods, returning no receipts (a plain trainer)."""

  def __init__(self):
    self.calls = []
    self.step = 0

  def fwd_bwd(self, x, apply_optimizer=False):
    self.calls.append(f"fwd_bwd:{x}")

  def update(self):
    self.calls.append("update")
    self.step += 1
    return self.step

  def get_metrics(self):
    return {"loss": 1.0}


def test_the_jax_engine_satisfies_every_protocol(tiny_engine):
  for protocol in (TrainingEngine, StagingEngine, CheckpointingEngine, WeightSource):
    assert isinstance(tiny_engine, protocol), protocol.__name__


def test_three_methods_make_a_training_engine_but_not_a_staging_engine():
  engine = MinimalEngine()
  assert isinstance(engine, TrainingEngine)
  assert not isinstance(engine, StagingEngine)
  assert missing_methods(engine, StagingEngine) == ("prepare_fwd_bwd_input", "wait_for_device")
  assert not isinstance(object(), TrainingEngine)


def test_methods_set_to_none_count_as_missing():
  assert not isinstance(NoStagingEngine(), StagingEngine)
  assert isinstance(RecordingEngine(), StagingEngine)


class _ForwardingProxy:
  """Forwards every attribute through ``__getattr__``: ``isinstance`` finds its methods before 3.12, not after."""

  def __init__(self, engine):
    self._engine = engine

  def __getattr__(self, name):
    return getattr(self._engine, name)


@pytest.mark.parametrize("protocol", [TrainingEngine, StagingEngine], ids=lambda p: p.__name__)
def test_missing_methods_names_what_the_protocol_check_does_not_find(protocol):
  proxy = _ForwardingProxy(RecordingEngine())
  missing = missing_methods(proxy, protocol)
  assert isinstance(proxy, protocol) == (missing == ())
  if missing:  # Python 3.12 and later: forwarded methods are not found
    with pytest.raises(TypeError, match="it lacks fwd_bwd, update, get_metrics$"):
      TrainerWorker(proxy)


def test_a_minimal_engine_drives_through_the_program_with_one_fallback_warning(caplog):
  engine = MinimalEngine()
  worker = TrainerWorker(engine)
  policy = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, engine_can_stage=worker.capabilities.can_stage,
                              engine_missing=worker.capabilities.missing_staging_methods)
  with caplog.at_level(logging.WARNING):
    result = RLProgram(worker, policy, payload_steps(3, 2), ProgramConfig(steps=3, micro_batches_per_step=2)).run()
  warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1, [r.getMessage() for r in warnings]
  assert "falling back to PIPELINED" in warnings[0].getMessage()
  assert [r.mode for r in result.records] == ["pipelined"] * 3
  assert engine.calls[:4] == ["fwd_bwd:s0m0", "fwd_bwd:s0m1", "update", "fwd_bwd:s1m0"]
  # No receipt, so no invented split of the call's host time: one plain span per dispatch.
  names = {s.name for s in result.host_spans if s.lane is Lane.STEP_LOOP}
  assert "fwd_bwd" in names and "prepare" not in names and "host wait" not in names
  assert result.summary["final_state_digest"] is None


def test_receipt_coerce_keeps_receipts_and_wraps_anything_else():
  r = Receipt("fwd_bwd", 0, 1, None, 1.0, 0.1, 0.2, 0.0)
  assert Receipt.coerce(r, kind="x", step=9, micro_step=9) is r and r.host_seconds_known
  wrapped = Receipt.coerce(3, kind="update", step=2, micro_step=-1)
  assert (wrapped.kind, wrapped.step, wrapped.ready, wrapped.mapping_s) == ("update", 2, None, None)
  assert not wrapped.host_seconds_known

  class Handle:
    def block_until_ready(self):
      return self

  h = Handle()
  assert Receipt.coerce(h, kind="fwd_bwd", step=0, micro_step=0).ready is h


def test_engine_receipts_carry_the_host_seconds_of_the_call(tiny_engine, tiny_source):
  payload = tiny_source.micro_batch(0, 0)
  from_payload = tiny_engine.fwd_bwd(payload)
  assert from_payload.kind == "fwd_bwd" and from_payload.micro_step == 0 and from_payload.step == 0
  assert from_payload.mapping_s > 0 and from_payload.placement_s >= 0 and from_payload.host_wait_s >= 0
  from_prepared = tiny_engine.fwd_bwd(tiny_engine.prepare_fwd_bwd_input(tiny_source.micro_batch(0, 1)))
  assert from_prepared.mapping_s == 0.0 and from_prepared.placement_s == 0.0 and from_prepared.micro_step == 1
  update = tiny_engine.update()
  assert (update.kind, update.step, update.micro_step) == ("update", 0, -1)
  update.ready.block_until_ready()
  assert tiny_engine.train_step == 1


def test_prepared_host_arrays_are_read_only(tiny_engine, tiny_source):
  """On CPU the placed arrays may alias the host buffers: a host write must not reach training."""
  prepared = tiny_engine.prepare_fwd_bwd_input(tiny_source.micro_batch(0, 0))
  tokens = prepared.host_arrays["input_tokens"]
  with pytest.raises(ValueError, match="read-only"):
    tokens[0, 0] = 7
  assert np.array_equal(np.asarray(prepared.arrays["input_tokens"]), tokens)


def test_worker_returns_typed_results_and_hides_its_engine():
  worker = TrainerWorker(RecordingEngine(wait_s=0.25))
  assert not hasattr(worker, "engine")
  worker.fwd_bwd("a", defer_update=True)
  stage = worker.stage_fwd_bwd("b")
  assert stage.stage_s >= 0 and stage.ended_at >= stage.started_at and stage.input_digest == "digest-b"
  applied = worker.apply_deferred_update()
  assert applied.device_wait_s == 0.25 and applied.update.kind == "update"
  receipt = worker.fwd_bwd_staged(apply_optimizer=True)
  assert receipt.update is not None and receipt.update.kind == "update"
  assert worker.export_weights() == {"step": 2} and worker.state_digest() == "state-2"
  assert worker.sample_wait_floor(3) == [0.25] * 3


def test_the_compile_counter_counts_new_compiles():
  import jax
  import jax.numpy as jnp

  from orchestrator.engine import backend_compile_count

  x = jnp.arange(7.0).block_until_ready()
  f = jax.jit(lambda x: jnp.sin(x) * 3.25 + 0.125)
  before = backend_compile_count()
  f(x).block_until_ready()
  assert backend_compile_count() == before + 1
  f(x).block_until_ready()  # cached: no second compile
  assert backend_compile_count() == before + 1

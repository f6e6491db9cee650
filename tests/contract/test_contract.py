"""The typed engine contract: Protocols, receipts, and engines that satisfy only part of it."""

from __future__ import annotations

import dataclasses
import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest

from orchestrator.contract import (
    CheckpointingEngine, DeviceMemory, LiveSource, Receipt, RunSummary, SourceStateError, StageReceipt, StagingEngine,
    StepMetrics, StepSource, StepTimings, TrainingEngine, WeightSource, Worker, live_part, missing_methods)
from orchestrator.contract.worker import ALLOWED_TRANSITIONS, Call, CallState, WorkerUsageError, next_call_state
from orchestrator.data.sources import IterableSteps, ReplaySteps, SyntheticSteps, as_step_source
from orchestrator.data.synthetic import SyntheticRollouts
from orchestrator.data.trajectory import Trajectory
from orchestrator.live.rollouts import LiveRollouts
from orchestrator.loop.program import ProgramConfig, RLProgram
from orchestrator.loop.recorder import Lane
from orchestrator.loop.trainer_worker import TrainerWorker
from orchestrator.remote import client, wire
from orchestrator.remote.refusals import Refused
from orchestrator.remote.served_worker import ServedWorker
from policies import Mode, StepBoundaryPolicy
from tests.fakes import NoStagingEngine, RecordingEngine, payload_steps

pytestmark = pytest.mark.engine


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
  """Forwards every attribute through ``__getattr__`` (``isinstance`` finds its methods before 3.12, not after)."""

  def __init__(self, engine):
    self._engine = engine

  def __getattr__(self, name):
    return getattr(self._engine, name)


def test_a_forwarding_proxy_is_judged_by_the_methods_it_defines_on_every_python_version():
  """The same answer on 3.11 and 3.12: forwarded methods are missing, and the refusal names them."""
  proxy = _ForwardingProxy(RecordingEngine())
  assert missing_methods(proxy, TrainingEngine) == ("fwd_bwd", "update", "get_metrics")
  assert missing_methods(proxy, StagingEngine)[-2:] == ("prepare_fwd_bwd_input", "wait_for_device")
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
  assert result.summary.final_state_digest is None


def test_receipt_coerce_keeps_receipts_and_wraps_anything_else():
  r = Receipt(kind="fwd_bwd", step=0, micro_step=1, ready=None, dispatched_at=1.0, mapping_s=0.1, placement_s=0.2,
              host_wait_s=0.0)
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


def test_the_state_digest_and_a_staged_inputs_digest_are_what_their_protocols_find():
  """An engine with ``state_digest`` alone reports its digest (``StateDigestingEngine``, without
  ``WeightSource``'s ``export_weights``); one without it, or with it set to None, still trains and reports
  none. A staged input's digest is its ``PreparedInput.digest``; an input without one (or None) gives None."""

  class DigestOnly(MinimalEngine):
    def state_digest(self):
      return f"state-{self.step}"

  class DigestNone(MinimalEngine):
    state_digest = None

  worker = TrainerWorker(DigestOnly())
  worker.fwd_bwd("a", apply_optimizer=True)
  assert not worker.capabilities.can_export_weights and worker.state_digest() == "state-1"
  for engine in (MinimalEngine(), DigestNone()):
    worker = TrainerWorker(engine)
    worker.fwd_bwd("a", apply_optimizer=True)
    assert worker.state_digest() is None and engine.calls == ["fwd_bwd:a", "update"]

  def staged(prepared):
    return StageReceipt(stage_s=0.0, started_at=0.0, ended_at=0.0, prepared=prepared)

  assert staged(SimpleNamespace(digest="d")).input_digest == "d"
  assert staged(SimpleNamespace(digest=None)).input_digest is None and staged(object()).input_digest is None


def test_the_compile_counter_counts_new_compiles():
  import jax
  import jax.numpy as jnp

  from orchestrator.engine import backend_compile_count

  x = jnp.arange(7.0).block_until_ready()
  # A constant no earlier run used, so a persistent compilation cache (STEP_BOUNDARY_COMPILATION_CACHE) has no
  # executable for it and the first call compiles.
  scale = 1.0 + int.from_bytes(os.urandom(4), "little") / 2**32
  f = jax.jit(lambda x: jnp.sin(x) * scale + 0.125)
  before = backend_compile_count()
  f(x).block_until_ready()
  assert backend_compile_count() == before + 1
  f(x).block_until_ready()  # cached: no second compile
  assert backend_compile_count() == before + 1


# ---------------------------------------------------------------- the worker, source and output contracts
def test_the_local_and_the_remote_worker_both_satisfy_the_worker_protocol():
  from orchestrator.remote.client import RemoteTrainerWorker

  assert missing_methods(TrainerWorker, Worker) == ()
  assert missing_methods(RemoteTrainerWorker, Worker) == ()
  assert isinstance(TrainerWorker(RecordingEngine()), Worker)
  assert not isinstance(RecordingEngine(), Worker)  # an engine is not a worker: no stage_fwd_bwd, no capabilities


# One table of which call may follow which, held by the local worker, the remote one and its server.
_INTO = {  # the calls that bring a worker into each state (a micro-batch first, so the server has one to update)
    CallState.READY: (Call.FWD_BWD,),
    CallState.STAGED: (Call.FWD_BWD, Call.STAGE),
    CallState.UPDATE_OWED: (Call.FWD_BWD_DEFERRING,),
    CallState.UPDATE_OWED_STAGED: (Call.FWD_BWD_DEFERRING, Call.STAGE),
    CallState.STAGED_DISPATCHED: (Call.FWD_BWD_DEFERRING, Call.STAGE, Call.APPLY_DEFERRED_UPDATE_THEN_STAGED),
}
_TRAJECTORIES = [Trajectory(np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32), 0.5)]


def _make(worker, call: Call) -> None:
  """Makes ``call`` on ``worker`` (a remote worker of several micro-batches makes either apply_deferred_update as
  the one its state calls for)."""
  payload = _TRAJECTORIES
  {Call.FWD_BWD: lambda: worker.fwd_bwd(payload),
   Call.FWD_BWD_DEFERRING: lambda: worker.fwd_bwd(payload, defer_update=True),
   Call.STAGE: lambda: worker.stage_fwd_bwd(payload),
   Call.FWD_BWD_STAGED: worker.fwd_bwd_staged,
   Call.FWD_BWD_STAGED_DEFERRING: lambda: worker.fwd_bwd_staged(defer_update=True),
   Call.FWD_BWD_STAGED_UPDATING: lambda: worker.fwd_bwd_staged(apply_optimizer=True),
   Call.APPLY_DEFERRED_UPDATE: worker.apply_deferred_update,
   Call.APPLY_DEFERRED_UPDATE_THEN_STAGED: worker.apply_deferred_update,
   Call.UPDATE: worker.update,
   Call.RESTORE_CHECKPOINT: worker.restore_checkpoint}[call]()


def _assert_the_worker_follows_the_table(make_worker, states, calls_in) -> None:
  """From each state, each call: refused with the table's words and nothing changed, or led where it says."""
  for state in states:
    for call in calls_in(state):
      worker = make_worker()
      for into in _INTO[state]:
        _make(worker, into)
      assert worker.call_state is state
      outcome = ALLOWED_TRANSITIONS[state][call]
      if isinstance(outcome, CallState):
        _make(worker, call)
        assert worker.call_state is outcome, (state, call)
      else:
        with pytest.raises(WorkerUsageError) as excinfo:
          _make(worker, call)
        assert str(excinfo.value) == outcome.format(method=call.method, call=call.value), (state, call)
        assert worker.call_state is state
      assert (worker.update_owed, worker.has_staged) == (worker.call_state.update_owed, worker.call_state.has_staged)


class _ServedInProcess:
  """A remote worker's connection without the wire: every call is served by a ``ServedWorker`` over a recording
  engine in this process, whose refusals come back as the connection turns them."""

  def __init__(self, address, *, recipe_digest, token, limits, position):
    self.served = ServedWorker(RecordingEngine)
    self.hello = {"capabilities": dataclasses.asdict(self.served.capabilities)}
    self.offset_s = self.offset_error_s = 0.0
    self.methods: list[str] = []

  def call(self, header, parts=None):
    header, arrays = wire.decode(b"".join(parts if parts is not None else wire.encode_parts(header)))
    self.methods.append(header["method"])
    try:
      return wire.decode(self.served.call(header["method"], header, arrays))
    except Refused as refusal:
      raise WorkerUsageError(refusal.message.removeprefix("WorkerUsageError: ")) from None

  def receipt(self, data):
    return None if data is None else Receipt(
        kind=data["kind"], step=data["step"], micro_step=data["micro_step"], ready=None, dispatched_at=0.0,
        update=self.receipt(data["update"]))


@pytest.fixture
def remote_worker(monkeypatch):
  """Builds remote workers whose trainer is served in this process."""
  monkeypatch.setattr(client, "TrainerConnection", _ServedInProcess)
  return lambda micro_batches_per_step=1: client.RemoteTrainerWorker(
      "in-process:0", recipe_digest="fake", micro_batches_per_step=micro_batches_per_step)


def test_the_call_table_rules_every_call_in_every_state():
  assert set(ALLOWED_TRANSITIONS) == set(CallState)
  assert all(set(calls) == set(Call) for calls in ALLOWED_TRANSITIONS.values())
  with pytest.raises(WorkerUsageError, match="^fwd_bwd: the previous step's update is still owed; call apply_def"):
    next_call_state(CallState.UPDATE_OWED, Call.FWD_BWD_DEFERRING)
  assert next_call_state(CallState.UPDATE_OWED, Call.STAGE) is CallState.UPDATE_OWED_STAGED


_LOCAL_STATES = [s for s in CallState if s is not CallState.STAGED_DISPATCHED]


def _one_update_call(state: CallState) -> list[Call]:
  return [c for c in Call if c is not Call.APPLY_DEFERRED_UPDATE_THEN_STAGED]


def test_the_local_worker_follows_the_call_table():
  _assert_the_worker_follows_the_table(lambda: TrainerWorker(RecordingEngine()), _LOCAL_STATES, _one_update_call)


def test_the_remote_worker_follows_the_call_table_and_refuses_before_a_round_trip(remote_worker):
  _assert_the_worker_follows_the_table(remote_worker, _LOCAL_STATES, _one_update_call)

  def with_the_update_its_state_calls_for(state):  # several micro-batches: a staged input goes with the update
    skip = Call.APPLY_DEFERRED_UPDATE if state.has_staged else Call.APPLY_DEFERRED_UPDATE_THEN_STAGED
    return [c for c in Call if c is not skip]

  _assert_the_worker_follows_the_table(lambda: remote_worker(2), list(CallState), with_the_update_its_state_calls_for)
  worker = remote_worker()
  worker.fwd_bwd(_TRAJECTORIES, defer_update=True)
  sent = list(worker._connection.methods)
  with pytest.raises(WorkerUsageError, match="still owed"):
    worker.fwd_bwd(_TRAJECTORIES)
  assert worker._connection.methods == sent  # refused here: nothing went to the trainer


def test_the_server_refuses_a_call_out_of_order_by_the_same_table(remote_worker):
  """A client that skips the table (any gRPC caller) meets it on the server, in the same words."""
  served = remote_worker()._connection.served
  for header, outcome in (({"method": "fwd_bwd_staged"}, ALLOWED_TRANSITIONS[CallState.READY][Call.FWD_BWD_STAGED]),
                          ({"method": "apply_deferred_update", "then_dispatch_staged": True},
                           ALLOWED_TRANSITIONS[CallState.READY][Call.APPLY_DEFERRED_UPDATE_THEN_STAGED])):
    with pytest.raises(Refused) as excinfo:
      served.call(header["method"], header, {})
    call = Call.APPLY_DEFERRED_UPDATE_THEN_STAGED if "then_dispatch_staged" in header else Call.FWD_BWD_STAGED
    assert excinfo.value.message == "WorkerUsageError: " + outcome.format(method=call.method, call=call.value)
  assert wire.decode(served.call("state_digest", {}, {}))[0]["digest"] == "state-0"  # nothing changed


def test_a_call_the_table_allows_is_taken_by_every_worker(monkeypatch, remote_worker):
  """Negative control: allow a micro-batch while an update is owed, and the local worker, the remote one and its
  server all take it, so none of them keeps a rule of its own."""
  monkeypatch.setitem(ALLOWED_TRANSITIONS[CallState.UPDATE_OWED], Call.FWD_BWD, CallState.UPDATE_OWED)
  for worker in (TrainerWorker(RecordingEngine()), remote_worker()):
    worker.fwd_bwd(_TRAJECTORIES, defer_update=True)
    worker.fwd_bwd(_TRAJECTORIES)
    assert worker.call_state is CallState.UPDATE_OWED


@pytest.mark.parametrize("source_class", [SyntheticSteps, ReplaySteps, IterableSteps, LiveRollouts],
                         ids=lambda c: c.__name__)
def test_every_source_satisfies_the_step_source_protocol(source_class):
  assert missing_methods(source_class, StepSource) == ()


def test_only_the_live_source_has_the_live_part():
  assert missing_methods(LiveRollouts, LiveSource) == ()
  assert live_part(IterableSteps([[1]])) is None
  assert live_part(SyntheticSteps(SyntheticRollouts(64, 4, 8), 1)) is None


class _HalfLive(IterableSteps):
  """Claims to be live (it can be synced) but cannot say when a step waits for a sync."""

  def sync(self, version, weights):
    pass


def test_a_source_with_part_of_the_live_contract_is_refused_naming_what_it_lacks():
  with pytest.raises(TypeError, match="part live source: it lacks last_wait_s, blocked_on_sync, step_stats, check"):
    live_part(_HalfLive([[1]]))
  with pytest.raises(TypeError, match="blocked_on_sync"):
    RLProgram(TrainerWorker(RecordingEngine()), StepBoundaryPolicy(Mode.OFF), _HalfLive([["a"]]),
              ProgramConfig(steps=1, micro_batches_per_step=1))


class _PositionOnly:
  """An iterator with a position but not the rest of the StepSource contract (a raw grain iterator, say)."""

  def __iter__(self):
    return self

  def __next__(self):
    return ["a"]

  def get_state(self):
    return {"kind": "mine"}

  def set_state(self, state):
    pass


def test_a_source_with_a_position_but_part_of_the_contract_is_refused_not_wrapped():
  """Wrapping it as a plain iterable would drop its position from every checkpoint."""
  with pytest.raises(TypeError, match="part step source: it lacks state_json, count_steps, close"):
    as_step_source(_PositionOnly())


def test_a_plain_iterable_becomes_a_step_source_with_no_position():
  source = as_step_source([["a"], ["b"]])
  assert isinstance(source, StepSource) and source.get_state() is None and source.count_steps(10) == 2
  assert next(source) == ["a"]
  with pytest.raises(SourceStateError, match="no position to restore"):
    source.set_state({"kind": "synthetic", "next_step": 0})
  steps = SyntheticSteps(SyntheticRollouts(64, 4, 8), 1)
  assert as_step_source(steps) is steps


def test_step_metrics_keep_known_keys_as_fields_and_the_rest_as_extra():
  m = StepMetrics.coerce({"loss": 0.5, "tokens": 12, "micro_batch_losses": [1.0, 2.0]})
  assert (m.loss, m.tokens, m.grad_norm) == (0.5, 12, None)
  assert m.extra == {"micro_batch_losses": [1.0, 2.0]}
  assert StepMetrics.coerce(m) is m and StepMetrics.coerce({}) == StepMetrics() == StepMetrics.coerce(None)
  assert m.to_json()["micro_batch_losses"] == [1.0, 2.0] and m.to_json()["loss"] == 0.5


def test_the_worker_hands_back_typed_metrics_whatever_the_engine_returns():
  worker = TrainerWorker(RecordingEngine())
  worker.fwd_bwd("a", apply_optimizer=True)
  assert worker.get_metrics() == StepMetrics(step=1, loss=0.0)


def test_the_summary_json_holds_each_part_and_leaves_out_the_parts_that_do_not_apply():
  policy = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, wait_threshold_s=0.001)
  timings = StepTimings(steps=3, median_boundary_idle_s=0.0, median_boundary_idle_strict_s=0.001,
                        median_step_s=0.1, staged_boundaries=2)
  summary = RunSummary(timings=timings, policy=policy.report(), final_state_digest="abc")
  data = summary.to_json()
  assert data["requested_mode"] == "stage_before_update" and data["final_mode"] == "stage_before_update"
  assert data["steps"] == 3 and data["threshold_s"] == 0.001 and data["final_state_digest"] == "abc"
  assert not {"processes", "agreement", "trainer", "reward_first_step", "eval_accuracy_end"} & set(data)
  data = summary.replace(trainer={"location": "remote"}, run={"run_id": "r1"}).to_json()
  assert data["trainer"] == {"location": "remote"} and data["run_id"] == "r1"


def test_device_memory_round_trips_and_names_a_bad_report():
  memory = DeviceMemory(bytes_in_use=(10, 30), bytes_limit=(100, 100), input_bytes=(4, 4))
  assert memory.free_bytes == 70 and DeviceMemory.from_json(memory.to_json()) == memory
  assert DeviceMemory.from_json(None) is None
  for bad, named in (({"bytes_in_use": [1], "bytes_limit": [2]}, "lacks 'input_bytes'"),
                     ({"bytes_in_use": [1], "bytes_limit": [2, 3], "input_bytes": [1]}, "one per device"),
                     ({"bytes_in_use": [-1], "bytes_limit": [2], "input_bytes": [1]}, "bytes_in_use must be")):
    with pytest.raises(ValueError, match=named):
      DeviceMemory.from_json(bad)

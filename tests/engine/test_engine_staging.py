"""Prepared inputs train exactly like payloads; preparing changes nothing and blocks on nothing."""

from __future__ import annotations

import time

import pytest

from orchestrator.data.trajectory import Trajectory
from orchestrator.engine import backend_compile_count
from orchestrator.engine.placement import PINNED_HOST
from tests.conftest import run_child
from tests.engine_helpers import FailedComputation, LongComputation, run_staged, run_unstaged

STEPS, MICRO = 3, 3


def _steps(source):
  return [source.step(s, MICRO) for s in range(STEPS)]


def _losses(metrics):
  return [(m.loss, m.grad_norm, m.micro_batch_loss_sums) for m in metrics]


@pytest.fixture
def unstaged_reference(tiny_engine, tiny_source):
  metrics = run_unstaged(tiny_engine, _steps(tiny_source))
  return _losses(metrics), tiny_engine.state_digest()


@pytest.mark.engine
@pytest.mark.parametrize("before_update", [True, False], ids=["before_update", "after_update"])
def test_prepared_inputs_train_bit_identically_to_payloads(
    tiny_engine_and_start, tiny_source, unstaged_reference, before_update
):
  engine, start = tiny_engine_and_start
  engine.restore(start)
  metrics = run_staged(engine, _steps(tiny_source), before_update=before_update)
  assert (_losses(metrics), engine.state_digest()) == unstaged_reference


@pytest.mark.engine
def test_inputs_placed_through_pinned_host_memory_train_bit_identically(
    tiny_engine_and_start, tiny_source, unstaged_reference, monkeypatch
):
  """On a GPU or TPU every input goes through pinned host memory; forced here on CPU (which has that memory kind
  but keeps the plain copy) the two-step copy trains exactly as the plain one."""
  engine, start = tiny_engine_and_start
  engine.restore(start)
  assert engine._inputs.host_memory_kind is None  # CPU's own choice
  monkeypatch.setattr(engine._inputs, "host_memory_kind", PINNED_HOST)
  metrics = run_staged(engine, _steps(tiny_source))
  assert (_losses(metrics), engine.state_digest()) == unstaged_reference


@pytest.mark.engine
def test_staging_wrong_micro_batch_changes_training(tiny_engine_and_start, tiny_source, unstaged_reference):
  engine, start = tiny_engine_and_start
  engine.restore(start)
  run_staged(engine, _steps(tiny_source), stage_payload=lambda k, nxt: nxt[1])
  assert engine.state_digest() != unstaged_reference[1]


@pytest.mark.engine
def test_one_token_change_in_prepared_payload_changes_training(
    tiny_engine_and_start, tiny_source, unstaged_reference
):
  engine, start = tiny_engine_and_start
  engine.restore(start)

  def one_token_off(k, nxt):
    first = list(nxt[0])
    t = first[0]
    completion = t.completion_ids.copy()
    completion[0] = (completion[0] + 1) % engine.preset.vocab_size
    first[0] = Trajectory(t.prompt_ids, completion, t.advantage, t.old_logprobs, t.group_id)
    return first

  run_staged(engine, _steps(tiny_source), stage_payload=one_token_off)
  assert engine.state_digest() != unstaged_reference[1]


@pytest.mark.engine
def test_prepared_input_digest_is_content_addressed(tiny_engine, tiny_source):
  p = tiny_source.micro_batch(0, 0)
  a, b = tiny_engine.prepare_fwd_bwd_input(p), tiny_engine.prepare_fwd_bwd_input(list(p))
  c = tiny_engine.prepare_fwd_bwd_input(tiny_source.micro_batch(0, 1))
  assert a.digest == b.digest != c.digest
  assert a.loss_tokens == sum(len(t.completion_ids) for t in p)


@pytest.mark.engine
def test_prepare_changes_no_step_state(tiny_engine, tiny_source):
  e = tiny_engine
  e.fwd_bwd(tiny_source.micro_batch(0, 0))
  before = (e.train_step, e.micro_step_count, e.total_micro_steps, e.inflight_count)
  digest = e.state_digest()
  e.prepare_fwd_bwd_input(tiny_source.micro_batch(1, 0))
  assert (e.train_step, e.micro_step_count, e.total_micro_steps, e.inflight_count) == before
  assert e.state_digest() == digest
  assert e.fwd_bwd(tiny_source.micro_batch(0, 1)).micro_step == 1  # the next micro-batch is still the second


class _BlockingPrepare:
  """A wrong engine whose prepare waits for the device first (the bug prepare must not have)."""

  def __init__(self, engine):
    self.engine = engine

  def prepare_fwd_bwd_input(self, payload):
    self.engine.wait_for_device()
    return self.engine.prepare_fwd_bwd_input(payload)


@pytest.fixture(scope="module")
def long_computation():
  return LongComputation()


def _prepare_returns_while_in_flight(engine, prepare, payload, long_computation) -> bool:
  in_flight = long_computation.dispatch()
  engine._throttler.add(in_flight)  # a long computation queued on the engine
  try:
    prepare(payload)
    return not in_flight.is_ready()
  finally:
    engine.wait_for_device()
    engine._throttler._queue.clear()


@pytest.mark.engine
def test_prepare_does_not_wait_for_queued_computations(tiny_engine, tiny_source, long_computation):
  payload = tiny_source.micro_batch(0, 0)
  prepare = tiny_engine.prepare_fwd_bwd_input
  assert _prepare_returns_while_in_flight(tiny_engine, prepare, payload, long_computation)


@pytest.mark.engine
def test_blocking_prepare_is_caught(tiny_engine, tiny_source, long_computation):
  """Negative control: a prepare that waits on the queue fails the readiness check above."""
  payload = tiny_source.micro_batch(0, 0)
  wrong = _BlockingPrepare(tiny_engine).prepare_fwd_bwd_input
  assert not _prepare_returns_while_in_flight(tiny_engine, wrong, payload, long_computation)


@pytest.mark.engine
def test_wait_for_device_returns_seconds_blocked_and_dequeues_nothing(tiny_engine, long_computation):
  e = tiny_engine
  e._throttler.add(long_computation.dispatch())
  queued = e.inflight_count
  outer_start = time.perf_counter()
  waited = e.wait_for_device()
  outer = time.perf_counter() - outer_start
  assert 0.5 * outer <= waited <= outer
  assert e.inflight_count == queued
  idle_start = time.perf_counter()
  idle_wait = e.wait_for_device()
  assert idle_wait <= time.perf_counter() - idle_start
  assert idle_wait < 0.1 * waited  # the floor is tiny next to a real wait


@pytest.mark.engine
def test_wait_for_device_raises_a_failed_computations_error(tiny_engine):
  tiny_engine._throttler.add(FailedComputation())
  with pytest.raises(Exception, match="injected device failure"):
    tiny_engine.wait_for_device()
  tiny_engine._throttler._queue.clear()


@pytest.mark.engine
def test_prepared_inputs_cause_no_new_trace_or_compile(tiny_engine, tiny_source):
  e = tiny_engine
  e.fwd_bwd(tiny_source.micro_batch(0, 0))
  e.update()
  traces, compiles = dict(e.trace_counts), backend_compile_count()
  e.fwd_bwd(e.prepare_fwd_bwd_input(tiny_source.micro_batch(1, 0)))
  e.fwd_bwd(tiny_source.micro_batch(1, 1))
  e.update()
  e.wait_for_device()
  assert e.trace_counts == traces
  assert backend_compile_count() == compiles


@pytest.mark.engine
def test_lazy_jit_path_traces_once_for_payloads_and_prepared_inputs(tiny_source):
  from orchestrator.engine import build_engine

  e = build_engine("tiny", aot=False)
  e.fwd_bwd(tiny_source.micro_batch(0, 0))
  e.update()
  after_first = (dict(e.trace_counts), backend_compile_count())
  assert after_first[0] == {"accumulate": 1, "accumulate_dropless": 0, "apply": 1}
  e.fwd_bwd(e.prepare_fwd_bwd_input(tiny_source.micro_batch(1, 0)))
  e.fwd_bwd(tiny_source.micro_batch(1, 1))
  e.update()
  e.wait_for_device()
  assert (dict(e.trace_counts), backend_compile_count()) == after_first


@pytest.mark.engine
def test_input_prepared_by_another_engine_is_refused(tiny_engine, tiny_source):
  from dataclasses import replace

  prepared = tiny_engine.prepare_fwd_bwd_input(tiny_source.micro_batch(0, 0))
  foreign = replace(prepared, engine_id=prepared.engine_id + 1000)
  with pytest.raises(ValueError, match="prepared by engine"):
    tiny_engine.fwd_bwd(foreign)
  assert tiny_engine.micro_step_count == 0


MESH_CHILD = """
import numpy as np
from orchestrator.engine import build_engine
from orchestrator.data.synthetic import SyntheticRollouts
from tests.engine_helpers import run_staged, run_unstaged
mesh = {mesh}
e = build_engine("tiny", mesh=mesh, rows=8)
assert len(e.mesh.devices.flat) == {devices}, e.mesh
src = SyntheticRollouts(e.preset.vocab_size, e.rows, e.tokens_per_row, seed=3)
steps = [src.step(s, 2) for s in range(3)]
start = e.snapshot()
ref = run_unstaged(e, steps); ref_digest = e.state_digest()
for before in (True, False):
  e.restore(start)
  got = run_staged(e, steps, before_update=before)
  assert [m.loss for m in got] == [m.loss for m in ref], (got, ref)
  assert e.state_digest() == ref_digest
prepared = e.prepare_fwd_bwd_input(steps[0][0])
held = {{}}
for array in prepared.arrays.values():
  for shard in array.addressable_shards:
    held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
assert len(held) == {devices} and prepared.bytes_per_device == tuple(held[i] for i in sorted(held)), held
# by field: each field's shards, summed over the devices; together the placed arrays' bytes
by_field = {{name: sum(s.data.nbytes for s in array.addressable_shards) for name, array in prepared.arrays.items()}}
assert prepared.bytes_by_field == by_field and sum(by_field.values()) == sum(held.values()), by_field
assert e.device_memory() is None  # CPU devices report no allocator statistics
leaf = e.export_weights()["layers"][0]["attn"]["q_proj"]["w"]
print("sharding", leaf.sharding.spec, "devices", len(leaf.sharding.device_set))
assert len(leaf.sharding.device_set) == {devices}
print("CHILD-OK")
"""


@pytest.mark.e2e
@pytest.mark.parametrize(
    "mesh,devices",
    [({"fsdp": 2, "expert": 2}, 4), ({"fsdp": 2, "context": 2, "expert": 2}, 8)],
    ids=["fsdp2xexpert2", "fsdp2xcontext2xexpert2"],
)
def test_prepared_inputs_bit_identical_on_multi_axis_mesh(mesh, devices):
  out = run_child(MESH_CHILD.format(mesh=mesh, devices=devices), devices=devices)
  assert "sharding" in out

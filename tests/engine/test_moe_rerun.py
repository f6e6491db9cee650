"""MoE capacity routing and dropless re-runs: a re-run equals dropless-from-the-start, bit for bit;
staging before update() leaves the pending overflow check alone."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from orchestrator.data.trajectory import Trajectory
from orchestrator.engine import backend_compile_count, build_engine
from tests.engine_helpers import run_staged, run_unstaged

# tiny_moe: 4 experts, top-2, 4 rows x 64 tokens. With factor 0.5 each expert takes
# ceil(0.5 * 256 * 2 / 4) = 64 assignments: a micro-batch of <= 32 real tokens can
# never overflow (<= 64 assignments in all); one of > 128 tokens always does
# (> 256 assignments, 4 * 64 slots).
FACTOR = 0.5
SMALL, BIG = 30, 200


def _payload(tokens: int, seed: int) -> list[Trajectory]:
  rng = np.random.default_rng(seed)
  out, left = [], tokens
  while left > 0:
    n = min(left, 60)
    prompt = max(1, n // 3)
    out.append(Trajectory(
        rng.integers(1, 512, prompt, dtype=np.int32),
        rng.integers(1, 512, n - prompt, dtype=np.int32),
        float(rng.normal()), -rng.exponential(1.0, n - prompt).astype(np.float32), 0,
    ))
    left -= n
  return out


# Each step's last micro-batch overflows; step 1's first does too.
PATTERN = [[SMALL, SMALL, BIG], [BIG, SMALL, BIG], [SMALL, SMALL, BIG]]
STEPS = [[_payload(n, 100 * k + i) for i, n in enumerate(sizes)] for k, sizes in enumerate(PATTERN)]
EXPECTED_RERUNS = [1, 2, 1]
EXPECTED_RERUN_INDICES = [[2], [0, 2], [2]]


@pytest.fixture(scope="module")
def rerun_engine():
  engine = build_engine("tiny_moe", ragged_buffer_factor=FACTOR, retry_when_tokens_dropped=True)
  return engine, engine.snapshot()


def _reference_dropless_from_the_start(engine):
  """Overflowing micro-batches run with the dropless program from the start."""
  metrics = []
  for k, payloads in enumerate(STEPS):
    for i, p in enumerate(payloads):
      engine.fwd_bwd(p, dropless=PATTERN[k][i] == BIG)
    engine.update()
    metrics.append(engine.get_metrics())
  return metrics


def _summary(metrics):
  return [(m.loss, m.grad_norm, m.tokens) for m in metrics]


@pytest.mark.engine
@pytest.mark.parametrize("aot", [True, False], ids=["compiled", "lazy-jit"])
def test_rerun_equals_dropless_from_the_start_bit_for_bit(rerun_engine, aot):
  if aot:
    engine, start = rerun_engine
  else:
    engine = build_engine("tiny_moe", ragged_buffer_factor=FACTOR, retry_when_tokens_dropped=True, aot=False)
    start = engine.snapshot()
  engine.restore(start)
  rerun = run_unstaged(engine, STEPS)
  digest = engine.state_digest()
  engine.restore(start)
  reference = _reference_dropless_from_the_start(engine)
  assert engine.state_digest() == digest
  assert _summary(rerun) == _summary(reference)
  assert [m.reruns for m in rerun] == EXPECTED_RERUNS
  assert [m.rerun_micro_batches for m in rerun] == EXPECTED_RERUN_INDICES
  assert [m.reruns for m in reference] == [0, 0, 0]


@pytest.mark.engine
def test_metrics_report_dropped_tokens_per_micro_batch(rerun_engine):
  engine, start = rerun_engine
  engine.restore(start)
  metrics = run_unstaged(engine, STEPS)
  for m, sizes in zip(metrics, PATTERN):
    dropped = m.dropped_tokens
    assert len(dropped) == 3
    assert [d > 0 for d in dropped] == [n == BIG for n in sizes]


@pytest.mark.engine
def test_discarded_first_run_is_not_counted_twice(rerun_engine):
  """Negative control: without re-runs the overflowed gradients differ from dropless ones."""
  engine, start = rerun_engine
  engine.restore(start)
  reference = _reference_dropless_from_the_start(engine)
  plain = build_engine("tiny_moe", ragged_buffer_factor=FACTOR)  # drops, never re-runs
  plain_metrics = run_unstaged(plain, STEPS)
  assert [m.reruns for m in plain_metrics] == [0, 0, 0]
  assert _summary(plain_metrics) != _summary(reference)


@pytest.mark.engine
def test_staged_order_matches_unstaged_with_reruns(rerun_engine):
  engine, start = rerun_engine
  engine.restore(start)
  unstaged = run_unstaged(engine, STEPS)
  digest = engine.state_digest()
  compiles = backend_compile_count()
  traces = dict(engine.trace_counts)
  engine.restore(start)
  staged = run_staged(engine, STEPS, before_update=True)
  assert engine.state_digest() == digest
  assert _summary(staged) == _summary(unstaged)
  assert [m.reruns for m in staged] == EXPECTED_RERUNS
  assert backend_compile_count() == compiles and engine.trace_counts == traces


@pytest.mark.engine
def test_prepare_and_wait_leave_the_pending_overflow_check_alone(rerun_engine):
  engine, start = rerun_engine
  engine.restore(start)
  for p in STEPS[0]:
    last = engine.fwd_bwd(p)
  assert engine.overflow_check_pending
  engine.prepare_fwd_bwd_input(STEPS[1][0])
  assert engine.overflow_check_pending
  engine.wait_for_device()
  assert last.ready.is_ready() and engine.overflow_check_pending
  engine.update()
  assert not engine.overflow_check_pending
  assert engine.get_metrics().rerun_micro_batches == [2]


@pytest.mark.engine
def test_rerunning_the_prepared_input_instead_of_the_last_is_caught(rerun_engine):
  """Negative control: a re-run of the staged input trains differently."""
  engine, start = rerun_engine
  engine.restore(start)
  run_unstaged(engine, STEPS)
  reference = engine.state_digest()
  engine.restore(start)
  honest_prepare = engine.prepare_fwd_bwd_input

  def buggy_prepare(payload):
    prepared = honest_prepare(payload)
    if engine._in_progress.pending_check is not None:
      engine._in_progress.pending_check = dataclasses.replace(engine._in_progress.pending_check, batch=prepared.arrays)
    return prepared

  engine.prepare_fwd_bwd_input = buggy_prepare
  try:
    run_staged(engine, STEPS, before_update=True)
  finally:
    del engine.prepare_fwd_bwd_input
  assert engine.state_digest() != reference


@pytest.mark.engine
def test_staging_the_next_steps_second_micro_batch_is_caught(rerun_engine):
  engine, start = rerun_engine
  engine.restore(start)
  run_unstaged(engine, STEPS)
  reference = engine.state_digest()
  engine.restore(start)
  run_staged(engine, STEPS, before_update=True, stage_payload=lambda k, nxt: nxt[1])
  assert engine.state_digest() != reference


@pytest.fixture(scope="module")
def long_micro_batch_engines():
  """Micro-batches long enough (16 x 256 tokens) that an update that does not wait returns first."""
  kw = dict(rows=16, tokens_per_row=256, max_inflight=4)
  rerun = build_engine("tiny_moe", ragged_buffer_factor=8.0, retry_when_tokens_dropped=True, **kw)
  dropless = build_engine("tiny_moe", ragged_buffer_factor=-1, **kw)
  payload = [tr for i in range(16) for tr in _payload(200, 900 + i)][:64]
  return rerun, dropless, payload


@pytest.mark.engine
def test_update_waits_for_the_last_micro_batch_under_reruns(long_micro_batch_engines):
  rerun, _, payload = long_micro_batch_engines
  last = rerun.fwd_bwd(payload)
  rerun.update()
  assert last.ready.is_ready()  # the overflow flag was read on the host
  rerun.wait_for_device()


@pytest.mark.engine
def test_update_does_not_wait_when_fully_dropless(long_micro_batch_engines):
  _, dropless, payload = long_micro_batch_engines
  last = dropless.fwd_bwd(payload)
  dropless.update()
  assert not last.ready.is_ready()
  dropless.wait_for_device()


@pytest.mark.engine
@pytest.mark.parametrize(
    "preset,options,message",
    [
        ("tiny", {"retry_when_tokens_dropped": True, "ragged_buffer_factor": 1.0},
         "engine.retry_when_tokens_dropped=true needs an MoE model, but 'tiny' is dense"),
        ("tiny_moe", {"ragged_buffer_factor": 0}, "engine.ragged_buffer_factor=0 is out of range: use -1"),
        ("tiny_moe", {"ragged_buffer_factor": -0.5}, "engine.ragged_buffer_factor=-0.5 is out of range"),
        ("tiny_moe", {"retry_when_tokens_dropped": True},
         "retry_when_tokens_dropped=true with engine.ragged_buffer_factor=-1"),
    ],
    ids=["rerun-dense", "factor-zero", "factor-negative", "rerun-dropless"],
)
def test_bad_config_combinations_fail_at_construction(preset, options, message):
  with pytest.raises(ValueError, match=message):
    build_engine(preset, **options)


@pytest.mark.engine
@pytest.mark.parametrize("factor", [-1, -1.0])
def test_minus_one_and_minus_one_point_zero_are_the_same_dropless_layout(factor):
  from orchestrator.engine.engine import EngineOptions

  assert EngineOptions(ragged_buffer_factor=factor).capacity_factor is None


@pytest.mark.engine
def test_skip_nonfinite_updates_skips_and_counts(tiny_source):
  poison = [Trajectory(np.array([1, 2], np.int32), np.array([3, 4], np.int32), -1.0,
                       np.array([-1e30, -1e30], np.float32), 0)]
  guarded = build_engine("tiny", skip_nonfinite_updates=True)
  before = guarded.state_digest()
  guarded.fwd_bwd(poison, apply_optimizer=True)
  m = guarded.get_metrics()
  assert m.skipped_update and m.skipped_updates_total == 1 and not np.isfinite(m.grad_norm)
  assert guarded.state_digest() == before and guarded.train_step == 1
  guarded.fwd_bwd(tiny_source.micro_batch(0, 0), apply_optimizer=True)  # training goes on
  assert np.isfinite(guarded.get_metrics().loss) and guarded.state_digest() != before


@pytest.mark.engine
def test_without_the_guard_a_nonfinite_update_poisons_the_weights():
  """Negative control for the test above."""
  poison = [Trajectory(np.array([1, 2], np.int32), np.array([3, 4], np.int32), -1.0,
                       np.array([-1e30, -1e30], np.float32), 0)]
  engine = build_engine("tiny")
  engine.fwd_bwd(poison, apply_optimizer=True)
  leaves = jax.tree.leaves(jax.device_get(engine.export_weights()))
  assert not all(np.isfinite(x).all() for x in leaves)


MOE_MESH_CHILD = """
from orchestrator.engine import build_engine
from orchestrator.data.synthetic import SyntheticRollouts
from tests.engine_helpers import run_staged, run_unstaged
e = build_engine("tiny_moe", mesh={"fsdp": 2, "expert": 2}, rows=8, ragged_buffer_factor=0.9,
                 retry_when_tokens_dropped=True)
spec = e.export_weights()["layers"][0]["mlp"]["gate_proj"].sharding.spec
assert tuple(spec)[:2] == ("expert", "fsdp"), spec
src = SyntheticRollouts(512, 8, 64, seed=3)
steps = [src.step(s, 2) for s in range(3)]
start = e.snapshot()
ref = run_unstaged(e, steps)
digest = e.state_digest()
e.restore(start)
got = run_staged(e, steps, before_update=True)
assert e.state_digest() == digest
assert [m.reruns for m in got] == [m.reruns for m in ref] and sum(m.reruns for m in ref) > 0
print("CHILD-OK")
"""


@pytest.mark.e2e
def test_reruns_and_staging_on_an_fsdp_by_expert_mesh():
  """Expert weights sharded over `expert`, rows over fsdp x expert: staged == unstaged, with re-runss."""
  from tests.conftest import run_child

  run_child(MOE_MESH_CHILD, devices=4)

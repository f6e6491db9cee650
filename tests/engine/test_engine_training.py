"""Training semantics: accumulation equals one big batch, checkpoints resume exactly, misuse is refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from orchestrator.engine import build_engine
from orchestrator.engine.mesh import MeshConfig, describe_devices, device_summary, missing_devices
from orchestrator.engine.optimizer import LearningRates
from orchestrator.engine.options import EngineOptions
from orchestrator.engine.step_record import StepInProgress
from tests.engine_helpers import run_unstaged


@pytest.mark.engine
def test_micro_batches_and_one_update_equal_one_big_batch(tiny_source):
  """M micro-batches + update == the same rows as one micro-batch, up to float reassociation."""
  small = build_engine("tiny", rows=4)
  big = build_engine("tiny", rows=8)
  payloads = [tiny_source.micro_batch(0, 0), tiny_source.micro_batch(0, 1)]
  for p in payloads:
    small.fwd_bwd(p)
  small.update()
  big.fwd_bwd(payloads[0] + payloads[1], apply_optimizer=True)
  a, b = small.get_metrics(), big.get_metrics()
  assert a.tokens == b.tokens == sum(len(t.completion_ids) for p in payloads for t in p)
  assert a.loss == pytest.approx(b.loss, rel=1e-5)
  assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
  for x, y in zip(_leaves(small.export_weights()), _leaves(big.export_weights())):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def _leaves(tree):
  import jax

  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.mark.engine
def test_update_without_micro_batch_is_refused(tiny_engine):
  with pytest.raises(RuntimeError, match="no micro-batch accumulated"):
    tiny_engine.update()


@pytest.mark.engine
def test_skipped_update_changes_training(tiny_engine_and_start, tiny_source):
  """Negative control for the bit-identity checks: dropping one update shows in the digest."""
  engine, start = tiny_engine_and_start
  steps = [tiny_source.step(s, 2) for s in range(3)]
  engine.restore(start)
  run_unstaged(engine, steps)
  reference = engine.state_digest()
  engine.restore(start)
  for k, payloads in enumerate(steps):
    for p in payloads:
      engine.fwd_bwd(p)
    if k != 1:
      engine.update()
  assert engine.state_digest() != reference


@pytest.mark.engine
def test_checkpoint_save_restore_continue_equals_uninterrupted(tmp_path, tiny_source):
  steps = [tiny_source.step(s, 2) for s in range(4)]
  straight = build_engine("tiny", checkpoint_dir=str(tmp_path / "a"))
  run_unstaged(straight, steps)

  first = build_engine("tiny", checkpoint_dir=str(tmp_path / "b"))
  run_unstaged(first, steps[:2])
  path = first.save_checkpoint({"recipe": "test"})
  assert path.endswith("/2")

  resumed = build_engine("tiny", seed=123, checkpoint_dir=str(tmp_path / "b"))
  assert resumed.state_digest() != first.state_digest()
  meta = resumed.restore_checkpoint()
  assert meta == {"step": 2, "recipe": "test"}
  assert resumed.train_step == 2
  assert resumed.state_digest() == first.state_digest()
  run_unstaged(resumed, steps[2:])
  assert resumed.state_digest() == straight.state_digest()


@pytest.mark.engine
def test_checkpoint_mid_step_saves_the_state_of_the_last_update(tmp_path, tiny_source):
  e = build_engine("tiny", checkpoint_dir=str(tmp_path))
  run_unstaged(e, [tiny_source.step(0, 2)])
  after_update = e.state_digest()
  e.fwd_bwd(tiny_source.micro_batch(1, 0))  # the next step has begun
  e.save_checkpoint()
  e.fwd_bwd(tiny_source.micro_batch(1, 1), apply_optimizer=True)
  assert e.restore_checkpoint()["step"] == 1
  assert e.state_digest() == after_update and e.micro_step_count == 0


@pytest.mark.engine
def test_checkpoint_needs_a_directory(tiny_engine):
  with pytest.raises(RuntimeError, match="checkpoint_dir"):
    tiny_engine.save_checkpoint()


@pytest.mark.engine
def test_build_engine_refuses_unknown_options_and_presets():
  with pytest.raises(ValueError, match="unknown options \\['rowz'\\]"):
    build_engine("tiny", rowz=4)
  with pytest.raises(ValueError, match="model preset 'nope' not found.*tiny"):
    build_engine("nope")
  with pytest.raises(ValueError, match="needs 4 devices but 1 are visible"):
    build_engine("tiny", mesh={"fsdp": 4})
  with pytest.raises(ValueError, match="unknown axes \\['tp'\\]"):
    build_engine("tiny", mesh={"tp": 2})


@pytest.mark.engine
def test_the_device_hint_names_the_devices_each_process_needs():
  """XLA forces devices per process: two processes on one CPU host need 2 each for a 4-device mesh, not 4."""
  mesh = MeshConfig(fsdp=2, expert=2)
  flag = "--xla_force_host_platform_device_count="
  assert missing_devices(mesh, visible=4, processes=2) is None
  assert f"{flag}4 before" in missing_devices(mesh, visible=1, processes=1)
  job = missing_devices(mesh, visible=2, processes=2)
  assert f"{flag}2 in every process" in job and "4 ÷ 2" in job and f"{flag}4" not in job
  assert f"{flag}1 in every process" in missing_devices(mesh, visible=2, processes=4)
  uneven = missing_devices(mesh, visible=3, processes=3)
  assert "cannot split 4 devices evenly" in uneven and flag not in uneven


@pytest.mark.e2e
def test_the_device_report_names_platform_kind_count_and_jax():
  """What run_rl's opening line says about the devices: per kind, the platform where the kind does not say it."""
  found = f"devices: {len(jax.devices())} × cpu, the mesh uses 1; JAX {jax.__version__}"
  assert describe_devices(MeshConfig()) == found
  gpus = device_summary([("gpu", "NVIDIA H100 80GB HBM3")] * 8, 4, "0.12.0")
  assert gpus == "devices: 8 × NVIDIA H100 80GB HBM3 (gpu), the mesh uses 4; JAX 0.12.0"
  tpus = device_summary([("tpu", "TPU v5 lite")] * 4 + [("cpu", "cpu")], 4, "0.10.2")
  assert tpus == "devices: 4 × TPU v5 lite, 1 × cpu, the mesh uses 4; JAX 0.10.2"


@pytest.mark.engine
def test_the_step_in_progress_records_each_micro_batch_once_and_a_finished_step_keeps_its_own():
  """A dropless re-run replaces its micro-batch's loss, not its dropped tokens; a finished step is not changed by
  the next one."""
  step = StepInProgress()
  step.record(0, np.float32(1.0), np.array([4, 4.0, 1, 0, 0, 4]), np.int32(2))
  step.record(1, np.float32(3.0), np.array([4, 2.0, 0, 0, 0.4, 4]), np.int32(0))
  step.record(0, np.float32(5.0), np.array([4, 6.0, 2, 0, 0.8, 4]), np.int32(0))  # micro-batch 0 re-run dropless
  step.micro, step.reruns = 2, [0]
  finished = step.finish(7, {"loss": np.float32(2.0), "grad_norm": np.float32(0.5), "tokens": np.float32(8)},
                         skipped=False)
  step.reset()
  step.record(0, np.float32(9.0), np.array([1, 1.0, 1, 0, 9.0, 1]), np.int32(1))
  rates = LearningRates(EngineOptions(learning_rate=0.5, warmup_steps=10))
  metrics = finished.host_metrics(skipped_updates_total=1, learning_rates=rates)
  assert metrics.learning_rate == 0.5 * 5 / 10  # update 7 after one skipped: the optimizer applied 5 before it
  assert metrics.step == 7 and metrics.micro_batches == 2 and metrics.micro_batch_loss_sums == [5.0, 3.0]
  assert metrics.micro_batch_tokens == [4, 4] and metrics.entropy == 1.0 and metrics.clip_fraction == 0.25
  assert metrics.ppo_kl == pytest.approx(1.2 / 8)  # the re-run's drift, not the discarded run's
  assert metrics.dropped_tokens == [2, 0] and metrics.rerun_micro_batches == [0] and metrics.reruns == 1
  assert metrics.loss == 2.0 and not metrics.skipped_update and metrics.skipped_updates_total == 1
  assert step.micro == 0 and len(step.micro_losses) == 1 and step.micro_losses[0][0] == 9.0
  assert step.take_pending_check() is None

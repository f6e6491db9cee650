"""``python -m orchestrator.bench.moe``: its summary of the rounds, and one short run of both arms."""

from __future__ import annotations

import pytest

from orchestrator.bench import moe as bench


@pytest.mark.spec
def test_the_summary_is_each_arms_median_with_its_range_and_the_per_round_ratio():
  summary = bench.summarise({"engine": [2.0, 1.0, 1.5], "tunix": [4.0, 2.0, 2.5]})
  assert summary["engine"] == {"step_s": 1.5, "low_s": 1.0, "high_s": 2.0}
  assert summary["tunix"] == {"step_s": 2.5, "low_s": 2.0, "high_s": 4.0}
  assert summary["ratio"] == {"median": 0.5, "low": 0.5, "high": 0.6}  # per round: 0.5, 0.5, 0.6


@pytest.mark.e2e
def test_both_arms_train_the_same_shape_and_the_engine_routes(capsys):
  """tiny_moe, one round: both arms run their steps; Tunix's arm keeps Tunix's own MoE layer."""
  from tunix.models.qwen3.model import MoELayer

  from orchestrator.models.presets import load_preset

  preset = load_preset("tiny_moe")
  batches = bench._batches(preset, 2, 2)
  engine, tunix = bench.EngineArm(preset, 2), bench.TunixArm(preset, 2)
  assert all(s > 0 for s in bench.time_steps(engine, batches) + bench.time_steps(tunix, batches))
  assert type(tunix.model.layers[0].mlp) is MoELayer
  result = bench.run_preset("tiny_moe", rounds=1, steps=1, micro_batches=2)
  assert result["experts"] == 4 and result["ratio"]["median"] > 0

"""Model FLOPs and MFU (``engine.flops``): the weights a token meets are the model's published size, an MoE counts
the experts a token is routed to, and the peak is known only for chips in the table."""

from __future__ import annotations

import pytest

from orchestrator.engine.flops import PEAK_FLOPS_PER_S, matmul_params_per_token, peak_flops_per_s, step_model_flops
from orchestrator.models.presets import load_preset

pytestmark = pytest.mark.spec


def test_qwen3_0p6b_meets_its_published_weights_per_token():
  # 28 layers × (q, k, v, o: 6.29 M; MLP: 9.44 M) + the tied head, 155.58 M: Qwen3-0.6B's 0.6 B without norms
  assert matmul_params_per_token(load_preset("qwen3_0p6b_shape")) == 595_984_384


def test_an_moe_counts_its_router_and_the_experts_each_token_is_routed_to():
  preset = load_preset("moe24_top8")
  d, f = preset.embed_dim, preset.hidden_dim
  attention = d * preset.num_heads * preset.head_dim * 2 + d * preset.num_kv_heads * preset.head_dim * 2
  per_layer = attention + d * preset.num_experts + preset.num_experts_per_tok * 3 * d * f
  assert matmul_params_per_token(preset) == preset.num_layers * per_layer + d * preset.vocab_size


def test_a_steps_flops_are_six_per_weight_and_token_plus_attention():
  preset = load_preset("tiny")
  flops = step_model_flops(preset, rows=4, tokens_per_row=64, micro_batches=3)
  tokens = 4 * 64 * 3
  attention = 12 * preset.num_layers * 64 * preset.num_heads * preset.head_dim
  assert flops == tokens * (6 * matmul_params_per_token(preset) + attention)
  assert step_model_flops(preset, rows=4, tokens_per_row=64, micro_batches=6) == 2 * flops


def test_the_peak_is_summed_over_known_chips_and_unknown_elsewhere():
  assert peak_flops_per_s(["TPU v5 lite"]) == PEAK_FLOPS_PER_S["TPU v5 lite"] == 197e12
  assert peak_flops_per_s(["TPU v5 lite"] * 4) == 4 * 197e12
  assert peak_flops_per_s(["cpu"]) is None
  assert peak_flops_per_s(["TPU v5 lite", "cpu"]) is None
  assert peak_flops_per_s([]) is None

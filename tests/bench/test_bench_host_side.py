"""``python -m orchestrator.bench.host_side``: its micro-batches, and one stage of each arm measured."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.bench import host_side as bench
from orchestrator.data.packing import FIELDS, RoutingShape, fits

ROUTING = RoutingShape(layers=3, top_k=2, num_experts=8)


@pytest.mark.spec
def test_the_micro_batch_fills_its_long_rows_two_trajectories_each_with_a_top_k_routing():
  payload = bench.payload(4, 256, ROUTING, vocab_size=512)
  assert len(payload) == 8 and all(t.num_tokens == 128 for t in payload)
  assert fits(payload, rows=4, tokens_per_row=256) and not fits(payload + payload[:1], rows=4, tokens_per_row=256)
  for t in payload:
    assert t.routing.shape == (128, 3, 2) and t.routing.dtype == np.int16
    assert (t.routing[..., 0] != t.routing[..., 1]).all() and t.routing.max() < 8  # distinct, as a top-k's
  assert all(t.routing is None for t in bench.payload(4, 256, None, vocab_size=512))


@pytest.mark.engine
def test_a_stage_is_measured_with_its_bytes_and_the_host_memory_it_adds():
  for routing in (None, ROUTING):
    arm = bench.stage_arm(2, 64, routing, repeats=2, vocab_size=512)
    per_token = sum(d.itemsize for d in FIELDS.values()) + (0 if routing is None else 3 * 2 * 2)
    assert arm["staged_bytes"] == 2 * 64 * per_token
    assert arm["host_bytes_added"] >= arm["staged_bytes"]  # the packed arrays, held for the step
    assert all(arm[k]["low"] <= arm[k]["median"] <= arm[k]["high"] for k in ("mapping_s", "placement_s"))

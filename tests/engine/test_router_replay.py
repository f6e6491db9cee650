"""Rollout routing replay: the trainer routes by the recorded experts, which ride in the staged micro-batch."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from orchestrator.app import cli
from orchestrator.data import packing
from orchestrator.data.synthetic import SyntheticRollouts
from orchestrator.data.trajectory import Trajectory
from orchestrator.engine import build_engine, moe
from orchestrator.engine import engine as engine_module
from orchestrator.engine.loss import LossConfig, attention_mask
from orchestrator.engine.model import build_model
from orchestrator.models.presets import load_preset
from orchestrator.engine.step_math import loss_sum_fn

PRESET = load_preset("tiny_moe")
ROUTING = packing.RoutingShape(layers=PRESET.num_layers, top_k=PRESET.num_experts_per_tok,
                               num_experts=PRESET.num_experts)
OPTIONS = dict(rows=4, ragged_buffer_factor=1.0, retry_when_tokens_dropped=True)


def _own_routing(payloads):
  """``payloads`` with each trajectory's routing as the engine's starting weights choose it (same seed): one
  compiled forward pass of a row as long as the engine's, the trajectory first and padding after it in a segment
  of its own (causal attention: the padding changes nothing before it)."""
  graphdefs, params, _ = build_model(PRESET, 0)
  row_tokens = PRESET.tokens_per_row

  @jax.jit
  def routing_of_row(params, tokens, segments):
    model = nnx.merge(graphdefs["dropless"], params)
    return moe.routing_of(model, tokens, jnp.arange(row_tokens)[None], attention_mask(segments), segments > 0)

  def own(t):
    tokens = np.concatenate([t.prompt_ids, t.completion_ids])
    row, segments = np.zeros((1, row_tokens), np.int32), np.zeros((1, row_tokens), np.int32)
    row[0, :len(tokens)], segments[0, :len(tokens)] = tokens, 1
    return dataclasses.replace(t, routing=np.asarray(routing_of_row(params, row, segments)[0, :len(tokens)]))

  return [[own(t) for t in payload] for payload in payloads]


def _step(engine, payloads):
  for payload in payloads:
    engine.fwd_bwd(payload)
  engine.update()
  m = engine.get_metrics()
  return m.loss, m.grad_norm, m.dropped_tokens, m.reruns


@pytest.fixture(scope="module")
def payloads():
  source = SyntheticRollouts(PRESET.vocab_size, 4, PRESET.tokens_per_row, seed=5)
  return _own_routing([source.micro_batch(0, i) for i in range(2)])


@pytest.mark.engine
def test_replaying_the_trainers_own_routing_trains_exactly_as_routing_itself(payloads):
  """Weights at the replayed experts renormalised are top-k's weights: the same step, bit for bit, drops and
  re-runs included."""
  plain = build_engine(PRESET, **OPTIONS)
  replayed = build_engine(PRESET, router_replay=True, **OPTIONS)
  got, want = _step(replayed, payloads), _step(plain, [[dataclasses.replace(t, routing=None) for t in p]
                                                       for p in payloads])
  assert got == want and sum(got[2]) > 0  # some tokens were dropped, the same ones


@pytest.mark.engine
def test_one_corrupted_expert_id_changes_the_loss_and_the_update_negative_control(payloads):
  """The presets' experts start small, so one token's other expert moves the loss little — but it moves it,
  and the update sends that token's gradient to another expert."""
  t = next(t for t in payloads[0] if t.advantage > 0)
  routing = t.routing.copy()
  position = len(t.prompt_ids) - 1  # predicts the first completion token; the first MoE layer
  routing[position, 0, 0] = next(e for e in range(PRESET.num_experts) if e not in routing[position, 0])
  corrupted = [dataclasses.replace(x, routing=routing) if x is t else x for x in payloads[0]]
  graphdefs, params, _ = build_model(PRESET, 0)
  loss_sum = loss_sum_fn(graphdefs["dropless"], LossConfig(0.2, 0.28, None, "token_mean", PRESET.tokens_per_row,
                                                           0.0, "k3"))
  sums = [float(loss_sum(params, packing.pack_payload(p, rows=4, tokens_per_row=PRESET.tokens_per_row,
                                                      vocab_size=PRESET.vocab_size, routing=ROUTING))[0])
          for p in (payloads[0], corrupted)]
  assert sums[0] != sums[1]
  engine = build_engine(PRESET, router_replay=True, **OPTIONS)
  start = engine.snapshot()
  digests = []
  for first in (payloads[0], corrupted):
    engine.restore(start)
    _step(engine, [first, payloads[1]])
    digests.append(engine.state_digest())
  assert digests[0] != digests[1]


@pytest.mark.engine
def test_the_layers_route_to_the_recorded_experts():
  graphdefs, params, _ = build_model(PRESET, 0)
  model = nnx.merge(graphdefs["dropless"], params)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, PRESET.vocab_size, (2, 16)).astype(np.int32)
  segments = np.ones_like(tokens)
  replay = np.argsort(rng.random((2, 16, ROUTING.layers, ROUTING.num_experts)), -1)[..., :ROUTING.top_k]
  positions = np.broadcast_to(np.arange(16), tokens.shape)
  chosen = moe.routing_of(model, tokens, positions, attention_mask(segments), segments > 0, replay=replay)
  own = moe.routing_of(model, tokens, positions, attention_mask(segments), segments > 0)
  assert np.array_equal(np.asarray(chosen), replay) and not np.array_equal(np.asarray(own), replay)


@pytest.mark.engine
def test_the_staged_routing_is_counted_by_field_and_in_the_memory_gate(payloads, monkeypatch):
  engine = build_engine(PRESET, router_replay=True, **OPTIONS)
  prepared = engine.prepare_fwd_bwd_input(payloads[0])
  by_field = prepared.bytes_by_field
  assert by_field[packing.ROUTING] == 4 * PRESET.tokens_per_row * ROUTING.layers * ROUTING.top_k * 2
  assert sum(by_field.values()) == sum(prepared.bytes_per_device)
  # what the headroom rule adds per input (a CPU reports no allocator statistics: give it some)
  monkeypatch.setattr(engine_module, "allocator_stats", lambda devices: (0, 1 << 30))
  assert engine.device_memory().input_bytes == prepared.bytes_per_device
  with pytest.raises(ValueError, match=r"payload\[0\] carries no routing"):
    engine.prepare_fwd_bwd_input([dataclasses.replace(t, routing=None) for t in payloads[0]])


@pytest.mark.engine
def test_a_sampler_records_the_routing_its_weights_choose():
  from orchestrator.live.sampler import LiveSampler
  from orchestrator.tasks.tokenizer import CharTokenizer

  sampler = LiveSampler(PRESET, CharTokenizer(), seed=0, max_prompt_length=16, max_generation_steps=4,
                        routing=ROUTING)
  samples = sampler.sample(["abc", "hello"], seed=1)
  recorded, = _own_routing([[Trajectory(p, c, 0.0) for p, c in zip(samples.prompt_ids, samples.completion_ids)]])
  for routing, t in zip(samples.routing, recorded):
    assert routing.dtype == np.int16 and np.array_equal(routing, t.routing)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_recording_with_routing_trains_to_one_digest_in_every_mode(tmp_path):
  recipe = ["--recipe", "recipes/rig_cpu_moe.yaml", "moe.router_replay=true", "batch.rows=8", "rollouts.groups=48"]
  assert cli.main(["record", *recipe, "--out", str(tmp_path / "rec")]) == 0
  out = tmp_path / "rig"
  code = cli.main(["rig", *recipe, "steps=3", "--recording", str(tmp_path / "rec"), "--out", str(out), "--arms",
                   "off", "pipelined", "stage_after_update", "stage_before_update"])
  report = json.loads((out / "report.json").read_text())
  # predictions depend on this machine's timing: the correctness checks must all pass
  failed = [c for c in report["checks"] if c["status"] == "fail" and c["kind"] == "correctness"]
  assert code == 0 and not failed, failed
  assert len({arm["final_state_digest"] for arm in report["arms"]}) == 1

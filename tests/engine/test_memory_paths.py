"""The engine's memory paths compute what the plain computation does: log-probs and entropy over the vocabulary in
chunks of tokens equal the whole vocabulary's at once (values and gradients, any temperature), rematerialised
layers give the gradients of unrematerialised ones (dense and MoE), and splash attention (Pallas, interpreted on
the CPU) gives the loss and gradients of Tunix's einsum attention."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orchestrator.data.packing import pack_payload
from orchestrator.data.synthetic import SyntheticRollouts
from orchestrator.engine import logprobs, loss
from orchestrator.engine import model as model_lib
from orchestrator.engine import step_math
from orchestrator.engine.loss import LossConfig, SampledDistribution
from orchestrator.models.presets import load_preset

pytestmark = pytest.mark.engine

ROWS, TOKENS, WIDTH, VOCAB = 3, 10, 8, 37


def _head_and_hidden(seed=0):
  rng = np.random.default_rng(seed)
  weight = jnp.asarray(rng.normal(0, 1.0, (WIDTH, VOCAB)), jnp.float32)
  hidden = jnp.asarray(rng.normal(0, 1.0, (ROWS, TOKENS, WIDTH)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, VOCAB, (ROWS, TOKENS)), jnp.int32)
  return weight, hidden, targets


def _chunked(weight, hidden, targets, sampled, chunk):
  return logprobs.token_logprobs(hidden, lambda h: h @ weight, targets, sampled, chunk)


def _whole(weight, hidden, targets, sampled):
  return loss.token_logprobs(jnp.einsum("rtd,dv->rtv", hidden, weight), targets, sampled)


SAMPLED = [None, SampledDistribution(temperature=0.05), SampledDistribution(temperature=0.3, token_ids=(1, 4, 9, 30)),
           SampledDistribution(temperature=2.0)]


@pytest.mark.parametrize("chunk", [1, 7, 16, ROWS * TOKENS, 1024])
@pytest.mark.parametrize("sampled", SAMPLED, ids=["plain", "t0.05", "t0.3-restricted", "t2"])
def test_chunked_logprobs_and_entropy_equal_the_whole_vocabulary(chunk, sampled):
  weight, hidden, targets = _head_and_hidden()
  logp, entropy = _chunked(weight, hidden, targets, sampled, chunk)
  want_logp, want_entropy = _whole(weight, hidden, targets, sampled)
  assert logp.shape == entropy.shape == (ROWS, TOKENS)
  assert np.all(np.isfinite(logp)) and np.all(np.isfinite(entropy))
  np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=1e-5)
  # negative control: the comparison sees a chunk whose rows are taken one position off
  shifted, _ = _chunked(weight, jnp.roll(hidden, 1, axis=1), targets, sampled, chunk)
  assert not np.allclose(shifted, want_logp, rtol=1e-3, atol=1e-3)


def test_the_tempered_log_probs_match_a_float64_reference_at_any_temperature():
  weight, hidden, targets = _head_and_hidden(1)
  logits = np.einsum("rtd,dv->rtv", np.asarray(hidden, np.float64), np.asarray(weight, np.float64))
  for temperature in (0.05, 0.3, 1.0, 2.0):
    allowed = np.array([1, 4, 9, 30])
    sampled = SampledDistribution(temperature=temperature, token_ids=tuple(int(i) for i in allowed))
    tempered = np.full_like(logits, -np.inf)
    tempered[..., allowed] = logits[..., allowed] / temperature
    shift = tempered.max(-1, keepdims=True)
    log_softmax = tempered - shift - np.log(np.exp(tempered - shift).sum(-1, keepdims=True))
    allowed_targets = jnp.asarray(allowed[np.asarray(targets) % len(allowed)], jnp.int32)
    want = np.take_along_axis(log_softmax, np.asarray(allowed_targets)[..., None], -1)[..., 0]
    logp, entropy = _chunked(weight, hidden, allowed_targets, sampled, 7)
    np.testing.assert_allclose(logp, want, rtol=2e-4, atol=2e-4)
    assert np.all(np.isfinite(entropy))


def test_chunked_gradients_equal_the_whole_vocabularys():
  weight, hidden, targets = _head_and_hidden(2)
  sampled = SampledDistribution(temperature=0.7)

  def total(fn, weight, hidden):
    logp, _ = fn(weight, hidden)
    return jnp.sum(logp * jnp.linspace(-1, 1, ROWS * TOKENS).reshape(ROWS, TOKENS))

  chunked = jax.grad(functools.partial(total, lambda w, h: _chunked(w, h, targets, sampled, 4)), argnums=(0, 1))
  whole = jax.grad(functools.partial(total, lambda w, h: _whole(w, h, targets, sampled)), argnums=(0, 1))
  for got, want in zip(chunked(weight, hidden), whole(weight, hidden)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _micro_batch(preset, rows=4, tokens=64, seed=0):
  payload = SyntheticRollouts(preset.vocab_size, rows, tokens, generations_per_group=4, fill=0.85,
                              seed=seed).micro_batch(0, 0)
  return {name: jnp.asarray(value) for name, value in pack_payload(payload, rows=rows, tokens_per_row=tokens,
                                                                               vocab_size=preset.vocab_size).items()}


def _loss_and_grads(preset, batch, *, remat="none", chunk=1024, splash_mesh=None, seed=0):
  splash_block = model_lib.splash_block_tokens(batch["input_tokens"].shape[1]) if splash_mesh is not None else None
  graphdefs, params, _ = model_lib.build_model(preset, seed, remat=remat, splash_block=splash_block)
  config = LossConfig(0.2, 0.28, None, "token_mean", batch["input_tokens"].shape[1], logprob_chunk_tokens=chunk)
  fn = step_math.loss_sum_fn(graphdefs["capacity"], config, remat, splash_mesh)
  (total, _), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, batch)
  return float(total), grads


def _assert_same_grads(got, want, tolerance=1e-3):
  """Each gradient within float rounding of the other: elementwise within ``tolerance`` of the leaf's largest
  entry (a recomputation reassociates sums, so small entries move by the large ones' rounding)."""
  flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(flat_got) == len(flat_want)
  for g, w in zip(flat_got, flat_want):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    np.testing.assert_allclose(g, w, rtol=0, atol=tolerance * max(np.abs(w).max(), 1e-12))


def _remat_policies(preset, remat):
  """The save policy of each rematerialised region the loss's trace holds at its top level (None: save nothing)."""
  graphdefs, params, _ = model_lib.build_model(preset, 0, remat=remat)
  batch = _micro_batch(preset)
  fn = step_math.loss_sum_fn(graphdefs["capacity"], LossConfig(logprob_chunk_tokens=1 << 20), remat)
  eqns = jax.make_jaxpr(fn)(params, batch).jaxpr.eqns
  return [e.params.get("policy") for e in eqns if "remat" in e.primitive.name or "checkpoint" in e.primitive.name]


def test_each_remat_policy_rematerialises_every_layer_with_its_save_policy():
  preset = load_preset("tiny")
  assert _remat_policies(preset, "none") == []  # the negative control: nothing recomputed
  full = _remat_policies(preset, "full")
  assert len(full) == preset.num_layers and all(policy is None for policy in full)
  dots = _remat_policies(preset, "dots")
  assert len(dots) == preset.num_layers and all("DotsSaveable" in str(policy) for policy in dots)
  # an MoE: each layer's attention block, and its experts' computation inside the expert layer
  assert len(_remat_policies(load_preset("tiny_moe"), "full")) >= load_preset("tiny_moe").num_layers


@pytest.mark.parametrize("preset_name", ["tiny", "tiny_moe"])
def test_rematerialised_layers_give_the_unrematerialised_gradients(preset_name):
  preset = load_preset(preset_name)
  batch = _micro_batch(preset)
  want_loss, want = _loss_and_grads(preset, batch, remat="none")
  for remat in ("dots", "full"):
    got_loss, got = _loss_and_grads(preset, batch, remat=remat)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    _assert_same_grads(got, want)
  # negative control: other weights give other gradients, which the comparison sees
  _, other = _loss_and_grads(preset, batch, remat="full", seed=1)
  with pytest.raises(AssertionError):
    _assert_same_grads(other, want)


def test_the_engines_chunked_loss_equals_one_chunk():
  preset = load_preset("tiny")
  batch = _micro_batch(preset, seed=3)
  whole_loss, whole = _loss_and_grads(preset, batch, chunk=1 << 20)
  chunked_loss, chunked = _loss_and_grads(preset, batch, chunk=50)
  assert chunked_loss == pytest.approx(whole_loss, rel=1e-5)
  _assert_same_grads(chunked, whole)


def test_splash_attention_gives_the_einsum_attentions_loss_and_gradients(monkeypatch):
  """Tunix's splash path on a one-device mesh, the Pallas kernel interpreted (no TPU here)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  from orchestrator.engine import mesh as mesh_lib

  monkeypatch.setattr(splash, "make_splash_mha", functools.partial(splash.make_splash_mha, interpret=True))
  preset = dataclasses.replace(load_preset("tiny"), head_dim=128, num_heads=2, num_kv_heads=1)
  batch = _micro_batch(preset, rows=2, tokens=128, seed=4)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig.parse(None))
  want_loss, want = _loss_and_grads(preset, batch)
  got_loss, got = _loss_and_grads(preset, batch, splash_mesh=mesh)
  assert got_loss == pytest.approx(want_loss, rel=1e-4)
  _assert_same_grads(got, want, tolerance=5e-3)


def test_each_steps_metrics_count_its_compiles_and_model_flops(tiny_engine, tiny_source):
  from orchestrator.engine.flops import step_model_flops

  def step(k):
    for i in range(2):
      tiny_engine.fwd_bwd(tiny_source.micro_batch(k, i))
    tiny_engine.update()
    return tiny_engine.get_metrics()

  step(0)
  second = step(1)
  assert second.compiles == 0  # nothing recompiles once the programs ran
  assert second.model_flops == step_model_flops(tiny_engine.preset, rows=tiny_engine.rows,
                                                tokens_per_row=tiny_engine.tokens_per_row, micro_batches=2)
  assert second.device_peak_bytes is None and second.peak_flops_per_s is None  # a CPU reports neither
  jax.jit(lambda x: x * 3 + 1)(np.zeros(17, np.float32)).block_until_ready()  # negative control: a new program
  assert step(2).compiles == 1

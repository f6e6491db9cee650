"""The loss's aggregations and clipping (``engine.loss_aggregation``, ``engine.clip_eps_low/high``), its entropy
and clipped-token count, against a numpy computation on a fixed packed micro-batch, and the engine's step loss
divided by the right denominator across micro-batches."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.engine.loss import LossConfig, policy_loss_sum, sequence_lengths

pytestmark = pytest.mark.engine

NORM_TOKENS = 6


def _micro_batch():
  """Two packed rows: row 0 holds sequences 1 (3 completion tokens) and 2 (1), row 1 holds one of 2; padding
  after. Old log-probs sit near the new ones, some far enough that both clip bounds bind."""
  rng = np.random.default_rng(3)
  logits = rng.normal(0, 1.0, (2, 6, 5)).astype(np.float32)
  segment_ids = np.array([[1, 1, 1, 1, 2, 2], [1, 1, 1, 0, 0, 0]], np.int32)
  loss_mask = np.array([[0, 1, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0]], np.float32)
  target_tokens = rng.integers(0, 5, (2, 6)).astype(np.int32)
  advantages = np.array([[0, 1.5, 1.5, 1.5, 0, -0.7], [0, -1.2, -1.2, 0, 0, 0]], np.float32)
  logp = _log_softmax(logits)[np.arange(2)[:, None], np.arange(6)[None], target_tokens]
  old = logp + np.array([[0, 0.5, -0.6, 0.05, 0, 0.4], [0, -0.5, 0.3, 0, 0, 0]], np.float32)
  batch = {"target_tokens": target_tokens, "loss_mask": loss_mask, "advantages": advantages,
           "old_logprobs": old, "old_logprobs_mask": loss_mask, "segment_ids": segment_ids}
  return logits, batch


def _log_softmax(x):
  x = x.astype(np.float64)
  return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


def _numpy_entropy(logits, batch) -> float:
  """The mean entropy of the softmax over the completion tokens (nats)."""
  logp = _log_softmax(logits)
  per_token = -(np.exp(logp) * logp).sum(-1)
  return float((per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum())


def _numpy_clipped(logits, batch, low, high) -> int:
  """Completion tokens whose clipped term is the smaller (the clip bound them)."""
  logp = _log_softmax(logits)[np.arange(2)[:, None], np.arange(6)[None], batch["target_tokens"]]
  ratio, adv = np.exp(logp - batch["old_logprobs"]), batch["advantages"]
  return int(((np.clip(ratio, 1 - low, 1 + high) * adv < ratio * adv) * batch["loss_mask"]).sum())


def _numpy_loss(logits, batch, aggregation, low, high) -> float:
  logp = _log_softmax(logits)[np.arange(2)[:, None], np.arange(6)[None], batch["target_tokens"]]
  ratio = np.exp(logp - batch["old_logprobs"])
  adv = batch["advantages"]
  per_token = -np.minimum(ratio * adv, np.clip(ratio, 1 - low, 1 + high) * adv)
  sequences = [per_token[0, 1:4], per_token[0, 5:6], per_token[1, 1:3]]  # the masked tokens of each sequence
  if aggregation == "token_mean":
    return float(np.concatenate(sequences).mean())
  if aggregation == "seq_mean_token_mean":
    return float(np.mean([s.mean() for s in sequences]))
  return float(sum(s.sum() for s in sequences) / (len(sequences) * NORM_TOKENS))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("low,high", [(0.2, 0.28), (0.1, 0.1), (0.3, 0.0)])
def test_each_aggregation_and_clip_pair_matches_numpy(aggregation, low, high):
  logits, batch = _micro_batch()
  config = LossConfig(low, high, None, aggregation, NORM_TOKENS)
  total, denominator, stats = policy_loss_sum(logits, batch, config)
  assert float(total) / float(denominator) == pytest.approx(_numpy_loss(logits, batch, aggregation, low, high),
                                                            rel=1e-5)
  tokens, entropy, clipped, kl, drift, with_old = np.asarray(stats, np.float64)
  assert tokens == 6
  assert entropy / tokens == pytest.approx(_numpy_entropy(logits, batch), rel=1e-5)
  assert clipped == _numpy_clipped(logits, batch, low, high) and kl == 0  # no reference without kl_beta
  # the drift (verl's ppo_kl): the sampler's log-prob minus the trainer's, over the tokens that carry one
  logp = _log_softmax(logits)[np.arange(2)[:, None], np.arange(6)[None], batch["target_tokens"]]
  carried = batch["loss_mask"] * (batch["old_logprobs_mask"] > 0)
  assert with_old == carried.sum() and with_old > 0
  assert drift == pytest.approx(float(((batch["old_logprobs"] - logp) * carried).sum()), rel=1e-4, abs=1e-5)


def test_the_aggregations_differ_on_this_micro_batch_negative_control():
  """The fixed micro-batch has sequences of unequal length and clipped ratios, so a wrong aggregation or a
  clip bound ignored would show."""
  logits, batch = _micro_batch()
  values = {_numpy_loss(logits, batch, a, 0.2, 0.28) for a in ("token_mean", "seq_mean_token_mean",
                                                               "seq_mean_token_sum_norm")}
  assert len(values) == 3
  assert _numpy_loss(logits, batch, "token_mean", 0.2, 0.28) != _numpy_loss(logits, batch, "token_mean", 0.1, 0.1)
  assert 0 < _numpy_clipped(logits, batch, 0.3, 0.0) < _numpy_clipped(logits, batch, 0.2, 0.28) < 6


def test_sequence_lengths_count_each_packed_sequence_in_its_row():
  _, batch = _micro_batch()
  lengths, sequences = sequence_lengths(batch["loss_mask"], batch["segment_ids"])
  np.testing.assert_array_equal(np.asarray(lengths) * batch["loss_mask"],
                                [[0, 3, 3, 3, 0, 1], [0, 2, 2, 0, 0, 0]])
  assert float(sequences) == 3


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_the_engine_divides_the_step_by_the_aggregations_denominator_over_micro_batches(tiny_source, aggregation):
  """Two micro-batches: the step's loss is their summed loss sums over their summed denominators (sequences for
  a per-sequence mean), and the token count stays the tokens."""
  from orchestrator.engine import build_engine

  engine = build_engine("tiny", loss_aggregation=aggregation)
  engine.fwd_bwd(tiny_source.micro_batch(0, 0))
  engine.fwd_bwd(tiny_source.micro_batch(0, 1), apply_optimizer=True)
  m = engine.get_metrics()
  sequences = sum(len(tiny_source.micro_batch(0, i)) for i in (0, 1))
  denominator = m.tokens if aggregation == "token_mean" else sequences
  assert m.loss == pytest.approx(sum(m.micro_batch_loss_sums) / denominator, rel=1e-5)
  assert m.tokens == sum(m.micro_batch_tokens) and m.tokens > sequences


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_the_kl_term_adds_beta_times_the_estimator_to_each_tokens_loss(estimator):
  logits, batch = _micro_batch()
  reference_logits = logits + np.random.default_rng(9).normal(0, 0.5, logits.shape).astype(np.float32)
  beta = 0.05
  config = LossConfig(0.2, 0.28, None, "token_mean", NORM_TOKENS, beta, estimator)
  total, denominator, stats = policy_loss_sum(logits, batch, config, reference_logits)
  logp = _log_softmax(logits)[np.arange(2)[:, None], np.arange(6)[None], batch["target_tokens"]]
  ref = _log_softmax(reference_logits)[np.arange(2)[:, None], np.arange(6)[None], batch["target_tokens"]]
  kl = logp - ref if estimator == "k1" else np.exp(ref - logp) - (ref - logp) - 1
  mask = batch["loss_mask"]
  expected_kl = float((kl * mask).sum() / mask.sum())
  assert float(stats[3]) / float(stats[0]) == pytest.approx(expected_kl, rel=1e-5)
  assert float(total) / float(denominator) == pytest.approx(
      _numpy_loss(logits, batch, "token_mean", 0.2, 0.28) + beta * expected_kl, rel=1e-5)
  assert expected_kl != 0  # the reference differs: a term left out would show


def test_with_the_reference_equal_to_the_policy_the_first_steps_kl_is_zero_and_then_grows(tiny_source):
  from orchestrator.engine import build_engine

  plain = build_engine("tiny", learning_rate=0.01)
  assert plain._training.reference == ()  # β = 0 builds no reference (the default run is unchanged)
  engine = build_engine("tiny", learning_rate=0.01, kl_beta=0.1)
  kls, losses = [], []
  for step in range(3):
    for e in (engine, plain):
      e.fwd_bwd(tiny_source.micro_batch(step, 0), apply_optimizer=True)
    kls.append(engine.get_metrics().kl)
    losses.append((engine.get_metrics().loss, plain.get_metrics().loss))
  assert kls[0] == 0.0 and losses[0][0] == losses[0][1]  # the reference is the start: nothing to pay yet
  assert kls[1] > 0 and kls[2] > 0 and plain.get_metrics().kl is None

"""GRPO-style clipped policy-gradient loss over packed rows, as a sum and its denominator.

Returning the *sum* and the denominator (completion tokens, or sequences) lets the engine
accumulate micro-batches and divide once in ``update()``, so M micro-batches and
one update equal one batch of M times the rows, up to float reassociation.

The ratio compares the trained policy with the one that sampled the rollouts
(their ``old_logprobs``), so both must be the same distribution: the sampler
divides the logits by its temperature and may sample from a subset of the
vocabulary (a task's answer alphabet), and ``SampledDistribution`` tells the
loss to take its log-probs the same way, as Tunix's GRPO does for the
temperature. Otherwise the ratio is off by the sampler's normaliser before any
update, and the clipping then cuts the gradient of one sign of advantage.

Truncated sampling (``rollouts.top_p``, ``rollouts.top_k``) only shapes which
tokens are drawn: Tunix's sampler returns each sampled token's log-prob under
the full tempered distribution (forbidden ids excluded), not under the top-p or
top-k renormalised one, and ``SampledDistribution`` takes the trainer's the
same way, so the ratio is still 1 before any update (as verl and Tunix train).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import common as rl_common


@dataclasses.dataclass(frozen=True)
class SampledDistribution:
  """The distribution the rollouts were sampled from, over the model's logits: the full tempered one over the
  ids the sampler may emit. A top-p or top-k truncation is not part of it: the sampler's log-probs are the
  untruncated distribution's too (see the module docstring).

  Attributes:
    temperature: the sampler's temperature (its logits are divided by it).
    token_ids: the ids the sampler may emit; None: every id of the vocabulary.
  """

  temperature: float = 1.0
  token_ids: tuple[int, ...] | None = None

  def is_plain(self, vocab_size: int) -> bool:
    """True when it is the model's own distribution: temperature 1 over the whole vocabulary."""
    return self.temperature == 1.0 and (self.token_ids is None or len(set(self.token_ids)) >= vocab_size)

  def logits(self, logits: jax.Array) -> jax.Array:
    """``logits`` as the sampler turns them into probabilities (float32)."""
    out = logits.astype(jnp.float32)
    if self.temperature != 1.0:  # before the mask: the mask's fill divided by a small temperature overflows
      out = out / self.temperature
    if self.token_ids is not None:
      allowed = np.zeros(logits.shape[-1], dtype=bool)
      allowed[np.asarray(self.token_ids, dtype=np.int64)] = True
      # finite, not -inf: a prompt position's target may be an id the sampler never emits, and its
      # (masked-out) term must stay finite
      out = jnp.where(allowed, out, jnp.finfo(jnp.float32).min / 2)
    return out


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Clipping range of the probability ratio (PPO/GRPO style, asymmetric allowed: DAPO's ε_low/ε_high), the
  distribution the rollouts were sampled from, and how token losses are averaged (``policy_loss_sum``).

  ``norm_tokens``: ``seq_mean_token_sum_norm``'s constant, the most tokens a trajectory may have (the engine's
  ``tokens_per_row``)."""

  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.28
  sampled: SampledDistribution | None = None  # None: the model's own distribution
  aggregation: str = "token_mean"
  norm_tokens: int = 1
  kl_beta: float = 0.0  # 0: no KL term (and no reference logits are asked for)
  kl_estimator: str = "k3"
  logprob_chunk_tokens: int = 1024  # the engine's chunked log-probs (orchestrator.engine.logprobs)


#: What ``policy_loss_sum``'s ``token_stats`` sums, in order.
TOKEN_STATS = ("tokens", "entropy", "clipped", "kl", "drift", "tokens_with_old")


def per_token_kl(logp: jax.Array, reference_logp: jax.Array, estimator: str) -> jax.Array:
  """The KL estimate of each sampled token between the policy (``logp``) and the reference: ``k1`` = log π −
  log π_ref; ``k3`` = π_ref/π − log(π_ref/π) − 1 (never negative, lower variance; Tunix's ``low_var_kl``).
  As a loss on tokens drawn from π, ``k1``'s expected gradient is 0 and ``k3``'s is that of KL(π_ref ‖ π)
  (docs/engine.md)."""
  if estimator == "k1":
    return logp - reference_logp
  if estimator == "k3":
    delta = reference_logp - logp
    return jnp.exp(delta) - delta - 1.0
  raise ValueError(f"KL estimator {estimator!r}: use k1 or k3")


def attention_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T, T] causal mask that keeps each packed segment to itself and hides padding."""
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  real = (segment_ids > 0)[:, :, None]
  t = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((t, t), dtype=jnp.bool_))[None]
  return same & real & causal


def token_logprobs(logits: jax.Array, targets: jax.Array, sampled: SampledDistribution | None):
  """Each position's log-prob of its target and its distribution's entropy (nats; no gradient) from the whole
  vocabulary's ``logits`` at once, under the sampled distribution (None or plain: the model's own).
  ``orchestrator.engine.logprobs.token_logprobs`` computes the same in chunks of tokens."""
  if sampled is not None and not sampled.is_plain(logits.shape[-1]):
    logits = sampled.logits(logits)
  logp = rl_common.selective_log_softmax(logits, targets)
  stopped = jax.lax.stop_gradient(logits.astype(jnp.float32))
  entropy = -jnp.sum(jax.nn.softmax(stopped, axis=-1) * jax.nn.log_softmax(stopped, axis=-1), axis=-1)
  return logp, entropy


def policy_loss_sum(logits: jax.Array, batch: dict, config: LossConfig, reference_logits: jax.Array | None = None):
  """``policy_loss_sum_from_logprobs`` with the log-probs taken from the whole vocabulary's ``logits`` at once
  (and the reference's from ``reference_logits``): the reference computation the engine's chunked one equals."""
  logp, entropy = token_logprobs(logits, batch["target_tokens"], config.sampled)
  reference_logp = None
  if reference_logits is not None:
    reference_logp, _ = token_logprobs(reference_logits, batch["target_tokens"], config.sampled)
  return policy_loss_sum_from_logprobs(logp, entropy, batch, config, reference_logp)


def policy_loss_sum_from_logprobs(logp: jax.Array, entropy: jax.Array, batch: dict, config: LossConfig,
                                  reference_logp: jax.Array | None = None):
  """Returns ``(loss_sum, denominator, token_stats)`` of the clipped surrogate l_st over completion tokens t of
  sequences s, from each position's log-prob of its target (``logp``, [rows, tokens], under the sampled
  distribution) and its entropy; the step's loss is the micro-batches' summed ``loss_sum`` over their summed
  ``denominator``, so micro-batches accumulate exactly. ``token_stats`` sums six figures over the completion
  tokens (a micro-batch's share of what practitioners watch, ``TOKEN_STATS``): 1 (the token count), the
  policy's entropy (of the distribution sampled from, in nats), whether the clip bound the token (its clipped
  term was the smaller: the ratio left [1 − ε_low, 1 + ε_high] in the direction its advantage pushes, verl's
  ``pg_clipfrac``), its KL to the reference (0 without one), and over the tokens that carry the sampler's
  log-prob, the sampler's log-prob minus the trainer's and 1 (their mean is verl's ``ppo_kl``). With ``config.kl_beta`` > 0 each token's loss
  adds β · ``per_token_kl`` against ``reference_logp`` (the reference model's log-probs of the same targets,
  under the same sampled distribution). Per ``config.aggregation`` (``engine.loss_aggregation``):

  * ``token_mean``: Σ_st l_st / Σ_s L_s — every completion token weighs the same (L_s: s's completion tokens);
  * ``seq_mean_token_mean``: (1/N) Σ_s (1/L_s) Σ_t l_st — every sequence weighs the same (N: sequences);
  * ``seq_mean_token_sum_norm``: Σ_st l_st / (N · norm_tokens) — Dr. GRPO's constant normaliser: no length
    bias in either direction.
  """
  has_old = batch["old_logprobs_mask"] > 0
  old = jnp.where(has_old, batch["old_logprobs"], jax.lax.stop_gradient(logp))
  ratio = jnp.exp(logp - old)
  adv = batch["advantages"]
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high) * adv
  per_token = -jnp.minimum(unclipped, clipped)
  mask = batch["loss_mask"]
  kl = jnp.zeros_like(per_token)
  if config.kl_beta:
    if reference_logp is None:
      raise ValueError("kl_beta > 0 needs the reference model's log-probs")
    kl = per_token_kl(logp, jax.lax.stop_gradient(reference_logp), config.kl_estimator)
    per_token = per_token + config.kl_beta * kl
  tokens = jnp.sum(mask)
  with_old = mask * has_old
  drift = jnp.sum((old - jax.lax.stop_gradient(logp)) * with_old)
  stats = jnp.stack([tokens, jnp.sum(entropy * mask), jnp.sum((clipped < unclipped) * mask), jnp.sum(kl * mask),
                     drift, jnp.sum(with_old)])
  if config.aggregation == "token_mean":
    return jnp.sum(per_token * mask), tokens, stats
  lengths, sequences = sequence_lengths(mask, batch["segment_ids"])
  if config.aggregation == "seq_mean_token_mean":
    return jnp.sum(per_token * mask / jnp.maximum(lengths, 1.0)), sequences, stats
  if config.aggregation == "seq_mean_token_sum_norm":
    return jnp.sum(per_token * mask), sequences * float(config.norm_tokens), stats
  raise ValueError(f"loss aggregation {config.aggregation!r}: use one of token_mean, seq_mean_token_mean,"
                   " seq_mean_token_sum_norm")


def sequence_lengths(mask: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each token's sequence's loss-carrying token count ([B, T]), and how many sequences carry loss: a packed
  row holds several sequences (segment ids 1, 2, …; 0 is padding), each within one row."""
  rows, width = segment_ids.shape
  flat = (segment_ids + jnp.arange(rows, dtype=segment_ids.dtype)[:, None] * (width + 1)).reshape(-1)
  counts = jax.ops.segment_sum(mask.reshape(-1), flat, num_segments=rows * (width + 1))
  return counts[flat].reshape(rows, width), jnp.sum((counts > 0).astype(jnp.float32))

"""GRPO-style clipped policy-gradient loss over packed rows, as a sum and its token count.

Returning the *sum* and the denominator (completion tokens) lets the engine
accumulate micro-batches and divide once in ``update()``, so M micro-batches and
one update equal one batch of M times the rows, up to float reassociation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from tunix.rl import common as rl_common


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Clipping range of the probability ratio (PPO/GRPO style, asymmetric allowed)."""

  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.28


def attention_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T, T] causal mask that keeps each packed segment to itself and hides padding."""
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  real = (segment_ids > 0)[:, :, None]
  t = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((t, t), dtype=jnp.bool_))[None]
  return same & real & causal


def policy_loss_sum(logits: jax.Array, batch: dict, config: LossConfig):
  """Returns ``(loss_sum, token_count)`` of the clipped surrogate over completion tokens."""
  logp = rl_common.selective_log_softmax(logits, batch["target_tokens"])
  has_old = batch["old_logprobs_mask"] > 0
  old = jnp.where(has_old, batch["old_logprobs"], jax.lax.stop_gradient(logp))
  ratio = jnp.exp(logp - old)
  adv = batch["advantages"]
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high) * adv
  per_token = -jnp.minimum(unclipped, clipped)
  mask = batch["loss_mask"]
  return jnp.sum(per_token * mask), jnp.sum(mask)

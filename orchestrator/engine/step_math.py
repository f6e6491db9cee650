"""The step's math as pure functions: accumulate one micro-batch, apply the update.

No engine state lives here. The engine jits these with its shardings and
donation; ``on_trace(name)`` is called at trace time only (tests count traces).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from orchestrator.data import packing
from orchestrator.engine import logprobs
from orchestrator.engine import model as model_lib
from orchestrator.engine import moe as moe_lib
from orchestrator.engine.loss import LossConfig, attention_mask, policy_loss_sum_from_logprobs


def loss_sum_fn(graphdef: Any, loss_config: LossConfig, remat: str = "none", splash_mesh=None) -> Callable:
  """``(params, batch, *reference) -> (loss_sum, ([denominator, token_count], token_stats, dropped_tokens))`` for
  one packed micro-batch (``loss.policy_loss_sum_from_logprobs``, its log-probs taken in chunks of
  ``loss_config.logprob_chunk_tokens`` tokens: ``logprobs``); ``reference``: the reference model's params, given
  when the loss has a KL term (its forward pass is part of the micro-batch's work; its drops are not counted).
  ``remat``: the model's ``engine.remat``, whose save policy is in force while the model is traced;
  ``splash_mesh``: the mesh a model built with splash attention traces in (its kernel is sharded over it; the
  packed rows' segment ids keep each sequence to itself), None for Tunix's einsum attention."""
  chunk, sampled = loss_config.logprob_chunk_tokens, loss_config.sampled

  def forward(model, batch, mask):
    if splash_mesh is None:
      return logprobs.forward_hidden(model, batch["input_tokens"], batch["positions"], None, mask)
    with splash_mesh:  # Tunix's splash path reads the mesh of this (legacy) context, not jax.set_mesh's
      return logprobs.forward_hidden(model, batch["input_tokens"], batch["positions"], None, mask,
                                     segment_ids=batch["segment_ids"])

  def loss_sum(params, batch, *reference):
    model = nnx.merge(graphdef, params)
    mask = attention_mask(batch["segment_ids"])
    # Under routing replay the policy routes by the sampler's choices; the frozen reference routes itself.
    with model_lib.remat_policy(remat), moe_lib.routing_scope(batch["segment_ids"] > 0,
                                                              batch.get(packing.ROUTING)) as dropped:
      hidden, head = forward(model, batch, mask)
    logp, entropy = logprobs.token_logprobs(hidden, head, batch["target_tokens"], sampled, chunk)
    reference_logp = None
    if reference:
      with model_lib.remat_policy(remat), moe_lib.routing_scope(batch["segment_ids"] > 0):
        ref_hidden, ref_head = forward(nnx.merge(graphdef, reference[0]), batch, mask)
      reference_logp, _ = logprobs.token_logprobs(jax.lax.stop_gradient(ref_hidden), ref_head,
                                                  batch["target_tokens"], sampled, chunk)
      reference_logp = jax.lax.stop_gradient(reference_logp)
    total, denominator, token_stats = policy_loss_sum_from_logprobs(logp, entropy, batch, loss_config,
                                                                    reference_logp)
    dropped_tokens = sum(dropped) if dropped else jnp.float32(0)
    return total, (jnp.stack([denominator, token_stats[0]]), token_stats, dropped_tokens)

  return loss_sum


def accumulate_fn(graphdef: Any, loss_config: LossConfig, *, mask_overflow: bool,
                  on_trace: Callable[[], None], remat: str = "none", splash_mesh=None) -> Callable:
  """``(params, grad_acc, loss_acc, denom_acc, batch)`` → accumulators plus this micro-batch's
  loss sum, token stats (``loss.TOKEN_STATS``), dropped tokens and overflow flag. ``denom_acc`` is [the loss's
  denominator, tokens].

  With ``mask_overflow`` (dropless re-runs) a micro-batch that dropped tokens
  adds nothing; its re-run adds its gradients once. The mask runs on the
  device, so nothing syncs (and ``x + 0 == x``, so a discarded run leaves no trace).
  """
  loss_sum = loss_sum_fn(graphdef, loss_config, remat, splash_mesh)

  def accumulate(params, grad_acc, loss_acc, denom_acc, batch, *reference):
    on_trace()
    (total, (denominators, token_stats, dropped)), grads = jax.value_and_grad(loss_sum, has_aux=True)(
        params, batch, *reference)
    overflow = dropped > 0
    if mask_overflow:
      keep = jnp.logical_not(overflow)
      grads = jax.tree.map(lambda g: jnp.where(keep, g, jnp.zeros_like(g)), grads)
      total = jnp.where(keep, total, 0.0)
      denominators = jnp.where(keep, denominators, 0.0)
      token_stats = jnp.where(keep, token_stats, 0.0)
    grad_acc = jax.tree.map(jnp.add, grad_acc, grads)
    return grad_acc, loss_acc + total, denom_acc + denominators, total, token_stats, dropped, overflow

  return accumulate


def mean_grads(grad_acc: Any, denom_acc: jax.Array) -> Any:
  """Accumulated gradient sums divided by the step's loss denominator (``denom_acc[0]``)."""
  scale = 1.0 / jnp.maximum(denom_acc[0], 1.0)
  return jax.tree.map(lambda g: g * scale, grad_acc)


def apply_fn(optimizer: optax.GradientTransformation, *, on_trace: Callable[[], None]) -> Callable:
  """``(params, opt_state, grad_acc, loss_acc, denom_acc)`` → new params and optimizer state,
  zeroed accumulators, and the step's metrics (loss, grad norm, tokens)."""

  def apply(params, opt_state, grad_acc, loss_acc, denom_acc):
    on_trace()
    grads = mean_grads(grad_acc, denom_acc)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": loss_acc * (1.0 / jnp.maximum(denom_acc[0], 1.0)),
               "grad_norm": grad_norm, "tokens": denom_acc[1]}
    zeros = jax.tree.map(jnp.zeros_like, grad_acc)
    return params, opt_state, zeros, jnp.zeros_like(loss_acc), jnp.zeros_like(denom_acc), metrics

  return apply


def grad_norm(grad_acc: Any, denom_acc: jax.Array) -> jax.Array:
  """The norm of the step's mean gradient (the non-finite check reads it)."""
  return optax.tree.norm(mean_grads(grad_acc, denom_acc))

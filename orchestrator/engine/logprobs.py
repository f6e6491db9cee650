"""Per-token log-probs and entropy of a Tunix model, over the vocabulary in chunks of tokens.

A model's forward pass ends in its head, ``[tokens, width] → [tokens, vocabulary]``.
At real shapes that last array is the largest of the step: 32 rows × 1,024 tokens
of Qwen3's 151,936 ids are 20 GB of float32 logits, and their softmax as much again
for the backward pass. Here the forward pass stops at the head's input
(``forward_hidden``), and ``token_logprobs`` applies the head to
``chunk_tokens`` tokens at a time, keeping of each chunk only the log-prob of its
target and its entropy; the chunk's logits are recomputed in the backward pass
(``jax.checkpoint``), so at most one chunk's [chunk, vocabulary] logits exist at
once, forward or backward (MaxText and the seed compute log-probs so).

The head is whatever the model calls on its final hidden states (``lm_head``, or the
embedder's ``decode`` for tied embeddings), captured as it is called, so every
family computes its logits with its own head, dtype and casts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from tunix.rl import common as rl_common

from orchestrator.engine.loss import SampledDistribution


class _HeadCapture:
  """Stands for the model's head during one forward pass: keeps the head and its input, returns the input."""

  def __init__(self, head: Callable, captured: list):
    self._head, self._captured = head, captured

  def __call__(self, hidden):
    self._captured.append((self._head, hidden))
    return hidden


def forward_hidden(model: Any, *args, **kwargs) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
  """Runs ``model(*args, **kwargs)`` up to its head: returns the head's input ([rows, tokens, width]) and the
  head over a chunk of tokens (``[tokens, width] → [tokens, vocabulary]``, float32). ``model`` is a merged Tunix model used for this one call (its head is
  replaced on the instance); the logits the call would have returned are never computed (jit drops them).

  Raises:
    RuntimeError: the model called no head this capture knows (a family whose head is not ``lm_head`` or
      ``embedder.decode``).
  """
  captured: list = []
  if hasattr(model, "lm_head"):
    model.lm_head = _HeadCapture(model.lm_head, captured)
  model.embedder.decode = _HeadCapture(model.embedder.decode, captured)
  model(*args, **kwargs)
  if len(captured) != 1:
    raise RuntimeError(f"{type(model).__name__}'s forward pass called {len(captured)} heads; the chunked"
                       " log-probs know lm_head and embedder.decode")
  head, hidden = captured[0]
  # the heads' einsums take [rows, tokens, width]: a chunk of tokens is one row
  return hidden, lambda h: head(h[None])[0].astype(jnp.float32)


def token_logprobs(hidden: jax.Array, head: Callable[[jax.Array], jax.Array], targets: jax.Array,
                   sampled: SampledDistribution | None, chunk_tokens: int) -> tuple[jax.Array, jax.Array]:
  """Each position's log-prob of its target and the entropy of its distribution (nats), ``[rows, tokens]``
  both, under the distribution the rollouts were sampled from (``sampled``: its temperature and allowed ids;
  None or plain: the model's own), computed ``chunk_tokens`` positions at a time.

  The entropy is a metric: no gradient flows through it. The log-probs equal the whole-vocabulary computation's
  within float rounding (the same operations on each row of logits; only the grouping of rows differs).
  """
  rows, tokens = targets.shape
  count = rows * tokens
  flat_hidden = hidden.reshape(count, hidden.shape[-1])
  flat_targets = targets.reshape(count)
  transformed = sampled is not None

  def one_chunk(h, t):
    logits = head(h)
    if transformed and not sampled.is_plain(logits.shape[-1]):
      logits = sampled.logits(logits)
    logp = rl_common.selective_log_softmax(logits, t)
    stopped = jax.lax.stop_gradient(logits)
    entropy = -jnp.sum(jax.nn.softmax(stopped, axis=-1) * jax.nn.log_softmax(stopped, axis=-1), axis=-1)
    return logp, entropy

  if count <= chunk_tokens:
    logp, entropy = one_chunk(flat_hidden, flat_targets)
  else:
    chunks = -(-count // chunk_tokens)
    pad = chunks * chunk_tokens - count
    padded_hidden = jnp.pad(flat_hidden, ((0, pad), (0, 0))).reshape(chunks, chunk_tokens, -1)
    padded_targets = jnp.pad(flat_targets, (0, pad)).reshape(chunks, chunk_tokens)
    logp, entropy = jax.lax.map(lambda xs: jax.checkpoint(one_chunk)(*xs), (padded_hidden, padded_targets))
    logp, entropy = logp.reshape(-1)[:count], entropy.reshape(-1)[:count]
  return logp.reshape(rows, tokens), entropy.reshape(rows, tokens)

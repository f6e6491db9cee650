"""Capacity-limited MoE routing with an overflow count, in place of Tunix's MoE layer.

Each expert takes at most ``capacity = ceil(factor × buffer_tokens × top_k /
num_experts)`` token assignments per micro-batch, where ``buffer_tokens`` is
the micro-batch's static ``rows × tokens_per_row`` (expert buffers are sized
ahead, as ragged all-to-all buffers are). Assignments queue per expert in
priority order — every token's first choice before any second choice, tokens
in row-major order — and those past capacity are dropped: they contribute no
expert output. Padding positions are not routed and take no capacity.
``factor=None`` is fully dropless.

The layer keeps Tunix's parameter names (``router``, ``gate_proj``,
``up_proj``, ``down_proj``), so weights and shardings are unchanged. Two
things reach it from the loss function without changing Tunix's decoder
signatures, both through ``routing_scope``: the mask of real tokens, and a list
that collects each layer's dropped-assignment count inside the same trace.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx

_SCOPE: contextvars.ContextVar = contextvars.ContextVar("moe_routing_scope", default=None)


@contextlib.contextmanager
def routing_scope(token_mask: jax.Array | None):
  """While tracing the model: routes only ``token_mask`` positions and collects drop counts.

  Yields the list each MoE layer appends its dropped-assignment count to.
  """
  dropped: list[jax.Array] = []
  token = _SCOPE.set((token_mask, dropped))
  try:
    yield dropped
  finally:
    _SCOPE.reset(token)


class CapacityMoELayer(nnx.Module):
  """Top-k MoE with per-expert capacity; see the module docstring."""

  def __init__(self, tunix_layer, capacity_factor: float | None):
    self.router = tunix_layer.router
    self.gate_proj = tunix_layer.gate_proj
    self.up_proj = tunix_layer.up_proj
    self.down_proj = tunix_layer.down_proj
    self.num_experts = tunix_layer.num_experts
    self.experts_per_tok = tunix_layer.experts_per_tok
    self.dtype = tunix_layer.dtype
    self.capacity_factor = capacity_factor

  def capacity(self, buffer_tokens: int) -> int | None:
    if self.capacity_factor is None:
      return None
    return math.ceil(self.capacity_factor * buffer_tokens * self.experts_per_tok / self.num_experts)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    n, k, e = b * t, self.experts_per_tok, self.num_experts
    scope = _SCOPE.get()
    token_mask = None if scope is None else scope[0]
    real = jnp.ones((n,), jnp.float32) if token_mask is None else token_mask.reshape(n).astype(jnp.float32)

    scores = self.router(x).astype(jnp.float32).reshape(n, e)
    weights, experts = jax.lax.top_k(jax.nn.softmax(scores, axis=-1), k)  # [N, K]
    weights = (weights / jnp.sum(weights, axis=-1, keepdims=True)).astype(self.dtype)

    # [K, N, E]: choice-major, so all first choices queue before any second choice.
    assigned = jax.nn.one_hot(experts.T, e, dtype=jnp.float32) * real[None, :, None]
    capacity = self.capacity(n)
    if capacity is None:
      kept = assigned
    else:
      queue = assigned.reshape(k * n, e)
      position = jnp.cumsum(queue, axis=0) - queue  # place in the expert's queue
      kept = (queue * (position < capacity)).reshape(k, n, e)
    keep = jnp.sum(kept, axis=-1).T  # [N, K]: 1 where the assignment got a slot
    dropped = jnp.sum(assigned) - jnp.sum(kept)
    if scope is not None:
      scope[1].append(dropped)

    flat = x.reshape(n, d).astype(self.dtype)
    outputs = []
    for i in range(e):  # every expert on every token; dropped assignments are masked below
      gate = jnp.astype(self.gate_proj[...][i], self.dtype)
      up = jnp.astype(self.up_proj[...][i], self.dtype)
      down = jnp.astype(self.down_proj[...][i], self.dtype)
      outputs.append((nnx.silu(flat @ gate) * (flat @ up)) @ down)
    per_expert = jnp.stack(outputs, axis=1)  # [N, E, D]
    chosen = jnp.take_along_axis(per_expert, experts[:, :, None], axis=1)  # [N, K, D]
    combined = jnp.sum(chosen * (weights * keep.astype(self.dtype))[:, :, None], axis=1)
    return combined.reshape(b, t, d)


def install(model, capacity_factor: float | None) -> None:
  """Replaces every Tunix MoE layer of ``model`` with a CapacityMoELayer (same params)."""
  for layer in model.layers:
    if hasattr(layer.mlp, "router"):
      layer.mlp = CapacityMoELayer(layer.mlp, capacity_factor)


def set_capacity_factor(model, capacity_factor: float | None) -> None:
  for layer in model.layers:
    if isinstance(layer.mlp, CapacityMoELayer):
      layer.mlp.capacity_factor = capacity_factor

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
``up_proj``, ``down_proj``), so weights and shardings are unchanged. Three
things reach it from the loss function without changing Tunix's decoder
signatures, all through ``routing_scope``: the mask of real tokens, a list
that collects each layer's dropped-assignment count inside the same trace, and
under rollout routing replay the experts the sampler chose.

Rollout routing replay (``engine.router_replay``): each token goes to the
experts the sampling policy's layer chose for it (``[rows, tokens, layers,
top_k]``, the layer found by its place in the forward pass), in the recorded
order, instead of the trainer's own top-k; capacity, priority and drops apply
to them as to a top-k. The routing weights are the trainer's router
probabilities at the replayed experts, renormalised over them — a softmax of
the trainer's router logits over the replayed experts, as Rollout Routing
Replay (R3; Ma et al., 2025) defines it — so the router still gets the
gradient of the loss through those weights. Without replay the same formula
holds with the trainer's own top-k, so a replay of the trainer's own choices
changes nothing.

Each expert computes only the assignments it kept (``routed_expert_mlp``): the
kept assignments are sorted by expert (stably, so in priority order), each
expert's group padded to whole blocks of ``block_rows`` rows, and each block
runs its expert's MLP; the outputs go back to their tokens weighted by the
routing weights. The expert work is the kept assignments' (plus at most a
block of padding per expert), not every expert's on every token — E / top-k
times less (2× on the presets, 16× at 128 experts top-8). XLA's CPU backend has
no grouped matmul (``jax.lax.ragged_dot`` there multiplies every group densely),
hence the blocks. The result equals the dense computation (every expert on
every token, masked) up to float rounding: the sums are the same terms in
another order (``tests/engine/test_moe_routed.py`` states the tolerance).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import operator

import jax
import jax.numpy as jnp
from flax import nnx

_SCOPE: contextvars.ContextVar = contextvars.ContextVar("moe_routing_scope", default=None)


@dataclasses.dataclass
class _Scope:
  token_mask: jax.Array | None
  replay: jax.Array | None
  dropped: list = dataclasses.field(default_factory=list)  # per layer, in forward order
  chosen: list = dataclasses.field(default_factory=list)  # per layer: its [N, K] experts


@contextlib.contextmanager
def routing_scope(token_mask: jax.Array | None, replay: jax.Array | None = None):
  """While tracing the model: routes only ``token_mask`` positions and collects drop counts; with ``replay``
  ([rows, tokens, layers, top_k] expert ids) the n-th MoE layer of the forward pass routes by ``replay[:, :, n]``.

  Yields the list each MoE layer appends its dropped-assignment count to (one entry per layer, in order).
  """
  scope = _Scope(token_mask, replay)
  token = _SCOPE.set(scope)
  try:
    yield scope.dropped
  finally:
    _SCOPE.reset(token)


def routing_of(model, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
               token_mask: jax.Array, replay: jax.Array | None = None) -> jax.Array:
  """The experts each MoE layer of ``model`` chooses for each token of a forward pass, [rows, tokens, layers,
  top_k] int16, in each token's choice order (what routing replay carries); with ``replay``, the experts the
  layers routed to under that replay."""
  scope = _Scope(token_mask, replay)
  token = _SCOPE.set(scope)
  try:
    model(tokens, positions, None, attention_mask)
  finally:
    _SCOPE.reset(token)
  b, t = tokens.shape
  return jnp.stack([experts.reshape(b, t, -1) for experts in scope.chosen], axis=2).astype(jnp.int16)


class CapacityMoELayer(nnx.Module):
  """Top-k MoE with per-expert capacity; see the module docstring."""

  def __init__(self, tunix_layer, capacity_factor: float | None, remat: bool = False):
    self.remat = remat  # the experts' computation is recomputed in the backward pass (engine.remat)
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
    scope = _SCOPE.get() or _Scope(None, None)
    real = (jnp.ones((n,), jnp.float32) if scope.token_mask is None
            else scope.token_mask.reshape(n).astype(jnp.float32))

    scores = self.router(x).astype(jnp.float32).reshape(n, e)
    probabilities = jax.nn.softmax(scores, axis=-1)
    if scope.replay is None:
      weights, experts = jax.lax.top_k(probabilities, k)  # [N, K]
    else:  # this layer's recorded choices: the layers before it each appended their drop count
      experts = scope.replay[:, :, len(scope.dropped)].reshape(n, k).astype(jnp.int32)
      weights = jnp.take_along_axis(probabilities, experts, axis=-1)
    scope.chosen.append(experts)
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
    scope.dropped.append(dropped)

    flat = x.reshape(n, d).astype(self.dtype)
    gate, up, down = (jnp.astype(w[...], self.dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
    # choice-major, as the queue: assignment a = choice × N + token
    kept_flat = keep.T.reshape(k * n) > 0
    # Under engine.remat the experts' buffers and hidden activations are recomputed in the backward pass, not
    # kept (a checkpoint inside the layer: the drop counts above stay outside it, in the model's own trace).
    expert_mlp = jax.checkpoint(routed_expert_mlp) if self.remat else routed_expert_mlp
    combined = expert_mlp(flat, experts.T.reshape(k * n), weights.T.reshape(k * n), kept_flat, gate, up, down)
    return combined.reshape(b, t, d)


#: Chunks the expert blocks are computed in (``routed_expert_mlp``): a chunk past the used rows is skipped.
CHUNKS = 5


def block_rows(assignments: int, num_experts: int) -> int:
  """Rows per expert block: a power of two at most a quarter of an expert's even share of the assignments (at
  least 8). Every block of the buffer is computed, so its padding (under a block per expert) is work, within a
  quarter of the assignments here; smaller blocks pad less but XLA's CPU matmuls lose more on them (on small_moe's
  shape 128-row blocks took 1.4× the time of 256-row ones for 10 % fewer rows)."""
  share = max(1, assignments // (4 * num_experts))
  return max(8, 1 << (share.bit_length() - 1))


def routed_expert_mlp(tokens: jax.Array, expert_of: jax.Array, weight_of: jax.Array, kept: jax.Array,
                      gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
  """Σ over each token's kept assignments of weight × expert MLP(token), computing each expert on its own
  assignments only.

  Args:
    tokens: [N, D] the layer's input.
    expert_of, weight_of, kept: [A] per assignment, choice-major (a = choice × N + token, the queue's priority
      order): its expert, routing weight, and whether it got a slot (dropped and padding ones contribute
      nothing).
    gate, up: [E, D, F]; down: [E, F, D] the experts' weights.

  Returns:
    [N, D] each token's combined expert output.

  Each kept assignment gets a row of a buffer where every expert's assignments lie together, in priority order,
  its group padded to whole blocks of ``block_rows``; the buffer is filled and read back by gathers (XLA's CPU
  scatters of whole rows are slow: only a row-to-token index is scattered).
  """
  n, d = tokens.shape
  e = gate.shape[0]
  a = expert_of.shape[0]
  rows = block_rows(a, e)
  capacity = -(-(a + e * (rows - 1)) // rows) * rows  # the padded groups' bound, whole blocks
  queued = jax.nn.one_hot(expert_of, e, dtype=jnp.int32) * kept[:, None].astype(jnp.int32)  # [A, E]
  counts = jnp.sum(queued, axis=0)
  place = jnp.take_along_axis(jnp.cumsum(queued, axis=0) - queued, expert_of[:, None], axis=1)[:, 0]
  padded = -(-counts // rows) * rows
  padded_end = jnp.cumsum(padded)
  row = jnp.where(kept, padded_end[expert_of] - padded[expert_of] + place, capacity)  # each assignment's row
  # each row's assignment (a: none); the one scatter, of indices
  slot = jnp.full((capacity,), a, jnp.int32).at[row].set(jnp.arange(a, dtype=jnp.int32), mode="drop")
  buffer = _gather_rows(tokens, jnp.where(slot < a, slot % n, n), row.reshape(a // n, n))
  blocks = capacity // rows
  # each block's expert: the group whose padded range holds the block's first row (blocks past the last group's
  # hold zeros and are never read)
  block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(blocks) * rows, side="right"), e - 1)
  x = buffer.reshape(blocks, rows, d)

  def expert_blocks(x, block_expert):
    hidden = nnx.silu(jnp.einsum("brd,bdf->brf", x, gate[block_expert])) * jnp.einsum("brd,bdf->brf", x,
                                                                                     up[block_expert])
    return jnp.einsum("brf,bfd->brd", hidden, down[block_expert])

  # The buffer's bound holds every assignment and a block of padding per expert; padding tokens are not routed,
  # so its last blocks are often empty: they are computed a chunk of blocks at a time, and a chunk past the used
  # rows is skipped (a branch XLA runs alone, in the backward pass too).
  chunk = -(-blocks // CHUNKS)
  used_rows = padded_end[-1]
  out = jnp.concatenate([
      jax.lax.cond(first * rows < used_rows, expert_blocks, lambda x, _: jnp.zeros_like(x),
                   x[first:first + chunk], block_expert[first:first + chunk])
      for first in range(0, blocks, chunk)]).reshape(capacity, d)
  picked = _gather_rows(out, row, slot[None, :]) * weight_of[:, None]  # [A, D]
  # choice by choice: XLA's CPU backend fuses a gather into a reduction over choices 60× slower than this sum
  return functools.reduce(operator.add, (picked[c * n:(c + 1) * n] for c in range(a // n)))


@jax.custom_vjp
def _gather_rows(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
  """``x``'s rows at ``index`` (``len(x)``: a zero row), where each row of ``x`` goes to the rows ``inverse``
  lists for it (its columns; ``len(index)``: none). Its gradient gathers too — the cotangent's rows at
  ``inverse``, summed over its columns — where a plain gather's is a scatter-add, slow on XLA's CPU backend."""
  return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[index]


def _gather_rows_fwd(x, index, inverse):
  return _gather_rows(x, index, inverse), (index, inverse)


def _gather_rows_bwd(saved, cotangent):
  index, inverse = saved
  padded = jnp.concatenate([cotangent, jnp.zeros((1, cotangent.shape[1]), cotangent.dtype)])
  gathered = functools.reduce(operator.add, (padded[inverse[c]] for c in range(inverse.shape[0])))
  return gathered, None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def install(model, capacity_factor: float | None, remat: bool = False) -> None:
  """Replaces every Tunix MoE layer of ``model`` with a CapacityMoELayer (same params); ``remat``: its experts'
  computation is recomputed in the backward pass."""
  for layer in model.layers:
    if hasattr(layer.mlp, "router"):
      layer.mlp = CapacityMoELayer(layer.mlp, capacity_factor, remat)


def set_capacity_factor(model, capacity_factor: float | None) -> None:
  for layer in model.layers:
    if isinstance(layer.mlp, CapacityMoELayer):
      layer.mlp.capacity_factor = capacity_factor

"""Routed-only expert compute (``moe.routed_expert_mlp``): each expert runs its kept assignments only, and the
result equals the dense computation (every expert on every token, dropped assignments masked) — values and
gradients within float32 rounding (relative 1e-5 of the output's scale), drop counts and re-runs unchanged —
on one device and on fsdp and expert meshes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from orchestrator.engine.moe import block_rows, routed_expert_mlp
from tests.conftest import run_child

#: |routed − dense| ≤ RTOL × max |dense|: the same terms summed in another order, in float32.
RTOL = 1e-5


def dense_reference(tokens, experts, weights, keep, gate, up, down):
  """Every expert on every token, then each token's chosen ones, weighted, dropped assignments masked (the
  layer's computation before routing)."""
  outputs = [(nnx.silu(tokens @ gate[i]) * (tokens @ up[i])) @ down[i] for i in range(gate.shape[0])]
  chosen = jnp.take_along_axis(jnp.stack(outputs, axis=1), experts[:, :, None], axis=1)
  return jnp.sum(chosen * (weights * keep)[:, :, None], axis=1)


def _case(seed, n, d, f, e, k, keep_share):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
  gate, up = (jnp.asarray(rng.standard_normal((e, d, f)) * 0.1, jnp.float32) for _ in range(2))
  down = jnp.asarray(rng.standard_normal((e, f, d)) * 0.1, jnp.float32)
  experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
  weights = jnp.asarray(rng.random((n, k)), jnp.float32)
  keep = jnp.asarray(rng.random((n, k)) < keep_share, jnp.float32)
  return tokens, experts, weights, keep, gate, up, down


def _routed(tokens, experts, weights, keep, gate, up, down):
  return routed_expert_mlp(tokens, experts.T.reshape(-1), weights.T.reshape(-1), keep.T.reshape(-1) > 0,
                           gate, up, down)


def _close(got, want):
  scale = float(jnp.max(jnp.abs(want))) or 1.0
  return float(jnp.max(jnp.abs(got - want))) <= RTOL * scale


CASES = {"4 experts top-2, 1 in 5 dropped": (0, 512, 64, 48, 4, 2, 0.8),
         "16 experts top-2, none dropped": (1, 300, 32, 16, 16, 2, 1.0),
         "8 experts top-4, half dropped": (2, 96, 16, 24, 8, 4, 0.5),
         "fewer tokens than experts": (3, 3, 8, 8, 4, 2, 1.0)}


@pytest.mark.engine
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_routed_compute_equals_the_dense_reference_in_values_and_gradients(case):
  args = _case(*CASES[case])
  assert _close(jax.jit(_routed)(*args), dense_reference(*args))
  cotangent = jnp.asarray(np.random.default_rng(9).standard_normal(args[0].shape), jnp.float32)
  wrt = (0, 2, 4, 5, 6)  # tokens, routing weights, the experts' weights
  grads = [jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) * cotangent), argnums=wrt)(*args)
           for fn in (_routed, dense_reference)]
  assert all(_close(g, r) for g, r in zip(*grads))


@pytest.mark.engine
def test_a_wrong_expert_or_a_kept_assignment_left_out_is_seen_negative_controls():
  tokens, experts, weights, keep, gate, up, down = _case(*CASES["4 experts top-2, 1 in 5 dropped"])
  want = dense_reference(tokens, experts, weights, keep, gate, up, down)
  assert not _close(_routed(tokens, (experts + 1) % 4, weights, keep, gate, up, down), want)
  assert not _close(_routed(tokens, experts, weights, keep.at[5, 0].set(1 - keep[5, 0]), gate, up, down), want)


@pytest.mark.engine
def test_blocks_keep_the_padding_within_a_quarter_of_the_assignments():
  for assignments, experts in ((4096, 4), (4096, 16), (640, 128), (16, 4)):
    rows = block_rows(assignments, experts)
    assert rows >= 8 and rows & (rows - 1) == 0
    assert experts * (rows - 1) <= max(assignments // 4, experts * 7)


@pytest.mark.engine
def test_the_expert_work_is_the_kept_assignments_not_every_expert_on_every_token():
  """The compiled program's flops, routed against dense, on 16 experts top-2: about top-k / E of the expert work
  (the rest: the router's top-k, the sort and the gathers), which is where the step's time went."""
  args = _case(*CASES["16 experts top-2, none dropped"])

  def flops(fn):
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]

  assert flops(_routed) < 0.3 * flops(dense_reference)


MESH_CHILD = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from orchestrator.engine import build_engine
from orchestrator.engine.mesh import MeshConfig, make_mesh
from tests.engine.test_moe_routed import CASES, _case, _close, _routed, dense_reference

mesh = make_mesh(MeshConfig(fsdp=2, expert=2))
tokens, experts, weights, keep, gate, up, down = _case(*CASES["4 experts top-2, 1 in 5 dropped"])
put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
sharded = (put(tokens, ("fsdp", "expert"), None), put(experts, ("fsdp", "expert"), None),
           put(weights, ("fsdp", "expert"), None), put(keep, ("fsdp", "expert"), None),
           put(gate, "expert", "fsdp", None), put(up, "expert", "fsdp", None), put(down, "expert", None, "fsdp"))
want = dense_reference(tokens, experts, weights, keep, gate, up, down)
assert _close(jax.jit(_routed)(*sharded), want)
# the engine on the mesh: a step with drops and a dropless re-run, against the same step on one device
""" + "\n".join([
    "from tests.engine.test_moe_rerun import STEPS, FACTOR",
    "losses = {}",
    "for name, mesh_shape in (('mesh', {'fsdp': 2, 'expert': 2}), ('one', None)):",
    "  engine = build_engine('tiny_moe', ragged_buffer_factor=FACTOR, retry_when_tokens_dropped=True,"
    " mesh=mesh_shape, rows=4)",
    "  for payload in STEPS[1]:",
    "    engine.fwd_bwd(payload)",
    "  engine.update()",
    "  m = engine.get_metrics()",
    "  losses[name] = (m.loss, m.grad_norm, m.reruns, m.dropped_tokens)",
    "(loss, norm, reruns, dropped), (loss1, norm1, reruns1, dropped1) = losses['mesh'], losses['one']",
    "assert reruns == reruns1 == 2 and dropped == dropped1, losses",
    "assert abs(loss - loss1) <= 1e-5 * abs(loss1) and abs(norm - norm1) <= 1e-4 * norm1, losses",
    "print('CHILD-OK')",
])


@pytest.mark.e2e
@pytest.mark.slow  # a 4-device child; the suite keeps the MoE engine on this mesh (test_moe_rerun.py)
def test_routed_compute_on_fsdp_and_expert_meshes_equals_the_reference_and_one_device():
  run_child(MESH_CHILD, devices=4)

"""Build a Tunix Qwen3 from a preset, with seeded random weights, split into graph and params."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.qwen3 import model as qwen3_model

from orchestrator.engine import mesh as mesh_lib
from orchestrator.engine import moe as moe_lib
from orchestrator.engine.presets import ModelPreset


def model_config(preset: ModelPreset) -> qwen3_model.ModelConfig:
  return qwen3_model.ModelConfig(
      num_layers=preset.num_layers,
      vocab_size=preset.vocab_size,
      embed_dim=preset.embed_dim,
      hidden_dim=preset.hidden_dim,
      num_heads=preset.num_heads,
      head_dim=preset.head_dim,
      num_kv_heads=preset.num_kv_heads,
      rope_theta=preset.rope_theta,
      norm_eps=preset.norm_eps,
      use_tied_embedding=preset.use_tied_embedding,
      num_experts=preset.num_experts,
      num_experts_per_tok=preset.num_experts_per_tok,
      shd_config=mesh_lib.qwen3_sharding(),
  )


def build_model(preset: ModelPreset, seed: int, capacity_factor: float | None = None):
  """Returns ``(graphdefs, params, partition_specs)`` for a randomly initialised Qwen3.

  ``graphdefs`` has two entries over the same params: ``"capacity"`` routes MoE
  tokens with ``capacity_factor`` (None: dropless) and ``"dropless"`` never
  drops; for a dense model both are the same graph. ``params`` is a plain
  nested dict of host-resident jax arrays. Tunix initialises the dense MLP
  kernels to zero, which would leave the MLP untrainable (zero weights on both
  sides give zero gradients); those are re-drawn from a scaled normal here,
  seeded, so every weight learns.
  """
  model = qwen3_model.Qwen3(model_config(preset), rngs=nnx.Rngs(seed))
  graphdefs = {}
  if preset.is_moe:
    moe_lib.install(model, None)
    graphdefs["dropless"], _ = nnx.split(model)
    moe_lib.set_capacity_factor(model, capacity_factor)
  graphdef, state = nnx.split(model)
  graphdefs["capacity"] = graphdef
  graphdefs.setdefault("dropless", graphdef)
  specs = nnx.get_partition_spec(state)
  params = nnx.to_pure_dict(state)
  rng = np.random.default_rng(seed + 1)

  def redraw_zeros(path, x):
    if x.ndim >= 2 and not np.any(np.asarray(x)):
      fan_in = x.shape[0]
      draw = rng.standard_normal(x.shape, dtype=np.float32) / np.sqrt(fan_in)
      return jnp.asarray(draw, x.dtype)
    return x

  params = jax.tree_util.tree_map_with_path(redraw_zeros, params)
  return graphdefs, params, nnx.to_pure_dict(specs)


def param_shardings(mesh, specs):
  """NamedShardings (one per param leaf) from the partition specs the weights carry."""
  return jax.tree.map(
      lambda spec: jax.sharding.NamedSharding(
          mesh, spec if isinstance(spec, jax.sharding.PartitionSpec) else jax.sharding.PartitionSpec()
      ),
      specs,
      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec) or x is None,
  )

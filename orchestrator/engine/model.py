"""Build a Tunix Qwen3 from a preset (seeded random weights) or a checkpoint, split into graph and params."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.qwen3 import model as qwen3_model
from tunix.models.qwen3 import params as qwen3_params

from orchestrator.engine import mesh as mesh_lib
from orchestrator.engine import moe as moe_lib
from orchestrator.engine.presets import ModelPreset


#: JAX's dtype for each compute dtype a recipe may name (``engine.dtype``); weights stay float32.
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def model_config(preset: ModelPreset, dtype: str = "float32") -> qwen3_model.ModelConfig:
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
      dtype=COMPUTE_DTYPES[dtype],
      param_dtype=jnp.float32,
  )


def build_model(preset: ModelPreset, seed: int, capacity_factor: float | None = None, *, mesh=None,
                dtype: str = "float32"):
  """Returns ``(graphdefs, params, partition_specs)`` for a Qwen3: randomly initialised with ``seed``, or,
  when ``preset.checkpoint`` names a Hugging Face checkpoint, with its weights (read through Tunix's loader,
  onto ``mesh``'s shardings as they load when a mesh is given, else onto the default device; upcast to
  float32, the weights' dtype here). ``dtype`` is the compute dtype.

  ``graphdefs`` has two entries over the same params: ``"capacity"`` routes MoE
  tokens with ``capacity_factor`` (None: dropless) and ``"dropless"`` never
  drops; for a dense model both are the same graph. ``params`` is a plain
  nested dict of host-resident jax arrays. Tunix initialises the dense MLP
  kernels to zero, which would leave the MLP untrainable (zero weights on both
  sides give zero gradients); those are re-drawn from a scaled normal here,
  seeded, so every weight learns.
  """
  config = model_config(preset, dtype)
  if preset.checkpoint:
    model = qwen3_params.create_model_from_safe_tensors(preset.checkpoint, config, mesh, dtype=jnp.float32)
  else:
    model = qwen3_model.Qwen3(config, rngs=nnx.Rngs(seed))
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

  if not preset.checkpoint:  # a checkpoint's weights are kept as they are
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

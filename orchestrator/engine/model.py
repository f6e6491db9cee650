"""Build a Tunix model of the preset's family from a preset (seeded random weights) or a checkpoint, split into
graph and params."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.llama3 import model as llama3_model
from tunix.utils import compat, torch_utils

from orchestrator.models import hf_checkpoint, local_global
from orchestrator.engine import mesh as mesh_lib
from orchestrator.engine import moe as moe_lib
from orchestrator.models.families import FAMILIES
from orchestrator.models.presets import ModelPreset


#: JAX's dtype for each compute dtype a recipe may name (``engine.dtype``); weights stay float32.
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# Tunix 0.1.7's Llama3 attention calls its rotary function without the config's base, so every Llama ran at
# 1,000,000 (SmolLM2's is 100,000). The family's model below sets the base for the duration of its own call;
# anyone else's Llama3 (the variable unset) rotates as Tunix's does.
_LLAMA_ROPE_THETA: contextvars.ContextVar[float | None] = contextvars.ContextVar("llama_rope_theta", default=None)
_tunix_llama_rope = llama3_model.apply_rope


def _llama_rope(inputs, positions, head_dim, rope_theta=1_000_000):
  theta = _LLAMA_ROPE_THETA.get()
  return _tunix_llama_rope(inputs, positions, head_dim, rope_theta if theta is None else theta)


llama3_model.apply_rope = _llama_rope


class Llama3(llama3_model.Llama3):
  """Tunix's Llama3, rotating with its config's ``rope_theta``."""

  def __call__(self, *args, **kwargs):
    token = _LLAMA_ROPE_THETA.set(self.config.rope_theta)
    try:
      return super().__call__(*args, **kwargs)
    finally:
      _LLAMA_ROPE_THETA.reset(token)


#: What ``engine.remat=dots`` keeps of a rematerialised layer: the outputs of its weight matmuls (dots without
#: batch dimensions), not attention's score and probability tensors (batched dots and what follows them).
REMAT_SAVE_POLICIES = {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}

# Tunix's layers rematerialise with ``nnx.remat(block)`` and no policy, so every remat recomputes the whole
# block. The families' modules see ``nnx`` through the proxy below, whose ``remat`` adds the policy of the
# engine being traced (``remat_policy``); outside one (a sampler, anyone else's model) it is Tunix's own call.
_REMAT_POLICY: contextvars.ContextVar = contextvars.ContextVar("remat_policy", default=None)


class _NnxWithRematPolicy:
  """``flax.nnx`` as a Tunix model module sees it, ``remat`` taking the policy in force."""

  def __getattr__(self, name):
    return getattr(nnx, name)

  @staticmethod
  def remat(f, **kwargs):
    policy = _REMAT_POLICY.get()
    if policy is not None and "policy" not in kwargs:
      kwargs["policy"] = policy
    return nnx.remat(f, **kwargs)


@contextlib.contextmanager
def remat_policy(remat: str):
  """While tracing a model built with ``engine.remat=remat``: its layers keep what the policy saves."""
  token = _REMAT_POLICY.set(REMAT_SAVE_POLICIES.get(remat))
  try:
    yield
  finally:
    _REMAT_POLICY.reset(token)


def _install_remat_policy(module) -> None:
  if getattr(module, "nnx", None) is nnx:
    module.nnx = _NnxWithRematPolicy()


#: The model class of each family whose Tunix class is not used as it is.
_MODEL_CLASSES = {"llama": Llama3}


def model_class(preset: ModelPreset):
  family = FAMILIES[preset.family]
  return _MODEL_CLASSES.get(family.name) or getattr(family.tunix_model(), family.model_class)


#: The splash kernel's blocks, largest first: a multiple of 128 tokens (its lanes) that divides the row.
SPLASH_BLOCKS = (512, 256, 128)


def splash_block_tokens(tokens_per_row: int) -> int:
  """The splash kernel's block: the largest of ``SPLASH_BLOCKS`` that divides a row.

  Raises:
    ValueError: the row is no multiple of 128 tokens (the recipe refuses such a row first).
  """
  for block in SPLASH_BLOCKS:
    if tokens_per_row % block == 0:
      return block
  raise ValueError(f"engine.attention=splash needs rows of a multiple of 128 tokens; batch.tokens_per_row is"
                   f" {tokens_per_row}")


def model_config(preset: ModelPreset, dtype: str = "float32", remat: str = "none", splash_block: int | None = None):
  """The family's Tunix ``ModelConfig`` for ``preset`` (``dtype``: the compute dtype; weights are float32;
  ``remat``: ``engine.remat``, each decoder layer rematerialised unless ``none``: the whole layer for a dense
  model; for an MoE the attention block, and inside each expert layer its experts' computation, whose drop
  counts must leave the layer outside any rematerialised trace;
  ``splash_block``: attention as Tunix's Pallas splash kernel in blocks of this many tokens, None: Tunix's
  einsum attention).

  Raises:
    ValueError: a compute dtype or an MoE the family's Tunix model does not take.
  """
  family = FAMILIES[preset.family]
  module = family.tunix_model()
  if dtype not in family.compute_dtypes:
    raise ValueError(f"engine.dtype={dtype}: Tunix's {family.model_class} computes in"
                     f" {' or '.join(family.compute_dtypes)}; use engine.dtype={family.compute_dtypes[0]}")
  if preset.is_moe and family.moe_model_type is None:
    raise ValueError(f"model {preset.name}: num_experts={preset.num_experts}, but the {family.name} family has no"
                     " MoE model; drop num_experts or use the qwen3 family")
  values = dict(num_layers=preset.num_layers, vocab_size=preset.vocab_size, embed_dim=preset.embed_dim,
                hidden_dim=preset.hidden_dim, num_heads=preset.num_heads, head_dim=preset.head_dim,
                num_kv_heads=preset.num_kv_heads, rope_theta=preset.rope_theta, norm_eps=preset.norm_eps,
                use_tied_embedding=preset.use_tied_embedding, weight_tying=preset.use_tied_embedding,
                num_experts=preset.num_experts, num_experts_per_tok=preset.num_experts_per_tok,
                shd_config=mesh_lib.model_sharding(module.ShardingConfig), dtype=COMPUTE_DTYPES[dtype],
                param_dtype=jnp.float32)
  if family.local_global_attention:
    values.update(local_global.tunix_config_values(preset, module))
  if splash_block is not None:
    values.update(use_flash_attention=True, flash_attention_block_size=splash_block)
  if remat != "none":
    _install_remat_policy(module)
    values["remat_config"] = module.RematConfig.BLOCK if preset.is_moe else module.RematConfig.DECODER
  fields = {field.name for field in dataclasses.fields(module.ModelConfig)}
  return module.ModelConfig(**{name: value for name, value in values.items() if name in fields})


def build_model(preset: ModelPreset, seed: int, capacity_factor: float | None = None, *, mesh=None,
                dtype: str = "float32", remat: str = "none", splash_block: int | None = None):
  """Returns ``(graphdefs, params, partition_specs)`` for a model of the preset's family: randomly initialised with ``seed``, or,
  when ``preset.checkpoint`` names a Hugging Face checkpoint, with its weights (``load_hf_checkpoint``: onto
  ``mesh``'s shardings when a mesh is given, else onto this process's first device, where random weights
  start; upcast to float32, the weights' dtype here). ``dtype`` is the compute dtype, ``remat`` the
  layers' rematerialisation, ``splash_block`` the splash attention's block (``model_config``).

  ``graphdefs`` has two entries over the same params: ``"capacity"`` routes MoE
  tokens with ``capacity_factor`` (None: dropless) and ``"dropless"`` never
  drops; for a dense model both are the same graph. ``params`` is a plain
  nested dict of host-resident jax arrays. Tunix initialises the dense MLP
  kernels to zero, which would leave the MLP untrainable (zero weights on both
  sides give zero gradients); those are re-drawn from a scaled normal here,
  seeded, so every weight learns.
  """
  config = model_config(preset, dtype, remat, splash_block)
  if preset.checkpoint:
    model = load_hf_checkpoint(preset, config, mesh)
  else:
    model = model_class(preset)(config, rngs=nnx.Rngs(seed))
  graphdefs = {}
  if preset.is_moe:
    moe_lib.install(model, None, remat=remat != "none")
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


#: A Tunix key of one expert's projection, as the key mapping gives it: (layer prefix, expert, projection).
_EXPERT_KEY = re.compile(r"(layers\.\d+\.mlp\.)experts\.(\d+)\.(gate|up|down)_proj\.kernel")


def load_hf_checkpoint(preset: ModelPreset, config, mesh=None):
  """The preset's model with its Hugging Face checkpoint's weights, read tensor by tensor as each header's own
  dtype.

  Tunix's loader maps every file as the dtype of its first tensor, so a file
  mixing dtypes would load reinterpreted bytes; here each tensor is read as
  its header says (``hf_checkpoint.tensor_arrays``), mapped to Tunix's names
  by Tunix's own key mapping, experts stacked, upcast to float32 and placed on
  its sharding (``mesh``'s, else this process's first local device: a sampler's in a job of several
  processes, which must be able to read every weight) one at a time.
  """
  directory = preset.checkpoint
  cls = model_class(preset)
  with compat.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    abstract = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(params=0)))
  graphdef, abstract_state = nnx.split(abstract)
  if mesh is not None:
    placements = nnx.get_named_sharding(abstract_state, mesh).to_pure_dict()
  else:  # this process's own first device: jax.devices()[0] is process 0's in a job of several processes
    placements = jax.tree.map(lambda _: jax.local_devices()[0], abstract_state.to_pure_dict())
  # Tunix's own name mapping (private, but the one its loader uses), so the names cannot drift from its model.
  names = FAMILIES[preset.family].tunix_params()
  key_map = names._get_key_and_transform_mapping(config)  # pylint: disable=protected-access
  values, experts = {}, {}
  for tensor, array in hf_checkpoint.tensor_arrays(hf_checkpoint.checkpoint_tensors(directory)):
    key, transform = torch_utils.torch_key_to_jax_key(key_map, tensor.name)
    if transform is not None:
      permute, reshape = transform
      array = array.transpose(permute) if permute else array
      array = array.reshape(reshape) if reshape else array
    if match := _EXPERT_KEY.fullmatch(key):
      experts.setdefault(f"{match[1]}{match[3]}_proj", {})[int(match[2])] = array
    else:
      values[key] = array
  for key, by_expert in experts.items():
    values[key] = np.stack([np.asarray(by_expert[e], np.float32) for e in sorted(by_expert)])
  if hasattr(names, "_make_preprocess_fn"):  # Gemma3 joins each layer's q/k/v into its einsum weights, as Tunix's
    # loader does; on the host's CPU, so the joined weights never gather on one accelerator before placement
    with jax.default_device(_host_device()):
      values = names._make_preprocess_fn(config)(values)  # pylint: disable=protected-access

  def place(path, placement, shape):
    key = ".".join(str(getattr(part, "key", getattr(part, "idx", part))) for part in path)
    value = np.asarray(values[key], np.float32)  # every name is there: the recipe checked the tensors
    if value.shape != shape.shape:
      raise ValueError(f"{directory}: {key} has shape {value.shape}, the model's is {shape.shape}")
    return jax.device_put(value, placement)

  state = jax.tree_util.tree_map_with_path(place, placements, abstract_state.to_pure_dict())
  return nnx.merge(graphdef, state)


def _host_device():
  """The host's CPU device, or the default device where JAX_PLATFORMS leaves the CPU out."""
  try:
    return jax.devices("cpu")[0]
  except RuntimeError:
    return None


def param_shardings(mesh, specs):
  """NamedShardings (one per param leaf) from the partition specs the weights carry."""
  return jax.tree.map(
      lambda spec: jax.sharding.NamedSharding(
          mesh, spec if isinstance(spec, jax.sharding.PartitionSpec) else jax.sharding.PartitionSpec()
      ),
      specs,
      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec) or x is None,
  )

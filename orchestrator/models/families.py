"""The model families the engine trains: one table, read by the checker, the loader, the builder and the exporter.

A family is a Tunix model (``tunix/models/<name>``) and the Hugging Face
``model_type`` values whose checkpoints it runs. What differs between them is
written once here, as data: which per-layer tensors a checkpoint holds (query/
key norms, query/key/value biases), which ``config.json`` settings the Tunix
model does not implement (refused by name, with the value it runs), whether it
has an MoE variant, which compute dtypes it takes and which rotary base it
actually uses. Nothing here imports JAX: the recipe checks a checkpoint against
its family before anything is built; ``tunix_model`` imports the model module
only when a model is built.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

#: The family of a preset (``configs/model/*.yaml``) that names none.
DEFAULT_FAMILY = "qwen3"


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family: how its checkpoints look and which Tunix model runs them."""

  name: str
  #: config.json's ``model_type`` values of the family, each with its ``architectures`` entry.
  model_types: Mapping[str, str]
  #: The Tunix package under ``tunix.models`` and its model class.
  tunix_package: str
  model_class: str
  #: Per-layer tensors beyond the shared Llama layout: RMS norms on queries and keys (Qwen3), biases on the
  #: query, key and value projections (Qwen2).
  qk_norm: bool = False
  qkv_bias: bool = False
  #: Per-layer norms around the MLP as well as before attention and the MLP (Gemma 3: four a layer).
  sandwich_norms: bool = False
  #: Sliding-window layers between global ones, each with its own rotary base, and the query scaled by a
  #: configured ``query_pre_attn_scalar`` (Gemma 3); their settings are read by ``models/local_global.py``.
  local_global_attention: bool = False
  #: Tunix's model can run attention as the Pallas splash kernel on a TPU (``use_flash_attention``, with segment
  #: ids), which never holds a [rows, heads, T, T] probability tensor (``engine.attention=splash``).
  flash_attention: bool = False
  #: The module under the Tunix package holding its Hugging Face name mapping.
  params_module: str = "params"
  #: transformers' ``head_dim`` where config.json gives none, by ``model_type`` (a model_type not here derives it:
  #: ``hidden_size // num_attention_heads``, as Llama's, Qwen2's and Qwen3 MoE's configs do).
  default_head_dims: Mapping[str, int] = dataclasses.field(default_factory=dict)
  #: The value of ``tie_word_embeddings`` where config.json gives none.
  default_tied_embedding: bool = False
  #: The ``model_type`` of the family's MoE variant (None: dense only).
  moe_model_type: str | None = None
  #: config.json settings the Tunix model does not implement, with the value it does implement (absent is fine).
  unsupported: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  #: The compute dtypes (``engine.dtype``) the Tunix model takes.
  compute_dtypes: tuple[str, ...] = ("float32", "bfloat16")
  #: The rotary base the Tunix model runs whatever its config says (None: the config's ``rope_theta``).
  fixed_rope_theta: float | None = None
  #: transformers' defaults where config.json gives none.
  default_rope_theta: float = 10_000.0
  default_norm_eps: float = 1e-6
  default_context_tokens: int = 32_768

  def tunix_model(self) -> ModuleType:
    """``tunix.models.<package>.model`` (imports JAX)."""
    return importlib.import_module(f"tunix.models.{self.tunix_package}.model")

  def tunix_params(self) -> ModuleType:
    """``tunix.models.<package>.<params_module>``: the family's Hugging Face name mapping."""
    return importlib.import_module(f"tunix.models.{self.tunix_package}.{self.params_module}")

  def model_type(self, moe: bool) -> str:
    return self.moe_model_type if moe else next(iter(self.model_types))

  def rope_theta(self, configured: float) -> float:
    """The rotary base the model computes with, for a config that gives ``configured``."""
    return self.fixed_rope_theta if self.fixed_rope_theta is not None else configured


_SHARED_UNSUPPORTED = {"rope_scaling": None, "hidden_act": "silu", "quantization_config": None}

#: Every family, by name. Llama's Tunix attention is given the config's rotary base by ``model._llama_rope``
#: (Tunix 0.1.7 calls its rotary function without it); Tunix's Qwen3 rotates with 1,000,000 whatever the
#: config says, so a Qwen3 checkpoint with another base is refused rather than run wrong. Tunix's Gemma3 (text
#: only: ``gemma3_text``; the multimodal ``gemma3`` checkpoint holds a vision tower) ties its embeddings, has no
#: soft-capping and normalises with a fixed epsilon of 1e-6, so each of those is refused otherwise.
FAMILIES: dict[str, Family] = {
    "qwen3": Family(
        name="qwen3", model_types={"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"},
        tunix_package="qwen3", model_class="Qwen3", qk_norm=True, moe_model_type="qwen3_moe",
        default_head_dims={"qwen3": 128}, flash_attention=True,
        unsupported=dict(_SHARED_UNSUPPORTED, attention_bias=False, use_sliding_window=False),
        fixed_rope_theta=1_000_000.0),
    "qwen2": Family(
        name="qwen2", model_types={"qwen2": "Qwen2ForCausalLM"}, tunix_package="qwen2", model_class="Qwen2",
        qkv_bias=True, flash_attention=True, unsupported=dict(_SHARED_UNSUPPORTED, use_sliding_window=False)),
    "llama": Family(
        name="llama", model_types={"llama": "LlamaForCausalLM"}, tunix_package="llama3", model_class="Llama3",
        unsupported=dict(_SHARED_UNSUPPORTED, attention_bias=False, mlp_bias=False, pretraining_tp=1),
        compute_dtypes=("float32",), default_norm_eps=1e-6, default_context_tokens=2048),
    "gemma3": Family(
        name="gemma3", model_types={"gemma3_text": "Gemma3ForCausalLM"}, tunix_package="gemma3",
        model_class="Gemma3", qk_norm=True, sandwich_norms=True, local_global_attention=True,
        params_module="params_safetensors", default_tied_embedding=True,
        default_head_dims={"gemma3_text": 256},
        unsupported={"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
                     "quantization_config": None, "attention_bias": False, "attn_logit_softcapping": None,
                     "final_logit_softcapping": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                     "use_bidirectional_attention": False},
        compute_dtypes=("float32",), default_rope_theta=1_000_000.0, default_context_tokens=131_072),
}

#: Each model_type any family runs, with its family.
BY_MODEL_TYPE: dict[str, Family] = {model_type: family for family in FAMILIES.values()
                                     for model_type in family.model_types}


def family(name: str) -> Family:
  """The family named ``name``.

  Raises:
    ValueError: no such family (the message lists them).
  """
  if name not in FAMILIES:
    raise ValueError(f"model family {name!r} is not one the engine runs; families: {', '.join(FAMILIES)}")
  return FAMILIES[name]

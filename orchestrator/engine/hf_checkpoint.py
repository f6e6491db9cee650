"""Qwen3 checkpoints in Hugging Face layout: read ``config.json``, check the tensors, and write them back.

A checkpoint directory holds ``config.json`` (the model's sizes), one or more
``*.safetensors`` files (the weights, named as ``transformers`` names them) and
usually the tokenizer's files. Reading one here needs no JAX: the recipe checks
a directory (sizes, family, every tensor's name and shape, from the files'
headers) before anything is built, and the weights are then loaded through
Tunix's loader (``orchestrator.engine.model``), which shards them onto the mesh
as it reads. ``export_tensors`` is the loader's inverse, so a directory written
by ``run_rl export`` loads back to the same weights, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from orchestrator.engine.presets import ModelPreset

CONFIG_FILE = "config.json"
#: The ``model_type`` values of the Qwen3 family (dense and MoE) that Tunix's Qwen3 implements.
QWEN3_MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
#: The tokenizer's files a checkpoint directory may carry; ``run_rl export`` copies the ones present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")
#: The preset fields a checkpoint's ``config.json`` decides, and how each is named there (dense models).
SIZE_KEYS = {"num_layers": "num_hidden_layers", "vocab_size": "vocab_size", "embed_dim": "hidden_size",
             "hidden_dim": "intermediate_size", "num_heads": "num_attention_heads", "head_dim": "head_dim",
             "num_kv_heads": "num_key_value_heads", "num_experts": "num_experts",
             "num_experts_per_tok": "num_experts_per_tok"}


class CheckpointDirError(ValueError):
  """A checkpoint directory that cannot be used as given; the message names the file, the value and the fix."""


def read_config(directory: str | Path, key: str = "model.checkpoint") -> dict[str, Any]:
  """The ``config.json`` of a Qwen3 checkpoint directory, checked to be one.

  Raises:
    CheckpointDirError: no such directory, no or unreadable ``config.json``, or another model family.
  """
  try:
    return _read_config(directory, key)
  except OSError as e:  # unreadable: permissions, a broken disk
    raise CheckpointDirError(f"{key}={directory} cannot be read ({e.strerror or e}); give a directory you can"
                             " read") from None


def _read_config(directory: str | Path, key: str) -> dict[str, Any]:
  path = Path(directory).expanduser()
  if path.is_file():
    raise CheckpointDirError(f"{key}={directory} is a file; give the directory holding the checkpoint's"
                             " config.json and *.safetensors")
  if not path.is_dir():
    raise CheckpointDirError(f"{key}={directory}: no such directory; give a Hugging Face checkpoint directory"
                             " (config.json and *.safetensors)")
  config_path = path / CONFIG_FILE
  if not config_path.is_file():
    raise CheckpointDirError(f"{key}={directory}: it has no {CONFIG_FILE}; give the directory a Hugging Face"
                             " checkpoint was saved to (config.json beside its *.safetensors)")
  try:
    config = json.loads(config_path.read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointDirError(f"{key}: {config_path} is not readable JSON ({e}); restore the checkpoint's"
                             f" {CONFIG_FILE}") from None
  if not isinstance(config, dict):
    raise CheckpointDirError(f"{key}: {config_path} holds a JSON {type(config).__name__}, not an object;"
                             f" restore the checkpoint's {CONFIG_FILE}")
  model_type = config.get("model_type")
  if model_type not in QWEN3_MODEL_TYPES:
    family = (f"a {model_type} model" if isinstance(model_type, str) and model_type
              else f"no model_type (architectures: {config.get('architectures')})")
    raise CheckpointDirError(f"{key}={directory}: its {CONFIG_FILE} names {family}; this trainer runs the Qwen3"
                             f" family ({', '.join(QWEN3_MODEL_TYPES)}): use a Qwen3 checkpoint")
  return config


#: The largest size ``config.json`` may give (larger ones are damage, and would build huge name tables).
MAX_SIZE = {"num_hidden_layers": 1024, "num_experts": 4096, "num_experts_per_tok": 4096,
            "num_attention_heads": 4096, "num_key_value_heads": 4096}
MAX_OTHER_SIZE = 1 << 24
#: The tensor dtypes (safetensors' names) the loader reads; others (FP8 and its scales, int8) are refused.
TENSOR_DTYPES = ("F32", "BF16", "F16")
#: config.json settings Tunix's Qwen3 does not implement, with the value it does implement (absent is fine).
UNSUPPORTED = {"rope_scaling": None, "attention_bias": False, "use_sliding_window": False, "hidden_act": "silu",
               "quantization_config": None}


def _int(config: Mapping[str, Any], name: str, where: str) -> int:
  value = config.get(name)
  high = MAX_SIZE.get(name, MAX_OTHER_SIZE)
  if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
    raise CheckpointDirError(f"{where}: {name}={value!r} must be a whole number in [1, {high:,}]; restore the"
                             f" checkpoint's {CONFIG_FILE}")
  return value


def preset_from_config(directory: str | Path, config: Mapping[str, Any]) -> ModelPreset:
  """The model preset a checkpoint's ``config.json`` describes (``checkpoint`` set to the directory).

  Raises:
    CheckpointDirError: a size missing or out of range, or a Qwen3 variant Tunix's model does not implement
      (MoE with dense layers between, or unnormalised top-k routing).
  """
  where = f"model.checkpoint {Path(directory) / CONFIG_FILE}"
  moe = config.get("model_type") == "qwen3_moe"
  # An MoE checkpoint's experts are moe_intermediate_size wide (its intermediate_size is a dense MLP's it has not).
  names = dict(SIZE_KEYS, hidden_dim="moe_intermediate_size") if moe else SIZE_KEYS
  if "head_dim" not in config:  # transformers' default for Qwen3
    names = {field: name for field, name in names.items() if field != "head_dim"}
  sizes = {field: _int(config, name, where) for field, name in names.items()
           if not field.startswith("num_experts") or moe}
  sizes.setdefault("head_dim", sizes["embed_dim"] // sizes["num_heads"])
  if moe:
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
      raise CheckpointDirError(f"{where}: mlp_only_layers={config.get('mlp_only_layers')} decoder_sparse_step="
                               f"{config.get('decoder_sparse_step')}: every layer must be an MoE layer (Tunix's"
                               " Qwen3 MoE has no dense layers between); use a checkpoint without them")
    if config.get("norm_topk_prob", True) is not True:
      raise CheckpointDirError(f"{where}: norm_topk_prob={config.get('norm_topk_prob')}: Tunix's Qwen3 MoE"
                               " normalises the top-k routing weights; use a checkpoint that does")
  for name, implemented in UNSUPPORTED.items():
    if config.get(name, implemented) != implemented:
      raise CheckpointDirError(f"{where}: {name}={config[name]!r}, which Tunix's Qwen3 does not implement (it runs"
                               f" {name}={implemented!r}); use a checkpoint without it")
  tied = config.get("tie_word_embeddings", False)
  if not isinstance(tied, bool):
    raise CheckpointDirError(f"{where}: tie_word_embeddings={tied!r} must be true or false")
  rope = config.get("rope_theta", 1_000_000)
  eps = config.get("rms_norm_eps", 1e-6)
  for name, value in (("rope_theta", rope), ("rms_norm_eps", eps)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
      raise CheckpointDirError(f"{where}: {name}={value!r} must be a finite number > 0")
  return ModelPreset(name=Path(directory).name or str(directory), **sizes, rope_theta=rope, norm_eps=float(eps),
                     use_tied_embedding=tied,
                     checkpoint=str(Path(directory).expanduser().absolute()))


def disagreement(preset: ModelPreset, loaded: ModelPreset) -> str | None:
  """The first size in which a named preset and a checkpoint differ (``"embed_dim: 64 vs 1024"``), else None."""
  for field in (*SIZE_KEYS, "use_tied_embedding"):
    mine, theirs = getattr(preset, field), getattr(loaded, field)
    if mine != theirs:
      name = SIZE_KEYS.get(field, "tie_word_embeddings")
      if field == "hidden_dim" and loaded.is_moe:
        name = "moe_intermediate_size"
      return f"{field}={mine} but its {CONFIG_FILE} has {name}={theirs}"
  return None


def expected_tensors(preset: ModelPreset) -> dict[str, tuple[int, ...]]:
  """Every tensor a Hugging Face Qwen3 checkpoint of ``preset``'s sizes holds, by name, with its shape."""
  d, v, n, k, h = preset.embed_dim, preset.vocab_size, preset.num_heads, preset.num_kv_heads, preset.head_dim
  f = preset.hidden_dim
  out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
  if not preset.use_tied_embedding:
    out["lm_head.weight"] = (v, d)
  for layer in range(preset.num_layers):
    p = f"model.layers.{layer}."
    out.update({p + "self_attn.q_proj.weight": (n * h, d), p + "self_attn.k_proj.weight": (k * h, d),
                p + "self_attn.v_proj.weight": (k * h, d), p + "self_attn.o_proj.weight": (d, n * h),
                p + "self_attn.q_norm.weight": (h,), p + "self_attn.k_norm.weight": (h,),
                p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
    if preset.is_moe:
      out[p + "mlp.gate.weight"] = (preset.num_experts, d)
      for e in range(preset.num_experts):
        out.update({p + f"mlp.experts.{e}.gate_proj.weight": (f, d), p + f"mlp.experts.{e}.up_proj.weight": (f, d),
                    p + f"mlp.experts.{e}.down_proj.weight": (d, f)})
    else:
      out.update({p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                  p + "mlp.down_proj.weight": (d, f)})
  return out


def tensor_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
  """Every tensor's name and shape in the directory's ``*.safetensors`` files, from their headers only.

  Raises:
    CheckpointDirError: no ``*.safetensors`` file, one that is not a readable safetensors file, or a tensor of
      a dtype the loader does not read.
  """
  files = sorted(Path(directory).expanduser().glob("*.safetensors"))
  if not files:
    raise CheckpointDirError(f"model.checkpoint={directory}: it has no *.safetensors file; give the directory"
                             " holding the checkpoint's weights")
  shapes, dtypes = {}, {}
  for file in files:
    try:
      with safe_open(str(file), framework="numpy") as f:
        for name in f.keys():
          tensor = f.get_slice(name)
          shapes[name], dtypes[name] = tuple(tensor.get_shape()), (tensor.get_dtype(), file)
    except Exception as e:  # safetensors raises its own error types for a damaged header
      raise CheckpointDirError(f"model.checkpoint: {file} is not a readable safetensors file ({e}); restore it")
  for name, (dtype, file) in dtypes.items():
    if dtype not in TENSOR_DTYPES:
      raise CheckpointDirError(f"model.checkpoint: tensor {name} in {file} is {dtype}; the loader reads"
                               f" {', '.join(TENSOR_DTYPES)} weights: use an unquantised checkpoint")
  return shapes


def check_tensors(directory: str | Path, preset: ModelPreset) -> None:
  """Every tensor ``preset`` needs is in the directory with its shape (extra tensors are left unread).

  Raises:
    CheckpointDirError: a tensor missing (named, with how many are) or of another shape.
  """
  found = tensor_shapes(directory)
  wanted = expected_tensors(preset)
  missing = [name for name in wanted if name not in found]
  if missing:
    raise CheckpointDirError(f"model.checkpoint={directory}: {len(missing)} of the model's {len(wanted)} tensors"
                             f" are missing from its *.safetensors (first: {missing[0]}); the files do not match"
                             f" its {CONFIG_FILE}: restore the checkpoint")
  for name, shape in wanted.items():
    if found[name] != shape:
      raise CheckpointDirError(f"model.checkpoint={directory}: tensor {name} has shape {list(found[name])} but"
                               f" {CONFIG_FILE}'s sizes need {list(shape)}; restore the checkpoint")


def load_preset_from_checkpoint(directory: str | Path) -> ModelPreset:
  """``config.json``'s preset, with every tensor checked against it (no weights are read)."""
  preset = preset_from_config(directory, read_config(directory))
  check_tensors(directory, preset)
  return preset


# ------------------------------------------------------------------ writing
_LAYER = re.compile(r"layers\.(\d+)\.(.*)")


def export_tensors(params: Mapping[str, Any], preset: ModelPreset) -> dict[str, np.ndarray]:
  """The Hugging Face tensors of a Qwen3's params (the nested dict ``nnx.to_pure_dict`` gives, on the host).

  The inverse of Tunix's Qwen3 key mapping: projections are transposed back to
  ``(out, in)`` and attention heads flattened, MoE experts unstacked.

  Raises:
    ValueError: a param this mapping does not know (the model is not a Qwen3 of ``preset``'s sizes).
  """
  flat = _flatten(params)
  d = preset.embed_dim
  out: dict[str, np.ndarray] = {}
  for key, value in flat.items():
    x = np.asarray(value)
    if key == "embedder.input_embedding":
      out["model.embed_tokens.weight"] = x
    elif key == "final_norm.w":
      out["model.norm.weight"] = x
    elif key == "lm_head.w":
      out["lm_head.weight"] = x.T
    elif match := _LAYER.fullmatch(key):
      out.update(_layer_tensors(f"model.layers.{match[1]}.", match[2], x, d))
    else:
      raise ValueError(f"export: param {key} is not a Qwen3 weight")
  return {name: np.ascontiguousarray(x) for name, x in out.items()}


def _layer_tensors(prefix: str, key: str, x: np.ndarray, d: int) -> dict[str, np.ndarray]:
  if key in ("attn.q_proj.w", "attn.k_proj.w", "attn.v_proj.w"):  # (d, heads, head_dim) -> (heads*head_dim, d)
    return {prefix + f"self_attn.{key.split('.')[1]}.weight": x.reshape(d, -1).T}
  if key == "attn.o_proj.w":  # (heads, head_dim, d) -> (d, heads*head_dim)
    return {prefix + "self_attn.o_proj.weight": x.reshape(-1, d).T}
  if key in ("attn.q_norm.w", "attn.k_norm.w"):
    return {prefix + f"self_attn.{key.split('.')[1]}.weight": x}
  if key in ("input_layernorm.w", "post_attention_layernorm.w"):
    return {prefix + key.replace(".w", ".weight"): x}
  if key in ("mlp.gate_proj.kernel", "mlp.up_proj.kernel", "mlp.down_proj.kernel"):
    return {prefix + key.replace(".kernel", ".weight"): x.T}
  if key == "mlp.router.kernel":
    return {prefix + "mlp.gate.weight": x.T}
  if key in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):  # stacked experts (e, in, out)
    name = key.split(".")[1]
    return {prefix + f"mlp.experts.{e}.{name}.weight": x[e].T for e in range(x.shape[0])}
  raise ValueError(f"export: param {prefix}{key} is not a Qwen3 weight")


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.update(_flatten(value, name + "."))
    else:
      out[name] = value
  return out


def export_config(preset: ModelPreset, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """A ``config.json`` for ``preset``'s sizes: the source checkpoint's (``base``) with the sizes and dtype set,
  or a new one for a preset's model."""
  config = dict(base or {})
  config.pop("dtype", None)  # newer transformers' name for torch_dtype: the weights written are float32
  moe = preset.is_moe
  config.update(model_type="qwen3_moe" if moe else "qwen3", architectures=[QWEN3_MODEL_TYPES[
      "qwen3_moe" if moe else "qwen3"]], torch_dtype="float32", rope_theta=preset.rope_theta,
                rms_norm_eps=preset.norm_eps, tie_word_embeddings=preset.use_tied_embedding)
  for field, name in SIZE_KEYS.items():
    if field.startswith("num_experts") and not moe or field == "hidden_dim" and moe:
      continue
    config[name] = getattr(preset, field)
  if moe:
    config["moe_intermediate_size"] = preset.hidden_dim
    config.setdefault("decoder_sparse_step", 1)
    config.setdefault("mlp_only_layers", [])
    config.setdefault("norm_topk_prob", True)
  return config


def preset_sizes(preset: ModelPreset) -> dict[str, Any]:
  """The preset's fields that describe the model (for messages and the saved run)."""
  return {k: v for k, v in dataclasses.asdict(preset).items() if k not in ("rows", "tokens_per_row")}

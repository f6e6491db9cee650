"""Checkpoints in Hugging Face layout: read ``config.json``, check the tensors, and write them back.

The families a checkpoint may be (Llama, Qwen2, Qwen3 dense and MoE, Gemma 3) are
``orchestrator.models.families.FAMILIES``; ``config.json``'s ``model_type``
chooses one, and everything below reads what differs from that table.


A checkpoint directory holds ``config.json`` (the model's sizes), one or more
``*.safetensors`` files (the weights, named as ``transformers`` names them) and
usually the tokenizer's files. Reading one here needs no JAX: the recipe checks
a directory (sizes, family, every tensor's name and shape, from the files'
headers, and every weight's finiteness) before anything is built, and the
weights are then read here tensor by tensor, each as its own header's dtype
(``tensor_arrays``), for ``orchestrator.engine.model`` to place on the mesh.
Every file is opened through ``orchestrator.user_files`` (regular files only,
sizes bounded before reading). ``export_tensors`` is the loader's inverse, so a
directory written by ``run_rl export`` loads back to the same weights, bit for
bit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from orchestrator.models import local_global, rope_parameters
from orchestrator.models.families import BY_MODEL_TYPE, FAMILIES, Family
from orchestrator.models.presets import ModelPreset
from orchestrator.user_files import MIB, UserFileError, open_regular, read_regular_text

CONFIG_FILE = "config.json"
#: The shard index a checkpoint saved in several files carries (its weight_map names each tensor's file).
INDEX_FILE = "model.safetensors.index.json"
#: The most read of a checkpoint's JSON files (config, tokenizer settings, shard index) and of a safetensors
#: header; a safetensors file's data is read by offset, within the file's size, so its size bounds nothing.
JSON_MAX_BYTES = 16 * MIB
HEADER_MAX_BYTES = 100 * MIB
WEIGHTS_MAX_BYTES = 1 << 50
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


def read_json(path: Path, *, what: str) -> Any:
  """The JSON in one of a checkpoint's files (``what`` names it in a refusal), read as a regular file of at
  most ``JSON_MAX_BYTES``.

  Raises:
    CheckpointDirError: the file is not a regular file within the bound (a FIFO, a device), not UTF-8, or
      not JSON.
  """
  try:
    text = read_regular_text(path, what=what, max_bytes=JSON_MAX_BYTES)
  except UserFileError as e:
    raise CheckpointDirError(str(e)) from None
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise CheckpointDirError(f"{what} {path} is not readable JSON ({e}); restore the checkpoint's copy") from None


def read_config(directory: str | Path, key: str = "model.checkpoint") -> dict[str, Any]:
  """The ``config.json`` of a checkpoint directory, checked to be of a family the engine runs.

  Raises:
    CheckpointDirError: no such directory, no or unreadable ``config.json``, or a ``model_type`` no family has.
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
  try:
    os.lstat(config_path)  # not os.path.lexists: it says False for a file it may not look at (EACCES)
  except FileNotFoundError:
    raise CheckpointDirError(f"{key}={directory}: it has no {CONFIG_FILE}; give the directory a Hugging Face"
                             " checkpoint was saved to (config.json beside its *.safetensors)") from None
  config = read_json(config_path, what=f"{key}'s {CONFIG_FILE}")
  if not isinstance(config, dict):
    raise CheckpointDirError(f"{key}: {config_path} holds a JSON {type(config).__name__}, not an object;"
                             f" restore the checkpoint's {CONFIG_FILE}")
  model_type = config.get("model_type")
  if not isinstance(model_type, str) or model_type not in BY_MODEL_TYPE:
    named = (f"model_type={model_type!r}" if model_type is not None
             else f"no model_type (architectures: {config.get('architectures')})")
    if model_type == "gemma3":
      named += " (Gemma 3 with its vision tower; the engine trains the text-only gemma3_text)"
    raise CheckpointDirError(f"{key}={directory}: its {CONFIG_FILE} names {named}; this trainer runs the"
                             f" model types {', '.join(BY_MODEL_TYPE)} (Tunix's {', '.join(FAMILIES)} models):"
                             " use a checkpoint of one of them")
  try:
    return rope_parameters.as_legacy_keys(config, f"{key} {config_path}")
  except ValueError as e:
    raise CheckpointDirError(str(e)) from None


def config_family(config: Mapping[str, Any]) -> Family:
  """The family of a ``config.json`` ``read_config`` accepted."""
  return BY_MODEL_TYPE[config["model_type"]]


#: The largest size ``config.json`` may give (larger ones are damage, and would build huge name tables).
MAX_SIZE = {"num_hidden_layers": 1024, "num_experts": 4096, "num_experts_per_tok": 4096,
            "num_attention_heads": 4096, "num_key_value_heads": 4096}
MAX_OTHER_SIZE = 1 << 24
#: The numpy dtype of each tensor dtype (safetensors' names) the loader reads; others (FP8 and its scales,
#: int8) are refused.
TENSOR_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16)}


def _int(config: Mapping[str, Any], name: str, where: str) -> int:
  value = config.get(name)
  high = MAX_SIZE.get(name, MAX_OTHER_SIZE)
  if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
    raise CheckpointDirError(f"{where}: {name}={value!r} must be a whole number in [1, {high:,}]; restore the"
                             f" checkpoint's {CONFIG_FILE}")
  return value


def context_tokens(config: Mapping[str, Any], where: str) -> int:
  """The longest sequence the model was trained for: ``config.json``'s ``max_position_embeddings``.

  Raises:
    CheckpointDirError: it is not a whole number in range.
  """
  if "max_position_embeddings" not in config:
    return BY_MODEL_TYPE[config["model_type"]].default_context_tokens
  return _int(config, "max_position_embeddings", where)


def _check_head_sizes(sizes: dict[str, int], where: str) -> None:
  """The attention sizes Tunix's models can shape their projections from (``head_dim`` defaulted in place)."""
  heads, kv_heads = sizes["num_heads"], sizes["num_kv_heads"]
  if heads % kv_heads:
    raise CheckpointDirError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads="
                             f"{kv_heads} (each key/value head serves a whole group of query heads); restore the"
                             f" checkpoint's {CONFIG_FILE}")
  if "head_dim" not in sizes:  # transformers' default
    if sizes["embed_dim"] % heads:
      raise CheckpointDirError(f"{where}: hidden_size={sizes['embed_dim']} is not a multiple of"
                               f" num_attention_heads={heads} and no head_dim is given; add head_dim or restore"
                               f" the checkpoint's {CONFIG_FILE}")
    sizes["head_dim"] = sizes["embed_dim"] // heads
  if sizes["head_dim"] % 2:
    raise CheckpointDirError(f"{where}: head_dim={sizes['head_dim']} is odd; rotary position embeddings rotate"
                             f" the two halves of each head, so it must be even: restore the checkpoint's"
                             f" {CONFIG_FILE}")


def preset_from_config(directory: str | Path, config: Mapping[str, Any]) -> ModelPreset:
  """The model preset a checkpoint's ``config.json`` describes (``checkpoint`` set to the directory).

  Raises:
    CheckpointDirError: a size missing or out of range, or a setting the family's Tunix model does not
      implement (MoE with dense layers between, unnormalised top-k routing, rotary scaling, biases, another
      rotary base than Tunix's Qwen3 runs), named with the value it does implement.
  """
  where = f"model.checkpoint {Path(directory) / CONFIG_FILE}"
  family = config_family(config)
  moe = config["model_type"] == family.moe_model_type
  # An MoE checkpoint's experts are moe_intermediate_size wide (its intermediate_size is a dense MLP's it has not).
  names = dict(SIZE_KEYS, hidden_dim="moe_intermediate_size") if moe else SIZE_KEYS
  if "head_dim" not in config:  # transformers' default: hidden_size // num_attention_heads
    names = {field: name for field, name in names.items() if field != "head_dim"}
  sizes = {field: _int(config, name, where) for field, name in names.items()
           if not field.startswith("num_experts") or moe}
  if "head_dim" not in config and config["model_type"] in family.default_head_dims:
    sizes["head_dim"] = family.default_head_dims[config["model_type"]]
  _check_head_sizes(sizes, where)
  context_tokens(config, where)
  if moe:
    if sizes["num_experts_per_tok"] > sizes["num_experts"]:
      raise CheckpointDirError(f"{where}: num_experts_per_tok={sizes['num_experts_per_tok']} is more than"
                               f" num_experts={sizes['num_experts']}; restore the checkpoint's {CONFIG_FILE}")
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
      raise CheckpointDirError(f"{where}: mlp_only_layers={config.get('mlp_only_layers')} decoder_sparse_step="
                               f"{config.get('decoder_sparse_step')}: every layer must be an MoE layer (Tunix's"
                               " Qwen3 MoE has no dense layers between); use a checkpoint without them")
    if config.get("norm_topk_prob", True) is not True:
      raise CheckpointDirError(f"{where}: norm_topk_prob={config.get('norm_topk_prob')}: Tunix's Qwen3 MoE"
                               " normalises the top-k routing weights; use a checkpoint that does")
  for name, implemented in family.unsupported.items():
    value = config.get(name, implemented)
    if isinstance(implemented, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
      raise CheckpointDirError(f"{where}: {name}={value!r} must be a number; restore the checkpoint's"
                               f" {CONFIG_FILE}")
    if value != implemented:
      raise CheckpointDirError(f"{where}: {name}={value!r}, which Tunix's {family.model_class} does not"
                               f" implement (it runs {name}={implemented!r}), so this model cannot be trained as"
                               f" it was made; use a checkpoint of a model with {name}={implemented!r}")
  tied = config.get("tie_word_embeddings", family.default_tied_embedding)
  if not isinstance(tied, bool):
    raise CheckpointDirError(f"{where}: tie_word_embeddings={tied!r} must be true or false")
  rope = config.get("rope_theta", family.default_rope_theta)
  eps = config.get("rms_norm_eps", family.default_norm_eps)
  for name, value in (("rope_theta", rope), ("rms_norm_eps", eps)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
      raise CheckpointDirError(f"{where}: {name}={value!r} must be a finite number > 0")
  if family.rope_theta(rope) != rope:
    raise CheckpointDirError(f"{where}: rope_theta={rope!r}{'' if 'rope_theta' in config else ' (the default)'},"
                             f" but Tunix's {family.model_class} rotates with rope_theta={family.fixed_rope_theta:g}"
                             " whatever its config says; use a checkpoint trained with that base")
  try:
    settings = local_global.settings_from_config(config, sizes, where) if family.local_global_attention else {}
  except ValueError as e:
    raise CheckpointDirError(str(e)) from None
  return ModelPreset(name=Path(directory).name or str(directory), **sizes, **settings, rope_theta=rope,
                     norm_eps=float(eps), use_tied_embedding=tied, family=family.name,
                     checkpoint=str(Path(directory).expanduser().absolute()))


def disagreement(preset: ModelPreset, loaded: ModelPreset) -> str | None:
  """The first size in which a named preset and a checkpoint differ (``"embed_dim: 64 vs 1024"``), else None."""
  if preset.family != loaded.family:
    return f"family={preset.family} but its {CONFIG_FILE} has model_type={loaded.family} (the {loaded.family} family)"
  for field in (*SIZE_KEYS, "use_tied_embedding"):
    mine, theirs = getattr(preset, field), getattr(loaded, field)
    if mine != theirs:
      name = SIZE_KEYS.get(field, "tie_word_embeddings")
      if field == "hidden_dim" and loaded.is_moe:
        name = "moe_intermediate_size"
      return f"{field}={mine} but its {CONFIG_FILE} has {name}={theirs}"
  if FAMILIES[loaded.family].local_global_attention:
    mine, theirs = local_global.settings(preset), local_global.settings(loaded)
    for field in mine:
      if mine[field] != theirs[field]:
        return f"{field}={mine[field]} but its {CONFIG_FILE} has {local_global.CONFIG_KEYS[field]}={theirs[field]}"
  return None


#: The settings of a model's forward pass beyond its sizes, by preset field → config.json key: the KL reference
#: runs with the trained model's (``reference_differences``).
FORWARD_SETTINGS = {"norm_eps": "rms_norm_eps", "rope_theta": "rope_theta"}


def reference_differences(trained: ModelPreset, reference: ModelPreset) -> list[str]:
  """Each setting in which a KL reference's checkpoint (``reference``) would run otherwise than the trained model
  (the reference's forward pass is the trained model's program with the reference's weights): its
  ``FORWARD_SETTINGS``, in words; [] when none (sizes and family: ``disagreement``; the context: the recipe
  bounds the rows by both models')."""
  return [f"{key}={getattr(reference, field)!r} (the trained model's {getattr(trained, field)!r})"
          for field, key in FORWARD_SETTINGS.items() if getattr(reference, field) != getattr(trained, field)]


def expected_tensors(preset: ModelPreset) -> dict[str, tuple[int, ...]]:
  """Every tensor a Hugging Face checkpoint of ``preset``'s family and sizes holds, by name, with its shape."""
  d, v, n, k, h = preset.embed_dim, preset.vocab_size, preset.num_heads, preset.num_kv_heads, preset.head_dim
  f = preset.hidden_dim
  family = FAMILIES[preset.family]
  out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
  if not preset.use_tied_embedding:
    out["lm_head.weight"] = (v, d)
  for layer in range(preset.num_layers):
    p = f"model.layers.{layer}."
    out.update({p + "self_attn.q_proj.weight": (n * h, d), p + "self_attn.k_proj.weight": (k * h, d),
                p + "self_attn.v_proj.weight": (k * h, d), p + "self_attn.o_proj.weight": (d, n * h),
                p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
    if family.qk_norm:
      out.update({p + "self_attn.q_norm.weight": (h,), p + "self_attn.k_norm.weight": (h,)})
    if family.sandwich_norms:
      out.update({p + "pre_feedforward_layernorm.weight": (d,), p + "post_feedforward_layernorm.weight": (d,)})
    if family.qkv_bias:
      out.update({p + "self_attn.q_proj.bias": (n * h,), p + "self_attn.k_proj.bias": (k * h,),
                  p + "self_attn.v_proj.bias": (k * h,)})
    if preset.is_moe:
      out[p + "mlp.gate.weight"] = (preset.num_experts, d)
      for e in range(preset.num_experts):
        out.update({p + f"mlp.experts.{e}.gate_proj.weight": (f, d), p + f"mlp.experts.{e}.up_proj.weight": (f, d),
                    p + f"mlp.experts.{e}.down_proj.weight": (d, f)})
    else:
      out.update({p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                  p + "mlp.down_proj.weight": (d, f)})
  return out


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One tensor of a checkpoint, as its file's header describes it."""

  name: str
  file: Path
  dtype: str  # safetensors' name: F32, BF16, F16
  shape: tuple[int, ...]
  begin_bytes: int  # from the start of the file
  end_bytes: int


SAFETENSORS_FILE = "model.checkpoint's safetensors file"


def _damaged(file: Path, why: str) -> CheckpointDirError:
  return CheckpointDirError(f"model.checkpoint: {file} is not a readable safetensors file ({why}); restore it")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  """A JSON object whose keys are unique (``json`` would keep the last of two silently)."""
  out = dict(pairs)
  if len(out) != len(pairs):
    twice = next(key for i, (key, _) in enumerate(pairs) if key in dict(pairs[:i]))
    raise ValueError(f"it names tensor {twice} twice")
  return out


def _read_header(file: Path) -> tuple[dict[str, Any], int, int]:
  """A safetensors file's header (at most ``HEADER_MAX_BYTES``), where its data starts and the file's size."""
  with open_regular(file, what=SAFETENSORS_FILE, max_bytes=WEIGHTS_MAX_BYTES) as (f, size_bytes):
    prefix = f.read(8)
    if len(prefix) < 8:
      raise _damaged(file, f"it is {size_bytes} bytes, shorter than a header's length")
    length = int.from_bytes(prefix, "little")
    if length > size_bytes - 8:
      raise _damaged(file, f"its header claims {length:,} bytes but {size_bytes - 8:,} follow: it is truncated")
    if length > HEADER_MAX_BYTES:
      raise _damaged(file, f"its header is {length:,} bytes, over the {HEADER_MAX_BYTES:,} read for one")
    raw = f.read(length)
  try:
    header = json.loads(raw, object_pairs_hook=_unique_keys)
  except ValueError as e:  # not UTF-8, not JSON, or a name twice
    raise _damaged(file, f"its header is not one JSON object of tensors: {e}") from None
  if not isinstance(header, dict):
    raise _damaged(file, "its header is not a JSON object")
  return header, 8 + length, size_bytes


def _whole(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor(file: Path, name: str, entry: Any, data_start: int) -> Tensor:
  entry = entry if isinstance(entry, dict) else {}
  dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
  if not (isinstance(shape, list) and all(map(_whole, shape)) and isinstance(offsets, list) and len(offsets) == 2
          and all(map(_whole, offsets)) and offsets[0] <= offsets[1]):
    raise _damaged(file, f"tensor {name} has no valid shape and data_offsets in its header")
  if dtype not in TENSOR_DTYPES:
    raise CheckpointDirError(f"model.checkpoint: tensor {name} in {file} is {dtype}; the loader reads"
                             f" {', '.join(TENSOR_DTYPES)} weights (not quantised ones): convert the checkpoint to"
                             " one of those")
  size_bytes = math.prod(shape) * TENSOR_DTYPES[dtype].itemsize
  if offsets[1] - offsets[0] != size_bytes:
    raise _damaged(file, f"tensor {name}, {dtype} of shape {shape}, is {size_bytes:,} bytes but its header gives"
                         f" it {offsets[1] - offsets[0]:,}")
  return Tensor(name, file, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _file_tensors(file: Path) -> list[Tensor]:
  """The tensors of one safetensors file, each within the file and none overlapping another."""
  header, data_start, size_bytes = _read_header(file)
  tensors = [_tensor(file, name, entry, data_start) for name, entry in header.items() if name != "__metadata__"]
  end_bytes, last = data_start, None
  for tensor in sorted(tensors, key=lambda t: (t.begin_bytes, t.end_bytes)):
    if tensor.begin_bytes < end_bytes:
      raise _damaged(file, f"tensors {last} and {tensor.name} overlap")
    end_bytes, last = tensor.end_bytes, tensor.name
  if end_bytes > size_bytes:
    raise _damaged(file, f"tensor {last} ends at byte {end_bytes:,}, past the file's {size_bytes:,}: it is"
                         " truncated")
  return tensors


def checkpoint_tensors(directory: str | Path) -> dict[str, Tensor]:
  """Every tensor in the directory's ``*.safetensors`` files, by name, from their headers only.

  Raises:
    CheckpointDirError: no ``*.safetensors`` file; one that is not a regular, readable safetensors file; a
      tensor of a dtype the loader does not read; a name in two files (which to load would be a guess); a
      ``model.safetensors.index.json`` that places a tensor elsewhere.
  """
  directory = Path(directory).expanduser()
  files = sorted(directory.glob("*.safetensors"))
  if not files:
    raise CheckpointDirError(f"model.checkpoint={directory}: it has no *.safetensors file; give the directory"
                             " holding the checkpoint's weights")
  tensors: dict[str, Tensor] = {}
  for file in files:
    try:
      found = _file_tensors(file)
    except UserFileError as e:
      raise CheckpointDirError(str(e)) from None
    for tensor in found:
      if tensor.name in tensors:
        raise CheckpointDirError(f"model.checkpoint={directory}: tensor {tensor.name} is in both"
                                 f" {tensors[tensor.name].file.name} and {file.name}, so which to load is a guess;"
                                 " remove the file that does not belong")
      tensors[tensor.name] = tensor
  _check_index(directory, tensors)
  return tensors


def _check_index(directory: Path, tensors: Mapping[str, Tensor]) -> None:
  """A shard index, when there is one, places every tensor in the file that holds it, and no other."""
  path = directory / INDEX_FILE
  if not os.path.lexists(path):
    return
  index = read_json(path, what=f"model.checkpoint's {INDEX_FILE}")
  weight_map = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
    raise CheckpointDirError(f"model.checkpoint: {path} has no weight_map of tensor names to files; restore it")
  for name, tensor in tensors.items():
    listed = weight_map.get(name)
    if listed != tensor.file.name:
      says = f"places it in {listed}" if listed else "does not list it"
      raise CheckpointDirError(f"model.checkpoint={directory}: tensor {name} is in {tensor.file.name} but"
                               f" {INDEX_FILE} {says}; the files and the index are from different saves: restore"
                               " the checkpoint")
  unheld = [name for name in weight_map if name not in tensors]
  if unheld:
    raise CheckpointDirError(f"model.checkpoint={directory}: {INDEX_FILE} places {len(unheld)} tensor(s) in files"
                             f" that do not hold them (first: {unheld[0]} in {weight_map[unheld[0]]}); a shard is"
                             " missing or stale: restore the checkpoint")


def check_tensors(directory: str | Path, preset: ModelPreset) -> dict[str, Tensor]:
  """Exactly the tensors ``preset`` needs are in the directory, each with its shape; returns them.

  Raises:
    CheckpointDirError: a tensor missing (named, with how many are), one the model has no place for (a
      layer more than ``config.json`` gives: loading would drop it), or one of another shape.
  """
  found = checkpoint_tensors(directory)
  wanted = expected_tensors(preset)
  missing = [name for name in wanted if name not in found]
  if missing:
    raise CheckpointDirError(f"model.checkpoint={directory}: {len(missing)} of the model's {len(wanted)} tensors"
                             f" are missing from its *.safetensors (first: {missing[0]}); the files do not match"
                             f" its {CONFIG_FILE}: restore the checkpoint")
  unexpected = [name for name in found if name not in wanted]
  if unexpected:
    named = ", ".join(unexpected[:3]) + (f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else "")
    raise CheckpointDirError(f"model.checkpoint={directory}: {len(unexpected)} tensor(s) in its *.safetensors are"
                             f" not the model's ({named}, in {found[unexpected[0]].file.name}); the files do not"
                             f" match its {CONFIG_FILE} ({preset.num_layers} layers): restore the checkpoint")
  for name, shape in wanted.items():
    if found[name].shape != shape:
      raise CheckpointDirError(f"model.checkpoint={directory}: tensor {name} has shape {list(found[name].shape)}"
                               f" but {CONFIG_FILE}'s sizes need {list(shape)}; restore the checkpoint")
  return found


def tensor_arrays(tensors: Mapping[str, Tensor]) -> Iterator[tuple[Tensor, np.ndarray]]:
  """Each tensor's values as its own header's dtype: read-only views of its file, mapped into memory (so
  only the pages read are resident), file by file.

  Raises:
    CheckpointDirError: a file is no longer a regular file, or is shorter than its header says.
  """
  by_file: dict[Path, list[Tensor]] = {}
  for tensor in tensors.values():
    by_file.setdefault(tensor.file, []).append(tensor)
  for file, group in by_file.items():
    try:
      with open_regular(file, what=SAFETENSORS_FILE, max_bytes=WEIGHTS_MAX_BYTES) as (f, size_bytes):
        if size_bytes < max(tensor.end_bytes for tensor in group):
          raise _damaged(file, "it is shorter than its header says: it changed since it was checked")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except UserFileError as e:
      raise CheckpointDirError(str(e)) from None
    for tensor in sorted(group, key=lambda t: t.begin_bytes):
      values = np.frombuffer(mapped, TENSOR_DTYPES[tensor.dtype], count=math.prod(tensor.shape),
                             offset=tensor.begin_bytes)
      yield tensor, values.reshape(tensor.shape)


#: How many values a finiteness check looks at at once (its mask is a byte each).
FINITE_CHUNK_VALUES = 1 << 24


def check_finite(tensors: Mapping[str, Tensor]) -> None:
  """Every weight is a finite number: a NaN or an infinity would make the first step's loss non-finite.

  Raises:
    CheckpointDirError: naming the first tensor holding one, its file and how many it holds.
  """
  for tensor, values in tensor_arrays(tensors):
    chunks = [values.reshape(-1)[i:i + FINITE_CHUNK_VALUES] for i in range(0, values.size, FINITE_CHUNK_VALUES)]
    bad = sum(chunk.size - int(np.count_nonzero(np.isfinite(chunk))) for chunk in chunks)
    if bad:
      raise CheckpointDirError(f"model.checkpoint: tensor {tensor.name} in {tensor.file} holds {bad:,} NaN or"
                               f" infinite value(s) of {values.size:,}; a model cannot train from it: restore the"
                               " checkpoint")


def load_preset_from_checkpoint(directory: str | Path) -> ModelPreset:
  """``config.json``'s preset, with every tensor checked against it: names, shapes and dtypes from the
  headers, then every weight read once to check it is finite (nothing is built)."""
  preset = preset_from_config(directory, read_config(directory))
  check_finite(check_tensors(directory, preset))
  return preset


# ------------------------------------------------------------------ writing
_LAYER = re.compile(r"layers\.(\d+)\.(.*)")


def export_tensors(params: Mapping[str, Any], preset: ModelPreset) -> dict[str, np.ndarray]:
  """The Hugging Face tensors of a model's params (the nested dict ``nnx.to_pure_dict`` gives, on the host).

  The inverse of Tunix's key mappings (one layout for every family, the
  tensors a family lacks never arising): projections are transposed back to
  ``(out, in)`` and attention heads flattened, MoE experts unstacked.

  Raises:
    ValueError: a param this mapping does not know (the model is not one of ``preset``'s family and sizes).
  """
  flat = _flatten(params)
  d = preset.embed_dim
  out: dict[str, np.ndarray] = {}
  for key, value in flat.items():
    x = np.asarray(value)
    if key == "embedder.input_embedding":
      out["model.embed_tokens.weight"] = x
    elif key in ("final_norm.w", "final_norm.scale"):
      out["model.norm.weight"] = x
    elif key == "lm_head.w":
      out["lm_head.weight"] = x.T
    elif match := _LAYER.fullmatch(key):
      out.update(_layer_tensors(f"model.layers.{match[1]}.", match[2], x, d))
    else:
      raise ValueError(f"export: param {key} is not a {preset.family} weight")
  wanted = expected_tensors(preset)
  if set(out) != set(wanted):
    odd = sorted(set(out) ^ set(wanted))
    raise ValueError(f"export: the params give {len(out)} tensors where a {preset.family} checkpoint of these"
                     f" sizes has {len(wanted)} (first difference: {odd[0]})")
  return {name: np.ascontiguousarray(x) for name, x in out.items()}


#: Tunix's Gemma3 names of a layer's norms, with Hugging Face's.
_GEMMA_NORMS = {"pre_attention_norm.scale": "input_layernorm.weight",
                "post_attention_norm.scale": "post_attention_layernorm.weight",
                "pre_ffw_norm.scale": "pre_feedforward_layernorm.weight",
                "post_ffw_norm.scale": "post_feedforward_layernorm.weight",
                "attn._query_norm.scale": "self_attn.q_norm.weight", "attn._key_norm.scale": "self_attn.k_norm.weight"}


def _heads_to_rows(x: np.ndarray) -> np.ndarray:
  """A Gemma3 projection ``(heads, d, head_dim)`` as Hugging Face's ``(heads*head_dim, d)``."""
  return x.transpose(0, 2, 1).reshape(-1, x.shape[1])


def _layer_tensors(prefix: str, key: str, x: np.ndarray, d: int) -> dict[str, np.ndarray]:
  if key in _GEMMA_NORMS:
    return {prefix + _GEMMA_NORMS[key]: x}
  if key == "attn.q_einsum.w":
    return {prefix + "self_attn.q_proj.weight": _heads_to_rows(x)}
  if key in ("attn.kv_einsum.w", "attn.qkv_einsum.w"):  # (2 or 3, heads, d, head_dim): k, v (q, k, v) stacked
    names = ("k", "v") if key == "attn.kv_einsum.w" else ("q", "k", "v")
    return {prefix + f"self_attn.{name}_proj.weight": _heads_to_rows(part) for name, part in zip(names, x)}
  if key == "attn.attn_vec_einsum.w":  # (heads, head_dim, d) -> (d, heads*head_dim)
    return {prefix + "self_attn.o_proj.weight": x.reshape(-1, d).T}
  if key in ("attn.q_proj.w", "attn.k_proj.w", "attn.v_proj.w"):  # (d, heads, head_dim) -> (heads*head_dim, d)
    return {prefix + f"self_attn.{key.split('.')[1]}.weight": x.reshape(d, -1).T}
  if key == "attn.o_proj.w":  # (heads, head_dim, d) -> (d, heads*head_dim)
    return {prefix + "self_attn.o_proj.weight": x.reshape(-1, d).T}
  if key in ("attn.q_norm.w", "attn.k_norm.w"):
    return {prefix + f"self_attn.{key.split('.')[1]}.weight": x}
  if key in ("attn.q_bias", "attn.k_bias", "attn.v_bias"):  # (heads*head_dim,), as Hugging Face's
    return {prefix + f"self_attn.{key.split('.')[1][0]}_proj.bias": x}
  if key in ("input_layernorm.w", "post_attention_layernorm.w"):
    return {prefix + key.replace(".w", ".weight"): x}
  if key in ("mlp.gate_proj.kernel", "mlp.up_proj.kernel", "mlp.down_proj.kernel"):
    return {prefix + key.replace(".kernel", ".weight"): x.T}
  if key == "mlp.router.kernel":
    return {prefix + "mlp.gate.weight": x.T}
  if key in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):  # stacked experts (e, in, out)
    name = key.split(".")[1]
    return {prefix + f"mlp.experts.{e}.{name}.weight": x[e].T for e in range(x.shape[0])}
  raise ValueError(f"export: param {prefix}{key} is not a weight of a family the engine runs")


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
  """A ``config.json`` for ``preset``'s family and sizes: the source checkpoint's (``base``) with the sizes and
  dtype set, or a new one for a preset's model. Its ``rope_theta`` is the base the model computed with."""
  config = dict(base or {})
  config.pop("dtype", None)  # newer transformers' name for torch_dtype: the weights written are float32
  config.pop(rope_parameters.KEY, None)  # written as the older keys below, which transformers 5 reads too
  moe = preset.is_moe
  family = FAMILIES[preset.family]
  model_type = family.model_type(moe)
  config.update(model_type=model_type, architectures=[family.model_types[model_type]], torch_dtype="float32",
                rope_theta=family.rope_theta(preset.rope_theta), rms_norm_eps=preset.norm_eps,
                tie_word_embeddings=preset.use_tied_embedding)
  for field, name in SIZE_KEYS.items():
    if field.startswith("num_experts") and not moe or field == "hidden_dim" and moe:
      continue
    config[name] = getattr(preset, field)
  if family.local_global_attention:
    config.update(local_global.config_entries(preset))
  if moe:
    config["moe_intermediate_size"] = preset.hidden_dim
    config.setdefault("decoder_sparse_step", 1)
    config.setdefault("mlp_only_layers", [])
    config.setdefault("norm_topk_prob", True)
  return config


def preset_sizes(preset: ModelPreset) -> dict[str, Any]:
  """The preset's fields that describe the model (for messages and the saved run)."""
  return {k: v for k, v in dataclasses.asdict(preset).items() if k not in ("rows", "tokens_per_row")}

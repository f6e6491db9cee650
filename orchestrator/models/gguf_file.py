"""A GGUF file read as a Hugging Face checkpoint: its config, its weights dequantized to float32, its tokenizer.

GGUF is llama.cpp's single-file format: metadata (the architecture's sizes,
the tokenizer's vocabulary, merges, special ids and chat template) and
tensors, most of them quantised in blocks. ``GGUFCheckpoint`` reads one
through the ``gguf`` package and checks everything the import needs before
anything is written: the architecture is one a family here runs
(``families.FAMILIES``), every tensor has a Hugging Face name and a type
``gguf`` can dequantize (one row of each type is dequantized to find out), the
tokenizer is a byte-level BPE whose pre-tokenizer is known, and the
resulting ``config.json`` and tensors pass the same check a checkpoint
directory gets (``hf_checkpoint.preset_from_config`` and the tensors' shapes).

llama.cpp stores a Llama's query and key rows permuted for its interleaved
rotary layout (pairs of neighbouring features); Hugging Face's Llama rotates
the two halves of each head, so the import puts the rows back
(``unpermute_rotary_rows``). Qwen2 and Qwen3 files are stored unpermuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf  # the optional gguf extra: this module is imported only where a GGUF file is read
import numpy as np

from orchestrator.models import gguf_tokenizer, hf_checkpoint
from orchestrator.models.families import FAMILIES
from orchestrator.models.presets import ModelPreset

GGUF_MAGIC = b"GGUF"
#: GGUF's ``general.architecture`` of each family the import reads, with its config.json ``model_type``.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
#: Architectures whose query/key rows llama.cpp's converter permuted.
PERMUTED_ROTARY = {"llama"}
#: GGUF tensor names (per layer after ``blk.N.``) and the Hugging Face names they become.
TOP_LEVEL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
               "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
               "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
               "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
               "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
               "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
class GGUFError(ValueError):
  """A GGUF file the import cannot turn into a checkpoint; the message names the file, the value and the fix."""


def unpermute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's row order of a query or key projection (or its bias): within each head, llama.cpp
  interleaves the two rotary halves (row 2i is the first half's i-th, row 2i+1 the second's); Hugging Face
  keeps the halves in order."""
  rows = weight.shape[0]
  return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def numpy_shape(tensor) -> tuple[int, ...]:
  """A GGUF tensor's shape in numpy's (row-major) order: GGUF lists its dimensions innermost first."""
  return tuple(int(n) for n in reversed(tensor.shape))


class GGUFCheckpoint:
  """One GGUF file, checked to import: ``config``, ``tensors()``, ``tokenizer_files()``.

  Raises (from the constructor):
    GGUFError: not a GGUF file, truncated or damaged, another architecture, a tensor without a Hugging Face
      name or of a type ``gguf`` cannot dequantize, a tokenizer the import cannot rebuild, or sizes the family's
      model cannot take.
  """

  def __init__(self, path: str | Path):
    self.path = Path(path)
    self._check_magic()
    try:
      self._reader = gguf.GGUFReader(str(self.path))
    except Exception as e:  # a damaged file fails inside numpy's memory map or the parser, any way it may
      raise GGUFError(f"{self.path} is not a readable GGUF file ({type(e).__name__}: {str(e)[:200]}); it is"
                      " truncated or damaged: download or copy it again") from None
    self.architecture = self._string("general.architecture")
    if self.architecture not in ARCHITECTURES:
      other = (" (a Gemma 3 GGUF holds a SentencePiece vocabulary, which the import does not rebuild: train its"
               " Hugging Face directory with model.checkpoint=DIR)" if self.architecture.startswith("gemma") else "")
      raise GGUFError(f"{self.path}: general.architecture={self.architecture!r}; the import reads"
                      f" {', '.join(ARCHITECTURES)} models{other}: use a GGUF of one")
    self.family = FAMILIES[ARCHITECTURES[self.architecture]]
    self._names = self._hf_names()
    self._check_types()
    self.config = self._config()
    self.preset = self._check_against_family()
    #: tokenizer.json, tokenizer_config.json and generation_config.json, as text (built here, so a vocabulary
    #: the import cannot rebuild is refused before anything is written).
    try:
      self.tokenizer_files = gguf_tokenizer.tokenizer_files(self.path, self._value, self.config)
    except gguf_tokenizer.GGUFTokenizerError as e:
      raise GGUFError(str(e)) from None

  # ------------------------------------------------------------------ metadata
  def _check_magic(self) -> None:
    try:
      with open(self.path, "rb") as f:
        magic = f.read(4)
    except OSError as e:
      raise GGUFError(f"{self.path} cannot be read ({e.strerror or e}); give a GGUF file you can read") from None
    if magic != GGUF_MAGIC:
      raise GGUFError(f"{self.path} is not a GGUF file (it starts {magic!r}, not {GGUF_MAGIC!r}); give a .gguf"
                      " model file")

  def _value(self, key: str, default: Any = None) -> Any:
    field = self._reader.fields.get(key)
    return default if field is None else field.contents()

  def _string(self, key: str) -> str:
    value = self._value(key)
    if not isinstance(value, str):
      raise GGUFError(f"{self.path}: metadata {key} is {value!r}, not a string; the file is damaged or not a model")
    return value

  def _size(self, name: str, default: Any = None) -> int:
    value = self._value(f"{self.architecture}.{name}", default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise GGUFError(f"{self.path}: metadata {self.architecture}.{name}={value!r} must be a whole number ≥ 1;"
                      " the file is damaged")
    return value

  def _hf_names(self) -> dict[str, str]:
    names = {}
    for tensor in self._reader.tensors:
      match = _LAYER.fullmatch(tensor.name)
      hf = (f"model.layers.{match[1]}.{LAYER_NAMES[match[2]]}" if match and match[2] in LAYER_NAMES
            else TOP_LEVEL_NAMES.get(tensor.name))
      if hf is None:
        why = (" (llama.cpp's rotary frequency factors: a scaled rotary embedding, which Tunix's model does not"
               " implement)" if tensor.name == "rope_freqs.weight" else "")
        raise GGUFError(f"{self.path}: tensor {tensor.name}{why} has no place in a {self.family.name} checkpoint;"
                        " the import reads Llama, Qwen2 and Qwen3 files: use one without it")
      names[tensor.name] = hf
    return names

  def _check_types(self) -> None:
    """Every tensor's type dequantizes: one row of a tensor of each type is tried before anything is written."""
    types = gguf.GGMLQuantizationType
    tried = set()
    for tensor in self._reader.tensors:
      if tensor.tensor_type in tried:
        continue
      tried.add(tensor.tensor_type)
      if tensor.tensor_type in (types.I8, types.I16, types.I32, types.I64):
        raise GGUFError(f"{self.path}: tensor {tensor.name} holds integers ({tensor.tensor_type.name}), not"
                        " weights; use a GGUF of float or quantised weights")
      try:
        gguf.quants.dequantize(np.asarray(tensor.data).reshape(-1, tensor.data.shape[-1])[:1],
                                     tensor.tensor_type)
      except NotImplementedError:
        raise GGUFError(f"{self.path}: tensor {tensor.name} is {tensor.tensor_type.name}, a quantisation the gguf"
                        f" package cannot dequantize; use a GGUF quantised otherwise (Q8_0, Q4_K_M, F16 ...)"
                        ) from None

  def _config(self) -> dict[str, Any]:
    heads = self._size("attention.head_count")
    width = self._size("embedding_length")
    scaling = self._value(f"{self.architecture}.rope.scaling.type")
    if scaling not in (None, "none"):
      raise GGUFError(f"{self.path}: {self.architecture}.rope.scaling.type={scaling!r}; Tunix's"
                      f" {self.family.model_class} implements no rotary scaling: use a GGUF without it")
    head_dim = self._size("attention.key_length", self._value(f"{self.architecture}.rope.dimension_count",
                                                              width // heads))
    model_type = ARCHITECTURES[self.architecture]
    eos = self._value("tokenizer.ggml.eos_token_id")
    config = {
        "model_type": model_type, "architectures": [self.family.model_types[model_type]],
        "num_hidden_layers": self._size("block_count"), "hidden_size": width,
        "intermediate_size": self._size("feed_forward_length"), "num_attention_heads": heads,
        "num_key_value_heads": self._size("attention.head_count_kv", heads), "head_dim": head_dim,
        "vocab_size": len(self._value("tokenizer.ggml.tokens") or []) or self._size("vocab_size"),
        "max_position_embeddings": self._size("context_length"),
        "rope_theta": float(self._value(f"{self.architecture}.rope.freq_base", self.family.default_rope_theta)),
        # float32 in the file: its shortest decimal (1e-05, not 9.999999747378752e-06)
        "rms_norm_eps": float(str(np.float32(self._value(f"{self.architecture}.attention.layer_norm_rms_epsilon",
                                                         self.family.default_norm_eps)))),
        "tie_word_embeddings": "output.weight" not in self._names, "hidden_act": "silu",
        "torch_dtype": "float32", "bos_token_id": self._value("tokenizer.ggml.bos_token_id"), "eos_token_id": eos,
    }
    return config

  def _check_against_family(self) -> ModelPreset:
    try:
      preset = hf_checkpoint.preset_from_config(self.path.stem, self.config)
    except hf_checkpoint.CheckpointDirError as e:
      raise GGUFError(f"{self.path}: its metadata gives a model the trainer cannot run: {e}") from None
    wanted = hf_checkpoint.expected_tensors(preset)
    shapes = {self._names[t.name]: numpy_shape(t) for t in self._reader.tensors}
    if "model.embed_tokens.weight" in shapes and self.config["vocab_size"] != shapes["model.embed_tokens.weight"][0]:
      raise GGUFError(f"{self.path}: the tokenizer has {self.config['vocab_size']} tokens but token_embd.weight"
                      f" has {shapes['model.embed_tokens.weight'][0]} rows; the file is damaged")
    for name in sorted(set(wanted) | set(shapes)):
      if shapes.get(name) != wanted.get(name):
        gguf_name = next((g for g, h in self._names.items() if h == name), name)
        raise GGUFError(f"{self.path}: tensor {gguf_name} ({name}) is {list(shapes[name]) if name in shapes else 'missing'}"
                        f" where the metadata's sizes need {list(wanted[name]) if name in wanted else 'none'};"
                        " the file is damaged or of a variant the trainer does not run")
    return preset

  # ------------------------------------------------------------------ what the import writes
  def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
    """Each tensor as float32 under its Hugging Face name, query/key rows in Hugging Face's order."""
    permuted = self.architecture in PERMUTED_ROTARY
    for tensor in self._reader.tensors:
      name = self._names[tensor.name]
      shape = numpy_shape(tensor)
      values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
      values = np.asarray(values, np.float32).reshape(shape)
      if permuted and ".self_attn.q_proj." in name:
        values = unpermute_rotary_rows(values, self.config["num_attention_heads"])
      elif permuted and ".self_attn.k_proj." in name:
        values = unpermute_rotary_rows(values, self.config["num_key_value_heads"])
      yield name, np.ascontiguousarray(values)

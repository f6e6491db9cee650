"""Small GGUF files for the import's tests, written with the ``gguf`` package as llama.cpp's converter lays them
out: Hugging Face tensors renamed, a Llama's query/key rows permuted for llama.cpp's interleaved rotary layout,
a byte-level BPE vocabulary in the metadata."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from orchestrator.models.gguf_file import LAYER_NAMES, TOP_LEVEL_NAMES

#: A tiny byte-level BPE vocabulary: every printable ASCII character in GPT-2's byte alphabet (a space is Ġ),
#: a few merges, and the chat tokens as control tokens.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n"]


def _vocab() -> list[str]:
  characters = ["Ġ" if c == " " else c for c in map(chr, range(32, 127))] + ["Ċ"]
  merged = [m.replace(" ", "") for m in MERGES]
  return SPECIALS + characters + merged


def permute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's converter's row order for a query or key projection (within each head, the two rotary
  halves interleaved): written here independently of the import's inverse."""
  rows = weight.shape[0]
  halves = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
  return halves.swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path: Path, tensors: dict[str, np.ndarray], config: dict, *, architecture: str = "llama",
               permute: bool = True, quantization: gguf.GGMLQuantizationType | None = None) -> Path:
  """``tensors`` (Hugging Face names) and ``config`` (a config.json's sizes) as a GGUF file at ``path``."""
  writer = gguf.GGUFWriter(str(path), architecture)
  writer.add_block_count(config["num_hidden_layers"])
  writer.add_context_length(config.get("max_position_embeddings", 2048))
  writer.add_embedding_length(config["hidden_size"])
  writer.add_feed_forward_length(config["intermediate_size"])
  writer.add_head_count(config["num_attention_heads"])
  writer.add_head_count_kv(config["num_key_value_heads"])
  writer.add_rope_freq_base(config["rope_theta"])
  writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
  writer.add_key_length(config["head_dim"])
  vocab = _vocab()
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("smollm")
  writer.add_token_list(vocab)
  writer.add_token_types([3 if t in SPECIALS else 1 for t in vocab])
  writer.add_token_merges(MERGES)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_add_bos_token(False)
  writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
  to_gguf = {hf: g for g, hf in TOP_LEVEL_NAMES.items()}
  for name, value in tensors.items():
    value = np.asarray(value, np.float32)
    if name.startswith("model.layers."):
      layer, rest = name[len("model.layers."):].split(".", 1)
      gguf_name = f"blk.{layer}." + next(g for g, hf in LAYER_NAMES.items() if hf == rest)
      if permute and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
        heads = config["num_attention_heads" if "q_proj" in rest else "num_key_value_heads"]
        value = permute_rotary_rows(value, heads)
    else:
      gguf_name = to_gguf[name]
    if quantization is not None and value.ndim == 2:
      writer.add_tensor(gguf_name, gguf.quants.quantize(value, quantization), raw_dtype=quantization)
    else:
      writer.add_tensor(gguf_name, value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path

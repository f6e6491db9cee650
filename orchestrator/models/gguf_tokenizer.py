"""A GGUF file's byte-level BPE vocabulary rebuilt as Hugging Face tokenizer files, through ``tokenizers``.

GGUF keeps a BPE tokenizer as metadata: ``tokenizer.ggml.tokens`` (every
token's text, by id, in GPT-2's byte-to-unicode alphabet), ``.merges`` (by
rank), ``.token_type`` (control tokens are the special ones), ``.pre`` (which
pre-tokenizer splits text before BPE), the special ids and the chat template.
These are the same pieces a ``tokenizer.json`` holds; a SentencePiece
vocabulary (``tokenizer.ggml.model`` = ``llama``) is not rebuilt here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

#: Each byte-level BPE pre-tokenizer (``tokenizer.ggml.pre``) rebuilt: whether digits are split one by one
#: first, and the split pattern, as llama.cpp pre-tokenizes for that name.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS = {
    "gpt2": (False, _GPT2_PATTERN),
    "default": (False, _GPT2_PATTERN),
    "smollm": (True, _GPT2_PATTERN),
    "qwen2": (False, r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "llama-bpe": (False, r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                         r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
#: GGUF token types (llama.cpp's): control tokens are special; user-defined ones are added, not special.
CONTROL_TOKEN, USER_DEFINED_TOKEN = 3, 4


class GGUFTokenizerError(ValueError):
  """A GGUF vocabulary this module cannot rebuild; the message names the file, the value and the fix."""


def build_tokenizer(tokens: list[str], merges: list[str], token_types: list[int], pre: str,
                    where: Path) -> Tokenizer:
  """The ``tokenizers`` BPE the metadata describes.

  Raises:
    GGUFTokenizerError: a token twice, a merge that is not two tokens, or an unknown pre-tokenizer.
  """
  if pre not in PRE_TOKENIZERS:
    raise GGUFTokenizerError(f"{where}: tokenizer.ggml.pre={pre!r}, a pre-tokenizer the import does not rebuild"
                             f" (it rebuilds {', '.join(PRE_TOKENIZERS)}); use a GGUF of another model")
  vocab: dict[str, int] = {}
  for token_id, text in enumerate(tokens):
    if text in vocab:
      raise GGUFTokenizerError(f"{where}: token {text!r} is in tokenizer.ggml.tokens twice (ids {vocab[text]} and"
                               f" {token_id}); the vocabulary is damaged")
    vocab[text] = token_id
  pairs = []
  for rank, merge in enumerate(merges):
    parts = merge.split(" ")
    if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab:
      raise GGUFTokenizerError(f"{where}: merge {rank} ({merge!r}) is not two tokens of the vocabulary; the"
                               " vocabulary is damaged")
    pairs.append((parts[0], parts[1]))
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
  digits, pattern = PRE_TOKENIZERS[pre]
  steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
  steps += [pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
  tokenizer.decoder = decoders.ByteLevel()
  added = [AddedToken(tokens[i], special=kind == CONTROL_TOKEN, normalized=False)
           for i, kind in enumerate(token_types) if kind in (CONTROL_TOKEN, USER_DEFINED_TOKEN)]
  tokenizer.add_tokens(added)
  return tokenizer


def _pad_token(pad: str, tokens: list[str], token_types: list[int], template: Any) -> str:
  """The file's padding token, unless its chat template writes it (SmolLM2 pads with <|im_end|>, which ends
  every message): then the first control token the template does not write. A prompt holding the pad id
  would have it masked out by Tunix's sampler but not by training, so the live loop refuses such prompts."""
  if not isinstance(template, str) or pad not in template:
    return pad
  unused = [tokens[i] for i, kind in enumerate(token_types) if kind == CONTROL_TOKEN and tokens[i] not in template]
  return unused[0] if unused else pad


def tokenizer_files(path: Path, value: Callable[[str], Any], config: dict[str, Any]) -> dict[str, str]:
  """``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` (text) from the metadata
  ``value(key)`` reads.

  Raises:
    GGUFTokenizerError: no vocabulary, a SentencePiece one, or one ``build_tokenizer`` refuses.
  """
  model = value("tokenizer.ggml.model")
  if model != "gpt2":
    raise GGUFTokenizerError(f"{path}: tokenizer.ggml.model={model!r}; the import rebuilds byte-level BPE"
                             " vocabularies (gpt2), not SentencePiece ones: use a GGUF with a BPE tokenizer")
  tokens = list(value("tokenizer.ggml.tokens") or [])
  token_types = list(value("tokenizer.ggml.token_type") or [1] * len(tokens))
  tokenizer = build_tokenizer(tokens, list(value("tokenizer.ggml.merges") or []), token_types,
                              value("tokenizer.ggml.pre") or "default", path)

  def text(key: str) -> str | None:
    token_id = value(f"tokenizer.ggml.{key}_token_id")
    if token_id is None:
      return None
    if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
      raise GGUFTokenizerError(f"{path}: tokenizer.ggml.{key}_token_id={token_id!r} is not one of the"
                               f" vocabulary's {len(tokens)} ids; the file is damaged")
    return tokens[token_id]

  if text("eos") is None:
    raise GGUFTokenizerError(f"{path}: no tokenizer.ggml.eos_token_id; a completion could never end: use a GGUF"
                             " with one")
  template = value("tokenizer.chat_template")
  settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text("bos"), "eos_token": text("eos"),
              "pad_token": _pad_token(text("padding") or text("eos"), tokens, token_types, template),
              "unk_token": text("unknown"),
              "add_bos_token": bool(value("tokenizer.ggml.add_bos_token") or False), "add_eos_token": False,
              "model_max_length": config["max_position_embeddings"], "clean_up_tokenization_spaces": False}
  if isinstance(template, str):
    settings["chat_template"] = template
  generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
  return {"tokenizer.json": tokenizer.to_str(pretty=True),
          "tokenizer_config.json": json.dumps({k: v for k, v in settings.items() if v is not None}, indent=1),
          "generation_config.json": json.dumps(generation, indent=1)}

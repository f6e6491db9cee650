"""A checkpoint's own tokenizer: ``tokenizer.json`` through ``tokenizers``, from local files only.

It has what Tunix's sampler asks of a tokenizer (``encode``, ``decode``,
``bos_id``, ``eos_id``, ``pad_id``). The special tokens come from the
checkpoint's files: ``tokenizer_config.json`` (``bos_token``, ``eos_token``,
``pad_token``), ``generation_config.json`` and ``config.json``
(``eos_token_id``, which may list several; the sampler stops at any of them).
A chat template (``tokenizer_config.json``'s ``chat_template`` or a
``chat_template.jinja`` file) is rendered the way ``transformers`` renders it:
Jinja in a sandbox, one user message, the generation prompt added; one probe
prompt is rendered when the tokenizer is made, so a template that fails, or
writes characters the vocabulary cannot encode, is refused before a run starts.
Every file is read through ``orchestrator.user_files`` (regular files only,
sizes bounded before reading).

``char_tokenizer_json`` writes the live loop's character tokenizer in this
format, so a model trained on a preset exports with a tokenizer any
``transformers`` user can load.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jinja2.sandbox
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from orchestrator.models import hf_checkpoint
from orchestrator.tasks.tokenizer import ALPHABET, BOS, EOS, PAD
from orchestrator.user_files import MIB, UserFileError, read_regular_text

TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: The most read of a ``tokenizer.json`` (large vocabularies take tens of MiB).
TOKENIZER_MAX_BYTES = 256 * MIB
#: The prompt a chat template is rendered with when the tokenizer is made (text every vocabulary encodes).
PROBE_PROMPT = "1+1="


class TokenizerError(ValueError):
  """A tokenizer that cannot be used; the message names the file, the value and the fix."""


def _read_json(path: Path) -> dict[str, Any]:
  """One of the checkpoint's JSON settings files, or {} where there is none."""
  if not os.path.lexists(path):
    return {}
  try:
    data = hf_checkpoint.read_json(path, what="model.checkpoint's")
  except hf_checkpoint.CheckpointDirError as e:
    raise TokenizerError(str(e)) from None
  if not isinstance(data, dict):
    raise TokenizerError(f"model.checkpoint: {path} holds a JSON {type(data).__name__}, not an object; restore"
                         " the checkpoint's copy")
  return data


def _read_text(path: Path, max_bytes: int) -> str:
  try:
    return read_regular_text(path, what="model.checkpoint's", max_bytes=max_bytes)
  except UserFileError as e:
    raise TokenizerError(str(e)) from None


def _one_line(error: Exception) -> str:
  """An error's text on one line (Jinja's syntax errors add the template's line below)."""
  return " ".join(str(error).split())


def _token_text(value: Any) -> str | None:
  """A special token as ``tokenizer_config.json`` gives it: a string, or ``{"content": ...}``."""
  if isinstance(value, Mapping):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


class HFTokenizer:
  """The tokenizer in a Hugging Face checkpoint directory.

  Args:
    directory: holds ``tokenizer.json`` (and optionally ``tokenizer_config.json``, ``generation_config.json``,
      ``config.json``).
    chat_template: render each prompt through the checkpoint's chat template before encoding it.

  Raises:
    TokenizerError: no ``tokenizer.json``, an unreadable one, no end-of-sequence token, a special token the
      vocabulary lacks, or ``chat_template`` asked for but none in the directory.
  """

  def __init__(self, directory: str | Path, *, chat_template: bool = False):
    self.directory = Path(directory).expanduser()
    path = self.directory / TOKENIZER_FILE
    if not os.path.lexists(path):
      raise TokenizerError(f"model.checkpoint={directory}: it has no {TOKENIZER_FILE}; the live loop samples"
                           f" text with the checkpoint's tokenizer: copy its {TOKENIZER_FILE} there")
    try:
      self._tokenizer = Tokenizer.from_str(_read_text(path, TOKENIZER_MAX_BYTES))
    except TokenizerError:
      raise
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
      raise TokenizerError(f"model.checkpoint: {path} is not a tokenizers file ({_one_line(e)}); restore it"
                           ) from None
    settings = _read_json(self.directory / "tokenizer_config.json")
    generation = _read_json(self.directory / "generation_config.json")
    model = _read_json(self.directory / "config.json")
    self._vocab_size = self._ids_the_model_takes(model.get("vocab_size"))
    self._bos = self._special_id(_token_text(settings.get("bos_token")), "bos_token")
    # add_bos_token false (SmolLM2's: its bos is <|im_start|>, which the chat template writes itself): prompts
    # get no bos of the sampler's, as transformers' tokenizer adds none
    self._add_bos = settings.get("add_bos_token", True) is not False
    self._eos = self._eos_ids(settings, {"generation_config.json": generation, "config.json": model})
    if not self._eos:
      raise TokenizerError(f"model.checkpoint={directory}: no end-of-sequence token (eos_token in"
                           " tokenizer_config.json or eos_token_id in generation_config.json); add one")
    pad = self._special_id(_token_text(settings.get("pad_token")), "pad_token")
    self._pad = pad if pad is not None else self._eos[0]
    self._template, self._template_file = None, None
    if chat_template:
      self._template, self._template_file = self._chat_template(settings)
      self._probe_template()

  def _eos_ids(self, settings: Mapping[str, Any], sources: Mapping[str, Mapping[str, Any]]) -> list[int]:
    """Every end-of-sequence id the files name: tokenizer_config.json's eos_token, then each file's
    eos_token_id (one or a list; null is none). One that is not a token id is refused, not skipped: the
    sampler would not stop at it."""
    eos = [self._special_id(_token_text(settings.get("eos_token")), "eos_token")]
    for file, source in sources.items():
      ids = source.get("eos_token_id")
      for token_id in ids if isinstance(ids, list) else [ids]:
        if token_id is not None and (isinstance(token_id, bool) or not isinstance(token_id, int)
                                     or not 0 <= token_id < self.vocab_size):
          raise TokenizerError(f"model.checkpoint={self.directory}: {file}'s eos_token_id {token_id!r} is not one"
                               f" of the tokenizer's {self.vocab_size} ids; fix {file}")
        eos.append(token_id)
    return list(dict.fromkeys(i for i in eos if i is not None))

  def _ids_the_model_takes(self, model_vocab_size: Any) -> int:
    """One more than the largest id the sampler may emit or a prompt may hold: the tokenizer's, or fewer where
    every id past ``config.json``'s ``vocab_size`` is a special token the model has no row for (Gemma 3's image
    token, 262144, past its text model's 262,144 ids), which nothing samples and no prompt may hold. A plain
    token past it is left counted, so the recipe refuses the tokenizer as too large for the model."""
    every_id = set(self._tokenizer.get_vocab(with_added_tokens=True).values())
    ids = max(every_id) + 1
    if isinstance(model_vocab_size, bool) or not isinstance(model_vocab_size, int) or ids <= model_vocab_size:
      return ids
    specials = {i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special}
    past = {i for i in every_id if i >= model_vocab_size}
    return model_vocab_size if past <= specials else ids

  def _special_id(self, text: str | None, name: str) -> int | None:
    if text is None:
      return None
    token_id = self._tokenizer.token_to_id(text)
    if token_id is None:
      raise TokenizerError(f"model.checkpoint={self.directory}: {name} {text!r} (tokenizer_config.json) is not in"
                           f" {TOKENIZER_FILE}'s vocabulary; fix tokenizer_config.json")
    if token_id >= self.vocab_size:
      raise TokenizerError(f"model.checkpoint={self.directory}: {name} {text!r} is id {token_id}, past the model's"
                           f" {self.vocab_size} ids (config.json's vocab_size); use a {name} the model has")
    return token_id

  def _chat_template(self, settings: Mapping[str, Any]) -> tuple[jinja2.Template, Path]:
    """The checkpoint's chat template, and the file it is in."""
    source, where = settings.get("chat_template"), self.directory / "tokenizer_config.json"
    if isinstance(source, list):  # several named templates: transformers uses "default"
      source = next((t.get("template") for t in source if isinstance(t, Mapping) and t.get("name") == "default"),
                    None)
    file = self.directory / CHAT_TEMPLATE_FILE
    if not isinstance(source, str) and os.path.lexists(file):
      source, where = _read_text(file, hf_checkpoint.JSON_MAX_BYTES), file
    if not isinstance(source, str):
      raise TokenizerError(f"model.chat_template=true but model.checkpoint={self.directory} has no chat template"
                           f" (tokenizer_config.json's chat_template or {CHAT_TEMPLATE_FILE}); add one or set"
                           " model.chat_template=false")
    # As transformers renders chat templates: loop controls, raise_exception and strftime_now available.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message):
      raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
      return env.from_string(source), where
    except jinja2.TemplateError as e:
      raise TokenizerError(f"model.chat_template=true: the chat template in {where} does not parse"
                           f" ({_one_line(e)}); fix it, or set model.chat_template=false") from None

  def _probe_template(self) -> None:
    """Renders one prompt, so that a template that fails on every prompt (a Jinja error, its own
    ``raise_exception``) or writes text the vocabulary cannot encode is refused now, by what it is."""
    text = self.format_prompt(PROBE_PROMPT).replace(PROBE_PROMPT, "", 1)  # the template's own text
    try:
      ids = self._tokenizer.encode(text, add_special_tokens=False).ids
    except Exception as e:  # tokenizers raises a bare Exception (a word-level vocabulary without [UNK])
      error = e
    else:
      if ids and max(ids) >= self.vocab_size:
        raise TokenizerError(f"model.chat_template=true: the chat template in {self._template_file} writes token"
                             f" id {max(ids)}, which the model's {self.vocab_size} ids do not include; fix the"
                             " template or set model.chat_template=false")
      return
    bad = next((c for c in text if not self._encodes(c)), None)
    what = f"the character {bad!r}" if bad is not None else f"text ({_one_line(error)})"
    raise TokenizerError(f"model.chat_template=true: the chat template in {self._template_file} writes {what},"
                         f" which {TOKENIZER_FILE}'s vocabulary cannot encode; fix the template or set"
                         " model.chat_template=false")

  def _encodes(self, text: str) -> bool:
    try:
      self._tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # tokenizers raises a bare Exception
      return False
    return True

  # ---------------------------------------------------------------- what the sampler asks of a tokenizer
  @property
  def vocab_size(self) -> int:
    """One more than the largest id the model takes (``_ids_the_model_takes``; ids may leave gaps: the count of
    tokens could be fewer)."""
    return self._vocab_size

  def format_prompt(self, prompt: str) -> str:
    """``prompt`` as the model sees it: through the chat template when one is used, else as is."""
    if self._template is None:
      return prompt
    try:
      return self._template.render(messages=[{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   bos_token=self._text(self._bos), eos_token=self._text(self._eos[0]))
    except Exception as e:  # a template can fail any way Jinja or its own raise_exception makes it
      raise TokenizerError(f"model.chat_template=true: the chat template in {self._template_file} fails on a"
                           f" prompt ({type(e).__name__}: {_one_line(e)}); fix the template or set"
                           " model.chat_template=false") from None

  def _text(self, token_id: int | None) -> str:
    return "" if token_id is None else self._tokenizer.id_to_token(token_id)

  def encode(self, text: str, **_) -> list[int]:
    """Ids of ``text`` (no special tokens added: the sampler adds bos itself).

    Raises:
      ValueError: the vocabulary cannot encode it (a word-level vocabulary without an unknown token).
    """
    try:
      return self._tokenizer.encode(text, add_special_tokens=False).ids
    except Exception as e:  # tokenizers raises a bare Exception (a word-level vocabulary without [UNK])
      raise ValueError(f"{text!r} cannot be encoded by model.checkpoint's {self.directory / TOKENIZER_FILE} ({e});"
                       " use text its vocabulary holds") from None

  def decode(self, ids: Iterable[int], **_) -> str:
    """The text of ``ids`` up to the first end-of-sequence token, special tokens skipped."""
    kept = []
    for i in ids:
      i = int(i)
      if i in self._eos:
        break
      kept.append(i)
    return self._tokenizer.decode(kept, skip_special_tokens=True)

  def decode_prompt(self, ids: Iterable[int]) -> str:
    """The text of a prompt's ``ids`` as the model saw it, special tokens and all (a chat template's
    end-of-message token is an eos, where ``decode`` would stop)."""
    return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

  def bos_id(self) -> int | None:
    """The id the sampler puts before each prompt: None where tokenizer_config.json says add_bos_token false."""
    return self._bos if self._add_bos else None

  def eos_id(self) -> int:
    return self._eos[0]

  @property
  def eos_ids(self) -> list[int]:
    """Every id that ends a completion."""
    return list(self._eos)

  def pad_id(self) -> int:
    return self._pad


def char_tokenizer_json(directory: str | Path, alphabet: str = ALPHABET) -> None:
  """Writes the character tokenizer (``orchestrator.tasks.tokenizer``) as ``tokenizer.json`` and
  ``tokenizer_config.json`` in ``directory``: the same ids, one per character, pad/bos/eos 0/1/2."""
  specials = {"<pad>": PAD, "<bos>": BOS, "<eos>": EOS}
  vocab = dict(specials, **{c: i + 3 for i, c in enumerate(alphabet)})
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=None))
  tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
  tokenizer.decoder = decoders.Fuse()  # characters join without spaces
  tokenizer.add_special_tokens(list(specials))
  out = Path(directory)
  tokenizer.save(str(out / TOKENIZER_FILE))
  (out / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
       "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))

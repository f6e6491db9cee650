"""A character tokenizer for the live loop's tasks: one id per character, plus pad, bos and eos.

It has what Tunix's sampler asks of a tokenizer (``encode``, ``decode``,
``bos_id``, ``eos_id``, ``pad_id``), so the sampler takes it as is. Ids stay
far below the model presets' vocabulary sizes. ``sampled_token_ids`` says which
ids a live sampler may emit, for this tokenizer or a checkpoint's (JAX-free, so
the recipe's readers and the benchmarks' settings can ask it before JAX starts).
"""

from __future__ import annotations

from collections.abc import Iterable

PAD, BOS, EOS = 0, 1, 2
#: Every character a task may use: digits, lower-case letters, and the prompts' punctuation.
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz+-=*%?:>|,. "


class CharTokenizer:
  """Maps each character of ``alphabet`` to one id (after the three specials)."""

  def __init__(self, alphabet: str = ALPHABET):
    if len(set(alphabet)) != len(alphabet):
      raise ValueError("the alphabet repeats a character")
    self.alphabet = alphabet
    self._ids = {c: i + 3 for i, c in enumerate(alphabet)}

  @property
  def vocab_size(self) -> int:
    return len(self.alphabet) + 3

  def encode(self, text: str, **_) -> list[int]:
    """Ids of ``text``'s characters (no bos/eos).

    Raises:
      ValueError: a character outside the alphabet (named, with its position).
    """
    try:
      return [self._ids[c] for c in text]
    except KeyError:
      bad = next(i for i, c in enumerate(text) if c not in self._ids)
      raise ValueError(f"character {text[bad]!r} at {bad} of {text!r} is not in the tokenizer's alphabet") from None

  def decode(self, ids: Iterable[int], **_) -> str:
    """The characters of ``ids``, stopping at the first eos; pad, bos and unknown ids are skipped."""
    out = []
    for i in ids:
      i = int(i)
      if i == EOS:
        break
      if 3 <= i < self.vocab_size:
        out.append(self.alphabet[i - 3])
    return "".join(out)

  def bos_id(self) -> int:
    return BOS

  def eos_id(self) -> int:
    return EOS

  def pad_id(self) -> int:
    return PAD


def sampled_token_ids(tokenizer, alphabet: str | None) -> list[int]:
  """The ids a live sampler may emit: the answer alphabet's, or any id the tokenizer can decode.

  With an alphabet, only the answer's characters are ever sampled: answers have a fixed length, so no eos
  is needed, and every completion has exactly ``max_generation_steps`` tokens. Without one, a checkpoint's
  vocabulary may be padded past the tokenizer's, and those ids are never sampled. Neither is the pad id
  (unless it is also an end of sequence, after which nothing counts): Tunix's sampler takes every pad id in
  the sequence for padding and hides it from the tokens decoded after it, while the trainer attends to it, so
  the sampler's log-probs of those tokens would not be the policy's. The trainer's loss takes its log-probs
  over the same ids (``orchestrator.engine.loss.SampledDistribution``).
  """
  ids = set(tokenizer.encode(alphabet)) if alphabet is not None else set(range(tokenizer.vocab_size))
  if tokenizer.pad_id() not in set(getattr(tokenizer, "eos_ids", [tokenizer.eos_id()])):
    ids.discard(tokenizer.pad_id())
  return sorted(ids)

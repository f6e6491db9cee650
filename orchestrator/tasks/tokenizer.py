"""A character tokenizer for the live loop's tasks: one id per character, plus pad, bos and eos.

It has what Tunix's sampler asks of a tokenizer (``encode``, ``decode``,
``bos_id``, ``eos_id``, ``pad_id``), so the sampler takes it as is. Ids stay
far below the model presets' vocabulary sizes.
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

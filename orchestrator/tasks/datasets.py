"""A file of one's own prompts as a task (``task.name: dataset``): JSONL or Parquet, read once, checked row by row.

``load_task`` reads ``task.path`` (chosen by its extension, its content
checked), takes each row's ``task.prompt_field`` and ``task.answer_field``,
holds out the evaluation prompts — those of ``task.eval_path``, or else about
``task.eval_fraction`` of the file's, by a hash of the prompt as the built-in
tasks do — and returns a ``DatasetTask``. Anything that would fail later (a
missing file, a row without a field, a character the tokenizer cannot encode, a
prompt too long, an empty split) raises ``DatasetError`` here, naming the file,
the row and the fix; the recipe turns it into a refusal before anything runs.

Draws are a pure function of (seed, split, index): index ``i`` of a split of
``n`` rows is position ``i % n`` of epoch ``i // n``'s shuffle of that split
(grain's ``MapDataset.shuffle``, seeded by the run's seed and the split, a new
order each epoch). A resumed run restores the step, and so the indices, and
draws exactly the prompts the first run would have.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from orchestrator.tasks.rewards import NumberTooLong, final_number, normalise
from orchestrator.tasks.tasks import Problem, _held_out
from orchestrator.tasks.tokenizer import CharTokenizer
from orchestrator.user_files import UserFileError, check_regular, read_regular_bytes

#: The repository root: a relative path that does not exist as given is read from there (as a recording's is).
REPO_ROOT = Path(__file__).resolve().parents[2]
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet", ".pq")
#: The largest prompt file (JSONL or Parquet) read: a bigger one is refused before a byte of it is read.
MAX_DATASET_BYTES = 1 << 30
#: The most tokens a prompt, or an answer, may take where ``task.max_prompt_tokens`` (``max_completion_tokens``)
#: is unset and the longest one sizes the run: the most either key may be given.
MAX_DERIVED_TOKENS = 4096
#: Rows of a Parquet file read at a time, the columns' bytes counted after each batch.
PARQUET_BATCH_ROWS = 1024


class DatasetError(ValueError):
  """A dataset file or setting that cannot be used; one line naming the key, the file, the row and the fix."""


@dataclasses.dataclass(frozen=True)
class Row:
  """One row's problem and where it is (``task.path=FILE line N``), for messages."""

  where: str
  problem: Problem


# ---------------------------------------------------------------------------- reading


def resolve_path(path: str) -> Path:
  """``path`` as given if it exists (or is absolute), else relative to the repository root."""
  given = Path(path)
  if given.exists() or given.is_absolute():
    return given
  return REPO_ROOT / given


def read_records(key: str, path: str) -> list[tuple[str, Any]]:
  """Every record of the file ``key`` (``task.path`` or ``task.eval_path``) names, each with where it is.

  Raises:
    DatasetError: the file is missing, a directory, not a regular file (a FIFO would block the read, a device
      never end it), over ``MAX_DATASET_BYTES``, neither JSONL nor Parquet, unreadable as its kind, or empty.
  """
  try:
    return _read_records(key, path)
  except UserFileError as e:  # a FIFO, a device, a socket, a file over MAX_DATASET_BYTES
    raise DatasetError(str(e)) from None
  except OSError as e:  # unreadable: permissions, a broken disk, a name too long
    raise DatasetError(f"{key}={path} cannot be read ({e.strerror or e}); give a file you can read") from None


def _read_records(key: str, path: str) -> list[tuple[str, Any]]:
  found = resolve_path(path)
  if not found.exists():
    raise DatasetError(f"{key}={path} does not exist (looked in the working directory and the repository root);"
                       " give the path of a JSONL or Parquet file of prompts")
  if found.is_dir():
    raise DatasetError(f"{key}={path} is a directory; give a JSONL ({', '.join(JSONL_SUFFIXES)}) or Parquet"
                       f" ({', '.join(PARQUET_SUFFIXES)}) file")
  suffix = found.suffix.lower()
  if suffix in JSONL_SUFFIXES:
    records = _read_jsonl(key, path, found)
  elif suffix in PARQUET_SUFFIXES:
    records = _read_parquet(key, path, found)
  else:
    raise DatasetError(f"{key}={path} is neither JSONL ({', '.join(JSONL_SUFFIXES)}) nor Parquet"
                       f" ({', '.join(PARQUET_SUFFIXES)}); convert it, or rename it if it is one of them")
  if not records:
    raise DatasetError(f"{key}={path} is empty: it holds no rows; give it one JSON object per line (or a Parquet"
                       " table) with a prompt and an answer")
  return records


def _read_jsonl(key: str, path: str, found: Path) -> list[tuple[str, Any]]:
  """The JSON object on each line that is not blank, with ``KEY=PATH line N`` (1-based)."""
  data = read_regular_bytes(found, what=f"{key}'s file", max_bytes=MAX_DATASET_BYTES)
  try:
    text = data.decode("utf-8-sig")  # a byte-order mark (some editors write one) is no text
  except UnicodeDecodeError as e:
    raise DatasetError(f"{key}={path} is not UTF-8 text (byte {e.start}), so it is not JSONL; convert it to UTF-8"
                       " JSON lines, or name a Parquet file .parquet") from None
  records = []
  # Split on newlines only: a JSON string may hold U+2028, which str.splitlines would split at.
  for number, line in enumerate(text.split("\n"), start=1):
    if not line.strip():
      continue
    where = f"{key}={path} line {number}"
    record = parse_line(where, line)
    if not isinstance(record, dict):
      raise DatasetError(f"{where} is a JSON {type(record).__name__}, not an object; each line must be one JSON"
                         ' object such as {"prompt": "2+3=", "answer": "5"}')
    records.append((where, record))
  return records


class _NotJson(ValueError):
  """A value Python's json reads but JSON has not (NaN, Infinity) or a float cannot hold (1e400)."""


def _no_constant(literal: str):
  raise _NotJson(f"the literal {literal}, which JSON does not have")


def _finite_float(text: str) -> float:
  value = float(text)
  if not math.isfinite(value):
    raise _NotJson(f"the number {text[:40]}, too large for a float")
  return value


def parse_line(where: str, line: str) -> Any:
  """One JSONL line, every way it can fail refused in one line naming ``where`` (its file and line)."""
  example = ' such as {"prompt": "2+3=", "answer": "5"}'
  try:
    return json.loads(line, parse_constant=_no_constant, parse_float=_finite_float)
  except json.JSONDecodeError as e:
    raise DatasetError(f"{where} is not JSON ({e.msg} at column {e.colno}); each line must be one JSON object"
                       + example) from None
  except _NotJson as e:
    raise DatasetError(f"{where} holds {e}; write the value as a string, or leave it out") from None
  except RecursionError:
    raise DatasetError(f"{where} nests its brackets deeper than the reader's limit (about"
                       f" {sys.getrecursionlimit()} levels); each line must be one flat JSON object"
                       + example) from None
  except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
    raise DatasetError(f"{where} holds a value that cannot be read ({str(e).split(';')[0]}); write it as a string,"
                       " or leave it out") from None


def _read_parquet(key: str, path: str, found: Path) -> list[tuple[str, Any]]:
  """Each row of the Parquet table as a mapping of its columns, with ``KEY=PATH row N`` (1-based)."""
  check_regular(found, what=f"{key}'s file", max_bytes=MAX_DATASET_BYTES)
  try:
    rows = _parquet_rows(key, path, pq.ParquetFile(found))
  except (pa.ArrowException, OSError) as e:
    raise DatasetError(f"{key}={path} is not a Parquet file pyarrow can read ({e}); convert it, or name a JSONL"
                       " file .jsonl") from None
  return [(f"{key}={path} row {number}", record) for number, record in enumerate(rows, start=1)]


def _parquet_rows(key: str, path: str, parquet: pq.ParquetFile) -> list[dict]:
  """The rows, read a batch at a time while the columns read stay within ``MAX_DATASET_BYTES``: a small file can
  unpack to far more (compression, and a dictionary that repeats one long value in every row)."""
  metadata = parquet.metadata
  unpacked_bytes = sum(metadata.row_group(g).total_byte_size for g in range(metadata.num_row_groups))
  if unpacked_bytes > MAX_DATASET_BYTES:
    raise _unpacks_too_large(key, path, f"{unpacked_bytes:,} bytes")
  rows, read_bytes = [], 0
  for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
    read_bytes += batch.nbytes
    if read_bytes > MAX_DATASET_BYTES:
      raise _unpacks_too_large(key, path, f"more than {MAX_DATASET_BYTES:,} bytes")
    rows.extend(batch.to_pylist())
  return rows


def _unpacks_too_large(key: str, path: str, size: str) -> DatasetError:
  return DatasetError(f"{key}={path} unpacks to {size} of columns, over the {MAX_DATASET_BYTES:,} bytes read for a"
                      " prompt file; give a smaller file")


def text_field(where: str, record: dict, field: str, key: str) -> str:
  """``record[field]``, a string; ``key`` is the setting that names the field (for the fix)."""
  if field not in record:
    has = ", ".join(repr(name) for name in record) or "none"
    raise DatasetError(f"{where} has no field {field!r} (its fields: {has}); name the field to read with"
                       f" {key}=FIELD")
  value = record[field]
  if not isinstance(value, str):
    raise DatasetError(f"{where}: field {field!r} is {value!r} ({type(value).__name__}), not a string; write it as"
                       f" a string ({json.dumps(str(value))})")
  return value


def read_rows(key: str, path: str, prompt_field: str, answer_field: str) -> list[Row]:
  """The problems of the file ``key`` names, one per record; a record's other fields go with its problem
  (``Problem.extra``: reward functions may take them)."""
  rows = []
  for where, record in read_records(key, path):
    prompt = text_field(where, record, prompt_field, "task.prompt_field")
    answer = text_field(where, record, answer_field, "task.answer_field")
    extra = {k: v for k, v in record.items() if k not in (prompt_field, answer_field)}
    rows.append(Row(where, Problem(prompt, answer, extra or None)))
  return rows


# ---------------------------------------------------------------------------- checks


def check_characters(rows: Sequence[Row], tokenizer, prompt_field: str, answer_field: str) -> None:
  """Every prompt and answer is text ``tokenizer`` can encode (the sampler would fail on the first other one,
  mid-run): the character tokenizer's characters only; a checkpoint's tokenizer is asked."""
  if not isinstance(tokenizer, CharTokenizer):
    for row in rows:
      for field, text in ((prompt_field, row.problem.prompt), (answer_field, row.problem.answer)):
        try:
          tokenizer.encode(text)
        except ValueError as e:
          raise DatasetError(f"{row.where}: field {field!r} cannot be encoded by the model's tokenizer ({e})"
                             ) from None
    return
  known = set(tokenizer.alphabet)
  for row in rows:
    for field, text in ((prompt_field, row.problem.prompt), (answer_field, row.problem.answer)):
      bad = next((c for c in text if c not in known), None)
      if bad is not None:
        raise DatasetError(f"{row.where}: field {field!r} has the character {bad!r}, which the character tokenizer"
                           f" cannot encode; write the prompts and answers in its characters only"
                           f" ({tokenizer.alphabet!r})")


def check_answers(rows: Sequence[Row], answer_field: str, reward: Sequence[str]) -> None:
  """Every answer can score: none is empty (the task's own check, accuracy's, would compare empty text with
  empty text, and an empty completion would count as correct); with ``math`` among ``reward`` (``task.reward``)
  every answer holds a number (else that term is 0.0 for every completion)."""
  for row in rows:
    answer = row.problem.answer
    if not answer.strip():
      raise DatasetError(f"{row.where}: field {answer_field!r} is {answer!r}, so no completion can be scored"
                         " against it (accuracy would count an empty completion as correct); give every row an"
                         " answer")
    if "math" not in reward:
      continue
    try:
      number = final_number(answer, strict=True)
    except NumberTooLong as e:
      raise DatasetError(f"{row.where}: field {answer_field!r} holds {e}, so math cannot compare it with a"
                         " completion's; shorten the answer, or drop math from task.reward") from None
    if number is None:
      raise DatasetError(f"{row.where}: field {answer_field!r} is {answer!r}, which holds no number, but"
                         " task.reward lists math (the completion's final number against the answer's); give"
                         " every row a numeric answer, or drop math from task.reward")


def prompt_tokens(tokenizer, prompt: str) -> int:
  """The tokens ``prompt`` takes in the sampler and the packing: the formatted prompt's (a checkpoint's chat
  template, if one is used) and the bos before them (where the tokenizer has one)."""
  formatted = tokenizer.format_prompt(prompt) if hasattr(tokenizer, "format_prompt") else prompt
  return len(tokenizer.encode(formatted)) + (tokenizer.bos_id() is not None)


def check_no_pad_in_prompts(rows: Sequence[Row], tokenizer) -> None:
  """No prompt, as the model sees it, holds the pad id: Tunix's sampler masks that id out of a prompt, and
  training would not, so the two would score another sequence (a checkpoint without a pad token pads with
  its eos, which a chat template may put in every prompt). Nor an id past the model's (``HFTokenizer``'s
  ``vocab_size``), which would read an embedding row it does not have."""
  if not hasattr(tokenizer, "format_prompt"):  # the character tokenizer: no character encodes to pad
    return
  pad = tokenizer.pad_id()
  for row in rows:
    ids = tokenizer.encode(tokenizer.format_prompt(row.problem.prompt))
    if pad in ids:
      raise DatasetError(f"{row.where}: the prompt as the model sees it holds the pad token (id {pad}), which the"
                         " sampler would mask out of it but training would not; give the checkpoint a pad_token"
                         " (tokenizer_config.json) that no prompt uses")
    if ids and max(ids) >= tokenizer.vocab_size:  # a special token the model has no row for (Gemma 3's image)
      raise DatasetError(f"{row.where}: the prompt as the model sees it holds token id {max(ids)}, which the"
                         f" model's {tokenizer.vocab_size} ids do not include; remove that token from the prompt")


def check_prompt_lengths(rows: Sequence[Row], tokenizer, max_prompt_tokens: int, *, given: bool = True) -> None:
  """Every prompt fits ``task.max_prompt_tokens`` (a longer one would not fit the sampler's cache); unset
  (``given`` false), the most any prompt may take (``MAX_DERIVED_TOKENS``: it sizes every micro-batch)."""
  for row in rows:
    n = prompt_tokens(tokenizer, row.problem.prompt)
    if n <= max_prompt_tokens:
      continue
    if given:
      raise DatasetError(f"{row.where}: the prompt takes {n} tokens (bos included), more than"
                         f" task.max_prompt_tokens={max_prompt_tokens}; raise task.max_prompt_tokens or shorten"
                         " the prompt")
    raise DatasetError(f"{row.where}: the prompt takes {n:,} tokens (bos included), more than the"
                       f" {max_prompt_tokens:,} a prompt may take (task.max_prompt_tokens unset: the longest"
                       " prompt sizes every micro-batch); shorten or drop the prompt")


def with_completion_limits(rows: Sequence[Row], field: str, limit: int, given: int | None) -> list[Row]:
  """``rows`` with each problem's own completion limit (``Problem.max_new_tokens``) read from its ``field``
  (``task.max_tokens_field``): a whole number in [1, ``limit``], the task's (``task.max_completion_tokens``,
  ``given``; None: the longest answer's), which sizes the sampler."""
  bound = (f"task.max_completion_tokens={given}" if given is not None
           else f"{limit}, the longest answer's tokens (task.max_completion_tokens unset)")
  limited = []
  for row in rows:
    extra = row.problem.extra or {}
    if field not in extra:
      has = ", ".join(repr(name) for name in extra) or "no other"
      raise DatasetError(f"{row.where} has no field {field!r} (its other fields: {has}), which"
                         f" task.max_tokens_field={field} names; give every row one, or drop task.max_tokens_field")
    value = extra[field]
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or not 1 <= value <= limit:
      raise DatasetError(f"{row.where}: field {field!r} (task.max_tokens_field) is {value!r}; it must be a whole"
                         f" number of tokens in [1, {limit}] (at most {bound}); fix the row (a longer limit"
                         " needs a larger task.max_completion_tokens)")
    limited.append(dataclasses.replace(row, problem=dataclasses.replace(row.problem, max_new_tokens=int(value))))
  return limited


# ---------------------------------------------------------------------------- the split


def split_by_hash(rows: Sequence[Row], eval_fraction: float) -> tuple[list[Row], list[Row]]:
  """(train, eval): a row is held out when its prompt's hash falls under ``eval_fraction`` (stable across
  processes, and a prompt that repeats lands on one side every time)."""
  train, held_out = [], []
  for row in rows:
    (held_out if _held_out(row.problem.prompt, eval_fraction) else train).append(row)
  return train, held_out


def without_prompts_of(rows: Sequence[Row], held_out: Sequence[Row]) -> list[Row]:
  """``rows`` without those whose prompt is an evaluation prompt: an evaluation prompt is never trained on."""
  evaluated = {row.problem.prompt for row in held_out}
  return [row for row in rows if row.problem.prompt not in evaluated]


def check_split_by_hash(path: str, eval_fraction: float, rows: Sequence[Row], train: Sequence[Row],
                        held_out: Sequence[Row]) -> None:
  """Both sides of ``task.eval_fraction``'s split hold a row (a draw from an empty split has nothing to draw)."""
  if train and held_out:
    return
  distinct = len({row.problem.prompt for row in rows})
  if not held_out:
    raise DatasetError(f"task.eval_fraction={eval_fraction} holds out none of the {distinct} distinct prompts of"
                       f" task.path={path} (by a hash of the prompt), so the evaluation split is empty; raise"
                       " task.eval_fraction, add prompts, or give evaluation prompts in task.eval_path=FILE")
  raise DatasetError(f"task.eval_fraction={eval_fraction} holds out all {distinct} distinct prompts of"
                     f" task.path={path} (by a hash of the prompt), so the training split is empty; lower"
                     " task.eval_fraction or add prompts")


# ---------------------------------------------------------------------------- the task


def _shuffle_seed(seed: int, split: str) -> int:
  """A 32-bit seed (what grain takes) for ``split``'s shuffle under the run's ``seed`` (up to 63 bits)."""
  return int.from_bytes(hashlib.blake2b(f"{seed}:{split}".encode(), digest_size=4).digest(), "big")


@dataclasses.dataclass(frozen=True)
class DatasetTask:
  """Problems read from a file (``load_task``), drawn in a seeded shuffle per epoch; a ``tasks.Task``.

  ``problem(seed, split, index)`` is a pure function of its arguments: epoch
  ``index // n`` of the split's ``n`` rows, position ``index % n`` in that
  epoch's shuffle. Its own reward is ``exact`` (``rewards.normalise`` on both
  sides). Completions are sampled from the characters the answers use, and a
  space (shorter answers pad to ``max_answer_length``).
  """

  train_problems: tuple[Problem, ...]
  eval_problems: tuple[Problem, ...]
  answer_alphabet: str | None  # None: free text ending at the model's eos (a checkpoint's tokenizer)
  max_answer_length: int  # task.max_completion_tokens
  max_prompt_tokens: int
  name = "dataset"
  _orders: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def problem(self, seed: int, split: str, index: int) -> Problem:
    return self._order(seed, split)[index]

  def _order(self, seed: int, split: str):
    """``split``'s problems in grain's seeded shuffle (a new order each epoch), built once per (seed, split)."""
    # import here: grain imports JAX, and the recipe reads this module before JAX starts (after the host settings)
    import grain

    if split not in ("train", "eval"):
      raise ValueError(f"split {split!r}: use 'train' or 'eval'")
    key = (seed, split)
    if key not in self._orders:
      problems = self.train_problems if split == "train" else self.eval_problems
      self._orders[key] = grain.MapDataset.source(problems).shuffle(seed=_shuffle_seed(seed, split))
    return self._orders[key]

  def reward(self, problem: Problem, completion: str) -> float:
    if not isinstance(completion, str):
      return 0.0
    return 1.0 if normalise(completion) == normalise(problem.answer) else 0.0

  def prompts(self) -> Iterator[str]:
    """Every distinct prompt either split draws."""
    return iter(dict.fromkeys(p.prompt for p in (*self.train_problems, *self.eval_problems)))

  def held_out(self, prompt: str) -> bool:
    return prompt in self._eval_prompts

  @functools.cached_property
  def _eval_prompts(self) -> frozenset[str]:
    return frozenset(p.prompt for p in self.eval_problems)


def answer_alphabet(rows: Sequence[Row], tokenizer) -> str | None:
  """With the character tokenizer: the characters the answers use, and a space, in the tokenizer's order.
  With a checkpoint's tokenizer None: completions are free text that ends at the model's eos."""
  if not isinstance(tokenizer, CharTokenizer):
    return None
  used = {c for row in rows for c in row.problem.answer} | {" "}
  return "".join(c for c in tokenizer.alphabet if c in used)


def load_task(*, path: str, eval_path: str | None = None, prompt_field: str = "prompt", answer_field: str = "answer",
              eval_fraction: float = 0.1, max_prompt_tokens: int | None = None,
              max_completion_tokens: int | None = None, tokenizer=None, reward: Sequence[str] = (),
              max_tokens_field: str | None = None) -> DatasetTask:
  """The dataset task the ``task.*`` keys describe, every row checked (its answers against ``reward``, the
  ``task.reward`` entries).

  ``max_prompt_tokens`` None: the longest prompt's (bos included);
  ``max_completion_tokens`` None: the longest answer's;
  ``max_tokens_field``: the field that gives each row's own completion limit (``with_completion_limits``).

  Raises:
    DatasetError: see ``read_records``, ``read_rows``, the checks and the split; one line each.
  """
  tokenizer = tokenizer or CharTokenizer()
  rows = read_rows("task.path", path, prompt_field, answer_field)
  if eval_path is not None:
    held_out = read_rows("task.eval_path", eval_path, prompt_field, answer_field)
    train = without_prompts_of(rows, held_out)
    if not train:
      raise DatasetError(f"every prompt of task.path={path} is also in task.eval_path={eval_path} (an evaluation"
                         " prompt is never trained on), so the training split is empty; give task.path other"
                         " prompts")
  else:
    train, held_out = split_by_hash(rows, eval_fraction)
  every = [*train, *held_out]
  check_answers(every, answer_field, reward)
  check_characters(every, tokenizer, prompt_field, answer_field)
  check_no_pad_in_prompts(every, tokenizer)
  check_prompt_lengths(every, tokenizer, MAX_DERIVED_TOKENS if max_prompt_tokens is None else max_prompt_tokens,
                       given=max_prompt_tokens is not None)
  if eval_path is None:
    check_split_by_hash(path, eval_fraction, rows, train, held_out)
  longest_prompt = max(prompt_tokens(tokenizer, row.problem.prompt) for row in every)
  # free text ends with an eos token (a checkpoint's tokenizer): room for it after the longest answer
  ends_with_eos = answer_alphabet(every, tokenizer) is None
  answer_tokens = [len(tokenizer.encode(row.problem.answer)) + ends_with_eos for row in every]
  longest_answer = max(answer_tokens)
  if max_completion_tokens is None and longest_answer > MAX_DERIVED_TOKENS:
    row = every[answer_tokens.index(longest_answer)]
    raise DatasetError(f"{row.where}: the {answer_field} takes {longest_answer:,} tokens, more than the"
                       f" {MAX_DERIVED_TOKENS:,} a completion may take (task.max_completion_tokens unset: the"
                       " longest answer sizes every completion); set task.max_completion_tokens, or shorten or"
                       " drop the answer")
  limit = max_completion_tokens if max_completion_tokens is not None else max(1, longest_answer)
  if max_tokens_field is not None:
    train, held_out = (with_completion_limits(part, max_tokens_field, limit, max_completion_tokens)
                       for part in (train, held_out))
  return DatasetTask(tuple(row.problem for row in train), tuple(row.problem for row in held_out),
                     answer_alphabet(every, tokenizer), limit,
                     max_prompt_tokens if max_prompt_tokens is not None else longest_prompt)

"""Tasks with verifiable rewards: prompts drawn by (seed, split, index), and a reward per completion.

``Task`` is what the live loop asks of one. The built-in tasks are here; a
file of one's own prompts (``task.name: dataset``) is
``orchestrator.tasks.datasets``, and rewards a recipe chooses instead of a task's
own are ``orchestrator.tasks.rewards``.

The built-in tasks: a random model cannot do them; a tiny one can learn them.
Answers have a fixed length and are sampled from the task's ``answer_alphabet`` only, so a
random model scores 1 / len(alphabet) ** length (chance). Each task names its
reward function (``reward``: 1.0 for a correct answer, 0.0 otherwise, and 0.0
for a malformed completion), so a recipe picks a task by name (``task.name``)
and its sizes by key (``task.*``). Prompts of the ``eval`` split never appear
in ``train``: held-out accuracy measures generalisation, not recall.

A built-in task's prompts are a finite space (``prompts()``: every one, in a fixed
order), split by a hash of the prompt. Problems are drawn with replacement, so
a split needs one prompt, not one per draw; but a draw retries until it lands
on its split, so an empty split would spin forever: ``split_sizes`` counts
both, the recipe refuses sizes that leave one empty, and ``make_task`` too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

#: Prompt tokens the sampler and the packing allow for the built-in tasks (bos included): all their prompts fit.
MAX_PROMPT_LENGTH = 16


@dataclasses.dataclass(frozen=True)
class Problem:
  """One prompt and the answer that earns the reward; ``extra``: a dataset row's other fields (column → value),
  which reward functions may take as keyword arguments (``rewards.Reward``); ``max_new_tokens``: the most tokens
  a completion of it may take (a dataset row's ``task.max_tokens_field``; None: the task's
  ``max_answer_length``). Neither is compared: a problem is its prompt and answer."""

  prompt: str
  answer: str
  extra: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)
  max_new_tokens: int | None = dataclasses.field(default=None, compare=False)


class Task(Protocol):
  """What the live loop asks of a task (``LiveRollouts``, the sampler's sizes, the recipe's checks).

  Attributes:
    name: the ``task.name`` that selects it.
    answer_alphabet: the characters completions are sampled from (nothing else is ever sampled, and
      every completion takes ``max_answer_length`` tokens); None: free text in the tokenizer's vocabulary,
      ending at the model's eos (a dataset read with a checkpoint's tokenizer).
    max_answer_length: the sampler's generation steps: every completion's tokens, or at most that many.
    max_prompt_tokens: the prompt tokens the sampler and the packing allow, bos included; every prompt fits.

  ``problem(seed, split, index)`` is a pure function of its arguments (``split``
  ``"train"`` or ``"eval"``): the same problem in every process and after a
  resume, which restores the step and so the indices its draws use. No prompt
  of ``eval`` is ever drawn for ``train``. ``reward(problem, completion)`` is the
  task's own check, in [0, 1] (1.0: correct): accuracy, the held-out evaluation
  and, unless ``task.reward`` chooses others, the training reward.
  ``prompts()`` is every prompt either split can draw, ``held_out(prompt)`` on
  which side it lies (``split_sizes`` counts both: an empty split is refused).
  """

  name: str
  answer_alphabet: str | None
  max_answer_length: int
  max_prompt_tokens: int

  def problem(self, seed: int, split: str, index: int) -> Problem: ...

  def reward(self, problem: Problem, completion: str) -> float: ...

  def prompts(self) -> Iterable[str]: ...

  def held_out(self, prompt: str) -> bool: ...


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
  return np.random.default_rng((seed, 0 if split == "train" else 1, index))


def _draw(seed: int, split: str, index: int, eval_share: float, make: Callable) -> Problem:
  """Draws problems from ``make(rng)`` until one falls on ``split``'s side of the held-out split."""
  rng = _rng(seed, split, index)
  while True:
    problem = make(rng)
    if _held_out(problem.prompt, eval_share) == (split == "eval"):
      return problem


def _word(rng: np.random.Generator, letters: int, length: int) -> str:
  return "".join(LETTERS[i] for i in rng.integers(0, letters, length))


LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _held_out(key: str, eval_share: float) -> bool:
  """A stable split of the problem space: the same problems are held out in every process."""
  h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big")
  return h / 2**32 < eval_share


class _BuiltIn:
  """What the built-in tasks share: a split by a hash of the prompt, and prompts of at most MAX_PROMPT_LENGTH."""

  eval_share: float
  max_prompt_tokens = MAX_PROMPT_LENGTH

  def held_out(self, prompt: str) -> bool:
    return _held_out(prompt, self.eval_share)


@dataclasses.dataclass(frozen=True)
class ModularAddition(_BuiltIn):
  """``a+b%m=`` → ``(a + b) mod m``, zero-padded to the width of ``m - 1``.

  Completions are sampled from the answer's digits only, so chance is 1/m.
  """

  modulus: int = 7
  eval_share: float = 0.2
  name = "modular_addition"

  def problem(self, seed: int, split: str, index: int) -> Problem:
    def make(rng):
      a, b = (int(x) for x in rng.integers(0, self.modulus, 2))
      return Problem(self._prompt(a, b), f"{(a + b) % self.modulus:0{self.max_answer_length}d}")

    return _draw(seed, split, index, self.eval_share, make)

  def _prompt(self, a: int, b: int) -> str:
    return f"{a}+{b}%{self.modulus}="

  def prompts(self) -> Iterator[str]:
    """Every prompt ``problem`` can draw, either split."""
    return (self._prompt(a, b) for a in range(self.modulus) for b in range(self.modulus))

  @property
  def answer_alphabet(self) -> str:
    return "0123456789"[: min(10, self.modulus)]

  def reward(self, problem: Problem, completion: str) -> float:
    return exact_answer(problem, completion)

  @property
  def max_answer_length(self) -> int:
    return len(str(self.modulus - 1))


@dataclasses.dataclass(frozen=True)
class _WordTask(_BuiltIn):
  """A task on a random word of ``length`` letters drawn from the first ``letters`` of the alphabet."""

  length: int
  letters: int
  eval_share: float = 0.2

  def reward(self, problem: Problem, completion: str) -> float:
    return exact_answer(problem, completion)

  @property
  def answer_alphabet(self) -> str:
    return LETTERS[: self.letters]

  def prompts(self) -> Iterator[str]:
    """Every prompt ``problem`` can draw, either split."""
    return (self._prompt("".join(w)) for w in itertools.product(LETTERS[: self.letters], repeat=self.length))


@dataclasses.dataclass(frozen=True)
class ReverseString(_WordTask):
  """``rev:abc>`` → ``cba``: reverse a short lower-case string."""

  length: int = 3
  letters: int = 4
  name = "reverse"

  def problem(self, seed: int, split: str, index: int) -> Problem:
    def make(rng):
      word = _word(rng, self.letters, self.length)
      return Problem(self._prompt(word), word[::-1])

    return _draw(seed, split, index, self.eval_share, make)

  def _prompt(self, word: str) -> str:
    return f"rev:{word}>"

  @property
  def max_answer_length(self) -> int:
    return self.length


@dataclasses.dataclass(frozen=True)
class FirstLetter(_WordTask):
  """``1st:cadb>`` → ``c``: copy the word's first letter (an algorithm, so held-out words test it)."""

  length: int = 4
  letters: int = 8
  name = "first_letter"

  def problem(self, seed: int, split: str, index: int) -> Problem:
    def make(rng):
      word = _word(rng, self.letters, self.length)
      return Problem(self._prompt(word), word[0])

    return _draw(seed, split, index, self.eval_share, make)

  def _prompt(self, word: str) -> str:
    return f"1st:{word}>"

  @property
  def max_answer_length(self) -> int:
    return 1


@dataclasses.dataclass(frozen=True)
class SplitSizes:
  """Distinct prompts in each split of a task; ``exact`` False: counting stopped early, so at least these."""

  train: int
  eval: int
  exact: bool

  @property
  def empty(self) -> str | None:
    """The split that holds no prompt ("training" or "evaluation"), or None."""
    return "training" if self.train == 0 else "evaluation" if self.eval == 0 else None


def split_sizes(task, *, enough: int = 1) -> SplitSizes:
  """Counts ``task``'s prompts per split, stopping once both hold ``enough`` (a space of 26**10 words is never
  walked whole: only a small space can leave a split empty, and that one is counted exactly)."""
  train = held_out = 0
  for prompt in task.prompts():
    if task.held_out(prompt):
      held_out += 1
    else:
      train += 1
    if train >= enough and held_out >= enough:
      return SplitSizes(train, held_out, exact=False)
  return SplitSizes(train, held_out, exact=True)


def max_generation_steps(task) -> int:
  """Tokens a completion takes: answers have a fixed length, so no eos is needed."""
  return task.max_answer_length


def exact_answer(problem: Problem, completion: str) -> float:
  """1.0 when the completion is exactly the answer (surrounding spaces ignored), else 0.0."""
  if not isinstance(completion, str):
    return 0.0
  return 1.0 if completion.strip() == problem.answer else 0.0


TASKS: dict[str, Callable[..., object]] = {"modular_addition": ModularAddition, "reverse": ReverseString,
                                           "first_letter": FirstLetter}


def make_task(name: str, **sizes):
  """The task ``name`` with ``sizes`` (its fields).

  Raises:
    ValueError: an unknown task or size (named, with what exists), or sizes that leave a split empty (drawing
      from it would never end).
  """
  if name not in TASKS:
    raise ValueError(f"task.name={name!r} is not a task; use one of {sorted(TASKS)}")
  cls = TASKS[name]
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(sizes) - known)
  if unknown:
    raise ValueError(f"task {name!r} has no settings {unknown}; it takes {sorted(known)}")
  task = cls(**sizes)
  counted = split_sizes(task)
  if counted.empty:
    raise ValueError(f"task {name!r} with {sizes} leaves the {counted.empty} split empty ({counted.train} training,"
                     f" {counted.eval} evaluation prompts); use larger sizes")
  return task


def group_advantages(rewards: np.ndarray, generations: int, scaling: str = "group") -> np.ndarray:
  """GRPO advantages: each reward minus its group's mean, over the group's std (``scaling`` "group": Tunix's
  estimator) or not (``scaling`` "none": Dr. GRPO's, Tunix's ``compute_drgrpo_advantages``)."""
  from tunix.rl import algo_core  # import here: the recipe reads this module before JAX (Tunix imports it)

  rewards = np.asarray(rewards, np.float64)  # float32's squares overflow past ~1.8e19: every advantage 0
  if rewards.ndim != 1 or len(rewards) % generations:
    raise ValueError(f"{len(rewards)} rewards do not split into groups of {generations}")
  if scaling == "none":
    return np.asarray(algo_core.compute_drgrpo_advantages(rewards, generations), np.float32)
  if scaling != "group":
    raise ValueError(f"advantage scaling {scaling!r}: use group or none")
  return np.asarray(algo_core.compute_advantages(rewards, generations), np.float32)

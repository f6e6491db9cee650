"""Rewards a recipe chooses (``task.reward``, ``task.reward_weights``): built-ins by name, or a function of one's own.

Every reward has Tunix's reward-function signature (``tunix.rl.rl_learner``:
``reward_fns``), so a function written for Tunix's GRPO learner works here as is::

    fn(prompts: list[str], completions: list[str], *, answer: list[str], mode: str, **kwargs) -> list[float]

It is called once per micro-batch over all its completions (a prompt repeats
once per completion of its group, as Tunix repeats it), with the answers
aligned to the completions and ``mode`` ``"train"`` — and, for a dataset, each
of the rows' other fields as a keyword argument of its own, a list aligned the
same way (verl's ``extra_info``; a row without the field gives None; the
names above are never replaced), passed to a function that takes that name
or ``**kwargs`` — and returns one finite
number per completion: a list, a tuple or a 1-D numpy array of ints or floats
(a bool counts as 1.0 or 0.0, so ``[c == a for ...]`` works). Several entries
are a weighted sum. A function that raises, returns anything else (a dict, a
string, a generator, another count, a value that is not a finite number) or
does not return within ``task.reward_timeout_s`` stops the run at that step
(``RewardError``), naming the entry and the prompt index (the ``index`` the
train split's problem was drawn with: ``Task.problem``).

Each call runs on a daemon thread of its own (``run_limited``), which the
caller waits for in slices, looking at the time limit and at whether the run
is closing: a stuck function can neither hang the run nor hold its stop. A
module of one's own is imported the same way when the recipe is validated, so
an import that never returns, or one that calls ``sys.exit``, is a refusal.

The built-ins (``BUILT_INS``): ``exact`` (the answer, after ``normalise``),
``math`` (the completion's final number equals the answer's) and ``format``
(``task.format_pattern`` matches the whole completion, surrounding whitespace
stripped: ``re.fullmatch``). Each scores 1.0 or 0.0.
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import importlib
import inspect
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from orchestrator.tasks.tasks import Problem

RewardFn = Callable[..., Sequence[float]]

#: ``task.reward_timeout_s``'s default: how long one call of a reward function, or the import of its module, may take.
DEFAULT_TIMEOUT_S = 60.0
#: How long the caller of a limited call waits before it looks at the time and at ``cancelled`` again.
POLL_S = 0.05


class RewardSpecError(ValueError):
  """A ``task.reward`` entry that cannot be used (unknown, not importable, not callable); one line, with the fix."""


class RewardError(RuntimeError):
  """A reward function failed at run time; the message names the entry and the prompt index."""


class CallTimedOut(Exception):
  """A limited call did not return within its time limit (``seconds``); it is left running on its thread."""

  def __init__(self, seconds: float):
    super().__init__(f"no return within {seconds:g} s")
    self.seconds = seconds


class CallCancelled(Exception):
  """The caller gave up on a limited call because its run is closing; the message says what was waited for."""


# ---------------------------------------------------------------------------- calls under a time limit


def run_limited(call: Callable[[], Any], *, timeout_s: float, cancelled: Callable[[], bool] | None = None,
                what: str = "a call") -> Any:
  """``call()`` on a daemon thread of its own, waited for at most ``timeout_s``: its value, or what it raised
  (``SystemExit`` too: a function's ``sys.exit`` must not end the run, let alone with code 0).

  ``what`` names the call in ``CallCancelled``'s message. A call that does not return is left on its thread
  (Python cannot stop a thread), which, being a daemon, does not hold the process's exit.

  Raises:
    CallTimedOut: ``timeout_s`` passed first.
    CallCancelled: ``cancelled()`` became true first.
  """
  outcome: dict[str, Any] = {}
  done = threading.Event()

  def target():
    try:
      outcome["value"] = call()
    except BaseException as e:  # pylint: disable=broad-except  # handed to the caller, which names it
      outcome["error"] = e
    finally:
      done.set()

  start = time.monotonic()
  threading.Thread(target=target, name=f"limited: {what}", daemon=True).start()
  while not done.wait(POLL_S):
    waited_s = time.monotonic() - start
    if cancelled is not None and cancelled():
      raise CallCancelled(f"{what}, which had run {waited_s:.1f} s of its {timeout_s:g} s limit")
    if waited_s >= timeout_s:
      raise CallTimedOut(timeout_s)
  if "error" in outcome:
    raise outcome["error"]
  return outcome["value"]


# ---------------------------------------------------------------------------- the built-ins


def normalise(text: str) -> str:
  """``text`` stripped, its runs of whitespace made one space, case-folded (what ``exact`` compares)."""
  return " ".join(text.split()).casefold()


def exact(prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[str], **_) -> list[float]:
  """1.0 where the completion equals the answer after ``normalise``, else 0.0."""
  return [1.0 if isinstance(c, str) and normalise(c) == normalise(a) else 0.0 for c, a in zip(completions, answer)]


# A number as answers write it: an optional sign, digits with optional thousands commas (1,000), an optional
# decimal part, and an optional denominator (3/4).
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?")
_HASHES = re.compile(r"####\s*([^\n]*)")
# LaTeX fractions as answers write them: \frac{3}{4}, \dfrac{3}{4}, \tfrac34 (single digits), with a sign.
_FRAC = re.compile(r"\\[dt]?frac\s*(?:\{\s*([-+]?[\d.,]+)\s*\}|(\d))\s*(?:\{\s*([\d.,]+)\s*\}|(\d))")
BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
  """The contents of the last ``\\boxed{...}`` in ``text``, nested braces and all; None when there is none
  (or it is never closed)."""
  start = text.rfind(BOXED)
  if start < 0:
    return None
  depth, i = 1, start + len(BOXED)
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i:j]
  return None


class NumberTooLong(ValueError):
  """A number with a run of more digits than Python converts to an int (``sys.get_int_max_str_digits``)."""


def final_number(text: str, *, strict: bool = False) -> fractions.Fraction | None:
  """The answer ``text`` gives, as an exact fraction: the number of its last ``\\boxed{...}`` (LaTeX fractions
  read as such), else the first number after its last ``####``, else its last number; None when there is none.

  Exact fractions, so ``1,000``, ``1000.0``, ``2000/2`` and ``\\frac{2000}{2}`` are all 1000 and no tolerance
  is needed.
  """
  if not isinstance(text, str):
    return None
  boxed = last_boxed(text)
  hashes = _HASHES.findall(text) if boxed is None else []
  chosen = boxed if boxed is not None else hashes[-1] if hashes else text
  chosen = _FRAC.sub(lambda m: f"{m[1] or m[2]}/{m[3] or m[4]}", chosen)
  numbers = _NUMBER.findall(chosen)
  if not numbers:
    return None
  number = numbers[0] if hashes else numbers[-1]  # "#### 42 because 40+2" answers 42
  number = number.replace(",", "").replace(" ", "")
  limit = sys.get_int_max_str_digits()
  digits = max(len(run) for run in re.findall(r"\d+", number))
  if limit and digits > limit:  # Fraction would raise ValueError: a number all the same, too long to read
    if strict:
      raise NumberTooLong(f"a number of {digits:,} digits, more than Python converts"
                          f" (sys.get_int_max_str_digits() is {limit:,})")
    return None
  try:
    return fractions.Fraction(number)
  except (ValueError, ZeroDivisionError):  # 3/0
    return None


def math_answer(prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[str], **_) -> list[float]:
  """1.0 where the completion's final number (``final_number``) equals the answer's, else 0.0."""
  out = []
  for completion, expected in zip(completions, answer):
    got, want = final_number(completion), final_number(expected)
    out.append(1.0 if got is not None and want is not None and got == want else 0.0)
  return out


def format_match(prompts: Sequence[str], completions: Sequence[str], *, pattern: re.Pattern, **_) -> list[float]:
  """1.0 where ``pattern`` matches the whole completion (``re.fullmatch``, surrounding whitespace stripped)."""
  return [1.0 if isinstance(c, str) and pattern.fullmatch(c.strip()) else 0.0 for c in completions]


#: The built-in rewards by name: each takes the compiled ``task.format_pattern`` (or None) and returns the function.
BUILT_INS: dict[str, Callable[[re.Pattern | None], RewardFn]] = {
    "exact": lambda pattern: exact,
    "math": lambda pattern: math_answer,
    "format": lambda pattern: functools.partial(format_match, pattern=pattern),
}


# ---------------------------------------------------------------------------- a recipe's reward


@dataclasses.dataclass(frozen=True)
class Term:
  """One entry of ``task.reward``: its name as the recipe gives it, the function, its weight."""

  name: str
  fn: RewardFn
  weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class Reward:
  """The weighted sum of a recipe's reward entries, called once per micro-batch, each entry's call limited to
  ``timeout_s`` (``task.reward_timeout_s``)."""

  terms: tuple[Term, ...]
  timeout_s: float = DEFAULT_TIMEOUT_S
  columns: tuple[str, ...] = ()  # a dataset's other fields: every call passes each (None where a row lacks it)

  def __call__(self, problems: Sequence[Problem], completions: Sequence[str], *, indices: Sequence[int],
               mode: str = "train", step: int | None = None,
               cancelled: Callable[[], bool] | None = None) -> np.ndarray:
    """One reward per completion (float32); ``problems[k]`` and ``indices[k]`` (its prompt index) are completion
    ``k``'s, all of ``step`` (named in errors). ``cancelled``: whether the run is closing (``run_limited``).

    Raises:
      RewardError: an entry raised, returned what is not one finite number per completion, or did not return
        within ``timeout_s``.
      CallCancelled: ``cancelled()`` became true while an entry ran.
    """
    prompts, answers = [p.prompt for p in problems], [p.answer for p in problems]
    where = f"on the micro-batch of prompt indices {_span(indices)}" + (f" of step {step}" if step is not None else "")
    total = np.zeros(len(completions), np.float64)
    columns = row_columns(problems, self.columns)
    for term in self.terms:
      arguments = dict(prompts=list(prompts), completions=list(completions), answer=list(answers), mode=mode)
      arguments.update({name: columns[name] for name in accepted_names(term.fn, columns)})
      values = term_values(term, arguments, where, timeout_s=self.timeout_s, cancelled=cancelled)
      total += term.weight * _checked(term, values, where, indices, prompts)
    over = np.flatnonzero(~(np.abs(total) <= FLOAT32_MAX))
    if over.size:
      k = int(over[0])
      weights = ", ".join(f"{t.name!r} × {t.weight:g}" for t in self.terms)
      raise RewardError(f"the weighted reward ({weights}) of completion {k} (prompt index {indices[k]}:"
                        f" {prompts[k]!r}) {where} is {total[k]:g}, past float32's range (|reward| <="
                        f" {FLOAT32_MAX:.4g}), which the trainer holds rewards in; lower task.reward_weights or"
                        " the rewards' scale")
    return total.astype(np.float32)


#: The largest reward (and weighted sum) float32 holds: the trainer's rewards and advantages are float32.
FLOAT32_MAX = float(np.finfo(np.float32).max)

#: The arguments every reward function gets; a dataset field of one of these names is not passed.
REWARD_ARGUMENTS = ("prompts", "completions", "answer", "mode")


def row_columns(problems: Sequence[Problem], names: Sequence[str] = ()) -> dict[str, list[Any]]:
  """The dataset rows' other fields (``Problem.extra``), ``names`` and any the rows hold, each a list aligned
  with ``problems`` (None where a row lacks it), but those named as ``REWARD_ARGUMENTS``."""
  found = (name for p in problems for name in (p.extra or {}))
  names = dict.fromkeys(name for name in (*names, *found) if name not in REWARD_ARGUMENTS)
  return {name: [(p.extra or {}).get(name) for p in problems] for name in names}


def accepted_names(fn: RewardFn, names) -> list[str]:
  """Which of ``names`` ``fn`` takes as keyword arguments: all, given ``**kwargs`` (or no readable signature);
  else those it names."""
  try:
    parameters = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return list(names)
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
    return list(names)
  keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
  return [name for name in names if name in parameters and parameters[name].kind in keyword]


def term_values(term: Term, arguments: dict[str, Any], where: str, *, timeout_s: float,
                cancelled: Callable[[], bool] | None = None):
  """What one entry returns for a micro-batch (called as Tunix calls a reward function, with ``arguments``), under
  the time limit; ``where`` (the micro-batch) ends the errors' first clause."""
  try:
    return run_limited(lambda: term.fn(**arguments), timeout_s=timeout_s, cancelled=cancelled,
                       what=f"task.reward entry {term.name!r} {where}")
  except CallCancelled:
    raise
  except CallTimedOut:
    raise RewardError(f"task.reward entry {term.name!r} did not return within task.reward_timeout_s={timeout_s:g} s"
                      f" {where}; make it faster, or raise task.reward_timeout_s") from None
  except BaseException as e:  # a user's function may raise anything (sys.exit too): the run stops naming it
    raise RewardError(f"task.reward entry {term.name!r} raised {type(e).__name__}: {e} {where}; fix the function or"
                      " drop it from task.reward") from e


def _checked(term: Term, values, where: str, indices: Sequence[int], prompts: Sequence[str]) -> np.ndarray:
  """``values`` as one finite float per completion, or RewardError naming the entry and the prompt index."""
  fix = "return a list, a tuple or a 1-D numpy array of numbers, one per completion"
  if isinstance(values, np.ndarray) and values.ndim != 1:
    raise RewardError(f"task.reward entry {term.name!r} returned a numpy array of shape {values.shape} {where}; {fix}")
  if not isinstance(values, (list, tuple, np.ndarray)):  # a dict's len and iteration are its keys': not rewards
    raise RewardError(f"task.reward entry {term.name!r} returned {type(values).__name__}, not a list of floats,"
                      f" {where}; {fix}")
  if len(values) != len(indices):
    raise RewardError(f"task.reward entry {term.name!r} returned {len(values)} values for {len(indices)} completions"
                      f" {where}; {fix}")
  out = np.empty(len(values), np.float64)
  for k, value in enumerate(values):
    number = _as_number(value)
    if number is None or not math.isfinite(number):
      raise RewardError(f"task.reward entry {term.name!r} returned {value!r} for completion {k} (prompt index"
                        f" {indices[k]}: {prompts[k]!r}); a reward must be a finite real number")
    if abs(number) > FLOAT32_MAX:
      raise RewardError(f"task.reward entry {term.name!r} returned {value!r} for completion {k} (prompt index"
                        f" {indices[k]}: {prompts[k]!r}) {where}, past float32's range (|reward| <="
                        f" {FLOAT32_MAX:.4g}), which the trainer holds rewards in; scale it down")
    out[k] = number
  return out


def _as_number(value) -> float | None:
  """``value`` as a float (a bool as 1.0 or 0.0), or None for what is not a real number (a string is not, though
  float() would take it; a complex is not, though numpy's float() would drop its imaginary part)."""
  if isinstance(value, (str, bytes, complex, np.complexfloating)):
    return None
  try:
    return float(value)
  except (TypeError, ValueError):
    return None
  except OverflowError:  # an int past a float's range (10**400): a number, not a finite one
    return math.inf


def _span(indices: Sequence[int]) -> str:
  return f"{min(indices)}..{max(indices)}" if len(indices) else "(none)"


def task_reward(task, timeout_s: float = DEFAULT_TIMEOUT_S) -> Reward:
  """The task's own reward (``task.reward(problem, completion)``, one completion at a time) as a ``Reward``."""
  def own(prompts, completions, *, answer, **_):
    return [task.reward(Problem(p, a), c) for p, a, c in zip(prompts, answer, completions)]

  return Reward((Term(f"{task.name}'s own reward", own),), timeout_s)


def make_reward(task, names: Sequence[str], weights: Sequence[float], pattern: str | None, *,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> Reward:
  """The ``Reward`` a recipe's ``task.reward`` (names; empty: the task's own), ``task.reward_weights`` (empty: all
  1.0), ``task.format_pattern`` and ``task.reward_timeout_s`` (``timeout_s``: each call's limit, and each
  module's import's) describe, for ``task`` (None: the entries alone are checked).

  Raises:
    RewardSpecError: an unknown built-in, a module whose import fails, exits or does not return within
      ``timeout_s``, a name that is not callable or cannot take Tunix's reward arguments, weights of another
      length, ``format`` without a valid pattern, or ``math`` on a built-in task whose answers hold no number.
  """
  if not names:
    if weights:
      raise RewardSpecError(f"task.reward_weights={list(weights)} weighs task.reward entries, but task.reward is"
                            " not set; list the rewards in task.reward, or drop task.reward_weights")
    return task_reward(task, timeout_s)
  if weights and len(weights) != len(names):
    raise RewardSpecError(f"task.reward_weights has {len(weights)} weights for {len(names)} task.reward entries"
                          f" ({', '.join(names)}); give one weight per entry, or none (all 1.0)")
  compiled = compile_pattern(pattern) if "format" in names or pattern is not None else None
  if "math" in names and task is not None:
    check_numeric_answers(task)
  columns = list(row_columns([*getattr(task, "train_problems", ()), *getattr(task, "eval_problems", ())]))
  terms = []
  for i, name in enumerate(names):
    terms.append(Term(name, resolve(i, name, compiled, timeout_s, columns), float(weights[i]) if weights else 1.0))
  return Reward(tuple(terms), timeout_s, tuple(columns))


def check_numeric_answers(task, draws: int = 8) -> None:
  """``math`` compares numbers: a built-in task whose answers hold none would score 0.0 for every completion. (A
  dataset's rows are checked as they are read, each named: ``datasets.check_answers``.)"""
  if hasattr(task, "train_problems"):
    return
  for index in range(draws):
    problem = task.problem(0, "train", index)
    if final_number(problem.answer) is None:
      raise RewardSpecError(f"task.reward lists math, but task.name={task.name}'s answers hold no number (it answers"
                            f" {problem.prompt!r} with {problem.answer!r}), so math would score 0.0 for every"
                            " completion; use exact, or a task with numeric answers")


def compile_pattern(pattern: str | None) -> re.Pattern:
  """``task.format_pattern`` compiled (``format`` needs it)."""
  if pattern is None:
    raise RewardSpecError("task.reward lists format, which needs task.format_pattern=REGEX (matched against the"
                          " whole completion, surrounding whitespace stripped); set it, or drop format")
  try:
    return re.compile(pattern)
  except re.error as e:
    raise RewardSpecError(f"task.format_pattern={pattern!r} is not a regular expression ({e}); fix it") from None


def resolve(i: int, name: str, pattern: re.Pattern | None, timeout_s: float = DEFAULT_TIMEOUT_S,
            columns: Sequence[str] = ()) -> RewardFn:
  """Entry ``i`` of ``task.reward``: a built-in by name, or a ``package.module:function``, checked callable with
  the reward arguments and the dataset's ``columns`` it takes."""
  if name in BUILT_INS:
    return BUILT_INS[name](pattern)
  if ":" not in name:
    raise RewardSpecError(f"task.reward[{i}]={name!r} is not a reward; use one of {', '.join(sorted(BUILT_INS))}, or"
                          " package.module:function for a function of your own")
  fn = import_function(i, name, timeout_s)
  check_signature(i, name, fn, columns)
  return fn


def import_function(i: int, name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> RewardFn:
  """The function ``package.module:function`` names (a dotted attribute after the colon is followed), its
  module imported within ``timeout_s`` (on a thread of its own: ``run_limited``)."""
  module_name, _, attribute = name.partition(":")
  try:
    target = run_limited(lambda: importlib.import_module(module_name), timeout_s=timeout_s,
                         what=f"the import of {module_name!r}")
  except CallTimedOut:
    raise RewardSpecError(f"task.reward[{i}]={name!r}: importing module {module_name!r} did not return within"
                          f" task.reward_timeout_s={timeout_s:g} s; make its import finish (do slow work in the"
                          " function), or raise task.reward_timeout_s") from None
  except KeyboardInterrupt:  # Ctrl-C while the import runs: the user's, not the module's
    raise
  except BaseException as e:  # an import runs the module's code: anything can fail there, sys.exit too
    failure = f"it called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
    raise RewardSpecError(f"task.reward[{i}]={name!r}: module {module_name!r} cannot be imported ({failure}); put"
                          " it on PYTHONPATH, fix the name, or fix the module") from None
  for part in attribute.split("."):
    try:
      target = getattr(target, part)
    except AttributeError:
      raise RewardSpecError(f"task.reward[{i}]={name!r}: module {module_name!r} has no {attribute!r}; fix the"
                            " function's name") from None
    except Exception as e:  # a module's __getattr__ runs its code
      raise RewardSpecError(f"task.reward[{i}]={name!r}: looking up {attribute!r} in module {module_name!r} raised"
                            f" {type(e).__name__}: {e}; fix the module") from None
  if not callable(target):
    raise RewardSpecError(f"task.reward[{i}]={name!r} is a {type(target).__name__}, not a function; name a function"
                          " fn(prompts, completions, **kwargs) that returns one float per completion")
  return target


def check_signature(i: int, name: str, fn: RewardFn, columns: Sequence[str] = ()) -> None:
  """``fn`` must take what the loop passes (Tunix's reward arguments, and those of the dataset's ``columns`` it
  names), else every step would fail the same way."""
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # a builtin without a signature: its first call tells
    return
  rows = {column: [] for column in accepted_names(fn, columns)}
  try:
    signature.bind(prompts=[], completions=[], answer=[], mode="train", **rows)
  except TypeError as e:
    fields = f"; the dataset's rows also give {', '.join(columns)}" if columns else ""
    raise RewardSpecError(f"task.reward[{i}]={name!r} cannot be called as fn(prompts=..., completions=...,"
                          f" answer=..., mode=...) ({e}); give it Tunix's reward signature"
                          f" fn(prompts, completions, **kwargs){fields}") from None

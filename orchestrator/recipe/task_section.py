"""The recipe's ``task`` section: the live loop's task and its reward, checked by building them.

Validating this section makes the built-in task (its held-out split counted) or, for a dataset, checks its
keys and its reward entries (the rows are read with the model's tokenizer, which ``Recipe.validate`` knows);
nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import math

from orchestrator.recipe.checks import RecipeError
from orchestrator.tasks import datasets as datasets_lib
from orchestrator.tasks import rewards as rewards_lib
from orchestrator.tasks.tasks import MAX_PROMPT_LENGTH, TASKS, make_task, split_sizes
from orchestrator.tasks.tokenizer import CharTokenizer


#: Each task's size keys (``task.*``); ``TaskSection.make`` passes these to the task.
TASK_SIZE_KEYS = {"modular_addition": ("modulus",), "reverse": ("letters", "length"),
                  "first_letter": ("letters", "length")}
#: The range a recipe may give each ``task.*`` number.
TASK_RANGES = {"modulus": (2, 999), "length": (1, 10), "letters": (2, 26), "eval_prompts": (1, 4096)}


#: ``task.name`` for a file of one's own prompts (``orchestrator.tasks.datasets``); the others are ``TASKS``.
DATASET = "dataset"
#: The ``task.*`` keys only a dataset reads, unset by default: a built-in task refuses them.
DATASET_ONLY_KEYS = ("path", "eval_path", "max_prompt_tokens", "max_completion_tokens", "max_tokens_field")
#: Tokens a chat template's text may gain where a built-in prompt joins it (its two joins, two each).
TEMPLATE_JOIN_TOKENS = 4
#: The range of ``task.max_prompt_tokens`` and ``task.max_completion_tokens`` (they size the sampler's cache).
TOKEN_RANGES = {"max_prompt_tokens": (2, datasets_lib.MAX_DERIVED_TOKENS),
                "max_completion_tokens": (1, datasets_lib.MAX_DERIVED_TOKENS)}
#: The range of ``task.eval_pass_k``: completions sampled per held-out prompt at an evaluation during the run.
EVAL_PASS_K_RANGE = (1, 64)
#: The longest ``task.reward_timeout_s`` (a day): a limit is a limit.
MAX_REWARD_TIMEOUT_S = 86_400


@dataclasses.dataclass
class TaskSection:
  """The live loop's task (``rollouts.source: sampler``): its name and sizes, or a file of prompts; and its reward."""

  name: str = "modular_addition"  # modular_addition | reverse | first_letter | dataset
  modulus: int = 7  # modular_addition: answers 0 .. modulus-1
  length: int = 3  # reverse, first_letter: the word's length
  letters: int = 4  # reverse, first_letter: the alphabet's size
  eval_prompts: int = 64  # held-out prompts for the greedy evaluation at the start and the end
  # Evaluations during the run: after every eval_every-th optimizer step (None: only at the start and the end),
  # greedy and, with eval_pass_k, pass@k over k sampled completions per prompt.
  eval_every: int | None = None
  eval_pass_k: int | None = None
  # name: dataset — prompts and answers read from a file (orchestrator.tasks.datasets).
  path: str | None = None  # a JSONL (.jsonl) or Parquet (.parquet) file, one prompt per row
  prompt_field: str = "prompt"
  answer_field: str = "answer"
  eval_fraction: float = 0.1  # held out by a hash of the prompt (unless eval_path gives the evaluation prompts)
  eval_path: str | None = None  # the evaluation prompts; then nothing of path is held out
  max_prompt_tokens: int | None = None  # None: the longest prompt's (bos included)
  max_completion_tokens: int | None = None  # None: the longest answer's
  # A row field giving that row's own completion limit, in [1, max_completion_tokens]; None: every row's is that.
  max_tokens_field: str | None = None
  # The training reward (orchestrator.tasks.rewards): built-ins (exact, math, format) or package.module:function,
  # summed with reward_weights (default all 1.0). None listed: the task's own (a dataset's: exact).
  reward: list[str] = dataclasses.field(default_factory=list)
  reward_weights: list[float] = dataclasses.field(default_factory=list)
  # Seconds one call of a reward function (and the import of its module) may take; longer ends the run (refuses).
  reward_timeout_s: float = rewards_lib.DEFAULT_TIMEOUT_S
  format_pattern: str | None = None  # format: re.fullmatch against the completion, surrounding whitespace stripped

  def validate(self) -> None:
    if self.name != DATASET and self.name not in TASKS:
      raise RecipeError(f"task.name={self.name!r} is not a task; use one of"
                        f" {', '.join(sorted([*TASKS, DATASET]))}")
    for key, (low, high) in TASK_RANGES.items():
      value = getattr(self, key)
      if not low <= value <= high:
        raise RecipeError(f"task.{key}={value} is out of range: it must be in [{low}, {high}]")
    self._check_evaluations()
    if not (math.isfinite(self.reward_timeout_s) and 0 < self.reward_timeout_s <= MAX_REWARD_TIMEOUT_S):
      raise RecipeError(f"task.reward_timeout_s={self.reward_timeout_s} is out of range: it must be a number of"
                        f" seconds in (0, {MAX_REWARD_TIMEOUT_S:,}], how long one reward call may take")
    for i, weight in enumerate(self.reward_weights):
      if not abs(weight) <= rewards_lib.FLOAT32_MAX:
        raise RecipeError(f"task.reward_weights[{i}]={weight:g} is past float32's range (|weight| <="
                          f" {rewards_lib.FLOAT32_MAX:.4g}), which the weighted rewards are held in; give a"
                          " smaller weight")
    if self.name == DATASET:
      self._check_dataset_keys()
    else:
      self._check_built_in_keys()
      self._check_splits()
    if self.name != DATASET:
      self.make_reward(self.make())
    elif self.reward or self.reward_weights:  # the entries now; the rows are read with the model's tokenizer,
      self.make_reward(None)                  # which Recipe.validate knows

  def _check_evaluations(self) -> None:
    if self.eval_every is not None and not 1 <= self.eval_every <= 10**9:
      raise RecipeError(f"task.eval_every={self.eval_every} is out of range: it must be a whole number of optimizer"
                        " steps >= 1 (evaluate after every N-th step), or leave it unset to evaluate only at the"
                        " start and the end")
    if self.eval_pass_k is not None:
      low, high = EVAL_PASS_K_RANGE
      if not low <= self.eval_pass_k <= high:
        raise RecipeError(f"task.eval_pass_k={self.eval_pass_k} is out of range: it must be in [{low}, {high}],"
                          " the completions sampled per held-out prompt for pass@k")
      if self.eval_every is None:
        raise RecipeError(f"task.eval_pass_k={self.eval_pass_k} is measured at the evaluations during the run,"
                          " and task.eval_every is unset; set task.eval_every=N, or drop task.eval_pass_k")

  def _check_dataset_keys(self) -> None:
    if not self.path:
      raise RecipeError("task.name=dataset needs task.path=FILE: a JSONL (.jsonl) or Parquet (.parquet) file with"
                        f" a {self.prompt_field!r} and an {self.answer_field!r} field per row")
    if self.eval_path is None and not 0 < self.eval_fraction < 1:
      raise RecipeError(f"task.eval_fraction={self.eval_fraction} is out of range: it must be in (0, 1), the share"
                        " of task.path's prompts held out for the evaluation (or give them in task.eval_path)")
    for key, (low, high) in TOKEN_RANGES.items():
      value = getattr(self, key)
      if value is not None and not low <= value <= high:
        raise RecipeError(f"task.{key}={value} is out of range: it must be in [{low}, {high}]")

  def _check_built_in_keys(self) -> None:
    for key in DATASET_ONLY_KEYS:
      if getattr(self, key) is not None:
        raise RecipeError(f"task.{key} is set but task.name={self.name} is a built-in task (its prompts and sizes are"
                          f" its own); set task.name=dataset to read prompts from a file, or drop task.{key}")

  def make_reward(self, task):
    """The training reward ``task.reward`` and ``task.reward_weights`` describe, for ``task`` (``make()``)."""
    try:
      return rewards_lib.make_reward(task, self.reward, self.reward_weights, self.format_pattern,
                                     timeout_s=self.reward_timeout_s)
    except rewards_lib.RewardSpecError as e:
      raise RecipeError(str(e)) from None

  def _sizes(self, **changed: int) -> dict[str, int]:
    return {key: changed.get(key, getattr(self, key)) for key in TASK_SIZE_KEYS[self.name]}

  def make(self, tokenizer=None):
    """The task (a ``tasks.Task``); a dataset is read and checked here, every time, with ``tokenizer`` (the
    sampler's; default the character tokenizer)."""
    if self.name != DATASET:
      task = make_task(self.name, **self._sizes())
      if tokenizer is not None and getattr(tokenizer, "format_prompt", lambda prompt: prompt)(""):
        # A chat template: a built-in prompt (at most MAX_PROMPT_LENGTH ASCII characters, so at most
        # that many tokens) inside the chat template, plus room for the template's own tokens to split
        # differently where the prompt joins them. The instance is this call's own, so nothing else sees it.
        bound = datasets_lib.prompt_tokens(tokenizer, "") + MAX_PROMPT_LENGTH + TEMPLATE_JOIN_TOKENS
        object.__setattr__(task, "max_prompt_tokens", bound)
      return task
    try:
      return datasets_lib.load_task(path=self.path, eval_path=self.eval_path, prompt_field=self.prompt_field,
                                    answer_field=self.answer_field, eval_fraction=self.eval_fraction,
                                    max_prompt_tokens=self.max_prompt_tokens,
                                    max_completion_tokens=self.max_completion_tokens,
                                    tokenizer=tokenizer or CharTokenizer(), reward=self.reward,
                                    max_tokens_field=self.max_tokens_field)
    except datasets_lib.DatasetError as e:
      raise RecipeError(str(e)) from None

  def _check_splits(self) -> None:
    """A prompt is drawn again until it lands on its split (held out by a hash of the prompt), so sizes whose
    few prompts all land on one side would make every draw from the other spin forever: refused here."""
    task = TASKS[self.name](**self._sizes())
    counted = split_sizes(task)
    if counted.empty is None:
      return
    given = " ".join(f"task.{key}={value}" for key, value in self._sizes().items())
    fixes = [fix for fix in map(self._nearest_working, TASK_SIZE_KEYS[self.name]) if fix]
    raise RecipeError(
        f"task.name={self.name} {given} leaves the {counted.empty} split empty: its"
        f" {counted.train + counted.eval} prompts split {counted.train} for training and {counted.eval} for"
        f" evaluation (about {task.eval_share:.0%} are held out, by a hash of the prompt), so a draw from the"
        f" {counted.empty} split would never end; use {' or '.join(fixes) or 'larger sizes'}")

  def _nearest_working(self, key: str) -> str | None:
    """The value of ``key`` nearest to this one (the others kept) whose splits both hold a prompt, with their
    sizes; None when there is none in range."""
    low, high = TASK_RANGES[key]
    current = getattr(self, key)
    for distance in range(1, high - low + 1):
      for value in (current + distance, current - distance):
        if low <= value <= high:
          counted = split_sizes(TASKS[self.name](**self._sizes(**{key: value})), enough=1000)
          if counted.empty is None:
            more = "" if counted.exact else " or more"
            return (f"task.{key}={value} ({counted.train}{more} training, {counted.eval}{more} evaluation"
                    " prompts)")
    return None

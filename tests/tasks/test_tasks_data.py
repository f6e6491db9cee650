"""Prompt datasets (``task.name: dataset``) and the rewards a recipe chooses (``task.reward``).

Most tests are pure Python on files written to tmp_path; a few near the end run
``run_rl`` on the shipped example dataset for a couple of steps. The refusals
run end to end in tests/app/test_refusals.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import textwrap
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.app import cli
from orchestrator.tasks import datasets, rewards
from orchestrator.tasks.hf_tokenizer import HFTokenizer, char_tokenizer_json
from orchestrator.tasks.rewards import RewardError, make_reward
from orchestrator.tasks.tasks import FirstLetter, ModularAddition, Problem, group_advantages, split_sizes
from orchestrator.recipe.task_section import TaskSection

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "id": f"{a}{b}"} for a in range(7) for b in range(7)]


def write_rows_text(rows):
  return "".join(json.dumps(r) + "\n" for r in rows)


def write_jsonl(path, rows):
  path.write_text(write_rows_text(rows))
  return str(path)


def write_parquet(path, rows):
  pq.write_table(pa.Table.from_pylist(rows), path)
  return str(path)


@pytest.fixture
def jsonl(tmp_path):
  return write_jsonl(tmp_path / "prompts.jsonl", ROWS)


@pytest.fixture
def fresh_module(tmp_path, monkeypatch):
  """Writes ``NAME.py`` into tmp_path (on sys.path) and returns NAME; the module is forgotten afterwards."""
  names = []

  def write(name, source):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    names.append(name)
    return name

  monkeypatch.syspath_prepend(str(tmp_path))
  yield write
  for name in names:
    sys.modules.pop(name, None)


# ---------------------------------------------------------------------------- reading and drawing


@pytest.mark.spec
def test_jsonl_and_parquet_give_the_same_task(tmp_path, jsonl):
  parquet = write_parquet(tmp_path / "prompts.parquet", ROWS)
  a, b = datasets.load_task(path=jsonl), datasets.load_task(path=parquet)
  assert a == b
  assert len(a.train_problems) + len(a.eval_problems) == len(ROWS) and a.eval_problems
  assert a.max_prompt_tokens == len("6+6=") + 1 and a.max_answer_length == 2  # sizes from the data: bos counted
  assert a.answer_alphabet == "0123456789 "  # the answers' characters, and a space to pad a shorter one
  assert split_sizes(a).empty is None


@pytest.mark.spec
def test_other_fields_and_given_sizes_are_used(tmp_path):
  rows = [{"question": f"{a}*{b}?", "solution": str(a * b)} for a in range(5) for b in range(5)]
  task = datasets.load_task(path=write_jsonl(tmp_path / "q.jsonl", rows), prompt_field="question",
                            answer_field="solution", max_prompt_tokens=12, max_completion_tokens=4)
  assert task.max_prompt_tokens == 12 and task.max_answer_length == 4
  assert {p.prompt for p in task.train_problems} <= {r["question"] for r in rows}


@pytest.mark.spec
def test_a_row_s_own_completion_limit_is_read_from_the_field_named(tmp_path):
  rows = [dict(row, limit=1 + i % 2) for i, row in enumerate(ROWS)]
  path = write_jsonl(tmp_path / "limits.jsonl", rows)
  task = datasets.load_task(path=path, max_completion_tokens=4, max_tokens_field="limit")
  limits = {row["prompt"]: row["limit"] for row in rows}
  assert all(p.max_new_tokens == limits[p.prompt] for p in (*task.train_problems, *task.eval_problems))
  assert task.max_answer_length == 4  # the sampler's size is still the task's
  assert all(p.max_new_tokens is None for p in datasets.load_task(path=path).train_problems)  # unnamed: unread
  assert Problem("1+1=", "2", max_new_tokens=1) == Problem("1+1=", "2")  # a problem is its prompt and answer
  with pytest.raises(datasets.DatasetError, match=r"limits.jsonl line 1 has no field 'budget' \(its other fields:"
                                                  r" 'id', 'limit'\), which task.max_tokens_field=budget names"):
    datasets.load_task(path=path, max_tokens_field="budget")


@pytest.mark.engine
def test_draws_are_a_pure_function_of_seed_split_and_index(jsonl):
  task, again = datasets.load_task(path=jsonl), datasets.load_task(path=jsonl)  # a resumed run: a new process
  n = len(task.train_problems)
  draws = [task.problem(0, "train", i) for i in range(2 * n)]
  assert draws == [again.problem(0, "train", i) for i in range(2 * n)]
  assert task.problem(0, "train", 7) == again.problem(0, "train", 7)  # one index alone, not only in sequence
  # Each epoch is the whole split once, in its own order; another seed shuffles otherwise.
  assert sorted(map(str, draws[:n])) == sorted(map(str, task.train_problems)) == sorted(map(str, draws[n:]))
  assert draws[:n] != draws[n:]
  assert draws[:n] != [task.problem(1, "train", i) for i in range(n)]
  held_out = {task.problem(0, "eval", i).prompt for i in range(3 * len(task.eval_problems))}
  assert held_out == {p.prompt for p in task.eval_problems}
  assert not held_out & {p.prompt for p in draws}
  assert all(task.held_out(p) for p in held_out) and not any(task.held_out(p.prompt) for p in draws)


@pytest.mark.spec
def test_an_eval_file_holds_out_its_prompts_and_nothing_of_the_training_file(tmp_path, jsonl):
  evaluation = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "1+2=", "answer": "3"}, {"prompt": "9+9=",
                                                                                         "answer": "18"}])
  task = datasets.load_task(path=jsonl, eval_path=evaluation)
  assert [p.prompt for p in task.eval_problems] == ["1+2=", "9+9="]
  # Everything of task.path trains, except a prompt the evaluation asks (it is never trained on).
  assert sorted(p.prompt for p in task.train_problems) == sorted(r["prompt"] for r in ROWS if r["prompt"] != "1+2=")


@pytest.mark.spec
def test_a_bad_row_is_named_with_its_line_and_fields(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"question": "2+2=", "answer": "4"}\n')
  with pytest.raises(datasets.DatasetError, match=r"bad.jsonl line 3 has no field 'prompt' \(its fields: 'question',"
                                                  r" 'answer'\); name the field to read with task.prompt_field="):
    datasets.load_task(path=str(path))


@pytest.mark.spec
@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_file_that_would_block_or_never_end_is_refused_before_it_is_read(tmp_path, kind, suffix):
  path = tmp_path / f"prompts{suffix}"
  if kind == "fifo":
    os.mkfifo(path)  # opened for reading, it would block until a writer came
  else:
    path.symlink_to("/dev/zero")  # read whole, it would fill memory
  what = "a FIFO (named pipe)" if kind == "fifo" else "a character device"
  with pytest.raises(datasets.DatasetError, match=f"task.path's file {re.escape(str(path))} is {re.escape(what)},"
                                                  " which a run would block on or read without end"):
    datasets.load_task(path=str(path))
  path.unlink()  # the negative control: a regular file of that name is read
  (write_jsonl if suffix == ".jsonl" else write_parquet)(path, ROWS)
  assert datasets.load_task(path=str(path)).train_problems


@pytest.mark.spec
def test_an_eval_file_that_would_block_is_refused_too(tmp_path, jsonl):
  evaluation = tmp_path / "eval.jsonl"
  os.mkfifo(evaluation)
  with pytest.raises(datasets.DatasetError, match="task.eval_path's file .*eval.jsonl is a FIFO"):
    datasets.load_task(path=jsonl, eval_path=str(evaluation))
  evaluation.unlink()  # the negative control: a regular file of that name is read
  assert datasets.load_task(path=jsonl, eval_path=write_jsonl(evaluation, ROWS[:3])).eval_problems


@pytest.mark.spec
def test_a_file_over_the_bound_is_refused_naming_it(tmp_path, jsonl, monkeypatch):
  size = os.path.getsize(jsonl)
  monkeypatch.setattr(datasets, "MAX_DATASET_BYTES", size)
  assert datasets.load_task(path=jsonl).train_problems  # at the bound: read
  monkeypatch.setattr(datasets, "MAX_DATASET_BYTES", size - 1)
  with pytest.raises(datasets.DatasetError, match=f"is {size:,} bytes, over the {size - 1:,} bytes read for it"):
    datasets.load_task(path=jsonl)


@pytest.mark.spec
@pytest.mark.parametrize("dictionary,size", [(True, "more than 50,000"), (False, "[0-9,]+")])
def test_a_parquet_file_that_unpacks_past_the_bound_is_refused(tmp_path, monkeypatch, dictionary, size):
  """Compressed, the padding is small; as columns it is not (a dictionary holds it once, the rows repeat it)."""
  path = tmp_path / "prompts.parquet"
  pq.write_table(pa.Table.from_pylist([{**row, "pad": "x" * 2000} for row in ROWS]), path, compression="zstd",
                 use_dictionary=dictionary)
  monkeypatch.setattr(datasets, "MAX_DATASET_BYTES", 50_000)
  assert path.stat().st_size < 50_000  # the file is within the bound; its columns are not
  with pytest.raises(datasets.DatasetError, match=f"prompts.parquet unpacks to {size} bytes of columns, over"
                                                  " the 50,000 bytes read for a prompt file"):
    datasets.load_task(path=str(path))
  write_parquet(path, ROWS)  # the negative control: the same rows unpadded are read
  assert datasets.load_task(path=str(path)).train_problems


@pytest.mark.spec
@pytest.mark.parametrize("line,message", [
    ("[" * 100_000, "nests its brackets deeper than the reader's limit"),
    ('{"prompt": "1+1=", "answer": "2", "score": NaN}', "holds the literal NaN, which JSON does not have"),
    ('{"prompt": "1+1=", "answer": "2", "score": -Infinity}', "holds the literal -Infinity"),
    ('{"prompt": "1+1=", "answer": "2", "score": 1e400}', "holds the number 1e400, too large for a float"),
    ('{"prompt": "1+1=", "answer": "2", "id": ' + "7" * 5000 + "}", "holds a value that cannot be read"),
])
def test_every_way_a_line_fails_to_parse_is_one_line_naming_it(tmp_path, line, message):
  path = tmp_path / "bad.jsonl"
  path.write_text(write_rows_text(ROWS[:20]) + line + "\n")
  with pytest.raises(datasets.DatasetError) as e:
    datasets.load_task(path=str(path))
  assert f"bad.jsonl line 21 {message}" in str(e.value) and "\n" not in str(e.value)
  path.write_text(write_rows_text(ROWS[:20]) + '{"prompt": "1+1=", "answer": "2", "score": 1e300}\n')
  assert datasets.load_task(path=str(path))  # the negative control: a large finite number is read


@pytest.mark.spec
@pytest.mark.parametrize("answer", ["", "  ", "\t\n"])
def test_an_answer_that_cannot_score_is_refused_naming_its_row(tmp_path, answer):
  rows = [*ROWS[:20], {"prompt": "9+9=", "answer": answer}]
  with pytest.raises(datasets.DatasetError, match=f"empty.jsonl line 21: field 'answer' is {re.escape(repr(answer))},"
                                                  " so no completion can be scored against it"):
    datasets.load_task(path=write_jsonl(tmp_path / "empty.jsonl", rows))
  rows[-1]["answer"] = "0"  # the negative control: a short answer scores
  assert datasets.load_task(path=write_jsonl(tmp_path / "empty.jsonl", rows))


@pytest.mark.spec
def test_math_refuses_an_answer_without_a_number_naming_its_row(tmp_path):
  path = write_jsonl(tmp_path / "words.jsonl", [*ROWS[:20], {"prompt": "9+9=", "answer": "eighteen"}])
  assert datasets.load_task(path=path, reward=["exact"])  # exact compares the text: a word is an answer
  with pytest.raises(datasets.DatasetError, match="words.jsonl line 21: field 'answer' is 'eighteen', which holds no"
                                                  " number, but task.reward lists math"):
    datasets.load_task(path=path, reward=["exact", "math"])


# ---------------------------------------------------------------------------- the built-in rewards


@pytest.mark.spec
@pytest.mark.parametrize("completion,answer,expected", [
    ("7", "7", 1.0), ("  Seven  Days ", "seven days", 1.0), ("ab", "AB", 1.0),
    ("8", "7", 0.0), ("77", "7", 0.0), ("", "7", 0.0), ("seven  day", "seven days", 0.0), (None, "7", 0.0),
])
def test_exact(completion, answer, expected):
  assert rewards.exact(["p"], [completion], answer=[answer]) == [expected]


@pytest.mark.spec
@pytest.mark.parametrize("completion,answer,expected", [
    ("7", "7", 1.0), ("the sum is 1,000", "1000", 1.0), ("1000.0", "1000", 1.0), ("0.75", "3/4", 1.0),
    ("6/8", "0.75", 1.0), (r"so \boxed{42}, not 41", "42", 1.0), ("first 3 then\n#### 12", "12", 1.0),
    ("long working 5 + 7\n#### 12", "#### 12", 1.0), ("-3", "-3", 1.0), ("1 then 2", "2", 1.0),
    ("8", "7", 0.0), ("7 then 8", "7", 0.0), (r"\boxed{41} or 42", "42", 0.0), ("no number", "7", 0.0),
    ("3", "-3", 0.0), ("7", "no number", 0.0), ("1/0", "1", 0.0), (None, "7", 0.0),
])
def test_math(completion, answer, expected):
  assert rewards.math_answer(["p"], [completion], answer=[answer]) == [expected]


@pytest.mark.spec
def test_format_matches_the_whole_stripped_completion():
  reward = make_reward(FirstLetter(), ["format"], [], r"[0-9]+")
  got = reward([Problem("p", "1")] * 5, ["12", " 12 ", "12a", "a12", ""], indices=[0] * 5)
  assert got.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]  # re.fullmatch: a search would take "12a" and "a12"


@pytest.mark.spec
def test_entries_are_a_weighted_sum():
  reward = make_reward(ModularAddition(), ["exact", "math", "format"], [1.0, 0.5, 0.25], r"\d+")
  got = reward([Problem("3+4%7=", "0")] * 3, ["0", "0.0", "x"], indices=[0, 0, 1])
  assert got.tolist() == [1.75, 0.5, 0.0]  # "0.0": the right number, but not digits only


@pytest.mark.spec
def test_a_built_in_task_keeps_its_own_reward_by_default():
  task = ModularAddition()
  problems = [task.problem(0, "train", i) for i in range(20)]
  completions = [p.answer if i % 2 else "9" for i, p in enumerate(problems)]
  own = make_reward(task, [], [], None)(problems, completions, indices=list(range(20)))
  assert own.tolist() == [task.reward(p, c) for p, c in zip(problems, completions)]
  assert 0 < own.sum() < 20


# ---------------------------------------------------------------------------- a function of one's own


@pytest.mark.spec
def test_a_function_of_one_s_own_gets_the_micro_batch_with_the_answers_as_keywords(fresh_module):
  name = fresh_module("my_rewards_keywords", """
      calls = []

      def score(prompts, completions, answer, **kwargs):
        calls.append(dict(prompts=prompts, completions=completions, answer=answer, **kwargs))
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]
      """)
  reward = make_reward(ModularAddition(), [f"{name}:score"], [], None)
  problems = [Problem("1+1=", "2")] * 2 + [Problem("2+2=", "4")] * 2
  got = reward(problems, ["2", "3", "4 ", "4"], indices=[6, 6, 7, 7])
  assert got.tolist() == [1.0, 0.0, 1.0, 1.0]
  (call,) = sys.modules[name].calls  # one call for the whole micro-batch
  assert call == {"prompts": ["1+1=", "1+1=", "2+2=", "2+2="], "completions": ["2", "3", "4 ", "4"],
                  "answer": ["2", "2", "4", "4"], "mode": "train"}


@pytest.mark.spec
def test_a_dataset_rows_other_fields_reach_the_functions_that_take_them(tmp_path, fresh_module):
  """verl's extra_info: each other field as a keyword list aligned with the completions, to a function that names
  it or takes **kwargs; one that does neither is called as before; the reward arguments are never replaced."""
  rows = [dict(r, mode="not-train", level=len(r["prompt"])) for r in ROWS]
  task = datasets.load_task(path=write_jsonl(tmp_path / "rows.jsonl", rows))
  name = fresh_module("my_rewards_rows", """
      calls = {}

      def named(prompts, completions, answer, id, mode):
        calls["named"] = dict(id=id, mode=mode)
        return [0.0] * len(completions)

      def anything(prompts, completions, **kwargs):
        calls["anything"] = kwargs
        return [0.0] * len(completions)

      def plain(prompts, completions, answer, mode):
        calls["plain"] = True
        return [0.0] * len(completions)
      """)
  reward = make_reward(task, [f"{name}:named", f"{name}:anything", f"{name}:plain"], [], None)
  problems = [task.train_problems[i] for i in (0, 0, 1, 1)]
  reward(problems, ["1", "2", "3", "4"], indices=[0, 0, 1, 1])
  calls, ids = sys.modules[name].calls, [p.extra["id"] for p in problems]
  assert calls["named"] == {"id": ids, "mode": "train"}
  assert calls["anything"]["id"] == ids and calls["anything"]["level"] == [len(p.prompt) for p in problems]
  assert calls["anything"]["mode"] == "train" and calls["plain"]
  # a micro-batch whose rows all lack a field still passes it, as None for each completion
  bare = [Problem(p.prompt, p.answer) for p in problems]
  reward(bare, ["1", "2", "3", "4"], indices=[0, 0, 1, 1])
  assert sys.modules[name].calls["named"] == {"id": [None] * 4, "mode": "train"}


@pytest.mark.spec
def test_a_function_asking_for_a_field_the_rows_lack_is_refused_naming_the_fields(jsonl, fresh_module):
  name = fresh_module("my_rewards_missing", """
      def score(prompts, completions, answer, difficulty):
        return [0.0] * len(completions)
      """)
  with pytest.raises(rewards.RewardSpecError, match="missing a required argument: 'difficulty'.*the dataset's rows"
                                                    " also give id"):
    make_reward(datasets.load_task(path=jsonl), [f"{name}:score"], [], None)


@pytest.mark.spec
@pytest.mark.parametrize("body,message", [
    ("raise ValueError('no grader')", "task.reward entry '{name}:score' raised ValueError: no grader on the"
                                      " micro-batch of prompt indices 6..7; fix the function"),
    ("return [1.0]", "task.reward entry '{name}:score' returned 1 values for 4 completions on the micro-batch of"
                     " prompt indices 6..7; return a list, a tuple or a 1-D numpy array of numbers"),
    ("return [0.0, 0.0, float('nan'), 0.0]", "task.reward entry '{name}:score' returned nan for completion 2"
                                             " (prompt index 7: '2+2='); a reward must be a finite real number"),
    ("return [0.0, 'good', 0.0, 0.0]", "returned 'good' for completion 1 (prompt index 6: '1+1=')"),
    ("return None", "returned NoneType, not a list of floats"),
])
def test_a_failing_function_is_named_with_the_prompt_index(fresh_module, body, message):
  name = fresh_module(f"my_rewards_failing_{abs(hash(body))}", f"""
      def score(prompts, completions, **kwargs):
        {body}
      """)
  reward = make_reward(ModularAddition(), ["exact", f"{name}:score"], [], None)
  problems = [Problem("1+1=", "2")] * 2 + [Problem("2+2=", "4")] * 2
  with pytest.raises(RewardError) as e:
    reward(problems, ["2", "3", "4", "4"], indices=[6, 6, 7, 7])
  assert message.format(name=name) in str(e.value)


PROBLEMS = [Problem("1+1=", "2")] * 2 + [Problem("2+2=", "4")] * 2


def _own(body: str, fresh_module, timeout_s: float = rewards.DEFAULT_TIMEOUT_S):
  """A reward of one entry, ``score``, whose body is ``body`` (its own module)."""
  name = fresh_module(f"my_rewards_{abs(hash(body))}", f"""
      import sys, time
      import numpy as np

      def score(prompts, completions, **kwargs):
        {body}
      """)
  return make_reward(ModularAddition(), [f"{name}:score"], [], None, timeout_s=timeout_s), name


@pytest.mark.spec
@pytest.mark.parametrize("body,message", [
    ("return {0.5: 'a', 10.0: 'b', 20.0: 'c', 31.5: 'd'}", "returned dict, not a list of floats,"),
    ("return '1111'", "returned str, not a list of floats,"),
    ("return (x for x in [1.0] * 4)", "returned generator, not a list of floats,"),
    ("return {1.0, 2.0, 3.0, 4.0}", "returned set, not a list of floats,"),
    ("return np.ones((4, 1))", "returned a numpy array of shape (4, 1)"),
    ("return [1.0, 1j, 0.0, 0.0]", "returned 1j for completion 1"),
    ("return [1.0, np.complex64(1), 0.0, 0.0]", "returned np.complex64("),
    ("sys.exit(0)", "raised SystemExit: 0 on the micro-batch of prompt indices 6..7 of step 3"),
])
def test_a_reward_that_does_not_return_one_real_number_per_completion_stops_the_run(fresh_module, body, message):
  reward, name = _own(body, fresh_module)
  with pytest.raises(RewardError) as e:
    reward(PROBLEMS, ["2", "3", "4", "4"], indices=[6, 6, 7, 7], step=3)
  assert f"task.reward entry '{name}:score' {message}" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.spec
def test_a_reward_or_weighted_sum_past_float32_is_refused_naming_it_not_as_a_nan_advantage(fresh_module):
  """The trainer holds rewards in float32: 1e39 would be inf there, and its group's advantages nan. The reward
  that returned it is named (or, for a weighted sum, the weights); negative control: 3e38 alone passes."""
  big, name = _own("return [1e39, 0.0, 0.0, 0.0]", fresh_module)
  with pytest.raises(RewardError) as e:
    big(PROBLEMS, ["2", "3", "4", "4"], indices=[6, 6, 7, 7], step=3)
  assert str(e.value).startswith(f"task.reward entry '{name}:score' returned 1e+39 for completion 0 (prompt index 6:")
  assert "past float32's range" in str(e.value)
  fine, name = _own("return [3e38, 0.0, 0.0, 0.0]", fresh_module)
  assert fine(PROBLEMS, ["2", "3", "4", "4"], indices=[6, 6, 7, 7])[0] == np.float32(3e38)
  doubled = make_reward(ModularAddition(), [f"{name}:score", f"{name}:score"], [], None)
  with pytest.raises(RewardError, match=r"the weighted reward \('.*:score' × 1, '.*:score' × 1\) of completion 0"):
    doubled(PROBLEMS, ["2", "3", "4", "4"], indices=[6, 6, 7, 7], step=3)


@pytest.mark.engine
def test_large_rewards_keep_their_advantages():
  """Rewards near 1e20: float32's squares would overflow the group std and zero every advantage."""
  adv = group_advantages(np.array([1e20, 0, 0, 0], np.float64), 4)
  assert np.all(np.isfinite(adv)) and adv[0] > 0 > adv[1]


@pytest.mark.spec
@pytest.mark.parametrize("body", ["return [1.0, 0, 0.5, 2]", "return (1.0, 0, 0.5, 2)",
                                  "return np.array([1.0, 0, 0.5, 2], np.float32)",
                                  "return [True, False, np.float64(0.5), np.int64(2)]"])
def test_lists_tuples_1d_arrays_and_bools_are_rewards(fresh_module, body):
  """The negative control of the refusals above: every accepted form gives the same rewards (a bool: 1 or 0)."""
  reward, _ = _own(body, fresh_module)
  assert reward(PROBLEMS, ["2", "3", "4", "4"], indices=[6, 6, 7, 7], step=3).tolist() == [1.0, 0.0, 0.5, 2.0]


@pytest.mark.spec
def test_a_reward_call_past_its_time_limit_stops_the_run_naming_it_and_the_step(fresh_module):
  slow, name = _own("time.sleep(float(completions[0])); return [1.0] * len(completions)", fresh_module,
                    timeout_s=0.2)
  with pytest.raises(RewardError) as e:
    slow(PROBLEMS, ["30", "3", "4", "4"], indices=[6, 6, 7, 7], step=3)  # sleeps 30 s, far past 0.2 s
  assert str(e.value) == (f"task.reward entry '{name}:score' did not return within task.reward_timeout_s=0.2 s on"
                          " the micro-batch of prompt indices 6..7 of step 3; make it faster, or raise"
                          " task.reward_timeout_s")
  patient = make_reward(ModularAddition(), [f"{name}:score"], [], None, timeout_s=60)
  assert patient(PROBLEMS, ["0", "3", "4", "4"], indices=[6, 6, 7, 7]).tolist() == [1.0] * 4  # the control


@pytest.mark.spec
def test_a_reward_call_is_given_up_once_its_run_closes():
  entered, release, closing = threading.Event(), threading.Event(), threading.Event()

  def stuck(prompts, completions, **_):
    entered.set()
    release.wait(60)
    return [1.0] * len(completions)

  reward = rewards.Reward((rewards.Term("my_rewards:stuck", stuck),), timeout_s=3600)
  caller = threading.Thread(target=lambda: outcome.append(_raised(reward, closing)), daemon=True)
  outcome = []
  try:
    caller.start()
    assert entered.wait(60)
    caller.join(0.3)
    assert caller.is_alive()  # the control: the call is still waited for while the run goes on
    closing.set()
    caller.join(60)
    assert not caller.is_alive()
    (error,) = outcome
    assert isinstance(error, rewards.CallCancelled)
    assert str(error).startswith("task.reward entry 'my_rewards:stuck' on the micro-batch of prompt indices 6..7 of"
                                 " step 3, which had run ")
  finally:
    release.set()


def _raised(reward, closing):
  try:
    reward(PROBLEMS, ["2", "3", "4", "4"], indices=[6, 6, 7, 7], step=3, cancelled=closing.is_set)
  except BaseException as e:  # pylint: disable=broad-except  # what the caller saw is the test's subject
    return e
  return None


@pytest.mark.spec
@pytest.mark.parametrize("source,message", [
    ("import sys\nsys.exit(0)\n", "module '{name}' cannot be imported (it called sys.exit(0))"),
    ("raise SystemExit('no grader here')\n", "module '{name}' cannot be imported (it called sys.exit('no grader here'))"),
    ("class Odd(BaseException): pass\nraise Odd('odd')\n", "module '{name}' cannot be imported (Odd: odd)"),
    ("import time\ntime.sleep(30)\n", "importing module '{name}' did not return within task.reward_timeout_s=0.2 s"),
])
def test_a_module_whose_import_exits_or_hangs_is_refused(fresh_module, source, message):
  name = fresh_module(f"my_rewards_import_{abs(hash(source))}", source + "def score(prompts, completions, **kw):\n"
                                                                          "  return [0.0] * len(completions)\n")
  with pytest.raises(rewards.RewardSpecError) as e:
    make_reward(ModularAddition(), [f"{name}:score"], [], None, timeout_s=0.2)
  assert f"task.reward[0]='{name}:score': " + message.format(name=name) in str(e.value)


@pytest.mark.spec
def test_run_rl_refuses_a_module_that_exits_at_import_before_writing_anything(tmp_path, fresh_module, capsys):
  name = fresh_module("my_rewards_exit_at_import", "import sys\nsys.exit(0)\n")
  out = tmp_path / "run"
  assert cli.main(["task.reward=[exact, my_rewards_exit_at_import:score]", "--out", str(out),
                   "run.reserve_host_core=false"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == (f"run_rl: error: task.reward[1]='{name}:score': module '{name}' cannot be imported (it called"
                 " sys.exit(0)); put it on PYTHONPATH, fix the name, or fix the module")
  assert not out.exists()


@pytest.mark.spec
def test_a_module_whose_attribute_lookup_raises_is_refused(fresh_module):
  name = fresh_module("my_rewards_lazy", "def __getattr__(attribute):\n  raise RuntimeError('lazy ' + attribute)\n")
  with pytest.raises(rewards.RewardSpecError, match=f"task.reward\\[0\\]='{name}:score': looking up 'score' in module"
                                                    f" '{name}' raised RuntimeError: lazy score; fix the module"):
    make_reward(ModularAddition(), [f"{name}:score"], [], None)


@pytest.mark.spec
def test_a_module_that_imports_in_time_is_taken(fresh_module):
  name = fresh_module("my_rewards_import_quick", "def score(prompts, completions, **kw):\n"
                                                 "  return [0.5] * len(completions)\n")
  reward = make_reward(ModularAddition(), [f"{name}:score"], [], None, timeout_s=60)
  assert reward(PROBLEMS, ["2", "3", "4", "4"], indices=[6, 6, 7, 7]).tolist() == [0.5] * 4


@pytest.mark.spec
def test_math_on_a_built_in_task_without_numeric_answers_is_refused():
  assert make_reward(ModularAddition(), ["math"], [], None)  # the control: its answers are numbers
  with pytest.raises(rewards.RewardSpecError, match="task.reward lists math, but task.name=first_letter's answers"
                                                    " hold no number"):
    make_reward(FirstLetter(), ["math"], [], None)


@pytest.mark.spec
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), 86_401.0])
def test_the_reward_time_limit_is_a_positive_finite_number_of_seconds(value):
  TaskSection(reward_timeout_s=0.5).validate()  # the control
  with pytest.raises(recipe_lib.RecipeError, match=f"task.reward_timeout_s={value} is out of range: it must be a"
                                                   r" number of seconds in \(0, 86,400\]"):
    TaskSection(reward_timeout_s=value).validate()


@pytest.mark.spec
def test_the_recipe_checks_every_entry_before_anything_runs(jsonl):
  section = TaskSection(name="dataset", path=jsonl, reward=["exact", "math"], reward_weights=[1.0, 2.0])
  section.validate()
  with pytest.raises(recipe_lib.RecipeError, match=r"task.reward\[1\]='mathematics' is not a reward; use one of"
                                                   " exact, format, math, or package.module:function"):
    TaskSection(name="dataset", path=jsonl, reward=["exact", "mathematics"]).validate()


# ---------------------------------------------------------------------------- run_rl on a dataset

LIVE = ["--recipe", "recipes/dataset_example.yaml", "steps=2", "rollouts.groups_per_micro_batch=2", "batch.rows=4",
        "task.eval_prompts=4", "run.reserve_host_core=false"]


@pytest.fixture
def no_env_switches(monkeypatch):
  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)


def _records(run):
  return [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]


@pytest.mark.e2e
def test_run_rl_trains_on_the_example_dataset_to_the_end(tmp_path, no_env_switches):
  run = tmp_path / "run"
  assert cli.main(LIVE + ["--out", str(run)]) == 0
  summary = json.loads((run / "summary.json").read_text())
  assert summary["eval_accuracy_start"] is not None and summary["eval_accuracy_end"] is not None
  records = _records(run)
  assert [r["step"] for r in records] == [0, 1]
  assert all(0.0 <= r["reward_mean"] <= 1.1 and math.isfinite(r["reward_mean"]) for r in records)


@pytest.mark.e2e
@pytest.mark.parametrize("failure,message", [
    ('raise RuntimeError("the grader is down")', "raised RuntimeError: the grader is down"),
    ("time.sleep(120)", "did not return within task.reward_timeout_s=5 s"),  # 5 s: far above a quick call's time
], ids=["raises", "times-out"])
def test_a_reward_that_fails_stops_the_run_naming_it_and_keeps_the_records_before(tmp_path, no_env_switches,
                                                                                  fresh_module, capsys, failure,
                                                                                  message):
  """The example recipe has 2 micro-batches per step of 2 groups each, at staleness 1: the fifth call is step 2's
  first micro-batch (prompt indices 8 and 9), sampled once update 0 is published. The run stops at the first
  boundary that sees the failure: boundary 1, which waits for step 2's rollouts, or boundary 0's later check
  where the sampler got there first (a loaded machine); every record of a step trained before is kept."""
  name = fresh_module(f"my_rewards_step_two_{abs(hash(failure))}", f"""
      import time

      calls = []

      def score(prompts, completions, **kwargs):
        calls.append(len(completions))
        if len(calls) > 4:
          {failure}
        return [0.5] * len(completions)
      """)
  run = tmp_path / "run"
  code = cli.main(LIVE + ["steps=3", f"task.reward=[{name}:score]", "task.reward_weights=[]",
                          "task.reward_timeout_s=5", "--out", str(run)])
  err = capsys.readouterr().err
  assert code == 1, err
  assert (f"the rollout thread failed while sampling step 2: RewardError: task.reward entry '{name}:score' {message}"
          " on the micro-batch of prompt indices 8..9 of step 2" in err), err
  assert "Traceback" not in err
  records = _records(run)
  assert [r["step"] for r in records] in ([0], [0, 1]) and records[0]["reward_mean"] == 0.5  # the function's
  assert records[-1]["loss"] is not None and records[-1]["checkpoint_path"] is None  # trained, not checkpointed


@pytest.mark.spec
@pytest.mark.parametrize("completion, answer, score", [
    (r"so \boxed{\frac{1}{4}}", r"\frac{3}{4}", 0.0),  # the same denominator is not the same number
    (r"so \boxed{\frac{3}{4}}", "3/4", 1.0),
    (r"\boxed{\dfrac{-6}{8}}", "-0.75", 1.0),
    ("#### 42 because 40+2", "42", 1.0),  # the number after ####, not the last in the line
    ("#### 2", "42", 0.0),
])
def test_math_reads_latex_fractions_and_the_number_after_the_hashes(completion, answer, score):
  assert rewards.math_answer([""], [completion], answer=[answer]) == [score]


def _with_special_token_past(directory, model_vocab_size: int, *, special: bool = True):
  """The character tokenizer with one more token, ``<image>`` (special or not), and a config.json whose model
  has ``model_vocab_size`` ids."""
  directory.mkdir()
  char_tokenizer_json(directory)
  tokenizer = json.loads((directory / "tokenizer.json").read_text())
  tokenizer["added_tokens"].append({"id": 51, "content": "<image>", "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": special})
  (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
  (directory / "config.json").write_text(json.dumps({"vocab_size": model_vocab_size}))
  return directory


@pytest.mark.spec
def test_a_special_token_past_the_model_s_ids_is_left_out_and_refused_in_a_prompt(tmp_path):
  """Gemma 3's tokenizer holds its image token at 262144, past its text model's 262,144 ids: the model takes
  the ids before it (nothing samples it), and a prompt that holds it is refused. A plain token past the
  model's ids still counts, so the recipe refuses that tokenizer as too large."""
  tokenizer = HFTokenizer(_with_special_token_past(tmp_path / "special", 51))
  assert tokenizer.encode("ab<image>")[-1] == 51 and tokenizer.vocab_size == 51
  assert HFTokenizer(_with_special_token_past(tmp_path / "plain", 51, special=False)).vocab_size == 52
  assert HFTokenizer(_with_special_token_past(tmp_path / "fits", 52)).vocab_size == 52
  data = tmp_path / "prompts.jsonl"
  data.write_text(json.dumps({"prompt": "look: <image>", "answer": "a"}) + "\n"
                  + "".join(json.dumps({"prompt": f"p{i}", "answer": "b"}) + "\n" for i in range(20)))
  with pytest.raises(datasets.DatasetError, match="holds token id 51, which the model's 51 ids do not include"):
    datasets.load_task(path=str(data), tokenizer=tokenizer)

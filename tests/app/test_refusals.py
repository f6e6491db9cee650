"""Bad input of every kind is refused before anything starts: exit 2, one line, no traceback, nothing written.

One table across recipe values, environment switches, flags, recipe files,
output directories, recordings and ``serve-trainer``'s tokens and address (each
run through ``run_rl`` in process), and a second across payloads (through the
API: ``ValueError``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket

import numpy as np
import pytest

from orchestrator.app import cli
from orchestrator import recipe as recipe_lib
from orchestrator.data.packing import pack_payload
from orchestrator.data.recording import MANIFEST, write_recording
from orchestrator.data.synthetic import RolloutShape, generate_groups
from orchestrator.data.trajectory import Trajectory
from tests.checkpoint_files import preset_tensors, write_directory

SHAPE = RolloutShape(groups=16, generations_per_group=4, prompt_len_median=8, completion_len_median=6,
                     max_tokens=64, vocab_size=512, seed=5)
ON_RECORDING = ["model=tiny", "batch.rows=16", "steps=2", "rollouts.source=recording"]


@pytest.fixture(scope="module")
def good_recording(tmp_path_factory):
  path = tmp_path_factory.mktemp("rec") / "good"
  write_recording(path, generate_groups(SHAPE), vocab_size=512, produced_by={"test": True})
  return path


def _recording(tmp_path, good, edit):
  """A copy of the good recording with its manifest edited by ``edit(manifest) -> manifest``."""
  path = tmp_path / "rec"
  shutil.copytree(good, path)
  manifest = json.loads((path / MANIFEST).read_text())
  (path / MANIFEST).write_text(json.dumps(edit(manifest)))
  return ON_RECORDING + [f"rollouts.recording={path}"]


def _recipe_file(tmp_path, content: bytes | str):
  path = tmp_path / "recipe.yaml"
  path.write_bytes(content if isinstance(content, bytes) else content.encode())
  return ["--recipe", str(path)]


GOOD_ROW = '{"prompt": "1+1=", "answer": "2"}\n'


def _dataset(tmp_path, content: bytes | str, *keys: str, name: str = "prompts.jsonl"):
  """A live run on the dataset ``content`` (written to tmp_path/name), with more ``task.*`` keys."""
  path = tmp_path / name
  path.write_bytes(content if isinstance(content, bytes) else content.encode())
  return ["task.name=dataset", f"task.path={path}", *keys]


def _parquet_dataset(tmp_path, rows):
  import pyarrow as pa  # import here: only these rows write Parquet
  import pyarrow.parquet as pq

  path = tmp_path / "prompts.parquet"
  pq.write_table(pa.Table.from_pylist(rows), path)
  return ["task.name=dataset", f"task.path={path}"]


def _fifo_dataset(tmp_path):
  path = tmp_path / "prompts.jsonl"
  os.mkfifo(path)  # reading it would block until a writer came: the run must not
  return ["task.name=dataset", f"task.path={path}"]


def _sums(count: int) -> str:
  return "".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(count))


def _limited_sums(count: int, last_limit: int) -> str:
  """``_sums`` with a completion limit of 1 per row (field ``limit``), the last row's ``last_limit``."""
  return "".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}", "limit": {1 if i < count - 1 else last_limit}}}\n'
                 for i in range(count))


def _checkpoint(tmp_path, *keys: str, tensors=None, **config_changes):
  """A run on a tiny checkpoint written with ``tensors`` and ``config_changes`` (``checkpoint_files``)."""
  directory = write_directory(tmp_path / "model", tensors, **config_changes)
  return [f"model.checkpoint={directory}", *keys]


def _gemma3_checkpoint(tmp_path, **config_changes):
  """A run on a tiny Gemma 3 checkpoint whose ``config.json`` is changed by ``config_changes``."""
  directory = write_directory(tmp_path / "model", preset_name="tiny_gemma3", **config_changes)
  return [f"model.checkpoint={directory}"]


def _nan_in(name: str):
  tensors = preset_tensors()
  tensors[name] = tensors[name].copy()
  tensors[name].flat[7] = np.nan
  return tensors


def _fifo_weights(tmp_path):
  argv = _checkpoint(tmp_path)
  (tmp_path / "model" / "model.safetensors").unlink()
  os.mkfifo(tmp_path / "model" / "model.safetensors")
  return argv


def _chat_template(tmp_path, template: str):
  argv = _checkpoint(tmp_path, "rollouts.source=sampler", "model.chat_template=true")
  settings = tmp_path / "model" / "tokenizer_config.json"
  settings.write_text(json.dumps(dict(json.loads(settings.read_text()), chat_template=template)))
  return argv


def _existing_run(tmp_path):
  run = tmp_path / "earlier"
  run.mkdir()
  (run / "config.json").write_text("{}")
  return ["--out", str(run)]


def _not_a_run(tmp_path):
  """A model checkpoint's directory: it has a config.json, but no run's."""
  path = tmp_path / "model"
  path.mkdir()
  (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
  return ["--resume", str(path)]


def _tensorboard_a_file(tmp_path):
  path = tmp_path / "new-run"
  path.mkdir()
  (path / "tensorboard").write_text("someone's notes")
  return ["--out", str(path)]


def _file_as_out(tmp_path):
  path = tmp_path / "a-file"
  path.write_text("not a directory")
  return ["--out", str(path)]


def _loose_token(tmp_path, mode=0o644) -> str:
  """A token file that its group or others can read."""
  path = tmp_path / "trainer.token"
  path.write_text("a-shared-token\n")
  path.chmod(mode)
  return str(path)


_HELD: list[socket.socket] = []  # listening sockets the port-taken rows hold; closed when the module's tests end


@pytest.fixture(scope="module", autouse=True)
def _close_held_sockets():
  yield
  while _HELD:
    _HELD.pop().close()


def _taken_port() -> str:
  """127.0.0.1:PORT with a socket listening on it."""
  held = socket.socket()
  held.bind(("127.0.0.1", 0))
  held.listen()
  _HELD.append(held)
  return f"127.0.0.1:{held.getsockname()[1]}"


def _drop(key):
  def edit(m):
    del m[key]
    return m
  return edit


def _set(key, value):
  def edit(m):
    m[key] = value
    return m
  return edit


# (id, argv or argv-maker, environment, message fragment)
CASES = [
    ("steps-inf", ["steps=inf"], {}, "steps: expected a finite number"),
    ("steps-nan", ["steps=nan"], {}, "steps: expected a finite number"),
    ("steps-1e400", ["steps=1e400"], {}, "steps: expected a finite number"),
    ("steps-negative", ["steps=-3"], {}, "steps=-3 is out of range"),
    ("steps-absurd", ["steps=1e12"], {}, "steps=1000000000000 is out of range: it must be <="),
    ("steps-fraction", ["steps=2.5"], {}, "steps: expected a whole number"),
    ("first-micro-batch-below-nothing", ["simulate.micro_batch_s=0.1", "simulate.first_micro_batch_extra_s=-0.2"], {},
     "simulate.first_micro_batch_extra_s=-0.2 is out of range: a first micro-batch cannot take less than nothing"),
    ("lr-nan", ["engine.learning_rate=nan"], {}, "engine.learning_rate: expected a finite number"),
    ("lr-inf", ["engine.learning_rate=inf"], {}, "engine.learning_rate: expected a finite number"),
    ("lr-zero", ["engine.learning_rate=0"], {}, "engine.learning_rate=0.0 is out of range"),
    ("lr-past-float32", ["engine.learning_rate=1e300"], {}, "engine.learning_rate=1e+300 is out of range: it must be <="),
    ("grad-norm-negative", ["engine.max_grad_norm=-1"], {}, "engine.max_grad_norm=-1.0 is out of range"),
    ("weight-decay-negative", ["engine.weight_decay=-0.1"], {}, "engine.weight_decay=-0.1 is out of range"),
    ("inflight-zero", ["engine.max_inflight=0"], {}, "engine.max_inflight=0 is out of range"),
    ("inflight-absurd", ["engine.max_inflight=100000"], {}, "engine.max_inflight=100000 is out of range"),
    ("factor-zero", ["engine.ragged_buffer_factor=0"], {}, "engine.ragged_buffer_factor=0.0 is out of range"),
    ("backend-unknown", ["engine.backend=torch"], {}, "engine.backend='torch' is not a backend"),
    ("micro-batches-zero", ["batch.micro_batches_per_step=0"], {}, "batch.micro_batches_per_step=0 is out of range"),
    ("rows-zero", ["batch.rows=0"], {}, "batch.rows=0 is out of range"),
    ("rows-absurd", ["batch.rows=1000000", "batch.tokens_per_row=1000000"], {}, "tokens per micro-batch is out of range"),
    ("rows-do-not-split", ["mesh.fsdp=2", "batch.rows=3"], {}, "batch.rows=3 does not split over mesh.fsdp"),
    ("mesh-axis-zero", ["mesh.expert=0"], {}, "mesh.expert=0 is out of range"),
    ("mesh-too-many-devices", ["mesh.fsdp=4", "rollouts.source=synthetic"], {}, "needs 4 devices but"),
    ("fill-above-one", ["rollouts.fill=1.5"], {}, "rollouts.fill=1.5 is out of range"),
    ("source-unknown", ["rollouts.source=live"], {}, "rollouts.source='live': use one of"),
    ("recording-unset", ["rollouts.source=recording", "rollouts.recording=null"], {}, "needs rollouts.recording=DIR"),
    ("synthetic-rows-too-short", ["batch.tokens_per_row=2", "rollouts.source=synthetic"], {}, "too short for synthetic"),
    ("disable-after-zero", ["step_boundary.disable_after=0"], {}, "step_boundary.disable_after=0 is out of range"),
    ("threshold-negative", ["step_boundary.wait_threshold_s=-1"], {}, "wait_threshold_s=-1.0 is out of range"),
    ("threshold-word", ["step_boundary.wait_threshold_s=soon"], {}, "wait_threshold_s: expected float"),
    ("reprobe-zero", ["step_boundary.reprobe_every=0"], {}, "step_boundary.reprobe_every=0 is out of range"),
    ("control-every-negative", ["step_boundary.control_every=-1"], {},
     "step_boundary.control_every=-1 is out of range: it must be >= 0"),
    ("control-every-one", ["step_boundary.control_every=1"], {},
     "step_boundary.control_every=1 makes every boundary that would stage a control, so nothing stages"),
    ("control-every-fraction", ["step_boundary.control_every=1.5"], {},
     "step_boundary.control_every: expected a whole number, got 1.5"),
    ("control-every-word", ["step_boundary.control_every=x"], {}, "step_boundary.control_every: expected int, got 'x'"),
    ("control-every-boolean", ["step_boundary.control_every=true"], {},
     "step_boundary.control_every: expected int, got boolean True"),
    ("min-free-negative", ["step_boundary.min_free_device_bytes=-1"], {},
     "step_boundary.min_free_device_bytes=-1 is out of range: use 'auto', 0 (no memory gate)"),
    ("min-free-word", ["step_boundary.min_free_device_bytes=plenty"], {},
     "step_boundary.min_free_device_bytes: expected 'auto' or a whole number of bytes (0: no memory gate), got 'plenty'"),
    ("min-free-fraction", ["step_boundary.min_free_device_bytes=1.5"], {},
     "step_boundary.min_free_device_bytes: expected 'auto' or a whole number of bytes"),
    ("min-free-absurd", ["step_boundary.min_free_device_bytes=1e18"], {},
     "step_boundary.min_free_device_bytes=1000000000000000000 is out of range"),
    # Two keys that name one thing, given in one layer (across layers the higher one's wins: tests/app/test_cli.py).
    ("link-of-nothing", ["simulate.host_link_gb_s=0"], {},
     "simulate.host_link_gb_s=0.0 is out of range: a link carries more than nothing, so it must be > 0"),
    ("link-beside-copy", ["simulate.host_link_gb_s=1", "simulate.copy_s=2"], {},
     "simulate.copy_s=2.0 and simulate.host_link_gb_s=1.0 are both set"),
    ("no-bytes-per-token", ["simulate.bytes_per_token=0"], {}, "simulate.bytes_per_token=0.0 is out of range"),
    ("earlier-spelling-beside-its-successor", ["simulate.map_s=0.2", "simulate.input_copy_s=0.3"], {},
     "simulate.input_copy_s=0.3 and simulate.map_s=0.2 are both set; input_copy_s is the earlier spelling of"
     " map_s: keep only simulate.map_s"),
    ("checkpoint-every-negative", ["checkpoint.every=-1"], {}, "checkpoint.every=-1 is out of range"),
    # Sizes inside their ranges whose few prompts all land on one side of the held-out split: a draw from the
    # other side would spin forever (every such size in range: tests/live/test_live_parts.py).
    ("task-modulus-no-eval-prompt", ["task.name=modular_addition", "task.modulus=2"], {},
     "task.name=modular_addition task.modulus=2 leaves the evaluation split empty: its 4 prompts split 4 for"
     " training and 0 for evaluation"),
    ("task-reverse-no-train-prompt", ["task.name=reverse", "task.letters=2", "task.length=1"], {},
     "task.name=reverse task.letters=2 task.length=1 leaves the training split empty: its 2 prompts split 0 for"
     " training and 2 for evaluation"),
    ("task-reverse-3-letters-no-train-prompt", ["task.name=reverse", "task.letters=3", "task.length=1"], {},
     "leaves the training split empty: its 3 prompts split 0 for training and 3 for evaluation"),
    ("task-first-letter-no-eval-prompt", ["task.name=first_letter", "task.letters=3", "task.length=1"], {},
     "task.name=first_letter task.letters=3 task.length=1 leaves the evaluation split empty: its 3 prompts split 3"
     " for training and 0 for evaluation"),
    ("task-first-letter-2-letters-no-eval-prompt", ["task.name=first_letter", "task.letters=2", "task.length=1"],
     {}, "leaves the evaluation split empty: its 2 prompts split 2 for training and 0 for evaluation"),
    ("task-first-letter-8-words-no-eval-prompt", ["task.name=first_letter", "task.letters=2", "task.length=3"], {},
     "leaves the evaluation split empty: its 8 prompts split 8 for training and 0 for evaluation"),
    ("task-split-names-sizes-that-work", ["task.name=reverse", "task.letters=2", "task.length=1"], {},
     "; use task.letters=4 (1 training, 3 evaluation prompts) or task.length=2 (3 training, 1 evaluation prompts)"),
    ("task-split-checked-for-any-source", ["rollouts.source=synthetic", "task.name=modular_addition",
                                           "task.modulus=2"], {}, "leaves the evaluation split empty"),
    # A dataset of one's own prompts (task.name=dataset): the file and every row are checked up front.
    ("dataset-no-path", ["task.name=dataset"], {}, "task.name=dataset needs task.path=FILE"),
    ("dataset-path-missing", ["task.name=dataset", "task.path=/no/such/prompts.jsonl"], {},
     "task.path=/no/such/prompts.jsonl does not exist"),
    ("dataset-a-directory", lambda t, g: ["task.name=dataset", f"task.path={t}"], {}, "is a directory; give a JSONL"),
    ("dataset-empty", lambda t, g: _dataset(t, "\n\n"), {}, "prompts.jsonl is empty: it holds no rows"),
    ("dataset-neither-kind", lambda t, g: _dataset(t, "prompt,answer\n1+1=,2\n", name="prompts.csv"), {},
     "prompts.csv is neither JSONL (.jsonl) nor Parquet (.parquet, .pq); convert it"),
    ("dataset-line-not-an-object", lambda t, g: _dataset(t, GOOD_ROW + "[1, 2]\n"), {},
     "prompts.jsonl line 2 is a JSON list, not an object; each line must be one JSON object"),
    ("dataset-line-not-json", lambda t, g: _dataset(t, GOOD_ROW + '{"prompt": "2+2="\n'), {},
     "prompts.jsonl line 2 is not JSON (Expecting ',' delimiter at column 18)"),
    ("dataset-jsonl-not-utf8", lambda t, g: _dataset(t, b"\xff\xfe{}\n"), {}, "prompts.jsonl is not UTF-8 text"),
    ("dataset-a-fifo", lambda t, g: _fifo_dataset(t), {}, "prompts.jsonl is a FIFO (named pipe), which a run would"
                                                             " block on"),
    ("dataset-line-nested-too-deep", lambda t, g: _dataset(t, GOOD_ROW + "[" * 100_000 + "\n"), {},
     "prompts.jsonl line 2 nests its brackets deeper than the reader's limit"),
    ("dataset-answer-empty", lambda t, g: _dataset(t, _sums(20) + '{"prompt": "9+9=", "answer": " "}\n'), {},
     "prompts.jsonl line 21: field 'answer' is ' ', so no completion can be scored against it"),
    ("dataset-math-answer-no-number", lambda t, g: _dataset(t, _sums(20) + '{"prompt": "9+9=", "answer": "x"}\n',
                                                            "task.reward=[math]"), {},
     "prompts.jsonl line 21: field 'answer' is 'x', which holds no number, but task.reward lists math"),
    ("reward-weight-past-float32", ["task.reward=[exact]", "task.reward_weights=[1e39]"], {},
     "task.reward_weights[0]=1e+39 is past float32's range (|weight| <= 3.403e+38), which the weighted rewards are"
     " held in; give a smaller weight"),
    ("dataset-math-answer-too-long", lambda t, g: _dataset(t, _sums(20) + '{"prompt": "9+9=", "answer": "'
                                                           + "1" * 10_000 + '"}\n', "task.reward=[math]"), {},
     "prompts.jsonl line 21: field 'answer' holds a number of 10,000 digits, more than Python converts"
     " (sys.get_int_max_str_digits() is 4,300), so math cannot compare it with a completion's; shorten the answer,"
     " or drop math from task.reward"),
    ("dataset-parquet-not-parquet", lambda t, g: _dataset(t, GOOD_ROW, name="prompts.parquet"), {},
     "prompts.parquet is not a Parquet file pyarrow can read"),
    ("dataset-row-lacks-field", lambda t, g: _dataset(t, GOOD_ROW + '{"prompt": "2+2=", "solution": "4"}\n'), {},
     "prompts.jsonl line 2 has no field 'answer' (its fields: 'prompt', 'solution'); name the field to read with"
     " task.answer_field=FIELD"),
    ("dataset-parquet-row-lacks-field", lambda t, g: _parquet_dataset(t, [{"question": "1+1=", "answer": "2"}]), {},
     "prompts.parquet row 1 has no field 'prompt' (its fields: 'question', 'answer')"),
    ("dataset-value-not-a-string", lambda t, g: _dataset(t, GOOD_ROW + '{"prompt": "2+2=", "answer": 4}\n'), {},
     "prompts.jsonl line 2: field 'answer' is 4 (int), not a string; write it as a string (\"4\")"),
    ("dataset-character-outside-alphabet", lambda t, g: _dataset(t, GOOD_ROW + '{"prompt": "What is 2+2?", "answer":'
                                                                    ' "4"}\n'), {},
     "prompts.jsonl line 2: field 'prompt' has the character 'W', which the character tokenizer cannot encode;"
     " write the prompts and answers in its characters only"),
    ("dataset-eval-fraction-zero", lambda t, g: _dataset(t, _sums(20), "task.eval_fraction=0"), {},
     "task.eval_fraction=0.0 is out of range: it must be in (0, 1)"),
    ("dataset-eval-fraction-one", lambda t, g: _dataset(t, _sums(20), "task.eval_fraction=1"), {},
     "task.eval_fraction=1.0 is out of range: it must be in (0, 1)"),
    ("dataset-no-eval-prompt", lambda t, g: _dataset(t, _sums(3), "task.eval_fraction=0.001"), {},
     "task.eval_fraction=0.001 holds out none of the 3 distinct prompts of task.path="),
    ("dataset-eval-file-is-all-of-it", lambda t, g: _dataset(t, _sums(3), f"task.eval_path={t / 'prompts.jsonl'}"),
     {}, "is also in task.eval_path="),
    ("dataset-prompt-too-long", lambda t, g: _dataset(t, GOOD_ROW + '{"prompt": "12+34=", "answer": "46"}\n',
                                                      "task.max_prompt_tokens=6"), {},
     "prompts.jsonl line 2: the prompt takes 7 tokens (bos included), more than task.max_prompt_tokens=6; raise"
     " task.max_prompt_tokens or shorten the prompt"),
    # unset, the longest prompt (answer) sizes the run: one of a million tokens is refused before anything is built
    ("dataset-million-token-prompt", lambda t, g: _dataset(t, _sums(20) + '{"prompt": "' + "1" * 1_000_000
                                                           + '=", "answer": "1"}\n'), {},
     "prompts.jsonl line 21: the prompt takes 1,000,002 tokens (bos included), more than the 4,096 a prompt may take"
     " (task.max_prompt_tokens unset: the longest prompt sizes every micro-batch); shorten or drop the prompt"),
    ("dataset-million-token-answer", lambda t, g: _dataset(t, _sums(20) + '{"prompt": "9+9=", "answer": "'
                                                           + "1" * 1_000_000 + '"}\n'), {},
     "prompts.jsonl line 21: the answer takes 1,000,000 tokens, more than the 4,096 a completion may take"),
    ("dataset-completion-tokens-zero", lambda t, g: _dataset(t, _sums(20), "task.max_completion_tokens=0"), {},
     "task.max_completion_tokens=0 is out of range: it must be in [1, 4096]"),
    ("dataset-keys-on-a-built-in-task", ["task.name=reverse", "task.path=prompts.jsonl"], {},
     "task.path is set but task.name=reverse is a built-in task"),
    ("dataset-row-limit-zero", lambda t, g: _dataset(t, _limited_sums(20, 0), "task.max_tokens_field=limit",
                                                     "task.max_completion_tokens=2"), {},
     "prompts.jsonl line 20: field 'limit' (task.max_tokens_field) is 0; it must be a whole number of tokens in"
     " [1, 2] (at most task.max_completion_tokens=2)"),
    ("dataset-row-limit-above-the-task-s", lambda t, g: _dataset(t, _limited_sums(20, 3),
                                                                 "task.max_tokens_field=limit",
                                                                 "task.max_completion_tokens=2"), {},
     "prompts.jsonl line 20: field 'limit' (task.max_tokens_field) is 3; it must be a whole number of tokens in"
     " [1, 2]"),
    ("dataset-row-limit-field-on-a-built-in-task", ["task.name=reverse", "task.max_tokens_field=limit"], {},
     "task.max_tokens_field is set but task.name=reverse is a built-in task"),
    # How the live sampler draws each token and where a completion ends (rollouts.top_p, top_k, stop).
    ("top-p-zero", ["rollouts.top_p=0"], {}, "rollouts.top_p=0.0 is out of range: it must be a finite number in"
                                             " (0, 1]"),
    ("top-p-above-one", ["rollouts.top_p=1.5"], {}, "rollouts.top_p=1.5 is out of range: it must be a finite number"
                                                    " in (0, 1]"),
    ("top-p-nan", ["rollouts.top_p=nan"], {}, "rollouts.top_p: expected a finite number"),
    ("top-k-negative", ["rollouts.top_k=-1"], {}, "rollouts.top_k=-1 is out of range: it must be a whole number"
                                                  " >= 0"),
    ("top-k-fraction", ["rollouts.top_k=1.5"], {}, "rollouts.top_k: expected a whole number, got 1.5"),
    ("top-p-synthetic", ["rollouts.source=synthetic", "model=tiny", "rollouts.top_p=0.9"], {},
     "rollouts.top_p=0.9 is read by the live loop only, but rollouts.source=synthetic"),
    ("stop-empty-string", ["rollouts.stop=['']"], {}, "rollouts.stop[0]='' is 0 characters long: each stop string"
                                                      " must be 1 to 256 characters"),
    ("stop-not-a-list", ["rollouts.stop=</answer>"], {}, "rollouts.stop='</answer>' is not a list of strings"),
    ("stop-not-strings", ["rollouts.stop=[1, 2]"], {}, "rollouts.stop=[1, 2] is not a list of strings"),
    ("stop-too-many", [f"rollouts.stop=[{', '.join(f'x{i}' for i in range(17))}]"], {},
     "rollouts.stop lists 17 strings; it must list at most 16"),
    # The rewards a recipe chooses (task.reward): each entry is found and checked up front.
    ("reward-unknown", ["task.reward=[exactly]"], {},
     "task.reward[0]='exactly' is not a reward; use one of exact, format, math, or package.module:function"),
    ("reward-not-importable", ["task.reward=[exact, no_such_reward_module:score]"], {},
     "task.reward[1]='no_such_reward_module:score': module 'no_such_reward_module' cannot be imported"),
    ("reward-no-such-function", ["task.reward=[json:no_such_score]"], {}, "module 'json' has no 'no_such_score'"),
    ("reward-not-callable", ["task.reward=[math:pi]"], {}, "task.reward[0]='math:pi' is a float, not a function"),
    ("reward-wrong-signature", ["task.reward=[os.path:join]"], {},
     "task.reward[0]='os.path:join' cannot be called as fn(prompts=..., completions=..., answer=..., mode=...)"),
    ("reward-timeout-zero", ["task.reward_timeout_s=0"], {}, "task.reward_timeout_s=0.0 is out of range: it must be"
                                                             " a number of seconds in (0, 86,400]"),
    ("reward-timeout-nan", ["task.reward_timeout_s=nan"], {}, "task.reward_timeout_s: expected a finite number"),
    ("reward-timeout-not-live", ["rollouts.source=synthetic", "model=tiny", "task.reward_timeout_s=5"], {},
     "task.reward_timeout_s=5.0 is read by the live loop only, but rollouts.source=synthetic"),
    ("reward-math-on-words", ["task.name=reverse", "task.reward=[math]"], {},
     "task.reward lists math, but task.name=reverse's answers hold no number"),
    ("reward-weights-length", ["task.reward=[exact]", "task.reward_weights=[1, 2]"], {},
     "task.reward_weights has 2 weights for 1 task.reward entries (exact)"),
    ("reward-weights-without-rewards", ["task.reward_weights=[2]"], {}, "but task.reward is not set"),
    ("reward-format-no-pattern", ["task.reward=[format]"], {}, "task.reward lists format, which needs"
                                                              " task.format_pattern=REGEX"),
    ("reward-format-bad-pattern", ["task.reward=[format]", "task.format_pattern=[a-"], {},
     "task.format_pattern='[a-' is not a regular expression"),
    # Every seed key: JAX's PRNG takes signed 64-bit seeds, numpy's seeding none below 0.
    ("engine-seed-1e23", ["engine.seed=1e23"], {},
     "engine.seed=99999999999999991611392 is out of range: a seed must be an integer in [0, 2**63 - 1"),
    ("engine-seed-1e30", ["engine.seed=1e30"], {}, "engine.seed=1000000000000000019884624838656 is out of range"),
    ("engine-seed-2-to-the-63", ["engine.seed=9223372036854775808"], {},
     "engine.seed=9223372036854775808 is out of range: a seed must be an integer in [0, 2**63 - 1 ="
     " 9223372036854775807]"),
    ("engine-seed-negative", ["engine.seed=-2"], {}, "engine.seed=-2 is out of range"),
    ("engine-seed-fraction", ["engine.seed=0.5"], {}, "engine.seed: expected a whole number"),
    ("rollouts-seed-1e23", ["rollouts.seed=1e23"], {}, "rollouts.seed=99999999999999991611392 is out of range"),
    ("rollouts-seed-negative", ["rollouts.seed=-1"], {}, "rollouts.seed=-1 is out of range"),
    ("rollouts-seed-synthetic-1e30", ["rollouts.source=synthetic", "model=tiny", "rollouts.seed=1e30"], {},
     "rollouts.seed=1000000000000000019884624838656 is out of range"),
    ("scored-step-zero", ["checkpoint.scored_steps=[0]"], {}, "checkpoint.scored_steps [0] are outside"),
    ("model-unknown", ["model=huge"], {}, "model.preset='huge' is not a preset"),
    ("name-a-path", ["name=../../elsewhere"], {}, "name='../../elsewhere': use letters, digits"),
    ("key-unknown", ["engine.learnin_rate=1"], {}, "did you mean 'engine.learning_rate'?"),
    ("not-key-value", ["notakeyvalue"], {}, "is not key=value"),
    ("env-not-boolean", [], {"PIPELINE_STEP_BOUNDARY": "maybe"}, "environment PIPELINE_STEP_BOUNDARY='maybe'"),
    ("env-factor-word", [], {"RAGGED_BUFFER_FACTOR": "abc"}, "environment RAGGED_BUFFER_FACTOR='abc'"),
    ("env-retry-on-dense", [], {"RETRY_WHEN_TOKENS_DROPPED": "1"}, "needs an MoE model, but 'tiny' is dense"),
    ("env-stage-while-off", ["--no-pipeline_step_boundary"], {"STAGE_BEFORE_UPDATE": "yes"}, "has no effect with"),
    ("flags-stage-while-off", ["--stage_before_update", "--no-pipeline_step_boundary"], {}, "has no effect with"),
    ("flags-require-without-staging", ["--no-stage_next_microbatch", "--require_staging"], {}, "staging is off"),
    ("flag-steps-word", ["--steps", "x"], {}, "argument --steps: invalid int value"),
    ("tunix-with-checkpoints", ["engine.backend=tunix_peft", "checkpoint.every=1", "rollouts.source=synthetic"], {}, "does not write checkpoints"),
    ("trainer-location-unknown", ["trainer.location=elsewhere"], {}, "trainer.location='elsewhere': use local or remote"),
    ("trainer-remote-no-address", ["trainer.location=remote"], {}, "needs trainer.address=HOST:PORT"),
    ("trainer-address-no-port", ["trainer.location=remote", "trainer.address=trainerhost"], {}, "is not HOST:PORT"),
    ("trainer-spawn-while-local", ["trainer.spawn=true"], {}, "trainer.spawn is set but trainer.location=local"),
    ("trainer-spawn-off-loopback", ["trainer.location=remote", "trainer.spawn=true", "trainer.address=10.1.2.3:5000"],
     {}, "is not a loopback address"),
    ("trainer-timeout-zero", ["trainer.timeout_s=0"], {}, "trainer.timeout_s=0.0 is out of range"),
    ("trainer-message-limit-tiny", ["trainer.max_message_bytes=1000"], {}, "trainer.max_message_bytes=1000 is out of"),
    ("trainer-token-file-missing", ["trainer.location=remote", "trainer.address=127.0.0.1:5000",
                                    "trainer.token_file=/no/such/token"], {}, "trainer token file /no/such/token"),
    ("trainer-off-loopback-no-token", ["trainer.location=remote", "trainer.address=10.1.2.3:5000"],
     {"STEP_BOUNDARY_TRAINER_TOKEN": ""}, "is not loopback and no token is set"),
    ("trainer-token-file-loose", lambda t, g: ["trainer.location=remote", "trainer.address=127.0.0.1:5000",
                                               f"trainer.token_file={_loose_token(t)}"], {},
     "has mode 0644: its group or others can access it; make it private: chmod 600"),
    ("serve-token-file-loose", lambda t, g: ["serve-trainer", "--token-file", _loose_token(t, 0o640)], {},
     "has mode 0640: its group or others can access it; make it private: chmod 600"),
    ("serve-insecure-off-loopback", ["serve-trainer", "--insecure-no-token", "--listen", "0.0.0.0:0"],
     {"STEP_BOUNDARY_TRAINER_TOKEN": ""}, "--insecure-no-token with --listen 0.0.0.0:0: off loopback a trainer needs"),
    ("serve-insecure-with-token", ["serve-trainer", "--insecure-no-token"], {"STEP_BOUNDARY_TRAINER_TOKEN": "x"},
     "--insecure-no-token serves without a token, but $STEP_BOUNDARY_TRAINER_TOKEN is given too"),
    ("serve-token-out-with-token", lambda t, g: ["serve-trainer", "--token-out", str(t / "new.token")],
     {"STEP_BOUNDARY_TRAINER_TOKEN": "x"}, "names a file for a generated token, but the token comes from"),
    ("serve-token-out-exists", lambda t, g: ["serve-trainer", "--token-out", _file_as_out(t)[1]],
     {"STEP_BOUNDARY_TRAINER_TOKEN": ""}, "already exists (a server that did not stop cleanly?); remove it"),
    ("serve-token-out-unwritable", lambda t, g: ["serve-trainer", "--token-out", _file_as_out(t)[1] + "/t"],
     {"STEP_BOUNDARY_TRAINER_TOKEN": ""}, "cannot write the token file"),
    ("serve-port-taken", lambda t, g: ["serve-trainer", "--insecure-no-token", "--listen", _taken_port()],
     {"STEP_BOUNDARY_TRAINER_TOKEN": ""}, "the address is in use (another server listens there); choose another port"),
    ("distributed-zero-processes", ["distributed.num_processes=0"], {}, "distributed.num_processes=0 is out of range"),
    ("distributed-id-out-of-range", ["distributed.num_processes=2", "distributed.process_id=2",
                                     "distributed.coordinator_address=127.0.0.1:1234"], {},
     "distributed.process_id=2 is out of range: it must be in [0, 1]"),
    ("distributed-id-without-coordinator", ["distributed.num_processes=2", "distributed.process_id=1"], {},
     "distributed.process_id is set but distributed.coordinator_address is not"),
    ("distributed-env-id-without-count", [], {"STEP_BOUNDARY_PROCESS_ID": "1"},
     "distributed.process_id=1 needs distributed.num_processes"),
    ("distributed-coordinator-no-port", ["distributed.num_processes=2", "distributed.process_id=0",
                                         "distributed.coordinator_address=coordinator"], {}, "is not HOST:PORT"),
    ("distributed-detect-and-count", ["distributed.detect_cluster=true", "distributed.num_processes=2"], {},
     "distributed.num_processes=2 is set with distributed.detect_cluster=true"),
    ("distributed-live-split", ["distributed.num_processes=2", "rollouts.placement=split"], {},
     "rollouts.placement=split puts the sampler on local devices beside the trainer's, but with distributed.* set"),
    ("distributed-live-remote-trainer", ["distributed.num_processes=2", "trainer.location=remote",
                                         "trainer.spawn=true"], {}, "trainer.location=remote drives one trainer"),
    ("live-placement-unknown", ["rollouts.placement=apart"], {}, "rollouts.placement='apart': use one of auto, shared, split, process"),
    ("advantage-scaling-unknown", ["rollouts.advantage_scaling=std"], {},
     "rollouts.advantage_scaling='std': use group (divide by the group's reward std, GRPO's) or none"),
    ("live-devices-when-shared", ["rollouts.devices=2"], {}, "rollouts.devices=2 is for rollouts.placement=split"),
    # In-flight weight updates (rollouts.in_flight_updates, decode_chunk_tokens).
    ("decode-chunk-zero", ["task.name=reverse", "rollouts.in_flight_updates=true", "rollouts.decode_chunk_tokens=0"],
     {}, "rollouts.decode_chunk_tokens=0 is out of range: it must be a whole number of tokens >= 1"),
    ("decode-chunk-fraction", ["rollouts.in_flight_updates=true", "rollouts.decode_chunk_tokens=1.5"], {},
     "rollouts.decode_chunk_tokens: expected a whole number"),
    ("decode-chunk-past-the-completion-limit", ["task.name=reverse", "task.length=4",
                                                "rollouts.in_flight_updates=true", "rollouts.decode_chunk_tokens=9"],
     {}, "rollouts.decode_chunk_tokens=9 leaves no point inside a generation for new weights to land at: the"
         " completion limit is 4 tokens"),
    ("in-flight-on-a-recording", lambda t, g: ON_RECORDING + [f"rollouts.recording={g}",
                                                              "rollouts.in_flight_updates=true"], {},
     "rollouts.in_flight_updates=True is read by the live loop only, but rollouts.source=recording"),
    ("loss-aggregation-unknown", ["engine.loss_aggregation=sum"], {},
     "engine.loss_aggregation='sum' is not an aggregation; use one of token_mean"),
    ("samples-every-negative", ["metrics.samples_every=-1"], {}, "metrics.samples_every=-1"),
    ("samples-every-not-live", ["rollouts.source=synthetic", "metrics.samples_every=5"], {},
     "metrics.samples_every=5 is read by the live loop only"),
    ("eval-every-zero", ["task.eval_every=0"], {}, "task.eval_every=0 is out of range: it must be a whole number"),
    ("eval-every-negative", ["task.eval_every=-3"], {}, "task.eval_every=-3 is out of range"),
    ("eval-every-not-an-integer", ["task.eval_every=2.5"], {}, "task.eval_every: expected a whole number"),
    ("eval-every-not-a-number", ["task.eval_every=often"], {}, "task.eval_every: expected"),
    ("stop-on-a-built-in-task", ["rollouts.stop=['</a>']"], {},
     "rollouts.stop=['</a>'] ends free-text completions, but task.name=first_letter is a built-in task"),
    ("eval-every-not-live", ["rollouts.source=synthetic", "task.eval_every=5"], {},
     "task.eval_every=5 is read by the live loop only"),
    ("eval-pass-k-zero", ["task.eval_every=5", "task.eval_pass_k=0"], {}, "task.eval_pass_k=0 is out of range"),
    ("eval-pass-k-too-many", ["task.eval_every=5", "task.eval_pass_k=65"], {}, "task.eval_pass_k=65 is out of range"),
    ("eval-pass-k-without-evaluations", ["task.eval_pass_k=4"], {},
     "task.eval_pass_k=4 is measured at the evaluations during the run, and task.eval_every is unset"),
    ("clip-low-negative", ["engine.clip_eps_low=-0.1"], {}, "engine.clip_eps_low=-0.1 is out of range"),
    ("clip-high-negative", ["engine.clip_eps_high=-0.2"], {}, "engine.clip_eps_high=-0.2 is out of range"),
    ("clip-low-at-one", ["engine.clip_eps_low=1"], {},
     "engine.clip_eps_low=1.0 is out of range: the clip range [1 - clip_eps_low, 1 + clip_eps_high] = [0, 1.28]"),
    ("kl-beta-negative", ["engine.kl_beta=-0.1"], {}, "engine.kl_beta=-0.1 is out of range"),
    ("kl-beta-not-finite", ["engine.kl_beta=inf"], {}, "engine.kl_beta: expected a finite number, got 'inf'"),
    ("kl-estimator-unknown", ["engine.kl_estimator=k2"], {}, "engine.kl_estimator='k2' is not an estimator"),
    ("remat-unknown", ["engine.remat=layers"], {}, "engine.remat='layers' is not a remat policy"),
    ("logprob-chunk-zero", ["engine.logprob_chunk_tokens=0"], {}, "engine.logprob_chunk_tokens=0 is out of range"),
    ("logprob-chunk-negative", ["engine.logprob_chunk_tokens=-8"], {},
     "engine.logprob_chunk_tokens=-8 is out of range"),
    ("logprob-chunk-fraction", ["engine.logprob_chunk_tokens=1.5"], {}, "engine.logprob_chunk_tokens"),
    ("logprob-chunk-word", ["engine.logprob_chunk_tokens=many"], {}, "engine.logprob_chunk_tokens"),
    ("logprob-chunk-huge", ["engine.logprob_chunk_tokens=99999999"], {},
     "engine.logprob_chunk_tokens=99999999 is out of range"),
    ("attention-unknown", ["engine.attention=flash"], {}, "engine.attention='flash' is not an attention"),
    ("attention-splash-on-a-llama", ["model=smollm2_135m_shape", "engine.attention=splash"], {},
     "engine.attention=splash: smollm2_135m_shape is a llama model"),
    ("attention-splash-off-a-tpu", ["engine.attention=splash"], {},
     "engine.attention=splash runs Tunix's Pallas splash kernel, on a TPU only; this run's devices are cpu"),
    ("lr-schedule-unknown", ["engine.lr_schedule=step"], {}, "engine.lr_schedule='step' is not a schedule"),
    ("lr-decay-when-constant", ["engine.decay_steps=10"], {}, "engine.decay_steps=10 is for a decaying schedule"),
    ("lr-warmup-past-the-run", ["steps=5", "engine.warmup_steps=6"], {},
     "engine.warmup_steps=6 leaves none of the run's 5 steps at the peak rate"),
    ("lr-warmup-the-whole-run", ["steps=5", "engine.warmup_steps=5"], {},
     "engine.warmup_steps=5 leaves none of the run's 5 steps at the peak rate (engine.learning_rate is reached"
     " after the warm-up's last update); use at most 4, or run more steps"),
    ("lr-warmup-not-an-integer", ["engine.warmup_steps=1.5"], {}, "engine.warmup_steps"),
    ("live-placement-not-live", ["rollouts.source=synthetic", "rollouts.placement=split"], {},
     "rollouts.placement=split is read by the live loop only, but rollouts.source=synthetic"),
    ("live-split-too-few-devices", ["steps=1", "rollouts.placement=split"], {},
     "rollouts.placement=split needs 2 local devices (the mesh's 1 and rollouts.devices=1) but 1 are visible"),
    ("live-split-remote-trainer", ["rollouts.placement=split", "trainer.location=remote", "trainer.spawn=true"], {},
     "a remote trainer does not share"),
    ("live-mesh-spawned-trainer-too-few-devices", ["mesh.fsdp=2", "trainer.location=remote", "trainer.spawn=true"],
     {}, "mesh {'fsdp': 2, 'context': 1, 'expert': 1} needs 2 devices but 1 are visible; on CPU set XLA_FLAGS="),
    ("live-tunix-backend", ["engine.backend=tunix_peft"], {}, "rollouts.source=sampler trains with engine.backend=jax"),
    ("distributed-remote-trainer", ["rollouts.source=synthetic", "distributed.num_processes=2",
                                    "trainer.location=remote", "trainer.spawn=true"], {},
     "trainer.location=remote drives one trainer process"),
    ("distributed-uneven-devices", ["rollouts.source=synthetic", "model=tiny", "mesh.fsdp=3", "batch.rows=6",
                                    "distributed.num_processes=2"], {},
     "distributed.num_processes=2 does not split the mesh's 3 devices evenly"),
    ("resume-with-recipe", ["--resume", "somewhere", "--recipe", "recipes/default.yaml"], {}, "only --steps may be given"),
    ("resume-steps-as-a-key", ["--resume", "somewhere", "steps=8"], {},
     "only --steps may be given with it (got steps=8); to run it to step 8, give --steps 8"),
    ("resume-missing", lambda t, g: ["--resume", str(t / "no-such-run")], {}, "no such run directory"),
    ("resume-not-a-run", lambda t, g: ["--resume", str(t)], {}, "holds no run"),
    ("from-checkpoint-alone", ["--from-checkpoint", "2"], {}, "--from-checkpoint N goes with --resume DIR"),
    ("from-checkpoint-zero", ["--resume", "somewhere", "--from-checkpoint", "0"], {},
     "--from-checkpoint 0 is out of range"),
    ("resume-another-tools-config", lambda t, g: _not_a_run(t), {}, "config.json is not a run config written by"),
    ("out-is-a-file", lambda t, g: _file_as_out(t), {}, "is a file, not a directory"),
    ("out-tensorboard-a-file", lambda t, g: _tensorboard_a_file(t), {},
     "tensorboard is a file, where the run writes its tensorboard directory"),
    ("out-holds-a-run", lambda t, g: _existing_run(t), {}, "already holds a run; continue it with `run_rl --resume"),
    ("recipe-missing", ["--recipe", "no/such/recipe.yaml"], {}, "recipe no/such/recipe.yaml does not exist"),
    ("recipe-directory", lambda t, g: ["--recipe", str(t)], {}, "is a directory; pass a recipe YAML file"),
    ("recipe-not-utf8", lambda t, g: _recipe_file(t, b"model: \xff\xfe tiny\n"), {}, "is not UTF-8 text"),
    ("recipe-bad-yaml", lambda t, g: _recipe_file(t, "model: tiny\nsteps: [1, 2\n"), {}, "is not valid YAML at line"),
    ("recipe-duplicate-key", lambda t, g: _recipe_file(t, "steps: 2\nsteps: 3\n"), {}, "key 'steps' appears twice"),
    ("recipe-duplicate-section", lambda t, g: _recipe_file(t, "engine:\n  seed: 1\nengine:\n  seed: 2\n"), {},
     "key 'engine' appears twice"),
    ("recipe-a-list", lambda t, g: _recipe_file(t, "- model\n- tiny\n"), {}, "must be a mapping of keys"),
    ("recipe-unknown-section", lambda t, g: _recipe_file(t, "engines:\n  seed: 1\n"), {}, "unknown key 'engines'"),
    ("recipe-key-and-its-short-form", lambda t, g: _recipe_file(
        t, "model: tiny_moe\nengine:\n  router_replay: false\nmoe:\n  router_replay: true\n"), {},
     "engine.router_replay is given twice (moe.router_replay is its short form); keep one"),
    ("recording-no-manifest", lambda t, g: ON_RECORDING + [f"rollouts.recording={t}"], {}, "no manifest"),
    ("manifest-a-list", lambda t, g: _recording(t, g, lambda m: [m]), {}, "must be a JSON object, got list"),
    ("manifest-missing-key", lambda t, g: _recording(t, g, _drop("record_digests")), {},
     "lacks the key 'record_digests'"),
    ("manifest-short-digests", lambda t, g: _recording(t, g, _set("record_digests", ["0" * 64])), {},
     "record_digests must hold 16"),
    ("manifest-path-outside", lambda t, g: _recording(
        t, g, _set("files", [{"path": "../../etc/passwd", "records": 16}])), {}, "lies outside the recording"),
    ("manifest-groups-disagree", lambda t, g: _recording(t, g, _set("num_groups", 99)), {},
     "num_groups 99 disagrees with files[0].records 16"),
    ("manifest-trajectories-disagree", lambda t, g: _recording(t, g, _set("num_trajectories", 7)), {},
     "trajectories but the manifest says 7"),
    ("manifest-schema-version", lambda t, g: _recording(t, g, _set("schema_version", 99)), {},
     "schema_version 99 is not supported"),
    ("checkpoint-nan-weight", lambda t, g: _checkpoint(t, tensors=_nan_in("model.norm.weight")), {},
     "tensor model.norm.weight in"),
    ("checkpoint-third-layer", lambda t, g: _checkpoint(t, tensors=dict(preset_tensors(), **{
        "model.layers.2.input_layernorm.weight": np.ones(64, np.float32)})), {},
     "1 tensor(s) in its *.safetensors are not the model's (model.layers.2.input_layernorm.weight"),
    ("checkpoint-kv-heads", lambda t, g: _checkpoint(t, num_key_value_heads=3), {},
     "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ("checkpoint-weights-a-fifo", lambda t, g: _fifo_weights(t), {}, "model.safetensors is a FIFO (named pipe)"),
    ("checkpoint-context", lambda t, g: _checkpoint(t, max_position_embeddings=8), {},
     "tokens is longer than the model's context of 8 (max_position_embeddings"),
    ("gemma3-soft-capping", lambda t, g: _gemma3_checkpoint(t, final_logit_softcapping=30.0), {},
     "final_logit_softcapping=30.0, which Tunix's Gemma3 does not implement (it runs final_logit_softcapping=None)"),
    ("gemma3-untied", lambda t, g: _gemma3_checkpoint(t, tie_word_embeddings=False), {},
     "tie_word_embeddings=False, which Tunix's Gemma3 does not implement"),
    ("gemma3-multimodal", lambda t, g: _gemma3_checkpoint(t, model_type="gemma3"), {},
     "names model_type='gemma3' (Gemma 3 with its vision tower; the engine trains the text-only gemma3_text)"),
    ("gemma3-query-scale", lambda t, g: _gemma3_checkpoint(t, query_pre_attn_scalar=100), {},
     "query_pre_attn_scalar=100; Tunix's Gemma3 scales queries by the head size or the width per head (16 here)"),
    ("gemma3-pattern", lambda t, g: _gemma3_checkpoint(t, layer_types=["full_attention"] * 6), {},
     "layer_types gives layer 0 full_attention where Tunix's Gemma3 runs sliding_attention"),
    ("chat-template-raises", lambda t, g: _chat_template(t, "{{ raise_exception('no tools') }}"), {},
     "fails on a prompt (TemplateError: no tools)"),
    ("batch-steps-zero", ["rollouts.batch_steps=0"], {}, "rollouts.batch_steps=0 is out of range: it must be >= 1"),
    ("batch-steps-negative", ["rollouts.batch_steps=-1"], {}, "rollouts.batch_steps=-1 is out of range"),
    ("batch-steps-fraction", ["rollouts.batch_steps=1.5"], {}, "rollouts.batch_steps: expected a whole number"),
    ("batch-steps-word", ["rollouts.batch_steps=two"], {}, "rollouts.batch_steps: expected int, got 'two'"),
    ("batch-steps-boolean", ["rollouts.batch_steps=true"], {}, "rollouts.batch_steps: expected int, got boolean True"),
    ("batch-steps-absurd", ["rollouts.batch_steps=5000"], {}, "rollouts.batch_steps=5000 is out of range"),
    ("per-call-zero", ["rollouts.micro_batches_per_call=0"], {},
     "rollouts.micro_batches_per_call=0 is out of range: it must be >= 1"),
    ("per-call-fraction", ["rollouts.micro_batches_per_call=1.5"], {},
     "rollouts.micro_batches_per_call: expected 'batch' (a whole sampled batch per call) or a whole number"),
    ("per-call-word", ["rollouts.micro_batches_per_call=all"], {},
     "rollouts.micro_batches_per_call: expected 'batch' (a whole sampled batch per call) or a whole number of"
     " micro-batches, got 'all'"),
    ("per-call-not-dividing", ["rollouts.micro_batches_per_call=3"], {},
     "rollouts.micro_batches_per_call=3 does not divide a sampled batch of 8 micro-batches"),
    ("epochs-zero", ["engine.epochs=0"], {}, "engine.epochs=0 is out of range: it must be in [1, 1024]"),
    ("epochs-negative", ["engine.epochs=-1"], {}, "engine.epochs=-1 is out of range"),
    ("epochs-fraction", ["engine.epochs=1.5"], {}, "engine.epochs: expected a whole number"),
    ("epochs-word", ["engine.epochs=two"], {}, "engine.epochs: expected int, got 'two'"),
    ("epochs-boolean", ["engine.epochs=true"], {}, "engine.epochs: expected int, got boolean True"),
    ("batch-steps-synthetic", ["rollouts.source=synthetic", "rollouts.batch_steps=2"], {},
     "rollouts.batch_steps=2 is read by the live loop only, but rollouts.source=synthetic"),
    ("epochs-replayed", lambda t, g: ON_RECORDING + [f"rollouts.recording={g}", "engine.epochs=2"], {},
     "engine.epochs=2 is read by the live loop only, but rollouts.source=recording"),
    ("router-replay-on-dense", ["model=tiny", "engine.router_replay=true"], {},
     "engine.router_replay=true replays the experts an MoE model's sampler chose, but 'tiny' is dense"),
    ("router-replay-short-form-on-dense", ["model=tiny", "moe.router_replay=true"], {},
     "engine.router_replay=true replays the experts an MoE model's sampler chose"),
    ("router-replay-of-a-recording-without-routing", lambda t, g: [
        "model=tiny_moe", "batch.rows=16", "steps=2", "rollouts.source=recording", f"rollouts.recording={g}",
        "engine.router_replay=true"], {},
     "was recorded without routing, but engine.router_replay is on: record it again with"),
    ("recording-too-short", lambda t, g: ON_RECORDING[:-2] + ["steps=500", "rollouts.source=recording",
                                                             f"rollouts.recording={g}"], {}, "500 were asked for"),
]


@pytest.mark.e2e
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(case, tmp_path, good_recording, capsys, monkeypatch):
  _, argv, env, message = case
  argv = argv(tmp_path, good_recording) if callable(argv) else list(argv)
  out = tmp_path / "out"
  serving = argv[:1] == ["serve-trainer"]  # a server has no run directory
  if "--out" not in argv and "--resume" not in argv and not serving:
    argv += ["--out", str(out)]
  if "--resume" not in argv:
    argv.append("run.reserve_host_core=false")
  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
  code = cli.main(argv)
  err = capsys.readouterr().err
  assert code == 2, err
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("run_rl serve-trainer: error:" if serving else "run_rl: error:"), err
  assert message in lines[0]
  assert "Traceback" not in err
  assert not out.exists()
  assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


@pytest.mark.spec
def test_the_table_covers_at_least_forty_inputs():
  assert len(CASES) + len(PAYLOADS) >= 40


def _traj(**kw):
  fields = dict(prompt_ids=np.array([1, 2], np.int32), completion_ids=np.array([3, 4, 5], np.int32),
                advantage=1.0, old_logprobs=None)
  fields.update(kw)
  return Trajectory(**fields)


PAYLOADS = [
    ("old-logprobs-nan", [_traj(old_logprobs=np.array([-1.0, np.nan, -1.0], np.float32))], "non-finite"),
    ("old-logprobs-inf", [_traj(old_logprobs=np.array([-np.inf, -1.0, -1.0], np.float32))], "non-finite"),
    ("old-logprobs-length", [_traj(old_logprobs=np.array([-1.0], np.float32))], "must match completion_ids"),
    ("advantage-inf", [_traj(advantage=float("inf"))], "must be finite"),
    ("advantage-overflows", [_traj(advantage=3e38)], "|advantage| must be <="),
    ("token-outside-vocab", [_traj(completion_ids=np.array([3, 600], np.int32))], "outside the model's vocabulary"),
    ("empty", [], "payload is empty"),
    ("too-long", [_traj(completion_ids=np.arange(1, 100, dtype=np.int32))], "more than tokens_per_row=64"),
]


@pytest.mark.spec
@pytest.mark.parametrize("case", PAYLOADS, ids=[c[0] for c in PAYLOADS])
def test_bad_payloads_raise_value_error_naming_the_problem(case):
  _, payload, message = case
  with pytest.raises(ValueError, match=message.replace("|", r"\|")):
    pack_payload(payload, rows=4, tokens_per_row=64, vocab_size=512)


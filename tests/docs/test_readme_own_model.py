"""The README's "Training your own model" commands, run as written, end with an exported model.

The block is read from README.md itself, so the test follows the README: its
placeholders (the checkpoint directory and the prompt file) are replaced by a
tiny Qwen3 checkpoint with a chat template and a file of sums. What is added
makes it a test's size: ``steps=2`` (not the recipe's 200), ``batch.rows=8``
(not the block's 64), ``rollouts.groups_per_micro_batch=2`` and
``task.eval_prompts=4`` (not the recipe's 8 and 16); the block's other keys
stay as written (the rows' 1,024 tokens, the 256-token prompts and 512-token
completions, bfloat16). The
``tensorboard`` line is not run (TensorBoard is not installed here); the event
files it would read are checked instead.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.app import cli
from orchestrator.engine import model as model_lib
from orchestrator.models import hf_checkpoint
from orchestrator.engine.diagnostics import tree_digest
from tests.engine.test_hf_checkpoint import write_checkpoint

pytestmark = pytest.mark.e2e

README = Path(__file__).resolve().parents[2] / "README.md"
CHECKPOINT_PLACEHOLDER = "/models/Qwen3-0.6B"
PROMPTS_PLACEHOLDER = "data/train.jsonl"


def own_model_commands() -> list[str]:
  """The shell commands of the ```bash block under "## Training your own model" that trains a checkpoint of the
  reader's (the one naming the placeholder; the section's first block imports SmolLM2), continuations joined."""
  section = README.read_text().split("## Training your own model", 1)[1].split("\n## ", 1)[0]
  block = next(b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if CHECKPOINT_PLACEHOLDER in b)
  joined = block.replace("\\\n", " ")
  return [line.split("#", 1)[0].strip() for line in joined.splitlines() if line.split("#", 1)[0].strip()]


def test_the_readme_block_is_found_and_names_its_placeholders():
  commands = own_model_commands()
  assert [c.split()[:2] for c in commands] == [["run_rl", "--recipe"], ["tensorboard", "--logdir"],
                                               ["run_rl", "export"]]
  assert CHECKPOINT_PLACEHOLDER in commands[0] and PROMPTS_PLACEHOLDER in commands[0]


@pytest.fixture(autouse=True)
def _no_switches(monkeypatch):
  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)


def test_the_readme_own_model_commands_as_written_end_with_an_exported_model(tmp_path, monkeypatch, capsys):
  checkpoint = tmp_path / CHECKPOINT_PLACEHOLDER.lstrip("/")
  write_checkpoint(checkpoint, "tiny")
  settings = json.loads((checkpoint / "tokenizer_config.json").read_text())
  settings["chat_template"] = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt %} {% endif %}")
  (checkpoint / "tokenizer_config.json").write_text(json.dumps(settings))
  prompts = tmp_path / PROMPTS_PLACEHOLDER
  prompts.parent.mkdir()
  prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                             for a in range(8) for b in range(8)))
  (tmp_path / "recipes").symlink_to(README.parent / "recipes")  # the commands run from a checkout's root
  monkeypatch.chdir(tmp_path)

  train, _, export = own_model_commands()
  train = train.replace(CHECKPOINT_PLACEHOLDER, str(checkpoint)).replace(PROMPTS_PLACEHOLDER, str(prompts))
  test_size = ["steps=2", "batch.rows=8", "rollouts.groups_per_micro_batch=2", "task.eval_prompts=4"]
  assert cli.main(shlex.split(train)[1:] + test_size) == 0
  run = tmp_path / "runs" / "my-model"
  assert json.loads((run / "summary.json").read_text())["ended"] == "completed"
  assert any((run / "tensorboard").rglob("events.out.tfevents.*"))
  capsys.readouterr()

  assert cli.main(shlex.split(export)[1:]) == 0
  exported = tmp_path / "exported" / "my-model"
  written = json.loads((exported / "export.json").read_text())
  assert written["step"] == 2
  _, params, _ = model_lib.build_model(hf_checkpoint.load_preset_from_checkpoint(exported), 0)
  assert tree_digest(params) == written["weights_digest"]

"""Every ``run_rl`` command the docs show still parses, and its recipe overrides still resolve.

A command is a line of a fenced block in README.md or docs/*.md whose first word, after optional environment
assignments (``XLA_FLAGS=... run_rl ...``), is ``run_rl``; ``\\`` continuations are joined and shell comments
dropped. It goes through ``run_rl``'s own dispatch (``orchestrator.app.cli.main``) up to the first parse of
its arguments, by the main form's parser or the subcommand's, and stops there: nothing is run, built or
written. Where the command names no file that is not on disk (the placeholders below), its recipe and
``key=value`` overrides are then resolved as ``run_rl`` resolves them, with the line's own environment.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.app import cli
from orchestrator.app.arguments import UsageErrorParser

pytestmark = pytest.mark.spec

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: Marks of a usage synopsis (``run_rl [--recipe PATH] ...``), which shows a command's shape, not a command.
SYNOPSIS_MARKS = ("[", " | ", "...")
#: Values the docs use for files of the reader's own: such a command parses, but is not resolved.
PLACEHOLDERS = {
    "R": "a recipe of the reader's",
    "recipes/bigger.yaml": "another job's recipe",
    "/models/Qwen3-0.6B": "a Hugging Face checkpoint directory",
    "models/SmolLM2-135M-Instruct": "the directory run_rl import-gguf writes",
    "data/train.jsonl": "a prompt file",
    "/secure/trainer.token": "a token file",
}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


class _Parsed(BaseException):
  """Raised in place of going on once the command's arguments are parsed (not an Exception: no handler of the
  command catches it)."""

  def __init__(self, parser: argparse.ArgumentParser, args: argparse.Namespace):
    super().__init__(parser.prog)
    self.parser, self.namespace = parser, args


def _parse_and_stop(self, args=None, namespace=None):
  raise _Parsed(self, argparse.ArgumentParser.parse_intermixed_args(self, args, namespace))


def fenced_lines(text: str) -> list[tuple[int, str]]:
  """(line number, line) of every fenced code line, ``\\`` continuations joined onto the line they start on."""
  lines, inside, pending, start = [], False, "", 0
  for number, line in enumerate(text.splitlines(), 1):
    if line.lstrip().startswith("```"):
      inside, pending = not inside, ""
      continue
    if not inside:
      continue
    if not pending:
      start = number
    if line.rstrip().endswith("\\"):
      pending += line.rstrip()[:-1] + " "
      continue
    lines.append((start, pending + line))
    pending = ""
  return lines


def split_command(line: str) -> tuple[dict[str, str], list[str]] | None:
  """(environment assignments, arguments after ``run_rl``) for a ``run_rl`` command line, else None."""
  try:
    words = shlex.split(line, comments=True)
  except ValueError:  # not shell (a table of output, a YAML value with one quote)
    return None
  env = {}
  while words and ASSIGNMENT.match(words[0]):
    name, value = words.pop(0).split("=", 1)
    env[name] = value
  if not words or words[0] != "run_rl":
    return None
  return env, words[1:]


def doc_commands() -> list[tuple[str, str]]:
  """(where, line) of every ``run_rl`` command in a fenced block of the docs, usage synopses left out."""
  found = []
  for path in DOCS:
    for number, line in fenced_lines(path.read_text()):
      if split_command(line) and not any(mark in line.split("#", 1)[0] for mark in SYNOPSIS_MARKS):
        found.append((f"{path.relative_to(REPO)}:{number}", line.strip()))
  return found


def problem(line: str, monkeypatch) -> str | None:
  """Why ``line`` does not parse or resolve as ``run_rl`` would, or None."""
  env, argv = split_command(line)
  with monkeypatch.context() as patch:
    patch.setattr(UsageErrorParser, "parse_intermixed_args", _parse_and_stop)
    try:
      code = cli.main(argv)
    except _Parsed as parsed:
      parser, args = parsed.parser, parsed.namespace
    except SystemExit as e:  # --help prints and exits
      return None if e.code == 0 else f"exit {e.code}"
    else:
      return f"refused before parsing ended (exit {code})"
  if getattr(args, "resume", None) or not hasattr(args, "overrides"):
    return None  # a resume takes its recipe from the run; export takes none
  named = [args.recipe or "", *(o.split("=", 1)[-1] for o in args.overrides)]
  if any(value in PLACEHOLDERS for value in named):
    return None
  try:
    if parser.prog == "run_rl":
      cli.resolve_from_args(args, env=env)
    else:
      recipe_lib.resolve(args.recipe, env=env, overrides=args.overrides)
  except recipe_lib.RecipeError as e:
    return f"recipe: {e}"
  return None


@pytest.fixture(autouse=True)
def _from_the_repository_root(monkeypatch):
  monkeypatch.chdir(REPO)  # the docs' relative paths (recipes/..., recordings/...) are from a checkout's root


def test_the_docs_show_commands_of_every_form():
  lines = [line for _, line in doc_commands()]
  assert len(lines) >= 20
  for form in ("run_rl", "run_rl --resume", "run_rl simulate", "run_rl rig", "run_rl export",
               "run_rl serve-trainer", "run_rl record"):
    assert any(line.startswith(form) for line in lines), form
  assert any(line.startswith("XLA_FLAGS=") for line in lines)


def test_every_run_rl_command_in_the_docs_parses_and_its_overrides_resolve(monkeypatch, capsys):
  failures = [f"{where}: {line}\n    {why}" for where, line in doc_commands()
              if (why := problem(line, monkeypatch))]
  capsys.readouterr()
  assert not failures, "\n".join(failures)


@pytest.mark.parametrize("line", [
    "run_rl --no-such-switch",
    "run_rl simulate --recipe recipes/default.yaml --no-such-flag",
    "run_rl export runs/mine",                                 # --out is required
    "run_rl engine.no_such_key=1",
    "STAGE_BEFORE_UPDATE=maybe run_rl",
    "run_rl --recipe recipes/default.yaml steps=-3",
])
def test_a_command_that_does_not_parse_or_resolve_is_reported(line, monkeypatch, capsys):
  assert problem(line, monkeypatch)
  capsys.readouterr()


def test_continuations_are_joined_and_comments_and_synopses_left_out():
  text = ("```bash\nXLA_FLAGS=--x=4 run_rl mesh.fsdp=2 \\\n    steps=3   # a comment\n"
          "run_rl [--recipe PATH] [key=value ...]\necho run_rl\n```\nrun_rl outside a block\n")
  joined = [(n, line) for n, line in fenced_lines(text) if split_command(line)]
  assert [n for n, _ in joined] == [2, 4]
  assert split_command(joined[0][1]) == ({"XLA_FLAGS": "--x=4"}, ["mesh.fsdp=2", "steps=3"])

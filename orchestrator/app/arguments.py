"""The command line's parsers: ``run_rl`` and its subcommands refuse bad usage in one line, exit 2.

``UsageErrorParser`` raises ``UsageError`` where argparse would print and exit
itself, so that every refusal leaves through the command's one exit path.
``subcommand_parser`` and ``parse_subcommand`` are what every subcommand
(``record``, ``rig``, ``simulate``, ``serve-trainer``) starts with.
"""

from __future__ import annotations

import argparse
import sys

from orchestrator import recipe as recipe_lib


class UsageError(Exception):
  """The command line cannot be parsed (the message says what was wrong)."""


class UsageErrorParser(argparse.ArgumentParser):
  """An ArgumentParser whose errors raise ``UsageError`` instead of exiting (``--help`` still exits 0)."""

  def error(self, message):  # argparse would exit itself; keep one exit path
    raise UsageError(message)


def subcommand_parser(name: str, description: str) -> argparse.ArgumentParser:
  """``run_rl NAME``'s parser with what every subcommand takes: ``--recipe`` and ``key=value`` overrides."""
  p = UsageErrorParser(prog=f"run_rl {name}", description=description)
  p.add_argument("--recipe", help=f"recipe YAML (default: {recipe_lib.DEFAULT_RECIPE})")
  p.add_argument("overrides", nargs="*", metavar="key=value")
  return p


def parse_subcommand(parser: argparse.ArgumentParser, argv: list[str]):
  """(args, resolved recipe), or (None, exit code 2) after printing the one error line."""
  try:
    args = parser.parse_intermixed_args(argv)
    return args, recipe_lib.resolve(args.recipe, overrides=args.overrides)
  except (UsageError, recipe_lib.RecipeError) as e:
    print(f"{parser.prog}: error: {e}", file=sys.stderr)
    return None, 2

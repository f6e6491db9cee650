"""docs/testing.md maps every test file to what it specifies: none is missing from it, none it names is gone."""

from __future__ import annotations

import re

import pytest

from tests.conftest import LONGEST_FIRST, REPO

pytestmark = pytest.mark.spec

TESTING = REPO / "docs" / "testing.md"


def _listed(text: str) -> set[str]:
  """The test files a page's tables name, relative to tests/."""
  return set(re.findall(r"^\| `((?:[a-z_]+/)?test_[a-z0-9_]+\.py)` \|", text, re.M))


def test_every_test_file_is_listed_once_with_what_it_specifies_and_every_listed_file_exists():
  on_disk = {p.relative_to(REPO / "tests").as_posix() for p in (REPO / "tests").rglob("test_*.py")}
  assert _listed(TESTING.read_text()) == on_disk


def test_a_file_left_out_of_the_map_is_caught():
  """Negative control: the parser sees a row, and a map without it differs from the files on disk."""
  row = "| `loop/test_program_engine.py` | The program on the real engine. | engine |\n"
  assert _listed(row) == {"loop/test_program_engine.py"}
  without = re.sub(r"^\| `loop/test_program_engine\.py` \|.*\n", "", TESTING.read_text(), flags=re.M)
  assert "loop/test_program_engine.py" in _listed(TESTING.read_text())
  assert "loop/test_program_engine.py" not in _listed(without)


def _not_in_suite(paths) -> list[str]:
  """The paths of a run-first list that name no test file of this suite (a renamed file drops out of the order
  silently otherwise)."""
  return [path for path in paths if not (path.startswith("tests/") and (REPO / path).is_file())]


def test_the_files_the_suite_runs_first_are_its_own():
  assert not _not_in_suite(LONGEST_FIRST), "conftest.LONGEST_FIRST names files that are gone: rename them there"
  # Negative control: a renamed file is caught.
  assert _not_in_suite((*LONGEST_FIRST[:1], "tests/app/test_renamed_away.py")) == ["tests/app/test_renamed_away.py"]

"""docs/testing.md maps every test file to what it specifies: none is missing from it, none it names is gone, and
each row says whether its file holds tests of the long tier."""

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


def _tiers(text: str) -> dict[str, set[str]]:
  """Each listed test file's tiers, from its row's last column."""
  rows = re.findall(r"^\| `((?:[a-z_]+/)?test_[a-z0-9_]+\.py)` \|.*\| ([a-z0-9, ]+) \|\s*$", text, re.M)
  return {path: {tier.strip() for tier in tiers.split(",")} for path, tiers in rows}


def _tiers_that_miss_slow(text: str) -> list[str]:
  """The files whose row's tiers say ``slow`` where the file marks no test slow, or the reverse."""
  return [path for path, tiers in _tiers(text).items()
          if ("slow" in tiers) != bool(re.search(r"pytest\.mark\.slow\b", (REPO / "tests" / path).read_text()))]


def test_the_map_says_which_files_hold_tests_of_the_long_tier():
  """``pytest`` leaves the ``slow`` tests out, so the map says where they are: a row names ``slow`` exactly
  where its file marks a test slow."""
  text = TESTING.read_text()
  assert set(_tiers(text)) == _listed(text)  # every row's tiers are read
  assert not _tiers_that_miss_slow(text), "docs/testing.md: give these rows' tiers `slow`, or take it away"
  # Negative controls: a row that drops `slow` is caught, and one that names it for a file without slow tests.
  row = next(line for line in text.splitlines() if line.startswith("| `app/test_core_plan_runs.py`"))
  assert _tiers_that_miss_slow(text.replace(row, row.replace("e2e, slow |", "e2e |"))) == ["app/test_core_plan_runs.py"]
  row = next(line for line in text.splitlines() if line.startswith("| `loop/test_program_engine.py`"))
  assert _tiers_that_miss_slow(text.replace(row, row.rstrip()[:-1] + ", slow |")) == ["loop/test_program_engine.py"]

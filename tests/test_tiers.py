"""The suite's tiers hold: a test without a tier marker is refused, and a spec test that needs JAX fails the
spec tier (docs/testing.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def _pytest_in(tmp_path, test_source: str, *args: str) -> subprocess.CompletedProcess:
  """Runs pytest on one test file beside a copy of this suite's conftest, in a child."""
  suite = tmp_path / "tests"
  suite.mkdir()
  shutil.copy(REPO / "tests" / "conftest.py", suite / "conftest.py")
  (suite / "test_example.py").write_text(test_source)
  env = dict(os.environ, PYTHONPATH=str(REPO), STEP_BOUNDARY_COMPILATION_CACHE="off")
  return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite), *args],
                        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)


def test_a_test_without_a_tier_is_refused_by_name(tmp_path):
  run = _pytest_in(tmp_path, "def test_untiered():\n  pass\n")
  assert run.returncode != 0
  assert "test_untiered (none)" in run.stdout + run.stderr


def test_a_spec_test_that_imports_jax_fails_the_spec_tier(tmp_path):
  source = ("import pytest\n\n"
            "@pytest.mark.spec\n"
            "def test_pure():\n  assert 1 + 1 == 2\n\n"
            "@pytest.mark.spec\n"
            "def test_needs_jax():\n  import jax\n  assert jax.numpy.zeros(1).shape == (1,)\n")
  run = _pytest_in(tmp_path, source, "-m", "spec")
  assert run.returncode != 0, run.stdout
  assert "the spec tier imported jax" in run.stdout


def test_the_same_spec_tests_pass_without_the_jax_one(tmp_path):
  """Negative control for the one above: it fails for the JAX import, not for the way it runs."""
  source = "import pytest\n\n@pytest.mark.spec\ndef test_pure():\n  assert 1 + 1 == 2\n"
  run = _pytest_in(tmp_path, source, "-m", "spec")
  assert run.returncode == 0, run.stdout + run.stderr

"""Shared fixtures: one compiled ``tiny`` engine per test session, restored to its start per test; one
persistent XLA compilation cache per test session, shared with every child process it starts."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from orchestrator.app.host import COMPILATION_CACHE_ENV, use_compilation_cache

REPO = Path(__file__).resolve().parents[1]

# Most tests build the same few programs again (in this process and in the run_rl processes they start): a
# cache for this session compiles each once per host layout (orchestrator.app.host keys it by the thread pool
# and forced devices, so no test loads a program built for another layout). Set before JAX's first compile.
if COMPILATION_CACHE_ENV not in os.environ:  # =off runs the suite without one
  _cache = tempfile.mkdtemp(prefix="step-boundary-test-xla-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ[COMPILATION_CACHE_ENV] = _cache
use_compilation_cache()


@pytest.fixture(scope="session")
def tiny_engine_and_start():
  from orchestrator.engine import build_engine

  engine = build_engine("tiny", seed=0)
  return engine, engine.snapshot()


@pytest.fixture
def tiny_engine(tiny_engine_and_start):
  """The shared tiny engine, at its initial state."""
  engine, start = tiny_engine_and_start
  engine.restore(start)
  return engine


@pytest.fixture(scope="session")
def tiny_source(tiny_engine_and_start):
  from orchestrator.data.synthetic import SyntheticRollouts

  engine, _ = tiny_engine_and_start
  return SyntheticRollouts(engine.preset.vocab_size, engine.rows, engine.tokens_per_row, seed=7)


def run_child(code: str, *, devices: int = 1, timeout: int = 600, env: dict | None = None) -> str:
  """Runs ``code`` in a fresh Python with ``devices`` forced host devices; returns its stdout.

  Fails the calling test if the child fails; the child must print ``CHILD-OK``
  last, so a child that silently did nothing fails too.
  """
  child_env = dict(os.environ)
  child_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  child_env["PYTHONPATH"] = str(REPO) + os.pathsep + child_env.get("PYTHONPATH", "")
  child_env.update(env or {})
  proc = subprocess.run(
      [sys.executable, "-c", code],
      capture_output=True,
      text=True,
      timeout=timeout,
      env=child_env,
      cwd=REPO,
  )
  if proc.returncode != 0 or "CHILD-OK" not in proc.stdout:
    pytest.fail(
        f"child process failed (rc={proc.returncode})\n--- stdout\n{proc.stdout[-4000:]}"
        f"\n--- stderr\n{proc.stderr[-6000:]}"
    )
  return proc.stdout

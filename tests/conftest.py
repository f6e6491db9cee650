"""Shared fixtures and the suite's tiers: one compiled ``tiny`` engine per test session, restored to its start
per test; one persistent XLA compilation cache per test session, shared with every child process it starts.

Every test carries exactly one tier marker (``docs/testing.md``): ``spec`` runs without JAX, ``engine`` on the
shared tiny engine or JAX in this process, ``e2e`` through the app or a child process. A run of ``-m spec``
collects only the files that hold spec tests and fails if anything imported JAX."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from orchestrator.host.compilation_cache import COMPILATION_CACHE_ENV, use_compilation_cache

REPO = Path(__file__).resolve().parents[1]

# Most tests build the same few programs again (in this process and in the run_rl processes they start): a
# cache for this session compiles each once per host layout (orchestrator.host.compilation_cache keys it by
# the thread pool and forced devices, so no test loads a program built for another layout). Set before JAX's first compile.
if COMPILATION_CACHE_ENV not in os.environ:  # =off runs the suite without one
  _cache = tempfile.mkdtemp(prefix="step-boundary-test-xla-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ[COMPILATION_CACHE_ENV] = _cache

TIERS = ("spec", "engine", "e2e")
#: The test files that take longest, longest first (the suite's --durations lists them; docs/benchmarks.md, "The
#: test suite"), in the suite and in the long tier (``-m slow``) alike: of either, the files it runs keep
#: this order. They run before the rest, so that the two xdist workers end together rather than one finishing a
#: long file alone; `--no-loadscope-reorder` (pyproject.toml) keeps this order, where xdist would otherwise start
#: with the files that hold the most tests, most of them quick.
LONGEST_FIRST = (
    "tests/distributed/test_distributed.py", "tests/app/test_resume.py", "tests/live/test_in_flight_runs.py",
    "tests/remote/test_families_on_a_mesh.py", "tests/engine/test_hf_checkpoint.py", "tests/engine/test_moe_rerun.py",
    "tests/engine/test_real_model.py", "tests/distributed/test_live_job.py", "tests/live/test_sampler_process.py",
    "tests/live/test_grpo_options.py", "tests/app/test_cli.py", "tests/distributed/test_in_flight_job.py",
    "tests/engine/test_router_replay.py", "tests/engine/test_memory_paths.py", "tests/engine/test_moe_routed.py",
    "tests/app/test_core_plan_runs.py", "tests/bench/test_bench_in_flight.py", "tests/live/test_live_placement.py",
    "tests/remote/test_remote.py", "tests/remote/test_live_remote.py", "tests/live/test_batch_steps.py",
    "tests/live/test_live_loop.py", "tests/integrations/test_tunix_grpo.py", "tests/live/test_evaluations.py",
)
#: What a spec test must run without: imported in this process, any of them fails a ``-m spec`` run.
JAX_MODULES = ("jax", "jaxlib", "flax", "tunix", "optax", "orbax")


def _spec_only(config) -> bool:
  return config.getoption("markexpr", "").strip() == "spec"


def pytest_ignore_collect(collection_path, config):
  """Under ``-m spec``, a test file that holds no spec test is not imported (most import JAX)."""
  if _spec_only(config) and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
    return "pytest.mark.spec" not in collection_path.read_text()
  return None


@pytest.hookimpl(trylast=True)  # after -m has deselected: the items are the ones that run
def pytest_collection_modifyitems(config, items):
  """Refuses a test without exactly one tier marker; puts the files of ``LONGEST_FIRST`` first, in its order; turns
  the compilation cache on unless only spec tests run (its setting imports JAX, which must happen before the first
  compile, and no test compiles yet)."""
  untiered = [f"{item.nodeid} ({', '.join(m) or 'none'})" for item in items
              for m in [[t for t in TIERS if item.get_closest_marker(t)]] if len(m) != 1]
  if untiered:
    raise pytest.UsageError("each test needs exactly one of @pytest.mark.spec / engine / e2e (docs/testing.md): "
                            + "; ".join(untiered))
  rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
  if not all(item.get_closest_marker("spec") for item in items):
    use_compilation_cache()


_jax_reported = False


@pytest.fixture(autouse=True)
def _spec_tests_run_without_jax(request):
  """Under ``-m spec``, fails the first test after which JAX is imported (in whichever worker runs it)."""
  yield
  global _jax_reported
  if _spec_only(request.config) and not _jax_reported:
    imported = sorted(name for name in JAX_MODULES if name in sys.modules)
    if imported:
      _jax_reported = True
      pytest.fail(f"the spec tier imported {', '.join(imported)} (this test, or a module collected with it): "
                  "a test marked spec needs JAX; mark it engine or e2e", pytrace=False)


@pytest.fixture(autouse=True)
def _worker_cores_restored():
  """A run in the test's process that starts JAX moves this thread onto its host core (host/host_threads.py), and
  the process it belongs to is the worker's: every child a later test starts would inherit that one core (a run
  started there plans for one core, and shares it with the other worker's children)."""
  cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
  yield
  if cores is not None and os.sched_getaffinity(0) != cores:
    os.sched_setaffinity(0, cores)


@pytest.fixture(autouse=True)
def _root_logger_restored():
  """A test that runs ``main`` configures logging onto its captured stderr (``force=True``), which closes when
  the test ends: the next test in that worker that logs would print a logging error into its own stderr."""
  root = logging.getLogger()
  handlers, level = list(root.handlers), root.level
  yield
  root.handlers[:] = handlers
  root.setLevel(level)


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

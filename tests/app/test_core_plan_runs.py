"""Runs side by side take different cores, and a run on one core works (the core plan, host/host_threads.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.host.core_claims import CLAIMS_ENV, XLA_POOL_THREAD
from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")]


#: Starts the rest of its command line pinned to the cores given first (no fork of this JAX-holding process).
PINNED = ("import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')});"
          " os.execv(sys.argv[2], sys.argv[2:])")


def _start(out: Path, claims: Path, *args: str, cores=None) -> subprocess.Popen:
  env = dict(os.environ, PYTHONPATH=str(REPO), **{CLAIMS_ENV: str(claims)})
  command = [sys.executable, "-m", "orchestrator.app.cli", "--out", str(out), *args]
  if cores:
    command = [sys.executable, "-c", PINNED, ",".join(map(str, cores)), *command]
  return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def _xla_cores(pid: int, *, every_thread: bool = False) -> set[int]:
  """The cores XLA's pool threads of ``pid`` (or all its threads) may run on (from /proc)."""
  cores = set()
  for task in Path(f"/proc/{pid}/task").iterdir():
    if every_thread or (task / "comm").read_text().startswith(XLA_POOL_THREAD):
      line = next(l for l in (task / "status").read_text().splitlines() if l.startswith("Cpus_allowed_list"))
      for part in line.split()[1].split(","):
        lo, _, hi = part.partition("-")
        cores |= set(range(int(lo), int(hi or lo) + 1))
  return cores


def _claim(claims: Path, pid: int) -> Path | None:
  """The claim file of the run ``pid`` (None before it claims)."""
  return next(claims.glob(f"{pid}-*.json"), None) if claims.is_dir() else None


def _wait_for(condition, timeout_s: float, what: str):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    value = condition()
    if value:
      return value
    time.sleep(0.2)
  raise AssertionError(f"timed out waiting for {what}")


def _stop(proc: subprocess.Popen) -> str:
  if proc.poll() is None:
    proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  return err


def test_two_runs_side_by_side_each_take_their_own_cores(tmp_path):
  """The second run takes what the first yields; the first moves every thread off them. Negative control: the
  cores the second takes are the first's (so without yielding they would share them)."""
  claims = tmp_path / "claims"
  first = _start(tmp_path / "a", claims, "--steps", "100000")
  second = None
  try:
    _wait_for(lambda: _claim(claims, first.pid) and _xla_cores(first.pid), 120, "the first run's pool")
    claimed = set(json.loads(_claim(claims, first.pid).read_text())["cores"])
    second = _start(tmp_path / "b", claims, "--steps", "100000")
    _wait_for(lambda: _claim(claims, second.pid) and _xla_cores(second.pid), 120,
              "the second run's pool")
    theirs = _xla_cores(second.pid)
    mine = _wait_for(lambda: (lambda c: c if c and not c & theirs else None)(
        _xla_cores(first.pid, every_thread=True)), 30, "the first run to yield")
    assert theirs <= claimed, (theirs, claimed)
    assert mine and theirs and not mine & theirs
  finally:
    first_err = _stop(first)
    second_err = _stop(second) if second is not None else ""
  assert "[cores]" in first_err and "yields these while this run lives" in second_err.splitlines()[0]
  assert not claims.exists() or not list(claims.glob("*.json"))  # both claims end with their runs


def test_a_run_on_one_core_works(tmp_path):
  run = _start(tmp_path / "one", tmp_path / "claims", "--steps", "3", cores={0})
  _, err = run.communicate(timeout=300)
  assert run.returncode == 0, err[-3000:]
  assert "only 1 core" in err.splitlines()[0]

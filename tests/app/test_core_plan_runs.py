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
  """Starts ``run_rl --out out``; its standard error goes to ``_log(out)`` (a pipe nobody reads while the run goes
  on would fill and stop it)."""
  env = dict(os.environ, PYTHONPATH=str(REPO), **{CLAIMS_ENV: str(claims)})
  command = [sys.executable, "-m", "orchestrator.app.cli", "--out", str(out), *args]
  if cores:
    command = [sys.executable, "-c", PINNED, ",".join(map(str, cores)), *command]
  with open(_log(out), "w", encoding="utf-8") as log:
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=REPO)


def _log(out: Path) -> Path:
  return out.with_name(out.name + ".log")


def _first_line(out: Path) -> str | None:
  """The run's first line of standard error, once it is written whole."""
  text = _log(out).read_text()
  return text.partition("\n")[0] if "\n" in text else None


def _xla_cores(pid: int, *, every_thread: bool = False) -> set[int]:
  """The cores XLA's pool threads of ``pid`` (or all its threads) may run on (from /proc)."""
  cores = set()
  for task in Path(f"/proc/{pid}/task").iterdir():
    try:
      if not every_thread and not (task / "comm").read_text().startswith(XLA_POOL_THREAD):
        continue
      status = (task / "status").read_text()
    except (FileNotFoundError, ProcessLookupError):  # a thread that ended since the listing
      continue
    line = next(l for l in status.splitlines() if l.startswith("Cpus_allowed_list"))
    for part in line.split()[1].split(","):
      lo, _, hi = part.partition("-")
      cores |= set(range(int(lo), int(hi or lo) + 1))
  return cores


def _claim(claims: Path, pid: int) -> Path | None:
  """The claim file of the run ``pid`` (None before it claims)."""
  return next(claims.glob(f"{pid}-*.json"), None) if claims.is_dir() else None


#: How long a run may take to start its XLA pool, far above what it takes: the other worker's jobs and the first
#: run itself (on every core, until it yields) share the machine with the run starting, so its start-up can take
#: minutes. A run that ends first fails the wait at once (``_wait_for``).
START_WAIT_S = 600
#: How long the first run may take to move its threads off the cores the second claimed: its watcher looks every
#: second (core_claims.POLL_S).
YIELD_WAIT_S = 120
#: How long an interrupted run may take to end: it finishes the step in flight first (app/signals.py).
STOP_WAIT_S = 300


def _wait_for(condition, running: dict[Path, subprocess.Popen], what: str, timeout_s: float = START_WAIT_S):
  """Polls ``condition`` until it holds; fails at once, naming ``what``, when one of ``running`` has ended."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    value = condition()
    if value:
      return value
    for out, proc in running.items():
      if proc.poll() is not None:
        raise AssertionError(f"waiting for {what}: {out.name} ended with exit {proc.returncode}:"
                             f" {_log(out).read_text()[-3000:]}")
    time.sleep(0.2)
  raise AssertionError(f"timed out waiting for {what}")


def _stop(runs: dict[Path, subprocess.Popen]) -> dict[Path, str]:
  """Interrupts every run, then waits for each (killed if it outlasts ``STOP_WAIT_S``); their standard error."""
  for proc in runs.values():
    if proc.poll() is None:
      proc.send_signal(signal.SIGINT)
  try:
    for proc in runs.values():
      proc.wait(timeout=STOP_WAIT_S)
  finally:
    for proc in runs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return {out: _log(out).read_text() for out in runs}


def test_two_runs_side_by_side_each_take_their_own_cores(tmp_path):
  """The second run takes what the first yields; the first moves every thread off them. Negative control: the
  cores the second takes are the first's (so without yielding they would share them)."""
  claims, a, b = tmp_path / "claims", tmp_path / "a", tmp_path / "b"
  runs = {a: _start(a, claims, "--steps", "100000")}
  first = runs[a]
  try:
    _wait_for(lambda: _claim(claims, first.pid) and _xla_cores(first.pid), runs, "the first run's pool")
    claimed = set(json.loads(_claim(claims, first.pid).read_text())["cores"])
    second = runs[b] = _start(b, claims, "--steps", "100000")
    _wait_for(lambda: _claim(claims, second.pid) and _xla_cores(second.pid), runs, "the second run's pool")
    theirs = _xla_cores(second.pid)
    mine = _wait_for(lambda: (lambda c: c if c and not c & theirs else None)(
        _xla_cores(first.pid, every_thread=True)), runs, "the first run to yield", YIELD_WAIT_S)
    # the lines come after the pools: wait for them before the runs are stopped
    second_line = _wait_for(lambda: _first_line(b), runs, "the second run's first line")
    _wait_for(lambda: "[cores]" in _log(a).read_text(), runs, "the first run's line on yielding", YIELD_WAIT_S)
    assert theirs <= claimed, (theirs, claimed)
    assert mine and theirs and not mine & theirs
  finally:
    _stop(runs)
  assert "yields these while this run lives" in second_line, second_line
  assert not claims.exists() or not list(claims.glob("*.json"))  # both claims end with their runs


def test_a_run_on_one_core_works(tmp_path):
  out = tmp_path / "one"
  run = _start(out, tmp_path / "claims", "--steps", "3", cores={0})
  try:
    run.wait(timeout=START_WAIT_S)
  finally:
    err = _stop({out: run})[out]
  assert run.returncode == 0, err[-3000:]
  assert "only 1 core" in err.splitlines()[0]

"""Which process of a run holds its directories' locks (``run_dir.lock``).

The process that runs, resumes or launches a run holds its directory's lock
from before it reads anything there to its exit; a second one is refused
naming the holder. A process the launcher started, or a process other than 0
of a job started by hand, holds none: the launcher, or process 0, holds them
for it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from orchestrator.app import run_dir
from orchestrator.distributed.launcher import LAUNCHED_ENV
from orchestrator.recipe.loading import PROCESS_ID_ENV


def holds_the_lock() -> bool:
  """Whether this process takes the run directory's lock: not a process the launcher started (the launcher
  holds it), nor a process other than 0 of a job started by hand (process 0 owns the directory)."""
  return os.environ.get(LAUNCHED_ENV) != "1" and os.environ.get(PROCESS_ID_ENV, "0").strip() in ("", "0")


def lock(path: Path, *, flag: str, create: bool = False):
  """``path``'s lock (``run_dir.lock``), or nothing to hold where another process holds it for this one."""
  return run_dir.lock(path, flag=flag, create=create) if holds_the_lock() else contextlib.nullcontext()


def lock_run(path: Path, *, flag: str):
  """The lock of the run in ``path`` (``run_dir.lock_run``), or nothing to hold where another process holds it."""
  return run_dir.lock_run(path, flag=flag) if holds_the_lock() else contextlib.nullcontext()

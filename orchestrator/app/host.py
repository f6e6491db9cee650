"""This process's host settings, made before JAX starts its backend: XLA's CPU pool, the host core, logging.

A run of ``run_rl`` and ``run_rl serve-trainer`` make them once the recipe is
validated and before the first JAX import, since XLA reads them when its CPU
client starts.
"""

from __future__ import annotations

import contextlib
import logging
import sys

from orchestrator import phases
from orchestrator.distributed.bringup import fix_xla_threads
from orchestrator.host.compilation_cache import use_compilation_cache
from orchestrator.host.host_threads import apply_core_plan, release_core_plan

#: Libraries whose INFO lines would bury run_rl's own.
NOISY_LOGGERS = ("absl", "jax", "orbax", "etils")


def setup_host(recipe, *, distributed: bool = False, held: contextlib.ExitStack | None = None,
               among_runs: bool = True, host_after_start_up: bool = False) -> str:
  """Makes this process's host settings; returns its core plan in words (``host_threads.CorePlan.describe``).

  In a job of several processes (``distributed``) XLA's CPU pool is sized to the
  job's devices, the same in every process whatever its share of them. The cores
  follow ``run.reserve_host_core`` and the other runs on this machine
  (``host_threads.apply_core_plan``; ``among_runs=False``: this process's cores
  alone); ``held`` ends the plan's claim when it closes. Logging goes to stderr at INFO, the noisy libraries at WARNING.
  """
  xla_threads = None
  if distributed:  # the same code in every process of the job, whatever its share of devices
    xla_threads = fix_xla_threads(recipe.mesh.num_devices)
  described = apply_core_plan(recipe.run.reserve_host_core, xla_threads=xla_threads, among_runs=among_runs,
                              host_after_start_up=host_after_start_up).describe()
  if held is not None:
    held.callback(release_core_plan)
  logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr, force=True)
  for noisy in NOISY_LOGGERS:
    logging.getLogger(noisy).setLevel(logging.WARNING)
  use_compilation_cache()
  phases.mark("jax_ready")
  return described

"""This process's host settings, made before JAX starts its backend: XLA's CPU pool, the host core, logging.

A run of ``run_rl`` and ``run_rl serve-trainer`` make them once the recipe is
validated and before the first JAX import, since XLA reads them when its CPU
client starts.
"""

from __future__ import annotations

import logging
import sys

from orchestrator.distributed.bringup import fix_xla_threads
from orchestrator.engine.compilation_cache import use_compilation_cache
from orchestrator.engine.host_threads import reserve_host_core

#: Libraries whose INFO lines would bury run_rl's own.
NOISY_LOGGERS = ("absl", "jax", "orbax", "etils")


def setup_host(recipe, *, distributed: bool = False) -> str:
  """Makes this process's host settings; returns why the host core was or was not reserved ("no": not asked).

  In a job of several processes (``distributed``) XLA's CPU pool is sized to the
  job's devices, the same in every process whatever its share of them; with
  ``run.reserve_host_core`` one core is kept for the host side. Logging goes to
  stderr at INFO, the noisy libraries at WARNING.
  """
  reason = "no"
  xla_threads = None
  if distributed:  # the same code in every process of the job, whatever its share of devices
    xla_threads = fix_xla_threads(recipe.mesh.num_devices)
  if recipe.run.reserve_host_core:
    reason = reserve_host_core(xla_threads=xla_threads).reason
  logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr, force=True)
  for noisy in NOISY_LOGGERS:
    logging.getLogger(noisy).setLevel(logging.WARNING)
  use_compilation_cache()
  return reason

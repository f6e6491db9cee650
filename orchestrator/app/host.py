"""This process's host settings, made before JAX starts its backend: XLA's CPU pool, the host core, logging.

A run of ``run_rl`` and ``run_rl serve-trainer`` make them once the recipe is
validated and before the first JAX import, since XLA reads them when its CPU
client starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from orchestrator.distributed.bringup import fix_xla_threads
from orchestrator.engine.host_threads import reserve_host_core

#: Libraries whose INFO lines would bury run_rl's own.
NOISY_LOGGERS = ("absl", "jax", "orbax", "etils")
#: A directory for XLA's persistent compilation cache: repeated runs of the same programs load them instead of
#: compiling them again (minutes for a large model on an accelerator).
COMPILATION_CACHE_ENV = "STEP_BOUNDARY_COMPILATION_CACHE"
#: What XLA compiles for beside the program itself: the CPU thread pool's size (loops are split into as many
#: partitions as it has threads, which changes the last bits of a sum), the forced devices, the platform.
_LAYOUT_ENV = ("PJRT_NPROC", "XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_X64")


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


def compilation_cache_dir(base: str | Path, environ=os.environ) -> Path:
  """Where this process's compiled programs are cached under ``base``: one directory per host layout (thread
  pool, forced devices, platform), so a program compiled for one layout is never loaded under another,
  where a fresh compile could give other bits."""
  layout = json.dumps({name: environ.get(name) for name in _LAYOUT_ENV}, sort_keys=True)
  return Path(base) / hashlib.sha256(layout.encode()).hexdigest()[:16]


def use_compilation_cache(environ=os.environ) -> Path | None:
  """Turns on XLA's persistent compilation cache when ``$STEP_BOUNDARY_COMPILATION_CACHE`` names a directory
  (``off`` or unset: none); returns the directory used, or None. Call after the thread settings, which key it,
  and before the first compile (a cache chosen later is not used). Every program is cached, however quick its
  compile."""
  base = environ.get(COMPILATION_CACHE_ENV)
  if not base or base == "off":
    return None
  path = compilation_cache_dir(base, environ)
  import jax  # import here: after the host's thread settings, which the cache's directory names

  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return path

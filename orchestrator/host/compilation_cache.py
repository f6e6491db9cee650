"""XLA's persistent compilation cache, keyed by the host layout XLA compiles for.

``run_rl``, a trainer it serves and a sampler in a process of its own turn it on
the same way, after their thread settings and before their first compile.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

#: A directory for XLA's persistent compilation cache: repeated runs of the same programs load them instead of
#: compiling them again (minutes for a large model on an accelerator); ``off`` for none.
COMPILATION_CACHE_ENV = "STEP_BOUNDARY_COMPILATION_CACHE"
#: What XLA compiles for beside the program itself: the CPU thread pool's size (loops are split into as many
#: partitions as it has threads, which changes the last bits of a sum), the forced devices, the platform.
_LAYOUT_ENV = ("PJRT_NPROC", "XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_X64")


def compilation_cache_dir(base: str | Path, environ=os.environ) -> Path:
  """Where this process's compiled programs are cached under ``base``: one directory per host layout (thread
  pool, forced devices, platform), so a program compiled for one layout is never loaded under another,
  where a fresh compile could give other bits."""
  layout = json.dumps({name: environ.get(name) for name in _LAYOUT_ENV}, sort_keys=True)
  return Path(base) / hashlib.sha256(layout.encode()).hexdigest()[:16]


def default_cache_base(environ=os.environ) -> Path:
  """Where compiled programs are kept unless ``$STEP_BOUNDARY_COMPILATION_CACHE`` says otherwise: the user's
  cache directory (``$XDG_CACHE_HOME``, else ``~/.cache``), ``step-boundary/xla``."""
  return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "step-boundary" / "xla"  # may raise


def use_compilation_cache(environ=os.environ) -> Path | None:
  """Turns on XLA's persistent compilation cache in ``$STEP_BOUNDARY_COMPILATION_CACHE`` (unset:
  ``default_cache_base``; ``off``: none); returns the directory used, or None (also where it cannot be made).
  Call after the thread settings, which key it, and before the first compile (a cache chosen later is not
  used). Every program is cached, however quick its compile: the default run's first update comes 7.0 s
  after its start with its programs cached, 11.8 s without (docs/benchmarks.md, "Start-up")."""
  try:
    base = environ.get(COMPILATION_CACHE_ENV) or default_cache_base(environ)
  except (RuntimeError, KeyError):  # no home directory to find: compile as without a cache
    return None
  if base == "off":
    return None
  path = compilation_cache_dir(base, environ)
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError:  # an unwritable home: compile as without a cache
    return None
  if not os.access(path, os.W_OK | os.X_OK):  # there but not writable (XLA would warn at every program)
    return None
  import jax  # import here: after the host's thread settings, which the cache's directory names

  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return path

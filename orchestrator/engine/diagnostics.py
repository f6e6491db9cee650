"""Diagnostics: state digests and a count of XLA backend compiles.

The compile counter listens to JAX's public monitoring events. It is installed
on first use, not at import, so importing the engine changes nothing global.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

# The event JAX records once per XLA backend compile (jax.monitoring; stable across 0.4–0.10).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# The event it records instead when the persistent compilation cache supplies the program: for a run that
# counts compiles, a program loaded from the cache is one it would otherwise have compiled.
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_compiles = [0]
_installed = [False]


def _on_event_duration(event: str, duration_s: float, **_: Any) -> None:
  del duration_s
  if event == BACKEND_COMPILE_EVENT:
    with _lock:  # the engine compiles its programs in threads side by side: no count may be lost
      _compiles[0] += 1


def _on_event(event: str, **_: Any) -> None:
  if event == CACHE_HIT_EVENT:
    with _lock:
      _compiles[0] += 1


def backend_compile_count() -> int:
  """XLA backend compiles counted in this process since the counter was first asked for, programs loaded from
  the persistent compilation cache included.

  Callers take differences (compiles during an arm, after warm-up): the first
  call installs the listeners and returns 0.
  """
  with _lock:
    if not _installed[0]:
      jax.monitoring.register_event_duration_secs_listener(_on_event_duration)
      jax.monitoring.register_event_listener(_on_event)
      _installed[0] = True
    return _compiles[0]


def host_value(leaf: Any) -> np.ndarray:
  """The whole value of ``leaf`` on the host. A leaf split over several processes is gathered first — a
  collective: every process of the job must ask for the same leaves in the same order."""
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable and not leaf.is_fully_replicated:
    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
  return np.asarray(jax.device_get(leaf))


def tree_digest(tree: Any) -> str:
  """sha256 over every leaf's path, dtype, shape and bytes (read to the host; gathered across processes)."""
  h = hashlib.sha256()
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  for path, leaf in leaves:
    arr = host_value(leaf)
    h.update(jax.tree_util.keystr(path).encode())
    h.update(str(arr.dtype).encode())
    h.update(str(arr.shape).encode())
    h.update(np.ascontiguousarray(arr).tobytes())
  return h.hexdigest()

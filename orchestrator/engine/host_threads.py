"""Keep one CPU core free for host-side work while XLA computes on the CPU.

XLA's CPU client starts a thread pool sized to every core it may run on. On a
2-core machine that pool takes both cores, so host work — packing the next
micro-batch, copying it, logging — cannot run while a micro-batch computes, and
staging would have nothing to hide behind. ``reserve_host_core`` must run
before JAX creates its CPU client (before the first ``jax.devices()`` or the
first computation):

* it sets ``PJRT_NPROC`` to the cores XLA may use (all but one), which sizes
  XLA's pool, and
* it pins the process to those cores while the client starts (its threads
  inherit that mask), then moves the calling thread — the host side — onto the
  reserved core.

Benchmarks, the default run and the rig call it; tests that need overlap run it
in a child process.
"""

from __future__ import annotations

import dataclasses
import os
import sys


@dataclasses.dataclass(frozen=True)
class HostCoreReservation:
  """What ``reserve_host_core`` did: the cores XLA got and the one kept for the host."""

  xla_cores: tuple[int, ...]
  host_cores: tuple[int, ...]
  applied: bool
  reason: str


#: ``$PJRT_NPROC`` as this process had it before ``reserve_host_core`` sized XLA's pool for itself: what a child
#: process it starts inherits (the child reserves its own core; a pool size the user set is kept).
PJRT_NPROC_BEFORE_RESERVING: dict[str, str | None] = {}


def reserve_host_core(host_cores: int = 1, *, xla_threads: int | None = None) -> HostCoreReservation:
  """Gives XLA all cores but ``host_cores`` and keeps the rest for this thread.

  Call before JAX starts its CPU backend. Does nothing (``applied=False``, with
  the reason) where affinity is unsupported, where only one core is available,
  or where the JAX backend already started. ``xla_threads`` sizes XLA's pool
  instead of the cores it gets (a job of several processes fixes it, see
  ``orchestrator.distributed.bringup``); the pool still runs on those cores.
  """
  if not hasattr(os, "sched_getaffinity"):
    return HostCoreReservation((), (), False, "CPU affinity is not supported here")
  cores = tuple(sorted(os.sched_getaffinity(0)))
  if _jax_backend_started():
    return HostCoreReservation(
        cores, cores, False, "JAX's CPU backend already started; call this before using JAX"
    )
  if len(cores) <= host_cores:
    return HostCoreReservation(cores, cores, False, f"only {len(cores)} core(s) available")
  xla_cores, reserved = cores[:-host_cores], cores[-host_cores:]
  PJRT_NPROC_BEFORE_RESERVING.setdefault("value", os.environ.get("PJRT_NPROC"))
  os.environ["PJRT_NPROC"] = str(xla_threads or len(xla_cores))
  os.environ.setdefault("XLA_FLAGS", "")
  os.sched_setaffinity(0, xla_cores)
  import jax  # import here: after PJRT_NPROC and the affinity are set; this module runs before JAX is imported

  jax.devices()  # starts the CPU client: its thread pool inherits xla_cores
  os.sched_setaffinity(0, reserved)
  return HostCoreReservation(xla_cores, reserved, True, "ok")


def _jax_backend_started() -> bool:
  if "jax" not in sys.modules:
    return False
  try:
    from jax._src import xla_bridge  # import here: only once JAX is imported (checked above)

    return bool(getattr(xla_bridge, "_backends", {}))
  except ImportError:  # pragma: no cover - private module moved
    return False

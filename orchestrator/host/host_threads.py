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

Benchmarks call it; tests that need overlap run it in a child process.

A run plans its cores with ``apply_core_plan`` instead (``run.reserve_host_core``:
``auto``, ``true`` or ``false``). Two rules:

* XLA's pool size fixes how its reductions split, so the run's floats: it
  depends only on the cores this process may use and the setting, never on
  other runs (a neighbour never changes a digest). ``auto`` keeps a host core
  from ``AUTO_RESERVE_MIN_CORES`` cores on (measured: see there); ``false``
  shares the pool's cores with the host.
* Where the pool runs is chosen among the cores no other live run claimed
  (``core_claims``); when every core is claimed, the run takes half of the
  share of the run holding the most, which yields them while this run lives.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from orchestrator.host.core_claims import (Claim, ClaimsUnavailable, CoreClaims, CoreWatcher, layout, pin_run,
                                             pin_threads, share, span)


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
  os.environ.setdefault("XLA_FLAGS", "")
  _start_backend(xla_threads or len(xla_cores), xla_cores, reserved)
  return HostCoreReservation(xla_cores, reserved, True, "ok")


def _start_backend(xla_threads: int, xla_cores: tuple[int, ...] | None, host_cores: tuple[int, ...] | None) -> None:
  """Sizes XLA's pool, starts JAX's CPU client on ``xla_cores`` (its pool's threads inherit them), then moves
  this thread onto ``host_cores`` (None: the affinity is left as it is)."""
  os.environ["PJRT_NPROC"] = str(xla_threads)
  if xla_cores is not None:
    os.sched_setaffinity(0, xla_cores)
  import jax  # import here: after PJRT_NPROC and the affinity are set; this module runs before JAX is imported

  jax.devices()  # starts the CPU client
  if host_cores is not None:
    os.sched_setaffinity(0, host_cores)


#: From this many cores on, ``run.reserve_host_core: auto`` keeps one for the host. Measured on 2 cores (the
#: default run, docs/benchmarks.md "The core plan"): sharing both cores made each step 15 % slower and the first
#: update 1.8 s later than reserving one, since the sampler's process and the trainer's pool then contend for both.
AUTO_RESERVE_MIN_CORES = 2


@dataclasses.dataclass(frozen=True)
class CorePlan:
  """Where a run's threads go: XLA's pool (its size and cores) and the host side's cores.

  ``host_threads`` sizes the XLA pool of a process that runs on the host's cores (the sampler's); like
  ``xla_threads`` it depends only on this machine and the setting. ``pinned``: the cores were set (and claimed).
  """

  xla_cores: tuple[int, ...]
  host_cores: tuple[int, ...]
  xla_threads: int
  host_threads: int
  reserved: bool
  pinned: bool
  reason: str

  def describe(self) -> str:
    """The plan and why, for the run's first line."""
    if not self.pinned:
      return self.reason
    if self.reserved:
      where = f"XLA on cores {span(self.xla_cores)}, the host on {span(self.host_cores)}"
    else:
      where = f"XLA and the host share cores {span(self.xla_cores)}"
    return f"{where}, a pool of {self.xla_threads} XLA threads ({self.reason})"


def plan_cores(available: tuple[int, ...], others: list[Claim], reserve: bool | str,
               xla_threads: int | None = None) -> CorePlan:
  """The plan for a run that may use ``available`` beside the live runs that claimed ``others``."""
  available = tuple(sorted(available))
  reserving = (reserve is True or (reserve == "auto" and len(available) >= AUTO_RESERVE_MIN_CORES)) \
      and len(available) > 1
  if len(available) == 1:
    why = "only 1 core"
  elif reserve == "auto":
    why = f"{len(available)} cores: auto keeps one for the host from {AUTO_RESERVE_MIN_CORES}"
  else:
    why = f"run.reserve_host_core={str(reserve).lower()}"
  threads = xla_threads or (len(available) - 1 if reserving else len(available))
  host_threads = 1 if reserving else len(available)
  taken = {core for claim in others for core in claim.cores}
  cores = tuple(core for core in available if core not in taken)
  if not cores:  # the shares this process may run on (a taskset or cpuset may allow it fewer cores)
    shares = {claim.pid: tuple(c for c in share(claim, others) if c in available) for claim in others}
    donor = max(others, key=lambda claim: len(shares[claim.pid]), default=None)
    if donor is None or len(shares[donor.pid]) < 2:
      return CorePlan(available, available, threads, host_threads, False, False,
                      f"every core is claimed by runs {sorted(shares)}, none holding two: sharing them all, unpinned")
    cores = shares[donor.pid][len(shares[donor.pid]) // 2:]
    why += f"; every core was claimed, so run {donor.pid} yields these while this run lives"
  elif len(cores) < len(available):
    why += f"; cores {span(tuple(sorted(taken)))} are other runs'"
  xla_cores, host_cores = layout(cores, reserving)
  return CorePlan(xla_cores, host_cores, threads, host_threads, xla_cores != host_cores, True, why)


#: The plan ``apply_core_plan`` made in this process (read when starting the sampler's process).
APPLIED: dict[str, CorePlan] = {}


def apply_core_plan(reserve: bool | str, *, xla_threads: int | None = None, among_runs: bool = True,
                    claims: CoreClaims | None = None, host_after_start_up: bool = False) -> CorePlan:
  """Plans this run's cores beside the other runs (``plan_cores``), sizes XLA's pool, pins and claims.

  Call before JAX starts its CPU backend; does nothing (``pinned=False``, with the reason) where affinity is
  unsupported or the backend already started. A pinned run keeps to its share while it lives (``CoreWatcher``).
  ``among_runs=False`` plans on this process's cores alone, claiming none (a trainer its driver spawned); so
  does a run whose claims directory cannot be used (the plan's reason says why). A ``$PJRT_NPROC`` the user set
  sizes XLA's pool unless ``xla_threads`` does.

  ``host_after_start_up``: XLA's pool is placed at once, but this process's other threads (and the processes
  started from it, which inherit them: the sampler's) stay on all of the plan's cores until
  ``settle_core_plan`` moves them onto the host's, so the start-up's work of the trainer's thread and of the
  sampler's process, which computes nothing on XLA's pool yet, runs on every core the run holds.
  """
  if not hasattr(os, "sched_getaffinity"):
    return CorePlan((), (), 0, 0, False, False, "CPU affinity is not supported here")
  available = tuple(sorted(os.sched_getaffinity(0)))
  if _jax_backend_started():
    return CorePlan(available, available, len(available), len(available), False, False,
                    "JAX's CPU backend already started; the plan is made before using JAX")
  PJRT_NPROC_BEFORE_RESERVING.setdefault("value", os.environ.get("PJRT_NPROC"))
  xla_threads = xla_threads or _user_pool_size()
  plan, claims, unavailable = None, claims if among_runs else None, None
  try:
    claims = claims or (CoreClaims() if among_runs else None)
    if claims is not None:
      with claims.planning():
        plan = plan_cores(available, claims.live_claims(), reserve, xla_threads)
        if plan.pinned:
          claims.claim(tuple(sorted({*plan.xla_cores, *plan.host_cores})))
  except ClaimsUnavailable as e:
    plan, claims, unavailable = None, None, str(e)
  if plan is None:
    plan = plan_cores(available, [], reserve, xla_threads)
    if unavailable:
      plan = dataclasses.replace(plan, reason=f"{plan.reason}; without the other runs' claims: {unavailable}")
  later = plan.pinned and host_after_start_up
  start_up_cores = tuple(sorted({*plan.xla_cores, *plan.host_cores})) if later else plan.host_cores
  try:
    _start_backend(plan.xla_threads, plan.xla_cores if plan.pinned else None,
                   start_up_cores if plan.pinned else None)
  except BaseException:
    if claims is not None:
      claims.release()
    raise
  if plan.pinned:
    _HELD["available"] = available  # what release_core_plan puts this process's threads back on
    if later:  # the threads there now stay as the plan left them (XLA's, on its pool's cores); the others move
      _HELD["settle"] = (plan.xla_cores, plan.host_cores, frozenset(_thread_ids()) - {os.getpid()})
    if claims is not None and claims.own is not None:
      _HELD.update(claims=claims, watcher=CoreWatcher(claims, reserved=plan.reserved).start())
  APPLIED["plan"] = plan
  return plan


def _user_pool_size() -> int | None:
  """The XLA pool size ``$PJRT_NPROC`` held before this process planned, if the user set a valid one."""
  given = PJRT_NPROC_BEFORE_RESERVING.get("value")
  return int(given) if given and given.isdigit() and int(given) > 0 else None


def settle_core_plan() -> None:
  """Moves this process's thread and those started since its backend (and its followers: the sampler's process)
  onto the host's cores where ``apply_core_plan(host_after_start_up=True)`` left them on all of the plan's: the
  layout ``apply_core_plan`` makes at once otherwise. Once (then, and without such a plan, it does nothing)."""
  settle = _HELD.pop("settle", None)
  watcher = _HELD.get("watcher")
  if settle is not None and not (watcher is not None and watcher.moved):  # moved: the watcher laid it out anew
    xla_cores, host_cores, kept = settle
    pin_run(xla_cores, host_cores, skip=kept)


def _thread_ids() -> set[int]:
  """This process's thread ids (none where ``/proc`` cannot say)."""
  try:
    return {int(t) for t in os.listdir("/proc/self/task")}
  except OSError:
    return set()


def release_core_plan() -> None:
  """Ends this process's claim, if it made one, and puts its threads back on the cores it had before
  ``apply_core_plan`` pinned them (a run, rig or probe inside a longer-lived process, as the tests and a notebook
  run them, leaves it as it found it). Does nothing where nothing was pinned."""
  APPLIED.pop("plan", None)
  if not _HELD:
    return
  if "watcher" in _HELD:
    _HELD["watcher"].stop()
    _HELD["claims"].release()
  pin_threads(os.getpid(), _HELD["available"], _HELD["available"])
  _HELD.clear()


#: This process's pinning: the cores it had before; where it claimed its cores, the claims and their watcher.
_HELD: dict = {}


def _jax_backend_started() -> bool:
  if "jax" not in sys.modules:
    return False
  try:
    from jax._src import xla_bridge  # import here: only once JAX is imported (checked above)

    return bool(getattr(xla_bridge, "_backends", {}))
  except ImportError:  # pragma: no cover - private module moved
    return False

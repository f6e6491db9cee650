"""reserve_host_core gives XLA all cores but one and keeps the last for the host thread; a run settles its host
threads onto the host's cores after its start-up; a core plan released puts the process back on the cores it
had."""

from __future__ import annotations

import os

import pytest

from tests.conftest import run_child

pytestmark = pytest.mark.e2e

CHILD = """
import os
from orchestrator.host.host_threads import reserve_host_core
r = reserve_host_core()
print("reservation", r)
assert r.applied, r
assert os.environ["PJRT_NPROC"] == str(len(r.xla_cores))
assert tuple(sorted(os.sched_getaffinity(0))) == r.host_cores
assert not set(r.host_cores) & set(r.xla_cores)
again = reserve_host_core()
assert not again.applied and "already started" in again.reason, again
print("CHILD-OK")
"""


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs CPU affinity and at least two cores",
)
def test_reserve_host_core_splits_cores_between_xla_and_host():
  run_child(CHILD)


RELEASE_CHILD = """
import os
from orchestrator.host.host_threads import apply_core_plan, release_core_plan
before = tuple(sorted(os.sched_getaffinity(0)))
plan = apply_core_plan(True, among_runs=False)  # a rig's or a probe's plan: pinned, nothing claimed
assert plan.pinned, plan
assert tuple(sorted(os.sched_getaffinity(0))) == plan.host_cores != before
release_core_plan()
assert tuple(sorted(os.sched_getaffinity(0))) == before, (os.sched_getaffinity(0), before)
release_core_plan()  # a second release changes nothing
assert tuple(sorted(os.sched_getaffinity(0))) == before
print("CHILD-OK")
"""


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs CPU affinity and at least two cores",
)
def test_a_plan_that_claimed_nothing_is_released_to_the_cores_the_process_had():
  """``run_rl rig`` and ``simulate --probe`` plan their cores without claiming (``among_runs=False``); released,
  the process is back on every core it had, as a caller running them in process (a notebook) expects."""
  run_child(RELEASE_CHILD)


SETTLE_CHILD = """
import os, subprocess, sys, threading
from orchestrator.host.host_threads import apply_core_plan, settle_core_plan, release_core_plan

def affinity(tid=0):
  return tuple(sorted(os.sched_getaffinity(tid)))

def affinity_if_alive(tid):  # a thread may end between the listing and the look (XLA's and the runtime's come and go)
  try:
    return affinity(tid)
  except ProcessLookupError:
    return None

plan = apply_core_plan(True, among_runs=False, host_after_start_up=True)
assert plan.pinned, plan
everything = tuple(sorted({*plan.xla_cores, *plan.host_cores}))
pool = {int(t) for t in os.listdir("/proc/self/task")
        if open(f"/proc/self/task/{t}/comm").read().startswith("tf_XLAEigen")}
assert pool and all(affinity(t) == plan.xla_cores for t in pool)  # XLA's pool is placed at once
assert affinity() == everything  # start-up: the run's thread on every core of the plan
backend = {t: cores for t in map(int, os.listdir("/proc/self/task")) if t != os.getpid()
           for cores in [affinity_if_alive(t)] if cores is not None}
started = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                         capture_output=True, text=True, check=True).stdout.strip()
assert started == str(list(everything)), started  # a process it starts (the sampler's) inherits them
waiting = threading.Event()
helper = threading.Thread(target=waiting.wait, daemon=True); helper.start()
settle_core_plan()
assert affinity() == plan.host_cores, affinity()
assert affinity(helper.native_id) == plan.host_cores  # a thread started during the start-up moves too
assert all(affinity(t) == plan.xla_cores for t in pool)  # XLA's stay
now = {t: affinity_if_alive(t) for t in backend}
assert all(now[t] in (None, cores) for t, cores in backend.items()), (backend, now)  # as do its other threads
settle_core_plan()  # once: a second does nothing
assert affinity() == plan.host_cores
waiting.set(); release_core_plan()
print("CHILD-OK")
"""


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs CPU affinity and at least two cores",
)
def test_a_run_starts_on_all_its_cores_and_settles_its_host_threads_onto_the_hosts():
  """``run_rl`` places XLA's pool at once but leaves its own thread, and the sampler's process it starts, on all
  of the plan's cores until the first update (``settle_core_plan``): then the layout is the plan's."""
  run_child(SETTLE_CHILD)

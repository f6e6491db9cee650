"""reserve_host_core gives XLA all cores but one and keeps the last for the host thread; a core plan released
puts the process back on the cores it had."""

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

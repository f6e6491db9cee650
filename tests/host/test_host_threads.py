"""reserve_host_core gives XLA all cores but one and keeps the last for the host thread."""

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

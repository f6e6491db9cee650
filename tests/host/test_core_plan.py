"""The core plan: XLA's pool size from this machine and the setting alone; which cores, from the other runs' claims
(host/host_threads.py, host/core_claims.py)."""

from __future__ import annotations

import fcntl
import json
import os

import pytest

from orchestrator.host.core_claims import Claim, ClaimsUnavailable, CoreClaims, layout, share
from orchestrator.host.host_threads import plan_cores

pytestmark = pytest.mark.spec

TWO, FOUR = (0, 1), (0, 1, 2, 3)


def claim(pid, cores, started):
  return Claim(pid, tuple(cores), started)


@pytest.mark.parametrize("available, others, reserve, xla, host, threads, pinned", [
    (TWO, [], "auto", (0,), (1,), 1, True),  # alone on 2 cores: one kept for the host
    (TWO, [], False, TWO, TWO, 2, True),  # false: the host shares the pool's cores
    ((0,), [], "auto", (0,), (0,), 1, True),  # 1 core: nothing to keep
    ((0,), [], True, (0,), (0,), 1, True),
    (FOUR, [], True, (0, 1, 2), (3,), 3, True),
    (FOUR, [claim(7, (0, 1), 1)], "auto", (2,), (3,), 3, True),  # the free cores only; the pool keeps its size
    (TWO, [claim(7, TWO, 1)], "auto", (1,), (1,), 1, True),  # all claimed: half of the holder's share
    (FOUR, [claim(7, FOUR, 1)], False, (2, 3), (2, 3), 4, True),
    (TWO, [claim(7, TWO, 1), claim(8, (1,), 2)], "auto", TWO, TWO, 1, False),  # no run holds two: unpinned
    (TWO, [claim(7, FOUR, 1)], "auto", (1,), (1,), 1, True),  # taskset to 0,1 beside a 4-core run: only 0,1
])
def test_the_plan(available, others, reserve, xla, host, threads, pinned):
  plan = plan_cores(available, others, reserve)
  assert (plan.xla_cores, plan.host_cores, plan.xla_threads, plan.pinned) == (xla, host, threads, pinned)
  assert plan.reserved == (xla != host)


@pytest.mark.parametrize("available, reserve", [(TWO, "auto"), (TWO, False), (FOUR, True), (FOUR, "auto")])
def test_the_pools_do_not_depend_on_other_runs(available, reserve):
  """The pool sizes split XLA's reductions, so they must not change with the neighbours (a digest would);
  negative control: another setting or another machine does change them."""
  alone = plan_cores(available, [], reserve)
  for others in ([claim(7, available[:1], 1)], [claim(7, available, 1)], [claim(7, available, 1),
                                                                          claim(8, available[-1:], 2)]):
    beside = plan_cores(available, others, reserve)
    assert (beside.xla_threads, beside.host_threads) == (alone.xla_threads, alone.host_threads)
  assert plan_cores(available, [], not reserve if reserve != "auto" else False).xla_threads != alone.xla_threads \
      or len(available) == 1
  assert plan_cores(available + (9,), [], reserve).xla_threads != alone.xla_threads


def test_a_run_keeps_its_claim_less_what_newer_runs_took():
  own = claim(1, FOUR, 10)
  assert share(own, [claim(2, (2, 3), 20)]) == (0, 1)
  assert share(own, [claim(2, (2, 3), 5)]) == FOUR  # an older run's claim takes nothing from it
  assert share(own, [claim(2, FOUR, 20)]) == FOUR  # never left with none
  assert layout((0, 1), True) == ((0,), (1,)) and layout((0,), True) == ((0,), (0,))


def test_claims_of_live_runs_are_seen_and_those_of_ended_runs_removed(tmp_path):
  """A claim is live while its file is locked (flock locks belong to the open file, so another open of it in this
  process sees the lock as another process would)."""
  tmp_path.chmod(0o700)
  mine = CoreClaims(tmp_path)
  with mine.planning():
    assert mine.live_claims() == []
    own = mine.claim((0, 1))
  other = CoreClaims(tmp_path)
  with other.planning():
    assert other.live_claims() == [own]
  ended = tmp_path / "4242-0.json"
  ended.write_text(json.dumps({"pid": 4242, "cores": [1], "started_ns": 1}))  # nobody holds its lock
  assert other.live_claims() == [own] and not ended.exists()
  (tmp_path / "notes.json").write_text("not a claim")
  with open(tmp_path / "notes.json") as held:
    fcntl.flock(held, fcntl.LOCK_EX)
    assert other.live_claims() == [own]
  mine.release()
  assert other.live_claims() == [] and not list(tmp_path.glob(f"{os.getpid()}-*.json"))


def test_a_directory_that_is_not_this_users_own_is_not_used(tmp_path):
  """Another user's (or a shared) directory could hold links that make a claim overwrite a file: a file, a
  link, or a directory others may write is refused by name; the run then plans without claims."""
  (tmp_path / "a-file").write_text("")
  shared = tmp_path / "shared"
  shared.mkdir(mode=0o777)
  shared.chmod(0o777)
  (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
  (tmp_path / "elsewhere").mkdir(mode=0o700)
  for directory, why in [(tmp_path / "a-file", "is not a directory"), (shared, "is not this user's own"),
                         (tmp_path / "link", "is not a directory")]:
    with pytest.raises(ClaimsUnavailable, match=why):
      with CoreClaims(directory).planning():
        pass
  own = tmp_path / "own"
  with CoreClaims(own).planning():  # negative control: made here, 0700
    pass


def test_a_planted_link_is_never_followed(tmp_path):
  victim = tmp_path / "victim.txt"
  victim.write_text("keep me")
  claims = tmp_path / "claims"
  with CoreClaims(claims).planning() as mine:
    (claims / f"{os.getpid()}-0.json").symlink_to(victim)
    assert mine.live_claims() == []
    mine.claim((0,))
  assert victim.read_text() == "keep me"
  mine.release()


def test_a_lock_held_too_long_is_given_up(tmp_path):
  """A run stopped while it planned must not stall every other run."""
  holder, waiter = CoreClaims(tmp_path / "c"), CoreClaims(tmp_path / "c")
  with holder.planning():
    with pytest.raises(ClaimsUnavailable, match="stayed locked"):
      with waiter.planning(wait_s=0.2):
        pass
  with waiter.planning(wait_s=0.2):  # negative control: free again
    pass

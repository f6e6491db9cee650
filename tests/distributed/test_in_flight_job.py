"""In-flight weight updates in a job of several JAX processes: a job of two processes × 1 CPU device against a job
of one × 2, both through ``jax.distributed`` (only runs over the same collectives agree to the bit:
docs/distributed.md), each in child processes. A file of its own, so the suite's workers can run it beside the
other job tests."""

from __future__ import annotations

import os

import pytest

from orchestrator import recipe as recipe_lib
from tests.distributed.test_distributed import _run_rl, _summary_and_records


#: In-flight weight updates (tests/live/test_in_flight_runs.py's schedule): a 4-token answer in four 1-token chunks,
#: one sampler call a batch, staleness 2, so from step 2 on each generation takes the next version between its
#: chunks; on fsdp 2, a job of two processes against one.
IN_FLIGHT = ["steps=4", "task.name=reverse", "task.length=4", "task.letters=2", "rollouts.placement=shared",
             "rollouts.max_staleness=2", "rollouts.batch_steps=1", "engine.epochs=1",
             "rollouts.micro_batches_per_call=batch", "rollouts.in_flight_updates=true", "task.eval_prompts=4",
             "metrics.samples_every=0", "run.reserve_host_core=false", "mesh.fsdp=2", "distributed.timeout_s=60"]


@pytest.fixture(scope="module")
def in_flight_jobs(tmp_path_factory):
  """{process count: (run directory, completed process)}: in-flight updates in a job of two and of one."""
  tmp = tmp_path_factory.mktemp("in_flight")
  env = {k: v for k, v in os.environ.items() if k not in recipe_lib.ENV_SWITCHES}
  return {n: (tmp / str(n), _run_rl(IN_FLIGHT + [f"distributed.num_processes={n}", "--out", str(tmp / str(n))],
                                    env=env)) for n in (2, 1)}


@pytest.mark.e2e
@pytest.mark.slow
def test_in_flight_updates_in_a_job_of_two_train_to_the_one_process_digest(in_flight_jobs):
  """Each process's sampler takes each version at the chunk the schedule gives it (counts, not time), after the
  sync every process runs at the same point: the job of two samples what the job of one samples, token versions
  and all, and reaches its digest."""
  (two, ran_two), (one, ran_one) = in_flight_jobs[2], in_flight_jobs[1]
  assert ran_two.returncode == 0 and ran_one.returncode == 0, (ran_two.stderr[-3000:], ran_one.stderr[-3000:])
  (summary, records), (reference, reference_records) = _summary_and_records(two), _summary_and_records(one)
  assert summary["final_state_digest"] == reference["final_state_digest"]
  versions = [(r["token_version_min"], r["token_version_max"]) for r in records]
  assert versions == [(0, 0), (0, 0), (0, 1), (1, 2)]  # a generation's later chunks on the next version
  assert versions == [(r["token_version_min"], r["token_version_max"]) for r in reference_records]
  assert [r["reward_mean"] for r in records] == [r["reward_mean"] for r in reference_records]
  assert len(summary["processes"]) == 2 and "Traceback" not in ran_two.stderr

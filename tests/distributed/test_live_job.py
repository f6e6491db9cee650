"""The live loop in a job of several JAX processes: the default recipe's live GRPO on fsdp 2, a job of two processes
× 1 CPU device against a job of one × 2, both through ``jax.distributed`` (only runs over the same collectives agree
to the bit: docs/distributed.md), each in child processes. A file of its own, so the long tier's two
workers can run it beside the other job tests."""

from __future__ import annotations

import json
import os

import pytest

from orchestrator import recipe as recipe_lib
from policies import Mode
from tests.distributed.test_distributed import _run_rl, _summary_and_records

# The default recipe (live GRPO, staleness 1) on fsdp 2: 2 processes × 1 device against a job of 1 process × 2
# (a plain run sums its collectives in another order: docs/distributed.md). The job stages before every update
# (STAGE_BEFORE_UPDATE), the one process runs OFF: every process samples the same rollouts from the same weights,
# so both must reach one digest.
# One step per sampled batch, one pass: per-step weight versions.
LIVE = ["steps=3", "rollouts.groups_per_micro_batch=2", "batch.rows=4", "task.eval_prompts=4", "checkpoint.every=2",
        "run.reserve_host_core=false", "mesh.fsdp=2", "distributed.timeout_s=60",
        "rollouts.batch_steps=1", "engine.epochs=1", "rollouts.micro_batches_per_call=1"]


@pytest.fixture(scope="module")
def live_jobs(tmp_path_factory):
  """{process count: (run directory, completed process)}: the live loop in a job of two and of one. The job of two
  starts from ``model.checkpoint``, a tiny checkpoint of the tiny preset's initial weights, which its engine loads
  sharded over the job's mesh and each sampler whole on its own device; the job of one from the preset itself (a
  run on a checkpoint is the preset's run bit for bit: tests/engine/test_hf_checkpoint.py; a job of two on the
  preset: ``jobs`` in test_distributed.py)."""
  from tests.engine.test_hf_checkpoint import write_checkpoint

  tmp = tmp_path_factory.mktemp("live")
  write_checkpoint(tmp / "tiny", "tiny")
  env = {k: v for k, v in os.environ.items() if k not in recipe_lib.ENV_SWITCHES}
  runs = {2: LIVE + ["distributed.num_processes=2", f"rollouts.record_to={tmp / 'recording'}",
                     f"model.checkpoint={tmp / 'tiny'}"],
          1: LIVE + ["distributed.num_processes=1", "step_boundary.pipeline_step_boundary=false"]}
  return {n: (tmp / str(n), _run_rl(args + ["--out", str(tmp / str(n))], env=env)) for n, args in runs.items()}


@pytest.mark.e2e
@pytest.mark.slow
def test_the_live_loop_in_a_job_of_two_trains_to_the_one_process_digest(live_jobs):
  """The job of two, on a checkpoint of the preset's initial weights, reaches the digest, rewards and held-out
  accuracy of the job of one on the preset."""
  (two, ran_two), (one, ran_one) = live_jobs[2], live_jobs[1]
  assert ran_two.returncode == 0 and ran_one.returncode == 0, (ran_two.stderr[-3000:], ran_one.stderr[-3000:])
  (summary, records), (reference, reference_records) = _summary_and_records(two), _summary_and_records(one)
  assert [(r["mode"], r["staged"]) for r in records[:2]] == [(Mode.STAGE_BEFORE_UPDATE.value, True)] * 2
  assert [r["mode"] for r in reference_records] == [Mode.OFF.value] * 3
  assert summary["final_state_digest"] == reference["final_state_digest"]
  # the same rollouts, and the same greedy answers from the same weights (every process evaluates; 0 reports)
  assert [r["reward_mean"] for r in records] == [r["reward_mean"] for r in reference_records]
  assert [r["weights_version"] for r in records] == [0, 0, 1]
  for key in ("eval_accuracy_start", "eval_accuracy_end"):
    assert summary[key] is not None and summary[key] == reference[key]
  assert len(summary["processes"]) == 2 and "Traceback" not in ran_two.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_a_live_job_gathers_each_update_records_and_checkpoints_once(live_jobs):
  from orchestrator.engine.checkpointing import read_checkpoints

  (two, _), (one, _) = live_jobs[2], live_jobs[1]
  (summary, records), (_, reference_records) = _summary_and_records(two), _summary_and_records(one)
  # Two processes: each update's weights are gathered to every host (its bytes and seconds in the record); in a
  # job of one process every shard is local already, so nothing is gathered.
  gathered = {r["weight_sync_bytes"] for r in records}
  assert len(gathered) == 1 and gathered.pop() > 0 and all(r["weight_transfer_s"] > 0 for r in records)
  assert all(r["weight_sync_bytes"] is None for r in reference_records)
  # Process 0 alone writes the recording: every group the run trained on, once.
  manifest = json.loads((two.parent / "recording" / "manifest.json").read_text())
  assert manifest["num_groups"] == 3 * 2 * 2 and summary["recording"]["groups"] == 12
  # The checkpoint after 2 steps (process 0 writes its metadata) carries step 2's rollouts, sampled with version
  # 1 (staleness 1), so the job resumes as a run of one process does; the completed job's last step is
  # checkpointed too, once by the job.
  checkpoints = read_checkpoints(two / "checkpoints")
  assert sorted(checkpoints) == [2, 3] and summary["checkpoint_path"].endswith("checkpoints/3")
  state = checkpoints[2]["source_state"]
  assert state["kind"] == "live" and state["next_step"] == 2
  assert [(r["batch"], r["weights_version"]) for r in state["sampled"]] == [(2, 1)]  # one step per sampled batch



"""One process of a multi-controller job for the tests: every mode over one compiled engine, per model.

Run as ``python -m tests.distributed_driver OUT_PREFIX CONFIG_JSON`` with the
process's identity in the environment (``orchestrator.distributed.launcher.child_env``).
For each configuration (recipe + overrides) it builds the engine once, runs
the real ``RLProgram`` in each of the four modes from the same start with the
job's agreement, and writes what the tests compare to ``OUT_PREFIX.<process>.json``:
the final digest per mode, the path every boundary took, and whether the
input this process staged holds exactly its rows of the micro-batch.

``python -m tests.distributed_driver --fail PROCESS PHASE RUN_RL_ARGS...`` runs
``run_rl RUN_RL_ARGS`` as this process of a job, in which process ``PROCESS``
fails with ``INJECTED`` in ``PHASE``: ``preflight`` (before the run directory
is claimed) or ``step`` (at the end of step 1, while the others go on to the
next step's collectives).
"""

from __future__ import annotations

import json
import sys

import numpy as np


def _staged_rows(engine, source) -> dict:
  """This process's block of micro-batch (0, 0), checked against the whole micro-batch packed here."""
  from orchestrator.data import packing

  payload = next(iter(source))[0]
  prepared = engine.prepare_fwd_bwd_input(payload)
  whole = packing.pack_payload(payload, rows=engine.rows, tokens_per_row=engine.tokens_per_row,
                               vocab_size=engine.preset.vocab_size)
  start, stop = prepared.rows or (0, engine.rows)
  host_ok = all(np.array_equal(prepared.host_arrays[k], whole[k][start:stop]) for k in packing.FIELDS)
  shards_ok = True
  for name, array in prepared.arrays.items():
    for shard in array.addressable_shards:
      shards_ok &= bool(np.array_equal(np.asarray(shard.data), whole[name][shard.index]))
  return {"rows": list(prepared.rows) if prepared.rows else None, "host_rows_match": host_ok,
          "local_shards_match": shards_ok, "local_rows": int(next(iter(prepared.host_arrays.values())).shape[0])}


def run_config(job, recipe_path: str, overrides: list[str]) -> dict:
  from orchestrator import recipe as recipe_lib
  from orchestrator.loop.program import RLProgram
  from orchestrator.assembly import build_engine_from_recipe, policy_from_recipe, program_config, rollout_source
  from orchestrator.loop.trainer_worker import TrainerWorker
  from policies import Mode

  recipe = recipe_lib.resolve(recipe_path, overrides=overrides).recipe
  engine = build_engine_from_recipe(recipe)
  start = engine.snapshot()
  out = {"staged": _staged_rows(engine, rollout_source(recipe)), "modes": {}}
  for mode in Mode:
    engine.restore(start)
    worker = TrainerWorker(engine)
    policy = policy_from_recipe(recipe, worker.capabilities, mode=mode)
    program = RLProgram(worker, policy, rollout_source(recipe), program_config(recipe, None), agreement=job.agreement)
    result = program.run()
    out["modes"][mode.value] = {
        "digest": result.summary.final_state_digest,
        "path": [[r.mode, r.staged, r.low_wait, r.transition, r.reruns] for r in result.records],
        "per_process": [r.per_process for r in result.records],
        "processes": len(result.summary.processes or ()) or 1,
    }
  return out


#: The error a process made to fail raises.
INJECTED = "injected failure for the test"


def run_failing(failing: int, phase: str, argv: list[str]) -> int:
  """``run_rl argv`` in this process, failing as ``failing``'s ``phase`` says if this is that process."""
  import os

  from orchestrator.app import cli, preflight as preflight_lib
  from orchestrator.loop.trainer_worker import TrainerWorker

  if int(os.environ["STEP_BOUNDARY_PROCESS_ID"]) == failing:
    if phase == "preflight":
      def preflight(*args, **kwargs):
        raise RuntimeError(INJECTED)

      preflight_lib.preflight = preflight
    else:
      metrics, calls = TrainerWorker.get_metrics, []

      def get_metrics(self):
        calls.append(1)
        if len(calls) == 2:  # step 1's
          raise RuntimeError(INJECTED)
        return metrics(self)

      TrainerWorker.get_metrics = get_metrics
  return cli.main(argv)


def main(prefix: str, configs_json: str) -> None:
  from orchestrator import recipe as recipe_lib
  from orchestrator.distributed.job import join_job

  from orchestrator.distributed.bringup import fix_xla_threads

  configs = json.loads(configs_json)
  recipe = recipe_lib.resolve(configs[0][0], overrides=configs[0][1]).recipe
  fix_xla_threads(recipe.mesh.num_devices)  # as run_rl does: the same code whatever the process count
  job = join_job(recipe.distributed)
  results = {str(i): run_config(job, path, overrides) for i, (path, overrides) in enumerate(configs)}
  with open(f"{prefix}.{job.identity.process_id}.json", "w", encoding="utf-8") as f:
    json.dump(results, f)
  job.finish(succeeded=True)


if __name__ == "__main__":
  if sys.argv[1] == "--fail":
    sys.exit(run_failing(int(sys.argv[2]), sys.argv[3], sys.argv[4:]))
  main(sys.argv[1], sys.argv[2])

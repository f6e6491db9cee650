"""A job admits only its own: processes with different recipes stop together at bring-up, one that cannot join
ends in one line, and the line after a death offers ``--resume`` only where a checkpoint exists.

The slow tests start ``run_rl`` processes by hand (each with its identity in the environment, as on several
hosts); they end at bring-up, before an engine is built. The unit tests need no second process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.addresses import free_loopback_port
from orchestrator.distributed import admission, bringup, launcher
from orchestrator.distributed.agreement import KeyValueAgreement
from orchestrator.recipe.loading import PER_PROCESS_KEYS, job_settings
from tests.conftest import REPO
from tests.fakes import FakeKeyValueClient

JOB = ["--recipe", "recipes/mesh_4dev.yaml", "rollouts.source=synthetic", "mesh.fsdp=2", "mesh.context=2",
       "mesh.expert=1", "batch.rows=16", "steps=2", "distributed.num_processes=2"]
TIMEOUT_S = 20


def _start(process_id: int, port: int, args: list[str], out: Path) -> subprocess.Popen:
  """One ``run_rl`` process of a job started by hand (its identity in the environment, as a host's would be)."""
  env = launcher.child_env(dict(os.environ), process_id=process_id, coordinator=f"127.0.0.1:{port}",
                           devices_per_process=2)
  env.pop(launcher.LAUNCHED_ENV)  # no launcher: each process reports for itself
  return subprocess.Popen([sys.executable, "-m", "orchestrator.app.cli", *JOB, *args, "--out", str(out)], cwd=REPO,
                          env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def _ended(proc: subprocess.Popen, limit_s: float) -> tuple[int, list[str], str]:
  """(exit code, its ``run_rl`` lines, all of stderr) of ``proc``, which must end within ``limit_s``."""
  _, err = proc.communicate(timeout=limit_s)
  return proc.returncode, [l for l in err.splitlines() if l.startswith("run_rl")], err


# ---------------------------------------------------------------- a job admits only its own
#: Differences between two processes' recipes and how the line names them. The first runs as a job of two
#: run_rl processes; the rest are the same line from the same settings, made in this process.
DIFFERENCES = [
    ("engine.learning_rate", ["engine.learning_rate=0.001"], ["engine.learning_rate=0.01"], "0.001 (process 0) vs"
     " 0.01 (process 1)"),
    ("batch.micro_batches_per_step", ["batch.micro_batches_per_step=2"], ["batch.micro_batches_per_step=3"],
     "2 (process 0) vs 3 (process 1)"),
    ("step_boundary.stage_before_update", [], ["step_boundary.stage_before_update=false"],
     "true (process 0) vs false (process 1)"),
]


def _mismatch(key: str, shown: str) -> str:
  return (f"process 1's recipe differs from process 0's at {key}: {shown}; start every process with the same"
          " recipe")


@pytest.mark.e2e
@pytest.mark.slow
def test_processes_whose_recipes_differ_stop_together_in_one_line_naming_the_key(tmp_path):
  key, first, second, shown = DIFFERENCES[0]
  port = free_loopback_port()
  # Each process writes to its own --out: output paths may differ, so only the key above is named.
  procs = [_start(i, port, [*args, f"distributed.timeout_s={TIMEOUT_S}"], tmp_path / f"out{i}")
           for i, args in enumerate((first, second))]
  # A hang fails through the deadline; how fast a refusal comes is the machine's, not the test's, business.
  ended = [_ended(p, TIMEOUT_S + 60) for p in procs]
  line = f"run_rl: error: {_mismatch(key, shown)}"
  for process_id, (code, lines, err) in enumerate(ended):
    assert (code, lines) == (2, [line]), f"process {process_id}:\n{err[-3000:]}"
    assert "Traceback" not in err and "Check failure" not in err, err[-3000:]
  assert not (tmp_path / "out0").exists() and not (tmp_path / "out1").exists()  # refused before any claim


def _recipe(*overrides: str):
  return recipe_lib.resolve(overrides=["rollouts.source=synthetic", "distributed.num_processes=2", *overrides],
                            env={}).recipe


@pytest.mark.engine
def test_the_first_differing_key_is_named_in_the_recipes_order_and_identity_and_outputs_are_ignored():
  mine = job_settings(_recipe("distributed.process_id=0", "distributed.coordinator_address=10.0.0.1:1234",
                              "run.out=/tmp/a", "rollouts.record_to=/tmp/ra"))
  alike = job_settings(_recipe("distributed.process_id=1", "distributed.coordinator_address=gpu-a:1234",
                               "run.out=/tmp/b", "rollouts.record_to=/tmp/rb"))
  assert admission.first_difference(mine, alike) is None
  assert not set(PER_PROCESS_KEYS) & set(mine)
  assert {"checkpoint.directory", "step_boundary.stage_before_update", "distributed.timeout_s"} <= set(mine)
  other = job_settings(_recipe("engine.learning_rate=0.01", "rollouts.seed=9", "distributed.process_id=1",
                               "distributed.coordinator_address=gpu-a:1234"))
  key, a, b = admission.first_difference(mine, other)
  assert key == "engine.learning_rate" and b == 0.01 and a != b  # before rollouts.seed, in the schema's order
  assert admission.first_difference({"a": 1, "b": 2}, {"b": 2, "a": 1}) is None  # order alone is no difference
  assert admission.first_difference({"a": 1}, {"a": True}) == ("a", 1, True)
  assert admission.first_difference({"a": 1}, {"a": 1, "z": 3})[0] == "z"


@pytest.mark.engine
@pytest.mark.parametrize("key, first, second, shown", DIFFERENCES, ids=["learning-rate", "micro-batches", "mode"])
def test_each_job_setting_that_differs_is_named_with_both_processes_values(key, first, second, shown):
  """The settings each process posts at admission (its recipe's, its identity aside) differ at the key given on
  one command line only, and the line names it with both values as the recipe spells them."""
  zero = job_settings(_recipe("distributed.process_id=0", "distributed.coordinator_address=10.0.0.1:1234", *first))
  one = job_settings(_recipe("distributed.process_id=1", "distributed.coordinator_address=10.0.0.1:1234", *second))
  assert admission.first_difference(zero, one)[0] == key
  assert admission.mismatch_line(1, zero, one) == _mismatch(key, shown)


@pytest.mark.engine
def test_the_mismatch_line_names_the_key_both_values_and_the_fix():
  line = admission.mismatch_line(1, {"steps": 4, "engine.learning_rate": 0.001},
                                 {"steps": 4, "engine.learning_rate": 0.01})
  assert line == ("process 1's recipe differs from process 0's at engine.learning_rate: 0.001 (process 0) vs 0.01"
                  " (process 1); start every process with the same recipe")
  assert "\"auto\" (process 0) vs 0.5 (process 2)" in admission.mismatch_line(
      2, {"step_boundary.wait_threshold_s": "auto"}, {"step_boundary.wait_threshold_s": 0.5})
  assert "at new.key: (not a key there) (process 0) vs 1" in admission.mismatch_line(1, {}, {"new.key": 1})
  assert admission.mismatch_line(1, {"steps": 4}, {"steps": 4}) is None


def _posted_by(store, process_id, settings, version="0.1.0"):
  """What process ``process_id`` posts at admission, as if it had arrived first."""
  store[f"step_boundary/admission/{process_id}"] = json.dumps(settings)
  value = {"version": version, "digest": admission.settings_digest(settings)}
  store[f"step_boundary/round/0/{process_id}"] = json.dumps({"tag": admission.TAG, "value": value})


@pytest.mark.engine
@pytest.mark.parametrize("me", [0, 1])
def test_every_process_of_a_job_raises_the_same_line_for_the_same_difference(me):
  zero, one = {"steps": 4, "engine.learning_rate": 0.001}, {"steps": 4, "engine.learning_rate": 0.01}
  store = {}
  _posted_by(store, 1 - me, (zero, one)[1 - me])
  agreement = KeyValueAgreement(FakeKeyValueClient(store), me, 2, timeout_s=1)
  with pytest.raises(admission.JobMismatchError) as raised:
    admission.admit(agreement, FakeKeyValueClient(store), (zero, one)[me], version="0.1.0")
  assert str(raised.value) == admission.mismatch_line(1, zero, one)


@pytest.mark.engine
def test_a_job_of_alike_processes_is_admitted_and_another_version_is_refused():
  settings = {"steps": 4, "batch.rows": [16, 8]}
  store = {}
  _posted_by(store, 1, {"batch.rows": [16, 8], "steps": 4})  # keys in another order, a list read back from JSON
  admission.admit(KeyValueAgreement(FakeKeyValueClient(store), 0, 2, timeout_s=1), FakeKeyValueClient(store),
                  {"steps": 4, "batch.rows": (16, 8)}, version="0.1.0")
  store = {}
  _posted_by(store, 1, settings, version="0.2.0")
  with pytest.raises(admission.JobMismatchError, match=r"process 1 runs step-boundary 0.2.0 but process 0 runs"
                     r" 0.1.0; install the same version on every host"):
    admission.admit(KeyValueAgreement(FakeKeyValueClient(store), 0, 2, timeout_s=1), FakeKeyValueClient(store), settings,
                    version="0.1.0")


# ---------------------------------------------------------------- a process that cannot join
@pytest.mark.e2e
@pytest.mark.slow
def test_a_process_that_cannot_join_ends_in_one_line_and_exit_1_without_an_abort(tmp_path):
  timeout = ["distributed.timeout_s=3"]
  with socket.socket() as taken:  # a port some other program listens on
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    lonely, nobody = free_loopback_port(), free_loopback_port()
    while nobody == lonely:  # the same port would make the two one job
      nobody = free_loopback_port()
    procs = {"its peer never starts": _start(0, lonely, timeout, tmp_path / "a"),
             "no coordinator": _start(1, nobody, timeout, tmp_path / "b"),
             "a busy port": _start(0, taken.getsockname()[1], timeout, tmp_path / "c")}
    ended = {case: _ended(p, 90) for case, p in procs.items()}  # a hang fails through this deadline
  expected = {"its peer never starts": "process 0 of 2 serves the coordinator at 127.0.0.1:",
              "no coordinator": "process 1 of 2 could not reach the coordinator at 127.0.0.1:",
              "a busy port": "process 0 of 2 cannot serve the coordinator on port"}
  for case, (code, lines, err) in ended.items():
    assert code == 1 and len(lines) == 1 and expected[case] in lines[0], f"{case}:\n{err[-3000:]}"
    assert "distributed.timeout_s" in lines[0] or "free the port" in lines[0], lines[0]
    assert "Check failure" not in err and "Traceback" not in err, f"{case}:\n{err[-3000:]}"


_SIGTERM_AFTER_JOIN = """
import os, signal, sys, time, types
from orchestrator.distributed import bringup
section = types.SimpleNamespace(detect_cluster=False, coordinator_address=sys.argv[1], num_processes=1,
                                process_id=0, timeout_s=10)
bringup.join(section)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("SIGTERM was ignored", flush=True)
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_a_joined_process_still_ends_on_the_first_sigterm():
  """JAX's preemption notifier takes SIGTERM over when the job is joined; until the run's own handler is set,
  the first SIGTERM must end the process (a job that fails at bring-up must not linger)."""
  result = subprocess.run([sys.executable, "-c", _SIGTERM_AFTER_JOIN, f"127.0.0.1:{free_loopback_port()}"],
                          cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                          timeout=60)
  assert result.returncode == -signal.SIGTERM, result.stdout + result.stderr[-2000:]


def _section(process_id: int, address: str, timeout_s: float = 1):
  return types.SimpleNamespace(detect_cluster=False, coordinator_address=address, num_processes=2,
                               process_id=process_id, timeout_s=timeout_s)


@pytest.mark.engine
def test_a_busy_coordinator_port_and_an_unreachable_coordinator_are_one_line_before_jax_is_called():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    address = f"127.0.0.1:{taken.getsockname()[1]}"
    with pytest.raises(bringup.DistributedError, match=rf"process 0 of 2 cannot serve the coordinator on port"
                       rf" {taken.getsockname()[1]} \(distributed.coordinator_address={address}\): address already"
                       r" in use; free the port"):
      bringup.check_coordinator(_section(0, address), 1, time.monotonic() + 1)
    bringup.check_coordinator(_section(1, address), 1, time.monotonic() + 1)  # something answers: reached
  address = f"127.0.0.1:{free_loopback_port()}"
  start = time.monotonic()
  with pytest.raises(bringup.DistributedError, match=rf"process 1 of 2 could not reach the coordinator at {address}"
                     r" within 1 s \(connection refused\); start process 0 there"):
    bringup.check_coordinator(_section(1, address), 1, time.monotonic() + 1)
  assert time.monotonic() - start > 0.5  # it kept retrying until about the deadline
  bringup.check_coordinator(_section(0, address), 1, time.monotonic() + 1)  # a free port: process 0 may serve


# ---------------------------------------------------------------- the line after a death
def _run_dir(tmp_path: Path, checkpoint_directory: str | None = None) -> Path:
  out = tmp_path / "run"
  out.mkdir()
  (out / "config.json").write_text(json.dumps({"config": {"checkpoint": {"directory": checkpoint_directory}}}))
  return out


@pytest.mark.e2e
def test_the_line_after_a_death_offers_resume_only_where_a_complete_checkpoint_exists(tmp_path):
  assert launcher.resume_hint(tmp_path / "never-claimed") == "nothing was written"
  out = _run_dir(tmp_path)
  no_checkpoint = launcher.resume_hint(out)
  assert "--resume" not in no_checkpoint and "start the run again with another --out" in no_checkpoint
  (out / "checkpoints" / "2.orbax-checkpoint-tmp-1234").mkdir(parents=True)  # a checkpoint still being written
  assert "--resume" not in launcher.resume_hint(out)
  (out / "checkpoints" / "2").mkdir()
  assert launcher.resume_hint(out) == (f"records so far are in {out / 'records.jsonl'}; `run_rl --resume {out}`"
                                       " continues from the last complete checkpoint")


@pytest.mark.engine
def test_the_resume_hint_looks_in_the_runs_own_checkpoint_directory(tmp_path):
  elsewhere = tmp_path / "ckpts"
  out = _run_dir(tmp_path, str(elsewhere))
  (out / "checkpoints" / "4").mkdir(parents=True)  # not where this run checkpoints
  assert "--resume" not in launcher.resume_hint(out)
  (elsewhere / "4").mkdir(parents=True)
  assert "--resume" in launcher.resume_hint(out)

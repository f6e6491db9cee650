"""Several JAX processes (multi-controller): one job of 2 processes × 2 CPU devices against 1 × 4.

The jobs run as child processes with CPU (Gloo) collectives. Both jobs go
through ``jax.distributed`` — the job of one process too: XLA's in-process
CPU collectives sum in another order than Gloo's, so only runs over the same
collectives can agree to the bit (docs/distributed.md). The unit tests at the
end need no second process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from orchestrator.addresses import free_loopback_port
from orchestrator import recipe as recipe_lib
from orchestrator.data import packing
from orchestrator.data.synthetic import SyntheticRollouts
from orchestrator.distributed import launcher
from orchestrator.distributed.agreement import (AgreementError, KeyValueAgreement, ProcessLostError, SingleProcess,
                                                agree_on_measurements, combine_max)
from orchestrator.distributed.watchdog import Watchdog
from orchestrator.run_files import run_dir
from policies import Mode
from tests.conftest import REPO
from tests.fakes import FakeKeyValueClient

# Rows split over the two processes (fsdp) and tokens over each process's two devices (context).
SMALL = ["steps=3", "batch.rows=16", "batch.micro_batches_per_step=2", "run.reserve_host_core=false"]
DENSE = ("recipes/rig_cpu.yaml", SMALL + ["mesh.fsdp=2", "mesh.context=2"])
# Rows over fsdp × expert, two of the four experts per process; capacity 1.25 with dropless re-runs.
MOE = ("recipes/rig_cpu_moe.yaml", SMALL + ["mesh.fsdp=2", "mesh.expert=2"])
CONFIGS = {"dense": 0, "moe": 1}
ROWS = 16  # rows per micro-batch (SMALL)


def _launch_driver(tmp: Path, num_processes: int, configs) -> list[dict]:
  coordinator = f"127.0.0.1:{free_loopback_port()}"
  configs = [(path, overrides + [f"distributed.num_processes={num_processes}", "distributed.timeout_s=60"])
             for path, overrides in configs]
  prefix = tmp / f"job{num_processes}"
  procs = []
  for i in range(num_processes):
    env = launcher.child_env(dict(os.environ), process_id=i, coordinator=coordinator,
                             devices_per_process=4 // num_processes)
    procs.append(subprocess.Popen([sys.executable, "-m", "tests.distributed_driver", str(prefix), json.dumps(configs)],
                                  cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
  outputs = [p.communicate(timeout=900)[0].decode(errors="replace") for p in procs]
  for i, (p, text) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"process {i} of {num_processes} exited {p.returncode}:\n{text[-3000:]}"
  return [json.loads(Path(f"{prefix}.{i}.json").read_text()) for i in range(num_processes)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  """{process count: [each process's results]}, both jobs over the dense and the MoE configuration."""
  tmp = tmp_path_factory.mktemp("jobs")
  return {n: _launch_driver(tmp, n, [DENSE, MOE]) for n in (1, 2)}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_two_processes_reach_the_one_process_digest_in_every_mode(jobs, config):
  key = str(CONFIGS[config])
  reference = jobs[1][0][key]["modes"][Mode.OFF.value]["digest"]
  for mode in Mode:
    for process in jobs[2]:
      assert process[key]["modes"][mode.value]["digest"] == reference, (config, mode)
    assert jobs[1][0][key]["modes"][mode.value]["digest"] == reference, (config, mode)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_every_process_takes_the_same_path_at_every_boundary(jobs, config):
  key = str(CONFIGS[config])
  first, second = (p[key]["modes"] for p in jobs[2])
  for mode in Mode:
    assert first[mode.value]["path"] == second[mode.value]["path"], mode
    assert first[mode.value]["processes"] == 2
  staged = first[Mode.STAGE_BEFORE_UPDATE.value]
  assert any(step[1] for step in staged["path"]), "no boundary staged"
  waits = [p for p in staged["per_process"] if p]
  assert waits and all(len(p["device_wait_s"]) == 2 for p in waits)
  if config == "moe":  # dropless replay ran, and every process re-ran the same micro-batches
    assert sum(step[4] or 0 for step in first[Mode.OFF.value]["path"]) > 0


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_a_staged_input_holds_exactly_the_rows_each_process_was_given(jobs, config):
  key = str(CONFIGS[config])
  assert jobs[1][0][key]["staged"]["rows"] is None  # one process holds every row
  for process_id, process in enumerate(jobs[2]):
    staged = process[key]["staged"]
    half = ROWS // 2
    assert staged["rows"] == [process_id * half, (process_id + 1) * half]
    assert staged["local_rows"] == half
    assert staged["host_rows_match"] and staged["local_shards_match"]


# ---------------------------------------------------------------- run_rl with several processes
# distributed.timeout_s: long enough for a process started late on a loaded machine to meet the bring-up exchanges
# (5 s was not, beside a busy test run); a killed process is named by its exit, not by this timeout.
RUN = ["--recipe", "recipes/mesh_4dev.yaml", "rollouts.source=synthetic", "mesh.fsdp=2", "mesh.context=2",
       "mesh.expert=1", "batch.rows=16", "distributed.timeout_s=20", "checkpoint.every=2"]


def _run_rl(args, timeout=600, **kwargs):
  return subprocess.run([sys.executable, "-m", "orchestrator.app.cli", *args], cwd=REPO, capture_output=True, text=True,
                        timeout=timeout, **kwargs)


def _summary_and_records(out: Path):
  records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
  return json.loads((out / "summary.json").read_text()), records


def _process_pids(launcher_pid: int) -> dict[int, int]:
  """{process id: pid} of a local launcher's children (their identity is in their environment)."""
  out = {}
  for pid in subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split():
    try:
      env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
      continue
    for item in env:
      if item.startswith(b"STEP_BOUNDARY_PROCESS_ID="):
        out[int(item.split(b"=", 1)[1])] = int(pid)
  return out


@pytest.mark.e2e
@pytest.mark.slow
def test_a_killed_process_ends_the_run_in_one_line_and_resume_reaches_the_uninterrupted_digest(tmp_path):
  out = tmp_path / "run"
  # Killed once checkpoint 2 exists: six steps of about a second each still to run, time enough to kill it in.
  args = RUN + ["steps=8", "distributed.num_processes=2", "--out", str(out)]
  run = subprocess.Popen([sys.executable, "-m", "orchestrator.app.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 300
  while not (out / "checkpoints" / "2").is_dir() and run.poll() is None and time.monotonic() < deadline:
    time.sleep(0.05)
  assert run.poll() is None, "the run ended before a process could be killed"
  os.kill(_process_pids(run.pid)[1], signal.SIGKILL)
  _, err = run.communicate(timeout=120)  # a hang (the others never ending) fails here
  assert run.returncode == 1
  lines = [l for l in err.splitlines() if l.startswith("run_rl: process")]
  assert len(lines) == 1 and "process 1 of 2" in lines[0] and "killed by SIGKILL" in lines[0], err[-2000:]
  assert "Traceback" not in err
  summary = json.loads((out / "summary.json").read_text())
  assert summary["ended"] == "error" and "process 1 of 2" in summary["error"]

  resumed = _run_rl(["--resume", str(out)])
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert [r["step"] for r in run_dir.all_records(out)] == list(range(8))
  trace = json.loads((run_dir.latest_segment(out) / "trace.json").read_text())["traceEvents"]
  tracks = {e["args"]["name"] for e in trace if e.get("name") == "process_name"}
  assert {"process 0: device", "process 1: device", "process 1: host"} <= {t.split(" (")[0] for t in tracks}
  assert any(e.get("pid", 0) > 100 and e.get("ph") == "X" and e["name"].startswith("fwd_bwd") for e in trace)

  reference = _run_rl(RUN + ["steps=8", "distributed.num_processes=1", "--out", str(tmp_path / "one")])
  assert reference.returncode == 0, reference.stderr[-2000:]
  digest = json.loads((run_dir.latest_segment(out) / "summary.json").read_text())["final_state_digest"]
  assert digest == json.loads((tmp_path / "one" / "summary.json").read_text())["final_state_digest"]


@pytest.mark.e2e
@pytest.mark.slow
def test_input_refused_in_every_process_is_one_line_and_nothing_is_written(tmp_path):
  out = tmp_path / "run"
  result = _run_rl(RUN + ["steps=2", "distributed.num_processes=2", "rollouts.source=recording",
                          f"rollouts.recording={tmp_path / 'no-such-recording'}", "--out", str(out)])
  assert result.returncode == 2, result.stderr[-2000:]
  errors = [l for l in result.stderr.splitlines() if l.startswith("run_rl")]
  assert len(errors) == 1 and "no-such-recording" in errors[0] and "Traceback" not in result.stderr
  assert not out.exists()


# ---------------------------------------------------------------- a process that fails
def _run_failing(tmp: Path, failing: int, phase: str) -> list[tuple[int, str]]:
  """A job of two processes started by hand (``tests.distributed_driver --fail``) in which process ``failing``
  fails in ``phase``: each process's (exit code, stderr)."""
  coordinator = f"127.0.0.1:{free_loopback_port()}"
  # A long timeout: a process that waited for it (rather than being told) would fail the test's own wait.
  args = RUN + ["steps=4", "distributed.num_processes=2", "distributed.timeout_s=900", "--out", str(tmp / "run")]
  procs = []
  for i in range(2):
    env = launcher.child_env(dict(os.environ), process_id=i, coordinator=coordinator, devices_per_process=2)
    del env[launcher.LAUNCHED_ENV]  # as started by hand: each process prints its own line
    procs.append(subprocess.Popen([sys.executable, "-m", "tests.distributed_driver", "--fail", str(failing), phase,
                                   *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True))
  try:
    return [(p.returncode, err) for p, (_, err) in ((p, p.communicate(timeout=600)) for p in procs)]
  finally:  # a process still waiting (the test failed) is not left behind
    for p in procs:
      if p.poll() is None:
        p.kill()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("failing, phase", [(1, "preflight"), (0, "step")])
def test_a_process_that_fails_ends_the_job_at_once_and_every_process_names_it(tmp_path, failing, phase):
  """Negative control: whichever process is made to fail (1 before the run, 0 at a step), that one is named,
  by itself and by the other, which ends without waiting out distributed.timeout_s."""
  from tests.distributed_driver import INJECTED

  ended = _run_failing(tmp_path, failing, phase)
  other = 1 - failing
  (code, err), (other_code, other_err) = ended[failing], ended[other]
  where = "during bring-up" if phase == "preflight" else "at step 1"
  assert code == 1 and f"run_rl: process {failing} of 2: the run failed {where}: RuntimeError: {INJECTED}" in err
  other_lines = [l for l in other_err.splitlines() if l.startswith("run_rl")]
  assert other_code == launcher.ENDED_BY_PEER_EXIT and len(other_lines) == 1, other_err[-3000:]
  assert f"process {other} of 2: process {failing} of 2 failed: RuntimeError: {INJECTED}" in other_lines[0]
  assert "Traceback" not in other_err
  if phase == "preflight":
    assert not (tmp_path / "run").exists()
  else:
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ended"] == "error" and INJECTED in summary["error"]


# ---------------------------------------------------------------- unit tests (one process)
@pytest.mark.engine
def test_combine_max_takes_the_slowest_process_and_any_stop():
  values = [{"wait": 0.001, "stop": False, "delay": None, "floor": [1.0, 5.0]},
            {"wait": 0.004, "stop": True, "delay": None, "floor": [3.0, 2.0]}]
  assert combine_max(values) == {"wait": 0.004, "stop": True, "delay": None, "floor": [3.0, 5.0]}
  assert SingleProcess().combine("x", {"wait": 1.5}) == {"wait": 1.5}


def _post(store, round_index, process_id, tag, value):
  store[f"step_boundary/round/{round_index}/{process_id}"] = json.dumps({"tag": tag, "value": value})


@pytest.mark.engine
def test_an_exchange_returns_every_processs_value_and_cleans_up_after_itself():
  store = {}
  agreement = KeyValueAgreement(FakeKeyValueClient(store), 0, 2, timeout_s=1)
  _post(store, 0, 1, "observe step 0", {"wait": 2.0})
  assert agreement.exchange("observe step 0", {"wait": 1.0}) == [{"wait": 1.0}, {"wait": 2.0}]
  _post(store, 1, 1, "stop after step 1", None)
  assert agreement.exchange("stop after step 1", "SIGINT") == ["SIGINT", None]
  assert "step_boundary/round/0/0" not in store  # read everywhere once round 1 completed
  assert "step_boundary/round/1/0" in store


@pytest.mark.engine
def test_a_job_of_one_process_agrees_without_a_round_trip():
  client = FakeKeyValueClient()
  client.key_value_set = client.blocking_key_value_get = None  # any call would fail
  agreement = KeyValueAgreement(client, 0, 1, timeout_s=1)
  assert agreement.exchange("observe step 0", {"wait": 1.0}) == [{"wait": 1.0}] and agreement.exchanges == 1


@pytest.mark.engine
def test_a_process_that_never_arrives_is_named_and_a_diverged_one_is_refused():
  store = {}
  agreement = KeyValueAgreement(FakeKeyValueClient(store), 0, 3, timeout_s=0.5)
  _post(store, 0, 1, "observe step 4", 0.0)
  with pytest.raises(ProcessLostError, match=r"process 2 of 3 did not reach 'observe step 4' within 0.5 s"):
    agreement.exchange("observe step 4", 0.0)
  _post(store, 1, 1, "stop after step 4", None)
  with pytest.raises(AgreementError, match="process 1 is at 'stop after step 4' while process 0 is at 'observe"):
    agreement.exchange("observe step 5", 0.0)


@pytest.mark.engine
def test_the_watchdog_names_a_silent_peer_after_the_timeout_and_not_before():
  now = [0.0]
  store = {}
  dog = Watchdog(FakeKeyValueClient(store), 0, 3, timeout_s=5, on_lost=lambda line: None, clock=lambda: now[0])
  for beat in range(1, 5):  # process 1 beats, process 2 went silent after its first beat
    store["step_boundary/alive/1"] = str(beat)
    store.setdefault("step_boundary/alive/2", "1")
    assert dog.check(beat) is None
    now[0] += 1.0
  now[0] += 1.5
  store["step_boundary/alive/1"] = "9"
  assert dog.check(9) == "process 2 of 3 sent no heartbeat for 5.5 s (distributed.timeout_s=5)"


def _watchdog(store, process_id, lines):
  dog = Watchdog(FakeKeyValueClient(store), process_id, 2, timeout_s=60, on_lost=lines.append)
  dog.interval_s = 0.01  # many beats within the timeout: no peer ever counts as silent here
  return dog.start()


@pytest.mark.engine
def test_a_failed_process_names_a_peer_that_failed_first_and_else_tells_the_peers_its_own_failure():
  store, lost = {}, []
  first, second = _watchdog(store, 0, lost), _watchdog(store, 1, lost)
  first.wait_for_peers()  # process 1 beats and posted nothing: the failure is process 0's own
  assert lost == []
  first.post_failure("RuntimeError: boom\n  the rest of the message")
  second.wait_for_peers()  # its watchdog reads the failure and reports it (and would end the process)
  assert lost == ["process 0 of 2 failed: RuntimeError: boom"]
  second.post_ending()  # what the process does next (Job.end_for_peer), and what process 0 waits for
  first.wait_until_peers_end()
  # Negative control: the same two, the other way round.
  store, lost = {}, []
  first, second = _watchdog(store, 0, lost), _watchdog(store, 1, lost)
  second.post_failure("ValueError: bad")
  first.wait_for_peers()
  assert lost == ["process 1 of 2 failed: ValueError: bad"]


class _Exits:
  """A local process that exits with ``code`` at its ``at``-th poll."""

  def __init__(self, code: int, at: int):
    self.code, self.at, self.polls, self.pid = code, at, 0, 1000 + at

  def poll(self):
    self.polls += 1
    return self.code if self.polls >= self.at else None


@pytest.mark.e2e
@pytest.mark.parametrize("exits, blamed", [([(launcher.ENDED_BY_PEER_EXIT, 1), (1, 4)], 1),
                                           ([(1, 4), (launcher.ENDED_BY_PEER_EXIT, 1)], 0)],
                         ids=["ended-by-peer-first", "negative-control"])
def test_the_launcher_names_the_process_that_failed_not_one_its_failure_ended_first(tmp_path, capsys, exits,
                                                                                     blamed):
  import shutil

  job = launcher.LocalJob([], num_processes=2, devices_per_process=1, out=tmp_path / "run", timeout_s=60)
  shutil.rmtree(job._log_dir)
  job.processes = [_Exits(code, at) for code, at in exits]
  codes, first = job._wait()
  assert first == blamed and codes[blamed] == 1
  log = tmp_path / "process.log"
  log.write_text(f"Traceback\nrun_rl: process {blamed} of 2: the run failed at step 3: RuntimeError: boom\n")
  assert job._report(codes, first, {blamed: log}) == 1
  line = capsys.readouterr().err.strip()
  assert line.startswith(f"run_rl: process {blamed} of 2 (pid ") and "exit 1): the run failed at step 3" in line


@pytest.mark.engine
def test_a_process_packs_exactly_its_rows_of_the_whole_micro_batch():
  source = SyntheticRollouts(512, 8, 64, generations_per_group=4, fill=0.85, seed=3)
  payload = source.micro_batch(0, 0)
  whole = packing.pack_payload(payload, rows=8, tokens_per_row=64, vocab_size=512)
  for start, stop in ((0, 4), (4, 8), (2, 6)):
    part = packing.pack_payload(payload, rows=8, tokens_per_row=64, vocab_size=512, row_range=(start, stop))
    for name in packing.FIELDS:
      np.testing.assert_array_equal(part[name], whole[name][start:stop])
  assert not np.array_equal(part["input_tokens"], whole["input_tokens"][:4])  # another block is other rows
  with pytest.raises(ValueError, match="row_range"):
    packing.pack_payload(payload, rows=8, tokens_per_row=64, vocab_size=512, row_range=(4, 12))


@pytest.mark.engine
def test_a_local_process_gets_its_identity_and_its_share_of_cpu_devices():
  env = launcher.child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo", "PJRT_NPROC": "1"},
                           process_id=1, coordinator="127.0.0.1:1234", devices_per_process=2)
  assert env["STEP_BOUNDARY_PROCESS_ID"] == "1" and env["STEP_BOUNDARY_COORDINATOR_ADDRESS"] == "127.0.0.1:1234"
  assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=2"
  assert env["JAX_PLATFORMS"] == "cpu" and "PJRT_NPROC" not in env


@pytest.mark.engine
def test_a_run_never_saves_one_processs_identity():
  recipe = recipe_lib.resolve(overrides=["distributed.num_processes=2", "distributed.process_id=1",
                                         "distributed.coordinator_address=10.0.0.1:1234",
                                         "rollouts.source=synthetic"], env={}).recipe
  saved = recipe_lib.run_config_dict(recipe)["distributed"]
  assert saved["num_processes"] == 2 and saved["process_id"] is None and saved["coordinator_address"] is None


@pytest.mark.e2e
@pytest.mark.parametrize("command", [["rig", "--recording", "recordings/rig_small"],
                                     ["serve-trainer", "--listen", "127.0.0.1:0"]])
def test_commands_of_one_process_refuse_a_distributed_recipe(command, capsys):
  from orchestrator.app import cli

  code = cli.main(command + ["--recipe", "recipes/rig_cpu.yaml", "distributed.num_processes=2"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and "distributed" in err[0]


class _TwoProcesses(SingleProcess):
  """Process ``me`` of two, whose peer measured ``peer`` at every exchange."""

  num_processes = 2

  def __init__(self, peer):
    self.peer = peer

  def exchange(self, tag, value):
    return [value, self.peer]


@pytest.mark.engine
@pytest.mark.parametrize("agreed", [True, False], ids=["agreed", "negative-control-local-only"])
def test_processes_that_measured_different_waits_still_take_the_same_path(agreed):
  from policies import StepBoundaryPolicy

  low = {"stage_s": 0.004, "device_wait_s": 0.0001, "update_delay_s": 0.003, "rollout_wait_s": 0.0}
  high = {"stage_s": 0.001, "device_wait_s": 0.050, "update_delay_s": None, "rollout_wait_s": 0.0}
  paths = []
  for mine, peer in ((low, high), (high, low)):
    policy = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, wait_threshold_s=0.002, disable_after=2)
    path = []
    for step in range(5):
      plan = policy.plan(step)
      seen = agree_on_measurements(_TwoProcesses(peer), step, mine, 0.002)[0] if agreed else mine
      policy.observe(step, stage_s=seen["stage_s"], device_wait_s=seen["device_wait_s"], probe=plan.probe,
                     update_delay_s=seen["update_delay_s"], rollout_wait_s=seen["rollout_wait_s"])
      path.append((plan.mode.value, plan.stage))
    paths.append(path)
  assert (paths[0] == paths[1]) is agreed


@pytest.mark.e2e
@pytest.mark.slow
def test_a_signal_to_one_process_stops_every_process_after_the_same_step_with_a_checkpoint(tmp_path):
  out = tmp_path / "run"
  # A generous exchange timeout: on a loaded machine 5 s can pass between two processes' boundaries, and this
  # test is about the signal, not about noticing a lost peer.
  run = subprocess.Popen([sys.executable, "-m", "orchestrator.app.cli", *RUN, "steps=5000", "checkpoint.every=0",
                          "distributed.timeout_s=120", "distributed.num_processes=2", "--out", str(out)], cwd=REPO,
                         stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 300
  while run.poll() is None and time.monotonic() < deadline:
    records = out / "records.jsonl"
    if records.exists() and len(records.read_text().splitlines()) >= 2:
      break
    time.sleep(0.05)
  assert run.poll() is None, f"the run ended before a signal could be sent (rc={run.returncode})"
  os.kill(_process_pids(run.pid)[1], signal.SIGTERM)  # the signal reaches process 1 alone
  _, err = run.communicate(timeout=120)
  assert run.returncode == 143, err[-2000:]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["ended"] == "signal" and summary["signal"] == "SIGTERM"
  last = summary["last_step"]
  assert last < 4999 and (out / "checkpoints" / str(last + 1)).is_dir()
  assert len((out / "records.jsonl").read_text().splitlines()) == last + 1
  assert "Traceback" not in err and f"stopped by SIGTERM after step {last}" in err

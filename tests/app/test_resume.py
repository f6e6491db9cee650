"""Runs that survive: resume equals an uninterrupted run, clean stops on signals, no clobbered outputs.

The signal and kill tests run ``run_rl`` as a child process (marked slow: they
are few, and CI runs them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.app import cli, signals
from orchestrator import recipe as recipe_lib
from orchestrator.run_files import run_dir
from policies import Mode
from tests.conftest import REPO

DENSE = ["model=tiny", "rollouts.source=synthetic", "batch.micro_batches_per_step=2", "run.reserve_host_core=false"]
MOE = DENSE[1:] + ["model=tiny_moe", "engine.ragged_buffer_factor=0.9", "engine.retry_when_tokens_dropped=true"]
# Slower steps for the child-process tests, so a signal lands mid-run.
CHILD = DENSE + ["batch.rows=16"]
# A pinned zero threshold never judges a wait low: no staged mode turns its staging off because the machine
# is loaded, so the policy's path (and the records that show it) does not depend on timing.
PINNED = ["step_boundary.wait_threshold_s=0"]
MODE_FLAGS = {
    Mode.OFF: ["--no-pipeline_step_boundary", "--no-stage_before_update"],
    Mode.PIPELINED: ["--no-stage_next_microbatch"],
    Mode.STAGE_AFTER_UPDATE: ["--no-stage_before_update"],
    Mode.STAGE_BEFORE_UPDATE: [],
}


@pytest.fixture(autouse=True)
def _no_env_switches(monkeypatch):
  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)


def _run(argv, capsys=None) -> tuple[int, str]:
  code = cli.main(argv)
  out = capsys.readouterr().out if capsys else ""
  return code, out


def _summary(run: Path) -> dict:
  """The run's combined view: its latest segment's summary."""
  return json.loads((run_dir.latest_segment(run) / "summary.json").read_text())


def _records(run: Path) -> list[dict]:
  """Every step's record across the run's segments."""
  return run_dir.all_records(run)


@pytest.fixture(scope="module")
def reference_digests(tmp_path_factory):
  """Uninterrupted 4-step runs (all modes train to the same digest, so one per model)."""
  out = {}
  for name, base in (("dense", DENSE), ("moe", MOE)):
    run = tmp_path_factory.mktemp("ref") / name
    assert cli.main(base + ["steps=4", "--out", str(run)]) == 0
    out[name] = _summary(run)["final_state_digest"]
  return out


@pytest.mark.e2e
@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.name)
def test_a_resumed_run_trains_like_an_uninterrupted_one(model, mode, reference_digests, tmp_path):
  base = DENSE if model == "dense" else MOE
  run = tmp_path / "run"
  assert cli.main(base + MODE_FLAGS[mode] + PINNED + ["steps=2", "checkpoint.every=2", "--out", str(run)]) == 0
  assert cli.main(["--resume", str(run), "--steps", "4"]) == 0
  summary = _summary(run)
  assert summary["final_state_digest"] == reference_digests[model]
  records = _records(run)
  assert [r["step"] for r in records] == [0, 1, 2, 3] and summary["steps"] == 4
  assert summary["ended"] == "completed" and summary["requested_mode"] == summary["final_mode"] == mode.value
  # Each segment stages every boundary but its last step's (step 1 ended the first segment).
  assert [r["staged"] for r in records] == [mode.staged, False, mode.staged, False]
  trace = json.loads((run_dir.latest_segment(run) / "trace.json").read_text())["traceEvents"]
  assert len({e["pid"] for e in trace}) == 4  # device and host, for each of the two segments


@pytest.mark.e2e
def test_a_resumed_run_continues_its_learning_rate_schedule_and_kl_reference_exactly(tmp_path):
  """The schedule's position is the optimizer's update count, in the checkpoint, and the KL term's reference is
  the run's starting weights, which a resumed run builds again before it restores (not the checkpoint's): a run
  resumed inside a warm-up and decay trains what an uninterrupted one trains, and its records carry each
  update's rate."""
  schedule = ["engine.lr_schedule=cosine", "engine.warmup_steps=2", "engine.decay_steps=2", "engine.kl_beta=0.5"]
  whole, run = tmp_path / "whole", tmp_path / "run"
  assert cli.main(DENSE + PINNED + schedule + ["steps=4", "--out", str(whole)]) == 0
  assert cli.main(DENSE + PINNED + schedule + ["steps=3", "checkpoint.every=3", "--out", str(run)]) == 0
  assert cli.main(["--resume", str(run), "--steps", "4"]) == 0
  assert _summary(run)["final_state_digest"] == _summary(whole)["final_state_digest"]
  rates = [r["learning_rate"] for r in _records(run)]
  lr = rates[2]  # the recipe's engine.learning_rate, reached at the end of the warm-up
  assert lr > 0 and rates == pytest.approx([0.0, lr / 2, lr, lr / 2])
  constant = tmp_path / "constant"  # negative control: without the schedule the digest differs
  assert cli.main(DENSE + PINNED + ["steps=4", "--out", str(constant)]) == 0
  assert _summary(constant)["final_state_digest"] != _summary(whole)["final_state_digest"]


@pytest.mark.e2e
def test_a_completed_run_keeps_its_final_weights_and_without_a_checkpoint_it_cannot_resume(tmp_path, capsys):
  """A run without checkpoint.every still checkpoints its last step (summary.json names it); with that
  checkpoint gone there is nothing to resume from."""
  run = tmp_path / "run"
  assert cli.main(DENSE + ["steps=2", "--out", str(run)]) == 0
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
  assert _summary(run)["checkpoint_path"] == str(run.absolute() / "checkpoints" / "2")
  shutil.rmtree(run / "checkpoints")
  capsys.readouterr()
  assert cli.main(["--resume", str(run), "--steps", "4"]) == 2
  assert "no complete checkpoint" in capsys.readouterr().err


@pytest.mark.e2e
def test_resuming_a_finished_run_needs_more_steps(tmp_path, capsys):
  run = tmp_path / "run"
  assert cli.main(DENSE + ["steps=2", "checkpoint.every=1", "--out", str(run)]) == 0
  capsys.readouterr()
  assert cli.main(["--resume", str(run)]) == 2
  assert "already did 2 of 2 steps; pass --steps N with N > 2" in capsys.readouterr().err


@pytest.mark.e2e
def test_out_over_a_run_is_refused_and_nothing_in_it_changes(tmp_path, capsys):
  run = tmp_path / "run"
  assert cli.main(DENSE + ["steps=2", "checkpoint.every=1", "--out", str(run)]) == 0
  before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}
  capsys.readouterr()
  assert cli.main(DENSE + ["steps=3", "--out", str(run)]) == 2
  assert "already holds a run; continue it with `run_rl --resume" in capsys.readouterr().err
  assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.e2e
def test_a_checkpoint_directory_of_another_run_is_refused(tmp_path, capsys):
  shared = tmp_path / "ckpt"
  assert cli.main(DENSE + ["steps=2", "checkpoint.every=1", f"checkpoint.directory={shared}",
                           "--out", str(tmp_path / "a")]) == 0
  capsys.readouterr()
  code = cli.main(DENSE + ["steps=2", "checkpoint.every=1", f"checkpoint.directory={shared}",
                           "--out", str(tmp_path / "b")])
  err = capsys.readouterr().err
  assert code == 2 and "holds checkpoints of another run (steps [1, 2]" in err
  assert not (tmp_path / "b").exists()


@pytest.mark.engine
def test_a_save_the_checkpoint_library_skips_is_an_error(tmp_path):
  from orchestrator.engine import build_engine

  engine = build_engine("tiny", checkpoint_dir=str(tmp_path / "ckpt"))
  engine.save_checkpoint({"run_id": "a"})
  with pytest.raises(RuntimeError, match="checkpoint 0 was not written: .* already holds a checkpoint of that step"):
    engine.save_checkpoint({"run_id": "b"})


@pytest.mark.engine
def test_a_restore_reads_the_directory_as_it_is_now_so_a_checkpoint_moved_aside_is_written_anew(tmp_path):
  import jax.numpy as jnp

  from orchestrator.engine.checkpointing import Checkpointer

  state = {"w": jnp.arange(3.0)}
  trainer = Checkpointer(tmp_path / "ckpt")
  trainer.save(2, state, {})
  trainer.save(4, state, {})
  shutil.move(str(tmp_path / "ckpt" / "4"), str(tmp_path / "aside-4"))  # as a resume from 2 does
  trainer.restore(state, 2)
  assert trainer.save(4, state, {"again": True}).endswith("/4")  # without the re-read: "already holds" step 4
  assert sorted(trainer._manager.all_steps()) == [2, 4]


@pytest.mark.spec
def test_checkpoints_finished_after_the_resume_chose_go_aside_and_come_back_if_it_fails(tmp_path, capsys):
  from types import SimpleNamespace

  from orchestrator.app.resume import ResumePoint, set_aside_late_checkpoints, withdraw_segment

  ckpt, segment = tmp_path / "ckpt", tmp_path / "run" / "segments" / "1"
  for step in (2, 4, 6):
    (ckpt / str(step)).mkdir(parents=True)
    (ckpt / str(step) / "held").write_text(str(step))
  segment.mkdir(parents=True)
  (segment / run_dir.SEGMENT).write_text("{}")
  point = ResumePoint(checkpoint_step=4, metadata={"step": 4}, previous_records=[], earlier_valid=2)
  ours = {"run_id": "ours"}
  held = {2: ours, 4: ours}
  assert set_aside_late_checkpoints(point, held, run_id="ours", checkpoint_dir=str(ckpt), segment=segment) == []
  # Another run's later checkpoint is not this resume's to move (its save of that step refuses, naming it).
  held[6] = {"run_id": "another"}
  assert set_aside_late_checkpoints(point, held, run_id="ours", checkpoint_dir=str(ckpt), segment=segment) == []
  held[6] = ours
  assert set_aside_late_checkpoints(point, held, run_id="ours", checkpoint_dir=str(ckpt), segment=segment) == [6]
  aside = segment / run_dir.SUPERSEDED_CHECKPOINTS
  assert sorted(p.name for p in ckpt.iterdir()) == ["2", "4"] and (aside / "6" / "held").read_text() == "6"
  assert point.superseded_checkpoints == [6]
  assert "retrains steps 4 to 5 and writes checkpoint 6 again" in capsys.readouterr().err
  # The resume fails before its first step: the run is as it was, checkpoint 6 back where it was.
  plan = SimpleNamespace(write_dir=segment, checkpoint_dir=str(ckpt), out=tmp_path / "run")
  assert withdraw_segment(plan, point, RuntimeError("restore failed")) == 1
  assert sorted(p.name for p in ckpt.iterdir()) == ["2", "4", "6"] and (ckpt / "6" / "held").read_text() == "6"


# ---------------------------------------------------------------------------- child processes
def _child(argv, pythonpath: Path | None = None) -> subprocess.Popen:
  path = str(REPO) if pythonpath is None else os.pathsep.join([str(REPO), str(pythonpath)])
  env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
  for name in recipe_lib.ENV_SWITCHES:
    env.pop(name, None)
  return subprocess.Popen([sys.executable, "-m", "orchestrator.app.cli", *argv], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_records(proc, run: Path, count: int, timeout_s: float = 300) -> None:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    path = run / "records.jsonl"
    if path.exists() and len(path.read_text().splitlines()) >= count:
      return
    if proc.poll() is not None:
      pytest.fail(f"the run ended early (rc={proc.returncode}): {proc.stderr.read()[-2000:]}")
    time.sleep(0.02)
  proc.kill()
  pytest.fail(f"no {count} records within {timeout_s} s")


def _reference(tmp_path: Path, steps: int) -> str:
  run = tmp_path / f"reference-{steps}"
  assert cli.main(CHILD + [f"steps={steps}", "--out", str(run)]) == 0
  return _summary(run)["final_state_digest"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_at_the_next_boundary_with_a_checkpoint_and_resumes(sig, code, tmp_path):
  run = tmp_path / "run"
  proc = _child(CHILD + ["steps=5000", "--out", str(run)])
  _wait_for_records(proc, run, 3)
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == code, err[-2000:]
  assert "Traceback" not in err
  summary = _summary(run)
  last = summary["last_step"]
  assert summary["ended"] == "signal" and summary["signal"] == sig.name
  assert summary["checkpoint_path"].endswith(f"checkpoints/{last + 1}")
  assert f"stopped by {sig.name} after step {last}" in err and f"run_rl --resume {run}" in err
  assert [r["step"] for r in _records(run)] == list(range(last + 1))
  assert cli.main(["--resume", str(run), "--steps", str(last + 4)]) == 0
  assert _summary(run)["final_state_digest"] == _reference(tmp_path, last + 4)


# The live loop paced by its sampler: a reward that takes 0.6 s a micro-batch (one per call, two a step) while a
# step of the tiny trainer takes a few tens of ms, so a stop nearly always finds the loop waiting for rollouts,
# and at staleness 1 the checkpoint of the last finished step must carry the next step's, still being sampled.
# The sampler samples in the run's process: what a stop waits for is the live source's sampling thread, whatever
# the placement, and a sampler process of its own would only add its start-up to each of the three runs.
SLOW_REWARD = """
import time

def score(prompts, completions, answer, **kwargs):
  time.sleep(0.6)
  return [float(c[:1] == a[:1]) for c, a in zip(completions, answer)]
"""
PACED = ["rollouts.max_staleness=1", "rollouts.batch_steps=1", "engine.epochs=1",
         "rollouts.micro_batches_per_call=1", "rollouts.groups_per_micro_batch=2", "batch.rows=4",
         "task.eval_prompts=4", "task.reward=[slow_reward:score]", "checkpoint.every=0",
         "run.reserve_host_core=false", "rollouts.placement=shared"]


@pytest.fixture(scope="module")
def paced(tmp_path_factory):
  """The slow reward's module (on the children's path) and the uninterrupted paced run's digest."""
  where = tmp_path_factory.mktemp("paced")
  (where / "slow_reward.py").write_text(SLOW_REWARD)
  run = where / "uninterrupted"
  proc = _child(PACED + ["steps=6", "--out", str(run)], pythonpath=where)
  _, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-2000:]
  return where, _summary(run)["final_state_digest"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_stop_while_the_run_waits_for_rollouts_keeps_every_finished_step(sig, code, paced, tmp_path):
  """Sampler-paced at staleness 1, a signal after two finished steps: the run ends after its last finished step
  with that step's checkpoint (carrying the next step's rollouts, which the stop waited for), and the resume
  reaches the uninterrupted run's digest (after SIGINT; SIGTERM's stop takes the same path)."""
  where, digest = paced
  run = tmp_path / "run"
  proc = _child(PACED + ["steps=6", "--out", str(run)], pythonpath=where)
  _wait_for_records(proc, run, 2)
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == code, err[-2000:]
  assert "Traceback" not in err and "[stop] the checkpoint of step" in err  # it waited for the rollouts
  summary = _summary(run)
  last = summary["last_step"]
  assert summary["ended"] == "signal" and summary["checkpoint_path"].endswith(f"checkpoints/{last + 1}")
  assert f"stopped by {sig.name} after step {last}: checkpoint" in err
  assert [r["step"] for r in _records(run)] == list(range(last + 1))
  if sig is signal.SIGTERM:
    return
  resumed = _child(["--resume", str(run)], pythonpath=where)
  _, err = resumed.communicate(timeout=600)
  assert resumed.returncode == 0, err[-2000:]
  assert _summary(run)["final_state_digest"] == digest


@pytest.mark.e2e
@pytest.mark.slow
def test_two_sigints_at_once_are_one_stop_with_a_checkpoint(tmp_path):
  """A wrapper that forwards the terminal's Ctrl-C delivers it twice within microseconds: one clean stop,
  with a checkpoint."""
  run = tmp_path / "run"
  proc = _child(CHILD + ["steps=5000", "--out", str(run)])
  _wait_for_records(proc, run, 2)
  proc.send_signal(signal.SIGINT)
  time.sleep(0.01)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 130, err[-2000:]
  assert "Traceback" not in err and "second SIGINT" not in err
  summary = _summary(run)
  assert summary["ended"] == "signal" and summary["checkpoint_path"].endswith(f"checkpoints/{summary['last_step'] + 1}")


@pytest.mark.e2e
def test_signals_within_the_window_are_one_stop_and_a_later_one_stops_at_once(tmp_path, monkeypatch, capsys):
  """The handler itself, on a clock the test sets: a repeat within SIGNAL_WINDOW_S is the same stop; one after
  it ends the process at once (os._exit with the signal's code), in one line."""
  now = [100.0]
  monkeypatch.setattr(signals.time, "monotonic", lambda: now[0])

  def exit_now(code):
    raise SystemExit(code)

  monkeypatch.setattr(signals.os, "_exit", exit_now)
  stop = signals.StopSignals(tmp_path)
  stop._handle(signal.SIGINT, None)
  assert stop.requested() == "SIGINT"
  now[0] += signals.SIGNAL_WINDOW_S / 2
  stop._handle(signal.SIGINT, None)  # the same Ctrl-C, forwarded again: nothing more happens
  stop._handle(signal.SIGTERM, None)
  assert "second" not in capsys.readouterr().err
  now[0] += signals.SIGNAL_WINDOW_S
  with pytest.raises(SystemExit) as stopped:
    stop._handle(signal.SIGINT, None)
  assert stopped.value.code == signals.EXIT_NOTHING_TO_RESUME  # no checkpoint in tmp_path: nothing to resume
  assert capsys.readouterr().err.count("second SIGINT: stopped at once") == 1
  (tmp_path / "config.json").write_text(json.dumps({"run_id": "r", "config": {}}))
  (tmp_path / "checkpoints" / "2").mkdir(parents=True)  # a complete checkpoint: the stop is resumable
  with pytest.raises(SystemExit) as stopped:
    stop._handle(signal.SIGINT, None)
  assert stopped.value.code == 130


@pytest.mark.e2e
@pytest.mark.parametrize("remembered", [True, False], ids=["startup-handler", "python-default"])
def test_a_ctrl_c_python_drops_during_start_up_still_stops_the_run(remembered, tmp_path, capsys, monkeypatch):
  """A SIGINT that lands in a finalizer raises there, and Python prints and drops the KeyboardInterrupt; the
  run's StopSignals still takes it as a stop. Negative control: with Python's own handler it is lost."""

  class Finalized:
    def __del__(self):
      os.kill(os.getpid(), signal.SIGINT)  # the handler runs inside __del__, as in a gc callback

  dropped = []
  monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))

  def start_up():
    Finalized()  # dropped at once: its __del__ takes the interrupt
    with signals.StopSignals(tmp_path) as stop:
      return stop.requested()

  # A run starts with Python's own handler (the premise: a test before this one in the same worker may have left
  # another), which startup_interrupts replaces with one that also remembers.
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    if remembered:
      with signals.startup_interrupts():
        requested = start_up()
    else:
      requested = start_up()
  finally:
    signal.signal(signal.SIGINT, previous)
  err = capsys.readouterr().err
  assert dropped == [KeyboardInterrupt]  # Python dropped the interrupt rather than raise it
  assert requested == ("SIGINT" if remembered else None)
  assert ("SIGINT received: stopping after the first step if it finishes (checkpointed)" in err) == remembered


@pytest.mark.e2e
def test_a_stop_signal_ignored_when_run_rl_started_stays_ignored_in_the_run(capsys):
  """Under ``nohup`` (or a shell's background job) SIGINT is ignored: start-up and the run's own handlers leave
  it so, while SIGTERM still stops the run. The negative control: not ignored at start, the run handles it."""
  previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    with signals.startup_interrupts(), signals.StopSignals(Path(".")) as stop:
      assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
      assert "SIGINT is ignored in this process" in capsys.readouterr().err
      assert signal.getsignal(signal.SIGTERM) == stop._handle
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with signals.startup_interrupts(), signals.StopSignals(Path(".")) as stop:
      assert signal.getsignal(signal.SIGINT) == stop._handle
  finally:
    signal.signal(signal.SIGINT, previous)


@pytest.mark.e2e
def test_a_sigint_ignored_by_whoever_started_the_run_stays_ignored_in_start_up():
  previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    with signals.startup_interrupts():
      assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
  finally:
    signal.signal(signal.SIGINT, previous)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_killed_run_resumes_from_its_last_complete_checkpoint(tmp_path):
  """SIGKILL at several points (early, mid, around checkpoints): every resume trains like no kill."""
  steps = 24
  reference = _reference(tmp_path, steps)
  resumed = []
  for records_seen in (2, 9, 17):
    run = tmp_path / f"killed-after-{records_seen}"
    proc = _child(CHILD + [f"steps={steps}", "checkpoint.every=4", "--out", str(run)])
    _wait_for_records(proc, run, records_seen)
    proc.kill()
    proc.communicate(timeout=60)
    if not any(p.name.isdigit() for p in (run / "checkpoints").glob("*")):
      continue  # killed before the first checkpoint completed: nothing to resume, nothing claimed
    assert cli.main(["--resume", str(run)]) == 0, records_seen
    assert _summary(run)["final_state_digest"] == reference, records_seen
    assert [r["step"] for r in _records(run)] == list(range(steps)), records_seen
    resumed.append(records_seen)
  assert resumed[-2:] == [9, 17]  # the later kills always had a complete checkpoint to resume from


RECORDING = ["rollouts.source=recording", "rollouts.recording=recordings/rig_small", "batch.rows=32"]


@pytest.mark.e2e
@pytest.mark.parametrize("micro,source", [(1, "synthetic"), (2, "synthetic"), (2, "recording")])
def test_resuming_from_a_mid_run_checkpoint_repeats_the_run_exactly(micro, source, tmp_path):
  """Drop the last checkpoint of a finished run and resume from the one before: the steps after it
  are run again with the same plans, policy counters and weights (with one micro-batch per step the
  next boundary is planned before the checkpoint; the checkpoint carries that plan)."""
  import shutil

  run = tmp_path / "run"
  argv = DENSE[:-2] + [f"batch.micro_batches_per_step={micro}", "run.reserve_host_core=false"] + PINNED
  if source == "recording":  # the grain iterator's saved state picks the replay up where it was
    argv += RECORDING
  assert cli.main(argv + ["steps=4", "checkpoint.every=2", "--out", str(run)]) == 0
  first = _summary(run)
  first_records = _records(run)
  shutil.rmtree(run / "checkpoints" / "4")
  assert cli.main(["--resume", str(run)]) == 0
  again = _summary(run)
  assert again["final_state_digest"] == first["final_state_digest"]
  assert again["policy_counters"] == first["policy_counters"]
  keys = ("step", "mode", "staged", "stage_before_update", "reason", "actions", "tokens", "staged_digest")
  assert [{k: r[k] for k in keys} for r in _records(run)] == [{k: r[k] for k in keys} for r in first_records]

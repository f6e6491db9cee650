"""A run directory nothing can corrupt: one process at a time, segments that never rewrite a finished run,
records and checkpoint metadata checked as input, the saved recipe held to its digest."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.app import cli, locks
from orchestrator.loop.boundary_work import BoundaryWork
from orchestrator.run_files import checkpoint_check, run_dir
from tests.conftest import REPO

BASE = ["model=tiny", "rollouts.source=synthetic", "batch.micro_batches_per_step=2", "run.reserve_host_core=false",
        "step_boundary.wait_threshold_s=0", "checkpoint.every=2"]


@pytest.fixture(autouse=True)
def _no_env_switches(monkeypatch):
  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
  """A completed 4-step run with checkpoints 2 and 4 (copied by each test that changes it)."""
  run = tmp_path_factory.mktemp("finished") / "run"
  assert cli.main(BASE + ["steps=4", "--out", str(run)]) == 0
  return run


@pytest.fixture(scope="module")
def six_step_digest(tmp_path_factory) -> str:
  run = tmp_path_factory.mktemp("six") / "run"
  assert cli.main(BASE + ["steps=6", "--out", str(run)]) == 0
  return _summary(run)["final_state_digest"]


def _copy(finished: Path, tmp_path: Path) -> Path:
  run = tmp_path / "run"
  shutil.copytree(finished, run)
  return run


def _summary(run: Path) -> dict:
  return json.loads((run_dir.latest_segment(run) / run_dir.SUMMARY).read_text())


def _files(run: Path) -> dict[str, bytes]:
  """Every file of a run directory and its bytes (the lock file aside: it names its holder)."""
  return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
          if p.is_file() and p.name != run_dir.LOCK}


def _refused(argv, capsys) -> str:
  code = cli.main(argv)
  err = capsys.readouterr().err.strip()
  assert code == 2, err
  assert len(err.splitlines()) == 1 and "Traceback" not in err, err
  return err


def _metadata_path(run: Path, step: int) -> Path:
  return run / "checkpoints" / str(step) / "metadata" / "metadata"


# ---------------------------------------------------------------------------- the lock
@contextlib.contextmanager
def _held_by_another_process(path: Path):
  """``path``'s lock, held by a child process until the block ends (then killed: the OS drops its lock)."""
  child = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path;"
                            " from orchestrator.app import locks;"
                            f" held = locks.lock(Path({str(path)!r}), flag='t', create=True);"
                            " print('held', flush=True); time.sleep(600)"],
                           cwd=REPO, stdout=subprocess.PIPE, text=True)
  try:
    assert child.stdout.readline().strip() == "held"
    yield child.pid
  finally:
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)


@pytest.mark.e2e
def test_a_held_run_directory_is_refused_naming_the_holder_before_anything_is_read(finished, tmp_path, capsys):
  run = _copy(finished, tmp_path)
  (run / run_dir.CONFIG).write_text("not json")  # a resume that read it would refuse it for that instead
  before = _files(run)
  with _held_by_another_process(run) as holder:
    err = _refused(["--resume", str(run), "--steps", "6"], capsys)
  assert f"is in use by pid {holder}" in err
  assert _files(run) == before


@pytest.mark.e2e
def test_a_new_run_into_a_held_directory_is_refused(tmp_path, capsys):
  out = tmp_path / "new"
  with _held_by_another_process(out):
    err = _refused(BASE + ["steps=2", "--out", str(out)], capsys)
  assert "in use by pid" in err and not (out / run_dir.CONFIG).exists()


@pytest.mark.e2e
def test_the_lock_is_released_when_its_holder_ends_and_this_process_may_take_its_own_again(tmp_path):
  """The OS drops the lock of a process that dies (even by SIGKILL): the next one takes it. A process that
  holds a lock takes it again as a no-op (a live ``record`` holds its directory, then its run takes it)."""
  out = tmp_path / "dir"
  with _held_by_another_process(out) as holder:
    with pytest.raises(run_dir.RunDirError, match=f"in use by pid {holder}"):
      locks.lock(out, flag="t")
  held = locks.lock(out, flag="t")
  with locks.lock(out, flag="t"):  # re-entered: releasing it keeps the first
    pass
  assert locks._key(out) in locks._HELD
  held.release()
  assert locks._key(out) not in locks._HELD


@pytest.mark.e2e
def test_two_checkout_copies_sharing_a_checkpoint_directory_cannot_run_at_once(finished, tmp_path, capsys):
  shared = tmp_path / "shared-ckpt"
  with _held_by_another_process(shared):
    err = _refused(BASE + ["steps=2", f"checkpoint.directory={shared}", "--out", str(tmp_path / "x")], capsys)
  assert "checkpoint.directory" in err and "in use by pid" in err


@pytest.mark.e2e
def test_the_rig_refuses_a_run_directory(finished, tmp_path, capsys):
  run = _copy(finished, tmp_path)
  before = _files(run)
  err = _refused(["rig", "--out", str(run), "--recording", "recordings/rig_small"], capsys)
  assert "holds a run" in err
  assert _files(run) == before


@pytest.mark.e2e
def test_a_directory_the_lock_created_is_removed_after_a_refusal(tmp_path, capsys):
  out = tmp_path / "rig-out"
  code = cli.main(["rig", "--out", str(out), "--recording", str(tmp_path / "no-such-recording")])
  capsys.readouterr()
  assert code == 2 and not out.exists()


@pytest.mark.e2e
@pytest.mark.slow
def test_two_resumes_at_once_run_one_and_refuse_the_other(finished, tmp_path):
  run = _copy(finished, tmp_path)
  env = {k: v for k, v in os.environ.items() if k not in recipe_lib.ENV_SWITCHES}
  env["PJRT_NPROC"] = "1"
  procs = [subprocess.Popen([sys.executable, "-m", "orchestrator.app.cli", "--resume", str(run), "--steps", "8"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for _ in range(2)]
  results = [(p.wait(timeout=600), p.communicate()[1]) for p in procs]
  codes = sorted(code for code, _ in results)
  assert codes == [0, 2], results
  refused = next(err for code, err in results if code == 2)
  assert "is in use by pid" in refused and len(refused.strip().splitlines()) == 1
  assert [r["step"] for r in run_dir.all_records(run)] == list(range(8))
  assert len(list((run / run_dir.SEGMENTS).iterdir())) == 1  # the refused one opened no segment


# ---------------------------------------------------------------------------- segments
@pytest.mark.e2e
def test_extending_a_finished_run_writes_a_segment_and_leaves_the_run_as_it_was(finished, six_step_digest,
                                                                              tmp_path):
  run = _copy(finished, tmp_path)
  before = _files(run)
  assert cli.main(["--resume", str(run), "--steps", "6"]) == 0
  after = _files(run)
  assert {k: after[k] for k in before} == before  # not one byte of the finished run changed
  segment = run / run_dir.SEGMENTS / "1"
  summary = _summary(run)
  assert run_dir.latest_segment(run) == segment
  assert summary["final_state_digest"] == six_step_digest
  assert summary["steps"] == 6 and summary["segment"] == 1  # the combined view covers every step
  assert [s["summary"] for s in summary["segments"]] == [str(run / "summary.json"), str(segment / "summary.json")]
  assert [r["step"] for r in run_dir.all_records(run)] == list(range(6))
  assert [json.loads(line)["step"] for line in (segment / "records.jsonl").read_text().splitlines()] == [4, 5]
  # A later resume continues the extended run, to the length its latest segment ran to.
  assert run_dir.segments(run, run_dir.read_config(run))[-1].steps == 6


@pytest.mark.e2e
def test_a_failed_resume_leaves_every_file_of_the_finished_run_byte_identical(finished, tmp_path, monkeypatch,
                                                                             capsys):
  run = _copy(finished, tmp_path)
  before = _files(run)
  read_metrics = BoundaryWork.read_metrics

  def fail_at_step_5(self, boundary):
    if boundary.step == 5:
      raise RuntimeError("the device fell over")
    return read_metrics(self, boundary)

  monkeypatch.setattr(BoundaryWork, "read_metrics", fail_at_step_5)
  assert cli.main(["--resume", str(run), "--steps", "8"]) == 1
  assert "the device fell over" in capsys.readouterr().err
  after = _files(run)
  assert {k: after[k] for k in before} == before
  segment = run / run_dir.SEGMENTS / "1"
  assert json.loads((segment / "summary.json").read_text())["ended"] == "error"
  assert (segment / "error.log").exists()


@pytest.mark.e2e
def test_a_kill_between_a_checkpoint_and_its_record_loses_no_record(finished, tmp_path):
  """As a run killed right after checkpoint 2 leaves it: record 1 not yet written, no checkpoint 4, no summary.
  The resume restores record 1 from the checkpoint and trains to the digest of the run never killed."""
  run = _copy(finished, tmp_path)
  lines = (run / "records.jsonl").read_text().splitlines(keepends=True)
  (run / "records.jsonl").write_text(lines[0])
  shutil.rmtree(run / "checkpoints" / "4")
  (run / "summary.json").unlink()
  assert cli.main(["--resume", str(run)]) == 0
  records = run_dir.all_records(run)
  assert [r["step"] for r in records] == [0, 1, 2, 3]
  assert records[1]["restored_from_checkpoint"] == 2 and records[1]["step_s"] is not None
  assert [r.get("restored_from_checkpoint") for r in records[2:]] == [None, None]
  assert _summary(run)["final_state_digest"] == json.loads((finished / "summary.json").read_text())[
      "final_state_digest"]


# ---------------------------------------------------------------------------- records checked
def _change_line(run: Path, number: int, change) -> None:
  path = run / "records.jsonl"
  lines = path.read_bytes().split(b"\n")
  lines[number - 1] = change(lines[number - 1])
  path.write_bytes(b"\n".join(lines))


@pytest.mark.e2e
@pytest.mark.parametrize("change,problem", [
    (lambda line: line.replace(b'"step": 1', b'"step": 1,', 1), "not JSON"),
    (lambda line: b"{}", "no step"),
    (lambda line: line[:10] + b"\xff" + line[11:], "not UTF-8"),
    (lambda line: line.replace(b'"step": 1', b'"step": 3', 1), "holds step 3 where step 1 belongs"),
    (lambda line: b"[1, 2]", "a JSON list"),
], ids=["torn-json", "empty-object", "not-utf8", "wrong-step", "not-an-object"])
def test_a_damaged_record_the_resume_needs_is_refused_naming_file_and_line(change, problem, finished, tmp_path,
                                                                          capsys):
  run = _copy(finished, tmp_path)
  _change_line(run, 2, change)
  before = _files(run)
  err = _refused(["--resume", str(run), "--steps", "6"], capsys)
  assert f"{run / 'records.jsonl'} line 2 is damaged" in err and problem in err, err
  assert _files(run) == before  # refused, not "repaired"


# ---------------------------------------------------------------------------- checkpoint metadata checked
def _edit_metadata(run: Path, step: int, edit) -> None:
  path = _metadata_path(run, step)
  metadata = json.loads(path.read_text())
  edit(metadata)
  path.write_text(json.dumps(metadata))


@pytest.mark.e2e
@pytest.mark.parametrize("edit,problem", [
    (lambda m: m.update(step="four"), "says it is after step 'four'"),
    (lambda m: m.pop("records_count"), "lacks records_count"),
    (lambda m: m.update(records_count=3), "covers 3 records"),
    (lambda m: m["source_state"].update(next_step=3), "a rollout position before step 3"),
    (lambda m: m.update(source_state={"kind": "replay", "grain": {}}), "of kind 'replay'"),
    (lambda m: m.update(policy_state={"mode": "off"}), "policy state that cannot be restored"),
    (lambda m: m.update(mode="fast"), "names mode 'fast'"),
], ids=["step-not-a-number", "no-records-count", "records-count", "position", "source-kind", "policy", "mode"])
def test_damaged_metadata_on_the_latest_checkpoint_is_refused_naming_the_valid_one(edit, problem, finished,
                                                                                  tmp_path, capsys):
  run = _copy(finished, tmp_path)
  _edit_metadata(run, 4, edit)
  before = _files(run)
  err = _refused(["--resume", str(run), "--steps", "6"], capsys)
  assert "checkpoint 4" in err and problem in err, err
  assert "--from-checkpoint 2" in err
  assert _files(run) == before


@pytest.mark.e2e
def test_a_checkpoint_of_another_run_is_refused(finished, tmp_path, capsys):
  run = _copy(finished, tmp_path)
  _edit_metadata(run, 4, lambda m: m.update(run_id="someone-else"))
  err = _refused(["--resume", str(run), "--steps", "6"], capsys)
  assert "holds checkpoints of another run (steps [4], run someone-else)" in err


@pytest.mark.e2e
def test_a_junk_checkpoint_is_refused_and_from_checkpoint_moves_it_aside(finished, six_step_digest, tmp_path,
                                                                        capsys):
  run = _copy(finished, tmp_path)
  junk = run / "checkpoints" / "9"
  shutil.copytree(run / "checkpoints" / "4", junk)
  _metadata_path(run, 9).write_text("{not json")
  err = _refused(["--resume", str(run), "--steps", "12"], capsys)
  assert "checkpoint 9" in err and "--from-checkpoint 4" in err, err
  assert cli.main(["--resume", str(run), "--steps", "6", "--from-checkpoint", "4"]) == 0
  assert not junk.exists()
  assert (run / run_dir.SEGMENTS / "1" / run_dir.SUPERSEDED_CHECKPOINTS / "9" / "metadata").is_dir()  # kept
  assert _summary(run)["final_state_digest"] == six_step_digest


@pytest.mark.e2e
def test_from_checkpoint_refuses_a_checkpoint_that_is_not_there(finished, tmp_path, capsys):
  run = _copy(finished, tmp_path)
  err = _refused(["--resume", str(run), "--steps", "6", "--from-checkpoint", "3"], capsys)
  assert "no complete checkpoint 3" in err and "2, 4" in err
  assert "goes with --resume" in _refused(["--from-checkpoint", "2"], capsys)


# ---------------------------------------------------------------------------- the saved recipe
@pytest.mark.e2e
def test_an_edited_config_is_refused_naming_the_changed_keys(finished, tmp_path, capsys):
  run = _copy(finished, tmp_path)
  config = json.loads((run / run_dir.CONFIG).read_text())
  config["config"]["engine"]["learning_rate"] *= 10
  config["config"]["batch"]["rows"] = 8
  (run / run_dir.CONFIG).write_text(json.dumps(config))
  before = _files(run)
  err = _refused(["--resume", str(run), "--steps", "6"], capsys)
  assert "was edited" in err and "batch.rows, engine.learning_rate" in err, err
  assert _files(run) == before


@pytest.mark.engine
def test_a_config_digest_names_the_keys_that_changed():
  config = {"config": {"steps": 4, "engine": {"learning_rate": 0.1, "seed": 0}}}
  config["digest"] = run_dir.config_digest(config["config"])
  assert run_dir.edited_keys(config) == []
  config["config"]["engine"]["seed"] = 1
  assert run_dir.edited_keys(config) == ["engine.seed"]
  config["config"]["engine"]["new"] = 1
  assert run_dir.edited_keys(config) == ["engine.new", "engine.seed"]
  assert run_dir.edited_keys({"config": {}}) is None  # an older run's config: no digest to check


@pytest.mark.e2e
def test_a_directory_that_cannot_be_written_is_refused_in_one_line(finished, tmp_path, capsys, monkeypatch):
  run = _copy(finished, tmp_path)
  before = _files(run)
  monkeypatch.setattr(run_dir.os, "access", lambda path, mode: False)  # root can write anything: pretend
  err = _refused(["--resume", str(run), "--steps", "6"], capsys)
  assert "not writable" in err
  assert _files(run) == before


@pytest.mark.e2e
def test_rollouts_a_live_checkpoint_carries_are_checked_before_a_resume_trains_on_them(finished):
  """A live checkpoint carries sampled steps; one the engine could not train on is refused by name (a
  negative control: the same metadata passes with payloads that check)."""
  class CarryingSource:
    kind = "live"

    def set_state(self, state):
      del state

    def carried_payloads(self):
      return [("step 4", 0, ["not a trajectory"])]

  def refuse(payload):
    raise ValueError(f"payload[0] is a {type(payload[0]).__name__}, expected a Trajectory")

  metadata = json.loads(_metadata_path(finished, 4).read_text())
  metadata["source_state"] = {"kind": "live", "next_step": 4, "sampled": []}
  problem = checkpoint_check.problem(4, metadata, run_id=metadata["run_id"], source=CarryingSource(),
                                     payload_check=refuse)
  assert problem is not None and "carries rollouts of step 4" in problem and "expected a Trajectory" in problem
  assert checkpoint_check.problem(4, metadata, run_id=metadata["run_id"], source=CarryingSource(),
                                  payload_check=lambda payload: None) is None
  assert "config.json was edited" in checkpoint_check.problem(
      4, dict(metadata, config_sha256="0" * 64), run_id=metadata["run_id"], source=CarryingSource(),
      config_sha256="1" * 64)
  assert "names mode ['x']" in checkpoint_check.problem(4, dict(metadata, mode=["x"]), run_id=metadata["run_id"],
                                                        source=CarryingSource())
  assert "pending record of step 3 without" in checkpoint_check.problem(
      4, dict(metadata, pending_record={"step": 3}), run_id=metadata["run_id"], source=CarryingSource())


# ---------------------------------------------------------------------------- what a resume reads, of its kind
def _hand_made_run(path: Path, run_id: str = "r1") -> Path:
  """A run directory as a run leaves it, by hand: its config, records, a segment, an empty checkpoints/."""
  path.mkdir(parents=True)
  (path / run_dir.CONFIG).write_text(json.dumps({"run_id": run_id, "config": {"steps": 4}}))
  (path / run_dir.RECORDS).write_text("")
  (path / run_dir.CHECKPOINTS).mkdir()
  segment = path / run_dir.SEGMENTS / "1"
  segment.mkdir(parents=True)
  (segment / run_dir.SEGMENT).write_text(json.dumps({"first_step": 2, "steps": 6, "resumed_from": 2}))
  return path


@pytest.mark.engine
@pytest.mark.parametrize("damage,named,kind", [
    (lambda run: (run / "segments" / "2").write_text("x"), "segments/2", "a file, where a segment directory"),
    (lambda run: (run / "records.jsonl").unlink() or (run / "records.jsonl").mkdir(), "records.jsonl",
     "a directory, not the file a run writes there"),
    (lambda run: shutil.rmtree(run / "segments" / "1") or (run / "segments" / "1").mkdir()
     or (run / "segments" / "1" / "segment.json").mkdir(), "segments/1/segment.json", "a directory, not the file"),
    (lambda run: os.mkfifo(run / "segments" / "1" / "records.jsonl"), "segments/1/records.jsonl", "a FIFO"),
    (lambda run: (run / "checkpoints").rmdir() or (run / "checkpoints").write_text("x"), "checkpoints",
     "a file, not the directory a run writes there"),
    (lambda run: (run / "segments" / "1" / "trace.json").symlink_to(run / "nowhere"), "segments/1/trace.json",
     "a link that leads nowhere"),
], ids=["segment-a-file", "records-a-directory", "segment-json-a-directory", "records-a-fifo",
        "checkpoints-a-file", "trace-a-dangling-link"])
def test_a_path_a_resume_reads_that_is_not_of_its_kind_is_refused_naming_it(damage, named, kind, tmp_path):
  run = _hand_made_run(tmp_path / "run")
  run_dir.check_layout(run, flag="--resume")  # the negative control: the run as a run leaves it passes
  damage(run)
  with pytest.raises(run_dir.RunDirError) as excinfo:
    run_dir.check_layout(run, flag="--resume")
  message = str(excinfo.value)
  assert f"{run / named} is {kind}" in message and "move it out of" in message, message


@pytest.mark.e2e
def test_a_resume_of_a_run_with_a_segment_that_is_a_file_is_refused_and_changes_nothing(finished, tmp_path, capsys):
  run = _copy(finished, tmp_path)
  (run / run_dir.SEGMENTS).mkdir()
  (run / run_dir.SEGMENTS / "1").write_text("not a segment")
  before = _files(run)
  err = _refused(["--resume", str(run), "--steps", "6"], capsys)
  assert f"{run / 'segments' / '1'} is a file, where a segment directory (resume 1) belongs" in err, err
  assert _files(run) == before


@pytest.mark.engine
def test_a_new_segment_is_numbered_past_any_entry_and_a_failed_mkdir_is_a_refusal(tmp_path):
  run = _hand_made_run(tmp_path / "run")
  (run / run_dir.SEGMENTS / "2").write_text("x")
  assert run_dir.new_segment(run, first_step=2, steps=6, resumed_from=2).index == 3
  (run / run_dir.SEGMENTS).chmod(0o500)
  try:
    if os.access(run / run_dir.SEGMENTS, os.W_OK):  # root writes anything: a file where the root is stands in
      shutil.rmtree(run / run_dir.SEGMENTS)
      (run / run_dir.SEGMENTS).write_text("x")
    with pytest.raises(run_dir.RunDirError, match="cannot create the new segment"):
      run_dir.new_segment(run, first_step=2, steps=8, resumed_from=2)
  finally:
    if (run / run_dir.SEGMENTS).is_dir():
      (run / run_dir.SEGMENTS).chmod(0o700)


# ---------------------------------------------------------------------------- no lock in what is not a run
@pytest.mark.e2e
@pytest.mark.parametrize("make", [
    lambda d: (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8})),
    lambda d: (d / "manifest.json").write_text("{}"),
    lambda d: None,
], ids=["a-model-checkpoint", "a-recording", "empty"])
def test_a_directory_that_holds_no_run_gets_no_lock_file(make, tmp_path):
  target = tmp_path / "not-a-run"
  target.mkdir()
  make(target)
  before = sorted(p.name for p in target.iterdir())
  with pytest.raises(run_dir.RunDirError, match=r"holds no run|is not a run config written by run_rl"):
    locks.lock_run(target, flag="--resume")
  assert sorted(p.name for p in target.iterdir()) == before
  # The negative control: a run's directory that has lost its lock file gets one while it is held, and it is
  # removed again on release (a refused resume leaves the directory as it found it).
  run = _hand_made_run(tmp_path / "run")
  with locks.lock_run(run, flag="--resume"):
    assert (run / run_dir.LOCK).is_file()
  assert not (run / run_dir.LOCK).exists()


@pytest.mark.e2e
def test_a_refused_resume_of_a_run_without_a_lock_file_leaves_none(tmp_path, capsys, monkeypatch):
  """A copied run (no lock file), refused at its resume (no checkpoint to continue from), is left as found. A
  process that opened the lock file just before its holder removed it takes the lock on the file there now,
  never on the removed one (which would let a third process lock the new file beside it)."""
  run = _hand_made_run(tmp_path / "run")
  before = sorted(p.name for p in run.iterdir())
  assert cli.main(["--resume", str(run)]) == 2
  assert sorted(p.name for p in run.iterdir()) == before
  held = locks.lock_run(run, flag="--resume")
  monkeypatch.setattr(locks, "_HELD", set())  # what follows is another process's
  real_flock, released = locks.fcntl.flock, []

  def flock_after_the_holder_lets_go(fd, operation):
    if not released:  # between this open and this flock, the holder releases (and removes its file)
      released.append(True)
      held.release()
    return real_flock(fd, operation)

  monkeypatch.setattr(locks.fcntl, "flock", flock_after_the_holder_lets_go)
  with locks.lock(run, flag="--resume") as taken:
    assert os.fstat(taken._fd).st_ino == os.stat(run / run_dir.LOCK).st_ino  # the file there, not the removed


@pytest.mark.e2e
def test_export_of_a_directory_that_holds_no_run_is_refused_with_nothing_written(tmp_path, capsys):
  target = tmp_path / "recording"
  target.mkdir()
  (target / "manifest.json").write_text("{}")
  code = cli.main(["export", str(target), "--out", str(tmp_path / "exported")])
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1 and "holds no run (config.json is missing)" in err, err
  assert sorted(p.name for p in tmp_path.rglob("*")) == ["manifest.json", "recording"]


# ---------------------------------------------------------------------------- what a new run writes into
@pytest.mark.engine
def test_a_directory_inside_out_the_run_cannot_write_is_refused_before_anything_is_written(tmp_path,
                                                                                          monkeypatch):
  out = tmp_path / "out"
  (out / "tensorboard").mkdir(parents=True)
  run_dir.check_new(out)  # the negative control: a writable tensorboard/ is the run's to write into
  access = os.access
  monkeypatch.setattr(run_dir.os, "access", lambda path, mode: Path(path).name != "tensorboard"
                      and access(path, mode))  # root can write anything: pretend tensorboard/ is read-only
  with pytest.raises(run_dir.RunDirError, match=r"tensorboard is not writable, and the run writes its tensorboard"):
    run_dir.check_new(out)
  monkeypatch.undo()
  (out / "tensorboard").rmdir()
  (out / "checkpoints").write_text("x")
  with pytest.raises(run_dir.RunDirError, match=r"checkpoints is a file, where the run writes its checkpoints"):
    run_dir.check_new(out)


@pytest.mark.e2e
def test_a_tensorboard_path_that_is_a_file_refuses_the_run_before_its_directory_is_claimed(tmp_path, capsys):
  out = tmp_path / "out"
  out.mkdir()
  (out / "tensorboard").write_text("someone's notes")
  err = _refused(BASE + ["steps=2", "--out", str(out)], capsys)
  assert f"{out / 'tensorboard'} is a file, where the run writes its tensorboard directory" in err, err
  assert sorted(p.name for p in out.iterdir()) == ["tensorboard"]


# ---------------------------------------------------------------------------- a claim a kill left behind
@pytest.mark.engine
def test_a_claim_a_killed_run_left_before_its_first_step_is_taken_over_and_anything_more_is_not(tmp_path, capsys):
  out = tmp_path / "out"
  out.mkdir()
  (out / run_dir.LOCK).write_text("{}")  # killed between taking the lock and writing its claim
  run_dir.check_new(out)
  (out / run_dir.CONFIG).write_text(json.dumps({"run_id": "killed", "config": {}}))
  (out / run_dir.CHECKPOINTS).mkdir()
  (out / "tensorboard").mkdir()  # killed in bring-up, after the claim: no record, no checkpoint
  run_dir.check_new(out)
  with locks.lock(out, flag="--out"):
    run_dir.claim_new(out, {"run_id": "new", "config": {}})
  assert "held only the claim of run killed" in capsys.readouterr().err
  assert run_dir.abandoned_claim(out) is not None  # the new claim too, until the run writes more
  assert run_dir.read_config(out)["run_id"] == "new"
  # The negative controls: a run that left anything more than its claim stays its own.
  for more in (lambda: (out / run_dir.RECORDS).write_text(""), lambda: (out / run_dir.CHECKPOINTS / "2").mkdir(),
               lambda: (out / run_dir.ERROR_LOG).write_text("boom"), lambda: (out / "notes.txt").write_text("x")):
    shutil.rmtree(out)
    out.mkdir()
    (out / run_dir.CONFIG).write_text(json.dumps({"run_id": "killed", "config": {}}))
    (out / run_dir.CHECKPOINTS).mkdir()
    more()
    with pytest.raises(run_dir.RunDirError, match="already holds a run"):
      run_dir.check_new(out)


# ---------------------------------------------------------------------------- the files orbax reads
def _copy_checkpoint(finished: Path, tmp_path: Path, step: int = 4) -> Path:
  path = tmp_path / "checkpoint"
  shutil.copytree(finished / "checkpoints" / str(step), path)
  return path


def _truncate(path: Path, size: int = 20) -> None:
  path.write_bytes(path.read_bytes()[:size])


@pytest.mark.e2e
@pytest.mark.parametrize("damage,problem", [
    (lambda c: _truncate(c / "state" / "_METADATA"), "damaged state/_METADATA (not JSON"),
    (lambda c: (c / "state" / "_METADATA").write_text('{"tree_metadata": {}}'), "lists no saved arrays"),
    (lambda c: _truncate(c / "_CHECKPOINT_METADATA"), "damaged _CHECKPOINT_METADATA (not JSON"),
    (lambda c: _truncate(c / "metadata" / "metadata"), "damaged metadata/metadata (not JSON"),
    (lambda c: (c / "state" / "_sharding").write_text("[]"), "damaged state/_sharding (a JSON list"),
    (lambda c: _truncate(c / "state" / "array_metadatas" / "process_0"), "damaged state/array_metadatas/process_0"),
    (lambda c: shutil.rmtree(c / "state"), "has no state/ directory"),
    (lambda c: (c / "state" / "manifest.ocdbt").unlink(), "lacks state/manifest.ocdbt"),
    (lambda c: [_truncate(p, 0) for p in (c / "state" / "d").iterdir()], "(it is empty)"),
    (lambda c: [shutil.rmtree(d) for d in c.glob("state/**/d")], "has no data files in state/"),
], ids=["metadata-truncated", "metadata-no-arrays", "checkpoint-metadata", "run-metadata", "sharding", "arrays",
        "no-state", "no-manifest", "empty-data", "no-data"])
def test_a_damaged_file_orbax_reads_is_named(damage, problem, finished, tmp_path):
  checkpoint = _copy_checkpoint(finished, tmp_path)
  assert checkpoint_check.files_problem(checkpoint) is None  # the negative control: as the run wrote it
  damage(checkpoint)
  found = checkpoint_check.files_problem(checkpoint)
  assert found is not None and problem in found, found


@pytest.mark.e2e
def test_a_truncated_orbax_metadata_is_refused_naming_the_intact_checkpoint_and_nothing_changes(finished, tmp_path,
                                                                                               capsys):
  run = _copy(finished, tmp_path)
  _truncate(run / "checkpoints" / "4" / "state" / "_METADATA")
  before = _files(run)
  err = _refused(["--resume", str(run), "--steps", "6"], capsys)
  assert "checkpoint 4" in err and "damaged state/_METADATA" in err, err
  assert f"`run_rl --resume {run} --from-checkpoint 2`" in err, err
  assert _files(run) == before and not (run / run_dir.SEGMENTS).exists()


def _discard_late_output_of_earlier_tests(capsys) -> None:
  """An earlier test's failed restore can leave orbax reads whose errors asyncio logs when they are collected,
  through a handler whose stream an earlier capture closed: collect them now, and drop that output, which is
  not the calling test's."""
  gc.collect()
  capsys.readouterr()


@pytest.mark.e2e
@pytest.mark.parametrize("from_checkpoint", [None, 2], ids=["latest", "earlier"])
def test_a_checkpoint_that_fails_to_restore_leaves_the_run_as_it_was(from_checkpoint, finished, tmp_path, capsys):
  """Damage no check reads (the saved arrays' bytes) fails the restore: one line naming the checkpoint and the
  one to try instead; the run's view and its checkpoints as they were (those moved aside moved back)."""
  _discard_late_output_of_earlier_tests(capsys)
  run = _copy(finished, tmp_path)
  step = from_checkpoint or 4
  for data in (run / "checkpoints" / str(step) / "state").glob("**/d/*"):
    data.write_bytes(bytes(data.stat().st_size))
  before = _files(run)
  argv = ["--resume", str(run), "--steps", "6", *([f"--from-checkpoint={from_checkpoint}"] if from_checkpoint else [])]
  assert cli.main(argv) == 1
  lines = capsys.readouterr().err.strip().splitlines()
  assert lines[-1].startswith(f"run_rl: error: the resume could not restore checkpoint {step}"), lines
  assert "Traceback" not in "\n".join(lines) and "the run is as it was" in lines[-1]
  assert (f"`run_rl --resume {run} --from-checkpoint 2`" in lines[-1]) == (step == 4)
  after = _files(run)
  assert {k: after[k] for k in before} == before  # checkpoint 4 moved back, every file as it was
  assert run_dir.latest_segment(run) == run and not (run / "segments" / "1" / run_dir.SEGMENT).exists()
  assert (run / "segments" / "1" / run_dir.ERROR_LOG).exists()


@pytest.mark.e2e
def test_a_trainer_without_the_checkpoint_is_named_in_one_line_and_the_run_is_as_it_was(finished, tmp_path, capsys,
                                                                                       monkeypatch):
  """As a remote trainer answers NOT_FOUND (the client raises ``NoCheckpointError``): the driver's one line
  names it; nothing of the run changes."""
  from orchestrator.contract import NoCheckpointError
  from orchestrator.loop.trainer_worker import TrainerWorker

  def not_there(self, step=None):
    raise NoCheckpointError(f"the trainer at 127.0.0.1:1 has no such checkpoint (restore_checkpoint: NOT_FOUND):"
                            f" no checkpoint of step {step} in /elsewhere (it holds none)")

  _discard_late_output_of_earlier_tests(capsys)
  run = _copy(finished, tmp_path)
  before = _files(run)
  monkeypatch.setattr(TrainerWorker, "restore_checkpoint", not_there)
  assert cli.main(["--resume", str(run), "--steps", "6"]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert "NoCheckpointError: the trainer at 127.0.0.1:1 has no such checkpoint (restore_checkpoint: NOT_FOUND)" in (
      err[-1]) and "Traceback" not in "\n".join(err), err
  after = _files(run)
  assert {k: after[k] for k in before} == before and run_dir.latest_segment(run) == run


@pytest.mark.e2e
def test_a_fifo_for_a_checkpoints_metadata_is_refused_naming_it_and_never_read(finished, tmp_path, capsys):
  run = _copy(finished, tmp_path)
  checkpoint = run / "checkpoints" / "4"
  assert checkpoint_check.files_problem(checkpoint) is None  # the negative control: as the run wrote it
  (checkpoint / "metadata" / "metadata").unlink()
  os.mkfifo(checkpoint / "metadata" / "metadata")  # a read of it would block until a writer came
  err = _refused(["--resume", str(run), "--steps", "6"], capsys)
  assert "checkpoint 4" in err and "damaged metadata/metadata (is a FIFO (named pipe)" in err, err
  assert "--from-checkpoint 2" in err


@pytest.mark.e2e
def test_a_resume_of_a_claim_a_kill_left_says_the_same_out_can_start_again(finished, tmp_path, capsys):
  claim = tmp_path / "claim"
  claim.mkdir()
  shutil.copy(finished / run_dir.CONFIG, claim / run_dir.CONFIG)
  err = _refused(["--resume", str(claim)], capsys)
  assert f"start it again with the same --out {claim}" in err, err
  (claim / run_dir.RECORDS).write_text("")  # the negative control: a run that recorded keeps its directory
  err = _refused(["--resume", str(claim)], capsys)
  assert "start it again with a new --out" in err, err

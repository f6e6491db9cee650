"""``run_rl export``: which checkpoint it reads, what it refuses, and that ``--out`` never holds half an export.

One short real run per module (checkpoints after steps 2 and 3: the cadence's,
then the completed run's last) is shared by the tests that only read it; a test
that damages it copies it first.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.app import cli, export as export_lib, new_directory
from orchestrator.run_files import checkpoint_state

RUN = ["model=tiny", "rollouts.source=synthetic", "batch.micro_batches_per_step=1", "batch.rows=4",
       "run.reserve_host_core=false"]


@pytest.fixture(autouse=True)
def _no_switches(monkeypatch):
  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A completed 3-step run with checkpoint.every=2: checkpoints 2 (the cadence's) and 3 (its last step's)."""
  run = tmp_path_factory.mktemp("finished") / "run"
  with pytest.MonkeyPatch.context() as env:  # module scope: the autouse fixture does not cover it
    for name in recipe_lib.ENV_SWITCHES:
      env.delenv(name, raising=False)
    assert cli.main(RUN + ["steps=3", "checkpoint.every=2", "--out", str(run)]) == 0
  return run


def _copy(run: Path, tmp_path: Path) -> Path:
  copy = tmp_path / "run"
  shutil.copytree(run, copy)
  return copy


def _export(capsys, *argv) -> tuple[int, str]:
  capsys.readouterr()
  code = cli.main(["export", *map(str, argv)])
  return code, capsys.readouterr().err


def _one_line_refusal(code: int, err: str) -> str:
  assert code == 2 and "Traceback" not in err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("run_rl export: error: "), err
  return lines[0]


def _nothing_at(out: Path) -> bool:
  """``out`` does not exist, nor any partial sibling of it."""
  return not out.exists() and not list(out.parent.glob(f".{out.name}.*"))


@pytest.mark.e2e
def test_a_completed_run_exports_its_last_step_and_leaves_no_partial_directory(finished, tmp_path, capsys):
  code, err = _export(capsys, finished, "--out", tmp_path / "out")
  assert code == 0, err
  written = json.loads((tmp_path / "out" / "export.json").read_text())
  assert written["step"] == 3 and written["checkpoint"].endswith("checkpoints/3")
  assert [p.name for p in tmp_path.iterdir()] == ["out"]  # renamed into place: no hidden sibling left


# ------------------------------------------------------------------ a damaged checkpoint
def _data_files(checkpoint: Path) -> list[Path]:
  return [p for p in (checkpoint / "state").glob("ocdbt.process_*/d/*") if p.is_file()]


def _truncate(path: Path, size: int) -> None:
  with path.open("r+b") as f:
    f.truncate(size)


DAMAGE = {
    "metadata_truncated": (lambda c: _truncate(c / "state" / "_METADATA", 100), "_METADATA is not the array list"),
    "state_removed": (lambda c: shutil.rmtree(c / "state"), "has no state/ directory"),
    "data_files_missing": (lambda c: [p.unlink() for p in _data_files(c)], "is missing"),
    "data_files_cut_short": (lambda c: [_truncate(p, 10) for p in _data_files(c)], "cut short of the"),
    "data_file_a_fifo": (lambda c: [(p.unlink(), os.mkfifo(p)) for p in _data_files(c)], "is a FIFO"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("kind", DAMAGE)
def test_each_kind_of_damage_to_a_checkpoint_s_state_is_named(kind, finished, tmp_path):
  run = _copy(finished, tmp_path)
  assert checkpoint_state.params_problem(run / "checkpoints" / "3") is None  # negative control: intact
  damage, said = DAMAGE[kind]
  damage(run / "checkpoints" / "3")
  problem = checkpoint_state.params_problem(run / "checkpoints" / "3")
  assert problem is not None and said in problem and "\n" not in problem
  assert checkpoint_state.params_problem(run / "checkpoints" / "2") is None


@pytest.mark.e2e
def test_a_damaged_newest_checkpoint_is_passed_over_by_name_or_refused_when_named(finished, tmp_path, capsys):
  run = _copy(finished, tmp_path)
  DAMAGE["data_files_missing"][0](run / "checkpoints" / "3")

  code, err = _export(capsys, run, "--checkpoint", 3, "--out", tmp_path / "named")
  line = _one_line_refusal(code, err)
  assert f"checkpoint {run.absolute() / 'checkpoints' / '3'} has a damaged state" in line and "is missing" in line
  assert f"`run_rl export {run} --checkpoint 2 --out {tmp_path / 'named'}`" in line
  assert _nothing_at(tmp_path / "named")

  code, err = _export(capsys, run, "--out", tmp_path / "newest")
  assert code == 0 and "passing over damaged checkpoint(s)" in err and "3 has a damaged state" in err
  assert json.loads((tmp_path / "newest" / "export.json").read_text())["step"] == 2


# ------------------------------------------------------------------ a failed write
@pytest.mark.e2e
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device whose writes fail ENOSPC)")
def test_a_full_disk_is_one_line_and_leaves_nothing_at_out(finished, tmp_path, capsys, monkeypatch):
  """The weights are written while ``out`` does not exist yet (into a hidden sibling), so a write that fails
  as a full disk does (safetensors' own error, not an OSError) leaves nothing there."""
  import safetensors.numpy  # import here: the module export writes with, pointed at a full device

  out, real = tmp_path / "out", safetensors.numpy.save_file
  seen = []

  def full(tensors, filename, metadata=None):
    seen.append((Path(filename).parent.name, out.exists()))
    real(tensors, "/dev/full", metadata)

  monkeypatch.setattr(safetensors.numpy, "save_file", full)
  line = _one_line_refusal(*_export(capsys, finished, "--out", out))
  assert f"writing {out / 'model.safetensors'} failed" in line and "No space left on device" in line
  assert len(seen) == 1 and seen[0][0].startswith(".out.") and seen[0][1] is False
  assert _nothing_at(out) and list(tmp_path.iterdir()) == []


@pytest.mark.e2e
def test_missing_parents_of_out_are_made_and_removed_again_when_the_write_fails(finished, tmp_path, capsys,
                                                                               monkeypatch):
  """``--out exported/my-model`` (the README's) works where ``exported/`` does not exist yet; a failed write
  removes the parents it made along with the partial export (the negative control of the first half)."""
  out = tmp_path / "exported" / "my-model"
  code, _ = _export(capsys, finished, "--out", out)
  assert code == 0 and (out / "export.json").is_file()

  def read_only(src, dst):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), src, None, dst)

  monkeypatch.setattr(export_lib.os, "rename", read_only)
  failed = tmp_path / "elsewhere" / "deeper" / "my-model"
  _one_line_refusal(*_export(capsys, finished, "--out", failed))
  assert not (tmp_path / "elsewhere").exists()


@pytest.mark.e2e
def test_a_failed_rename_into_place_removes_the_partial_export(finished, tmp_path, capsys, monkeypatch):
  def read_only(src, dst):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), src, None, dst)

  monkeypatch.setattr(export_lib.os, "rename", read_only)
  out = tmp_path / "out"
  line = _one_line_refusal(*_export(capsys, finished, "--out", out))
  assert "Read-only file system" in line and _nothing_at(out)


@pytest.mark.e2e
def test_a_killed_export_s_partial_folder_is_removed_by_the_next_export_of_that_out(finished, tmp_path, capsys,
                                                                                   monkeypatch):
  """SIGKILL leaves the hidden partial folder: the next export of that --out removes it, with a note; one a live
  export holds (its lock) is left alone, as is another --out's. SIGTERM during the write removes its own."""
  out = tmp_path / "out"
  killed = tmp_path / ".out.0a1b2c3d.partial"
  killed.mkdir()
  (killed / "model.safetensors").write_bytes(b"half")
  other = tmp_path / ".elsewhere.0a1b2c3d.partial"
  other.mkdir()
  live, held = new_directory.make_partial(out)  # a concurrent export's, still being written
  try:
    code, err = _export(capsys, finished, "--out", out)
    assert code == 0, err
    assert f"removed {killed}, the partial folder of an export to {out} that was killed before it finished" in err
    assert not killed.exists() and live.is_dir() and other.is_dir()
  finally:
    os.close(held)

  def terminated(*args, **kwargs):  # SIGTERM arrives while the weights are written
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1)

  monkeypatch.setattr("safetensors.numpy.save_file", terminated)
  code, err = _export(capsys, finished, "--out", tmp_path / "second")
  assert code == 143 and "stopped by SIGTERM; nothing is at --out" in err and _nothing_at(tmp_path / "second")


# ------------------------------------------------------------------ a run that ended on a non-finite step
@pytest.mark.e2e
def test_a_diverged_run_is_refused_naming_the_step_and_the_checkpoint_before_it(finished, tmp_path, capsys):
  run = _copy(finished, tmp_path)
  summary = json.loads((run / "summary.json").read_text())
  (run / "summary.json").write_text(json.dumps(dict(summary, ended="error", last_step=3, non_finite_step=3)))

  line = _one_line_refusal(*_export(capsys, run, "--out", tmp_path / "out"))
  assert "the run ended at step 3, whose loss or gradient norm was not finite" in line
  assert f"`run_rl export {run} --checkpoint 2 --out {tmp_path / 'out'}`" in line
  line = _one_line_refusal(*_export(capsys, run, "--checkpoint", 3, "--out", tmp_path / "out"))
  assert line.startswith("run_rl export: error: --checkpoint 3: the run ended at step 3")
  assert _nothing_at(tmp_path / "out")

  code, err = _export(capsys, run, "--checkpoint", 2, "--out", tmp_path / "out")
  assert code == 0 and "warning: the run ended at step 3, whose loss" in err
  assert f"({run / 'summary.json'} says so); checkpoint 2 was written before it" in err
  assert json.loads((tmp_path / "out" / "export.json").read_text())["step"] == 2


@pytest.mark.e2e
def test_a_run_that_diverged_at_its_second_step_has_no_weights_to_export(tmp_path, capsys):
  """Its one checkpoint (after step 0) holds the weights step 1 diverged from."""
  run = tmp_path / "run"
  assert cli.main(RUN + ["steps=3", "checkpoint.every=1", "engine.learning_rate=1e30", "--out", str(run)]) == 1
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1"]
  line = _one_line_refusal(*_export(capsys, run, "--out", tmp_path / "out"))
  assert "the run ended at step 1" in line and "holds no intact checkpoint before it" in line
  assert _nothing_at(tmp_path / "out")


@pytest.mark.spec
def test_weights_that_are_not_finite_are_refused():
  class Candidates:
    def earlier(self, step):
      return f"export checkpoint {step - 1}"

  source = {"step": 3, "checkpoint_path": "ckpt/3", "candidates": Candidates()}
  params = {"layers": {"w": np.ones((2, 2), np.float32)}}
  export_lib._check_finite(params, source)  # negative control: finite weights pass
  params["layers"]["w"][0, 1] = np.inf
  with pytest.raises(export_lib.ExportError, match=r"layers\.w: 1 of 4 values are NaN or infinite.*checkpoint 2"):
    export_lib._check_finite(params, source)


# ------------------------------------------------------------------ not a run
@pytest.mark.spec
def test_a_directory_that_holds_no_run_is_refused_and_left_as_it_was(tmp_path, capsys):
  (tmp_path / "notes.txt").write_text("mine")
  line = _one_line_refusal(*_export(capsys, tmp_path, "--out", tmp_path.parent / f"{tmp_path.name}-out"))
  assert "holds no run (config.json is missing)" in line
  assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]  # no run.lock left in it

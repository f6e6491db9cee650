"""The accelerator checks' driver (``bench.tpu``): each check in a process of its own, its output kept even when
its time runs out, the figures docs/benchmarks.md quotes read from the run's directory, one JSON, an output
directory that already holds files refused, and a check that replays a recording refused unless the check
writing it runs before it."""

from __future__ import annotations

import json

import pytest

from orchestrator.bench import tpu

@pytest.mark.spec
def test_figures_come_from_the_runs_summary_and_records(tmp_path):
  (tmp_path / "summary.json").write_text(json.dumps({"steps": 2, "median_step_s": 3.3, "peak_device_bytes": 7,
                                                     "median_mfu": 0.4, "unrelated": 1}))
  (tmp_path / "records.jsonl").write_text("\n".join(json.dumps(r) for r in [
      {"step_s": 9.0, "weight_sync_s": 0.5, "compiles": 4}, {"step_s": 3.0, "weight_sync_s": 0.25, "compiles": 0}]))
  got = tpu.figures(tmp_path)
  assert got["steps"] == 2 and got["peak_device_bytes"] == 7 and got["median_mfu"] == 0.4
  assert "unrelated" not in got
  assert got["median_weight_sync_s"] == 0.375 and got["compiles_by_step"] == [4, 0] and got["first_step_s"] == 9.0
  assert tpu.figures(tmp_path / "missing") == {}


@pytest.mark.e2e
def test_a_check_cut_short_keeps_what_it_printed_and_reports_the_time_out(tmp_path, monkeypatch):
  monkeypatch.setattr(tpu, "CHECKS", {
      "quick": (["-c", "print('done', flush=True)"], 1.0),
      "slow": (["-c", "import time; print('started', flush=True); time.sleep(60)"], 1.0),
      "extended": (["-c", "raise SystemExit('an extended check runs only with --all or by name')"], 1.0)})
  monkeypatch.setattr(tpu, "DEFAULT_CHECKS", ("quick", "slow"))
  out = tmp_path / "out"
  assert tpu.main(["--out", str(out), "--minutes", "0.35"]) == 1  # a check that did not exit 0 fails the run
  result = json.loads((out / "tpu.json").read_text())["checks"]
  assert result["quick"]["exit_code"] == 0 and result["quick"]["tail"] == ["done"]
  assert result["slow"]["timed_out"] and result["slow"]["exit_code"] is None
  assert (out / "slow.log").read_text() == "started\n"
  assert "extended" not in result  # not a default check


@pytest.mark.spec
def test_the_default_checks_are_checks_and_the_extended_ones_are_named_or_all(tmp_path, capsys):
  assert set(tpu.DEFAULT_CHECKS) < set(tpu.CHECKS)
  assert {"moe24_compile", "moe24_rig", "live_saving", "tunix_grpo"}.isdisjoint(tpu.DEFAULT_CHECKS)
  with pytest.raises(SystemExit) as exit_info:
    tpu.main(["--all", "--only", "default", "--out", str(tmp_path / "out")])
  assert exit_info.value.code == 2 and "give one of them" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.spec
def test_an_output_directory_that_holds_files_is_refused(tmp_path, capsys):
  (tmp_path / "kept.txt").write_text("someone's")
  with pytest.raises(SystemExit) as exit_info:
    tpu.main(["--out", str(tmp_path)])
  assert exit_info.value.code == 2 and "already holds files" in capsys.readouterr().err
  assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]


@pytest.mark.spec
def test_a_check_that_replays_a_recording_needs_the_check_that_writes_it_named_before_it(tmp_path, capsys):
  """A recording lives in the run's own directory, so a rig named without its record check (or after it) would
  fail minutes later on a missing manifest; it is refused before anything is written."""
  assert tpu.recording_writer("moe24_rows2_rig") == "moe24_rows2_record"
  assert tpu.recording_writer("moe24_rig") == "moe24_record" and tpu.recording_writer("default") is None
  for only in (["moe24_rows2_rig"], ["moe24_rows2_rig", "moe24_rows2_record"], ["moe24_record", "moe24_rows2_rig"]):
    with pytest.raises(SystemExit) as exit_info:
      tpu.main(["--only", *only, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "moe24_rows2_rig replays the recording moe24_rows2_record writes" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
  for name in tpu.CHECKS:  # every check that replays a recording has a check that writes it
    tpu.recording_writer(name)

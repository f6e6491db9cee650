"""The accelerator benchmark: a tiny run on CPU end to end, and its decisions from numbers built here.

The end-to-end run pins the policy (``--wait-threshold-s 0``: no wait is low,
so no staging turns itself off) and gives a budget far above what the run
needs, bounded by ``--max-tries 1`` and ``--max-steps 3``: nothing it checks
depends on how fast this machine is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.bench.accelerator import main
from orchestrator.bench.accelerator_plan import (Size, StopAfter, digest_verdict, format_table, mode_row, next_size,
                                                 steps_per_arm)
from orchestrator.loop.recorder import BoundaryRecord
from policies import Mode, StepBoundaryPolicy
from tests.conftest import REPO

MODES = ["off", "pipelined", "stage_after_update", "stage_before_update"]


@pytest.mark.e2e
def test_a_tiny_run_on_cpu_prints_the_table_writes_the_json_and_trains_every_mode_alike(tmp_path):
  out = tmp_path / "bench.json"
  env = dict(os.environ, PYTHONPATH=str(REPO), PJRT_NPROC="1", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  proc = subprocess.run(
      [sys.executable, "-m", "orchestrator.bench.accelerator", "--minutes", "5", "--preset", "tiny",
       "--max-tries", "1", "--max-steps", "3", "--wait-threshold-s", "0", "--out", str(out)],
      capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("devices: cpu x1 used of 1")
  header = next(line for line in lines if line.startswith("mode "))
  for column in ("step_s", "idle_ms", "strict_ms", "map_ms", "copy_ms", "staged_MB/dev", "mem_GB", "digest"):
    assert column in header
  assert [line.split()[0] for line in lines if line.split() and line.split()[0] in MODES] == MODES
  assert "digests: identical" in proc.stdout

  report = json.loads(out.read_text())
  rows = report["modes"]
  assert [r["mode"] for r in rows] == MODES
  assert all(r["steps"] == 3 and not r["cut_short"] for r in rows)
  assert len({r["final_state_digest"] for r in rows}) == 1 and report["identical"] and report["exit_status"] == 0
  assert set(report["digests"]) == set(MODES)
  for r in rows:  # pinned: every boundary of a staged mode staged, and its input was timed
    assert r["staged_boundaries"] == (r["boundaries"] if Mode(r["mode"]).staged else 0)
    assert r["inputs_timed"] == 3 * 3 and r["median_placement_s"] is not None
  assert report["devices"]["platform"] == "cpu" and len(report["sizing"]["tries"]) == 1
  assert report["input_copy"]["bytes"] > 0 and report["plan"]["steps_per_arm"] == 3
  assert report["printed"] == lines  # everything printed is in the JSON


# ---------------------------------------------------------------- sizing
TINY = Size("tiny", num_layers=2, rows=4, tokens_per_row=64)


@pytest.mark.engine
def test_a_micro_batch_in_the_window_keeps_its_size():
  assert next_size(TINY, 0.5, 0.5, devices=1, max_tokens_per_device=1 << 17) is None
  assert next_size(TINY, 0.31, 0.5, devices=1, max_tokens_per_device=1 << 17) is None
  assert next_size(TINY, 0.99, 0.5, devices=1, max_tokens_per_device=1 << 17) is None


@pytest.mark.engine
def test_a_fast_micro_batch_grows_the_rows_first():
  assert next_size(TINY, 0.0625, 0.5, devices=1, max_tokens_per_device=1 << 17) == Size("tiny", 2, 32, 64)


@pytest.mark.engine
def test_past_the_token_cap_the_layers_grow_by_the_rest():
  # 8x is wanted; rows may only double (512 tokens per device), so the layers take the other 4x.
  assert next_size(TINY, 0.0625, 0.5, devices=1, max_tokens_per_device=512) == Size("tiny", 8, 8, 64)


@pytest.mark.engine
def test_one_try_grows_by_at_most_64x():
  assert next_size(TINY, 1e-6, 0.5, devices=1, max_tokens_per_device=1 << 30) == Size("tiny", 2, 256, 64)


@pytest.mark.engine
def test_device_memory_bounds_the_growth():
  # 8x wanted, but the peak already holds a tenth of the limit: at most 0.6 / 0.1 = 6x.
  grown = next_size(TINY, 0.0625, 0.5, devices=1, max_tokens_per_device=1 << 17, memory=(100, 1000))
  assert grown == Size("tiny", 2, 24, 64)
  assert next_size(TINY, 0.0625, 0.5, devices=1, max_tokens_per_device=1 << 17, memory=(700, 1000)) is None


@pytest.mark.engine
def test_rows_stay_a_multiple_of_the_devices():
  size = Size("small", 4, rows=8, tokens_per_row=256)
  assert next_size(size, 0.1, 0.5, devices=8, max_tokens_per_device=1 << 17) == Size("small", 4, 40, 256)


@pytest.mark.engine
def test_a_slow_micro_batch_shrinks_the_rows_then_the_layers():
  assert next_size(Size("small", 4, 8, 256), 2.0, 0.5, devices=1, max_tokens_per_device=1 << 17) == \
      Size("small", 4, 2, 256)
  assert next_size(Size("small", 4, 1, 256), 2.0, 0.5, devices=1, max_tokens_per_device=1 << 17) == \
      Size("small", 1, 1, 256)


@pytest.mark.engine
def test_steps_per_arm_fit_the_time_left_within_bounds():
  fit = steps_per_arm(100.0, step_s=1.0, arm_overhead_s=1.0, generate_step_s=0.1, arms=4, max_steps=200)
  assert fit == int((100 - 4) / (0.1 + 4 * 1.1))
  assert steps_per_arm(1.0, step_s=1.0, arm_overhead_s=1.0, generate_step_s=0.0, arms=4, max_steps=200) == 2
  assert steps_per_arm(1e6, step_s=1.0, arm_overhead_s=0.0, generate_step_s=0.0, arms=4, max_steps=30) == 30


@pytest.mark.engine
def test_an_arm_past_its_time_stops_but_not_before_its_first_boundary():
  now = [10.0]
  stop = StopAfter(5.0, lambda: now[0])
  assert [stop(), stop(), stop()] == [False, True, True]  # boundary 0 is never the last: two steps at least
  stop = StopAfter(50.0, lambda: now[0])
  assert [stop(), stop(), stop()] == [False, False, False]


# ---------------------------------------------------------------- rows, verdict
def _records(mode: Mode, steps: int, **extra) -> tuple[list, object]:
  policy = StepBoundaryPolicy(mode, wait_threshold_s=0.0)
  records = []
  for step in range(steps):
    last = step == steps - 1
    plan = policy.plan(step) if not last else None
    staged = bool(plan and plan.stage)
    record = BoundaryRecord(
        step=step, mode=mode.value, staged=staged, stage_before_update=bool(plan and plan.stage_before_update),
        probe=False, reason="", actions=[], stage_s=0.002 if staged else None, device_wait_s=0.4 if staged else None,
        low_wait=False if staged else None, transition=None, update_s=0.01,
        boundary_idle_s=None if last else 0.001 * step, boundary_idle_strict_s=None if last else 0.002 * step,
        step_s=1.0 + step, micro_batch_s=[0.5, 0.5], metrics_s=None, metrics_wait_s=None, checkpoint_s=None,
        checkpoint_path=None, weight_sync_s=None, staged_digest=None, loss=1.0, grad_norm=1.0, tokens=10, reruns=0,
        rerun_micro_batches=None, dropped_tokens=None, t_update_ready=float(step), t_next_first_dispatch=None)
    for name, value in extra.items():  # fields another change adds to the record
      setattr(record, name, value)
    records.append(record)
  return records, policy.report()


INPUTS = {"mapping_s": [0.001, 0.003, 0.002], "placement_s": [0.0005, 0.0005, 0.0007]}
COPY = {"bytes": 4000, "bytes_per_device": 1000}


@pytest.mark.engine
def test_a_row_reads_staged_bytes_and_memory_from_records_that_carry_them():
  records, report = _records(Mode.STAGE_BEFORE_UPDATE, 4, staged_bytes_per_device=2048,
                             device_bytes_in_use=5_000_000_000, device_bytes_limit=80_000_000_000)
  row = mode_row(Mode.STAGE_BEFORE_UPDATE, records, report, "d", INPUTS, {"bytes_in_use": 1}, steps_asked=4,
                 wall_s=9.0, input_copy=COPY)
  assert (row["staged_bytes_per_device"], row["staged_bytes_from"]) == (2048, "records")
  assert (row["device_bytes_in_use"], row["device_bytes_limit"], row["device_memory_from"]) == \
      (5_000_000_000, 80_000_000_000, "records")
  assert (row["staged_boundaries"], row["boundaries"], row["steps"], row["cut_short"]) == (3, 3, 4, False)
  assert row["median_step_s"] == 2.5 and row["median_boundary_idle_s"] == 0.001
  # The records hold these per device (lists in device order): the row takes the most on one device.
  records, report = _records(Mode.STAGE_BEFORE_UPDATE, 4, staged_bytes_per_device=[1024, 2048],
                             device_bytes_in_use=[5_000_000_000, None], device_bytes_limit=[80_000_000_000] * 2)
  row = mode_row(Mode.STAGE_BEFORE_UPDATE, records, report, "d", INPUTS, None, steps_asked=4, wall_s=9.0)
  assert (row["staged_bytes_per_device"], row["device_bytes_in_use"], row["device_bytes_limit"]) == \
      (2048, 5_000_000_000, 80_000_000_000)
  assert row["median_mapping_s"] == 0.002 and row["median_placement_s"] == 0.0005


@pytest.mark.engine
def test_without_those_fields_a_row_takes_the_input_shape_and_the_device_or_says_nothing():
  records, report = _records(Mode.STAGE_AFTER_UPDATE, 3)
  row = mode_row(Mode.STAGE_AFTER_UPDATE, records, report, "d", INPUTS,
                 {"bytes_in_use": 7, "bytes_limit": 9, "peak_bytes_in_use": 8}, steps_asked=3, wall_s=1.0,
                 input_copy=COPY)
  assert (row["staged_bytes_per_device"], row["staged_bytes_from"]) == (1000, "input shape")
  assert (row["device_bytes_in_use"], row["device_bytes_limit"], row["device_memory_from"]) == (7, 9, "device")
  records, report = _records(Mode.OFF, 3)
  row = mode_row(Mode.OFF, records, report, "d", INPUTS, None, steps_asked=3, wall_s=1.0, input_copy=COPY)
  assert row["staged_bytes_per_device"] is None and row["device_bytes_in_use"] is None
  assert "off" in format_table([row])[2] and " - " in format_table([row])[2]


def _row(mode: str, digest: str, steps: int = 5, asked: int = 5) -> dict:
  return {"mode": mode, "final_state_digest": digest, "steps": steps, "steps_asked": asked,
          "cut_short": steps < asked}


@pytest.mark.engine
def test_identical_digests_exit_0_and_a_differing_one_is_named_with_exit_1():
  line, status = digest_verdict([_row(m, "abc") for m in MODES])
  assert (line, status) == ("digests: identical (abc)", 0)
  line, status = digest_verdict([_row(m, "xyz" if m == "stage_after_update" else "abc") for m in MODES])
  assert status == 1 and "stage_after_update" in line and "pipelined" not in line


@pytest.mark.engine
def test_an_arm_cut_short_makes_the_digests_not_comparable():
  rows = [_row(m, "abc") for m in MODES[:3]] + [_row("stage_before_update", "zzz", steps=3)]
  line, status = digest_verdict(rows)
  assert status == 3 and "stage_before_update (3 of 5 steps)" in line


# ---------------------------------------------------------------- refusals, before anything starts
@pytest.mark.e2e
def test_bad_usage_is_refused_in_one_line_before_anything_runs(tmp_path, capsys):
  assert main(["--preset", "nope", "--out", str(tmp_path / "x.json")]) == 2
  assert "model.preset='nope' is not a preset" in capsys.readouterr().err
  assert main(["--preset", "tiny", "--out", str(tmp_path)]) == 2
  assert "is a directory" in capsys.readouterr().err
  assert main(["--preset", "tiny", "--wait-threshold-s", "soon", "--out", str(tmp_path / "x.json")]) == 2
  assert "--wait-threshold-s soon" in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_info:
    main(["--max-steps", "1"])
  assert exit_info.value.code == 2 and "a boundary lies between two steps" in capsys.readouterr().err
  assert not (tmp_path / "x.json").exists()

"""The accelerator benchmark's decisions, from numbers built here: sizes, steps, rows, the digests verdict."""

from __future__ import annotations

from orchestrator.bench.accelerator_plan import (Size, StopAfter, digest_verdict, format_table, mode_row, next_size,
                                                 steps_per_arm)
from orchestrator.loop.recorder import BoundaryRecord
from policies import Mode, StepBoundaryPolicy

MODES = ["off", "pipelined", "stage_after_update", "stage_before_update"]


# ---------------------------------------------------------------- sizing
TINY = Size("tiny", num_layers=2, rows=4, tokens_per_row=64)


def test_a_micro_batch_in_the_window_keeps_its_size():
  assert next_size(TINY, 0.5, 0.5, devices=1, max_tokens_per_device=1 << 17) is None
  assert next_size(TINY, 0.31, 0.5, devices=1, max_tokens_per_device=1 << 17) is None
  assert next_size(TINY, 0.99, 0.5, devices=1, max_tokens_per_device=1 << 17) is None


def test_a_fast_micro_batch_grows_the_rows_first():
  assert next_size(TINY, 0.0625, 0.5, devices=1, max_tokens_per_device=1 << 17) == Size("tiny", 2, 32, 64)


def test_past_the_token_cap_the_layers_grow_by_the_rest():
  # 8x is wanted; rows may only double (512 tokens per device), so the layers take the other 4x.
  assert next_size(TINY, 0.0625, 0.5, devices=1, max_tokens_per_device=512) == Size("tiny", 8, 8, 64)


def test_one_try_grows_by_at_most_64x():
  assert next_size(TINY, 1e-6, 0.5, devices=1, max_tokens_per_device=1 << 30) == Size("tiny", 2, 256, 64)


def test_device_memory_bounds_the_growth():
  # 8x wanted, but the peak already holds a tenth of the limit: at most 0.6 / 0.1 = 6x.
  grown = next_size(TINY, 0.0625, 0.5, devices=1, max_tokens_per_device=1 << 17, memory=(100, 1000))
  assert grown == Size("tiny", 2, 24, 64)
  assert next_size(TINY, 0.0625, 0.5, devices=1, max_tokens_per_device=1 << 17, memory=(700, 1000)) is None


def test_rows_stay_a_multiple_of_the_devices():
  size = Size("small", 4, rows=8, tokens_per_row=256)
  assert next_size(size, 0.1, 0.5, devices=8, max_tokens_per_device=1 << 17) == Size("small", 4, 40, 256)


def test_a_slow_micro_batch_shrinks_the_rows_then_the_layers():
  assert next_size(Size("small", 4, 8, 256), 2.0, 0.5, devices=1, max_tokens_per_device=1 << 17) == \
      Size("small", 4, 2, 256)
  assert next_size(Size("small", 4, 1, 256), 2.0, 0.5, devices=1, max_tokens_per_device=1 << 17) == \
      Size("small", 1, 1, 256)


def test_steps_per_arm_fit_the_time_left_within_bounds():
  fit = steps_per_arm(100.0, step_s=1.0, arm_overhead_s=1.0, generate_step_s=0.1, arms=4, max_steps=200)
  assert fit == int((100 - 4) / (0.1 + 4 * 1.1))
  assert steps_per_arm(1.0, step_s=1.0, arm_overhead_s=1.0, generate_step_s=0.0, arms=4, max_steps=200) == 2
  assert steps_per_arm(1e6, step_s=1.0, arm_overhead_s=0.0, generate_step_s=0.0, arms=4, max_steps=30) == 30


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
  assert row["median_mapping_s"] == 0.002 and row["median_placement_s"] == 0.0005


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


def test_identical_digests_exit_0_and_a_differing_one_is_named_with_exit_1():
  line, status = digest_verdict([_row(m, "abc") for m in MODES])
  assert (line, status) == ("digests: identical (abc)", 0)
  line, status = digest_verdict([_row(m, "xyz" if m == "stage_after_update" else "abc") for m in MODES])
  assert status == 1 and "stage_after_update" in line and "pipelined" not in line


def test_an_arm_cut_short_makes_the_digests_not_comparable():
  rows = [_row(m, "abc") for m in MODES[:3]] + [_row("stage_before_update", "zzz", steps=3)]
  line, status = digest_verdict(rows)
  assert status == 3 and "stage_before_update (3 of 5 steps)" in line


"""The boundary benchmark's medians, from records built here: what a run's speed decides is an input."""

from __future__ import annotations

import pytest

from orchestrator.bench.boundary import mode_row
from orchestrator.loop.recorder import BoundaryRecord
from policies import Mode, StepBoundaryPolicy

pytestmark = pytest.mark.spec

LOW_WAIT_S = 1e-5  # below the pinned threshold: the stage outlasted the compute
HIGH_WAIT_S = 0.5


def _record(step: int, plan, stage_s: float | None, last: bool = False) -> BoundaryRecord:
  return BoundaryRecord(
      step=step, mode=plan.mode.value, staged=plan.stage, stage_before_update=plan.stage_before_update,
      probe=plan.probe, reason=plan.reason, actions=[], stage_s=stage_s, device_wait_s=None, low_wait=None,
      transition=None, update_s=0.01, boundary_idle_s=None if last else 0.001 * step,
      boundary_idle_strict_s=None if last else 0.002 * step, step_s=0.1 + step, micro_batch_s=[0.05, 0.05],
      metrics_s=None, metrics_wait_s=None, checkpoint_s=None, checkpoint_path=None, weight_sync_s=None,
      staged_digest=None, loss=1.0, grad_norm=1.0, tokens=10, reruns=0, rerun_micro_batches=None,
      dropped_tokens=None, t_update_ready=float(step), t_next_first_dispatch=None)


def _run(waits: list[float], steps: int):
  """A STAGE_BEFORE_UPDATE run of ``steps`` steps whose staged boundaries waited ``waits`` in turn."""
  policy = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, wait_threshold_s=0.002, disable_after=2)
  records, waits = [], list(waits)
  for step in range(steps - 1):
    plan = policy.plan(step)
    stage_s = 0.001 * (step + 1) if plan.stage else None
    records.append(_record(step, plan, stage_s))
    if plan.stage:
      policy.observe(step, stage_s=stage_s, device_wait_s=waits.pop(0))
  records.append(_record(steps - 1, policy.plan(steps - 1), None, last=True))
  return records, policy.report()


def test_a_mode_whose_staging_turned_off_takes_the_stage_median_over_the_staged_boundaries():
  records, report = _run([LOW_WAIT_S, LOW_WAIT_S], steps=6)
  assert [r.staged for r in records[:-1]] == [True, True, False, False, False]  # the inputs as meant
  row = mode_row(Mode.STAGE_BEFORE_UPDATE, records, report, "digest")
  assert row["median_stage_s"] == 0.0015  # of 1 ms and 2 ms; the three unstaged boundaries have none
  assert (row["boundaries"], row["staged_boundaries"], row["auto_disables"]) == (5, 2, 1)
  assert row["final_mode"] == "pipelined"
  note = row["staging_note"]
  assert "2 of 5 boundaries staged" in note and "auto-disables: 1" in note and "--disable-after" in note
  assert row["median_boundary_idle_s"] == 0.002 and row["median_step_s"] == 2.6


def test_a_mode_that_staged_every_boundary_has_no_note():
  """Negative control: high waits keep staging on, and the row says nothing about it."""
  records, report = _run([HIGH_WAIT_S] * 4, steps=5)
  row = mode_row(Mode.STAGE_BEFORE_UPDATE, records, report, "digest")
  assert (row["boundaries"], row["staged_boundaries"], row["auto_disables"]) == (4, 4, 0)
  assert row["median_stage_s"] == 0.0025 and row["staging_note"] is None


def test_an_unstaged_mode_has_no_stage_median_and_no_note():
  policy = StepBoundaryPolicy(Mode.PIPELINED)
  records = [_record(step, policy.plan(step), None, last=step == 2) for step in range(3)]
  row = mode_row(Mode.PIPELINED, records, policy.report(), "digest")
  assert row["median_stage_s"] is None and row["staged_boundaries"] == 0 and row["staging_note"] is None

"""The rig report's mode comparisons: pooled over each mode's arms, faulted arms left out (JAX-free)."""

from __future__ import annotations

import pytest

from orchestrator.rig.report import _comparisons_markdown, comparisons


def _arm(mode, step_s, idle_s, *, fault=None, name=None):
  records = [{"step_s": s, "boundary_idle_s": i} for s, i in zip(step_s, idle_s)]
  return {"name": name or mode, "mode": mode, "fault": fault, "records": records}


@pytest.mark.spec
def test_staging_before_the_update_is_compared_with_off_and_pipelined_over_pooled_steps():
  arms = [_arm("off", [9.0, 1.10, 1.11, 1.12], [0.10, 0.11, 0.12, 0.0]),
          _arm("stage_before_update", [9.0, 1.00, 1.01, 1.02], [0.00, 0.01, 0.00, 0.0]),
          _arm("off", [9.0, 1.12, 1.10, 1.11], [0.11, 0.10, 0.12, 0.0], name="off#2"),
          _arm("stage_before_update", [9.0, 1.01, 1.00, 1.02], [0.01, 0.00, 0.00, 0.0], name="stage_before_update#2"),
          _arm("pipelined", [9.0, 1.05, 1.06, 1.04], [0.05, 0.06, 0.05, 0.0])]
  rows = {(r["mode"], r["against"]): r for r in comparisons(arms)}
  assert set(rows) == {("stage_before_update", "off"), ("stage_before_update", "pipelined"), ("pipelined", "off")}
  before_off = rows[("stage_before_update", "off")]
  assert before_off["arms"] == [2, 2] and before_off["steps"] == [6, 6]  # each arm's first step left out
  step = before_off["step_saving_s"]
  assert step["mean"] == pytest.approx(0.10, abs=1e-9) and 0 < step["low"] < step["mean"] < step["high"]
  assert before_off["step_saving_share"]["mean"] == pytest.approx(0.10 / 1.11, rel=1e-6)
  # Boundary idle over each arm's boundaries (its last record has none after it).
  assert before_off["boundary_idle_saving_s"]["mean"] == pytest.approx(0.11 - 0.02 / 6, abs=1e-9)
  assert rows[("stage_before_update", "pipelined")]["step_saving_s"]["mean"] == pytest.approx(0.04, abs=1e-9)
  assert rows[("pipelined", "off")]["step_saving_s"]["low"] > 0
  # Negative control: OFF's arms labelled as staged make the saving a cost, its whole interval below zero.
  swapped = [dict(a, mode={"off": "stage_before_update", "stage_before_update": "off"}.get(a["mode"], a["mode"]))
             for a in arms]
  cost = next(r for r in comparisons(swapped) if (r["mode"], r["against"]) == ("stage_before_update", "off"))
  assert cost["step_saving_s"]["high"] < 0 and cost["step_saving_s"]["mean"] == pytest.approx(-0.10, abs=1e-9)
  markdown = "\n".join(_comparisons_markdown(comparisons(arms)))
  assert "| stage_before_update | off | 2 / 2 | 6 / 6 | 100.00 ms" in markdown


@pytest.mark.spec
def test_a_faulted_arm_is_never_pooled_and_a_missing_pair_is_left_out():
  slow = _arm("stage_before_update", [9.0, 5.0, 5.0, 5.0], [1.0, 1.0, 1.0, 0.0], fault="blocking_prepare",
              name="stage_before_update#2")
  arms = [_arm("off", [9.0, 1.10, 1.11, 1.12], [0.10, 0.11, 0.12, 0.0]),
          _arm("stage_before_update", [9.0, 1.00, 1.01, 1.02], [0.00, 0.01, 0.00, 0.0]), slow]
  rows = comparisons(arms)
  assert [(r["mode"], r["against"]) for r in rows] == [("stage_before_update", "off")]
  assert rows[0]["arms"] == [1, 1] and rows[0]["step_saving_s"]["mean"] > 0  # the faulted arm would make it < 0
  assert comparisons([_arm("off", [1.0, 1.0, 1.0], [0.1, 0.1, 0.0])]) == []

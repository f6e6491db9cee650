"""The rig report's mode comparisons: over arm medians where each mode ran twice or more, over one arm's steps
otherwise (and said so); faulted arms, arms that ended in another mode and control boundaries left out
(JAX-free)."""

from __future__ import annotations

import pytest

from orchestrator.rig.report import _comparisons_markdown, comparisons, left_out_of_comparisons


def _arm(mode, step_s, idle_s, *, fault=None, name=None, final_mode=None, controls=()):
  records = [{"step_s": s, "boundary_idle_s": i, "control": k in controls}
             for k, (s, i) in enumerate(zip(step_s, idle_s))]
  return {"name": name or mode, "mode": mode, "fault": fault, "final_mode": final_mode or mode, "records": records}


ARMS = [_arm("off", [9.0, 1.10, 1.11, 1.12], [0.10, 0.11, 0.12, 0.0]),
        _arm("stage_before_update", [9.0, 1.00, 1.01, 1.02], [0.00, 0.01, 0.00, 0.0]),
        _arm("off", [9.0, 1.12, 1.11, 1.13], [0.11, 0.10, 0.12, 0.0], name="off#2"),
        # a control at boundary 2: its unstaged idle (0.20 s) and the step it lands in (1.60 s) are left out;
        # counted, that step would move this arm's median to 1.025 s
        _arm("stage_before_update", [9.0, 1.02, 1.00, 1.60, 1.03, 1.01], [0.01, 0.00, 0.20, 0.00, 0.00, 0.0],
             name="stage_before_update#2", controls=(2,)),
        _arm("pipelined", [9.0, 1.05, 1.06, 1.04], [0.05, 0.06, 0.05, 0.0]),
        _arm("stage_after_update", [9.0, 1.05, 1.06, 1.04], [0.05, 0.06, 0.05, 0.0], final_mode="pipelined")]


@pytest.mark.spec
def test_two_arms_a_side_compare_arm_medians_and_otherwise_pooled_steps_said_so():
  rows = {(r["mode"], r["against"]): r for r in comparisons(ARMS)}
  assert set(rows) == {("stage_before_update", "off"), ("stage_before_update", "pipelined"), ("pipelined", "off")}
  before_off = rows[("stage_before_update", "off")]
  assert before_off["samples"] == "arm medians" and before_off["n"] == [2, 2] and before_off["arms"] == [2, 2]
  step = before_off["step_saving_s"]  # arm medians 1.11, 1.12 against 1.01, 1.02 (the control's step left out)
  assert step["mean"] == pytest.approx(0.10, abs=1e-9) and 0 < step["low"] < step["mean"] < step["high"]
  assert before_off["step_saving_share"]["mean"] == pytest.approx(0.10 / 1.115, rel=1e-6)
  assert before_off["boundary_idle_saving_s"]["mean"] == pytest.approx(0.11, abs=1e-9)
  before_pipelined = rows[("stage_before_update", "pipelined")]
  assert before_pipelined["samples"] == "steps pooled (2 arms / 1: no drift between arms counted)"
  assert before_pipelined["n"] == [6, 3]  # the second arm's steps 1, 4 and 5: the control touched 2 and 3
  assert before_pipelined["step_saving_s"]["mean"] == pytest.approx(1.05 - 6.09 / 6, abs=1e-9)
  # STAGE_AFTER_UPDATE's arm ended in PIPELINED: it compares nothing, and the report names it.
  assert left_out_of_comparisons(ARMS) == ["stage_after_update (ended pipelined)"]
  markdown = "\n".join(_comparisons_markdown(comparisons(ARMS), left_out_of_comparisons(ARMS)))
  assert "| stage_before_update | off | 2 / 2 | arm medians: 2 / 2 | 100.00 ms" in markdown
  assert "Left out of the comparisons: stage_after_update (ended pipelined)." in markdown


@pytest.mark.spec
def test_the_saving_is_oriented_and_a_cost_lies_below_zero():
  """Negative control: OFF's arms labelled as staged make the saving a cost, its whole interval below zero."""
  swap = {"off": "stage_before_update", "stage_before_update": "off"}
  swapped = [dict(a, mode=swap.get(a["mode"], a["mode"]), final_mode=swap.get(a["mode"], a["mode"]))
             for a in ARMS[:4]]
  cost = comparisons(swapped)[0]
  assert (cost["mode"], cost["against"]) == ("stage_before_update", "off")
  assert cost["step_saving_s"]["high"] < 0 and cost["step_saving_s"]["mean"] == pytest.approx(-0.10, abs=1e-9)


@pytest.mark.spec
def test_a_faulted_arm_is_never_pooled_and_a_missing_pair_is_left_out():
  slow = _arm("stage_before_update", [9.0, 5.0, 5.0, 5.0], [1.0, 1.0, 1.0, 0.0], fault="blocking_prepare",
              name="stage_before_update#2")
  rows = comparisons([ARMS[0], ARMS[1], slow])
  assert [(r["mode"], r["against"]) for r in rows] == [("stage_before_update", "off")]
  assert rows[0]["arms"] == [1, 1] and rows[0]["step_saving_s"]["mean"] > 0  # the faulted arm would make it < 0
  assert left_out_of_comparisons([ARMS[0], ARMS[1], slow]) == ["stage_before_update#2 (fault: blocking_prepare)"]
  assert comparisons([_arm("off", [1.0, 1.0, 1.0], [0.1, 0.1, 0.0])]) == []

"""The saving benchmark's figures, from records given here: each mode's switches, the ratio to OFF, the share staged
before the update, and the control-measured and A/B savings with whether their intervals overlap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.app.cli import FLAG_KEYS
from orchestrator.bench.saving import MODE_FLAGS, SAMPLER_PACED, override_problem, summarise
from policies import Mode

pytestmark = pytest.mark.spec


def _records(steps: int, *, mode: str, control_every: int = 0, saved_s: float = 0.01) -> list:
  """A run's records in which what a boundary does shows in the next step's seconds: 0.1 s, plus ``saved_s``
  after a boundary that did not stage, plus a little noise; times continuous from update to update."""
  staged_mode = mode.startswith("stage")
  out, t = [], 0.0
  for k in range(steps):
    control = staged_mode and control_every > 0 and k % control_every == control_every - 1
    step_s = 0.1 + 0.001 * (k % 3) + (saved_s if k and not out[-1].staged else 0.0)
    t += step_s
    out.append(SimpleNamespace(step=k, step_s=step_s, t_update_ready=t, staged=staged_mode and not control,
                               stage_before_update=mode == "stage_before_update" and not control, control=control,
                               boundary_idle_s=0.0, reward_mean=1.0))
  return out


def _arm(mode: str, records) -> dict:
  return {"variant": "default", "mode": mode, "wall_s": 10.0, "summary": {"final_state_digest": "d"},
          "records": records}


def test_each_mode_s_switches_select_that_mode():
  for mode, flags in MODE_FLAGS.items():
    flag_values = {}
    for flag in flags:
      name = flag.removeprefix("--").removeprefix("no-")
      flag_values[FLAG_KEYS[name]] = (not flag.startswith("--no-"), flag)
    assert recipe_lib.resolve(None, env={}, flags=flag_values).recipe.mode is Mode(mode)
  sampler_paced = recipe_lib.resolve(None, env={}, overrides=list(SAMPLER_PACED)).recipe
  assert (sampler_paced.rollouts.batch_steps, sampler_paced.rollouts.micro_batches_per_call) == (1, 1)


def test_staging_that_saves_shows_in_both_measures_and_they_agree():
  """Steps after an unstaged boundary take 10 ms longer, in the staged run's controls and in the PIPELINED run
  alike: both measures say about +10 ms and overlap. The negative control makes the PIPELINED run as fast as the
  staged one: the A/B measure then says 0, outside the control-measured interval."""
  arms = [_arm("off", _records(200, mode="off", saved_s=0.02)),
          _arm("pipelined", _records(200, mode="pipelined")),
          _arm("stage_before_update", _records(200, mode="stage_before_update", control_every=10))]
  figures = summarise(arms)["default"]
  off, before = figures["modes"]["off"], figures["modes"]["stage_before_update"]
  assert before["step_ratio_to_off"] == pytest.approx(before["median_step_s"] / off["median_step_s"])
  assert before["step_ratio_to_off"] < 1
  assert before["staged_before_update_share"] == pytest.approx(180 / 199) and off["staged_before_update_share"] == 0
  # No sample at a run's first or last boundary, nor after a control.
  assert figures["controls"] == 19 and figures["staged"] == 160
  assert figures["control_measured_saving_s"]["mean"] == pytest.approx(0.01, abs=1e-3)
  assert figures["a_b_saving_s"]["mean"] == pytest.approx(0.01, abs=1e-3)
  assert figures["intervals_overlap"] is True

  arms[1] = _arm("pipelined", _records(200, mode="pipelined", saved_s=0.0))
  disagreeing = summarise(arms)["default"]
  assert disagreeing["a_b_saving_s"]["mean"] == pytest.approx(0.0, abs=1e-3)
  assert disagreeing["intervals_overlap"] is False


def test_without_controls_the_control_measured_saving_is_missing_and_no_agreement_is_claimed():
  arms = [_arm("pipelined", _records(10, mode="pipelined")),
          _arm("stage_before_update", _records(10, mode="stage_before_update"))]
  figures = summarise(arms)["default"]
  assert figures["control_measured_saving_s"] is None and figures["controls"] == 0
  assert figures["a_b_saving_s"] is not None and figures["intervals_overlap"] is None
  assert "step_ratio_to_off" not in figures["modes"]["pipelined"]  # no OFF run: no ratio


def test_each_staged_run_s_own_decisions_are_reported_by_rule_and_step():
  """A run whose controls turned staging off reports that rule and step; one that the wait proxy turned off, its
  own; one that never turned off, none (the negative control)."""
  saving_off = {"transition": {"step": 41, "from_mode": "stage_before_update", "to_mode": "pipelined",
                               "kind": "saving_disable", "reason": "staging cost time"}}
  runs = [_arm("stage_before_update", _records(20, mode="stage_before_update")) for _ in range(3)]
  runs[0]["summary"] = {"final_state_digest": "d", "final_mode": "pipelined",
                        "transitions": [saving_off["transition"]], "measured_saving": {"enough": True}}
  runs[1]["summary"] = {"final_state_digest": "d", "final_mode": "pipelined", "transitions": [
      {"step": 3, "kind": "auto_disable", "reason": "low waits"},
      {"step": 30, "kind": "reprobe_enabled", "reason": "re-probe"}]}
  runs[2]["summary"] = {"final_state_digest": "d", "final_mode": "stage_before_update", "transitions": []}
  decisions = summarise(runs)["default"]["decisions"]
  assert decisions[0]["turned_off"] == [{"rule": "saving_disable", "step": 41, "reason": "staging cost time"}]
  assert decisions[0]["measured_saving"] == {"enough": True}
  assert [o["rule"] for o in decisions[1]["turned_off"]] == ["auto_disable"]
  assert decisions[2] == {"final_mode": "stage_before_update", "turned_off": [], "measured_saving": None}


def test_an_override_the_recipe_refuses_stops_the_benchmark_before_any_run():
  assert override_problem(["step_boundary.wait_threshold_s=0", "step_boundary.control_every=4"]) is None
  problem = override_problem(["step_boundary.wait_threshold_s=-1"])
  assert problem.startswith("--set step_boundary.wait_threshold_s=-1: ") and "\n" not in problem
  assert "step_boundary.no_such_key" in override_problem(["step_boundary.no_such_key=1"])

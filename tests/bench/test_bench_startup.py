"""The start-up benchmark's figures, from step times and rewards given here: what a run's speed decides is an input."""

from __future__ import annotations

import pytest

from orchestrator.bench.startup import figures, first_reaching, ratios, seconds_per_step

pytestmark = pytest.mark.spec

TIMES = [10.0 + i for i in range(12)]


def test_the_time_to_the_reward_is_the_first_step_whose_window_mean_reaches_it():
  rewards = [0.0] * 5 + [1.0] * 7  # the window ending with step 9 is the first to average 0.5
  assert first_reaching(TIMES, rewards, target=0.5, window=10) == TIMES[9]
  assert first_reaching(TIMES, [0.49] * 12, target=0.5, window=10) is None
  assert first_reaching(TIMES[:9], [1.0] * 9, target=0.5, window=10) is None  # fewer steps than the window


def test_the_figures_say_how_many_runs_reached_the_reward_and_leave_a_median_only_if_all_did():
  reached = {"step_s": TIMES, "reward": [1.0] * 12, "digest": "d"}
  short = {"step_s": [t + 2 for t in TIMES], "reward": [0.0] * 12, "digest": "d"}
  row = figures([reached, short, reached])
  assert row["first_step_s"] == 10.0 and row["first_step_range_s"] == [10.0, 12.0]
  assert row["reward_reached"] == 2 and row["reward_s"] is None and row["reward_range_s"] == [TIMES[9], TIMES[9]]
  assert row["digests"] == ["d"] and row["steps"] == 12
  assert figures([reached, reached])["reward_s"] == TIMES[9]


def test_seconds_per_step_leave_out_the_compiling_steps():
  step_s = [5.0, 7.0, 7.5, 7.6, 7.7, 7.8]  # the first two steps compile
  assert seconds_per_step(step_s) == pytest.approx(0.1)
  assert seconds_per_step(step_s[:3]) is None


def test_the_ratios_pair_the_runs_of_one_round():
  """run_rl's figure over Tunix's in the same round; a reward one arm never reached leaves that round out."""
  ours = [{"step_s": [t / 2 for t in TIMES], "reward": [1.0] * 12}, {"step_s": TIMES, "reward": [0.0] * 12}]
  theirs = [{"step_s": TIMES, "reward": [1.0] * 12}, {"step_s": [t * 2 for t in TIMES], "reward": [1.0] * 12}]
  out = ratios(ours, theirs)
  assert out["first_step"] == {"median": 0.5, "range": [0.5, 0.5]}
  assert out["per_step"]["range"] == [0.5, 0.5]
  assert out["reward"] == {"median": 0.5, "range": [0.5, 0.5]}  # round 2: run_rl never reached it
  assert ratios(ours[1:], theirs[1:])["reward"] is None

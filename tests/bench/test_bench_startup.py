"""The start-up benchmark: its arms' settings agree with the recipe's (the Tunix arm samples, rewards and trains as
``run_rl`` does, but for what each ``run_rl`` arm measures), its figures from step times and rewards given here,
its rounds' order, and one short run of the Tunix arm."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest

from orchestrator.bench import startup
from orchestrator.bench.startup import (EXPECTED_DIFFERENCES, RUN_RL_ARMS, check_settings, differences, figures,
                                        first_reaching, matched_toy, ratios, round_order, run_rl_settings,
                                        seconds_per_step, step_rewards, tunix_settings, unmatched_toy)
from orchestrator.tasks.tasks import make_task
from orchestrator.tasks.tokenizer import CharTokenizer

TIMES = [10.0 + i for i in range(12)]


@pytest.mark.spec
def test_the_tunix_arm_samples_rewards_and_trains_as_the_recipe_says():
  ours, theirs = run_rl_settings(), tunix_settings(matched_toy())
  letters = CharTokenizer().encode(make_task("first_letter").answer_alphabet)
  assert ours["sampled_ids"] == theirs["sampled_ids"] == sorted(letters)  # the 8 answer letters, no other id
  assert ours["completion_tokens"] == theirs["completion_tokens"] == 1
  assert ours["reward"] == theirs["reward"] == "exact answer"
  assert (theirs["prompts"], theirs["generations"], theirs["micro_batches_per_step"]) == (8, 4, 2)
  assert theirs["learning_rate"] == ours["learning_rate"] == 1.5e-3 and theirs["passes"] == ours["passes"] == 2
  assert theirs["clip_eps"] == ours["clip_eps"] == [0.2, 0.28] and theirs["optimizer"] == ours["optimizer"]
  # Left: what Tunix cannot take from the recipe, and what the run_rl arms measure, each its own part of it.
  assert (theirs["logprobs_over_ids"], theirs["sampling_seed"]) == (512, "the same every call")
  for arm, overrides in RUN_RL_ARMS.items():
    assert differences(run_rl_settings(overrides), theirs) == EXPECTED_DIFFERENCES[arm], arm
  assert check_settings({arm: startup.arm_settings(arm) for arm in (*RUN_RL_ARMS, "tunix")}) == []


@pytest.mark.spec
@pytest.mark.parametrize("change, key", [(dict(completion_tokens=4), "completion_tokens"),
                                         (dict(sampled="vocabulary"), "sampled_ids"),
                                         (dict(reward="shaped"), "reward"),
                                         (dict(prompts=2), "prompts"),
                                         (dict(num_iterations=1), "passes"),
                                         (dict(clip_eps_high=None), "clip_eps"),
                                         (dict(weight_decay=1e-4), "optimizer"),
                                         (dict(seed=1), "prompts_seed")])
def test_a_tunix_arm_that_samples_or_trains_otherwise_is_caught(change, key):
  """Negative controls: one setting of the Tunix arm off the recipe's fails every run_rl arm's check."""
  settings = {arm: startup.arm_settings(arm) for arm in RUN_RL_ARMS}
  settings["tunix"] = tunix_settings(dataclasses.replace(matched_toy(), **change))
  caught = check_settings(settings)
  assert len(caught) == len(RUN_RL_ARMS) and all(key in line for line in caught)


@pytest.mark.spec
def test_the_unmatched_toy_differs_where_the_earlier_comparison_did():
  assert {"sampled_ids", "completion_tokens", "reward", "passes"} <= differences(
      tunix_settings(unmatched_toy()), tunix_settings(matched_toy()))


@pytest.mark.spec
def test_the_tunix_arm_is_read_from_the_recipe_not_written_down():
  overrides = ("rollouts.groups_per_micro_batch=4", "engine.learning_rate=0.001", "rollouts.batch_steps=2",
               "engine.epochs=1")
  toy = matched_toy(steps=30, overrides=overrides)
  assert (toy.prompts, toy.learning_rate, toy.mini_batches, toy.num_iterations) == (4, 1e-3, 2, 1)
  assert toy.rollout_prompts == 8 and toy.global_steps == 15  # a mini-batch per call; 30 steps of 2 per batch
  assert differences(run_rl_settings(overrides), tunix_settings(toy)) == EXPECTED_DIFFERENCES["run_rl"]


@pytest.mark.spec
def test_a_recipe_that_draws_its_prompts_with_another_seed_than_its_weights_is_caught():
  """Tunix's arm draws its weights and its prompts with one seed: a run_rl arm whose rollouts.seed differs from
  engine.seed would see other prompts, and the check says so."""
  theirs = tunix_settings(matched_toy())
  assert "prompts_seed" in differences(run_rl_settings(("rollouts.seed=5",)), theirs)
  assert "prompts_seed" not in differences(run_rl_settings(), theirs)


@pytest.mark.spec
def test_the_benchmark_refuses_to_run_arms_that_are_not_alike(monkeypatch, capsys):
  four_tokens = dataclasses.replace(matched_toy(), completion_tokens=4)
  monkeypatch.setattr(startup, "matched_toy", lambda steps=None, overrides=(): four_tokens)
  monkeypatch.setattr(startup, "run_arm", lambda arm, args: pytest.fail("no arm runs"))
  assert startup.main(["--rounds", "1"]) == 2
  assert "completion_tokens" in capsys.readouterr().err


@pytest.mark.spec
def test_the_time_to_the_reward_is_the_first_step_whose_window_mean_reaches_it():
  rewards = [0.0] * 5 + [1.0] * 7  # the window ending with step 9 is the first to average 0.5
  assert first_reaching(TIMES, rewards, target=0.5, window=10) == TIMES[9]
  assert first_reaching(TIMES, [0.49] * 12, target=0.5, window=10) is None
  assert first_reaching(TIMES[:9], [1.0] * 9, target=0.5, window=10) is None  # fewer steps than the window


@pytest.mark.spec
def test_the_figures_say_how_many_runs_reached_the_reward_and_leave_a_median_only_if_all_did():
  reached = {"step_s": TIMES, "reward": [1.0] * 12, "digest": "d"}
  short = {"step_s": [t + 2 for t in TIMES], "reward": [0.0] * 12, "digest": "d"}
  row = figures([reached, short, reached])
  assert row["first_step_s"] == 10.0 and row["first_step_range_s"] == [10.0, 12.0]
  assert row["reward_reached"] == 2 and row["reward_s"] is None and row["reward_range_s"] == [TIMES[9], TIMES[9]]
  assert row["reward_step"] is None and row["reward_step_range"] == [10, 10]
  assert row["digests"] == ["d"] and row["steps"] == 12
  assert figures([reached, reached])["reward_s"] == TIMES[9]
  later = {"step_s": TIMES, "reward": [0.0] * 7 + [1.0] * 5}  # reaches 0.5 at its 12th step, at 21 s
  assert (figures([reached, later, later])["reward_step"], figures([reached, later, later])["reward_s"]) == (12, 21.0)


@pytest.mark.spec
def test_seconds_per_step_leave_out_the_compiling_steps_and_count_sampling_steps_in():
  step_s = [5.0, 7.0, 7.5, 7.6, 7.7, 7.8]  # the first two steps compile
  assert seconds_per_step(step_s) == pytest.approx(0.1)
  assert seconds_per_step(step_s[:3]) is None
  # Every other step also waits 0.2 s for its sampling: 0.1 s and 0.3 s steps take 1.5 s over 7 steps, where
  # the median of the gaps would say 0.3 s (the negative control).
  sampled_every_other = [5.0, 7.0] + [7.0 + 0.4 * (i // 2) + 0.1 * (i % 2) for i in range(1, 9)]
  gaps = [b - a for a, b in zip(sampled_every_other[2:], sampled_every_other[3:])]
  assert seconds_per_step(sampled_every_other) == pytest.approx(1.5 / 7)
  assert statistics.median(gaps) == pytest.approx(0.3)


@pytest.mark.spec
def test_each_tunix_step_is_rewarded_with_the_mini_batch_it_trains():
  toy = dataclasses.replace(matched_toy(), prompts=1, micro_batches=2, generations=2, num_iterations=2)
  exact = [True, True, True, False] + [False] * 4 + [True] * 4  # three mini-batches of 4 completions
  assert step_rewards(exact, toy, steps=6) == [0.75, 0.75, 0.0, 0.0, 1.0, 1.0]
  assert step_rewards(exact, toy, steps=5) == [0.75, 0.75, 0.0, 0.0, 1.0]
  assert step_rewards(exact + [True], toy, steps=10) == [0.75, 0.75, 0.0, 0.0, 1.0, 1.0]  # no partial mini-batch


@pytest.mark.spec
def test_the_ratios_pair_the_runs_of_one_round():
  """run_rl's figure over Tunix's in the same round; a reward one arm never reached leaves that round out."""
  ours = [{"step_s": [t / 2 for t in TIMES], "reward": [1.0] * 12}, {"step_s": TIMES, "reward": [0.0] * 12}]
  theirs = [{"step_s": TIMES, "reward": [1.0] * 12}, {"step_s": [t * 2 for t in TIMES], "reward": [1.0] * 12}]
  out = ratios(ours, theirs)
  assert out["first_step"] == {"median": 0.5, "range": [0.5, 0.5]}
  assert out["per_step"]["range"] == [0.5, 0.5]
  assert out["reward"] == {"median": 0.5, "range": [0.5, 0.5]}  # round 2: run_rl never reached it
  assert ratios(ours[1:], theirs[1:])["reward"] is None


@pytest.mark.spec
def test_the_arms_take_turns_at_going_first(monkeypatch, capsys):
  arms = ["run_rl", "run_rl_sync", "tunix"]
  assert [round_order(arms, i) for i in range(4)] == [arms, arms[1:] + arms[:1], arms[2:] + arms[:2], arms]
  calls = []

  def fake_arm(arm, args):
    calls.append(arm)
    scale = 1.0 if arm == "tunix" else 0.5
    return {"step_s": [scale * t for t in TIMES], "reward": [1.0] * 12, "digest": "d", "completions": ["a"],
            "startup_s": {"first_update": 1.0}}

  monkeypatch.setattr(startup, "run_arm", fake_arm)
  assert startup.main(["--rounds", "3", "--arms", ",".join(arms)]) == 0
  assert calls == [a for i in range(3) for a in round_order(arms, i)]
  out = capsys.readouterr().out
  report = json.loads(out.strip().splitlines()[-1])
  assert report["ratios"].keys() == {"run_rl", "run_rl_sync"}
  assert report["ratios"]["run_rl_sync"]["per_step"] == {"median": 0.5, "range": [0.5, 0.5]}
  assert len(report["load_before_round"]) == 3 and "tunix's completions: 1 distinct" in out
  assert report["settings"]["tunix"]["completion_tokens"] == 1


@pytest.mark.e2e
def test_the_tunix_arm_samples_one_answer_letter_and_is_rewarded_for_exact_answers():
  """A few steps of the Tunix arm in its own process: every completion one of the answer letters, each step's
  reward its mini-batch's exact-answer rate (both passes over a mini-batch alike), the updates in order."""
  toy = matched_toy(steps=8)
  out = startup.tunix_arm(toy, steps=8, timeout_s=600)
  letters = set(make_task("first_letter").answer_alphabet)
  assert set(out["completions"]) <= letters and len(out["completions"]) > 1
  assert len(out["step_s"]) == 8 and out["step_s"] == sorted(out["step_s"]) and out["step_s"][0] > 0
  rewards = out["reward"]
  assert len(rewards) == 8 and all(0.0 <= r <= 1.0 for r in rewards)
  assert rewards[0::2] == rewards[1::2]  # num_iterations 2: each mini-batch trained twice in a row
  assert len(out["digest"]) == 64  # the final weights', to tell whether its runs train alike

"""The measured saving's arithmetic: the t table, Welch's interval against values worked by hand, which
boundaries give a sample, and when there are too few controls for a figure."""

from __future__ import annotations

import math
import random
import types

import pytest

from policies.saving import (DECISION_ERROR, MIN_CONTROLS, BoundarySample, ControlSchedule, Interval, MeasuredSaving,
                             SavingEstimate, boundary_sample, decision_level, estimate, estimate_from_records,
                             t_quantile, t_quantile_975, welch_interval)

pytestmark = pytest.mark.spec


@pytest.mark.parametrize("df,quantile", [(1, 12.706), (6, 2.447), (6.98, 2.447), (30, 2.042), (30.5, 2.042),
                                         (45, 2.021), (119, 2.000), (120, 1.980), (1e6, 1.980), (math.inf, 1.960)])
def test_the_t_quantile_rounds_the_degrees_of_freedom_down_to_a_table_entry(df, quantile):
  assert t_quantile_975(df) == quantile


def test_the_t_quantile_refuses_less_than_one_degree_of_freedom():
  with pytest.raises(ValueError, match="degrees of freedom must be >= 1, got 0.5"):
    t_quantile_975(0.5)


def test_welch_interval_matches_the_value_worked_by_hand():
  # control mean 2.5 (variance 5/3), staged mean 4 (variance 2.5): se = sqrt(5/12 + 1/2) = 0.957427,
  # df = (11/12)^2 / ((5/12)^2 / 3 + (1/2)^2 / 4) = 6.98 -> the table's 6: t = 2.447.
  interval = welch_interval([1, 2, 3, 4], [2, 3, 4, 5, 6])
  se = math.sqrt(5 / 12 + 1 / 2)
  assert interval.mean == pytest.approx(-1.5)
  assert interval.low == pytest.approx(-1.5 - 2.447 * se) and interval.high == pytest.approx(-1.5 + 2.447 * se)
  assert not interval.below_zero  # it straddles zero


def test_an_interval_wholly_below_zero_says_so_and_equal_samples_give_a_point():
  assert welch_interval([1.0, 1.1, 0.9], [2.0, 2.1, 1.9]).below_zero
  assert welch_interval([1.0, 1.0], [1.0, 1.0]) == Interval(0.0, 0.0, 0.0)
  with pytest.raises(ValueError, match="two values a side, got 1 and 3"):
    welch_interval([1.0], [1.0, 2.0, 3.0])


def test_too_few_controls_give_no_figure_and_enough_give_one():
  staged = [BoundarySample(0.0, 1.0 + 0.01 * i) for i in range(10)]
  few = estimate(staged, [BoundarySample(0.1, 1.2)] * (MIN_CONTROLS - 1))
  assert not few.enough and few.step_s is None and (few.staged_n, few.control_n) == (10, MIN_CONTROLS - 1)
  enough = estimate(staged, [BoundarySample(0.1 + 0.01 * i, 1.2 + 0.01 * i) for i in range(MIN_CONTROLS)])
  assert enough.enough and enough.step_s.mean > 0 and not enough.costs_time
  assert SavingEstimate.from_json(enough.to_json()) == enough


def _record(step, *, staged=False, control=False, t=None, step_s=1.0, idle=0.1, strict=0.2, update_s=0.05,
            micro=(0.4, 0.4)):
  return types.SimpleNamespace(step=step, staged=staged, control=control, step_s=step_s,
                               t_update_ready=t if t is not None else 1.0 + step, boundary_idle_s=idle,
                               boundary_idle_strict_s=strict, update_s=update_s, micro_batch_s=list(micro))


def test_a_sample_is_the_boundarys_idle_and_the_seconds_of_the_two_steps_around_it():
  before, record, after = _record(0, staged=True), _record(1, staged=True), _record(2, step_s=0.75, t=2.75)
  assert boundary_sample(before, record, after) == BoundarySample(0.1, 1.0 + 0.75)
  assert boundary_sample(_record(0, control=True), record, after) is None  # after a control: step 1 carries its effect
  assert boundary_sample(before, _record(1), after) is None  # neither staged nor a control
  # A resumed segment's first step counts from its first dispatch, on another clock: no sample across it.
  assert boundary_sample(before, record, _record(2, t=0.7)) is None
  assert boundary_sample(_record(0, staged=True, t=5.0), record, after) is None


def test_a_span_that_waited_for_an_evaluation_gives_no_sample():
  """An evaluation during the run (record k's ``eval_s``) delays step k + 1: neither boundary k's sample nor k +
  1's counts it; the negative control, the same records without it, give both."""
  records = [_record(k, staged=True) for k in range(4)]
  assert [boundary_sample(*records[k - 1:k + 2]) for k in (1, 2)] == [BoundarySample(0.1, 2.0)] * 2
  records[1].eval_s = 0.3
  assert [boundary_sample(*records[k - 1:k + 2]) for k in (1, 2)] == [None, None]


def test_a_span_holding_the_samplers_calls_on_the_trainers_devices_gives_no_sample():
  """A shared placement's sampler computing during step k (record k's ``sampling_on_trainer_devices_s`` > 0)
  slows step k whatever boundary k - 1 or k did: neither sample counts it; 0.0 (the sampler idle through the
  step) and None (a sampler elsewhere) leave both samples in."""
  records = [_record(k, staged=True) for k in range(4)]
  for quiet in (None, 0.0):
    for r in records:
      r.sampling_on_trainer_devices_s = quiet
    assert [boundary_sample(*records[k - 1:k + 2]) for k in (1, 2)] == [BoundarySample(0.1, 2.0)] * 2
  records[2].sampling_on_trainer_devices_s = 0.004
  assert [boundary_sample(*records[k - 1:k + 2]) for k in (1, 2)] == [None, None]


#: The first 21 steps of the default recipe on a TPU v5e with the low-wait rule pinned off and a control every 4th
#: boundary (2026-12-07, docs/benchmarks.md): (step ms, boundary idle ms, staged, control). The sampler shares the
#: chip; each sampled batch's generation lands in the first two steps of the batch before it (8-9, 16-17).
TPU_V5E_FIRST_STEPS = [(12.8, 0.18, 1, 0), (16.61, 0.14, 1, 0), (13.31, 0.3, 1, 0), (9.54, 3.2, 0, 1),
                       (15.58, 0.0, 1, 0), (10.43, 3.52, 0, 1), (15.98, 0.28, 1, 0), (12.84, 0.45, 1, 0),
                       (35.11, 0.24, 1, 0), (41.26, 3.05, 1, 0), (25.28, 3.76, 0, 1), (15.31, 0.31, 1, 0),
                       (12.96, 0.25, 1, 0), (10.68, 3.39, 0, 1), (16.06, 0.25, 1, 0), (12.47, 0.1, 1, 0),
                       (36.1, 0.44, 1, 0), (53.97, 0.13, 1, 0), (10.32, 2.96, 0, 1), (16.25, 0.15, 1, 0),
                       (10.65, 3.36, 0, 0)]


def test_the_samplers_generation_on_a_shared_chip_no_longer_makes_staging_look_costly():
  """On the TPU run above, 5 of the 11 staged samples spanned a step holding the sampler's generation and 1 of the
  5 controls did: read as they were then, the records say staging costs 23 ms a step (the policy turned it off at
  its first look, in both runs of the benchmark); the steps that held the generation marked, the records give no
  such figure."""
  t, records = 0.0, []
  for k, (step_ms, idle_ms, staged, control) in enumerate(TPU_V5E_FIRST_STEPS):
    t += step_ms / 1e3
    record = _record(k, staged=bool(staged), control=bool(control), t=t, step_s=step_ms / 1e3, idle=idle_ms / 1e3)
    records.append(record)
  as_then = estimate_from_records(records)
  assert as_then.step_s.below_zero and as_then.step_s.mean == pytest.approx(-0.02315, abs=1e-4)
  assert (as_then.control_n, as_then.staged_n) == (5, 9)  # the run's own closing line
  for k, record in enumerate(records):
    record.sampling_on_trainer_devices_s = 0.02 if k in (8, 9, 16, 17) else 0.0
  marked = estimate_from_records(records)
  assert marked.enough and not marked.step_s.below_zero and (marked.control_n, marked.staged_n) == (5, 3)


def test_the_records_of_a_run_give_control_and_staged_samples():
  records = [_record(k, staged=k % 3 != 2, control=k % 3 == 2, idle=0.1 + 0.01 * k) for k in range(20)]
  saving = estimate_from_records(records)
  # Neither the first step's boundary nor the last's; a staged one only after a staged one (k % 3 == 1).
  assert (saving.control_n, saving.staged_n) == (6, 6)
  assert saving.boundary_idle_s.mean == pytest.approx(0.01 * (sum(range(2, 20, 3)) / 6 - sum(range(1, 19, 3)) / 6))


@pytest.mark.parametrize("every,controls", [(0, []), (1, [1, 2, 3, 4, 5, 6]), (3, [2, 6])])
def test_the_control_schedule_takes_one_boundary_in_each_k_that_would_stage(every, controls):
  schedule = ControlSchedule(every)
  assert [n for n in range(1, 7) if schedule.is_control(n)] == controls


def _phases_of_controls(is_control, every: int, period: int, blocks: int = 200) -> set[int]:
  """The phases, within a period of ``period`` boundaries, at which ``is_control`` puts its controls; asserting
  one control per block of ``every``."""
  controls = [n for n in range(1, every * blocks + 1) if is_control(n)]
  assert [(n - 1) // every for n in controls] == list(range(blocks))
  return {n % period for n in controls}


@pytest.mark.parametrize("every", [4, 8, 20])
def test_controls_fall_at_every_phase_of_a_period_k_is_a_multiple_of(every):
  """A run's boundaries have periods (a sampled batch of 4 steps): controls at one phase of it would compare one
  kind of boundary with all kinds. The negative control, every K-th boundary, puts all of them at one phase."""
  assert _phases_of_controls(ControlSchedule(every).is_control, every, period=4) == {0, 1, 2, 3}
  assert len(_phases_of_controls(lambda n: n % every == 0, every, period=4)) == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_the_control_schedule_refuses_what_is_not_a_whole_number(bad):
  with pytest.raises(ValueError, match="control_every must be a whole number >= 0"):
    ControlSchedule(bad)


@pytest.mark.parametrize("df", [3, 4, 6, 10, 20, 30, 60, 120])
def test_the_general_t_quantile_matches_the_table_and_is_exact_at_one_and_two_degrees(df):
  assert abs(t_quantile(0.975, df) - t_quantile_975(df)) < 0.01
  assert t_quantile(0.975, 1) == pytest.approx(12.706, abs=1e-3) and t_quantile(0.975, 2) == pytest.approx(4.303, abs=1e-3)
  assert t_quantile(0.99, 3) == pytest.approx(4.541, rel=0.005) and t_quantile(0.995, 5) == pytest.approx(4.032, rel=0.005)
  with pytest.raises(ValueError, match="0.5 < p < 1"):
    t_quantile(0.4, 3)


def test_the_policy_looks_at_doubling_control_counts_and_spends_at_most_its_error():
  looks = {n: decision_level(n) for n in range(1, 700) if decision_level(n) is not None}
  assert list(looks) == [MIN_CONTROLS * 2 ** j for j in range(len(looks))]
  assert sum((1 - level) / 2 for level in looks.values()) < DECISION_ERROR
  assert looks[MIN_CONTROLS] < 0.99 and all(a < b for a, b in zip(list(looks.values()), list(looks.values())[1:]))


def test_an_interval_below_zero_between_looks_or_only_at_95_percent_does_not_turn_staging_off():
  staged = [BoundarySample(0.0, 1.0 + 0.01 * (i % 3)) for i in range(20)]
  slower = [BoundarySample(0.0, 0.98 + 0.02 * (i % 2)) for i in range(6)]  # staged costs about 1.5 % a step
  between = estimate(staged, slower, look=True)  # 6 controls: not a look
  assert between.step_s.below_zero and between.decision is None and not between.costs_time
  at_look = estimate(staged, slower[:MIN_CONTROLS], look=True)
  assert at_look.decision_level == decision_level(MIN_CONTROLS) and at_look.costs_time
  assert not estimate(staged, slower[:MIN_CONTROLS]).costs_time  # a staged sample's arrival takes no look
  marginal = [BoundarySample(0.0, x) for x in (0.998, 1.008, 0.993, 1.003, 0.988)]
  near = estimate(staged, marginal, look=True)
  assert near.step_s.below_zero and not near.decision.below_zero and not near.costs_time  # 95 % says so; the look not


def test_staging_that_saves_nothing_is_rarely_turned_off_where_judging_every_control_would_often():
  """Negative control: the same noise judged at the 95 % interval after every control turns staging off
  several times as often."""
  rng = random.Random(7)
  runs, controls_per_run, turned_off, every_control = 300, 40, 0, 0
  for _ in range(runs):
    saving = MeasuredSaving()
    decided = naive = False
    for k in range(controls_per_run * 4):
      control = k % 4 == 0
      estimate_now = saving.add(BoundarySample(0.0, rng.gauss(1.0, 0.05)), control=control)
      decided = decided or estimate_now.costs_time
      naive = naive or (control and estimate_now.enough and estimate_now.step_s.below_zero)
    turned_off += decided
    every_control += naive
  assert turned_off / runs <= DECISION_ERROR + 0.015, turned_off
  assert every_control >= 3 * max(turned_off, 1), (every_control, turned_off)

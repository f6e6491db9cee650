"""The saving benchmark's figures, from records given here: each mode's switches, the ratio to OFF, the share staged
before the update, and the control-measured and A/B savings with whether their intervals overlap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.app.cli import FLAG_KEYS
from orchestrator.bench.saving import MODE_FLAGS, SAMPLER_PACED, summarise
from policies import Mode

pytestmark = pytest.mark.spec


def _records(steps: int, *, mode: str, span_s, control_every: int = 0, step_s: float = 0.1) -> list:
  """A run's records whose boundary spans are ``span_s(k, control)``: idle 0, update 0, the next step's first
  micro-batch taking the span; times continuous from update to update."""
  staged = mode.startswith("stage")
  out, t = [], 0.0
  for k in range(steps):
    control = staged and control_every > 0 and k % control_every == control_every - 1
    first = span_s(k - 1, out[-1].control) if k else step_s
    t += step_s
    out.append(SimpleNamespace(step=k, step_s=step_s, t_update_ready=t, staged=staged and not control,
                               stage_before_update=mode == "stage_before_update" and not control, control=control,
                               boundary_idle_s=0.0, boundary_idle_strict_s=0.0, update_s=0.0,
                               micro_batch_s=[first, 0.01], reward_mean=1.0))
  return out


def _arm(mode: str, records) -> dict:
  return {"variant": "default", "mode": mode, "wall_s": 10.0, "summary": {"final_state_digest": "d"},
          "records": records}


def _noisy(base: float):
  return lambda k, control: base + 0.001 * (k % 3)


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
  """Staged spans 10 ms shorter than unstaged ones, in the control boundaries of the staged run and in the
  PIPELINED run alike: both measures say +10 ms and overlap. The negative control makes the PIPELINED run's spans
  as short as the staged ones: the A/B measure then says 0, outside the control-measured interval."""
  def span(k, control):
    return 0.05 + (0.01 if control else 0.0) + 0.001 * (k % 3)

  arms = [_arm("off", _records(40, mode="off", span_s=_noisy(0.06), step_s=0.12)),
          _arm("pipelined", _records(40, mode="pipelined", span_s=_noisy(0.06), step_s=0.11)),
          _arm("stage_before_update",
               _records(40, mode="stage_before_update", span_s=span, control_every=4, step_s=0.10))]
  figures = summarise(arms)["default"]
  assert figures["modes"]["stage_before_update"]["step_ratio_to_off"] == pytest.approx(0.10 / 0.12)
  assert figures["modes"]["stage_before_update"]["staged_before_update_share"] == pytest.approx(30 / 39)
  assert figures["modes"]["off"]["staged_before_update_share"] == 0
  assert figures["controls"] == 9 and figures["staged"] == 29  # the first boundary of a run gives no sample
  assert figures["control_measured_saving_s"]["mean"] == pytest.approx(0.01, abs=1e-3)
  assert figures["a_b_saving_s"]["mean"] == pytest.approx(0.01, abs=1e-3)
  assert figures["intervals_overlap"] is True

  arms[1] = _arm("pipelined", _records(40, mode="pipelined", span_s=_noisy(0.05), step_s=0.11))
  disagreeing = summarise(arms)["default"]
  assert disagreeing["a_b_saving_s"]["mean"] == pytest.approx(0.0, abs=1e-3)
  assert disagreeing["intervals_overlap"] is False


def test_without_controls_the_control_measured_saving_is_missing_and_no_agreement_is_claimed():
  arms = [_arm("pipelined", _records(10, mode="pipelined", span_s=_noisy(0.06), step_s=0.11)),
          _arm("stage_before_update",
               _records(10, mode="stage_before_update", span_s=_noisy(0.05), step_s=0.10))]
  figures = summarise(arms)["default"]
  assert figures["control_measured_saving_s"] is None and figures["controls"] == 0
  assert figures["a_b_saving_s"] is not None and figures["intervals_overlap"] is None
  assert "step_ratio_to_off" not in figures["modes"]["pipelined"]  # no OFF run: no ratio

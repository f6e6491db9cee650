"""bench.tunix_grpo's driver: where its arms run and what it reports (the arms faked; JAX-free)."""

from __future__ import annotations

import json
import types

import pytest

from orchestrator.bench import tunix_grpo


def _fake_arm(calls, digest_of=lambda mode, n: "d" * 64):
  def run(toy, mode, *, reserve_host_core=False, accelerator=False, **flags):
    calls.append((toy.layout, mode, accelerator, toy.mini_batches))
    n = sum(1 for c in calls if c[1] == mode)
    return {"seconds_per_step": 0.1 if mode is None else 0.08 + 0.01 * n, "host_blocks_per_step": 2.0,
            "staged_share": 0.5, "digest": digest_of(mode, n)}
  return run


@pytest.mark.spec
def test_on_an_accelerator_of_one_device_the_arms_run_there_in_turn_and_the_split_layout_is_skipped(
    monkeypatch, capsys):
  calls = []
  monkeypatch.setattr(tunix_grpo, "host_devices", lambda: ("tpu", 1))
  monkeypatch.setattr(tunix_grpo, "run_arm_in_child", _fake_arm(calls))
  assert tunix_grpo.main(["--repeats", "2"]) == 0
  out = capsys.readouterr().out
  assert "arms on 1 tpu device(s)" in out
  assert "b_split_four_mini_batches: skipped: the split layout needs two devices" in out
  # Stock and the add-on alternate, every one on the accelerator, the shared layout only: one mini-batch a global
  # step, then four (what one device can stage).
  assert calls == ([("shared", None, True, 1), ("shared", "stage_before_update", True, 1)] * 2
                   + [("shared", None, True, 4), ("shared", "stage_before_update", True, 4)] * 2)
  rows = json.loads(out.strip().splitlines()[-1])
  addon = next(r for r in rows if r["arm"] == "stage_before_update")
  assert addon["seconds_per_step_range"] == pytest.approx([0.09, 0.10]) and addon["platform"] == "tpu"
  assert addon["seconds_per_step"] == pytest.approx(0.095) and addon["same_digest_as_stock"] is True


@pytest.mark.spec
def test_on_the_cpu_both_layouts_run_on_forced_devices_and_another_digest_fails_the_run(monkeypatch, capsys):
  calls = []
  monkeypatch.setattr(tunix_grpo, "host_devices", lambda: pytest.fail("--platform cpu never asks the host"))
  # Negative control: the add-on's second run reaches other weights than stock's.
  fake = _fake_arm(calls, digest_of=lambda mode, n: "e" * 64 if (mode and n == 2) else "d" * 64)
  monkeypatch.setattr(tunix_grpo, "run_arm_in_child", fake)
  assert tunix_grpo.main(["--repeats", "2", "--platform", "cpu"]) == 1
  out = capsys.readouterr().out
  assert "arms on two forced CPU devices" in out and {c[0] for c in calls} == {"shared", "split"}
  assert not any(c[2] for c in calls)
  rows = json.loads(out.strip().splitlines()[-1])
  assert [r["config"] for r in rows] == [name for name in tunix_grpo.CONFIGS for _ in range(2)]
  assert [r["same_digest_as_stock"] for r in rows] == [True, False, True, True, True, True]


@pytest.mark.spec
def test_jax_platforms_cpu_is_the_cpu_without_asking_a_child(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setattr(tunix_grpo.subprocess, "run", lambda *a, **k: pytest.fail("no child needed"))
  assert tunix_grpo.host_devices() == ("cpu", 0)


class _RecordingSampler:
  """Stands in for Tunix's ``Sampler``: records each call's keyword arguments; holds state as it does."""

  def __init__(self):
    self.calls, self.transformer_state = [], "weights"

  def __call__(self, input_strings, max_generation_steps, **kwargs):
    self.calls.append(kwargs)
    return input_strings


@pytest.mark.spec
def test_sample_only_makes_every_rollout_call_forbid_all_but_the_allowed_ids():
  rollout, untouched = types.SimpleNamespace(_sampler=_RecordingSampler()), _RecordingSampler()
  tunix_grpo.sample_only(rollout, [13, 14, 15], vocab_size=20)
  sampler = rollout._sampler
  assert sampler(["1st:abcd>"], max_generation_steps=1, temperature=1.0) == ["1st:abcd>"]
  (forbidden,), = [call["forbidden_tokens"] for call in sampler.calls]  # one array, as the live sampler passes
  assert sorted(forbidden.tolist()) == sorted(set(range(20)) - {13, 14, 15})
  assert sampler.calls[0]["temperature"] == 1.0  # the rollout's own settings pass through
  assert isinstance(sampler, _RecordingSampler) and sampler.transformer_state == "weights"  # the same object
  untouched(["x"], max_generation_steps=1)  # negative control: a sampler left as it was forbids nothing
  assert "forbidden_tokens" not in untouched.calls[0]


@pytest.mark.spec
def test_a_toy_names_what_it_samples_and_its_reward_from_a_known_set():
  assert tunix_grpo.toy_sampled_ids(tunix_grpo.Toy(sampled="answer")) == list(range(13, 21))  # "a"-"h"
  assert tunix_grpo.toy_sampled_ids(tunix_grpo.Toy()) == list(range(64))  # the cut vocabulary, every id
  with pytest.raises(ValueError, match="sampled='letters'"):
    tunix_grpo.Toy(sampled="letters")
  with pytest.raises(ValueError, match="reward='binary'"):
    tunix_grpo.Toy(reward="binary")

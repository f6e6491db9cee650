"""The live loop with every GRPO option a practitioner tunes turned on at once (a KL reference, a warmed-up cosine
schedule, asymmetric clipping, another loss aggregation, top-p and top-k sampling, evaluations during the run):
the four boundary modes still train to one digest, and the options do change what trains."""

from __future__ import annotations

import json
import math

import pytest

from orchestrator.app import cli
from policies import Mode

#: The sampler in this process (rollouts.placement=shared): where the sampler runs is not what these runs test (tests/live/test_sampler_process.py pins that its own
#: process samples the same), and a process of its own would start JAX again for every run.
LIVE = ["steps=6", "task.eval_prompts=8", "run.reserve_host_core=false", "metrics.backends=[]",
        "metrics.samples_every=0", "step_boundary.wait_threshold_s=0", "rollouts.placement=shared"]
EVERY_OPTION = ["engine.kl_beta=0.1", "engine.lr_schedule=cosine", "engine.warmup_steps=2", "engine.decay_steps=4",
                "engine.clip_eps_low=0.1", "engine.clip_eps_high=0.3", "engine.loss_aggregation=seq_mean_token_mean",
                "rollouts.top_p=0.9", "rollouts.top_k=5", "task.eval_every=3", "task.eval_pass_k=2"]
MODE_FLAGS = {
    Mode.OFF: ["--no-pipeline_step_boundary", "--no-stage_before_update"],
    Mode.PIPELINED: ["--no-stage_next_microbatch"],
    Mode.STAGE_AFTER_UPDATE: ["--no-stage_before_update"],
    Mode.STAGE_BEFORE_UPDATE: [],
}


def _digest(tmp_path, name, argv):
  out = tmp_path / name
  assert cli.main([*argv, "--out", str(out)]) == 0
  summary = json.loads((out / "summary.json").read_text())
  records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
  return summary["final_state_digest"], records


@pytest.mark.e2e
def test_every_mode_trains_to_one_digest_with_every_option_on(tmp_path):
  runs = {mode: _digest(tmp_path, mode.value, [*LIVE, *EVERY_OPTION, *flags]) for mode, flags in MODE_FLAGS.items()}
  digests = {mode: digest for mode, (digest, _) in runs.items()}
  assert len(set(digests.values())) == 1, digests
  records = runs[Mode.STAGE_BEFORE_UPDATE][1]
  assert all(r["kl"] is not None for r in records) and records[0]["kl"] == pytest.approx(0, abs=1e-6)
  assert [r["learning_rate"] for r in records][:2] != [records[2]["learning_rate"]] * 2  # warming up
  assert [r["step"] for r in records if r["eval_accuracy"] is not None] == [2, 5]
  plain, _ = _digest(tmp_path, "plain", LIVE)
  assert plain not in digests.values()  # the negative control: the options change what trains


@pytest.mark.e2e
@pytest.mark.parametrize("temperature", [0.05, 0.3, 2.0])
def test_the_live_loop_trains_at_any_temperature_without_nan(tmp_path, temperature):
  """The tempered distribution divides before it masks (the sampler's restriction, the loss, the entropy alike):
  at 0.05 the masked logits' fill no longer overflows to -inf, so the loss, entropy and drift stay finite, and
  the sampler's own weights still give a ratio of 1 at the first step."""
  _, records = _digest(tmp_path, f"t{temperature}", ["steps=3", "rollouts.groups_per_micro_batch=2", "batch.rows=4",
                                                     "task.eval_prompts=4", "run.reserve_host_core=false",
                                                     "metrics.backends=[]", f"rollouts.temperature={temperature}",
                                                     "rollouts.placement=shared"])
  for r in records:
    assert all(math.isfinite(r[key]) for key in ("loss", "grad_norm", "entropy", "ppo_kl")), r
  assert abs(records[0]["ppo_kl"]) < 1e-4

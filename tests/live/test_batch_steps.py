"""Several optimizer steps per sampled batch (rollouts.batch_steps) and passes over it (engine.epochs): each batch is
sampled once, its later passes reshuffle whole groups by a seeded rule, staleness counts in batches, and every mode,
a resume inside a batch and an extension train to the digest of one uninterrupted run."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import numpy as np
import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.live import rollout_batches
from orchestrator.data.trajectory import Trajectory
from orchestrator.live.rollout_batches import BatchRollouts, BatchSchedule
from orchestrator.live.weight_versions import WeightVersions

STEPS, MICRO, BATCH_STEPS, EPOCHS = 6, 2, 2, 2  # a batch serves 4 steps: the run ends inside its second batch


def _items(schedule: BatchSchedule, groups_per_micro_batch: int) -> list[list[tuple[int, int]]]:
  """A sampled batch's micro-batches of (group, generation) pairs, in sampling order."""
  g, per_micro = schedule.generations_per_group, groups_per_micro_batch
  return [[(m * per_micro + k // g, k % g) for k in range(per_micro * g)] for m in range(schedule.micro_batches_per_batch)]


@pytest.mark.spec
def test_pass_zero_trains_in_sampling_order_and_later_passes_reshuffle_whole_groups():
  schedule = BatchSchedule(micro_batches_per_step=2, generations_per_group=3, batch_steps=2, epochs=3, seed=7)
  sampled = _items(schedule, groups_per_micro_batch=2)
  assert schedule.steps_per_batch == 6 and [schedule.pass_of(s) for s in range(6)] == [0, 0, 1, 1, 2, 2]
  assert schedule.mini_batch(0, sampled) == sampled[:2] and schedule.mini_batch(1, sampled) == sampled[2:]
  assert schedule.mini_batch(7, sampled) == sampled[2:]  # batch 1's second step, pass 0
  assert schedule.sampled_index(1, 1) == 3 and schedule.sampled_index(2, 0) == 3  # a later pass needs the batch
  for first in (2, 4):  # each later pass: every trajectory once, groups whole and in order, shapes kept
    micro = schedule.mini_batch(first, sampled) + schedule.mini_batch(first + 1, sampled)
    assert [len(m) for m in micro] == [len(m) for m in sampled]
    assert sorted(t for m in micro for t in m) == sorted(t for m in sampled for t in m)
    assert all(m[i:i + 3] == [(m[i][0], 0), (m[i][0], 1), (m[i][0], 2)] for m in micro for i in range(0, 6, 3))
    assert micro != sampled  # reshuffled
  assert schedule.mini_batch(2, sampled) != schedule.mini_batch(4, sampled)  # each pass its own order
  again = BatchSchedule(micro_batches_per_step=2, generations_per_group=3, batch_steps=2, epochs=3, seed=7)
  assert again.mini_batch(3, sampled) == schedule.mini_batch(3, sampled)  # a function of the recipe
  other_seed = dataclasses.replace(schedule, seed=8)
  assert other_seed.mini_batch(2, sampled) != schedule.mini_batch(2, sampled)  # negative control: the seed counts
  assert schedule.mini_batch(8, sampled) != schedule.mini_batch(2, sampled)  # and the batch


@pytest.mark.spec
def test_one_step_per_batch_is_the_step_schedule():
  schedule = BatchSchedule(micro_batches_per_step=3, generations_per_group=2, max_staleness=2)
  sampled = _items(schedule, groups_per_micro_batch=1)
  assert [schedule.version_for(s) for s in range(5)] == [0, 0, 0, 1, 2]
  assert all(schedule.mini_batch(s, sampled) == sampled for s in range(5))
  assert schedule.describe(4) == "step 4"


@pytest.mark.spec
def test_staleness_counts_in_sampled_batches_and_a_position_inside_a_batch_carries_it():
  on_policy = WeightVersions(BatchSchedule(2, 2, batch_steps=2, epochs=2, max_staleness=0), steps=10)
  assert [on_policy.version_for(s) for s in range(9)] == [0, 0, 0, 0, 4, 4, 4, 4, 8]
  assert [on_policy.carried(p) for p in (0, 3, 4, 5)] == [[], [0], [], [1]]  # inside a batch: the batch's rest
  assert not on_policy.blocked_on_sync(3) and on_policy.blocked_on_sync(4)
  for version in range(1, 5):  # only a batch's version is kept: the others no batch samples with
    on_policy.keep(version, f"w{version}")
  assert on_policy.synced == 4 and on_policy.available(4) and not on_policy.available(3)
  stale = WeightVersions(BatchSchedule(2, 2, batch_steps=2, epochs=2, max_staleness=1), steps=10)
  assert [stale.version_for(s) for s in (0, 3, 4, 7, 8)] == [0, 0, 0, 0, 4]
  assert [stale.carried(p) for p in (0, 3, 4, 5, 8)] == [[], [0, 1], [1], [1, 2], [2]]
  stale.restart_at(5)
  assert not stale.can_sample(2) and stale.can_sample(3)


@pytest.mark.spec
def test_batch_keys_default_to_one_step_per_batch_and_one_micro_batch_per_call():
  recipe = recipe_lib.Recipe()
  assert recipe.rollouts.batch_steps == 1 and recipe.engine.epochs == 1 and recipe.rollouts.micro_batches_per_call == 1


@pytest.mark.spec
def test_the_default_recipe_s_batch_keys_go_unread_when_its_sampler_is_replaced(tmp_path):
  """``rollouts.source=synthetic`` on the default recipe: the recipe's batch keys go back to their defaults, each
  source saying why (as its staleness and groups go unread). Given beside the replacement, or in a recipe that
  samples nothing, they are refused: nothing would read them."""
  default = recipe_lib.resolve(None, env={}).recipe
  assert (default.rollouts.batch_steps, default.rollouts.micro_batches_per_call) == (4, "batch")
  assert default.micro_batches_per_call() == 8
  resolved = recipe_lib.resolve(None, env={}, overrides=["rollouts.source=synthetic"])
  assert (resolved.recipe.rollouts.batch_steps, resolved.recipe.rollouts.micro_batches_per_call) == (1, 1)
  assert resolved.sources["rollouts.batch_steps"].startswith("default (dropped: rollouts.source=synthetic (override)")
  assert any("rollouts.micro_batches_per_call=batch is not read" in d for d in resolved.dropped)
  with pytest.raises(recipe_lib.RecipeError, match="rollouts.batch_steps=2 is read by the live loop only"):
    recipe_lib.resolve(None, env={}, overrides=["rollouts.source=synthetic", "rollouts.batch_steps=2"])
  own = tmp_path / "own.yaml"
  own.write_text("model: tiny\nrollouts:\n  source: synthetic\n  micro_batches_per_call: 2\n")
  with pytest.raises(recipe_lib.RecipeError, match="rollouts.micro_batches_per_call=2 is read by the live loop"):
    recipe_lib.resolve(own, env={})


# ---------------------------------------------------------------- the loop on a real engine

TASK_ARGS = dict(length=4, letters=8)


@pytest.fixture(scope="module")
def rig():
  """One compiled engine and one sampler, returned to their start before every run."""
  engine, sampler, task = _engine_and_sampler(sampled_as_the_sampler_samples=True)
  return engine, engine.snapshot(), engine.export_weights(), sampler, task


def _engine_and_sampler(*, sampled_as_the_sampler_samples: bool):
  from orchestrator.engine import build_engine
  from orchestrator.engine.loss import SampledDistribution
  from orchestrator.models.presets import load_preset
  from orchestrator.live.sampler import LiveSampler
  from orchestrator.tasks.tasks import FirstLetter
  from orchestrator.tasks.tokenizer import CharTokenizer, sampled_token_ids

  task = FirstLetter(**TASK_ARGS)
  sampled = SampledDistribution(1.0, tuple(sampled_token_ids(CharTokenizer(), task.answer_alphabet)))
  engine = build_engine("tiny", rows=4, learning_rate=3e-3, sampled=sampled if sampled_as_the_sampler_samples else None)
  sampler = LiveSampler(load_preset("tiny"), CharTokenizer(), seed=0, max_prompt_length=16, max_generation_steps=1,
                        alphabet=task.answer_alphabet)
  return engine, sampler, task


def _run(rig, mode, staleness, *, batch_steps=BATCH_STEPS, epochs=EPOCHS, source_cls=None, per_call=1, calls=None):
  """The run's result and how many micro-batches it sampled."""
  from orchestrator.live.rollouts import LiveRollouts, LiveShape
  from orchestrator.loop.program import ProgramConfig, RLProgram
  from orchestrator.loop.trainer_worker import TrainerWorker
  from policies import StepBoundaryPolicy

  engine, start, initial, sampler, task = rig
  engine.restore(start)
  sampler.sync(initial, 0)
  shape = LiveShape(STEPS, MICRO, 2, 4, staleness, seed=3, batch_steps=batch_steps, epochs=epochs,
                    micro_batches_per_call=per_call)
  source = (source_cls or LiveRollouts)(sampler, task, shape)
  sampled = []
  sample = source._shared.sample_micro_batches
  source._shared.sample_micro_batches = (lambda batch, first, count, *a, **k:
                                         sampled.extend((batch, first + m) for m in range(count))
                                         or (calls is not None and calls.append((batch, first, count)))
                                         or sample(batch, first, count, *a, **k))
  program = RLProgram(TrainerWorker(engine), StepBoundaryPolicy(mode, wait_threshold_s=0.0), source,
                      ProgramConfig(steps=STEPS, micro_batches_per_step=MICRO), weight_sync=source.sync)
  try:
    return program.run(), sampled
  finally:
    source.close()


@pytest.fixture(scope="module")
def runs(rig):
  from policies import Mode

  return {(mode, s): _run(rig, mode, s) for s in (0, 1) for mode in Mode}


@pytest.mark.engine
@pytest.mark.parametrize("staleness", [0, 1])
def test_every_mode_trains_to_one_digest_with_several_steps_per_batch(runs, staleness):
  from policies import Mode

  digests = {mode: runs[(mode, staleness)][0].summary.final_state_digest for mode in Mode}
  assert len(set(digests.values())) == 1, digests
  assert runs[(Mode.OFF, 0)][0].summary.final_state_digest != runs[(Mode.OFF, 1)][0].summary.final_state_digest


@pytest.mark.engine
def test_on_policy_batches_lag_only_after_their_first_step_and_stage_inside_a_batch(runs):
  """At max_staleness 0 a step trains on rollouts of the weights after the last step of the batch before: the
  record's staleness (step - the rollouts' weights version) is 0 at each batch's first step only. Every boundary
  inside a batch stages (its next micro-batch is sampled already); the one before a new batch cannot."""
  from policies import Mode

  records = runs[(Mode.STAGE_BEFORE_UPDATE, 0)][0].records
  assert [r.staleness for r in records] == [0, 1, 2, 3, 0, 1]
  assert [r.weights_version for r in records] == [0, 0, 0, 0, 4, 4]
  assert [r.staged for r in records] == [True, True, True, False, True, False]  # step 5 is the run's last
  assert records[3].next_ready is False
  stale = runs[(Mode.STAGE_BEFORE_UPDATE, 1)][0].records
  assert [r.staleness for r in stale] == [0, 1, 2, 3, 4, 5] and all(r.staged for r in stale[:-1])


@pytest.mark.engine
def test_a_batch_is_sampled_once_and_reused_by_its_steps(rig, runs):
  """Two batches of batch_steps × micro-batches are sampled for six steps of two passes; a run that samples each
  step anew (one step per batch: the negative control) samples every micro-batch it trains and trains elsewhere."""
  from policies import Mode

  result, sampled = runs[(Mode.PIPELINED, 0)]
  assert sampled == [(b, i) for b in range(2) for i in range(BATCH_STEPS * MICRO)]
  resampled, again = _run(rig, Mode.PIPELINED, 0, batch_steps=1, epochs=1)
  assert again == [(s, i) for s in range(STEPS) for i in range(MICRO)]
  assert [r.staleness for r in resampled.records] == [0] * STEPS
  assert resampled.summary.final_state_digest != result.summary.final_state_digest


@pytest.mark.engine
def test_a_whole_batch_sampled_in_one_call_trains_every_mode_to_one_digest(rig, runs):
  """``rollouts.micro_batches_per_call`` = a batch's micro-batches: one sampler call per batch, each micro-batch
  still published, scored and normalised on its own; what trains is a function of the recipe, so every mode
  agrees. One micro-batch per call (the control) calls the sampler once per micro-batch."""
  from policies import Mode

  per_batch = BATCH_STEPS * MICRO
  results = {}
  for mode in Mode:
    calls = []
    result, sampled = _run(rig, mode, 1, per_call=per_batch, calls=calls)
    assert calls == [(b, 0, per_batch) for b in range(2)], calls
    assert sampled == [(b, i) for b in range(2) for i in range(per_batch)]
    results[mode] = result.summary.final_state_digest
  assert len(set(results.values())) == 1, results
  calls = []
  _run(rig, Mode.OFF, 1, calls=calls)
  assert calls == [(b, i, 1) for b in range(2) for i in range(per_batch)]


@pytest.mark.engine
def test_a_skipped_or_differently_seeded_reshuffle_changes_what_trains(rig, runs, monkeypatch):
  from policies import Mode

  digest = runs[(Mode.PIPELINED, 0)][0].summary.final_state_digest
  assert _run(rig, Mode.PIPELINED, 0)[0].summary.final_state_digest == digest  # a rerun agrees
  order = rollout_batches.group_order
  monkeypatch.setattr(rollout_batches, "group_order", lambda seed, batch, pass_, groups: order(seed + 1, batch, pass_,
                                                                                                  groups))
  assert _run(rig, Mode.PIPELINED, 0)[0].summary.final_state_digest != digest
  monkeypatch.setattr(rollout_batches, "group_order", lambda seed, batch, pass_, groups: list(range(groups)))
  assert _run(rig, Mode.PIPELINED, 0)[0].summary.final_state_digest != digest


@pytest.mark.engine
def test_a_batch_s_later_steps_train_against_the_sampler_s_log_probs(rig, runs):
  """The ratio of every step is taken against the sampler's log-probs (the old policy), not the weights the step
  trains: the loss is the clipped surrogate of a ratio that is not 1. The negative control strips them (the loss
  then takes the ratio against the current policy: exactly 1, and a loss of group-centred advantages over
  completions of one length is 0). (Step 5's groups all scored alike: its advantages, and loss, are 0.)"""
  from orchestrator.live.rollouts import LiveRollouts
  from policies import Mode

  class Stripped(LiveRollouts):
    def __next__(self):
      return [[dataclasses.replace(t, old_logprobs=None) for t in micro] for micro in super().__next__()]

  losses = [r.loss for r in runs[(Mode.PIPELINED, 0)][0].records]
  stripped = [r.loss for r in _run(rig, Mode.PIPELINED, 0, source_cls=Stripped)[0].records]
  assert all(abs(loss) < 1e-6 for loss in stripped), stripped
  assert all(abs(loss) > 1e-3 for loss in losses[1:4]), losses  # the first batch's later steps, both passes


@pytest.mark.engine
def test_a_step_on_the_sampler_s_own_weights_has_a_ratio_of_one(runs):
  """The trainer takes its log-probs from the distribution the sampler sampled from (its answer alphabet, its
  temperature): each batch's first step at staleness 0 trains the weights that sampled it, so its ratio is 1 to
  float rounding and its loss 0. The negative control takes them over the whole vocabulary, as a model's own
  distribution: the sampler's log-probs are then larger by its normaliser, the ratio is below 1 before any update,
  and the loss is far from 0."""
  from orchestrator.live.rollouts import LiveRollouts, LiveShape
  from orchestrator.loop.program import ProgramConfig, RLProgram
  from orchestrator.loop.trainer_worker import TrainerWorker
  from policies import Mode, StepBoundaryPolicy

  losses = [r.loss for r in runs[(Mode.PIPELINED, 0)][0].records]
  assert abs(losses[0]) < 1e-4 and abs(losses[4]) < 1e-4, losses
  engine, sampler, task = _engine_and_sampler(sampled_as_the_sampler_samples=False)
  source = LiveRollouts(sampler, task, LiveShape(1, MICRO, 2, 4, 0, seed=3))
  try:
    result = RLProgram(TrainerWorker(engine), StepBoundaryPolicy(Mode.OFF, wait_threshold_s=0.0), source,
                       ProgramConfig(steps=1, micro_batches_per_step=MICRO), weight_sync=source.sync).run()
  finally:
    source.close()
  assert abs(result.records[0].loss) > 1e-2, result.records[0].loss


@pytest.mark.engine
def test_a_position_inside_a_batch_without_the_batch_s_rollouts_is_refused(rig):
  """The negative control of resuming inside a batch: its rest was sampled with weights no checkpoint inside it
  holds, so a position that does not carry them cannot restore; at the batch's edge nothing is owed."""
  from orchestrator.contract import SourceStateError
  from orchestrator.live.rollouts import LiveRollouts, LiveShape

  _, _, _, sampler, task = rig
  shape = LiveShape(STEPS, MICRO, 2, 4, 0, seed=3, batch_steps=BATCH_STEPS, epochs=EPOCHS)
  with pytest.raises(SourceStateError, match=r"carries sampled batches \[\], but max_staleness 0 with 4 steps per"
                                             r" batch needs \[0\]"):
    LiveRollouts(sampler, task, shape).set_state({"kind": "live", "next_step": 3, "sampled": []})
  LiveRollouts(sampler, task, shape).set_state({"kind": "live", "next_step": 4, "sampled": []})


# ---------------------------------------------------------------- run_rl: resume inside a batch, extension

#: The sampler in this process (rollouts.placement=shared): where the sampler runs is not what these runs test (tests/live/test_sampler_process.py pins that its own
#: process samples the same), and a process of its own would start JAX again for every run.
ARGV = ["rollouts.groups_per_micro_batch=2", "batch.rows=4", "task.eval_prompts=4", "run.reserve_host_core=false",
        f"rollouts.batch_steps={BATCH_STEPS}", f"engine.epochs={EPOCHS}", "rollouts.placement=shared"]


def _digest(stdout: str) -> str:
  return re.search(r"^final state digest: (\w+)$", stdout, re.M).group(1)


@pytest.fixture()
def clean_env(monkeypatch):
  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)


@pytest.mark.e2e
@pytest.mark.parametrize("staleness", [0, 1])
def test_a_run_resumed_inside_a_batch_or_at_its_edge_trains_like_one_never_stopped(tmp_path, clean_env, capsys,
                                                                                   staleness):
  """Checkpoints after steps 2 and 3 (and the last); a resume from the one after step 2 (inside the first batch: it carries the
  batch's rest) and from the one after step 3 (the batch's edge) reach the uninterrupted run's digest."""
  from orchestrator.app import cli
  from orchestrator.run_files import run_dir

  run = tmp_path / "run"
  argv = ARGV + [f"rollouts.max_staleness={staleness}", f"steps={STEPS}", "checkpoint.scored_steps=3,4"]
  assert cli.main(argv + ["--out", str(run)]) == 0
  whole = _digest(capsys.readouterr().out)
  records = run_dir.all_records(run)
  for position in (3, 4):  # the position after steps 0-2 (inside batch 0) and after steps 0-3 (its edge)
    copy = tmp_path / f"from-{position}"
    shutil.copytree(run, copy)
    for later in {4, STEPS} - {position}:
      shutil.rmtree(copy / "checkpoints" / str(later))
    metadata = json.loads((copy / "checkpoints" / str(position) / "metadata" / "metadata").read_text())
    carried = [b["batch"] for b in metadata["source_state"]["sampled"]]
    assert carried == ([0] if position == 3 else []) + ([1] if staleness else [])
    assert cli.main(["--resume", str(copy)]) == 0
    assert _digest(capsys.readouterr().out) == whole
    assert [r["reward_mean"] for r in run_dir.all_records(copy)] == [r["reward_mean"] for r in records]


@pytest.mark.e2e
def test_a_run_ending_inside_a_batch_extends_by_resume_like_a_longer_run(tmp_path, clean_env, capsys):
  """Five steps end inside the second batch (steps 4-7); extended to six by --resume --steps, the run trains the
  batch's rest from its last checkpoint and reaches the digest of six steps run at once."""
  from orchestrator.app import cli

  assert cli.main(ARGV + [f"steps={STEPS}", "--out", str(tmp_path / "six")]) == 0
  six = _digest(capsys.readouterr().out)
  run = tmp_path / "five"
  assert cli.main(ARGV + [f"steps={STEPS - 1}", "--out", str(run)]) == 0
  five = _digest(capsys.readouterr().out)
  assert cli.main(["--resume", str(run), "--steps", str(STEPS)]) == 0
  assert _digest(capsys.readouterr().out) == six != five


def _trajectory(completion_tokens: int, group: int) -> Trajectory:
  return Trajectory(np.array([1], np.int32), np.arange(completion_tokens, dtype=np.int32), 0.0,
                    np.zeros(completion_tokens, np.float32), group)


@pytest.mark.spec
def test_a_steps_stats_give_its_rewards_range_completion_lengths_and_the_share_cut_at_the_limit():
  """Two steps of one micro-batch in one sampled batch: each step's figures are its own micro-batch's."""
  schedule = BatchSchedule(micro_batches_per_step=1, generations_per_group=2, batch_steps=2)
  rollouts = BatchRollouts(0, 0)
  rollouts.add([_trajectory(3, 0), _trajectory(5, 0)], [0.0, 1.0], [False, True], 8, 0.5, [False, True])
  rollouts.add([_trajectory(2, 1), _trajectory(2, 1)], [0.5, 0.5], [False, False], 4, 0.5, [False, False])
  first, second = rollouts.stats(schedule, 0), rollouts.stats(schedule, 1)
  assert (first.reward_min, first.reward_max, first.completion_tokens_mean, first.completion_tokens_max,
          first.truncated_fraction) == (0.0, 1.0, 4.0, 5, 0.5)
  assert (second.reward_min, second.reward_max, second.completion_tokens_mean, second.completion_tokens_max,
          second.truncated_fraction) == (0.5, 0.5, 2.0, 2, 0.0)
  assert first.reward_group_std == pytest.approx(0.5 ** 0.5) and first.frac_reward_zero_std == 0.0  # 0 and 1
  assert (second.reward_group_std, second.frac_reward_zero_std) == (0.0, 1.0)  # equal rewards: no gradient
  fixed = BatchRollouts(0, 0)  # fixed-length answers have no end: no share is claimed
  fixed.add([_trajectory(1, 0), _trajectory(1, 0)], [1.0, 0.0], [True, False], 2, 0.1)
  assert fixed.stats(BatchSchedule(micro_batches_per_step=1, generations_per_group=2), 0).truncated_fraction is None
  assert BatchRollouts.from_json(rollouts.to_json()).truncated == [[False, True], [False, False]]
  routed = BatchRollouts(0, 0)  # routing replay's ids survive a checkpoint, compactly
  routing = np.arange(4 * 3 * 2, dtype=np.int16).reshape(4, 3, 2)
  routed.add([dataclasses.replace(_trajectory(3, 0), routing=routing)], [1.0], [True], 3, 0.1)
  saved = routed.to_json()
  assert "int16_base64" in json.dumps(saved)
  back = BatchRollouts.from_json(json.loads(json.dumps(saved))).payloads[0][0].routing
  assert back.dtype == np.int16 and np.array_equal(back, routing)


@pytest.mark.spec
def test_per_token_versions_give_a_step_its_tokens_version_range_and_mean_age_and_survive_a_checkpoint():
  """In-flight updates: each completion token's version (``Trajectory.versions``) gives the step's oldest, newest
  and mean age (the step minus the version); without them the fields are absent and the batch's JSON is what it
  was. A mix of trajectories with and without versions, or versions not one per token, is refused."""
  schedule = BatchSchedule(micro_batches_per_step=1, generations_per_group=2, batch_steps=2, max_staleness=1)
  versioned = BatchRollouts(1, 0)  # batch 1 of 2 steps a batch: steps 2 and 3
  first = [dataclasses.replace(_trajectory(3, 0), versions=np.array([0, 0, 1])),
           dataclasses.replace(_trajectory(2, 0), versions=np.array([0, 1]))]
  versioned.add(first, [0.0, 1.0], [False, True], 5, 0.5)
  versioned.add([dataclasses.replace(_trajectory(2, 1), versions=np.array([1, 2]))] * 2, [0.5, 0.5],
                [False, False], 4, 0.5)
  stats = versioned.stats(schedule, 2)
  assert (stats.token_version_min, stats.token_version_max) == (0, 1)
  assert stats.token_age_mean == pytest.approx(2 - 2 / 5)  # versions 0, 0, 1, 0, 1 at step 2
  later = versioned.stats(schedule, 3)
  assert (later.token_version_min, later.token_version_max, later.token_age_mean) == (1, 2, 1.5)
  assert stats.weights_version == 0 and stats.staleness == 2  # the oldest token's, as without in-flight updates
  back = BatchRollouts.from_json(json.loads(json.dumps(versioned.to_json())))
  assert back.payloads[0][0].versions.tolist() == [0, 0, 1]
  assert back.stats(schedule, 2) == stats
  plain = BatchRollouts(0, 0)
  plain.add([_trajectory(3, 0), _trajectory(2, 0)], [0.0, 1.0], [False, True], 5, 0.5)
  plain_stats = plain.stats(BatchSchedule(micro_batches_per_step=1, generations_per_group=2), 0)
  assert (plain_stats.token_version_min, plain_stats.token_version_max, plain_stats.token_age_mean) == (None,) * 3
  assert "versions" not in json.dumps(plain.to_json())
  mixed = BatchRollouts(0, 0)
  mixed.add([first[0], _trajectory(2, 0)], [0.0, 1.0], [False, True], 5, 0.5)
  with pytest.raises(ValueError, match="1 of 2 trajectories carry no per-token versions"):
    mixed.stats(BatchSchedule(micro_batches_per_step=1, generations_per_group=2), 0)
  short = BatchRollouts(0, 0)
  short.add([dataclasses.replace(_trajectory(3, 0), versions=np.array([0, 1]))] * 2, [0.0, 1.0], [False, True],
            6, 0.5)
  with pytest.raises(ValueError, match=r"versions have shape \(2,\); they must match its completion_ids' \(3,\)"):
    short.stats(BatchSchedule(micro_batches_per_step=1, generations_per_group=2), 0)


@pytest.mark.spec
def test_per_token_versions_leave_the_packed_content_and_its_digest_as_they_were():
  """Packing never reads the versions: a payload with them packs to the same arrays and content digest.
  Negative control: a changed log-prob does change the digest."""
  from orchestrator.data.packing import content_digest, pack_payload
  payload = [_trajectory(3, 0), _trajectory(2, 1)]
  pack = lambda p: content_digest(pack_payload(p, rows=2, tokens_per_row=8, vocab_size=16))
  with_versions = [dataclasses.replace(t, versions=np.arange(len(t.completion_ids))) for t in payload]
  assert pack(with_versions) == pack(payload)
  other = [dataclasses.replace(payload[0], old_logprobs=np.full(3, -0.5, np.float32)), payload[1]]
  assert pack(other) != pack(payload)

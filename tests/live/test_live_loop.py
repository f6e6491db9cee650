"""The live RL loop: staleness decides whether a boundary can stage, and every mode trains identically."""

from __future__ import annotations

import json
import re
import shutil
import threading

import pytest

from orchestrator.app import cli
from orchestrator import recipe as recipe_lib
from orchestrator.engine.checkpointing import Checkpointer
from orchestrator.live.rollouts import LiveRollouts, LiveShape, RolloutError
from orchestrator.run_files import run_dir
from orchestrator.tasks.tasks import FirstLetter
from orchestrator.loop.program import ProgramConfig, RLProgram, StoppedWithoutCheckpointError
from orchestrator.loop.trainer_worker import TrainerWorker
from policies import Mode, StepBoundaryPolicy
from tests.fakes import run_in_thread

STEPS, MICRO = 4, 2
TASK = FirstLetter(length=4, letters=8)


@pytest.fixture(scope="module")
def rig():
  """One compiled engine and one sampler, returned to their start before every run."""
  from orchestrator.engine import build_engine
  from orchestrator.models.presets import load_preset
  from orchestrator.live.sampler import LiveSampler
  from orchestrator.tasks.tokenizer import CharTokenizer

  engine = build_engine("tiny", rows=4, learning_rate=3e-3)
  sampler = LiveSampler(load_preset("tiny"), CharTokenizer(), seed=0, max_prompt_length=16, max_generation_steps=1,
                        alphabet=TASK.answer_alphabet)
  return engine, engine.snapshot(), engine.export_weights(), sampler


def _run(rig, mode, staleness, task=TASK):
  engine, start, initial, sampler = rig
  engine.restore(start)
  sampler.sync(initial, 0)
  source = LiveRollouts(sampler, task, LiveShape(STEPS, MICRO, 2, 4, staleness, seed=3))
  worker = TrainerWorker(engine)
  policy = StepBoundaryPolicy(mode, wait_threshold_s=0.0)
  program = RLProgram(worker, policy, source, ProgramConfig(steps=STEPS, micro_batches_per_step=MICRO),
                      weight_sync=source.sync)
  try:
    return program.run(), policy
  finally:
    source.close()


@pytest.fixture(scope="module")
def runs(rig):
  return {(mode, s): _run(rig, mode, s) for s in (0, 1) for mode in Mode}


@pytest.mark.engine
@pytest.mark.parametrize("staleness", [0, 1])
def test_every_mode_trains_to_the_same_digest(runs, staleness):
  digests = {mode: runs[(mode, staleness)][0].summary.final_state_digest for mode in Mode}
  assert len(set(digests.values())) == 1, digests
  rewards = {mode: [r.reward_mean for r in runs[(mode, staleness)][0].records] for mode in Mode}
  assert len({tuple(v) for v in rewards.values()}) == 1


@pytest.mark.engine
def test_staleness_changes_what_trains(runs):
  """Negative control: the weights version is part of what a step trains on."""
  assert (runs[(Mode.OFF, 0)][0].summary.final_state_digest
          != runs[(Mode.OFF, 1)][0].summary.final_state_digest)


@pytest.mark.engine
@pytest.mark.parametrize("mode", [Mode.STAGE_BEFORE_UPDATE, Mode.STAGE_AFTER_UPDATE], ids=lambda m: m.name)
def test_on_policy_boundaries_cannot_stage_and_the_records_say_why(runs, mode):
  result, policy = runs[(mode, 0)]
  boundaries = result.records[:-1]
  assert [r.staged for r in boundaries] == [False] * (STEPS - 1)
  assert all(r.next_ready is False and "on-policy" in r.reason for r in boundaries)
  assert policy.counters["next_not_ready"] == STEPS - 1 and policy.counters["auto_disable"] == 0
  assert [r.weights_version for r in result.records] == [0, 1, 2, 3]  # version = step at staleness 0


@pytest.mark.engine
@pytest.mark.parametrize("mode", [Mode.STAGE_BEFORE_UPDATE, Mode.STAGE_AFTER_UPDATE], ids=lambda m: m.name)
def test_with_one_step_of_staleness_every_boundary_stages(runs, mode):
  result, policy = runs[(mode, 1)]
  assert [r.staged for r in result.records[:-1]] == [True] * (STEPS - 1)
  assert all(r.next_ready for r in result.records[:-1])
  assert [r.weights_version for r in result.records] == [0, 0, 1, 2]
  assert [r.staleness for r in result.records] == [0, 1, 1, 1]
  assert policy.mode is mode and policy.counters["auto_disable"] == 0
  for r in result.records:
    assert 0 <= r.reward_mean <= 1 and r.sampled_tokens_per_s > 0


class _FailingTask(FirstLetter):
  def problem(self, seed, split, index):
    if split == "train" and index >= 2 * 2 * 2:  # step 2's first group
      raise ValueError("the task's prompt file is gone")
    return super().problem(seed, split, index)


@pytest.mark.engine
def test_a_failing_rollout_thread_surfaces_at_the_next_boundary_with_records_kept(rig):
  with pytest.raises(RolloutError, match="failed while sampling step 2: ValueError: the task's prompt file is gone"):
    _run(rig, Mode.STAGE_BEFORE_UPDATE, 1, task=_FailingTask(length=4, letters=8))


@pytest.mark.engine
def test_a_stop_ends_the_wait_for_a_stuck_sampler(rig):
  """The sampling thread hangs inside step 2 (holding the sampler). The loop, waiting for step 2's rollouts
  at boundary 1, keeps waiting until stop_requested turns true, then ends within a bounded time; step 2's
  checkpoint would have to carry those rollouts, so the run ends with the line that says so. The evaluation,
  which needs the sampler, gives up on a stop too."""
  engine, start, initial, sampler = rig
  engine.restore(start)
  sampler.sync(initial, 0)
  reached, release, stop = threading.Event(), threading.Event(), threading.Event()

  class StuckTask(FirstLetter):
    def problem(self, seed, split, index):
      if split == "train" and index >= 2 * 2 * 2:  # step 2's first group
        reached.set()
        release.wait(120)
      return super().problem(seed, split, index)

  source = LiveRollouts(sampler, StuckTask(length=4, letters=8), LiveShape(STEPS, MICRO, 2, 4, 1, seed=3))
  program = RLProgram(TrainerWorker(engine), StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, wait_threshold_s=0.0),
                      source, ProgramConfig(steps=STEPS, micro_batches_per_step=MICRO, stop_grace_s=0.2),
                      weight_sync=source.sync, stop_requested=lambda: "SIGTERM" if stop.is_set() else None)
  thread, outcome = run_in_thread(program)
  try:
    assert reached.wait(120)
    thread.join(timeout=0.5)
    assert thread.is_alive() and not outcome  # no stop: still waiting
    stop.set()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the loop did not end after the stop"
    assert isinstance(outcome["error"], StoppedWithoutCheckpointError)
    assert str(outcome["error"]).startswith("stopped by SIGTERM after step 1, but no checkpoint of it could be"
                                            " written")
    assert [r.step for r in program.records] == [0]
    assert source.evaluate(None, 0, 4, stop=stop.is_set) is None  # the sampler is still held
  finally:
    release.set()
    source.close()
  source._sampling.thread.join(timeout=60)  # the sampler is shared with the other tests here
  assert not source._sampling.thread.is_alive()


@pytest.mark.engine
def test_the_wait_for_a_step_s_rollouts_is_its_rollout_wait_and_is_not_judged(rig):
  """The loop polls ready() before it takes a step; the time it waited there is the boundary's rollout wait, so
  the policy does not judge that boundary's stage (a short device wait after waiting for sampling says nothing
  about staging). Sampling step 1 is held until the loop has waited one poll for it."""
  release = threading.Event()

  class Watched(LiveRollouts):
    def ready(self, step, timeout_s):
      done = super().ready(step, timeout_s)
      if step == 1 and not done:
        release.set()  # the loop waited for step 1: let its sampling go on
      return done

  # any judged wait would be low
  result, policy, _ = _run_holding(rig, MICRO * 2, Watched, release, wait_threshold_s=1e9)
  assert release.is_set() and result.records[0].rollout_wait_s > 0
  assert policy.counters["rollout_waits"] >= 1 and result.records[0].low_wait is None


def _run_holding(rig, group: int, watched: type, release: threading.Event, wait_threshold_s: float = 0.0) -> tuple:
  """A STAGE_BEFORE_UPDATE run at staleness 1 on ``watched`` (a ``LiveRollouts`` that sets ``release`` where the
  test says), whose sampling of train group ``group`` waits for ``release`` (at most 20 s); the result, the
  policy and whether the release came in time."""
  engine, start, initial, sampler = rig
  engine.restore(start)
  sampler.sync(initial, 0)
  held = []

  class HeldTask(FirstLetter):
    def problem(self, seed, split, index):
      if split == "train" and index == group:
        held.append(release.wait(20))
      return super().problem(seed, split, index)

  source = watched(sampler, HeldTask(length=4, letters=8), LiveShape(STEPS, MICRO, 2, 4, 1, seed=3))
  policy = StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, wait_threshold_s=wait_threshold_s)
  try:
    result = RLProgram(TrainerWorker(engine), policy, source, ProgramConfig(steps=STEPS, micro_batches_per_step=MICRO),
                       weight_sync=source.sync).run()
  finally:
    release.set()
    source.close()
  return result, policy, held == [True]


@pytest.mark.engine
def test_a_step_is_taken_and_staged_once_its_first_micro_batch_is_sampled(rig, runs):
  """Sampling of step 1's second micro-batch is held until the loop waits for it, inside step 1: so the
  boundary before staged step 1's first micro-batch while its second was not sampled yet. The seconds the
  loop waited there are step 1's micro_batch_wait_s, and what trains is unchanged (the digest of the run
  that never waited). Without streaming the loop would wait for the whole step at boundary 0 and the hold
  would time out."""
  release = threading.Event()

  class Watched(LiveRollouts):
    def micro_batch_ready(self, step, index, timeout_s):
      done = super().micro_batch_ready(step, index, 0.0)
      if (step, index) == (1, 1) and not done:
        release.set()  # the loop waits for it inside step 1: let its sampling go on
        done = super().micro_batch_ready(step, index, timeout_s)
      return done

  result, _, released = _run_holding(rig, (1 * MICRO + 1) * 2, Watched, release)  # step 1, micro-batch 1
  assert released, "step 1's second micro-batch was not waited for inside step 1"
  assert result.records[0].staged and result.records[1].micro_batch_wait_s > 0
  assert result.summary.final_state_digest == runs[(Mode.STAGE_BEFORE_UPDATE, 1)][0].summary.final_state_digest


@pytest.mark.engine
def test_a_boundary_whose_next_micro_batch_is_not_sampled_stages_it_after_the_update(rig, runs):
  """STAGE_BEFORE_UPDATE, with step 1's sampling held until the loop waits to take it: boundary 0 is planned
  while step 1's first micro-batch is not sampled, so it stages after the update (the update is not held back
  for the sampler); later boundaries stage before it as the mode says; what trains is unchanged."""
  from policies.call_order import Action
  from policies.step_boundary import UPDATE_FIRST_REASON

  release = threading.Event()

  class Watched(LiveRollouts):
    def ready(self, step, timeout_s):
      done = super().ready(step, timeout_s)
      if step == 1 and timeout_s > 0 and not done:
        release.set()  # the loop waits to take step 1 (after the update was dispatched)
      return done

  result, policy, released = _run_holding(rig, MICRO * 2, Watched, release)  # step 1's first group
  first = result.records[0]
  assert released and first.staged and first.reason == UPDATE_FIRST_REASON and first.rollout_wait_s > 0
  assert first.actions.index(Action.UPDATE.value) < first.actions.index(Action.STAGE_FIRST.value)
  assert policy.counters["staged_after_update_for_rollouts"] >= 1 and policy.mode is Mode.STAGE_BEFORE_UPDATE
  assert result.summary.final_state_digest == runs[(Mode.STAGE_BEFORE_UPDATE, 1)][0].summary.final_state_digest


def _new_run(tmp_path, monkeypatch, make_worker, source):
  """``app.run.build_run`` of a 4-step default-recipe run on ``source``, its trainer from ``make_worker``."""
  from orchestrator.app import run as app_run

  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(app_run, "make_worker", make_worker)
  recipe = recipe_lib.resolve(None, overrides=[f"steps={STEPS}", "task.eval_prompts=16"]).recipe
  return app_run.build_run(recipe, tmp_path / "run", source=source, run_id="bring-up",
                           checkpoint_dir=str(tmp_path / "run" / "checkpoints"))


@pytest.mark.e2e
def test_a_new_live_run_samples_while_its_trainer_is_built_and_evaluates_its_start_after_the_last_step(
    rig, tmp_path, monkeypatch):
  """build_run starts sampling before it asks for the trainer, and the run trains to the digest of one whose
  sampling began with its first step; its start evaluation runs after the last step, on a copy of the start's
  weights, and gives the figure that evaluating them before any step gives."""
  from orchestrator.engine.diagnostics import tree_digest

  engine, start, initial, sampler = rig
  later = _run(rig, Mode.STAGE_BEFORE_UPDATE, 1)[0].summary.final_state_digest  # sampling began at step 0
  engine.restore(start)
  source = LiveRollouts(sampler, TASK, LiveShape(STEPS, MICRO, 2, 4, 1, seed=3))
  expected = source.evaluate(initial, 0, 16)  # before any step (the sampler then holds version 0)
  evaluate, evaluated, handle = source.evaluate, [], None

  def noted(weights, version, prompts, *, pass_k=0, stop=None):
    evaluated.append((version, tree_digest(weights), len(handle.program.records)))
    return evaluate(weights, version, prompts, pass_k=pass_k, stop=stop)

  def make_worker(recipe, closers, *, checkpoint_dir, write_dir):
    assert source._sampling.thread is not None and source._sampling.thread.is_alive()  # sampling already
    # A run checkpoints its last step: the shared engine was built without the directory run_rl gives one.
    monkeypatch.setattr(engine, "_checkpointer", Checkpointer(checkpoint_dir))
    return TrainerWorker(engine), None

  source.evaluate = noted
  handle = _new_run(tmp_path, monkeypatch, make_worker, source)
  try:
    result = handle.run()
  finally:
    handle.close()
  assert result.summary.final_state_digest == later
  assert evaluated == [(0, tree_digest(initial), STEPS), (STEPS, tree_digest(engine.export_weights()), STEPS)]
  assert result.summary.evaluation.eval_accuracy_start == expected.accuracy


@pytest.mark.engine
def test_a_new_live_run_whose_trainer_cannot_be_built_stops_its_sampling(rig, tmp_path, monkeypatch):
  engine, start, initial, sampler = rig
  sampler.sync(initial, 0)
  source = LiveRollouts(sampler, TASK, LiveShape(STEPS, MICRO, 2, 4, 1, seed=3))

  def make_worker(recipe, closers, *, checkpoint_dir, write_dir):
    raise RuntimeError("no trainer here")

  with pytest.raises(RuntimeError, match="no trainer here"):
    _new_run(tmp_path, monkeypatch, make_worker, source)
  assert source._sampling.thread is not None
  source._sampling.thread.join(timeout=60)  # closed: the thread ends after the step it was sampling
  assert not source._sampling.thread.is_alive()


#: The step schedule these runs pin (step s trains on rollouts of weights version s - 1): one optimizer step per
#: sampled batch, one micro-batch per sampler call, where the default recipe samples a batch of four steps at once.
PER_STEP = ["rollouts.batch_steps=1", "engine.epochs=1", "rollouts.micro_batches_per_call=1"]
#: The sampler in this process (rollouts.placement=shared): where the sampler runs is not what these runs test (tests/live/test_sampler_process.py pins that its own
#: process samples the same), and a process of its own would start JAX again for every run.
SAMPLER_HERE = ["rollouts.placement=shared"]


def _digest(stdout: str) -> str:
  return re.search(r"^final state digest: (\w+)$", stdout, re.M).group(1)


@pytest.mark.e2e
def test_a_finished_live_run_extended_by_resume_trains_like_a_longer_run(tmp_path, monkeypatch, capsys):
  """A live run of 4 steps with checkpoints, resumed with --steps 8, reaches the digest of 8 steps run at once.
  Step 4 trains on rollouts of weights version 3 (staleness 1), which no checkpoint after 4 steps holds: the
  last checkpoint carries step 4's rollouts, sampled when it was written."""
  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)
  argv = ["rollouts.groups_per_micro_batch=2", "batch.rows=4", "task.eval_prompts=4", "checkpoint.every=2",
          "run.reserve_host_core=false", *PER_STEP, *SAMPLER_HERE]
  assert cli.main(argv + ["steps=8", "--out", str(tmp_path / "eight")]) == 0
  eight = _digest(capsys.readouterr().out)
  run = tmp_path / "four"
  assert cli.main(argv + ["steps=4", "--out", str(run)]) == 0
  four = _digest(capsys.readouterr().out)
  assert cli.main(["--resume", str(run), "--steps", "8"]) == 0
  assert _digest(capsys.readouterr().out) == eight != four


@pytest.mark.e2e
def test_run_rl_runs_the_live_loop_and_resumes_it_exactly(tmp_path, monkeypatch):
  """Through run_rl: reward and accuracy are recorded, the plot is drawn, and a resume from a mid-run
  checkpoint (whose next step was sampled with older weights) repeats the run bit for bit."""
  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)
  run = tmp_path / "run"
  argv = ["steps=4", "rollouts.groups_per_micro_batch=2", "batch.rows=4", "task.eval_prompts=8",
          "checkpoint.every=2", "run.reserve_host_core=false", *PER_STEP, *SAMPLER_HERE, "--out", str(run)]
  assert cli.main(argv) == 0
  first = json.loads((run / "summary.json").read_text())
  assert first["eval_accuracy_start"] is not None and first["reward_first_step"] is not None
  assert (run / "reward.png").is_file()
  records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
  assert all(r["reward_mean"] is not None and r["weights_version"] == max(0, r["step"] - 1) for r in records)
  # The sampler shares the trainer's devices: each step says how long it sampled there (the measured saving
  # leaves those spans out); one step at least waited for its rollouts, so a call ran inside it.
  on_devices = [r["sampling_on_trainer_devices_s"] for r in records]
  assert all(s is not None and s >= 0 for s in on_devices) and max(on_devices) > 0
  shutil.rmtree(run / "checkpoints" / "4")
  assert cli.main(["--resume", str(run)]) == 0
  again = json.loads((run_dir.latest_segment(run) / "summary.json").read_text())
  assert again["final_state_digest"] == first["final_state_digest"] and again["segment"] == 1
  again_records = run_dir.all_records(run)
  assert [r["reward_mean"] for r in again_records] == [r["reward_mean"] for r in records]


@pytest.mark.e2e
def test_a_live_run_records_the_rollouts_it_trained_on_and_they_replay(tmp_path, monkeypatch, capsys):
  """The recording keeps the distribution its rollouts were sampled from (temperature 0.7 over the task's
  answer alphabet), and the replay's loss takes the trainer's log-probs the same way: on the sampler's own
  weights (step 0, the run's start) the ratio is 1 — no drift, nothing clipped. Negative controls: told the
  rollouts are the model's own distribution, the replay drifts at step 0; a live recording written without
  the key is refused in one line naming it."""
  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)
  recording = tmp_path / "recording"
  shape = ["rollouts.groups_per_micro_batch=2", "batch.rows=4", "task.eval_prompts=4", "run.reserve_host_core=false",
           "rollouts.temperature=0.7", *PER_STEP, *SAMPLER_HERE]
  assert cli.main(["record", "steps=3", *shape, f"run.out={tmp_path / 'run'}", "--out", str(recording)]) == 0
  manifest_path = recording / "manifest.json"
  manifest = json.loads(manifest_path.read_text())
  assert manifest["num_groups"] == 3 * MICRO * 2 and manifest["produced_by"]["tool"] == "run_rl (live loop)"
  assert manifest["sampled_distribution"]["temperature"] == 0.7
  assert len(manifest["sampled_distribution"]["token_ids"]) == TASK.letters  # the answer alphabet's ids

  # the live run's micro-batch shape (its tokens per row derived from the task), so each replayed step holds
  # what the live step held: a wider row would pack the next batch's groups, sampled with newer weights
  tokens = json.loads((tmp_path / "run" / "config.json").read_text())["config"]["batch"]["tokens_per_row"]

  def replay_step_0(out):
    code = cli.main(["steps=1", "rollouts.source=recording", f"rollouts.recording={recording}", *shape,
                     f"batch.tokens_per_row={tokens}", "--out", str(tmp_path / out)])
    return code, (json.loads((tmp_path / out / "records.jsonl").read_text().splitlines()[0]) if code == 0 else None)

  code, first = replay_step_0("replay")
  assert code == 0 and abs(first["ppo_kl"]) < 1e-5 and first["clip_fraction"] == 0.0
  manifest_path.write_text(json.dumps(dict(manifest, sampled_distribution=None)))
  code, plain = replay_step_0("replay-plain")
  assert code == 0 and abs(plain["ppo_kl"]) > 1e-2
  manifest_path.write_text(json.dumps({k: v for k, v in manifest.items() if k != "sampled_distribution"}))
  capsys.readouterr()
  assert replay_step_0("replay-old") == (2, None)
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "manifest key sampled_distribution" in err[0] and not (tmp_path / "replay-old").exists()
  assert cli.main(["record", "steps=3", *shape, f"run.out={tmp_path / 'run2'}", "--out", str(recording)]) == 2

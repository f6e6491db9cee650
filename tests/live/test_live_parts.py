"""Parts of the live RL loop: the character tokenizer, tasks and rewards, GRPO advantages, the sampler, and the
loop's waits for rollouts (a stop ends them)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import signal
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from orchestrator.app import outcome as app_outcome, signals
from orchestrator.distributed import job as job_lib
from orchestrator.distributed.agreement import SingleProcess
from orchestrator.tasks.rewards import Reward, Term
from orchestrator.tasks.tasks import (TASKS, ModularAddition, Problem, ReverseString, _held_out, group_advantages,
                                     make_task, split_sizes)
from orchestrator.tasks.tokenizer import EOS, CharTokenizer, sampled_token_ids
from orchestrator.live.rollout_batches import BatchSchedule
from orchestrator.live.weight_versions import WeightVersions
from orchestrator.loop.program import NonFiniteStepError, ProgramConfig, RLProgram, StoppedWithoutCheckpointError
from orchestrator.loop.trainer_worker import TrainerWorker
from orchestrator.recipe import RecipeError
from orchestrator.recipe.task_section import TASK_RANGES, TASK_SIZE_KEYS, TaskSection
from policies import Mode, StepBoundaryPolicy
from tests.fakes import DivergingEngine, RecordingEngine, StuckLiveSource, run_in_thread


@pytest.mark.spec
def test_tokenizer_round_trips_and_stops_at_eos():
  tok = CharTokenizer()
  ids = tok.encode("3+4%7=")
  assert tok.decode(ids) == "3+4%7=" and min(ids) >= 3 and max(ids) < tok.vocab_size
  assert tok.decode(ids + [EOS] + tok.encode("junk")) == "3+4%7="
  assert tok.decode([0, 1] + ids + [10_000]) == "3+4%7="  # pad, bos and unknown ids are skipped
  with pytest.raises(ValueError, match="character 'Q' at 1 of 'aQ' is not in the tokenizer's alphabet"):
    tok.encode("aQ")


@pytest.mark.spec
@pytest.mark.parametrize("task", [ModularAddition(), ReverseString()], ids=lambda t: t.name)
def test_problems_are_deterministic_and_held_out_problems_never_train(task):
  train = {task.problem(0, "train", i).prompt for i in range(300)}
  held_out = {task.problem(0, "eval", i).prompt for i in range(100)}
  assert task.problem(0, "train", 5) == task.problem(0, "train", 5)
  assert task.problem(0, "train", 5) != task.problem(1, "train", 5) or task.problem(0, "train", 6) != task.problem(
      1, "train", 6)
  assert train and held_out and not train & held_out


@pytest.mark.spec
@pytest.mark.parametrize(
    "problem,completion,reward",
    [
        (Problem("3+4%7=", "0"), "0", 1.0),
        (Problem("3+4%7=", "0"), " 0 ", 1.0),
        (Problem("3+4%7=", "0"), "7", 0.0),
        (Problem("3+4%7=", "0"), "00", 0.0),
        (Problem("3+4%7=", "0"), "", 0.0),
        (Problem("3+4%7=", "0"), "0+", 0.0),
        (Problem("rev:abc>", "cba"), "cba", 1.0),
        (Problem("rev:abc>", "cba"), "abc", 0.0),
        (Problem("rev:abc>", "cba"), "cb", 0.0),
        (Problem("rev:abc>", "cba"), None, 0.0),
    ],
)
def test_rewards_on_hand_made_completions(problem, completion, reward):
  task = ModularAddition() if "%" in problem.prompt else ReverseString()
  assert task.reward(problem, completion) == reward


@pytest.mark.spec
def test_answers_are_right():
  p = ModularAddition(modulus=7).problem(3, "train", 0)
  a, rest = p.prompt.split("+")
  b = rest.split("%")[0]
  assert p.answer == str((int(a) + int(b)) % 7)
  r = ReverseString(length=4).problem(3, "train", 0)
  assert r.answer == r.prompt[len("rev:"):-1][::-1]


@pytest.mark.spec
def test_make_task_refuses_unknown_names_and_settings():
  assert make_task("reverse", length=2).length == 2
  with pytest.raises(ValueError, match="task.name='sort' is not a task"):
    make_task("sort")
  with pytest.raises(ValueError, match="has no settings \\['width'\\]"):
    make_task("modular_addition", width=3)


@pytest.mark.spec
def test_a_task_s_prompts_are_the_ones_it_draws():
  for task in (ModularAddition(modulus=3), ReverseString(length=2, letters=3)):
    space = set(task.prompts())
    drawn = {task.problem(0, split, i).prompt for split in ("train", "eval") for i in range(200)}
    assert len(space) == 9 and drawn == space


def _all_sizes(name):
  """Every combination of ``name``'s size keys in their recipe ranges."""
  keys = TASK_SIZE_KEYS[name]
  for values in itertools.product(*(range(TASK_RANGES[k][0], TASK_RANGES[k][1] + 1) for k in keys)):
    yield dict(zip(keys, values))


@pytest.mark.spec
@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_size_in_range_draws_from_both_splits_or_is_refused(name):
  """The whole class, not the examples: a task whose few prompts all fall on one side of the held-out split
  would draw from the other forever. Every size the recipe accepts draws from both; the refused ones really
  leave a split empty (counted over the whole prompt space)."""
  refused = []
  for sizes in _all_sizes(name):
    task = TASKS[name](**sizes)
    try:
      TaskSection(name=name, **sizes).validate()
    except RecipeError as e:
      assert "split empty" in str(e), e
      sides = {_held_out(p, task.eval_share) for p in task.prompts()}
      assert len(sides) == 1, sizes  # every prompt on one side
      with pytest.raises(ValueError, match="split empty"):
        make_task(name, **sizes)
      refused.append(tuple(sizes.values()))
      continue
    assert task.problem(0, "train", 0).prompt and task.problem(0, "eval", 0).prompt
  expected = {"modular_addition": [(2,)], "reverse": [(2, 1), (3, 1)], "first_letter": [(2, 1), (2, 3), (3, 1)]}
  assert refused == expected[name]


@pytest.mark.spec
def test_split_sizes_count_a_small_space_exactly_and_stop_early_on_a_large_one():
  assert split_sizes(ModularAddition(modulus=2)) == split_sizes(ModularAddition(modulus=2), enough=10)
  small = split_sizes(ModularAddition(modulus=2))
  assert (small.train, small.eval, small.exact, small.empty) == (4, 0, True, "evaluation")
  large = split_sizes(ReverseString(length=10, letters=26), enough=64)
  assert not large.exact and large.train >= 64 and large.eval == 64 and large.empty is None


@pytest.mark.engine
def test_group_advantages_center_each_group():
  adv = group_advantages(np.array([1, 0, 0, 0, 1, 1, 1, 1], np.float32), 4)
  assert adv[:4].sum() == pytest.approx(0, abs=1e-5) and adv[0] > 0 > adv[1]
  assert np.allclose(adv[4:], 0)  # a group that all agrees teaches nothing
  with pytest.raises(ValueError, match="do not split into groups of 3"):
    group_advantages(np.ones(4), 3)


@pytest.mark.engine
def test_advantage_scaling_none_leaves_out_the_group_std_as_dr_grpo_does():
  rewards = np.array([1, 0, 0, 0, 3, 1, 1, 1], np.float32)
  scaled, centred = group_advantages(rewards, 4), group_advantages(rewards, 4, "none")
  np.testing.assert_allclose(centred, [0.75, -0.25, -0.25, -0.25, 1.5, -0.5, -0.5, -0.5], atol=1e-6)
  np.testing.assert_allclose(scaled[:4], centred[:4] / (np.std(rewards[:4], ddof=1) + 1e-6), rtol=1e-5)
  assert not np.allclose(scaled, centred)  # the control: the default divides
  with pytest.raises(ValueError, match="advantage scaling 'std': use group or none"):
    group_advantages(rewards, 4, "std")


@pytest.fixture(scope="module")
def sampler():
  from orchestrator.models.presets import load_preset
  from orchestrator.live.sampler import LiveSampler

  return LiveSampler(load_preset("tiny"), CharTokenizer(), seed=0, max_prompt_length=16, max_generation_steps=4)


@pytest.mark.engine
def test_the_pad_id_is_never_sampled_unless_it_ends_a_sequence():
  """Tunix's sampler hides every pad id in a sequence from the tokens decoded after it; the trainer does not."""
  class PadIsEos(CharTokenizer):
    def pad_id(self) -> int:
      return self.eos_id()

  tok = CharTokenizer()
  assert tok.pad_id() not in sampled_token_ids(tok, None)
  assert sampled_token_ids(tok, None) == sorted(set(range(tok.vocab_size)) - {tok.pad_id()})
  assert sampled_token_ids(tok, "abc") == sorted(tok.encode("abc"))
  assert sampled_token_ids(PadIsEos(), None) == list(range(tok.vocab_size))  # its eos ends the completion


@pytest.mark.engine
def test_sampling_is_a_function_of_the_seed_and_stays_in_the_alphabet(sampler):
  tok = sampler.tokenizer
  a = sampler.sample(["3+4%7="] * 4, seed=11)
  b = sampler.sample(["3+4%7="] * 4, seed=11)
  c = sampler.sample(["3+4%7="] * 4, seed=12)
  assert [x.tolist() for x in a.completion_ids] == [x.tolist() for x in b.completion_ids]
  assert [x.tolist() for x in a.completion_ids] != [x.tolist() for x in c.completion_ids]
  for ids, lp in zip(a.completion_ids, a.logprobs):
    assert len(ids) == len(lp) and np.all(lp <= 0) and np.all(ids >= 2) and np.all(ids < tok.vocab_size)
  assert a.weights_version == 0
  # ended: a completion that stops before the limit ends with eos; one that does not was cut at the limit
  many = sampler.sample(["3+4%7="] * 64, seed=5)
  for ids, ended in zip(many.completion_ids, many.ended):
    assert ended == (int(ids[-1]) == EOS) and (ended or len(ids) == 4)
  assert any(many.ended) and not all(many.ended)


@pytest.mark.engine
def test_synced_weights_change_what_is_sampled(sampler):
  import jax

  from orchestrator.engine import model as model_lib
  from orchestrator.models.presets import load_preset

  before = sampler.greedy(["3+4%7=", "rev:abc>"])
  _, other, _ = model_lib.build_model(load_preset("tiny"), 5)
  sampler.sync(jax.device_put(other), version=3)
  assert sampler.weights_version == 3
  assert sampler.greedy(["3+4%7=", "rev:abc>"]) != before
  _, original, _ = model_lib.build_model(load_preset("tiny"), 0)
  sampler.sync(original, version=4)
  assert sampler.greedy(["3+4%7=", "rev:abc>"]) == before


# ---------------------------------------------------------------------------- waits for rollouts


def _wait_for(predicate, timeout_s=60.0):
  deadline = time.monotonic() + timeout_s
  while not predicate():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.01)


CASES = [(mode, staleness, 2) for mode in Mode for staleness in (0, 1)]
CASES += [(Mode.STAGE_BEFORE_UPDATE, staleness, 1) for staleness in (0, 1)]


@pytest.mark.spec
@pytest.mark.parametrize("mode,staleness,micro", CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_a_stop_ends_the_wait_for_rollouts_that_never_come(mode, staleness, micro):
  """Step 3's rollouts never arrive. Without a stop the loop keeps waiting (the negative control); once
  stop_requested turns true it returns within a bounded time: on-policy (staleness 0) with step 2's update
  applied and checkpointed ("stopped"); at staleness 1 step 3's checkpoint would have to carry step 3's
  rollouts, so the run ends with one line naming the latest checkpoint instead."""
  source = StuckLiveSource(6, micro, stuck_at=3, staleness=staleness)
  engine, stop = RecordingEngine(), threading.Event()
  program = RLProgram(TrainerWorker(engine), StepBoundaryPolicy(mode, wait_threshold_s=0.0), source,
                      ProgramConfig(steps=6, micro_batches_per_step=micro, checkpoint_every=2, stop_grace_s=0.2),
                      stop_requested=lambda: "SIGTERM" if stop.is_set() else None)
  thread, outcome = run_in_thread(program)
  _wait_for(lambda: source.waited > 0)
  thread.join(timeout=0.5)
  assert thread.is_alive() and not outcome, outcome  # no stop: still waiting for step 3
  waits = source.waited
  stop.set()
  stopped_at = time.monotonic()
  thread.join(timeout=30)
  assert not thread.is_alive(), "the loop did not end after the stop"
  assert time.monotonic() - stopped_at < 30 and waits > 1
  assert not any(call.startswith("fwd_bwd:s3") for call in engine.calls)
  assert engine.calls.count("update") == 3  # steps 0..2, step 2's too (staged before the update, it was owed)
  if staleness == 0:
    result = outcome["result"]
    assert result.ended == "stopped" and result.stop_reason == "SIGTERM" and result.last_step == 2
    assert result.checkpoint_path == "ckpt/3" and engine.calls[-1] == "checkpoint:3"
    assert [r.step for r in result.records] == [0, 1, 2]
    assert "stopped by SIGTERM while waiting for step 3's rollouts" in result.records[-1].reason
  else:
    error = outcome["error"]
    assert isinstance(error, StoppedWithoutCheckpointError)
    assert str(error).startswith("stopped by SIGTERM after step 2, but no checkpoint of it could be written")
    assert str(error).endswith("the latest checkpoint is ckpt/2 (after step 1); `run_rl --resume` continues from it")
    assert "checkpoint:3" not in engine.calls



@pytest.mark.spec
@pytest.mark.parametrize("diverged", [True, False], ids=["non_finite", "finite"])
@pytest.mark.parametrize("mode", [Mode.PIPELINED, Mode.STAGE_AFTER_UPDATE, Mode.STAGE_BEFORE_UPDATE],
                         ids=lambda m: m.name)
def test_a_stop_while_waiting_never_checkpoints_a_non_finite_step_whose_metrics_it_reads_last(mode, diverged):
  """Step 2's metrics are read only after step 3's first dispatch, which waits for rollouts that never come; a
  stop then reads them as work owed. A non-finite step 2 ends the run with its error, never checkpointed or
  synced; a finite one (the negative control) is checkpointed as a stop's last step is."""
  source = StuckLiveSource(6, 2, stuck_at=3, staleness=0)
  engine = DivergingEngine(from_step=2 if diverged else 99)
  stop = threading.Event()
  program = RLProgram(TrainerWorker(engine), StepBoundaryPolicy(mode, wait_threshold_s=0.0), source,
                      ProgramConfig(steps=6, micro_batches_per_step=2, checkpoint_every=2, stop_grace_s=0.2),
                      stop_requested=lambda: "SIGTERM" if stop.is_set() else None)
  thread, outcome = run_in_thread(program)
  _wait_for(lambda: source.waited > 0)
  stop.set()
  thread.join(timeout=30)
  assert not thread.is_alive(), "the loop did not end after the stop"
  assert "metrics:3" in engine.calls  # step 2's metrics (read after its update: the engine's step 3)
  if diverged:
    assert isinstance(outcome.get("error"), NonFiniteStepError), outcome
    assert outcome["error"].step == 2
    assert "checkpoint:3" not in engine.calls and "sync:3" not in engine.calls
  else:
    assert outcome["result"].ended == "stopped" and engine.calls[-1] == "checkpoint:3"


def _stop_inside_step_3(*, left_s=None, arrive_after_s=None):
  """Step 3 streams in: its first micro-batch is taken and dispatched (staged), its second does not come until a
  stop (staleness 1: the checkpoint of step 2 must carry step 3's batch). With ``arrive_after_s`` the rollouts
  come that long after the stop (a slow sampler, ``left_s`` its pace says is left); else never (stuck)."""
  source = StuckLiveSource(6, 3, stuck_at=3, stuck_micro=1)
  source.left_s = left_s
  engine, stop = RecordingEngine(), threading.Event()
  program = RLProgram(TrainerWorker(engine), StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE, wait_threshold_s=0.0),
                      source, ProgramConfig(steps=6, micro_batches_per_step=3, checkpoint_every=2, stop_grace_s=0.2),
                      stop_requested=lambda: "SIGTERM" if stop.is_set() else None)
  thread, outcome = run_in_thread(program)
  _wait_for(lambda: source.waited > 0)
  thread.join(timeout=0.5)
  assert thread.is_alive() and not outcome, outcome  # no stop: still waiting for step 3's micro-batch 1
  stop.set()
  if arrive_after_s is not None:
    time.sleep(arrive_after_s)
    source.stuck_at = 99
  thread.join(timeout=30)
  assert not thread.is_alive(), "the loop did not end after the stop"
  assert "fwd_bwd:prepared:s3m0" in engine.calls and "fwd_bwd:s3m1" not in engine.calls  # the first: staged
  assert engine.calls.count("update") == 3  # steps 0..2: step 3's dispatched micro-batch is never applied
  return outcome, engine


@pytest.mark.spec
def test_a_stop_inside_a_step_that_waits_for_a_later_micro_batch_checkpoints_the_step_before():
  """The stop ends the run after step 2, the last finished step: its checkpoint (position 3) carries step 3's
  batch, which the slow sampler delivers within the grace plus its measured pace; step 3's first micro-batch
  is dropped. The negative control: a sampler that never delivers ends without that checkpoint, naming the
  latest one (2), and no checkpoint holds a half-trained step."""
  outcome, engine = _stop_inside_step_3(left_s=2.0, arrive_after_s=0.5)
  result = outcome["result"]
  assert result.ended == "stopped" and result.stop_reason == "SIGTERM" and result.last_step == 2
  assert result.checkpoint_path == "ckpt/3" and engine.calls[-1] == "checkpoint:3"
  assert [r.step for r in result.records] == [0, 1, 2]
  assert engine.checkpoints[-1]["pending_record"]["step"] == 2 and engine.checkpoints[-1]["step"] == 3

  outcome, engine = _stop_inside_step_3()
  error = outcome["error"]
  assert isinstance(error, StoppedWithoutCheckpointError) and error.resumable
  assert str(error) == ("stopped by SIGTERM after step 2, but no checkpoint of it could be written: it must carry"
                        " rollouts sampled ahead with older weights (rollouts.max_staleness), and the sampler did"
                        " not deliver them within 0.2 s; the latest checkpoint is ckpt/2 (after step 1); `run_rl"
                        " --resume` continues from it")
  assert "checkpoint:3" not in engine.calls and "checkpoint:4" not in engine.calls


@pytest.mark.spec
def test_a_stop_while_waiting_for_the_first_step_s_rollouts_names_what_is_left():
  source = StuckLiveSource(4, 2, stuck_at=0)
  stop = threading.Event()
  program = RLProgram(TrainerWorker(RecordingEngine()), StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE), source,
                      ProgramConfig(steps=4, micro_batches_per_step=2, start_step=0),
                      stop_requested=lambda: "SIGINT" if stop.is_set() else None)
  thread, outcome = run_in_thread(program)
  _wait_for(lambda: source.waited > 0)
  stop.set()
  thread.join(timeout=30)
  assert not thread.is_alive()
  assert str(outcome["error"]) == ("stopped by SIGINT while waiting for step 0's rollouts, before this run trained a"
                                   " step; no checkpoint was written, so the run cannot be resumed: start it again with a new --out")
  # nothing to resume: the exit code says so, unlike a resumable stop's 130
  error, stopped = outcome["error"], signals.StopSignals(Path("."))
  stopped.received = signal.SIGINT
  assert not error.resumable
  assert app_outcome.stopped_without_checkpoint(None, error, stopped, job_lib.single()) == 4
  error.resumable = True  # the control: an earlier checkpoint to continue from
  assert app_outcome.stopped_without_checkpoint(None, error, stopped, job_lib.single()) == 130


class _TextSampler:
  """A sampler whose completions are the answer's first character; what ``LiveRollouts`` asks of one."""

  weights_version, placement = 0, None

  def sample(self, prompts, *, seed, temperature=1.0, **_):
    from orchestrator.live.sampler import Samples  # import here: it loads JAX, which this file's other tests skip

    ids = [np.array([1, 2], np.int32) for _ in prompts]
    return Samples(list(prompts), ids, ids, [np.zeros(2, np.float32) for _ in prompts], ["a"] * len(prompts), 0)


@pytest.mark.engine
def test_a_stop_while_a_reward_call_is_stuck_ends_the_run_and_the_sampling_thread_with_a_line(caplog):
  """Step 0's reward call never returns (its limit is an hour). The loop waits for step 0's rollouts until the
  stop (the negative control: not before), ends naming what it waited for, and closing the source gives the
  call up at once, saying so, rather than waiting the close's minute for the sampling thread."""
  from orchestrator.live.rollouts import LiveRollouts, LiveShape  # import here: it loads JAX (the sampler's)

  entered, release, stop = threading.Event(), threading.Event(), threading.Event()

  def stuck(prompts, completions, **_):
    entered.set()
    release.wait(120)
    return [0.0] * len(completions)

  reward = Reward((Term("my_rewards:stuck", stuck),), timeout_s=3600)
  source = LiveRollouts(_TextSampler(), ReverseString(), LiveShape(2, 1, 1, 2, 1), reward=reward)
  program = RLProgram(TrainerWorker(RecordingEngine()), StepBoundaryPolicy(Mode.STAGE_BEFORE_UPDATE), source,
                      ProgramConfig(steps=2, micro_batches_per_step=1, start_step=0, stop_grace_s=0.2),
                      stop_requested=lambda: "SIGINT" if stop.is_set() else None)
  thread, outcome = run_in_thread(program)
  try:
    assert entered.wait(60)
    thread.join(timeout=0.5)
    assert thread.is_alive() and not outcome, outcome  # no stop: still waiting for step 0's rollouts
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the loop did not end after the stop"
    assert str(outcome["error"]).startswith("stopped by SIGINT while waiting for step 0's rollouts")
    with caplog.at_level(logging.WARNING, logger="step_boundary.rollouts"):
      source.close(timeout_s=30)
      assert not source._sampling.thread.is_alive(), "closing did not give up the stuck reward call"
  finally:
    release.set()
  assert ("the run ended while sampling waited for task.reward entry 'my_rewards:stuck' on the micro-batch of prompt"
          " indices 0..0 of step 0, which had run" in caplog.text), caplog.text


class _OneOfTwo(SingleProcess):
  """Process 0 of a job of two whose peer was asked for no stop and measured what this process did."""

  num_processes = 2

  def exchange(self, tag, value):
    return [value, None if tag.startswith("stop") else value]


@pytest.mark.spec
def test_in_a_job_a_stop_seen_while_waiting_for_rollouts_is_agreed_at_the_next_boundary():
  """One process of a job sees a stop while it waits for step 3's rollouts. Ending its run there would leave the
  other process dispatching step 3 alone, so the wait goes on; once the rollouts come, the stop goes through the
  next boundary's exchange and every process ends after step 3, with its checkpoint (one process: test above)."""
  source = StuckLiveSource(6, 2, stuck_at=3, staleness=1)
  engine, stop = RecordingEngine(), threading.Event()
  program = RLProgram(TrainerWorker(engine), StepBoundaryPolicy(Mode.OFF), source,
                      ProgramConfig(steps=6, micro_batches_per_step=2, checkpoint_every=2, stop_grace_s=0.2),
                      stop_requested=lambda: "SIGTERM" if stop.is_set() else None, agreement=_OneOfTwo())
  thread, outcome = run_in_thread(program)
  _wait_for(lambda: source.waited > 0)
  stop.set()
  thread.join(timeout=1.0)  # five times the grace a stop has in one process
  assert thread.is_alive() and not outcome, outcome
  source.stuck_at = 99  # the rollouts come
  thread.join(timeout=30)
  assert not thread.is_alive()
  result = outcome["result"]
  assert result.ended == "stopped" and result.stop_reason == "SIGTERM" and result.last_step == 3
  assert result.checkpoint_path == "ckpt/4" and engine.calls.count("update") == 4


@pytest.mark.spec
def test_the_staleness_schedule_waits_for_each_step_s_version_and_keeps_only_what_is_still_needed():
  versions = WeightVersions(BatchSchedule(1, 2, max_staleness=2), steps=6)
  assert [versions.version_for(s) for s in range(6)] == [0, 0, 0, 1, 2, 3]
  assert versions.available(0) and not versions.blocked_on_sync(2) and versions.blocked_on_sync(3)
  assert not versions.blocked_on_sync(9)  # past the run's last step nothing waits for a sync
  versions.keep(1, "w1")
  versions.keep(2, "w2")
  assert not versions.blocked_on_sync(4) and versions.synced == 2
  assert versions.take(1) == "w1" and not versions.available(0)  # older versions dropped once a newer is taken
  assert versions.available(2) and not versions.available(3)
  assert versions.carried(4) == [4, 5]  # sampled with versions 2 and 3, older than step 4's position
  versions.restart_at(4)  # a run resumed before step 4: its checkpoint's weights arrive by sync
  assert not versions.available(4) and versions.first == 4 and not versions.can_sample(5)
  assert versions.can_sample(6)
  versions.keep(4, "w4")
  assert versions.available(4) and versions.take(4) == "w4"


class _BlockingSampler:
  """A sampler whose sampling waits for ``release``; greedy answers every prompt with "4"."""

  weights_version = 0

  def __init__(self):
    self.sampling, self.release, self.synced = threading.Event(), threading.Event(), []

  def sample(self, prompts, seed, temperature, **_):
    self.sampling.set()
    self.release.wait(30)
    raise RuntimeError("not needed by the test")

  def sync(self, weights, version):
    self.synced.append(version)

  def greedy(self, prompts, **_):
    return ["4"] * len(prompts)


@pytest.mark.engine
def test_an_evaluation_takes_the_sampler_in_its_turn_and_a_stop_ends_its_wait():
  # import here: it loads JAX (the weights are gathered across processes)
  from orchestrator.live.evaluations import HeldOutEvaluations
  from orchestrator.live.rollouts import LiveShape
  from orchestrator.live.shared_sampler import SharedSampler

  task, sampler, shape = ModularAddition(), _BlockingSampler(), LiveShape(1, 1, 1, 1, 0)
  shared = SharedSampler(sampler, task, lambda *a, **k: None, shape)
  evaluations = HeldOutEvaluations(shared, task, shape)
  thread = threading.Thread(target=lambda: pytest.raises(RuntimeError, shared.sample_micro_batches, 0, 0, 1, 0, None),
                            daemon=True)
  thread.start()
  assert sampler.sampling.wait(30)  # the sampling thread holds the sampler
  stopped = threading.Event()
  threading.Timer(0.3, stopped.set).start()
  assert evaluations.evaluate(None, 1, 3, stop=stopped.is_set) is None and sampler.synced == []
  sampler.release.set()
  thread.join(30)
  expected = np.mean([task.reward(task.problem(0, "eval", j), "4") for j in range(3)])
  assert evaluations.evaluate("w", 1, 3, stop=stopped.is_set).accuracy == expected and sampler.synced == [1]


@pytest.mark.engine
def test_a_completion_is_cut_after_its_first_eos_and_each_prompt_gets_its_own_ids():
  """LiveSampler._samples on a sampler's output given here: a completion keeps its first eos and nothing after
  (the log-probs alike); one without an eos is kept whole and not ended; repeated prompts get equal ids in
  arrays of their own."""
  from orchestrator.live.sampler import LiveSampler  # import here: JAX (this file's other tests run without it)

  tokenizer = CharTokenizer()
  sampler = LiveSampler.__new__(LiveSampler)
  sampler._eos_ids, sampler._fixed_length, sampler.tokenizer, sampler.weights_version = [EOS], False, tokenizer, 3
  sampler.prompt_ids = lambda prompt: np.asarray(tokenizer.encode(prompt), np.int32)
  a, b = tokenizer.encode("ab")
  out = types.SimpleNamespace(tokens=[[a, EOS, b], [a, b], [EOS, EOS]],
                              logprobs=[[-0.1, -0.2, -0.3], [-0.4, -0.5], [-0.6, -0.7]])
  samples = sampler._samples(["x", "y", "x"], out)
  assert [c.tolist() for c in samples.completion_ids] == [[a, EOS], [a, b], [EOS]]
  assert [len(lp) for lp in samples.logprobs] == [2, 2, 1]
  assert np.concatenate(samples.logprobs).tolist() == pytest.approx([-0.1, -0.2, -0.4, -0.5, -0.6])
  assert samples.ended == [True, False, True]
  first, _, third = samples.prompt_ids
  assert first.tolist() == third.tolist() and first is not third


# ---------------------------------------------------------------------------- sampling controls


@pytest.mark.engine
def test_an_lru_cache_evicting_sampling_states_inside_a_trace_compares_them_as_values(sampler):
  """Two sampling states of one shape under different temperatures: their trees share a hash (the metadata is
  left out of it), so a ``functools.lru_cache`` evicting the newer key compares it with the older, here while
  another function is traced, as JAX's caches do on any insertion. The live sampler's states compare as values,
  and so do those of the stock Tunix bench arm's sampler (``bench.tunix_grpo.keep_static_fields_plain``). The
  negative control: Tunix's own state, whose prompt length is an Array, fails that trace with the error
  ``live.tunix_sampler`` describes."""
  import functools

  import jax
  import jax.numpy as jnp
  from tunix.generate import sampler as tunix_sampler_lib

  from orchestrator.bench import tunix_grpo

  def evict_inside_a_trace(init_sample_state) -> None:
    def state_tree(temperature: float):
      return jax.tree.structure(init_sample_state(
          jnp.ones((2, 4), jnp.int32), total_sampling_steps=8, include_logits=False, forbidden_token_ids=None,
          temperature=temperature, top_p=None, top_k=None, seed=jax.random.key(0), beam_size=None))

    cached = functools.lru_cache(4)(lambda key: key)
    older, newer = state_tree(0.5), state_tree(0.6)
    assert hash(older) == hash(newer) and older != newer
    cached(older), cached(newer), cached(older)  # the older used again: the newer is evicted first

    def traced(x):
      for i in range(4):
        cached(i)
      return x

    jax.jit(traced)(1.0)

  evict_inside_a_trace(sampler._sampler.init_sample_state)
  own = sampler._sampler
  stock = tunix_sampler_lib.Sampler(own.transformer, own.tokenizer, own.cache_config)
  tunix_grpo.keep_static_fields_plain(types.SimpleNamespace(_sampler=stock))
  evict_inside_a_trace(stock.init_sample_state)
  with pytest.raises(ValueError, match="metadata fields of pytree"):
    evict_inside_a_trace(functools.partial(tunix_sampler_lib.Sampler.init_sample_state, own))


@pytest.mark.engine
def test_top_k_one_and_a_tiny_top_p_sample_the_greedy_completion_and_a_top_k_past_the_vocabulary_filters_nothing(
    sampler):
  """top_k=1 at temperature 1 keeps only the most likely id at every step, and so does a top_p smaller than any
  probability: both sample what ``greedy`` decodes. The negative control: untruncated sampling does not. A top_k
  wider than the vocabulary is off: the very samples of the untruncated call. The log-probs stay the full
  distribution's (below 0 for a tiny random model's most likely id), not the truncated one's (0)."""
  prompts = ["3+4%7=", "rev:abc>", "1+1%3=", "rev:dcb>"] * 2
  greedy = sampler.greedy(prompts)
  top_k = sampler.sample(prompts, seed=9, temperature=1.0, top_k=1)
  assert top_k.texts == greedy
  assert sampler.sample(prompts, seed=9, top_p=1e-6).texts == greedy
  assert all(np.all(lp < 0) for lp in top_k.logprobs)
  plain = sampler.sample(prompts, seed=9)
  assert plain.texts != greedy
  wide = sampler.sample(prompts, seed=9, top_k=10**6)
  assert [c.tolist() for c in wide.completion_ids] == [c.tolist() for c in plain.completion_ids]


def _sampler_on(outputs, *, fixed_length=False):
  """A LiveSampler whose ``_samples`` reads ``outputs`` (rows of ids, log-probs of -0.1 each) as Tunix's output."""
  from orchestrator.live.sampler import LiveSampler  # import here: JAX (this file's spec tests run without it)

  tokenizer = CharTokenizer()
  sampler = LiveSampler.__new__(LiveSampler)
  sampler._eos_ids, sampler._fixed_length, sampler.tokenizer, sampler.weights_version = [EOS], fixed_length, \
      tokenizer, 0
  sampler.prompt_ids = lambda prompt: np.asarray(tokenizer.encode(prompt), np.int32)
  tokens = [tokenizer.encode(text) if isinstance(text, str) else text for text in outputs]
  return sampler, types.SimpleNamespace(tokens=tokens, logprobs=[[-0.1] * len(ids) for ids in tokens])


@pytest.mark.engine
def test_a_stop_string_ends_a_completion_through_the_token_that_completed_it_and_the_text_before_it():
  tok = CharTokenizer()
  a, b = tok.encode("ab")
  sampler, out = _sampler_on(["ab=>cd", "x|y=>z", "abcd", [a, EOS, *tok.encode("=>")], "=>ab"])
  samples = sampler._samples(["p"] * 5, out, stop=["=>", "|"])
  assert [tok.decode(c) for c in samples.completion_ids] == ["ab=>", "x|", "abcd", "a", "=>"]
  assert samples.completion_ids[3].tolist() == [a, EOS]  # the eos came first: the stop string after it is not seen
  assert samples.texts == ["ab", "x", "abcd", "a", ""]  # cut before the stop string (the first one to occur)
  assert samples.ended == [True, True, False, True, True]
  assert [len(lp) for lp in samples.logprobs] == [4, 2, 4, 2, 2]
  # The negative control: a stop string that never occurs leaves every completion as it was without one.
  plain = sampler._samples(["p"] * 5, out)
  never = sampler._samples(["p"] * 5, out, stop=["zz"])
  assert never.texts == plain.texts == ["ab=>cd", "x|y=>z", "abcd", "a", "=>ab"]
  assert [c.tolist() for c in never.completion_ids] == [c.tolist() for c in plain.completion_ids]
  assert never.ended == plain.ended == [False, False, False, True, False]
  # A fixed-length answer alphabet has no end (None) until stop strings give it one.
  sampler, out = _sampler_on(["ab|c", "abcd"], fixed_length=True)
  assert sampler._samples(["p"] * 2, out).ended is None
  stopped = sampler._samples(["p"] * 2, out, stop=["|"])
  assert stopped.texts == ["ab", "abcd"] and stopped.ended == [True, False]


@pytest.mark.engine
def test_a_prompt_s_own_limit_cuts_its_completion_and_marks_it_truncated():
  tok = CharTokenizer()
  a, b = tok.encode("ab")
  sampler, out = _sampler_on(["abcd", [a, EOS, b, b], "abcd", [a, b, EOS, b]])
  samples = sampler._samples(["p"] * 4, out, max_new_tokens=[2, 2, None, 3])
  assert samples.texts == ["ab", "a", "abcd", "ab"]
  assert [c.tolist() for c in samples.completion_ids] == [[a, b], [a, EOS], tok.encode("abcd"), [a, b, EOS]]
  assert [len(lp) for lp in samples.logprobs] == [2, 2, 4, 3]
  assert samples.ended == [False, True, False, True]  # cut at its limit: truncated; an eos within it: ended
  # A stop string inside the limit still ends it; one past the limit was never sampled.
  sampler, out = _sampler_on(["a|bc", "abc|"])
  limited = sampler._samples(["p"] * 2, out, stop=["|"], max_new_tokens=[3, 3])
  assert limited.texts == ["a", "abc"] and limited.ended == [True, False]


class _RecordingSampler:
  """A sampler that answers every prompt with "a" and keeps the keyword arguments of each ``sample`` call."""

  weights_version = 0

  def __init__(self):
    self.calls = []

  def sample(self, prompts, **settings):
    from orchestrator.live.sampler import Samples  # import here: it loads JAX

    self.calls.append(settings)
    ids = [np.array([3], np.int32) for _ in prompts]
    return Samples(list(prompts), ids, ids, [np.zeros(1, np.float32) for _ in prompts], ["a"] * len(prompts), 0)


@pytest.mark.engine
def test_a_micro_batch_is_sampled_with_the_run_s_settings_and_each_problem_s_own_limit():
  from orchestrator.live.rollouts import LiveShape  # import here: it loads JAX (the sampler's)
  from orchestrator.live.shared_sampler import sample_micro_batches

  class Limited(ReverseString):
    def problem(self, seed, split, index):
      return dataclasses.replace(super().problem(seed, split, index), max_new_tokens=1 + index % 3)

  sampler, reward = _RecordingSampler(), lambda problems, texts, **_: np.zeros(len(texts))
  shape = LiveShape(1, 1, 2, 2, 0, top_p=0.9, top_k=5, stop=("|",))
  sample_micro_batches(sampler, Limited(), reward, shape, 0, 0, 1)
  sample_micro_batches(sampler, ReverseString(), reward, LiveShape(1, 1, 2, 2, 0), 0, 0, 1)
  limited, plain = sampler.calls
  assert limited == dict(seed=limited["seed"], temperature=1.0, top_p=0.9, top_k=5, stop=("|",),
                         max_new_tokens=[1, 1, 2, 2])  # per prompt of two groups of two
  assert plain == dict(seed=plain["seed"], temperature=1.0, top_p=1.0, top_k=0, stop=(), max_new_tokens=None)


@pytest.mark.engine
def test_the_sampling_calls_spans_give_the_seconds_of_a_window_they_ran_in():
  """Each finished call's span counts where it overlaps the window, the running call up to now, a wait for
  weights inside a call (``end`` then ``begin``) not at all; a window the calls missed gets 0.0."""
  from orchestrator.live.rollout_thread import SamplingSpans

  now = [0.0]
  spans = SamplingSpans(clock=lambda: now[0])
  for start, end in ((1.0, 2.0), (3.0, 3.5), (4.5, 5.0)):  # the third: a call resumed after a wait at 3.5-4.5
    now[0] = start
    spans.begin()
    now[0] = end
    spans.end()
  now[0] = 6.0
  spans.begin()
  now[0] = 6.25
  assert spans.seconds_within(0.0, 1.0) == 0.0 and spans.seconds_within(2.0, 3.0) == 0.0
  assert spans.seconds_within(1.5, 3.25) == pytest.approx(0.75)
  assert spans.seconds_within(3.0, 5.0) == pytest.approx(1.0)  # the wait between 3.5 and 4.5 not counted
  assert spans.seconds_within(5.5, 7.0) == pytest.approx(0.25)  # the running call, up to now

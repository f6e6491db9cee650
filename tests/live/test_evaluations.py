"""Evaluations during a live run (``task.eval_every``, ``task.eval_pass_k``): when they run, what they measure,
where their figures go, that they never change what trains, and the warning for a small held-out split."""

from __future__ import annotations

import json

import numpy as np
import pytest

from orchestrator.app import cli
from orchestrator.tasks.tasks import ModularAddition
from orchestrator.loop.metrics_log import TENSORBOARD_DIR
from orchestrator.loop.recorder import BoundaryRecord
from tests.loop.test_metrics_log import read_scalars


def _answer(prompt: str) -> str:
  """Modular addition's answer to ``prompt`` ("a+b%m=")."""
  a, rest = prompt.rstrip("=").split("+")
  b, m = rest.split("%")
  return str((int(a) + int(b)) % int(m))


class _VersionedSampler:
  """A sampler that answers with its weights' name: what ``SharedSampler`` and ``HeldOutEvaluations`` ask of
  one, and what it synced."""

  placement = None

  def __init__(self, group: int = 4):
    self.weights_version, self.weights, self.synced, self.sampled, self.group = 0, "own", [], [], group
    self.greedy_calls: list[int] = []

  def sync(self, weights, version):
    self.weights, self.weights_version = weights, version
    self.synced.append((weights, version))

  def greedy(self, prompts, **_):
    self.greedy_calls.append(len(prompts))
    return ["0" for _ in prompts]

  def sample(self, prompts, *, seed, temperature=1.0, **_):
    from orchestrator.live.sampler import Samples  # import here: it loads JAX

    self.sampled.append((self.weights, seed))
    # the fourth completion of each prompt's group of ``group`` is its right answer, the others "x"
    texts = [_answer(prompt) if k % self.group == 3 else "x" for k, prompt in enumerate(prompts)]
    ids = [np.array([1], np.int32) for _ in prompts]
    return Samples(list(prompts), ids, ids, [np.zeros(1, np.float32) for _ in prompts], texts, self.weights_version)


@pytest.mark.engine
def test_pass_at_k_counts_a_prompt_once_one_of_its_k_samples_passes_and_greedy_is_scored_alone():
  from orchestrator.live.evaluations import HeldOutEvaluations  # import here: it loads JAX
  from orchestrator.live.rollouts import LiveShape
  from orchestrator.live.shared_sampler import SharedSampler

  task, sampler = ModularAddition(), _VersionedSampler()
  # a training call makes 2 groups of 4: an evaluation calls the sampler with at most 8 prompts at a time
  shape = LiveShape(1, 1, 2, 4, 0)
  evaluations = HeldOutEvaluations(SharedSampler(sampler, task, lambda *a, **k: None, shape), task, shape)
  problems = [task.problem(0, "eval", j) for j in range(6)]
  greedy = np.mean([task.reward(p, "0") for p in problems])
  score = evaluations.evaluate("w", 5, 6, pass_k=4)
  assert score.accuracy == greedy and score.pass_k == 4 and score.pass_at_k == 1.0  # each prompt's 4th passes
  assert sampler.greedy_calls == [6] and len(sampler.sampled) == 3  # 24 completions in calls of 8
  seeds = [seed for _, seed in sampler.sampled]
  assert len(set(seeds)) == 3 and all(weights == "w" for weights, _ in sampler.sampled)
  sampler.group = 3
  assert evaluations.evaluate("w", 5, 6, pass_k=3).pass_at_k == 0.0  # negative control: the passing 4th not drawn
  sampler.group = 4
  assert evaluations.evaluate("w", 5, 6).pass_at_k is None and len(sampler.sampled) == 6  # no sampling without k
  evaluations.evaluate("w", 6, 6, pass_k=4)
  assert sampler.sampled[6][1] != seeds[0]  # another version, another seed
  evaluations.evaluate("w", 5, 6, pass_k=4)
  assert [seed for _, seed in sampler.sampled[9:]] == seeds  # the same version, the same seeds


@pytest.mark.engine
def test_a_batch_sampled_with_the_samplers_own_weights_after_an_evaluation_syncs_the_kept_copy_back():
  """Version 0 is "the sampler's own" weights (None); an evaluation replaces them, so a batch still sampled with
  version 0 must sync the copy the run kept, and without one it fails rather than sample other weights."""
  from orchestrator.live.evaluations import HeldOutEvaluations  # import here: it loads JAX
  from orchestrator.live.rollouts import LiveShape
  from orchestrator.live.shared_sampler import SharedSampler

  reward = lambda problems, texts, **_: np.zeros(len(texts), np.float32)  # noqa: E731
  sampler, task, shape = _VersionedSampler(), ModularAddition(), LiveShape(4, 1, 1, 4, 1)
  shared = SharedSampler(sampler, task, reward, shape)
  evaluations = HeldOutEvaluations(shared, task, shape)
  shared.sample_micro_batches(0, 0, 1, 0, None)
  assert sampler.sampled[-1][0] == "own" and sampler.synced == []
  evaluations.evaluate("after 1", 1, 2)
  with pytest.raises(RuntimeError, match="holds version 1 and no copy of them was kept"):
    shared.sample_micro_batches(1, 0, 1, 0, None)
  evaluations.keep_start_weights("start copy")
  shared.sample_micro_batches(1, 0, 1, 0, None)
  assert sampler.sampled[-1][0] == "start copy" and sampler.synced[-1] == ("start copy", 0)


def _records(run):
  return [BoundaryRecord.from_json(json.loads(line)) for line in (run / "records.jsonl").read_text().splitlines()]


#: The sampler in this process (rollouts.placement=shared): where the sampler runs is not what these runs test (tests/live/test_sampler_process.py pins that its own
#: process samples the same), and a process of its own would start JAX again for every run.
LIVE = ["steps=8", "task.eval_prompts=8", "run.reserve_host_core=false", "metrics.samples_every=0",
        "rollouts.placement=shared"]


@pytest.mark.e2e
def test_evaluations_during_a_run_are_recorded_logged_plotted_and_leave_what_trains_alone(tmp_path, capsys):
  """Every step evaluated (so batches still sampled with version 0 follow an evaluation, with staleness 1):
  the figures at every step, in TensorBoard and the summary, the last equal to the end's evaluation of the same
  weights; the digest equals the same run's without evaluations."""
  from orchestrator.live.plot import evaluation_series  # import here: matplotlib is not needed elsewhere

  plain, evaluated = tmp_path / "plain", tmp_path / "evaluated"
  assert cli.main([*LIVE, "--out", str(plain)]) == 0
  assert cli.main([*LIVE, "task.eval_every=3", "task.eval_pass_k=2", "--out", str(evaluated)]) == 0
  out = capsys.readouterr().out
  summary = json.loads((evaluated / "summary.json").read_text())
  assert summary["final_state_digest"] == json.loads((plain / "summary.json").read_text())["final_state_digest"]
  records = _records(evaluated)
  assert [r.step for r in records if r.eval_accuracy is not None] == [2, 5]  # after 3 and 6 updates
  assert all((r.eval_pass_at_k is None) == (r.eval_accuracy is None) and (r.eval_s is None) == (r.eval_accuracy
             is None) for r in records)
  assert all(r.eval_accuracy is None for r in _records(plain))
  during = summary["during_run"]
  assert [(e["updates"], e["pass_k"]) for e in during] == [(3, 2), (6, 2)]
  assert [e["accuracy"] for e in during] == [r.eval_accuracy for r in records if r.eval_accuracy is not None]
  assert "held-out greedy accuracy during the run, after N updates: 3: " in out and "(pass@2 " in out
  logged = read_scalars(evaluated / TENSORBOARD_DIR)
  assert sorted(logged["eval/accuracy"]) == [2, 5] and sorted(logged["eval/pass_at_k"]) == [2, 5]
  assert [points for _, points, _ in evaluation_series(records)] == [
      [(3, during[0]["accuracy"]), (6, during[1]["accuracy"])],
      [(3, during[0]["pass_at_k"]), (6, during[1]["pass_at_k"])]]
  assert (evaluated / "reward.png").is_file()


@pytest.mark.e2e
def test_every_step_evaluated_trains_what_an_unevaluated_run_trains(tmp_path):
  """With ``task.eval_every=1`` an evaluation replaces the sampler's weights at every step; whenever batch 1
  (sampled with version 0 at staleness 1) is sampled, before or after them, it samples with the start's weights
  (the unit test above forces the order that needs the kept copy)."""
  plain, evaluated = tmp_path / "plain", tmp_path / "evaluated"
  assert cli.main([*LIVE, "steps=4", "rollouts.batch_steps=2", "--out", str(plain)]) == 0
  assert cli.main([*LIVE, "steps=4", "rollouts.batch_steps=2", "task.eval_every=1", "--out", str(evaluated)]) == 0
  digests = [json.loads((run / "summary.json").read_text())["final_state_digest"] for run in (plain, evaluated)]
  assert digests[0] == digests[1]
  assert [r.step for r in _records(evaluated) if r.eval_accuracy is not None] == [0, 1, 2, 3]


@pytest.mark.e2e
def test_a_held_out_split_smaller_than_eval_prompts_is_stated_in_a_warning(tmp_path, capsys):
  rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(30)]
  (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:27]))
  (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[27:]))
  dataset = ["task.name=dataset", f"task.path={tmp_path / 'train.jsonl'}", f"task.eval_path={tmp_path / 'eval.jsonl'}",
             "steps=1", "run.reserve_host_core=false", "metrics.backends=[]", "rollouts.placement=shared"]
  assert cli.main([*dataset, "task.eval_prompts=16", "--out", str(tmp_path / "small")]) == 0
  warned = [line for line in capsys.readouterr().err.splitlines() if "held-out split holds" in line]
  assert warned == ["task.eval_prompts=16, but the held-out split holds 3 prompts: each evaluation uses those 3"
                    " (hold out more prompts for a finer figure)"]
  # the negative control: a split that holds what is asked for
  assert cli.main([*dataset, "task.eval_prompts=3", "--out", str(tmp_path / "enough")]) == 0
  assert "held-out split holds" not in capsys.readouterr().err

"""The sampler in a process of its own (``rollouts.placement: process``): the same samples as in process, bit for
bit, on synced weights and in decode chunks on the weights each chunk asks for; failures named; the child's
priority and cores; and no child outlives its run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from orchestrator.live.sampler_boot import SAMPLER_NICE
from orchestrator.live.sampler_process import SamplerProcess, SamplerProcessError, SamplerSpec
from orchestrator.tasks.tasks import FirstLetter
from tests.conftest import REPO

pytestmark = pytest.mark.engine

TASK = FirstLetter(length=4, letters=8)
PROMPTS = [TASK.problem(3, "train", i).prompt for i in range(4) for _ in range(4)]


def _spec():
  from orchestrator.models.presets import load_preset
  from orchestrator.recipe.model_section import ModelSection

  return SamplerSpec(preset=load_preset("tiny"), model=ModelSection(preset="tiny"), seed=0, max_prompt_length=16,
                     max_generation_steps=1, alphabet=TASK.answer_alphabet, dtype="float32")


@pytest.fixture(scope="module")
def pair():
  """An in-process sampler and a process sampler built alike, and trained weights to sync to both."""
  from orchestrator.engine import build_engine
  from orchestrator.live.sampler import LiveSampler
  from orchestrator.tasks.tokenizer import CharTokenizer

  spec = _spec()
  here = LiveSampler(spec.preset, CharTokenizer(), seed=0, max_prompt_length=16, max_generation_steps=1,
                     alphabet=TASK.answer_alphabet)
  there = SamplerProcess(spec, CharTokenizer())
  engine = build_engine("tiny", rows=4, learning_rate=3e-2)
  rng = np.random.default_rng(0)
  import jax

  trained = jax.tree.map(lambda w: np.asarray(w) + rng.normal(0, 0.05, np.shape(w)).astype(np.asarray(w).dtype),
                         jax.device_get(engine.export_weights()))
  yield here, there, trained
  there.close()


def _same(a, b):
  assert a.texts == b.texts
  for x, y in zip(a.completion_ids + a.logprobs + a.prompt_ids, b.completion_ids + b.logprobs + b.prompt_ids):
    np.testing.assert_array_equal(x, y)


def test_it_samples_what_the_in_process_sampler_samples_bit_for_bit(pair):
  here, there, trained = pair
  _same(here.sample(PROMPTS, seed=7), there.sample(PROMPTS, seed=7))
  assert here.greedy(PROMPTS[:4]) == there.greedy(PROMPTS[:4])
  here.sync(trained, 5)
  there.sync(trained, 5)
  after_here, after_there = here.sample(PROMPTS, seed=7), there.sample(PROMPTS, seed=7)
  _same(after_here, after_there)
  assert after_there.weights_version == 5


def test_a_sync_reaches_the_child_negative_control(pair):
  """Samples after a sync differ from those before it: the weights sent are the ones sampled with."""
  here, there, trained = pair
  there.sync(trained, 5)
  synced = there.sample(PROMPTS, seed=7)
  there.sync(jax_zeros_like(trained), 6)
  assert any(not np.array_equal(a, b) for a, b in zip(synced.logprobs, there.sample(PROMPTS, seed=7).logprobs))
  there.sync(trained, 5)


def test_the_sampling_settings_reach_the_child(pair):
  """Truncation, stop strings and per-prompt limits cross the pipe: the child samples what the in-process sampler
  samples with them; the negative control, without them it samples otherwise (no stop string ends a completion)."""
  here, there, trained = pair
  here.sync(trained, 5)
  there.sync(trained, 5)
  settings = dict(top_p=0.9, top_k=3, stop=("a",), max_new_tokens=[1] * len(PROMPTS))
  stopped = there.sample(PROMPTS, seed=7, **settings)
  _same(here.sample(PROMPTS, seed=7, **settings), stopped)
  assert stopped.ended == here.sample(PROMPTS, seed=7, **settings).ended and any(stopped.ended)
  assert there.sample(PROMPTS, seed=7).ended is None  # a fixed-length alphabet without stop strings has no end


def jax_zeros_like(tree):
  import jax

  return jax.tree.map(np.zeros_like, tree)


def test_weights_of_another_model_are_refused_naming_the_shapes_and_the_child_serves_on(pair):
  _, there, trained = pair
  import jax

  leaves, treedef = jax.tree.flatten(trained)
  wrong = jax.tree.unflatten(treedef, [leaves[0][:1], *leaves[1:]])
  with pytest.raises(SamplerProcessError, match="sync sent weights of shapes"):
    there.sync(wrong, 9)
  assert len(there.sample(PROMPTS[:2], seed=1).texts) == 2


def test_the_child_runs_below_its_parents_priority_on_its_parents_cores_and_ignores_ctrl_c(pair):
  _, there, _ = pair
  there.wait_ready()
  assert os.getpriority(os.PRIO_PROCESS, there.pid) == os.getpriority(os.PRIO_PROCESS, 0) + SAMPLER_NICE
  assert os.sched_getaffinity(there.pid) == os.sched_getaffinity(0)
  os.kill(there.pid, signal.SIGINT)
  assert len(there.sample(PROMPTS[:2], seed=1).texts) == 2


def test_a_child_that_dies_is_named_at_the_next_request():
  from orchestrator.tasks.tokenizer import CharTokenizer

  sampler = SamplerProcess(_spec(), CharTokenizer())
  sampler.wait_ready()
  os.kill(sampler.pid, signal.SIGKILL)
  with pytest.raises(SamplerProcessError, match=r"exited \(code -9\) during 'sample'"):
    sampler.sample(PROMPTS[:2], seed=1)
  sampler.close()


def test_close_ends_the_child_and_a_second_close_does_nothing():
  from orchestrator.tasks.tokenizer import CharTokenizer

  sampler = SamplerProcess(_spec(), CharTokenizer())
  sampler.wait_ready()
  sampler.close()
  assert not _alive(sampler.pid)
  sampler.close()
  with pytest.raises(SamplerProcessError):
    sampler.sample(PROMPTS[:2], seed=1)


_KILLED_PARENT = '''
import os, sys, time
from tests.live.test_sampler_process import _spec
from orchestrator.live.sampler_process import SamplerProcess
from orchestrator.tasks.tokenizer import CharTokenizer
sampler = SamplerProcess(_spec(), CharTokenizer())
sampler.wait_ready()
print(sampler.pid, flush=True)
time.sleep(600)
'''


def test_a_killed_run_leaves_no_sampler_behind():
  parent = subprocess.Popen([sys.executable, "-c", _KILLED_PARENT], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
  try:
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 60
    while _alive(child) and time.monotonic() < deadline:
      time.sleep(0.2)
    assert not _alive(child), "the sampler process outlived its killed parent"
  finally:
    parent.kill()


def _alive(pid: int) -> bool:
  """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


@pytest.fixture(scope="module")
def chunked_pair(pair):
  """An in-process sampler and a process sampler of 4-token completions over any id (so a generation has chunks)."""
  import dataclasses

  from orchestrator.live.sampler import LiveSampler
  from orchestrator.tasks.tokenizer import CharTokenizer

  spec = dataclasses.replace(_spec(), max_generation_steps=4, alphabet=None)
  here = LiveSampler(spec.preset, CharTokenizer(), seed=0, max_prompt_length=16, max_generation_steps=4)
  there = SamplerProcess(spec, CharTokenizer())
  yield here, there, pair[2]
  there.close()


def test_a_generation_in_chunks_asks_for_each_chunks_weights_and_lets_an_evaluation_in_between(chunked_pair):
  """In-flight updates with the sampler in its own process: the child asks this side for each chunk's weights
  (version 0, the sampler's own, for the first two chunks; the trained weights as version 1 after) and hands out
  the generation so far where asked; it samples what the in-process sampler samples in chunks, bit for bit, token
  versions and the generation so far included. A greedy request made while a chunk's weights are awaited (what an
  evaluation at the boundary does) is answered in between. Negative control: the same call on version 0
  throughout samples other log-probs."""
  here, there, trained = chunked_pair
  asked, greedy_between, partials = {"here": [], "there": []}, [], {"here": [], "there": []}

  def weights(side, sampler):
    def for_chunk(chunk):
      asked[side].append(chunk)
      if side == "there" and chunk == 2:
        greedy_between.append(sampler.greedy(PROMPTS[:2]))
      return (0, None) if chunk < 2 else (1, trained)
    return for_chunk

  def keep(side):
    return lambda chunk, generation: partials[side].append((chunk, generation() if chunk == 2 else None))

  settings = dict(seed=7, chunk_tokens=1)
  a = here.sample(PROMPTS, weights_for_chunk=weights("here", here), before_chunk=keep("here"), **settings)
  b = there.sample(PROMPTS, weights_for_chunk=weights("there", there), before_chunk=keep("there"), **settings)
  _same(a, b)
  assert asked["here"] == asked["there"] == [0, 1, 2, 3]
  assert [np.asarray(v).tolist() for v in b.versions] == [[0, 0, 1, 1]] * len(PROMPTS) and b.weights_version == 0
  (chunk_here, partial_here), (chunk_there, partial_there) = partials["here"][1], partials["there"][1]
  assert chunk_here == chunk_there == 2
  for x, y in zip(partial_here.tokens + partial_here.logprobs, partial_there.tokens + partial_there.logprobs):
    np.testing.assert_array_equal(x, y)
  assert greedy_between == [here.greedy(PROMPTS[:2])]
  one_version = there.sample(PROMPTS, weights_for_chunk=lambda chunk: (0, None), **settings)
  assert any(not np.array_equal(x, y) for x, y in zip(one_version.logprobs, b.logprobs))


def test_a_generation_in_chunks_given_up_while_it_waits_leaves_the_child_serving(chunked_pair):
  """The run closing while a chunk waits for its weights (the callback raises): the error reaches the caller, the
  child gives the generation up, and its next request is answered as before."""
  here, there, _ = chunked_pair

  def closing(chunk):
    if chunk == 1:
      raise RuntimeError("closed while waiting")
    return 0, None

  with pytest.raises(RuntimeError, match="closed while waiting"):
    there.sample(PROMPTS, seed=7, chunk_tokens=1, weights_for_chunk=closing)
  assert there.greedy(PROMPTS[:2]) == here.greedy(PROMPTS[:2])

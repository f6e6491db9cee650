"""A sampler never opens an accelerator the trainer's process holds: the sampler's process starts with JAX on
the host's cores (set before it imports JAX, whatever the parent's ``JAX_PLATFORMS``), and ``auto`` builds an
in-process sampler on the trainer's devices where they are an accelerator's (faked here), a process on a CPU
host; a shared sampler is handed the trainer's device arrays at a sync, not a host copy."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from orchestrator.live import sampler_process
from orchestrator.live.placement import keep
from orchestrator.live.sampler_process import SamplerProcess, SamplerProcessError, SamplerSpec
from orchestrator.tasks.tasks import FirstLetter
from orchestrator.tasks.tokenizer import CharTokenizer

TASK = FirstLetter(length=4, letters=8)


def _spec():
  from orchestrator.models.presets import load_preset
  from orchestrator.recipe.model_section import ModelSection

  return SamplerSpec(preset=load_preset("tiny"), model=ModelSection(preset="tiny"), seed=0, max_prompt_length=16,
                     max_generation_steps=1, alphabet=TASK.answer_alphabet, dtype="float32")


def _child_platform(monkeypatch, parent_platforms: str) -> dict:
  monkeypatch.setenv("JAX_PLATFORMS", parent_platforms)
  child = SamplerProcess(_spec(), CharTokenizer())
  try:
    child.wait_ready()
    return child.child_platform
  finally:
    child.close()


@pytest.mark.e2e
def test_the_sampler_process_computes_on_the_hosts_cores_whatever_its_parent_names(monkeypatch):
  # the parent names a platform list the child must not inherit (an accelerator first, as a TPU host's may)
  assert _child_platform(monkeypatch, "cpu,tpu") == {"platform": "cpu", "jax_platforms": "cpu"}


@pytest.mark.e2e
def test_negative_control_without_the_childs_environment_it_opens_the_parents_platforms(monkeypatch):
  # the child inherits "cpu,tpu" and JAX there starts every platform named: here the TPU's runtime is missing,
  # on a TPU host the trainer holds it; either way the sampler fails before it samples
  monkeypatch.setattr(sampler_process, "CHILD_ENVIRONMENT", {})
  with pytest.raises(SamplerProcessError, match="tpu"):
    _child_platform(monkeypatch, "cpu,tpu")


@pytest.mark.engine
def test_auto_beside_an_accelerator_builds_an_in_process_sampler_on_the_trainers_devices(monkeypatch):
  from orchestrator import assembly
  from orchestrator.live.sampler import LiveSampler
  from orchestrator.recipe import resolve

  recipe = resolve(overrides=["steps=4"]).recipe
  assert recipe.rollouts.placement == "auto"
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  source = assembly.live_source(recipe)
  try:
    assert type(source.sampler) is LiveSampler
    assert source.sampler_where.startswith("on the trainer's TPU devices")
  finally:
    source.close()


@pytest.mark.engine
def test_a_shared_samplers_sync_keeps_the_trainers_device_arrays_and_a_process_gets_host_copies():
  weights = {"w": jax.numpy.arange(6.0).reshape(2, 3)}
  kept, moved = keep(None, weights, on_device=True)
  assert kept["w"] is weights["w"] and moved is None
  copied, _ = keep(None, weights, on_device=False)  # the negative control: a host copy
  assert isinstance(copied["w"], np.ndarray) and not isinstance(copied["w"], jax.Array)
  np.testing.assert_array_equal(copied["w"], np.asarray(weights["w"]))


@pytest.mark.engine
def test_a_character_tokenizer_under_a_wide_vocabulary_samples_only_its_ids_with_the_forbidden_ids_one_argument():
  """A 49,152-wide vocabulary (SmolLM2's) under the character tokenizer: ~49,000 forbidden ids, which Tunix would
  take as as many jit arguments (a compile of minutes and tens of GB); given as one array they are one."""
  from orchestrator.models.presets import load_preset
  from orchestrator.live.sampler import LiveSampler

  tokenizer = CharTokenizer()
  sampler = LiveSampler(load_preset("tiny", vocab_size=49152), tokenizer, seed=0, max_prompt_length=16,
                        max_generation_steps=6)
  assert len(jax.tree.leaves(tuple(sampler._forbidden))) == 1  # Tunix's tuple() of it: one leaf
  out = sampler.sample(["abc", "de"] * 2, seed=3)
  ids = np.concatenate([np.asarray(c) for c in out.completion_ids])
  assert ids.size and ids.max() < tokenizer.vocab_size  # nothing drawn from the 49,000 forbidden ids


@pytest.mark.engine
def test_the_forbidden_ids_as_one_array_sample_what_they_sampled_as_a_list_of_ids():
  """Bit for bit: the one-array form masks exactly what Tunix's tuple of ids did (tiny vocabulary: both compile)."""
  from orchestrator.models.presets import load_preset
  from orchestrator.live.sampler import LiveSampler

  sampler = LiveSampler(load_preset("tiny"), CharTokenizer(), seed=0, max_prompt_length=16, max_generation_steps=5)
  as_array = sampler.sample(["abc", "de"] * 2, seed=7, temperature=1.3)
  sampler._forbidden = [int(i) for i in sampler._forbidden[0]]  # the form Tunix was given before
  as_ids = sampler.sample(["abc", "de"] * 2, seed=7, temperature=1.3)
  for a, b in zip(as_array.completion_ids, as_ids.completion_ids):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(as_array.logprobs, as_ids.logprobs):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

"""A generation in decode chunks (``live.chunked_sampling``): on one version it draws exactly what one call of
Tunix's sampler draws; across a version switch the tokens before it are the old weights' and every token after
it, with its log-prob, is the new weights' given the whole prefix (a forward pass of them agrees, the old
weights' does not); each token records its version; a generation carried where the weights change resumes to the
uninterrupted one, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.engine

PROMPTS = ["abc", "hello", "xy", "abc"]
PROMPT_TOKENS, COMPLETION_TOKENS, CHUNK_TOKENS, SEED = 16, 6, 2, 11


@pytest.fixture(scope="module")
def sampler():
  from orchestrator.live.sampler import LiveSampler
  from orchestrator.models.presets import load_preset
  from orchestrator.tasks.tokenizer import CharTokenizer

  return LiveSampler(load_preset("tiny"), CharTokenizer(), seed=0, max_prompt_length=PROMPT_TOKENS,
                     max_generation_steps=COMPLETION_TOKENS)


@pytest.fixture(scope="module")
def other_weights(sampler):
  """Weights of the same graph from another seed: a version far enough from version 0 to tell apart."""
  import jax

  from orchestrator.engine import model as model_lib
  from orchestrator.models.presets import load_preset

  _, params, _ = model_lib.build_model(load_preset("tiny"), 7)
  return jax.device_put(jax.device_get(params), sampler._own_sharding)


def _chunked(sampler, weights_by_chunk):
  from orchestrator.live import chunked_sampling
  from orchestrator.live.sampler import NEVER_SAMPLED

  flat = {v: chunked_sampling.flattened_weights(sampler._graphdef, w) for v, w in dict(weights_by_chunk).items()}
  return chunked_sampling.sample_in_chunks(
      sampler._sampler, PROMPTS, max_generation_steps=COMPLETION_TOKENS, max_prompt_length=PROMPT_TOKENS,
      chunk_tokens=CHUNK_TOKENS, weights_for_chunk=lambda g: (weights_by_chunk[g][0], flat[weights_by_chunk[g][0]]),
      seed=SEED, temperature=1.0, top_p=1.0, forbidden_tokens=sampler._forbidden, eos_tokens=[NEVER_SAMPLED])


def _policy_logprobs(sampler, params, prompt_ids, completion_ids) -> np.ndarray:
  """Each completion token's log-prob under ``params`` by one forward pass over prompt and completion (the
  tempered distribution at temperature 1 over the ids the sampler may emit, as the sampler returns them)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  model = nnx.merge(sampler._graphdef, params)
  tokens = np.concatenate([prompt_ids, completion_ids])[None]
  length = tokens.shape[1]
  logits, _ = model(jnp.asarray(tokens), jnp.arange(length)[None], None, jnp.tril(jnp.ones((1, length, length), bool)))
  logits = logits[0].astype(jnp.float32)
  if sampler._forbidden is not None:
    logits = logits.at[:, sampler._forbidden[0]].set(-jnp.inf)
  logp = jax.nn.log_softmax(logits, axis=-1)
  targets = np.arange(len(prompt_ids) - 1, length - 1)
  return np.asarray(logp[targets, completion_ids])


def test_chunks_on_one_version_draw_exactly_what_one_call_draws(sampler):
  from orchestrator.live.sampler import NEVER_SAMPLED

  chunks = -(-COMPLETION_TOKENS // CHUNK_TOKENS)
  plain = sampler._sampler([sampler.model_prompt(p) for p in PROMPTS], max_generation_steps=COMPLETION_TOKENS,
                           max_prompt_length=PROMPT_TOKENS, temperature=1.0, seed=SEED, return_logprobs=True,
                           forbidden_tokens=sampler._forbidden, eos_tokens=[NEVER_SAMPLED], top_p=1.0)
  compiled = sampler._sampler._compiled_decode_fn._cache_size()
  out = _chunked(sampler, [(0, sampler._params)] * chunks)
  assert sampler._sampler._compiled_decode_fn._cache_size() == compiled  # the call's own decode, not another
  for row in range(len(PROMPTS)):
    np.testing.assert_array_equal(out.tokens[row], np.asarray(plain.tokens[row]))
    np.testing.assert_array_equal(out.logprobs[row], np.asarray(plain.logprobs[row], np.float32))
    assert out.versions[row].tolist() == [0] * COMPLETION_TOKENS
  # Negative control: another seed draws other tokens, so equality above is not vacuous.
  other = sampler._sampler([sampler.model_prompt(p) for p in PROMPTS], max_generation_steps=COMPLETION_TOKENS,
                           max_prompt_length=PROMPT_TOKENS, temperature=1.0, seed=SEED + 1, return_logprobs=True,
                           forbidden_tokens=sampler._forbidden, eos_tokens=[NEVER_SAMPLED], top_p=1.0)
  assert any(not np.array_equal(out.tokens[r], np.asarray(other.tokens[r])) for r in range(len(PROMPTS)))


def test_after_a_switch_every_token_and_log_prob_is_the_new_weights_given_the_whole_prefix(sampler, other_weights):
  old = _chunked(sampler, [(0, sampler._params)] * 3)
  switched = _chunked(sampler, [(0, sampler._params), (1, other_weights), (1, other_weights)])
  again = _chunked(sampler, [(0, sampler._params), (1, other_weights), (1, other_weights)])
  differs = 0
  for row, prompt in enumerate(PROMPTS):
    assert switched.versions[row].tolist() == [0, 0, 1, 1, 1, 1]
    np.testing.assert_array_equal(switched.tokens[row][:CHUNK_TOKENS], old.tokens[row][:CHUNK_TOKENS])
    np.testing.assert_array_equal(switched.logprobs[row][:CHUNK_TOKENS], old.logprobs[row][:CHUNK_TOKENS])
    np.testing.assert_array_equal(switched.tokens[row], again.tokens[row])  # counts alone: the same every time
    prompt_ids = sampler.prompt_ids(prompt)
    new_policy = _policy_logprobs(sampler, other_weights, prompt_ids, switched.tokens[row])
    old_policy = _policy_logprobs(sampler, sampler._params, prompt_ids, switched.tokens[row])
    np.testing.assert_allclose(switched.logprobs[row][CHUNK_TOKENS:], new_policy[CHUNK_TOKENS:], atol=2e-5)
    np.testing.assert_allclose(switched.logprobs[row][:CHUNK_TOKENS], old_policy[:CHUNK_TOKENS], atol=2e-5)
    # Negative control: the old weights give the post-switch tokens other log-probs.
    differs += not np.allclose(switched.logprobs[row][CHUNK_TOKENS:], old_policy[CHUNK_TOKENS:], atol=1e-3)
  assert differs == len(PROMPTS)


def test_the_live_samplers_chunked_call_on_one_version_samples_what_its_whole_call_does(sampler, other_weights):
  """``LiveSampler.sample`` with ``weights_for_chunk`` (in-flight updates): on its own weights throughout, the
  completions, log-probs and ends of its one call, each token on version 0; a switch part way (negative
  control) changes the later tokens, which carry the new version."""
  settings = {"seed": SEED, "temperature": 1.0}
  whole = sampler.sample(PROMPTS, **settings)
  chunked = sampler.sample(PROMPTS, **settings, weights_for_chunk=lambda g: (0, None), chunk_tokens=CHUNK_TOKENS)
  assert whole.versions is None
  for row in range(len(PROMPTS)):
    np.testing.assert_array_equal(chunked.completion_ids[row], whole.completion_ids[row])
    np.testing.assert_array_equal(chunked.logprobs[row], whole.logprobs[row])
    assert chunked.versions[row].tolist() == [0] * len(chunked.completion_ids[row])
  assert chunked.texts == whole.texts and chunked.ended == whole.ended and chunked.weights_version == 0
  switched = sampler.sample(PROMPTS, **settings, chunk_tokens=CHUNK_TOKENS,
                            weights_for_chunk=lambda g: (0, None) if g == 0 else (1, other_weights))
  assert switched.weights_version == 0 and sampler.weights_version == 0  # the sampler's own weights untouched
  assert all(v.tolist() == [0] * CHUNK_TOKENS + [1] * (len(v) - CHUNK_TOKENS) for v in switched.versions)
  assert any(not np.array_equal(s, w) for s, w in zip(switched.completion_ids, whole.completion_ids))


def _resumable(sampler, weights_by_chunk, *, eos: list[int] | None = None, seed: int = SEED, tunix=None,
               **kwargs):
  """``_chunked`` with ``sample_in_chunks``'s other arguments (``before_chunk``, ``resume_from``), eos ids
  (None: one never sampled), a seed, and another Tunix sampler over the same model (``tunix``; None: the live
  sampler's own)."""
  from orchestrator.live import chunked_sampling
  from orchestrator.live.sampler import NEVER_SAMPLED

  flat = {v: chunked_sampling.flattened_weights(sampler._graphdef, w) for v, w in dict(weights_by_chunk).items()}
  return chunked_sampling.sample_in_chunks(
      tunix or sampler._sampler, PROMPTS, max_generation_steps=COMPLETION_TOKENS, max_prompt_length=PROMPT_TOKENS,
      chunk_tokens=CHUNK_TOKENS, weights_for_chunk=lambda g: (weights_by_chunk[g][0], flat[weights_by_chunk[g][0]]),
      seed=seed, temperature=1.0, top_p=1.0, forbidden_tokens=sampler._forbidden,
      eos_tokens=[NEVER_SAMPLED] if eos is None else eos, **kwargs)


def test_a_generation_carried_where_the_weights_change_resumes_to_the_uninterrupted_one(sampler, other_weights):
  """What a checkpoint inside a generation carries: the tokens, log-probs and versions before a chunk whose weights
  differ from the chunk before. Resumed from them, the generation ends with the uninterrupted one's tokens and
  log-probs, bit for bit, and its versions. Negative controls: one carried token changed changes what follows
  (the resume samples from the carried tokens, not from anything the sampler kept), and a resume where the
  weights do not change is refused (the uninterrupted generation kept its cache there)."""
  import dataclasses

  from orchestrator.live.chunked_sampling import PartialGeneration

  versions = [(0, sampler._params), (0, sampler._params), (1, other_weights)]
  carried: dict[int, PartialGeneration] = {}
  whole = _resumable(sampler, versions, before_chunk=lambda chunk, partial: carried.setdefault(chunk, partial()))
  assert sorted(carried) == [1, 2] and carried[2].versions.tolist() == [0] * 2 * CHUNK_TOKENS
  resumed = _resumable(sampler, versions, resume_from=carried[2])
  for row in range(len(PROMPTS)):
    np.testing.assert_array_equal(resumed.tokens[row], whole.tokens[row])
    np.testing.assert_array_equal(resumed.logprobs[row], whole.logprobs[row])
    assert resumed.versions[row].tolist() == [0] * 2 * CHUNK_TOKENS + [1] * (COMPLETION_TOKENS - 2 * CHUNK_TOKENS)
    np.testing.assert_array_equal(carried[2].tokens[row], whole.tokens[row][:2 * CHUNK_TOKENS])

  vocabulary = sorted({int(t) for row in whole.tokens for t in row})
  changed = [row.copy() for row in carried[2].tokens]
  changed[0][-1] = next(t for t in vocabulary if t != changed[0][-1])
  other = _resumable(sampler, versions, resume_from=dataclasses.replace(carried[2], tokens=changed))
  assert not np.array_equal(other.logprobs[0][2 * CHUNK_TOKENS:], whole.logprobs[0][2 * CHUNK_TOKENS:])

  with pytest.raises(ValueError, match="only where the weights change"):
    _resumable(sampler, versions, resume_from=carried[1])
  with pytest.raises(ValueError, match="resume it with the call that carried it"):
    _resumable(sampler, versions, resume_from=dataclasses.replace(carried[2], done=carried[2].done[:1]))
  with pytest.raises(ValueError, match=f"carried with seed={SEED} does not resume a call with seed={SEED + 1}"):
    _resumable(sampler, versions, resume_from=carried[2], seed=SEED + 1)


def test_a_generation_whose_rows_all_ended_before_the_carry_stays_ended_on_resume(sampler, other_weights):
  """Every row's eos before the carried chunk: carried as ended (Tunix's ``done``), the resume stops decoding as
  the uninterrupted generation did (Tunix decodes while any row has not ended). Negative control: the same tokens
  carried as not ended sample on."""
  import dataclasses

  from orchestrator.live import tunix_sampler
  from orchestrator.live.chunked_sampling import PartialGeneration

  versions = [(0, sampler._params), (0, sampler._params), (1, other_weights)]
  # each row's second token is an eos in the runs below (Tunix takes a list of eos ids)
  eos = sorted({int(row[1]) for row in _resumable(sampler, versions).tokens})
  # Tunix reads its eos ids when it first compiles: a sampler of its own compiles with these
  own = sampler._sampler
  ending = tunix_sampler.Sampler(own.transformer, own.tokenizer, own.cache_config)
  carried: dict[int, PartialGeneration] = {}
  whole = _resumable(sampler, versions, eos=eos, tunix=ending,
                     before_chunk=lambda c, partial: carried.setdefault(c, partial()))
  assert all(carried[2].done)
  resumed = _resumable(sampler, versions, eos=eos, tunix=ending, resume_from=carried[2])
  for row in range(len(PROMPTS)):
    np.testing.assert_array_equal(resumed.tokens[row], whole.tokens[row])
    np.testing.assert_array_equal(resumed.logprobs[row], whole.logprobs[row])
  reopened = _resumable(sampler, versions, eos=eos, tunix=ending,
                        resume_from=dataclasses.replace(carried[2], done=[False] * len(PROMPTS)))
  assert any(not np.array_equal(r, w) for r, w in zip(reopened.tokens, whole.tokens))

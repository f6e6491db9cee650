"""Sampling a generation in decode chunks, with the weights allowed to change between chunks (in-flight updates).

Tunix's ``Sampler.__call__`` prefills the prompts and runs one decode loop to
the completion limit. Its decode loop's bound (``total_sampling_steps``) is a
traced leaf of the sampling state, so the same compiled loop can stop after a
chunk and continue later, possibly with other weights, without a recompile.
Each token's sampling key is ``fold_in(seed, position)``, so a generation in
chunks on one version draws what one call draws: the same tokens and log-probs.

Where a chunk samples with weights other than the chunk before it, the KV
cache is re-filled: a prefill of the new weights over the prompt and every
token generated so far, which also samples the chunk's first token (with that
position's key), as a fresh generation from that prefix with the new weights
would. So every token after the switch, and its log-prob, is the new policy's
given the whole prefix, and the state at a switch is the tokens alone: a run
resumed there from carried tokens samples what the uninterrupted one did.
Keeping the old cache instead would make the tokens after a switch attend to
keys and values the old weights computed — a policy that is neither version's,
whose log-probs the trainer (which recomputes the whole sequence with one
version) cannot match — and a resume would need the cache itself.

This uses Tunix 0.1.7's private sampling functions (``init_sample_state``,
``_compiled_prefill_fn``, ``_compiled_decode_fn``), as its ``__call__`` does.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate import utils as tunix_utils

from orchestrator.live import tunix_sampler


@dataclasses.dataclass(frozen=True)
class ChunkedOutput:
  """What a chunked generation drew, per prompt: ``tokens[i]`` its ``max_generation_steps`` completion ids (as
  Tunix's sampler returns them, eos ids not cut), ``logprobs[i]`` each one's log-prob under the weights that
  sampled it, and ``versions[i]`` the version of those weights."""

  tokens: list[np.ndarray]
  logprobs: list[np.ndarray]
  versions: list[np.ndarray]


@dataclasses.dataclass(frozen=True)
class PartialGeneration:
  """A chunked generation before decode chunk ``next_chunk``, a chunk whose weights differ from the chunk before
  it: per prompt, the completion ids sampled so far (``next_chunk`` chunks' worth), each one's log-prob, and
  whether the row had ended (Tunix's ``done``); ``versions``: each of those tokens' weights version, the same for
  every prompt. Such a chunk re-fills the cache from the tokens alone, so ``sample_in_chunks(resume_from=...)``
  goes on from here as the uninterrupted generation did: what a checkpoint inside a generation carries."""

  next_chunk: int
  tokens: list[np.ndarray]
  logprobs: list[np.ndarray]
  done: list[bool]
  versions: np.ndarray
  #: The call it is part of (``call_settings``): a resume by any other call is refused.
  call: dict[str, Any]

  def to_json(self) -> dict[str, Any]:
    """As JSON (a checkpoint's metadata): every value exactly (log-probs are float32, which a JSON float holds)."""
    return {"next_chunk": self.next_chunk, "tokens": [row.tolist() for row in self.tokens],
            "logprobs": [[float(x) for x in row] for row in self.logprobs], "done": list(self.done),
            "versions": self.versions.tolist(), "call": dict(self.call)}

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> "PartialGeneration":
    """``to_json``'s output back.

    Raises:
      ValueError: a field is missing or of the wrong kind (a damaged or foreign checkpoint).
    """
    try:
      return cls(next_chunk=int(data["next_chunk"]), tokens=[np.asarray(row, np.int32) for row in data["tokens"]],
                 logprobs=[np.asarray(row, np.float32) for row in data["logprobs"]],
                 done=[bool(d) for d in data["done"]], versions=np.asarray(data["versions"], np.int64),
                 call=dict(data["call"]))
    except (KeyError, TypeError, ValueError, OverflowError) as e:
      raise ValueError(f"a carried generation that does not read as one ({type(e).__name__}: {e})") from None


def call_settings(prompts: Sequence[str], *, max_generation_steps: int, max_prompt_length: int, chunk_tokens: int,
                  seed: int, temperature: float, top_p: float | None, top_k: int | None,
                  forbidden_tokens: Sequence[Any] | None, eos_tokens: Sequence[int] | None) -> dict[str, Any]:
  """What makes one chunked generation that generation (a ``PartialGeneration``'s ``call``): every argument of
  ``sample_in_chunks`` that decides what it samples, as plain values (the forbidden ids by their CRC-32)."""
  forbidden = (np.concatenate([np.asarray(ids, np.int64).ravel() for ids in forbidden_tokens])
               if forbidden_tokens else np.zeros(0, np.int64))
  return {"prompts": list(prompts), "max_generation_steps": int(max_generation_steps),
          "max_prompt_length": int(max_prompt_length), "chunk_tokens": int(chunk_tokens), "seed": int(seed),
          "temperature": float(temperature), "top_p": None if top_p is None else float(top_p),
          "top_k": None if top_k is None else int(top_k), "forbidden_tokens_crc32": zlib.crc32(forbidden.tobytes()),
          "eos_tokens": None if eos_tokens is None else [int(t) for t in eos_tokens]}


def flattened_weights(graphdef: Any, params: Any) -> list[Any]:
  """Weights as Tunix's sampler passes them to its compiled functions (``Sampler._flattened_transformer_state``):
  the model's variables, each a leaf."""
  return jax.tree.leaves(nnx.variables(nnx.merge(graphdef, params)), is_leaf=lambda x: isinstance(x, nnx.Variable))


def sample_in_chunks(sampler, prompts: Sequence[str], *, max_generation_steps: int, max_prompt_length: int,
                     chunk_tokens: int, weights_for_chunk: Callable[[int], tuple[int, Any]], seed: int,
                     temperature: float, top_p: float = 1.0, top_k: int | None = None,
                     forbidden_tokens: Sequence[Any] | None = None,
                     eos_tokens: Sequence[int] | None = None,
                     before_chunk: Callable[[int, Callable[[], PartialGeneration]], None] | None = None,
                     resume_from: PartialGeneration | None = None) -> ChunkedOutput:
  """Samples one completion of each of ``prompts`` (already formatted), ``chunk_tokens`` tokens a chunk.

  Args:
    sampler: a Tunix ``Sampler``; its own weights are not used (each chunk's come from ``weights_for_chunk``).
    max_generation_steps, max_prompt_length: as ``Sampler.__call__`` takes them (the same compiled functions).
    chunk_tokens: completion tokens per chunk (the last chunk may be shorter).
    weights_for_chunk: chunk index -> (version, weights as ``flattened_weights`` gives them), called once per
      chunk in order before it is sampled (it may wait for that version, and let another caller use the sampler
      meanwhile: the generation's state is this function's, never the sampler's). A chunk whose version differs
      from the chunk before it re-fills the cache with its weights.
    seed, temperature, top_p, top_k, forbidden_tokens, eos_tokens: as ``Sampler.__call__`` takes them.
    before_chunk: called before each chunk from the second on (before ``weights_for_chunk``) with the chunk's
      index and a function that returns the generation so far (``PartialGeneration``; it copies the buffers off
      the device, so only when asked, and only while ``before_chunk`` runs). The generation so far is one a
      resume can go on from only where that chunk's version differs from the chunk before it.
    resume_from: go on from a ``PartialGeneration`` of this same call (prompts, sizes, seed, settings) rather than
      from the prompts: its tokens, log-probs and versions are the output's first ones, and chunk
      ``resume_from.next_chunk`` re-fills the cache with its own weights, which must differ from the last carried
      token's version (else the uninterrupted generation kept its cache there, and the resume would not be it).

  Raises:
    ValueError: ``chunk_tokens`` below 1, a prompt longer than ``max_prompt_length``, or a ``resume_from`` that
      does not fit this call or resumes where the weights do not change.
  """
  if chunk_tokens < 1:
    raise ValueError(f"chunk_tokens={chunk_tokens}: a chunk decodes at least one token")
  eos_ids = jnp.array(eos_tokens or [sampler.tokenizer.eos_id()])
  sampler.eos_ids = eos_ids
  total = max_prompt_length + max_generation_steps
  call = call_settings(prompts, max_generation_steps=max_generation_steps, max_prompt_length=max_prompt_length,
                       chunk_tokens=chunk_tokens, seed=seed, temperature=temperature, top_p=top_p, top_k=top_k,
                       forbidden_tokens=forbidden_tokens, eos_tokens=eos_tokens)
  state = _initial_state(sampler, call, forbidden_tokens)
  prompt_tokens = state.num_input_tokens  # what the compiled decode was traced with: it must not change
  chunks = -(-max_generation_steps // chunk_tokens)
  versions = np.zeros(max_generation_steps, np.int64)
  current, first = None, 0
  if resume_from is not None:
    first = resume_from.next_chunk
    _check_resume(resume_from, call, chunks=chunks)
    state = _carried(state, resume_from, max_prompt_length)
    versions[:len(resume_from.versions)] = resume_from.versions
    current = int(resume_from.versions[-1])
  for chunk in range(first, chunks):
    start = chunk * chunk_tokens  # the chunk's first completion token
    if before_chunk is not None and chunk > 0:
      before_chunk(chunk, lambda: _partial(state, chunk, start, versions, call))
    version, weights = weights_for_chunk(chunk)
    # weights_for_chunk may wait, and another caller may use the sampler meanwhile (an evaluation, whose call
    # sets its own eos ids): a re-fill's prefill compiled now must read this generation's
    sampler.eos_ids = eos_ids
    if chunk == 0:
      state = sampler._compiled_prefill_fn(weights, state, None, echo=False)
    elif version != current:
      state = _refill(sampler, weights, state, max_prompt_length + start, prompt_tokens)
    elif resume_from is not None and chunk == first:
      raise ValueError(f"a generation resumed before chunk {chunk} goes on with version {version}, the version of"
                       " its last carried token: the uninterrupted generation kept its cache there, which a"
                       " resume does not have; carry a generation only where the weights change")
    current = version
    end = min(start + chunk_tokens, max_generation_steps)
    versions[start:end] = version
    # The decode loop writes the token after ``decoding_step`` while ``decoding_step < total_sampling_steps``: a
    # bound of P + end - 1 stops it with completion token end - 1 written; the last chunk's is the whole call's.
    bound = total if end == max_generation_steps else max_prompt_length + end - 1
    # made from the leaf the prefill returned (its dtype and weak type, not a Python int's), so the decode Tunix's
    # own call compiled is the one every chunk runs
    bound = state.total_sampling_steps - state.total_sampling_steps + bound
    state = sampler._compiled_decode_fn(weights, dataclasses.replace(state, total_sampling_steps=bound))
  buffer = np.asarray(jax.device_get(state.token_buffer))[:, max_prompt_length:total]
  logprobs = np.asarray(jax.device_get(state.logprobs_buffer))[:, max_prompt_length:total]
  return ChunkedOutput([row.astype(np.int32) for row in buffer], [row.astype(np.float32) for row in logprobs],
                       [versions.copy() for _ in prompts])


def _initial_state(sampler, call: dict[str, Any], forbidden_tokens: Sequence[Any] | None):
  """The sampling state of ``call`` (``call_settings``'s) before its first chunk: its prompts tokenised and padded
  on the left, as Tunix's own call starts."""
  tokens = [sampler.tokenize(p) for p in call["prompts"]]
  max_prompt_length = call["max_prompt_length"]
  if max(len(t) for t in tokens) > max_prompt_length:
    raise ValueError(f"a prompt of {max(len(t) for t in tokens)} tokens is longer than max_prompt_length="
                     f"{max_prompt_length}")
  pad = sampler.tokenizer.pad_id()
  input_ids = np.array([tunix_utils.pad_to_length(t, target_length=max_prompt_length, pad_value=pad, left=True)
                        for t in tokens])
  return tunix_sampler.with_plain_static_fields(sampler.init_sample_state(
      jnp.array(input_ids), include_logits=False, total_sampling_steps=max_prompt_length + call["max_generation_steps"],
      forbidden_token_ids=tuple(forbidden_tokens) if forbidden_tokens else None, temperature=call["temperature"],
      top_p=call["top_p"], top_k=call["top_k"], seed=jax.random.PRNGKey(call["seed"]), beam_size=None,
      include_logprobs=True))


def _partial(state, next_chunk: int, start: int, versions: np.ndarray, call: dict[str, Any]) -> PartialGeneration:
  """The generation in ``state`` before chunk ``next_chunk``, whose first completion token is ``start``."""
  span = slice(call["max_prompt_length"], call["max_prompt_length"] + start)
  tokens = np.asarray(jax.device_get(state.token_buffer))[:, span]
  logprobs = np.asarray(jax.device_get(state.logprobs_buffer))[:, span]
  done = np.asarray(jax.device_get(state.done)).tolist()
  return PartialGeneration(next_chunk=next_chunk, tokens=[row.copy() for row in tokens],
                           logprobs=[row.copy() for row in logprobs], done=[bool(d) for d in done],
                           versions=versions[:start].copy(), call=dict(call))


def _check_resume(partial: PartialGeneration, call: dict[str, Any], *, chunks: int) -> None:
  """Refuses a ``PartialGeneration`` that is not one of this call's (``sample_in_chunks``'s ``resume_from``)."""
  for key, value in call.items():
    if partial.call.get(key) != value:
      shown = (lambda v: f"{len(v)} prompts" if isinstance(v, list) and key == "prompts" else repr(v))
      raise ValueError(f"a generation carried with {key}={shown(partial.call.get(key))} does not resume a call with"
                       f" {key}={shown(value)}: resume it with the call that carried it")
  if not 0 < partial.next_chunk < chunks:
    raise ValueError(f"a generation carried before chunk {partial.next_chunk} does not resume a call of {chunks}"
                     " decode chunks: the first chunk starts from the prompts, and past the last there is nothing"
                     " left to sample")
  rows, carried_tokens = len(call["prompts"]), partial.next_chunk * call["chunk_tokens"]
  shapes = {len(partial.tokens), len(partial.logprobs), len(partial.done)}
  lengths = {len(row) for row in (*partial.tokens, *partial.logprobs)} | {len(partial.versions)}
  if shapes != {rows} or lengths != {carried_tokens}:
    raise ValueError(f"a generation carried before chunk {partial.next_chunk} holds {sorted(shapes)} rows of"
                     f" {sorted(lengths)} tokens; this call has {rows} prompts with {carried_tokens} tokens before"
                     " that chunk: resume it with the call that carried it")


def _carried(state, partial: PartialGeneration, max_prompt_length: int):
  """``state`` (fresh from the prompts) with ``partial``'s tokens, log-probs and ends: the uninterrupted
  generation's state before ``partial.next_chunk`` in everything its re-fill reads (the cache and decoding step
  are the re-fill's own)."""
  end = max_prompt_length + len(partial.versions)
  tokens = np.asarray(jax.device_get(state.token_buffer)).copy()
  logprobs = np.asarray(jax.device_get(state.logprobs_buffer)).copy()
  tokens[:, max_prompt_length:end] = np.stack(partial.tokens)
  logprobs[:, max_prompt_length:end] = np.stack(partial.logprobs)
  put = lambda value, like: jax.device_put(value.astype(like.dtype), like.sharding)
  return dataclasses.replace(state, token_buffer=put(tokens, state.token_buffer),
                             logprobs_buffer=put(logprobs, state.logprobs_buffer),
                             done=put(np.asarray(partial.done), state.done))


def _refill(sampler, weights, state, prefix_tokens: int, prompt_tokens) -> Any:
  """The sampling state after a prefill of ``weights`` over the first ``prefix_tokens`` tokens of each row
  (prompt and completion so far) into a fresh cache, which samples the token after them: a generation from that
  prefix with those weights. The prefill is compiled once per prefix length (a chunk boundary)."""
  batch = state.token_buffer.shape[0]
  fresh = sampler.transformer.init_cache(batch, sampler.cache_config.cache_size, sampler.dtype)
  # the prompt length is a static field: an int, never an Array (``live.tunix_sampler`` says why)
  prefill_state = dataclasses.replace(state, cache=fresh, decoding_step=prefix_tokens - 1,
                                      num_input_tokens=int(prefix_tokens))
  state = sampler._compiled_prefill_fn(weights, prefill_state, None, echo=False)
  return dataclasses.replace(state, num_input_tokens=prompt_tokens)

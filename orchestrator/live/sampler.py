"""Sampling completions from the model being trained, with Tunix's sampler, on weights the sync delivers.

The sampler holds its own copy of the weights (a version number says which
update produced them) and a Tunix ``Sampler`` over the same Qwen3 graph the
engine trains. ``sync`` replaces the weights with the trainer's exported ones;
``sample`` draws completions with a caller-given seed, so a (seed, step, group)
key gives the same completions in any process and in any boundary mode.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from tunix.generate import sampler as sampler_lib

from orchestrator.data.packing import RoutingShape
from orchestrator.engine import model as model_lib
from orchestrator.engine import moe as moe_lib
from orchestrator.engine.loss import attention_mask
from orchestrator.models.presets import ModelPreset
from orchestrator.live import chunked_sampling, tunix_sampler
from orchestrator.live.placement import SamplerPlacement, default_device
from orchestrator.tasks.tokenizer import sampled_token_ids


#: A token id no sampler produces: Tunix's stop when the completion's end is found here instead.
NEVER_SAMPLED = -1


@dataclasses.dataclass(frozen=True)
class Samples:
  """Completions of ``prompts`` (one per prompt), with their per-token log-probs under the sampler.

  ``prompt_ids[i]`` are the ids the model was given (bos where the tokenizer has one, the prompt as
  formatted); ``completion_ids[i]`` ends with the eos id when the model produced one, or with the token that
  completed a stop string. ``texts[i]`` is the completion's text, cut before its stop string (what the reward
  sees). ``ended[i]``: whether it ended with an eos or a stop string (False: cut at ``max_generation_steps`` or
  at its prompt's own limit); None for a fixed-length answer alphabet sampled without stop strings, which has
  no end. ``routing[i]`` (a sampler that records routing): the experts each MoE layer of the sampling weights
  chose for each token of prompt and completion (``LiveSampler``'s docstring says how they are found).
  ``versions[i]`` (a generation in chunks that took newer weights part way, ``chunked_sampling``): the weights
  version that sampled each completion token, whose log-prob in ``logprobs[i]`` is that version's; None: every
  token ``weights_version``'s.
  """

  prompts: list[str]
  prompt_ids: list[np.ndarray]
  completion_ids: list[np.ndarray]
  logprobs: list[np.ndarray]
  texts: list[str]
  weights_version: int
  ended: list[bool] | None = None
  routing: list[np.ndarray] | None = None  # per completion: [prompt + completion tokens, layers, top_k] int16
  # per completion: the weights version that sampled each token (in-flight updates; None: all weights_version)
  versions: list[np.ndarray] | None = None


class LiveSampler:
  """Tunix's sampler over the trained Qwen3, restricted to the tokenizer's ids.

  Args:
    preset: the model preset the engine trains (same graph, same initial seed or checkpoint).
    tokenizer: the character tokenizer or a checkpoint's (``hf_tokenizer.HFTokenizer``); its ids must fit the
      preset's vocabulary. One with ``format_prompt`` (a chat template) formats every prompt first.
    seed: the weight seed, so version 0 equals the engine's initial weights.
    max_prompt_length, max_generation_steps: fixed sizes (no recompiles).
    alphabet: the only characters completions may use (a toy task's answers: fixed length, no eos); None
      samples any id the tokenizer has, and a completion ends at an end-of-sequence id.
    dtype: the compute dtype (``engine.dtype``), as the engine trains.
    routing: record each sampled sequence's MoE routing (rollout routing replay; None: none). Tunix's sampler
      does not return the experts its decoding steps chose, so they are found by one forward pass of the
      sampling weights over each prompt and completion (``engine.moe.routing_of``): the routing those weights
      give the sequence. A decoding step computes the same scores through its cache, so a token whose top-k
      is close to a tie may have been decoded with the other choice; what the trainer replays is this pass's.
    placement: the devices it samples on and holds its weights on (``live.placement``); None: the default
      device.
  """

  def __init__(self, preset: ModelPreset, tokenizer, *, seed: int, max_prompt_length: int,
               max_generation_steps: int, alphabet: str | None = None, dtype: str = "float32",
               placement: SamplerPlacement | None = None, routing: RoutingShape | None = None):
    if tokenizer.vocab_size > preset.vocab_size:
      raise ValueError(f"the tokenizer's {tokenizer.vocab_size} ids do not fit {preset.name}'s vocabulary"
                       f" of {preset.vocab_size}")
    graphdefs, params, _ = model_lib.build_model(preset, seed, dtype=dtype)
    self.placement = placement
    self._own_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # without a placement
    if placement is not None:  # Tunix's sampler keeps the first weights' shardings: every later sync must match
      params = placement.put(params)
    else:  # placed as ``sync`` places every later version, on one sharding: a checkpoint's weights arrive
      # committed to a device, the trainer's on its mesh's sharding, and jit keys on that, so prefill and decode
      # would compile again at the first sync
      params = jax.device_put(jax.device_get(params), self._own_sharding)
    self._graphdef = graphdefs["dropless"]  # sampling never drops tokens
    self._params = params  # the weights sampling now: routing is recorded with them
    self.routing = routing
    self._routing_jit = jax.jit(functools.partial(_routing_of, self._graphdef)) if routing is not None else None
    #: The tree ``sync`` takes and each leaf's shape (a sampler in another process rebuilds the weights with it).
    self.weights_structure = jax.tree.structure(params)
    self.weight_shapes = [tuple(leaf.shape) for leaf in jax.tree.leaves(params)]
    self.tokenizer = tokenizer
    self.max_prompt_length = max_prompt_length
    self.max_generation_steps = max_generation_steps
    cache = sampler_lib.CacheConfig(cache_size=max_prompt_length + max_generation_steps,
                                    num_layers=preset.num_layers, num_kv_heads=preset.num_kv_heads,
                                    head_dim=preset.head_dim)
    self._sampler = tunix_sampler.Sampler(nnx.merge(self._graphdef, params), tokenizer, cache)
    self._vocab_size = preset.vocab_size  # the logits' width: a top_k at least this wide filters nothing
    allowed = set(sampled_token_ids(tokenizer, alphabet))
    forbidden = np.asarray([i for i in range(preset.vocab_size) if i not in allowed], np.int32)
    # Tunix keeps the forbidden ids as a tuple in its jitted sampling state, so each id would be an argument of its
    # own: a character tokenizer's ~100 ids under a 49,152-wide vocabulary leave 49,000, whose compile took over
    # 20 GB of host memory. One array in a one-element list (Tunix's ``tuple()`` of it) indexes the logits the
    # same way, as a single argument.
    self._forbidden = [forbidden] if forbidden.size else None
    self._eos_ids = list(getattr(tokenizer, "eos_ids", [tokenizer.eos_id()]))
    self._fixed_length = alphabet is not None  # answers end at their length: no eos is ever sampled
    self._format = getattr(tokenizer, "format_prompt", None)
    self.weights_version = 0

  #: A weight sync may hand this sampler the trainer's device arrays (``placement.keep``'s ``on_device``).
  takes_device_arrays = True

  def sync(self, weights: Any, version: int) -> None:
    """Takes the trainer's weights (host or device arrays, any placement): onto the sampler's device, device to
    device for arrays already on a device (the trainer's, when it shares them: no round trip through the host);
    with a placement, onto its devices, where ``placement.transfer`` did not put them already)."""
    placed = self._placed(weights)
    model = nnx.merge(self._graphdef, placed)
    self._sampler.transformer_state = nnx.variables(model)
    self._params = placed
    self.weights_version = int(version)

  def _placed(self, weights: Any) -> Any:
    """``weights`` where this sampler computes: on its placement's devices, or its own device."""
    if self.placement is not None:
      return self.placement.put(weights)  # no copy for weights already there
    # device arrays (the trainer's, shared) stay on the device; host arrays are copied there
    return jax.device_put(weights, jax.tree.map(lambda _: self._own_sharding, weights))

  def close(self) -> None:
    """Nothing to free here (``sampler_process.SamplerProcess.close`` ends its process)."""

  def model_prompt(self, prompt: str) -> str:
    """The text the model is given for ``prompt`` (through the tokenizer's chat template, if it has one)."""
    return self._format(prompt) if self._format is not None else prompt

  def prompt_ids(self, prompt: str) -> np.ndarray:
    """The ids the model is given for ``prompt``: bos (when the tokenizer has one) and the formatted text."""
    return np.asarray(self._sampler.tokenize(self.model_prompt(prompt)), np.int32)

  def sample(self, prompts: Sequence[str], *, seed: int, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = 0, stop: Sequence[str] = (),
             max_new_tokens: Sequence[int | None] | None = None,
             weights_for_chunk: Callable[[int], tuple[int, Any]] | None = None,
             chunk_tokens: int = 0, before_chunk: Callable[[int, Callable[[], Any]], None] | None = None,
             resume_from: chunked_sampling.PartialGeneration | None = None) -> Samples:
    """One completion per prompt (repeat a prompt for a group), drawn with ``seed``.

    ``top_p`` (1.0: off) and ``top_k`` (0, or at least the vocabulary: off) truncate the distribution each token
    is drawn from; the log-probs are still the full tempered distribution's (``engine.loss``'s module docstring
    says why). ``stop``: strings that end a completion where one first occurs (``_samples``).
    ``max_new_tokens[i]``: prompt i's own limit (None: ``max_generation_steps``), at most that.

    ``weights_for_chunk`` (in-flight updates): the generation decodes in chunks of ``chunk_tokens`` tokens
    (``chunked_sampling.sample_in_chunks``), chunk g with ``weights_for_chunk(g)``'s (version, weights as
    ``sync`` takes them; None: this sampler's own) rather than this sampler's, and the samples carry each
    token's version (``Samples.versions``; their ``weights_version`` is the first chunk's). Without it, one call
    with this sampler's weights, as always. ``before_chunk`` and ``resume_from`` (a generation in chunks only):
    as ``chunked_sampling.sample_in_chunks`` takes them, to hand out the generation so far and to go on from one.
    """
    if weights_for_chunk is not None:
      return self._sample_in_chunks(prompts, seed=seed, temperature=temperature, top_p=top_p, top_k=top_k,
                                    stop=stop, max_new_tokens=max_new_tokens,
                                    weights_for_chunk=weights_for_chunk, chunk_tokens=chunk_tokens,
                                    before_chunk=before_chunk, resume_from=resume_from)
    if before_chunk is not None or resume_from is not None:
      raise ValueError("before_chunk and resume_from belong to a generation in chunks: give weights_for_chunk too")
    # Tunix cuts a completion before its eos, and the eos's log-prob with it; a completion that ends must
    # keep both (the policy learns when to stop, and a first-token eos would leave nothing). So its stop is
    # an id never sampled, and each completion is cut after its first eos here.
    with default_device(self.placement):
      out = self._sampler([self.model_prompt(p) for p in prompts], max_generation_steps=self.max_generation_steps,
                          max_prompt_length=self.max_prompt_length, temperature=temperature,
                          seed=int(seed), return_logprobs=True, forbidden_tokens=self._forbidden,
                          eos_tokens=[NEVER_SAMPLED], **self._truncation(top_p, top_k))
    samples = self._samples(prompts, out, stop=stop, max_new_tokens=max_new_tokens)
    if self.routing is None:
      return samples
    return dataclasses.replace(samples, routing=self._record_routing(samples.prompt_ids, samples.completion_ids))

  def _sample_in_chunks(self, prompts: Sequence[str], *, seed: int, temperature: float, top_p: float, top_k: int,
                        stop: Sequence[str], max_new_tokens: Sequence[int | None] | None,
                        weights_for_chunk: Callable[[int], tuple[int, Any]], chunk_tokens: int,
                        before_chunk: Callable[[int, Callable[[], Any]], None] | None,
                        resume_from: chunked_sampling.PartialGeneration | None) -> Samples:
    """``sample`` in decode chunks, each on the weights ``weights_for_chunk`` gives it (see ``sample``)."""
    if self.routing is not None:  # the recipe refuses in-flight updates with router replay
      raise ValueError("a generation in chunks has no one set of weights to record its routing with")
    flat: dict[int, Any] = {}  # per version, the weights as the compiled functions take them

    def chunk_weights(chunk: int) -> tuple[int, Any]:
      version, weights = weights_for_chunk(chunk)
      if version not in flat:
        flat[version] = chunked_sampling.flattened_weights(
            self._graphdef, self._params if weights is None else self._placed(weights))
      return version, flat[version]

    truncation = self._truncation(top_p, top_k)
    with default_device(self.placement):  # as ``sample``'s one call: its stop an id never sampled
      out = chunked_sampling.sample_in_chunks(
          self._sampler, [self.model_prompt(p) for p in prompts], max_generation_steps=self.max_generation_steps,
          max_prompt_length=self.max_prompt_length, chunk_tokens=chunk_tokens, weights_for_chunk=chunk_weights,
          seed=int(seed), temperature=temperature, top_p=truncation["top_p"], top_k=truncation.get("top_k"),
          forbidden_tokens=self._forbidden, eos_tokens=[NEVER_SAMPLED], before_chunk=before_chunk,
          resume_from=resume_from)
    samples = self._samples(prompts, out, stop=stop, max_new_tokens=max_new_tokens, versions=out.versions)
    return dataclasses.replace(samples, weights_version=int(min(v.min() for v in out.versions)))

  def _record_routing(self, prompt_ids: Sequence[np.ndarray], completion_ids: Sequence[np.ndarray]
                      ) -> list[np.ndarray]:
    """Each sequence's routing under the weights that sampled it: one forward pass over the prompts and
    completions, rows padded to a multiple of ``ROUTING_WIDTH_STEP`` tokens (few shapes, few compiles)."""
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    width = -(-max(lengths) // ROUTING_WIDTH_STEP) * ROUTING_WIDTH_STEP
    tokens = np.zeros((len(lengths), width), np.int32)
    segments = np.zeros((len(lengths), width), np.int32)
    for row, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
      tokens[row, :lengths[row]] = np.concatenate([p, c])
      segments[row, :lengths[row]] = 1
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
    with default_device(self.placement):
      routing = np.asarray(self._routing_jit(self._params, tokens, positions, segments))
    return [routing[row, :n] for row, n in enumerate(lengths)]

  def _truncation(self, top_p: float, top_k: int) -> dict[str, Any]:
    """Tunix's ``top_p``/``top_k`` arguments. Untruncated, exactly today's call (``top_p=1.0`` alone), so a run
    without them samples what it always did; a ``top_k`` as wide as the logits is off (``jax.lax.top_k`` takes
    no wider one, and it would filter nothing)."""
    top_k = 0 if top_k >= self._vocab_size else int(top_k)
    if top_p >= 1.0 and top_k == 0:
      return {"top_p": 1.0}
    return {"top_p": float(top_p), "top_k": top_k}  # Tunix reads top_k 0 as off

  def greedy(self, prompts: Sequence[str], *, stop: Sequence[str] = (),
             max_new_tokens: Sequence[int | None] | None = None) -> list[str]:
    """The most likely completion of each prompt (evaluation), ended as a sampled one is: at its eos, at its
    prompt's own limit (``max_new_tokens[i]``) and before a ``stop`` string."""
    with default_device(self.placement):
      out = self._sampler([self.model_prompt(p) for p in prompts], max_generation_steps=self.max_generation_steps,
                          max_prompt_length=self.max_prompt_length, forbidden_tokens=self._forbidden,
                          eos_tokens=self._eos_ids)
    texts = []
    for row, ids in enumerate(out.tokens):
      ids = np.asarray(ids, np.int32)
      if max_new_tokens is not None and max_new_tokens[row] is not None:
        ids = ids[:max_new_tokens[row]]
      text = self.tokenizer.decode(ids)
      found = first_stop(self.tokenizer, ids, text, stop) if stop else None
      texts.append(text if found is None else found[1])
    return texts

  def _samples(self, prompts: Sequence[str], out, *, stop: Sequence[str] = (),
               max_new_tokens: Sequence[int | None] | None = None,
               versions: Sequence[np.ndarray] | None = None) -> Samples:
    """``out``'s completions cut at their end (eos, limit, stop string), with their log-probs and, where given,
    each token's ``versions`` cut alike."""
    # Plain Python per completion (a few ids each) and each distinct prompt tokenized once: numpy's per-call
    # overhead here made the wrapper cost a sixth of Tunix's sampling time on the default batch.
    completions, logprobs, ended, eos = [], [], [], set(self._eos_ids)
    for row, (ids, lp) in enumerate(zip(out.tokens, out.logprobs)):
      ids = np.asarray(ids, np.int32)
      tokens = ids.tolist()
      if max_new_tokens is not None and max_new_tokens[row] is not None:
        # the draws before a limit do not depend on it (a key per decoding step): as if sampled with it
        tokens = tokens[:max_new_tokens[row]]
      end = next((k + 1 for k, token in enumerate(tokens) if token in eos), None)
      length = end if end is not None else len(tokens)
      completions.append(ids[:length])
      logprobs.append(np.asarray(lp, np.float32)[:length])
      ended.append(end is not None)
    texts = [self.tokenizer.decode(c) for c in completions]
    if stop:
      for row, completion in enumerate(completions):
        found = first_stop(self.tokenizer, completion, texts[row], stop)
        if found is not None:
          length, texts[row] = found
          completions[row], logprobs[row], ended[row] = completion[:length], logprobs[row][:length], True
    prompt_ids = {p: self.prompt_ids(p) for p in dict.fromkeys(prompts)}
    return Samples(list(prompts), [prompt_ids[p].copy() for p in prompts],
                   completions, logprobs, texts, self.weights_version,
                   None if self._fixed_length and not stop else ended,
                   versions=None if versions is None else [np.asarray(v, np.int64)[:len(c)].copy()
                                                           for v, c in zip(versions, completions)])


#: Rows of a routing pass are padded to a multiple of this many tokens.
ROUTING_WIDTH_STEP = 64


def _routing_of(graphdef, params, tokens, positions, segment_ids):
  return moe_lib.routing_of(nnx.merge(graphdef, params), tokens, positions, attention_mask(segment_ids),
                            segment_ids > 0)


def first_stop(tokenizer, ids: np.ndarray, text: str, stop: Sequence[str]) -> tuple[int, str] | None:
  """Where the first of the ``stop`` strings ends the completion ``ids`` (decoded: ``text``): (the tokens kept,
  through the one whose decoding first holds a stop string; the text before that stop string), or None.

  As vLLM stops (``include_stop_str_in_output=False``): the policy is trained on the token that completed the
  stop string, as on an eos, and the reward sees the text before it. The token is found by bisection over
  prefixes (a few decodes, not one per token), a longer prefix decoding to text that extends a shorter one's.
  """
  if not any(s in text for s in stop):
    return None
  low, high = 1, len(ids)  # the shortest prefix whose text holds a stop string is in [low, high]
  while low < high:
    middle = (low + high) // 2
    if any(s in tokenizer.decode(ids[:middle]) for s in stop):
      high = middle
    else:
      low = middle + 1
  prefix = tokenizer.decode(ids[:low])
  cut = min((prefix.find(s) for s in stop if s in prefix), default=len(prefix))
  return low, prefix[:cut]

"""The sampler's process, its side: the environment set before anything there imports JAX, then the requests.

JAX reads ``JAX_PLATFORMS`` when it is imported, and XLA's CPU client its pool
size (``PJRT_NPROC``) when it starts, so the child must have both before its
first import of JAX. This module imports nothing that imports JAX, and the
sampler's specification arrives pickled, to be loaded (importing JAX with it)
only once the environment is set. The parent's environment is never changed:
other threads of a running trainer read it, and other children it starts
inherit it. ``sampler_process.SamplerProcess`` is the parent's side.
"""

from __future__ import annotations

import os
import pickle
import signal
import traceback

#: The child's scheduling priority below its parent's. The host core is shared: the trainer's thread sleeps in
#: ``wait_for_device`` while its last micro-batch computes, and a staged boundary's update is dispatched only
#: once that thread runs again. At its parent's priority the sampler held the core for milliseconds after the
#: wait ended (staged steps measured 7 ms slower than controls); below it, the waking thread takes the core at
#: once, and the sampler keeps every moment the trainer's thread does not use.
SAMPLER_NICE = 10


def serve(conn, spec_bytes: bytes, environment: dict[str, str]) -> None:
  """The child: sets ``environment`` (and, unless it names one, an XLA pool sized to this process's cores), builds
  the sampler the pickled ``SamplerSpec`` describes, and answers requests until told to close or the pipe
  closes."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent stops us
  os.nice(SAMPLER_NICE)
  os.environ.update(environment)
  if "PJRT_NPROC" not in environment and hasattr(os, "sched_getaffinity"):
    os.environ["PJRT_NPROC"] = str(len(os.sched_getaffinity(0)))  # an XLA pool sized to the cores it may run on
  try:
    # import here: JAX starts with the environment above (the spec's modules import it too)
    import jax

    from orchestrator.host.compilation_cache import use_compilation_cache
    from orchestrator.live.sampler import LiveSampler

    spec = pickle.loads(spec_bytes)
    use_compilation_cache()
    sampler = LiveSampler(spec.preset, spec.model.tokenizer(), seed=spec.seed,
                          max_prompt_length=spec.max_prompt_length,
                          max_generation_steps=spec.max_generation_steps, alphabet=spec.alphabet,
                          dtype=spec.dtype, routing=spec.routing)
    treedef, shapes = sampler.weights_structure, sampler.weight_shapes
    conn.send(("ok", {"platform": jax.default_backend(), "jax_platforms": str(jax.config.jax_platforms)}))
  except BaseException:
    conn.send(("error", traceback.format_exc()))
    return
  requests = Requests(conn, sampler, lambda leaves: jax.tree.unflatten(treedef, leaves), shapes)
  while True:
    try:
      message = conn.recv()
    except (EOFError, OSError):  # the parent is gone
      return
    if message[0] == "close":
      return
    try:
      requests.answer(message)
    except ParentGone:
      return


class ParentGone(Exception):
  """The parent closed the pipe, or asked this process to close, while a generation in chunks waited for it."""


class CallAbandoned(Exception):
  """The parent gave up a generation in chunks while it waited for a chunk's weights (its run is closing)."""


class Requests:
  """The child's answers: ``sync``, ``sample``, ``greedy`` and ``sample_chunked``, each answered ``("ok", value)``
  or ``("error", traceback)``.

  A generation in chunks (in-flight updates) asks its parent for each chunk's weights (``("need", chunk)``,
  answered ``("weights", version, leaves)``, None for the sampler's own) and, before each chunk from the second
  on, whether it wants the generation so far (``("before", chunk)``: ``("partial",)`` asks for it, ``("go",)``
  goes on). While it waits, it answers any other request the parent sends (an evaluation takes the sampler
  between chunks, as in one process: the generation's state is the call's own); ``("abandon",)`` gives it up."""

  def __init__(self, conn, sampler, unflatten, shapes):
    """``unflatten``: host leaves (``jax.tree.leaves`` order) -> the sampler's weight tree; ``shapes``: the leaves'
    shapes it takes."""
    self._conn, self._sampler, self._unflatten, self._shapes = conn, sampler, unflatten, shapes

  def answer(self, message) -> None:
    try:
      self._conn.send(("ok", self._value(message)))
    except (ParentGone, CallAbandoned):
      raise
    except BaseException:
      self._conn.send(("error", traceback.format_exc()))

  def _value(self, message):
    kind = message[0]
    if kind == "sync":
      self._sampler.sync(self._tree(message[1], "sync"), 0)
      return None
    if kind == "sample":
      prompts, seed, temperature, top_p, top_k, stop, max_new_tokens = message[1:]
      return self._sampler.sample(prompts, seed=seed, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop,
                                  max_new_tokens=max_new_tokens)
    if kind == "sample_chunked":
      prompts, seed, temperature, top_p, top_k, stop, max_new_tokens, chunk_tokens, resume_from = message[1:]
      try:
        return self._sampler.sample(prompts, seed=seed, temperature=temperature, top_p=top_p, top_k=top_k,
                                    stop=stop, max_new_tokens=max_new_tokens, chunk_tokens=chunk_tokens,
                                    weights_for_chunk=self._weights_for_chunk, before_chunk=self._before_chunk,
                                    resume_from=resume_from)
      except CallAbandoned:
        return None
    if kind == "greedy":
      return self._sampler.greedy(message[1], stop=message[2], max_new_tokens=message[3])
    raise ValueError(f"unknown request {kind!r}")

  def _tree(self, leaves, what: str):
    sent = [tuple(leaf.shape) for leaf in leaves]
    if sent != self._shapes:
      raise ValueError(f"{what} sent weights of shapes {sent}; the sampler's model has {self._shapes}")
    return self._unflatten(leaves)

  def _weights_for_chunk(self, chunk: int):
    self._conn.send(("need", chunk))
    message = self._wait_for("weights")
    version, leaves = message[1], message[2]
    return version, None if leaves is None else self._tree(leaves, f"decode chunk {chunk}'s weights")

  def _before_chunk(self, chunk: int, generation) -> None:
    self._conn.send(("before", chunk))
    while True:
      message = self._wait_for("go", "partial")
      if message[0] == "go":
        return
      self._conn.send(("ok", generation()))

  def _wait_for(self, *kinds: str):
    """The next message of one of ``kinds``, answering every other request meanwhile."""
    while True:
      try:
        message = self._conn.recv()
      except (EOFError, OSError):
        raise ParentGone() from None
      if message[0] in kinds:
        return message
      if message[0] == "close":
        raise ParentGone()
      if message[0] == "abandon":
        raise CallAbandoned()
      self.answer(message)

"""The live loop's sampler in a process of its own (``rollouts.placement: process``, docs/live-loop.md).

In one process the sampler and the trainer share one XLA client (one thread
pool, one queue per device) and one interpreter: the sampler's programs land
between the trainer's, so a boundary's idle time is filled with sampling
rather than removed, and whatever the step loop does with the interpreter (a
blocking ``wait_for_device`` at a staged boundary hands it to the sampling
thread) moves sampling time from one step to another. A real job samples on
devices of its own; on a CPU host the equivalent is a process of its own:
its own interpreter and XLA client, on the host's cores rather than the
trainer's.

``SamplerProcess`` is a ``LiveSampler`` seen from outside: ``sync``, ``sample``
and ``greedy`` are requests over a pipe to a child process that built the same
``LiveSampler`` (same preset, seed, tokenizer and fixed sizes), so it samples
what an in-process sampler on one thread samples. Weights cross as host arrays
(the leaves in ``jax.tree.leaves`` order; the child keeps its own tree
structure). The child runs on the cores its parent's calling thread may use
(the host's, where the run's core plan kept one) with an XLA pool the plan
sized (``SamplerSpec.xla_threads``), ignores Ctrl-C (its parent stops the run and then it), and exits when
its parent's end of the pipe closes, so a killed run leaves no sampler behind. The child's side is
``sampler_boot``: it sets the child's environment (JAX on the host's cores) before JAX is imported there.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from orchestrator.host import core_claims
from orchestrator.live import sampler_boot
from orchestrator.live.sampler import Samples

#: How long the child may take to import, build its model and answer that it is ready.
START_TIMEOUT_S = 600.0
#: How long ``close`` waits for the child to exit before it is killed.
CLOSE_TIMEOUT_S = 10.0


#: What the child's environment holds beyond its parent's, set by ``sampler_boot`` before the child imports JAX
#: (which reads ``JAX_PLATFORMS`` at import): without it the child would open the accelerator its parent's
#: trainer holds (a TPU's runtime refuses a second process).
CHILD_ENVIRONMENT = {"JAX_PLATFORMS": "cpu"}


class SamplerProcessError(RuntimeError):
  """The sampler process failed or exited; the message says how (its traceback, or its exit code)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerSpec:
  """What the child needs to build the sampler: ``LiveSampler``'s arguments, the tokenizer as the recipe's model
  section makes it (a ``recipe.ModelSection``: picklable, unlike some tokenizers)."""

  preset: Any
  model: Any
  seed: int
  max_prompt_length: int
  max_generation_steps: int
  alphabet: str | None
  dtype: str
  xla_threads: int | None = None  # the child's XLA pool (the run's core plan fixes it); None: its cores'
  routing: Any = None  # a ``packing.RoutingShape``: record each sample's routing (rollout routing replay)


class SamplerProcess:
  """A ``LiveSampler`` in a child process; the same surface (``sync``, ``sample``, ``greedy``,
  ``weights_version``, ``placement``, ``tokenizer``).

  One request at a time (a lock): the sampling thread and an evaluation take turns already
  (``SharedSampler``). A request the child fails raises ``SamplerProcessError`` with its traceback; a child
  that exits raises it with the exit code.
  """

  #: Weights reach the child as host arrays: the sync keeps a host copy, as for a shared sampler.
  placement = None

  def __init__(self, spec: SamplerSpec, tokenizer):
    self.tokenizer = tokenizer
    self.weights_version = 0
    self._lock = threading.Lock()
    context = multiprocessing.get_context("spawn")  # a fork of a process whose XLA client runs is unsafe
    self._conn, child_conn = context.Pipe()
    # the child's target imports no JAX, and its specification travels pickled: the child loads it (and JAX
    # with it) once sampler_boot has set its environment
    environment = dict(CHILD_ENVIRONMENT)
    if spec.xla_threads:  # sized by the run's plan, never by which cores other runs left it: it fixes the samples
      environment["PJRT_NPROC"] = str(spec.xla_threads)
    self._process = context.Process(target=sampler_boot.serve, args=(child_conn, pickle.dumps(spec), environment),
                                    name="step-boundary-sampler", daemon=True)
    self._process.start()
    child_conn.close()  # the child holds its end: an exit shows here as EOF
    self.pid = self._process.pid
    core_claims.FOLLOWERS.add(self.pid)  # its threads follow the run's share of the cores
    self._ready = False
    #: The JAX platform the child computes on and its ``jax_platforms`` setting, once it is ready.
    self.child_platform: dict[str, str] | None = None

  def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
    """Waits until the child has built its sampler (the first request waits for it anyway)."""
    with self._lock:
      self._wait_ready(timeout_s)

  def sync(self, weights: Any, version: int) -> None:
    """Sends the trainer's weights (host or device arrays; copied to host here) as version ``version``."""
    leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(weights))]
    self._request("sync", leaves)
    self.weights_version = int(version)

  def sample(self, prompts: Sequence[str], *, seed: int, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = 0, stop: Sequence[str] = (),
             max_new_tokens: Sequence[int | None] | None = None,
             weights_for_chunk: Callable[[int], tuple[int, Any]] | None = None, chunk_tokens: int = 0,
             before_chunk: Callable[[int, Callable[[], Any]], None] | None = None,
             resume_from: Any = None) -> Samples:
    """``LiveSampler.sample`` in the child; the samples carry this side's ``weights_version`` (a generation in
    chunks: its first chunk's, as ``LiveSampler`` gives it). ``weights_for_chunk``, ``before_chunk``: called here,
    as the child's generation asks (``sampler_boot.Requests``); this side's turn on the pipe is given up while
    ``weights_for_chunk`` runs, so a request of another thread (an evaluation's) goes to the child meanwhile."""
    settings = (list(prompts), int(seed), float(temperature), float(top_p), int(top_k), tuple(stop),
                None if max_new_tokens is None else list(max_new_tokens))
    if weights_for_chunk is not None:
      return self._sample_in_chunks(settings, int(chunk_tokens), weights_for_chunk, before_chunk, resume_from)
    if before_chunk is not None or resume_from is not None:
      raise ValueError("before_chunk and resume_from belong to a generation in chunks: give weights_for_chunk too")
    samples = self._request("sample", *settings)
    return dataclasses.replace(samples, weights_version=self.weights_version)

  def _sample_in_chunks(self, settings: tuple, chunk_tokens: int, weights_for_chunk, before_chunk,
                        resume_from) -> Samples:
    """The conversation of one generation in chunks: the child asks for each chunk's weights and, before a
    chunk, whether the generation so far is wanted; it ends with the samples or the child's error. A callback
    that raises (the run closing while a chunk waits for its weights) has the child give the generation up."""
    with self._lock:
      self._wait_ready(START_TIMEOUT_S)
      message = self._exchange(("sample_chunked", *settings, chunk_tokens, resume_from), "sample_chunked")
      while message[0] != "ok":
        try:
          if message[0] == "before":
            if before_chunk is not None:
              before_chunk(message[1], lambda: self._exchange(("partial",), "partial")[1])
            reply = ("go",)
          else:  # ("need", chunk)
            reply = self._weights_reply(message[1], weights_for_chunk)
        except BaseException:
          self._abandon()
          raise
        message = self._exchange(reply, f"the reply to {message[0]!r}")
      return message[1]

  def _weights_reply(self, chunk: int, weights_for_chunk) -> tuple:
    """Under the lock: chunk ``chunk``'s weights as the child takes them, the lock given up while
    ``weights_for_chunk`` waits for them (another thread's request, an evaluation's, goes to the child then)."""
    self._lock.release()
    try:
      version, weights = weights_for_chunk(chunk)
      leaves = None if weights is None else [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(weights))]
    finally:
      self._lock.acquire()
    return ("weights", int(version), leaves)

  def _exchange(self, message: tuple, what: str) -> tuple:
    """Sends ``message`` and returns the child's next message (``ok``, ``need`` or ``before``); the child's error
    raises."""
    try:
      self._conn.send(message)
      return self._message(what, None)
    except (BrokenPipeError, EOFError, OSError):
      raise self._exited(what) from None

  def _abandon(self) -> None:
    """Tells the child to give up the generation waiting for its weights, and reads its answer (nothing)."""
    try:
      self._exchange(("abandon",), "abandon")
    except SamplerProcessError:
      pass  # the run is closing: a child that went meanwhile is no further harm

  def greedy(self, prompts: Sequence[str], *, stop: Sequence[str] = (),
             max_new_tokens: Sequence[int | None] | None = None) -> list[str]:
    """``LiveSampler.greedy`` in the child."""
    return self._request("greedy", list(prompts), list(stop), None if max_new_tokens is None else list(max_new_tokens))

  def close(self) -> None:
    """Asks the child to exit and waits for it (killing it after ``CLOSE_TIMEOUT_S``); idempotent."""
    if self._process.exitcode is None and not self._conn.closed:
      try:
        self._conn.send(("close",))
      except (BrokenPipeError, OSError):
        pass
    self._process.join(CLOSE_TIMEOUT_S)
    if self._process.exitcode is None:
      self._process.kill()
      self._process.join()
    self._conn.close()
    core_claims.FOLLOWERS.discard(self.pid)

  def _request(self, *message) -> Any:
    with self._lock:
      self._wait_ready(START_TIMEOUT_S)
      try:
        self._conn.send(message)
        return self._answer(message[0], None)
      except (BrokenPipeError, EOFError, OSError):
        raise self._exited(message[0]) from None

  def _wait_ready(self, timeout_s: float) -> None:
    if not self._ready:
      self.child_platform = self._answer("start", timeout_s)
      self._ready = True

  def _answer(self, what: str, timeout_s: float | None) -> Any:
    return self._message(what, timeout_s)[1]

  def _message(self, what: str, timeout_s: float | None) -> tuple:
    """The child's next message: ``("ok", value)``, or in a generation in chunks ``("need", chunk)`` or
    ``("before", chunk)``; its error raises ``SamplerProcessError``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not self._conn.poll(1.0):  # in steps, so a child that died without closing its end is noticed
      if not self._process.is_alive():
        raise self._exited(what)
      if deadline is not None and time.monotonic() > deadline:
        raise SamplerProcessError(f"the sampler process did not answer {what!r} within {timeout_s:.0f} s")
    try:
      message = self._conn.recv()
    except EOFError:
      raise self._exited(what) from None
    if message[0] == "error":
      raise SamplerProcessError(f"the sampler process failed at {what!r}:\n{message[1]}")
    return message

  def _exited(self, what: str) -> SamplerProcessError:
    self._process.join(1.0)
    return SamplerProcessError(f"the sampler process exited (code {self._process.exitcode}) during {what!r}")

"""RolloutThread: the thread that samples a live source's batches, ahead of the steps that train on them.

It samples batch after batch in order, each once the weights version it samples with is kept (``WeightVersions``;
the weight sync delivers them), a batch's micro-batches in pass 0's training order, publishing each sampler
call's as it is done (``SampledBatches``), so a step can be taken once its first micro-batch exists. It stops at
the run's last batch unless a checkpoint asks for the batches past it that its position carries
(``sample_until``). With in-flight updates a call decodes in chunks, each on the version
``BatchSchedule.call_versions`` gives it, waiting between chunks for the sync that keeps it; where a call's version
changes it keeps the generation so far (``generations``), which a checkpoint whose position falls there carries,
and a restored position goes on from one (``resume_generation``). The live source
(``rollouts.LiveRollouts``) owns the condition both share: it guards the versions, the batches and this
thread's ``error`` and ``closed``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Any

from orchestrator.live.chunked_sampling import PartialGeneration
from orchestrator.live.rollout_batches import BatchSchedule, SampledBatches
from orchestrator.live.shared_sampler import ClosedWhileWaiting, SharedSampler
from orchestrator.live.weight_versions import WeightVersions
from orchestrator.tasks.rewards import CallCancelled

log = logging.getLogger("step_boundary.rollouts")

#: The sampling calls whose spans are kept: enough to cover the steps a record can still ask about (the latest),
#: with the sampler ahead by up to a few batches of one-micro-batch calls.
KEPT_CALL_SPANS = 1024


class SamplingSpans:
  """When the sampling thread's calls ran (``time.perf_counter``): the spans of the last ``KEPT_CALL_SPANS`` and
  the start of the one running. Its own lock, held only to read or write them, so the step loop asking never
  waits for a call."""

  def __init__(self, clock=time.perf_counter):
    self._clock = clock
    self._lock = threading.Lock()
    self._done: collections.deque[tuple[float, float]] = collections.deque(maxlen=KEPT_CALL_SPANS)
    self._running: float | None = None

  def begin(self) -> float:
    with self._lock:
      self._running = self._clock()
      return self._running

  def end(self) -> float:
    with self._lock:
      ended = self._clock()
      if self._running is not None:
        self._done.append((self._running, ended))
      self._running = None
      return ended

  def seconds_within(self, start: float, end: float) -> float:
    """The seconds of [``start``, ``end``] during which a call ran (the running one up to now). The spans are in
    time order, so only the latest are read, back to the first that ended before ``start`` (the step loop asks
    for its latest step at every record)."""
    total = 0.0
    with self._lock:
      latest = [] if self._running is None else [(self._running, self._clock())]
      for began, ended in itertools.chain(latest, reversed(self._done)):
        if ended <= start:
          break
        total += max(0.0, min(end, ended) - max(start, began))
    return total


class RolloutThread:
  """Samples a live source's batches on a thread of its own, started by the first ``start``.

  Args:
    shared: the sampler, taken in turns with evaluation (``SharedSampler.sample_micro_batches``).
    shape: the steps' ``rollouts.LiveShape`` (micro-batches per batch and per sampler call).
    schedule: its ``BatchSchedule`` (each batch's weights version, how a batch is named).
    cond: the source's condition, which guards ``versions``, ``batches``, ``error`` and ``closed``.
    versions: the weights kept for each version a batch samples with.
    batches: where each sampled micro-batch is published.
    until_batch: the first batch not sampled (the run's batch count; ``sample_until`` raises it).

  Attributes:
    first_batch: the first batch sampled (a restored position's first not carried whole); set before ``start``.
    first_micro_batch: the first micro-batch of ``first_batch`` sampled (a restored position's carried part of that
      batch before it); set before ``start``.
    resume_generation: the generation of ``first_batch``'s call at ``first_micro_batch`` to go on from (a restored
      position carried it part-sampled; None: the call starts from its prompts); set before ``start``.
    generations: (batch, first micro-batch of its call, chunk) -> the generation so far before that chunk, for each
      chunk where a call's version changes, until ``forget`` drops its batch; under the condition.
    error: what the sampling failed with (None: it did not), naming the batch; under the condition.
    closed: ``close`` was called; under the condition.
    thread: the thread (None before ``start``).
    spans: when its sampling calls ran (``SamplingSpans``; its own lock, not the condition).
  """

  def __init__(self, shared: SharedSampler, shape, schedule: BatchSchedule, cond: threading.Condition,
               versions: WeightVersions, batches: SampledBatches, *, until_batch: int):
    self._shared, self._shape, self._schedule, self._cond = shared, shape, schedule, cond
    self._versions, self._batches = versions, batches
    self.first_batch, self.first_micro_batch = 0, 0
    self.resume_generation: PartialGeneration | None = None
    self.generations: dict[tuple[int, int, int], PartialGeneration] = {}
    self._until_batch = until_batch
    self.error: BaseException | None = None
    self.closed = False
    self.thread: threading.Thread | None = None
    self.spans = SamplingSpans()

  def start(self) -> None:
    """Starts the thread, once."""
    if self.thread is None:
      self.thread = threading.Thread(target=self._produce, name="rollouts", daemon=True)
      self.thread.start()

  def sample_until(self, batch: int) -> None:
    """Under the condition: samples up to ``batch`` (past the run's last, for a checkpoint that carries them)."""
    if batch > self._until_batch:
      self._until_batch = batch
      self._cond.notify_all()

  def forget(self, batch: int) -> None:
    """Under the condition: drops the generations kept of ``batch`` and the batches before it (no position from
    now on can carry them)."""
    for key in [key for key in self.generations if key[0] <= batch]:
      del self.generations[key]

  def close(self, timeout_s: float) -> None:
    """Stops the thread and waits for it at most ``timeout_s``: one inside JAX at exit aborts the process."""
    with self._cond:
      self.closed = True
      self._cond.notify_all()
    if self.thread not in (None, threading.current_thread()):
      self.thread.join(timeout_s)

  def _wait_for_version(self, version: int) -> float:
    """Under the condition: waits until the weight sync keeps ``version`` or the source closes; the seconds
    waited (0.0 where it was kept already)."""
    if self._versions.available(version):
      return 0.0
    start = time.perf_counter()
    self._cond.wait_for(lambda: self.closed or self._versions.available(version))
    return time.perf_counter() - start

  def _chunked(self, batch: int, first: int, paused_s: list[float],
               resume_from: PartialGeneration | None) -> dict[str, Any]:
    """(In-flight updates.) What the call at micro-batch ``first`` of ``batch`` decodes in chunks with
    (``SharedSampler.sample_micro_batches``' ``chunk_weights``, ``before_chunk``, ``resume_from``): each chunk on
    ``BatchSchedule.call_versions``' version, waited for until the weight sync keeps it (``close`` ends the wait;
    the seconds of each wait go in ``paused_s``, 0.0 for a chunk whose version is kept already), and before a
    chunk whose version differs from the chunk before it the generation so far kept in ``generations``: a
    checkpoint whose position falls there carries it, whether the sampler waits there or has gone on (a stop
    inside a step checkpoints after its boundary's sync)."""
    call = first // self._shape.micro_batches_per_call
    versions = self._schedule.call_versions(batch, call)

    def before_chunk(chunk: int, generation) -> None:
      if versions[chunk] == versions[chunk - 1]:
        return  # the generation goes on with its cache here: no position falls at this chunk
      kept = generation()  # off the condition: it copies the generation off the device
      with self._cond:
        self.generations[(batch, first, chunk)] = kept
        self._cond.notify_all()

    return {"chunk_weights": self._chunk_weights(versions, paused_s), "before_chunk": before_chunk,
            "resume_from": resume_from}

  def _chunk_weights(self, versions: list[int], paused_s: list[float]):
    """Chunk index -> (version, weights), chunk g on ``versions[g]`` (see ``_chunked``)."""

    def weights_for_chunk(chunk: int):
      version = versions[chunk]
      with self._cond:
        waiting = not self._versions.available(version)
        if waiting:  # the call computes nothing while it waits for its weights
          self.spans.end()
        paused_s.append(self._wait_for_version(version))
        if waiting:
          self.spans.begin()
        if self.closed:
          raise ClosedWhileWaiting(version)
        return version, self._versions.take(version)

    return weights_for_chunk

  def _produce(self) -> None:
    batch = self.first_batch
    # a restored position's batch carried part-sampled goes on at its first call not carried (with in-flight
    # updates only: its calls from there on sample with their chunks' versions, none with the batch's own)
    resume_at, resume_from = self.first_micro_batch, self.resume_generation
    try:
      while True:
        version = self._schedule.batch_version(batch)
        cut = resume_at > 0 or resume_from is not None  # the restored batch the position cut: none of its own
        with self._cond:
          # Past the run's last batch only when a checkpoint asks (``sample_until``); close() ends the wait.
          self._cond.wait_for(lambda: self.closed or batch < self._until_batch)
          # Then the sampler's pause for the batch's weights (the sync of ``version``), which the first call's
          # micro-batches record: a wait for a checkpoint's ask is not a pause for weights.
          batch_wait_s = 0.0 if cut else self._wait_for_version(version)
          if self.closed:
            return
          weights = None if cut else self._versions.take(version)
        per_call = self._shape.micro_batches_per_call
        for first in range(resume_at, self._shape.micro_batches_per_batch, per_call):  # in pass 0's training order
          start = self.spans.begin()
          paused_s = [batch_wait_s] if first == resume_at else []  # the sampler's waits for weights, this call's
          chunked = ({} if not self._schedule.in_flight_updates
                     else self._chunked(batch, first, paused_s, resume_from if first == resume_at else None))
          try:
            sampled = self._shared.sample_micro_batches(batch, first, per_call, version, weights,
                                                        cancelled=lambda: self.closed, **chunked)
          finally:
            ended = self.spans.end()
          seconds = (ended - start) / per_call  # each micro-batch's share of the call
          sync_wait_s = sum(paused_s) / per_call  # and of the sampler's waits for weights before and inside it
          with self._cond:  # each published when its call is done
            for one in sampled:
              self._batches.publish(batch, version, one, seconds, sync_wait_s)
            self._cond.notify_all()
        batch, resume_at, resume_from = batch + 1, 0, None
    except ClosedWhileWaiting:  # closed while a generation waited between chunks: nothing is left running
      return
    except CallCancelled as e:  # closed while a reward function ran: the run ends without waiting for it
      log.warning("[rollouts] the run ended while sampling waited for %s; it was left running", e)
    except BaseException as e:  # pylint: disable=broad-except  # surfaced at the next boundary
      with self._cond:
        self.error = RuntimeError(f"the rollout thread failed while sampling {self._schedule.describe(batch)}:"
                                  f" {type(e).__name__}: {e}")
        self._cond.notify_all()

"""The actor trainer's in-flight throttle, with the host's blocks counted.

Tunix's ``PeftTrainer.train()`` ends every call with ``wait_for_all()``, and
the RL learner calls ``train()`` once per micro-batch: the host drains the
device after every micro-batch. ``CountingThrottler`` has the same three
methods; with ``drain_each_call`` it behaves exactly like Tunix's throttler
(that is how a stock run is measured, and what OFF does), without it
``wait_for_all()`` drains nothing and only the in-flight bound
(``wait_for_next``) makes the host wait, so the next micro-batch is dispatched
while the previous one computes.

A *host block* is a wait on a computation that had not finished when the wait
began; waits on finished work cost nothing and are not counted.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import jax


def _finished(computation: Any) -> bool:
  return all(leaf.is_ready() for leaf in jax.tree.leaves(computation) if hasattr(leaf, "is_ready"))


class CountingThrottler:
  """Bounded in-flight queue of dispatched train steps (Tunix's throttler interface).

  Args:
    max_inflight: computations allowed in flight (<= 0: unbounded, as in Tunix).
    drain_each_call: ``wait_for_all()`` blocks on everything queued (stock);
      otherwise it is a no-op and ``drain()`` is the explicit full wait.
  """

  def __init__(self, max_inflight: int, drain_each_call: bool):
    self.max_inflight = max_inflight
    self.drain_each_call = drain_each_call
    self._queue: collections.deque = collections.deque()
    self.host_blocks = 0
    self.waits = 0
    self.last_computation: Any = None
    self.last_added_at: float | None = None

  def add_computation(self, computation: Any) -> None:
    self._queue.append(computation)
    self.last_computation = computation
    self.last_added_at = time.perf_counter()

  def _block_on(self, computation: Any) -> None:
    self.waits += 1
    if not _finished(computation):
      self.host_blocks += 1
    jax.block_until_ready(computation)

  def wait_for_next(self) -> None:
    """While the in-flight bound is reached, blocks on the oldest computation."""
    while self.max_inflight > 0 and len(self._queue) >= self.max_inflight:
      self._block_on(self._queue.popleft())

  def wait_for_all(self) -> None:
    """Tunix calls this at the end of every ``train()``: drains only with ``drain_each_call``."""
    if self.drain_each_call:
      self.drain()

  def drain(self) -> None:
    """Blocks on every queued computation, oldest first."""
    while self._queue:
      self._block_on(self._queue.popleft())

  def __len__(self) -> int:
    return len(self._queue)


def instrument_stock(learner: Any) -> CountingThrottler:
  """Counts a stock learner's host blocks without changing what it does (a draining ``CountingThrottler``)."""
  trainer = learner.rl_cluster._actor_trainer
  throttler = CountingThrottler(trainer.config.max_inflight_computations, drain_each_call=True)
  trainer._throttler = throttler
  return throttler

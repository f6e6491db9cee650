"""A bounded queue of in-flight device computations."""

from __future__ import annotations

import collections
import time
from typing import Any

import jax


class InflightThrottler:
  """Keeps at most ``max_inflight`` dispatched computations queued.

  Each entry is any pytree of ``jax.Array`` that becomes ready when its
  computation finishes. Unlike Tunix's throttler it can wait on a snapshot of
  the queue without dequeuing (``block_until_ready``), which is what
  ``wait_for_device`` needs: it must not change what the step loop later waits on.
  """

  def __init__(self, max_inflight: int = 2):
    if max_inflight < 1:
      raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
    self.max_inflight = max_inflight
    self._queue: collections.deque[Any] = collections.deque()

  def __len__(self) -> int:
    return len(self._queue)

  def add(self, computation: Any) -> None:
    """Queues a dispatched computation. Call ``wait_for_next`` first to stay bounded."""
    self._queue.append(computation)

  def wait_for_next(self) -> None:
    """While the queue is full, blocks on its oldest entry and drops it."""
    while len(self._queue) >= self.max_inflight:
      jax.block_until_ready(self._queue.popleft())

  def wait_for_all(self) -> None:
    """Blocks on every queued entry, oldest first, emptying the queue."""
    while self._queue:
      jax.block_until_ready(self._queue.popleft())

  def block_until_ready(self) -> float:
    """Blocks until every queued entry is ready; returns the seconds blocked.

    Dequeues nothing. A failed computation's error is raised here.
    """
    snapshot = list(self._queue)
    start = time.perf_counter()
    for computation in snapshot:
      jax.block_until_ready(computation)
    return time.perf_counter() - start

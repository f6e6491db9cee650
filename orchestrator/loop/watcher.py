"""Completion watcher: records when each dispatched computation becomes ready, off the hot path.

A background thread waits on dispatched computations in dispatch order and
stamps the time each became ready. The step loop only enqueues (a few µs) and
later asks for the stamps, by which time they are usually recorded already.
Device work on one device runs in dispatch order, so waiting in order stamps
each computation within the thread's wake-up latency of its real finish.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

#: How long ``close`` waits for the watching thread to end. It ends at once unless it is blocked on a
#: computation that never became ready (a failed run's); the thread is a daemon, so it is left behind rather
#: than holding the process's exit.
CLOSE_JOIN_TIMEOUT_S = 60


@dataclasses.dataclass
class Watched:
  key: Hashable
  kind: str
  step: int
  micro_step: int
  dispatched_at: float
  ready_at: float | None = None
  error: BaseException | None = None


class CompletionWatcher:
  """Stamps ready times of dispatched computations from a background thread.

  ``handle`` objects are anything with ``block_until_ready()`` (a
  ``jax.Array``, an engine's ``Computation.ready``); None counts as ready at once.
  """

  def __init__(self, clock: Callable[[], float] = time.perf_counter):
    self._clock = clock
    self._queue: queue.Queue = queue.Queue()
    self._items: dict[Hashable, Watched] = {}
    self._order: list[Watched] = []
    self._cond = threading.Condition()
    self._thread = threading.Thread(target=self._run, name="completion-watcher", daemon=True)
    self._thread.start()

  def watch(
      self, key: Hashable, handle: Any, *, kind: str, step: int, micro_step: int, dispatched_at: float
  ) -> Watched:
    item = Watched(key, kind, step, micro_step, dispatched_at)
    with self._cond:
      self._items[key] = item
      self._order.append(item)
    self._queue.put((item, handle))
    return item

  def _run(self) -> None:
    # The step loop may hold the host core (see host_threads); let this thread wake
    # on any core so its stamps do not wait for the loop to yield.
    if hasattr(os, "sched_setaffinity"):
      try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
      except OSError:
        pass
    while True:
      entry = self._queue.get()
      if entry is None:
        return
      item, handle = entry
      error = None
      try:
        if handle is not None:
          block = getattr(handle, "block_until_ready", None)
          if block is not None:
            block()
      except BaseException as e:  # pylint: disable=broad-except
        error = e
      now = self._clock()
      # A handle that knows when its computation finished (a remote trainer's, stamped
      # where it ran) is more exact than this thread's wake-up.
      stamped = getattr(handle, "ready_at", None)
      if isinstance(stamped, float) and error is None:
        now = min(now, stamped)
      with self._cond:
        item.ready_at = now if item.ready_at is None else min(item.ready_at, now)
        item.error = error
        self._cond.notify_all()

  def observe_ready(self, key: Hashable, at: float) -> None:
    """Another thread saw ``key`` ready by ``at`` (e.g. a blocking metrics read returned).

    Keeps the earlier of this and the watcher's own stamp: the watcher can wake
    late when the host is busy.
    """
    with self._cond:
      item = self._items.get(key)
      if item is not None:
        item.ready_at = at if item.ready_at is None else min(item.ready_at, at)
        self._cond.notify_all()

  def ready_at(self, key: Hashable, timeout_s: float | None = None) -> float:
    """The time ``key`` became ready, waiting for the stamp if needed.

    Raises:
      KeyError: ``key`` was never watched.
      TimeoutError: not ready within ``timeout_s``.
    """
    with self._cond:
      item = self._items[key]
      if not self._cond.wait_for(lambda: item.ready_at is not None, timeout_s):
        raise TimeoutError(f"{key} not ready after {timeout_s} s")
      return item.ready_at

  def get(self, key: Hashable) -> Watched | None:
    with self._cond:
      return self._items.get(key)

  def items(self) -> list[Watched]:
    with self._cond:
      return list(self._order)

  def drain(self, timeout_s: float | None = None) -> list[Watched]:
    """Waits until every watched computation is stamped; returns them in dispatch order."""
    with self._cond:
      self._cond.wait_for(lambda: all(i.ready_at is not None for i in self._order), timeout_s)
      return list(self._order)

  def close(self) -> None:
    self._queue.put(None)
    self._thread.join(timeout=CLOSE_JOIN_TIMEOUT_S)

"""Weight syncs: where step k's weights go after its update (a sampler, in an RL loop); and the held-out
evaluation a live run makes of some of those weights right after their sync (``task.eval_every``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from orchestrator.contract import WeightsOverWire, WeightTransfer, Worker
from orchestrator.loop.recorder import Lane, Recorder


class HostWeightStore:
  """The default weight sync: copies the updated weights to host memory, as a sampler receives them.

  In a job of several processes each process copies the shards it holds (a
  sampler would receive each host's part from that host); the live loop's sync
  gathers the whole weights instead (``live.placement.gather_across_processes``).
  """

  def __init__(self):
    self.version: int | None = None
    self.weights: Any = None
    self.syncs = 0

  def __call__(self, step: int, weights: Any) -> None:
    if weights is None:
      return
    import jax  # import here: the loop imports no JAX until weights arrive (a remote trainer's driver needs none)

    self.weights = jax.tree.map(_host_copy, weights)
    self.version = step
    self.syncs += 1


def _host_copy(leaf: Any) -> Any:
  import jax  # import here: the loop imports no JAX until weights arrive (see above)

  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    return [np.asarray(shard.data) for shard in leaf.addressable_shards]
  return jax.device_get(leaf)


def timed_sync(weight_sync: Callable[[int, Any], Any], worker: Worker, recorder: Recorder,
               clock: Callable[[], float], spans: dict, done: int) -> Any:
  """Step ``done - 1``'s weight sync as boundary work: the weights exported and handed to ``weight_sync``.

  Its seconds go in ``spans["weight_sync_s"]``. A sync that copies the weights onto a sampler's own devices
  says what it moved (a ``WeightTransfer``): its bytes and seconds go in the record too, and the transfer
  gets a span of its own inside the sync's. So does the export of a trainer in another process
  (``WeightsOverWire``), which is the weights crossing the wire: the reply's bytes and the call's seconds.
  Returns the weights exported.
  """
  start = clock()
  weights = worker.export_weights()
  wired = worker.last_export if isinstance(worker, WeightsOverWire) else None
  moved = weight_sync(done, weights)
  end = clock()
  spans["weight_sync_s"] = end - start
  recorder.span(f"weight sync {done}", start, end, Lane.BOUNDARY_WORK)
  if isinstance(wired, WeightTransfer):
    spans["weight_sync_wire_bytes"] = wired.bytes
    spans["weight_sync_wire_s"] = wired.seconds
    recorder.span(f"weight wire transfer {done}", wired.started_at, wired.ended_at, Lane.BOUNDARY_WORK)
  if isinstance(moved, WeightTransfer):
    spans["weight_sync_bytes"] = moved.bytes
    spans["weight_transfer_s"] = moved.seconds
    recorder.span(f"weight transfer {done}", moved.started_at, moved.ended_at, Lane.BOUNDARY_WORK)
  return weights


def timed_evaluation(live, weights: Any, done: int, config, recorder: Recorder, clock: Callable[[], float],
                     spans: dict, *, stop: Callable[[], Any]) -> None:
  """The held-out evaluation of the weights after ``done`` steps, where ``config.eval_every`` asks for one then
  (and the source is live), as boundary work after the weight sync: on the live source's sampler in its turn (a
  stop asked for while it waits skips it). Its figures and seconds go in ``spans`` (step ``done - 1``'s record)
  and a span of the trace."""
  if live is None or not (config.eval_every and config.eval_prompts and done % config.eval_every == 0):
    return
  start = clock()
  score = live.evaluate(weights, done, config.eval_prompts, pass_k=config.eval_pass_k, stop=stop)
  end = clock()
  if score is None:
    return
  spans.update(eval_s=end - start, eval_accuracy=score.accuracy, eval_pass_at_k=score.pass_at_k)
  recorder.span(f"evaluation {done}", start, end, Lane.BOUNDARY_WORK)

"""The default weight sync: where step k's weights go after its update when no sampler takes them (the
boundary's sync itself is ``boundary_work.BoundaryWork.sync``)."""

from __future__ import annotations

from typing import Any

import numpy as np



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

"""Weight syncs: where step k's weights go after its update (a sampler, in an RL loop)."""

from __future__ import annotations

from typing import Any


class HostWeightStore:
  """The default weight sync: copies the updated weights to host memory, as a sampler receives them."""

  def __init__(self):
    self.version: int | None = None
    self.weights: Any = None
    self.syncs = 0

  def __call__(self, step: int, weights: Any) -> None:
    if weights is None:
      return
    import jax  # pylint: disable=import-outside-toplevel

    self.weights = jax.device_get(weights)
    self.version = step
    self.syncs += 1

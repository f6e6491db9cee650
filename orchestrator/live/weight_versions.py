"""The staleness schedule of live rollouts, and the weights kept for it.

Step ``s`` samples with weights version ``max(0, s - max_staleness)``
(version v = the weights after v updates). ``WeightVersions`` answers which
version a step needs and whether it is synced yet, and keeps each synced
version's weights until the sampling thread takes them.
"""

from __future__ import annotations

from typing import Any


class WeightVersions:
  """The weights versions a live source's ``steps`` sample with under ``max_staleness``; the source's
  condition guards it.

  Attributes:
    synced: the newest version synced so far.
    first: the oldest version this source can sample with (a resumed run's: its checkpoint's).
  """

  def __init__(self, *, steps: int, max_staleness: int):
    self._steps, self._max_staleness = steps, max_staleness
    # version -> weights (host, or on a split sampler's devices); None: the sampler's own (version 0)
    self._kept: dict[int, Any] = {0: None}
    self.synced = 0
    self.first = 0

  def version_for(self, step: int) -> int:
    return max(0, step - self._max_staleness)

  def carried(self, first: int) -> list[int]:
    """The steps a position before ``first`` must carry: those sampled with weights older than ``first``'s,
    which a run resumed there cannot sample again (past the last step too: an extended run's)."""
    return [s for s in range(first, first + self._max_staleness) if self.version_for(s) < first]

  def blocked_on_sync(self, step: int) -> bool:
    """True when ``step``'s rollouts need weights that have not been synced yet."""
    return step < self._steps and self.version_for(step) > self.synced

  def can_sample(self, step: int) -> bool:
    """Whether ``step``'s version is one this source can still have (not older than ``first``)."""
    return self.version_for(step) >= self.first

  def keep(self, version: int, weights: Any) -> None:
    """``version``'s weights, synced."""
    self._kept[version] = weights
    self.synced = max(self.synced, version)

  def available(self, version: int) -> bool:
    """Whether ``version``'s weights are synced and kept."""
    return version <= self.synced and version in self._kept

  def take(self, version: int) -> Any:
    """``version``'s weights (``available`` first); the older ones, which no later step needs, are dropped."""
    weights = self._kept[version]
    for old in [v for v in self._kept if v < version]:
      del self._kept[old]
    return weights

  def restart_at(self, version: int) -> None:
    """A resumed run: ``version`` (its checkpoint's) is the first, and is synced once its weights arrive."""
    self.synced, self.first, self._kept = version, version, {}

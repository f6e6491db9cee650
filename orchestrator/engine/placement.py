"""Place host leaves on the shardings a compiled step expects."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


def place_leaf(leaf: Any, sharding: NamedSharding) -> Any:
  """Returns ``leaf`` on ``sharding`` without waiting for the copy.

  Left alone: leaves that are not arrays (None, str, Python objects), arrays
  already on an equivalent sharding, and arrays that are not fully addressable
  from this process (another process placed them; resharding them here would
  need a collective). Scalars and 0-d arrays go replicated, whatever the target
  spec, since a 0-d value has no dimension to split.
  """
  if isinstance(leaf, jax.Array):
    if not leaf.is_fully_addressable:
      return leaf
    if leaf.ndim and leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
      return leaf
  elif isinstance(leaf, (bool, int, float, np.generic)):
    leaf = np.asarray(leaf)
  elif not isinstance(leaf, np.ndarray):
    return leaf
  if np.ndim(leaf) == 0:
    return jax.device_put(leaf, NamedSharding(sharding.mesh, P()))
  return jax.device_put(leaf, sharding)


def place_tree(tree: Any, shardings: Any) -> Any:
  """``place_leaf`` over matching trees (``shardings`` has one NamedSharding per leaf of ``tree``)."""
  return jax.tree.map(place_leaf, tree, shardings, is_leaf=lambda x: x is None)

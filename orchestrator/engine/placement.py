"""Place host leaves on the shardings a compiled step expects, and say what they hold on the devices."""

from __future__ import annotations

import math
from collections.abc import Iterable
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


def bytes_per_device(arrays: Iterable[Any]) -> tuple[int, ...]:
  """What ``arrays`` hold on each of this process's devices, in device-id order.

  From each array's shape, dtype and sharding alone (anything with ``shape``, ``dtype`` and
  ``sharding``: a ``jax.Array`` or a ``jax.ShapeDtypeStruct``): no data is read and nothing waits.
  A replicated array counts on every device that holds a copy.
  """
  held: dict[int, int] = {}
  for array in arrays:
    shard_bytes = math.prod(array.sharding.shard_shape(array.shape)) * np.dtype(array.dtype).itemsize
    for device in array.sharding.addressable_devices:
      held[device.id] = held.get(device.id, 0) + shard_bytes
  return tuple(held[i] for i in sorted(held))


def allocator_stats(devices: Iterable[Any]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
  """(bytes in use, bytes limit) per device, in the order given, from ``device.memory_stats()``.

  None when any device does not report both (a CPU device's ``memory_stats()`` is None).
  """
  stats = [d.memory_stats() for d in devices]
  if not stats or any(not s or "bytes_in_use" not in s or "bytes_limit" not in s for s in stats):
    return None
  return tuple(int(s["bytes_in_use"]) for s in stats), tuple(int(s["bytes_limit"]) for s in stats)

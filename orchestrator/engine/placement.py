"""Place host leaves on the shardings a compiled step expects, and say what they hold on the devices."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

PINNED_HOST = "pinned_host"


def staging_memory_kind(devices: Iterable[Any]) -> str | None:
  """The host memory a staged copy onto ``devices`` starts from: ``"pinned_host"``, or None for a plain copy.

  On a GPU or TPU an asynchronous host-to-device copy needs page-locked (pinned) host memory: from
  ordinary (pageable) memory the driver copies through a bounce buffer of its own, and the transfer
  serialises with the computation it was meant to run beside. So where every device is an accelerator
  whose memories include the ``pinned_host`` kind (``device.addressable_memories()``), ``place_leaf``
  first puts a host array into pinned host memory and then copies it to device memory — JAX's memory
  kinds: ``jax.device_put`` onto the sharding ``with_memory_kind("pinned_host")``, then onto the sharding
  itself. CPU devices list a ``pinned_host`` memory too, but there host and device memory are one memory:
  CPU keeps the plain copy, and with it the digests it always had. No devices, or any device without
  that kind: the plain copy.
  """
  devices = list(devices)
  if not devices or any(d.platform == "cpu" for d in devices):
    return None
  if all(PINNED_HOST in {m.kind for m in d.addressable_memories()} for d in devices):
    return PINNED_HOST
  return None


def place_leaf(leaf: Any, sharding: NamedSharding, via: str | None = None) -> Any:
  """Returns ``leaf`` on ``sharding`` without waiting for the copy.

  Left alone: leaves that are not arrays (None, str, Python objects), arrays
  already on an equivalent sharding, and arrays that are not fully addressable
  from this process (another process placed them; resharding them here would
  need a collective). Scalars and 0-d arrays go replicated, whatever the target
  spec, since a 0-d value has no dimension to split. ``via`` names a host memory
  kind a host array goes through first (``staging_memory_kind``); None copies
  it directly.
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
  target = NamedSharding(sharding.mesh, P()) if np.ndim(leaf) == 0 else sharding
  if via is not None and not isinstance(leaf, jax.Array):
    leaf = jax.device_put(leaf, target.with_memory_kind(via))
  return jax.device_put(leaf, target)


def place_tree(tree: Any, shardings: Any, via: str | None = None) -> Any:
  """``place_leaf`` over matching trees (``shardings`` has one NamedSharding per leaf of ``tree``).

  A dict of host arrays of one or more dimensions (a packed micro-batch's fields) goes in one ``jax.device_put``
  call (through ``via`` in one more), which JAX batches: the same arrays as a call per field, for about half the
  host's time on a small micro-batch, where that time is the step's.
  """
  if (type(tree) is dict and type(shardings) is dict and tree and tree.keys() == shardings.keys()
      and all(type(v) is np.ndarray and v.ndim for v in tree.values())):
    names = sorted(tree)  # the order jax.tree.map gives a dict's keys, as the call per field returned them
    targets = [shardings[name] for name in names]
    arrays = [tree[name] for name in names]
    if via is not None:
      arrays = jax.device_put(arrays, [target.with_memory_kind(via) for target in targets])
    return dict(zip(names, jax.device_put(arrays, targets)))
  return jax.tree.map(lambda leaf, sharding: place_leaf(leaf, sharding, via), tree, shardings,
                      is_leaf=lambda x: x is None)


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

"""Placement edge cases, a micro-batch's arrays placed in one call as each alone, the host memory a staged copy
starts from, and the throttler's queue discipline."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from orchestrator.engine import mesh as mesh_lib
from orchestrator.engine.placement import (PINNED_HOST, bytes_per_device, place_leaf, place_tree,
                                          staging_memory_kind)
from orchestrator.engine.throttler import InflightThrottler

pytestmark = pytest.mark.engine


def test_place_tree_handles_scalars_zero_width_non_arrays_and_placed_leaves():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig())
  target = mesh_lib.batch_sharding(mesh, 2)
  already = jax.device_put(np.ones((2, 4), np.int32), target)
  tree = {
      "scalar": 3,
      "np_scalar": np.float32(2.5),
      "zero_d": np.array(7),
      "zero_width": np.zeros((2, 0), np.float32),
      "none": None,
      "text": "label",
      "placed": already,
      "host": np.arange(8, dtype=np.int32).reshape(2, 4),
  }
  out = place_tree(tree, {k: target for k in tree})
  assert out["placed"] is already
  assert out["none"] is None and out["text"] == "label"
  assert out["scalar"].shape == () and int(out["scalar"]) == 3
  assert float(out["np_scalar"]) == 2.5 and int(out["zero_d"]) == 7
  assert out["zero_width"].shape == (2, 0)
  assert isinstance(out["host"], jax.Array) and out["host"].sharding.is_equivalent_to(target, 2)
  np.testing.assert_array_equal(out["host"], tree["host"])


@dataclasses.dataclass(frozen=True)
class _Memory:
  kind: str


@dataclasses.dataclass(frozen=True)
class _Device:
  """What ``staging_memory_kind`` reads of a device: its platform and its memories' kinds."""

  platform: str
  kinds: tuple[str, ...] = ("device", "pinned_host", "unpinned_host")

  def addressable_memories(self):
    return [_Memory(k) for k in self.kinds]


@pytest.mark.parametrize("devices,expected", [
    ([_Device("gpu"), _Device("gpu")], PINNED_HOST),
    ([_Device("tpu")], PINNED_HOST),
    ([_Device("cpu")], None),  # CPU lists a pinned_host memory too, and keeps the plain copy
    ([_Device("gpu"), _Device("gpu", ("device", "unpinned_host"))], None),  # one device without it
    ([_Device("gpu", ("device",))], None),
    ([], None),
], ids=["gpus", "tpu", "cpu", "one-gpu-without", "gpu-without", "none"])
def test_a_staged_copy_goes_through_pinned_host_memory_only_on_accelerators_that_offer_it(devices, expected):
  assert staging_memory_kind(devices) == expected


def test_this_machines_cpu_devices_keep_the_plain_copy():
  assert staging_memory_kind(jax.devices()) is None


def test_placing_through_pinned_host_memory_gives_the_same_arrays_in_device_memory():
  """The two-step copy (host → pinned host → device) on CPU, which has the memory kind, forced."""
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig())
  target = mesh_lib.batch_sharding(mesh, 2)
  tree = {"tokens": np.arange(32, dtype=np.int32).reshape(4, 8), "scalar": np.float32(1.5)}
  shardings = {k: target for k in tree}
  direct, pinned = place_tree(tree, shardings), place_tree(tree, shardings, PINNED_HOST)
  for name in tree:
    np.testing.assert_array_equal(pinned[name], direct[name])
    assert pinned[name].sharding == direct[name].sharding and pinned[name].sharding.memory_kind == "device"
  assert bytes_per_device(pinned.values()) == (32 * 4 + 4,)


@pytest.mark.parametrize("via", [None, PINNED_HOST], ids=["direct", "pinned"])
def test_a_micro_batchs_host_arrays_placed_in_one_call_equal_each_placed_alone(via):
  """A dict of host arrays (a packed micro-batch) takes one batched copy; each array lands as ``place_leaf`` puts
  it: same values, dtype and sharding, in device memory."""
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig())
  rows, replicated = mesh_lib.batch_sharding(mesh, 2), mesh_lib.batch_sharding(mesh, 0)
  tree = {"tokens": np.arange(32, dtype=np.int32).reshape(4, 8), "mask": np.ones((4, 8), np.float32),
          "routing": np.arange(64, dtype=np.int16).reshape(4, 8, 2), "empty": np.zeros((4, 0), np.float32)}
  shardings = {"tokens": rows, "mask": replicated, "routing": rows, "empty": rows}
  together = place_tree(tree, shardings, via)
  assert list(together) == sorted(tree)  # the keys in the order a call per field (jax.tree.map) gives them
  for name, host in tree.items():
    alone = place_leaf(host, shardings[name], via)
    np.testing.assert_array_equal(together[name], host)
    assert together[name].dtype == host.dtype and together[name].sharding == alone.sharding
    assert together[name].sharding.memory_kind == "device"


def test_throttler_bounds_the_queue_and_snapshot_wait_dequeues_nothing():
  t = InflightThrottler(max_inflight=2)
  xs = [jax.numpy.ones(3) * i for i in range(3)]
  t.add(xs[0])
  t.add(xs[1])
  t.wait_for_next()
  assert len(t) == 1  # made room for one more
  t.add(xs[2])
  t.block_until_ready()
  assert len(t) == 2
  t.wait_for_all()
  assert len(t) == 0

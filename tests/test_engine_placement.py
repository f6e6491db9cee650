"""Placement edge cases and the throttler's queue discipline."""

from __future__ import annotations

import jax
import numpy as np

from orchestrator.engine import mesh as mesh_lib
from orchestrator.engine.placement import place_tree
from orchestrator.engine.throttler import InflightThrottler


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

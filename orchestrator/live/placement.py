"""Where the live loop's sampler runs and holds its weights (``rollouts.placement``, docs/live-loop.md).

``shared``: on the trainer's devices. With a one-device trainer there is no
placement (None): the sampler runs on the default device as it always has, so
that run is unchanged bit for bit. On a mesh the sampler's weights are
replicated over the mesh's devices. ``split``: on ``rollouts.devices`` local
devices the trainer's mesh does not use (the ones after it), replicated over
them; the weight sync copies each update's weights there, device to device
(``transfer``), while the trainer's thread does its boundary work.

Replicated, not the model's shardings, for two reasons. A sampling program on
replicated weights and a replicated batch needs no collective, so the sampler's
thread never issues one: on shared devices, two threads that each issue
collectives can enqueue them in different orders on different devices, which
deadlocks a GPU's and can exhaust a CPU client's rendezvous threads; here there
is nothing to order. And the sampler computes exactly what a one-device sampler
computes, so every placement samples the same rollouts and a run's digest
depends only on the trainer's mesh. The cost is a full copy of the weights on
each sampler device and the same sampling computed on each of them.

In a job of several JAX processes (``jax.distributed``) every process samples on
its own first local device, with the whole weights there: the trainer's mesh
spans the processes, so a sampler on it would run programs every process must
enter in the same order, which a sampling thread beside the trainer's cannot
promise. Each update's weights are gathered onto every process's sampler
device first (``gather_across_processes``): a collective, issued on the
trainer's thread at the same point of every process's boundary work, and the
one the sync adds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from orchestrator.contract import WeightTransfer
from orchestrator.engine.mesh import MeshConfig, missing_devices

#: The axis of a sampler's own mesh (its weights are replicated along it).
SAMPLER_AXIS = "sampler"


@dataclasses.dataclass(frozen=True)
class SamplerPlacement:
  """The sampler's devices and the one sharding every weight takes there (replicated over them).

  ``moves_at_sync``: the weight sync copies the weights onto these devices (``split``); otherwise it keeps a
  host copy, which the sampling thread places when it takes that version (``shared``).
  """

  kind: str
  devices: tuple[Any, ...]
  sharding: NamedSharding

  @property
  def moves_at_sync(self) -> bool:
    return self.kind == "split"

  def put(self, weights: Any) -> Any:
    """``weights`` (host arrays or arrays on any devices) on the sampler's devices; does not wait."""
    return jax.device_put(weights, jax.tree.map(lambda _: self.sharding, weights))

  def transfer(self, weights: Any) -> tuple[Any, WeightTransfer]:
    """Copies ``weights`` onto the sampler's devices and waits until they are there; the copy and what moved."""
    start = time.perf_counter()
    placed = jax.block_until_ready(self.put(weights))
    end = time.perf_counter()
    copies = len(self.devices)
    moved = sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(placed)) * copies
    return placed, WeightTransfer(bytes=moved, seconds=end - start, started_at=start, ended_at=end)

  def default_device(self):
    """A context in which the arrays the sampler creates (its cache, prompts, seeds) start on its devices."""
    return jax.default_device(self.devices[0])


def default_device(placement: SamplerPlacement | None):
  """``placement.default_device()``, or no change where there is no placement (the default device)."""
  return contextlib.nullcontext() if placement is None else placement.default_device()


def keep(placement: SamplerPlacement | None, weights: Any, *, on_device: bool = False
         ) -> tuple[Any, WeightTransfer | None]:
  """What a weight sync keeps of ``weights`` for the sampler, and what it moved: the copy on a split sampler's
  devices and its ``WeightTransfer``; in a job of several processes, the whole weights gathered onto this
  process's sampler device (``gather_across_processes``, not waited for) and what the gather moved; else, for a
  sampler in this process that shares the trainer's devices (``on_device``), the trainer's arrays themselves
  (never donated, so they stay valid: no copy and no round trip through the host; the sampling thread places
  them on its sharding when it takes that version), or a host copy (a sampler in a process of its own)."""
  if placement is not None and placement.moves_at_sync:
    return placement.transfer(weights)
  gathered, moved = gather_across_processes(weights)
  if moved is not None or on_device:
    return gathered, moved
  return jax.device_get(gathered), None


def _identity(tree: Any) -> Any:
  return tree  # at module level, so every gather of the same shapes reuses one compiled program


def gather_across_processes(weights: Any) -> tuple[Any, WeightTransfer | None]:
  """``weights`` with every leaf that is sharded over several processes (a job's mesh) replaced by the whole
  of it on this process's first local device (a job's sampler device), the others as they are; and what the
  gather moved (None: nothing spanned processes, as in any run of one process, which this leaves unchanged).

  Those leaves are replicated over their own mesh by one program (all-gathers: a collective) and this process
  keeps the copy on its first device. So every process of the job must call this at the same point of its
  device work, on the thread that issues the trainer's programs: the weight sync and the evaluations do. It
  dispatches the program and returns; whoever reads the copy waits for it (the sampling thread, as it samples:
  a wait on a buffer, no program of its own with a collective). So the trainer's thread never waits here for
  the micro-batch queued before the gather (a pipelined boundary's next one), and ``seconds`` is the dispatch.

  Raises:
    TypeError: a leaf sharded over several processes without a ``NamedSharding`` (the engine's have one).
  """
  leaves, treedef = jax.tree.flatten(weights)
  spread = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable]
  if not spread:
    return weights, None
  for i in spread:
    if not isinstance(leaves[i].sharding, NamedSharding):
      raise TypeError(f"a weight sharded as {leaves[i].sharding} spans several processes; the weight sync gathers"
                      " NamedSharding arrays only: place the engine's weights with a NamedSharding")
  start, here = time.perf_counter(), jax.local_devices()[0]
  replicated = [NamedSharding(leaves[i].sharding.mesh, PartitionSpec()) for i in spread]
  gathered = jax.jit(_identity, out_shardings=replicated)([leaves[i] for i in spread])
  for i, leaf in zip(spread, gathered):  # the other copies go with ``gathered``: one device holds the weights
    leaves[i] = next(shard.data for shard in leaf.addressable_shards if shard.device == here)
  end = time.perf_counter()
  moved = sum(leaves[i].nbytes for i in spread)
  return jax.tree.unflatten(treedef, leaves), WeightTransfer(bytes=moved, seconds=end - start, started_at=start,
                                                               ended_at=end)


def missing_sampler_devices(kind: str, trainer_devices: int, sampler_devices: int, visible: int) -> str | None:
  """Why ``visible`` local devices cannot hold a trainer of ``trainer_devices`` and a split sampler of
  ``sampler_devices``, and the fix; None if they can (or the placement is shared)."""
  if kind != "split" or trainer_devices + sampler_devices <= visible:
    return None
  needed = trainer_devices + sampler_devices
  return (f"rollouts.placement=split needs {needed} local devices (the mesh's {trainer_devices} and"
          f" rollouts.devices={sampler_devices}) but {visible} are visible; on CPU set"
          f" XLA_FLAGS=--xla_force_host_platform_device_count={needed} before JAX is imported, or use a smaller mesh,"
          " fewer rollouts.devices or rollouts.placement=shared")


def sampler_placement(kind: str, mesh: MeshConfig, sampler_devices: int | None = None) -> SamplerPlacement | None:
  """The sampler's placement beside a trainer on ``mesh`` (its first ``mesh.num_devices`` devices, as
  ``engine.mesh.make_mesh`` takes them); None for a shared sampler beside a one-device trainer. In a job of
  several processes, a shared sampler's is this process's first local device (see the module docstring).

  Raises:
    ValueError: too few devices are visible for the mesh, or for the mesh and a split sampler (the message
      names the counts and the fix).
  """
  devices, processes = jax.devices(), jax.process_count()
  message = missing_devices(mesh, visible=len(devices), processes=processes)
  n = mesh.num_devices
  if message is None and kind == "split" and processes > 1:
    message = ("rollouts.placement=split needs local devices beside the trainer's, but in a job of several"
               " processes the mesh takes every device of the job; use rollouts.placement=shared")
  if message is None:
    message = missing_sampler_devices(kind, n, sampler_devices or 1, len(devices))
  if message is not None:
    raise ValueError(message)
  if kind == "shared" and processes > 1:  # the job's mesh spans processes: each samples on its own device
    chosen = (jax.local_devices()[0],)
  elif kind == "shared":
    if n == 1:
      return None
    chosen = tuple(devices[:n])
  elif kind == "split":
    chosen = tuple(devices[n:n + (sampler_devices or 1)])
  else:
    raise ValueError(f"rollouts.placement={kind!r}: use shared or split")
  sampler_mesh = Mesh(np.array(chosen), (SAMPLER_AXIS,))
  return SamplerPlacement(kind, chosen, NamedSharding(sampler_mesh, PartitionSpec()))

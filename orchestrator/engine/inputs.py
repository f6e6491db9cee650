"""A micro-batch's way onto the devices: packed on the host, placed on the step's shardings.

A staged input and a payload given to ``fwd_bwd`` both come through
``MicroBatchInputs.prepare``, so they reach the compiled step identically.
In a job of several processes each process packs and places only its block of
the micro-batch (its rows, and its tokens where ``context`` spans processes):
which row each trajectory goes to is decided over the whole payload, then the
process writes its rows and builds the global array from them
(``jax.make_array_from_process_local_data``).

On a GPU or TPU a payload's arrays go through pinned host memory on their way
to the devices (``placement.staging_memory_kind``), so the staged copy is a
transfer that runs beside the compute; on CPU they are copied as they are. A
job of several processes builds its global arrays from the host arrays
directly (not through pinned memory yet).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from orchestrator.data import packing
from orchestrator.data.trajectory import Trajectory
from orchestrator.engine import mesh as mesh_lib
from orchestrator.engine.placement import bytes_per_device, place_tree, staging_memory_kind


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedFwdBwdInput:
  """A micro-batch already mapped to model inputs and placed on the step's shardings.

  Made by ``prepare_fwd_bwd_input``; consumed by ``fwd_bwd``. The copy to the
  devices may still be in flight when it is handed back.

  Attributes:
    arrays: the placed inputs, by field name (see ``packing.FIELDS``).
    host_arrays: the host arrays they were placed from, read-only (on CPU the
      placed arrays may alias them); ``digest`` hashes them on first use.
    loss_tokens: completion tokens the micro-batch adds to the loss denominator.
    num_trajectories: trajectories packed into it.
    mapping_s, placement_s: seconds spent packing and issuing the copies.
    engine_id: the engine that prepared it; another engine refuses it.
    rows: in a job of several processes, the rows ``(start, stop)`` of the
      micro-batch this process packed and placed (``host_arrays`` holds only
      those); None when this process holds every row.
    bytes_per_device: (a property) what the placed arrays hold on each of this
      process's devices, in device-id order.
    bytes_by_field: (a property) what each field's placed array holds over this process's devices; the
      fields' bytes sum to ``bytes_per_device``'s.
  """

  arrays: Mapping[str, jax.Array]
  host_arrays: Mapping[str, np.ndarray] = dataclasses.field(repr=False)
  loss_tokens: int
  num_trajectories: int
  mapping_s: float
  placement_s: float
  engine_id: int
  rows: tuple[int, int] | None = None

  @functools.cached_property
  def digest(self) -> str:
    """Content digest of the inputs, hashed when first asked for (never on the stage itself)."""
    return packing.content_digest(self.host_arrays)

  @functools.cached_property
  def bytes_per_device(self) -> tuple[int, ...]:
    """Bytes the placed arrays hold on each of this process's devices (device-id order), from their shardings."""
    return bytes_per_device(self.arrays.values())

  @functools.cached_property
  def bytes_by_field(self) -> dict[str, int]:
    """Bytes each field's placed array holds over this process's devices, by field name (``packing.FIELDS``)."""
    return {name: sum(bytes_per_device([array])) for name, array in self.arrays.items()}


def input_shardings(mesh, *, routing: bool = False) -> dict[str, jax.sharding.Sharding]:
  """Each packed field's sharding on ``mesh`` (rows and tokens split as ``mesh.batch_sharding`` says), with
  routing replay's ``[rows, tokens, layers, top_k]`` field split as the tokens are."""
  shardings = {name: mesh_lib.batch_sharding(mesh, 2) for name in packing.FIELDS}
  if routing:
    shardings[packing.ROUTING] = mesh_lib.batch_sharding(mesh, 4)
  return shardings


class MicroBatchInputs:
  """Packs payloads into ``[rows, tokens_per_row]`` arrays and places them on ``shardings``.

  ``devices`` are this process's devices of the shardings (device-id order); ``host_memory_kind`` the host
  memory a payload goes through on its way there (``placement.staging_memory_kind``: pinned host memory on
  an accelerator, None on CPU).
  """

  def __init__(self, rows: int, tokens_per_row: int, vocab_size: int, shardings: Mapping[str, jax.sharding.Sharding],
               routing: packing.RoutingShape | None = None):
    self.rows, self.tokens_per_row, self.vocab_size, self.routing = rows, tokens_per_row, vocab_size, routing
    self.shardings = dict(shardings)
    self.devices = sorted(self.shardings["input_tokens"].addressable_devices, key=lambda d: d.id)
    self.host_memory_kind = staging_memory_kind(self.devices)
    # Several processes: this process's block of each micro-batch (None: it holds every row).
    self.local_block = mesh_lib.process_block(self.shardings["input_tokens"], (rows, tokens_per_row))

  @functools.cached_property
  def input_bytes(self) -> tuple[int, ...]:
    """What one micro-batch's input holds on each of ``devices`` once placed (every input has the same shapes)."""
    host = self.pack(self.placeholder())
    return bytes_per_device(jax.ShapeDtypeStruct(host[name].shape, host[name].dtype, sharding=self.shardings[name])
                            for name in host)

  def placeholder(self) -> list[Trajectory]:
    """A one-trajectory payload of the inputs' shapes (for compiling and sizing; its values mean nothing)."""
    routing = None if self.routing is None else np.zeros((2, self.routing.layers, self.routing.top_k), np.int16)
    return [Trajectory(np.array([1], np.int32), np.array([2], np.int32), 0.0, routing=routing)]

  def pack(self, payload: Sequence[Trajectory]) -> dict[str, np.ndarray]:
    """The whole micro-batch, packed (its shapes are the compiled step's)."""
    return packing.pack_payload(payload, rows=self.rows, tokens_per_row=self.tokens_per_row,
                                vocab_size=self.vocab_size, routing=self.routing)

  def prepare(self, payload: Sequence[Trajectory], engine_id: int) -> PreparedFwdBwdInput:
    """Packs this process's block of ``payload`` and starts its copy; raises ValueError for a bad payload."""
    start = time.perf_counter()
    host = self.pack(payload) if self.local_block is None else self._pack_local(payload)
    mapped = time.perf_counter()
    arrays, placed = self._place(host), time.perf_counter()
    for array in host.values():
      array.flags.writeable = False  # the placed arrays may alias these on CPU
    rows = None if self.local_block is None else (self.local_block[0].start, self.local_block[0].stop)
    return PreparedFwdBwdInput(arrays, host, packing.count_loss_tokens(payload), len(payload),
                               mapped - start, placed - mapped, engine_id, rows)

  def _pack_local(self, payload: Sequence[Trajectory]) -> dict[str, np.ndarray]:
    rows, tokens = self.local_block
    host = packing.pack_payload(payload, rows=self.rows, tokens_per_row=self.tokens_per_row,
                                vocab_size=self.vocab_size, row_range=(rows.start, rows.stop), routing=self.routing)
    if (tokens.start, tokens.stop) != (0, self.tokens_per_row):
      host = {name: np.ascontiguousarray(array[:, tokens]) for name, array in host.items()}
    return host

  def _place(self, host: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    if self.local_block is None:
      return place_tree(host, self.shardings, via=self.host_memory_kind)
    shape = (self.rows, self.tokens_per_row)
    return {name: jax.make_array_from_process_local_data(self.shardings[name], array, shape + array.shape[2:])
            for name, array in host.items()}

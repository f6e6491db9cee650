"""Device mesh with the axes ``fsdp``, ``context`` and ``expert``, and the shardings built on it.

Rows of a micro-batch are split over ``fsdp`` × ``expert`` (both are data-parallel
for the dense parts of the model), tokens over ``context``. Weights are sharded
over ``fsdp`` along the model dimension and expert weights over ``expert`` along
the expert dimension. Tunix's Qwen3 names mesh axes per weight and activation
dimension through a ``ShardingConfig``; ``model_sharding`` builds one for these axes.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from orchestrator.engine.mesh_shape import AXES, ROW_AXES, TOKEN_AXIS, MeshConfig

__all__ = ["AXES", "ROW_AXES", "TOKEN_AXIS", "MeshConfig", "make_mesh", "model_sharding", "batch_sharding",
           "replicated", "check_batch_shape", "check_devices", "describe_devices", "device_summary", "process_block"]


def make_mesh(config: MeshConfig) -> Mesh:
  """A mesh over the first ``config.num_devices`` devices, every axis of Auto type.

  Raises:
    ValueError: fewer devices are visible than the mesh needs (the message says
      how to get forced host devices on CPU).
  """
  check_devices(config)
  devices = jax.devices()
  shape = (config.fsdp, config.context, config.expert)
  # Tunix's Qwen3 traces under the default Explicit axis types and fails; Auto lets
  # XLA propagate shardings from the inputs and the weights.
  return jax.make_mesh(
      shape,
      AXES,
      axis_types=(jax.sharding.AxisType.Auto,) * len(AXES),
      devices=devices[: config.num_devices],
  )


def check_devices(config: MeshConfig) -> None:
  """Raises ValueError when fewer devices are visible than the mesh needs (saying how to get more on CPU)."""
  message = missing_devices(config, visible=len(jax.devices()), processes=jax.process_count())
  if message is not None:
    raise ValueError(message)


def describe_devices(config: MeshConfig) -> str:
  """The devices JAX found, for the run's opening line: how many of each kind (a job's, over every process),
  how many the mesh takes, and JAX's version (``devices: 8 × NVIDIA H100 80GB HBM3 (gpu), the mesh uses 8;
  JAX 0.12.0.1``)."""
  return device_summary([(d.platform, d.device_kind) for d in jax.devices()], config.num_devices, jax.__version__)


def device_summary(devices: Sequence[tuple[str, str]], used: int, jax_version: str) -> str:
  """``devices`` as (platform, kind) pairs → ``devices: 1 × cpu, the mesh uses 1; JAX 0.10.2``; the platform
  is named where the kind does not start with it (``NVIDIA H100`` is a ``gpu``, ``TPU v5 lite`` a ``tpu``)."""
  counts = collections.Counter(devices)
  kinds = ", ".join(f"{n} × {kind}" + ("" if kind.lower().startswith(platform.lower()) else f" ({platform})")
                    for (platform, kind), n in counts.items())
  return f"devices: {kinds or 'none'}, the mesh uses {used}; JAX {jax_version}"


def missing_devices(config: MeshConfig, *, visible: int, processes: int) -> str | None:
  """Why ``visible`` devices (of a job of ``processes``) cannot hold the mesh, and the fix; None if they can.

  XLA's flag forces devices in each process, so a job of several processes needs the mesh's devices
  divided by the processes in each one, not the mesh's count.
  """
  if visible >= config.num_devices:
    return None
  needed = f"mesh {dataclasses.asdict(config)} needs {config.num_devices} devices but {visible} are visible"
  if processes <= 1:
    return (f"{needed}; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={config.num_devices} before"
            " JAX is imported")
  if config.num_devices % processes:
    return (f"{needed} in a job of {processes} processes, which cannot split {config.num_devices} devices"
            f" evenly; size the mesh to a multiple of {processes} devices")
  per_process = config.num_devices // processes
  return (f"{needed} in a job of {processes} processes; on CPU set"
          f" XLA_FLAGS=--xla_force_host_platform_device_count={per_process} in every process (devices per"
          f" process: {config.num_devices} ÷ {processes}) before JAX is imported")


#: Each weight's and activation's axes on this mesh, by Tunix's ShardingConfig field names (every family's
#: config takes the fields it declares; no ``tp``/``sp``).
_SHARDING_AXES = dict(
    emb_vd=(None, "fsdp"),
    emb_dv=("fsdp", None),
    q_weight_dnh=("fsdp", None, None),
    q_weight_ndh=(None, "fsdp", None),
    kv_weight_cndh=(None, None, "fsdp", None),
    qkv_weight_cndh=(None, None, "fsdp", None),
    vision_proj=("fsdp", None),
    vision_soft_emb_norm_weight=(None,),
    siglip=None,  # Gemma3's vision tower: the engine trains text-only checkpoints
    kv_weight_dnh=("fsdp", None, None),
    o_weight_nhd=(None, None, "fsdp"),
    ffw_weight_df=("fsdp", None),
    ffw_weight_fd=(None, "fsdp"),
    rms_norm_weight=(None,),
    qkv_bias=(None,),
    act_btd=(ROW_AXES, TOKEN_AXIS, None),
    act_btf=(ROW_AXES, TOKEN_AXIS, None),
    act_btnh=(ROW_AXES, TOKEN_AXIS, None, None),
    exp_weight_edf=("expert", "fsdp", None),
    exp_weight_efd=("expert", None, "fsdp"),
    exp_weight_cdf=("expert", "fsdp", None),
    exp_weight_cfd=("expert", None, "fsdp"),
)


def model_sharding(sharding_config_class):
  """A Tunix ``ShardingConfig`` (any family's class) that names only this mesh's axes.

  Raises:
    ValueError: the class declares a field this mesh gives no axes for (a Tunix model newer than this table).
  """
  fields = [field.name for field in dataclasses.fields(sharding_config_class)]
  unknown = [name for name in fields if name not in _SHARDING_AXES]
  if unknown:
    raise ValueError(f"{sharding_config_class.__module__}.ShardingConfig has fields {unknown} the mesh gives no"
                     " axes for; add them to orchestrator.engine.mesh._SHARDING_AXES")
  return sharding_config_class(**{name: _SHARDING_AXES[name] for name in fields})


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Sharding for one micro-batch leaf: rows over fsdp×expert, tokens over context."""
  if ndim == 0:
    return NamedSharding(mesh, P())
  if ndim == 1:
    return NamedSharding(mesh, P(ROW_AXES))
  return NamedSharding(mesh, P(ROW_AXES, TOKEN_AXIS, *([None] * (ndim - 2))))


def process_block(sharding: NamedSharding, global_shape: tuple[int, ...]) -> tuple[slice, ...] | None:
  """The block of a ``global_shape`` array this process's devices hold, one slice per dimension;
  None when this process holds all of it (one process).

  Raises:
    ValueError: the process's shards do not form one block (the mesh interleaves
      processes along a split dimension); order the devices by process.
  """
  indices = list(sharding.addressable_devices_indices_map(global_shape).values())
  block = []
  for dim, size in enumerate(global_shape):
    spans = {(s.start or 0, size if s.stop is None else s.stop) for s in (index[dim] for index in indices)}
    start, covered_to = min(a for a, _ in spans), min(a for a, _ in spans)
    for a, b in sorted(spans):
      if a > covered_to:
        raise ValueError(f"this process's shards of dimension {dim} are not one block ({sorted(spans)}); the mesh"
                         " must list each process's devices together")
      covered_to = max(covered_to, b)
    stop = covered_to
    block.append(slice(start, stop))
  if all(b.start == 0 and b.stop == size for b, size in zip(block, global_shape)):
    return None
  return tuple(block)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def check_batch_shape(config: MeshConfig, rows: int, tokens_per_row: int) -> None:
  """Raises ValueError unless rows split evenly over fsdp×expert and tokens over context."""
  config.check_batch_shape(rows, tokens_per_row)

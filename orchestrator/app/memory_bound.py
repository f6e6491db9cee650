"""The least memory a run's training needs, checked before anything is built (``preflight``).

Only what no remat policy, attention kernel or chunking can avoid is counted,
so a run this refuses cannot fit, and a run it passes may still not: the
weights, their gradients and the optimizer's two moments (float32: 16 bytes a
parameter, whatever ``engine.dtype`` computes in), a KL reference's copy of the
weights (4 bytes a parameter), and each layer's input over the micro-batch,
which the backward pass keeps (or, rematerialised, starts its recomputation
from); and where a live run's sampler shares that memory (a CPU host's, or the
trainer's accelerator with ``rollouts.placement`` shared), its copy of the
weights and the key/value cache of one sampler call (the live loop samples while
it trains, so both are held at once). They are compared with what the mesh's
devices hold: a device's memory limit, where the runtime reports one (an
accelerator), times the mesh's devices (a job of several processes holds the
rest on its other hosts), else the host's available memory, which CPU devices
share. A mesh asking for more devices than there are is left to the device
check.
"""

from __future__ import annotations

from orchestrator.app.compute_probe import parameter_count
from orchestrator.live.placement_rule import choose_placement
from orchestrator.recipe import RecipeError

#: Bytes of a value of each ``engine.dtype``.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def least_training_bytes(recipe, *, sampler_here: bool = False) -> dict[str, int]:
  """What training the recipe's micro-batch needs at the least, by part (bytes, the whole mesh's); with
  ``sampler_here``, a live run's sampler too (its weights and one call's key/value cache)."""
  preset, (rows, tokens_per_row) = recipe.model_preset(), recipe.micro_batch_shape()
  params, value_bytes = parameter_count(preset), DTYPE_BYTES.get(recipe.engine.dtype, 4)
  parts = {"the weights, their gradients and the optimizer's moments": 16 * params}
  if recipe.engine.kl_beta:
    parts["the KL reference's weights"] = 4 * params
  parts["each layer's input over the micro-batch, which the backward pass keeps"] = (
      rows * tokens_per_row * preset.num_layers * preset.embed_dim * value_bytes)
  if sampler_here and recipe.rollouts.source == "sampler":
    trajectories, per_trajectory = recipe.live_trajectories()
    call_rows = trajectories * recipe.micro_batches_per_call()
    parts["the sampler's weights"] = value_bytes * params
    parts[f"the sampler's key/value cache for {call_rows:,} sequences of {per_trajectory:,} tokens"] = (
        call_rows * per_trajectory * preset.num_layers * preset.num_kv_heads * preset.head_dim * 2 * value_bytes)
  return parts


def devices_memory_bytes(num_devices: int) -> tuple[int | None, str]:
  """What a mesh of ``num_devices`` devices holds, and what that is in words: a local device's memory limit
  times ``num_devices`` where the runtime reports one (the job's devices are alike), else the host's available
  memory (CPU devices share it); None where neither is known."""
  import jax  # import here: JAX-side (after setup_host)

  device = jax.local_devices()[0]
  limit = (device.memory_stats() or {}).get("bytes_limit")
  if limit:
    return int(limit) * num_devices, f"the memory of {num_devices} {device.device_kind} device(s)"
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
  except (OSError, StopIteration, ValueError):
    return None, "unknown"
  return kib * 1024, "this host's available memory"


def check_training_fits(recipe) -> None:
  """Refuses, in one line, a micro-batch whose training cannot fit the devices (``least_training_bytes``).

  Raises:
    RecipeError: the least it needs exceeds what the mesh's devices hold.
  """
  import jax  # import here: JAX-side (after setup_host)

  if recipe.mesh.num_devices > jax.device_count():
    return  # the device check refuses it, naming the devices
  platform = jax.default_backend()
  placement, _ = choose_placement(recipe.rollouts.placement, platform=platform, processes=jax.process_count(),
                                  trainer_local=True)
  parts = least_training_bytes(recipe, sampler_here=platform == "cpu" or placement == "shared")
  need = sum(parts.values())
  have, what = devices_memory_bytes(recipe.mesh.num_devices)
  if have is None or need <= have:
    return
  rows, tokens_per_row = recipe.micro_batch_shape()
  gib = 2 ** 30
  listed = "; ".join(f"{name} {size / gib:,.1f} GiB" for name, size in parts.items())
  raise RecipeError(f"batch.rows × batch.tokens_per_row = {rows:,} × {tokens_per_row:,} tokens per micro-batch"
                    f" cannot train model {recipe.model_preset().name} in {what} ({have / gib:,.1f} GiB): it needs at"
                    f" least {need / gib:,.1f} GiB ({listed}); {_fix(recipe, parts, have)}")


def _fix(recipe, parts: dict[str, int], have: int) -> str:
  """What would make it fit, by the part that cannot: the model's state alone, the sampler's call, the rows."""
  state = sum(size for name, size in parts.items() if "weights" in name)
  if state > have:
    return "use a mesh of more devices (mesh.fsdp) or a smaller model: its weights and optimizer state alone do not fit"
  if any(name.startswith("the sampler's key/value cache") and size > have / 2 for name, size in parts.items()):
    return ("sample fewer sequences a call (rollouts.micro_batches_per_call, rollouts.groups_per_micro_batch) or"
            " run the sampler in a process of its own (rollouts.placement=process)")
  if recipe.rollouts.source == "sampler" and recipe.batch.rows is None:
    return "sample fewer groups a micro-batch (rollouts.groups_per_micro_batch): they size its rows"
  return "lower batch.rows or batch.tokens_per_row"

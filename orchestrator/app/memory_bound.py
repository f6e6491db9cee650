"""The least memory a run's training needs, checked before anything is built (``preflight``).

Only what no remat policy, attention kernel or chunking can avoid is counted,
so a run this refuses cannot fit, and a run it passes may still not: the
weights, their gradients and the optimizer's two moments (float32: 16 bytes a
parameter, whatever ``engine.dtype`` computes in), a KL reference's copy of the
weights (4 bytes a parameter), and each layer's input over the micro-batch,
which the backward pass keeps (or, rematerialised, starts its recomputation
from); and where a live run's sampler shares that memory (a CPU host's, or the
trainer's accelerator with ``rollouts.placement`` shared), its copy of the
weights and the key/value cache of one sampler call. They are compared with
what the devices the mesh uses hold: the sum of their memory limits where the
runtime reports one (an accelerator), else the host's available memory, which
CPU devices share.
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
  """What ``num_devices`` local devices hold, and what that is in words: their memory limits summed where the
  runtime reports them, else the host's available memory (CPU devices share it); None where neither is known."""
  import jax  # import here: JAX-side (after setup_host)

  devices = jax.local_devices()[:num_devices]
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
  if limits and all(limits):
    return int(sum(limits)), f"the {len(devices)} {devices[0].device_kind} device(s)' memory"
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
                    f" least {need / gib:,.1f} GiB ({listed}); lower batch.rows or batch.tokens_per_row")

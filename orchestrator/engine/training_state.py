"""The training state on the devices: weights, optimizer state and the step's gradient accumulators.

``TrainingState`` places them on the mesh with the shardings the compiled
programs take, and holds what each program returns: the accumulate programs
replace the accumulators and the apply program the optimizer state and the
weights too (the buffers they donated are gone). Step k's weights are never
donated, so they stay readable after step k+1's first micro-batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orchestrator.engine import mesh as mesh_lib
from orchestrator.engine.inputs import input_shardings
from orchestrator.engine import model as model_lib
from orchestrator.engine.diagnostics import tree_digest
from orchestrator.engine.options import EngineOptions
from orchestrator.models.presets import ModelPreset

#: An on-device copy of a tree of arrays (snapshots): one jitted function, so repeated snapshots do not recompile.
device_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


class TrainingState:
  """Params, optimizer state and gradient accumulators placed on ``mesh``, built from ``preset`` with
  ``options``' seed, capacity factor and dtype; ``optimizer`` initialises the optimizer state.

  Attributes:
    graphdefs: the model's graph definitions by name (``"capacity"``, ``"dropless"``).
    param_shardings, opt_shardings, scalar_sharding, batch_shardings: the shardings the programs take.
    params, opt_state: the training state.
    grad_acc, loss_acc, denom_acc: the step's gradient, loss and [loss denominator, token count] accumulators.
  """

  def __init__(self, preset: ModelPreset, options: EngineOptions, mesh, optimizer, *, tokens_per_row: int = 0):
    splash_block = model_lib.splash_block_tokens(tokens_per_row) if options.attention == "splash" else None
    self.graphdefs, host_params, specs = model_lib.build_model(preset, options.seed, options.capacity_factor,
                                                               mesh=mesh, dtype=options.dtype,
                                                               remat=options.remat, splash_block=splash_block)
    self.param_shardings = model_lib.param_shardings(mesh, specs)
    self.scalar_sharding = mesh_lib.replicated(mesh)
    self.params = jax.device_put(host_params, self.param_shardings)
    opt_state = jax.jit(optimizer.init)(self.params)
    # Moments follow their param's sharding; step counters come back on one
    # device and are replicated over the mesh instead.
    self.opt_shardings = jax.tree.map(
        lambda x: x.sharding
        if isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding.mesh == mesh
        else self.scalar_sharding,
        opt_state,
    )
    self.batch_shardings = input_shardings(mesh, routing=options.router_replay)
    self.opt_state = jax.device_put(opt_state, self.opt_shardings)
    self._zeros_jit = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=self.param_shardings)
    # The KL term's reference, frozen: model.reference_checkpoint's weights, or else the starting weights (a
    # checkpoint's, or the seed's); a resumed run builds the same start before it restores, so its reference is
    # the run's, not the checkpoint's. Its weights take device memory as the policy's do, so the memory gate's
    # measured free bytes count them.
    self.reference: tuple = ()
    if options.kl_beta and preset.reference_checkpoint:
      reference = dataclasses.replace(preset, checkpoint=preset.reference_checkpoint)
      _, reference_params, _ = model_lib.build_model(reference, options.seed, options.capacity_factor, mesh=mesh,
                                                     dtype=options.dtype, remat=options.remat,
                                                     splash_block=splash_block)
      self.reference = (jax.device_put(reference_params, self.param_shardings),)
    elif options.kl_beta:
      self.reference = (device_copy(self.params),)
    self.zero_accumulators()

  @property
  def accumulators(self) -> tuple:
    """(gradient, loss, [loss denominator, token count]) accumulated over the step so far."""
    return self.grad_acc, self.loss_acc, self.denom_acc

  def zero_accumulators(self) -> None:
    self.grad_acc = self._zeros_jit(self.params)
    self.loss_acc = jax.device_put(np.float32(0), self.scalar_sharding)
    self.denom_acc = jax.device_put(np.zeros(2, np.float32), self.scalar_sharding)

  def accumulate(self, program, batch) -> tuple:
    """Dispatches an accumulate program on ``batch``; keeps its accumulators and returns its
    (loss sum, token stats (``loss.TOKEN_STATS``), dropped tokens, overflow flag)."""
    self.grad_acc, self.loss_acc, self.denom_acc, total, count, dropped, overflow = program(
        self.params, self.grad_acc, self.loss_acc, self.denom_acc, batch, *self.reference)
    return total, count, dropped, overflow

  def apply(self, program) -> dict[str, jax.Array]:
    """Dispatches the apply program; keeps the new weights, optimizer state and (zeroed) accumulators and
    returns the update's device metrics."""
    self.params, self.opt_state, self.grad_acc, self.loss_acc, self.denom_acc, metrics = program(
        self.params, self.opt_state, self.grad_acc, self.loss_acc, self.denom_acc)
    return metrics

  def reset_to(self, params: Any, opt_state: Any) -> None:
    """New weights and optimizer state, with empty accumulators."""
    self.params, self.opt_state = params, opt_state
    self.zero_accumulators()

  def copies(self) -> tuple[Any, Any]:
    """On-device copies of (params, optimizer state)."""
    return device_copy(self.params), device_copy(self.opt_state)

  def checkpointed(self) -> dict[str, Any]:
    """What a checkpoint holds (and a restore's template)."""
    return {"params": self.params, "opt_state": self.opt_state}

  def digest(self) -> str:
    """A sha256 of params and optimizer state: equal digests mean bit-identical training state."""
    return tree_digest(self.checkpointed())

"""An engine over a stock Tunix ``PeftTrainer``, with the staging methods.

This is the trainer most users already have: its jitted train step maps
nothing itself, so the adapter packs each payload and places it on the
trainer's device — the same work for a payload given to ``fwd_bwd`` and for
one staged ahead with ``prepare_fwd_bwd_input`` (one path, so staged and
unstaged inputs train bit for bit alike and trigger no retrace).
``wait_for_device`` blocks on the micro-batches still in flight.

Gradient accumulation is Tunix's own (``optax.MultiSteps`` over
``gradient_accumulation_steps``): it averages per-micro-batch mean losses and
applies the update inside the M-th micro-batch's program. ``update()`` is
therefore a no-op on the host — it checks that a whole step was accumulated
and advances the count — and a *deferred* update (STAGE_BEFORE_UPDATE) defers
nothing real: the stage still runs while the last micro-batch (which carries
the update) computes, and the wait before the no-op update is what the policy
measures.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.sft import peft_trainer

from orchestrator.contract import Receipt, StepMetrics
from orchestrator.data.packing import content_digest, count_loss_tokens, pack_payload
from orchestrator.data.trajectory import Trajectory
from orchestrator.engine import model as model_lib
from orchestrator.engine.options import EngineOptions
from orchestrator.engine.loss import LossConfig, SampledDistribution, attention_mask, policy_loss_sum
from orchestrator.models.presets import ModelPreset, load_preset


@dataclasses.dataclass(frozen=True, eq=False)
class TunixPreparedInput:
  """A payload packed and placed on the trainer's device (read-only host arrays kept for the digest)."""

  arrays: dict
  host_arrays: dict = dataclasses.field(repr=False)
  loss_tokens: int
  mapping_s: float
  placement_s: float

  @functools.cached_property
  def digest(self) -> str:
    return content_digest(self.host_arrays)


class TunixTrainerEngine:
  """Drives ``tunix.sft.peft_trainer.PeftTrainer`` one micro-batch at a time.

  Args:
    preset: model preset name (dense presets).
    micro_batches_per_step: Tunix's ``gradient_accumulation_steps``.
    rows, tokens_per_row: batch shape (default: the preset's).
    learning_rate, weight_decay, max_grad_norm: AdamW with global-norm clipping.
    clip_eps_low, clip_eps_high: the loss's ratio clipping range.
    seed: weight seed.
    dtype: the compute dtype (``engine.dtype``).
    sampled: the distribution the rollouts were sampled from (``loss.SampledDistribution``).
  """

  def __init__(self, preset: str | ModelPreset = "tiny", *, micro_batches_per_step: int, rows: int | None = None,
               tokens_per_row: int | None = None, learning_rate: float = 1e-3, weight_decay: float = 0.0,
               max_grad_norm: float = 1.0, clip_eps_low: float = 0.2, clip_eps_high: float = 0.28,
               seed: int = 0, dtype: str = "float32", sampled: SampledDistribution | None = None):
    self.preset = load_preset(preset) if isinstance(preset, str) else preset
    self.rows = rows or self.preset.rows
    self.tokens_per_row = tokens_per_row or self.preset.tokens_per_row
    self.micro_batches_per_step = micro_batches_per_step
    graphdefs, params, _ = model_lib.build_model(self.preset, seed, dtype=dtype)
    self.model = nnx.merge(graphdefs["capacity"], params)
    loss_config = LossConfig(clip_eps_low, clip_eps_high, sampled)

    # Tunix calls loss_fn(model, **inputs) through nnx.value_and_grad, which needs
    # every input as a named parameter.
    def loss_fn(model, input_tokens, target_tokens, segment_ids, positions, loss_mask,
                advantages, old_logprobs, old_logprobs_mask):
      batch = {"target_tokens": target_tokens, "loss_mask": loss_mask, "advantages": advantages,
               "old_logprobs": old_logprobs, "old_logprobs_mask": old_logprobs_mask}
      logits, _ = model(input_tokens, positions, None, attention_mask(segment_ids))
      total, denominator, _ = policy_loss_sum(logits, batch, loss_config)
      return total / jnp.maximum(denominator, 1.0)

    self.trainer = peft_trainer.PeftTrainer(
        self.model,
        optax.chain(optax.clip_by_global_norm(max_grad_norm),
                    optax.adamw(learning_rate, weight_decay=weight_decay)),
        peft_trainer.TrainingConfig(eval_every_n_steps=10**9,
                                    gradient_accumulation_steps=micro_batches_per_step),
    ).with_loss_fn(loss_fn)
    self._train_step, _ = self.trainer.jit_train_and_eval_step()
    self._micro = 0
    self._step = 0
    self._losses: list[jax.Array] = []
    self._inflight: collections.deque = collections.deque(maxlen=2)  # the last dispatched micro-batches
    self._last: dict[str, Any] = {}

  def prepare_fwd_bwd_input(self, payload: Sequence[Trajectory]) -> TunixPreparedInput:
    """Packs ``payload`` and starts its copy to the trainer's device; waits for nothing, changes nothing."""
    start = time.perf_counter()
    host = pack_payload(payload, rows=self.rows, tokens_per_row=self.tokens_per_row,
                        vocab_size=self.preset.vocab_size)
    mapped = time.perf_counter()
    arrays = {k: jax.device_put(v) for k, v in host.items()}
    placed = time.perf_counter()
    for array in host.values():
      array.flags.writeable = False  # the placed arrays may alias these on CPU
    return TunixPreparedInput(arrays, host, count_loss_tokens(payload), mapped - start, placed - mapped)

  def wait_for_device(self) -> float:
    """Blocks until the micro-batches in flight are done; returns the seconds it blocked."""
    start = time.perf_counter()
    jax.block_until_ready(list(self._inflight))
    return time.perf_counter() - start

  def fwd_bwd(self, payload_or_prepared, apply_optimizer: bool = False) -> Receipt:
    """Runs one micro-batch through the trainer's jitted step (a payload is prepared first)."""
    if isinstance(payload_or_prepared, TunixPreparedInput):
      prepared, mapping_s, placement_s = payload_or_prepared, 0.0, 0.0
    else:
      prepared = self.prepare_fwd_bwd_input(payload_or_prepared)
      mapping_s, placement_s = prepared.mapping_s, prepared.placement_s
    loss, _, _ = self._train_step(prepared.arrays)
    receipt = Receipt(kind="fwd_bwd", step=self._step, micro_step=self._micro, ready=loss,
                      dispatched_at=time.perf_counter(), mapping_s=mapping_s, placement_s=placement_s)
    self._inflight.append(loss)
    self._losses.append(loss)
    self._micro += 1
    if apply_optimizer:
      self.update()
    return receipt

  def update(self) -> Receipt:
    """Closes the step: Tunix's MultiSteps applied the update with the M-th micro-batch.

    The update ran inside that micro-batch's program, so the receipt's handle
    is that micro-batch's loss.

    Raises:
      RuntimeError: fewer or more than ``micro_batches_per_step`` micro-batches
        were run (the stock trainer cannot update at any other point).
    """
    if self._micro != self.micro_batches_per_step:
      raise RuntimeError(
          f"the stock Tunix trainer updates every {self.micro_batches_per_step} micro-batches;"
          f" update() after {self._micro}"
      )
    receipt = Receipt(kind="update", step=self._step, micro_step=-1, ready=self._losses[-1],
                      dispatched_at=time.perf_counter(), mapping_s=0.0, placement_s=0.0, host_wait_s=0.0)
    self._last = {"step": self._step + 1, "micro_losses": self._losses}
    self._losses, self._micro = [], 0
    self._step += 1
    return receipt

  def get_metrics(self) -> StepMetrics:
    if not self._last:
      return StepMetrics()
    losses = [float(x) for x in jax.device_get(self._last["micro_losses"])]
    return StepMetrics(step=self._last["step"], loss=float(np.mean(losses)), extra={"micro_batch_losses": losses})

  @property
  def train_step(self) -> int:
    return self._step

  @property
  def micro_step_count(self) -> int:
    return self._micro

  def export_weights(self) -> Any:
    """The model's parameters as a pure dict of arrays (Tunix donates only the optimizer)."""
    return nnx.to_pure_dict(nnx.state(self.model, nnx.Param))

  def state_digest(self) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(nnx.to_pure_dict(nnx.state(self.model)))):
      h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


def build_tunix_engine(preset: str | ModelPreset, *, mesh: Mapping[str, int] | None, rows: int | None,
                       tokens_per_row: int | None, checkpoint_dir: str | None, micro_batches_per_step: int,
                       sampled: SampledDistribution | None = None, **options: Any) -> TunixTrainerEngine:
  """The ``tunix_peft`` backend: a stock ``PeftTrainer`` on one device, without checkpoints.

  Raises:
    ValueError: settings the stock trainer cannot honour (a mesh of several
      devices, checkpoints, MoE re-runs, a non-default in-flight bound).
  """
  devices = 1
  for size in (mesh or {}).values():
    devices *= int(size)
  if devices != 1:
    raise ValueError(f"engine.backend=tunix_peft runs on one device; the mesh asks for {devices}")
  if checkpoint_dir:
    raise ValueError("engine.backend=tunix_peft does not write checkpoints; drop the checkpoint settings")
  unsupported = {k: v for k, v in options.items()
                 if k in ("ragged_buffer_factor", "retry_when_tokens_dropped", "skip_nonfinite_updates",
                          "max_inflight", "lr_schedule", "warmup_steps", "decay_steps", "loss_aggregation",
                          "kl_beta", "kl_estimator", "remat", "attention", "logprob_chunk_tokens")
                 and v != getattr(EngineOptions(), k)}
  if unsupported:
    raise ValueError(f"engine.backend=tunix_peft cannot honour {unsupported}; leave them at their defaults")
  kept = {k: options[k] for k in ("learning_rate", "weight_decay", "max_grad_norm", "clip_eps_low",
                                  "clip_eps_high", "seed", "dtype") if k in options}
  return TunixTrainerEngine(preset, micro_batches_per_step=micro_batches_per_step, rows=rows,
                            tokens_per_row=tokens_per_row, sampled=sampled, **kept)


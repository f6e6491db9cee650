"""What the engine records of the step in progress, and the finished step its metrics are read from.

The step's per-micro-batch losses, dropped tokens and dropless re-runs stay on
the devices until ``FinishedStep.host_metrics`` reads them (``get_metrics``):
recording them never blocks the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from orchestrator.contract import StepMetrics
from orchestrator.engine.optimizer import LearningRates


@dataclasses.dataclass(frozen=True, eq=False)
class PendingOverflowCheck:
  """The last micro-batch whose overflow flag the host has not read yet, with its own inputs (a re-run's)."""

  micro_step: int
  overflow: jax.Array
  batch: Mapping[str, jax.Array]


@dataclasses.dataclass(frozen=True, eq=False)
class FinishedStep:
  """An applied (or skipped) update and its step's micro-batches, as device values.

  Attributes:
    step: the update's number (1 for the first).
    device: the update's metrics (``loss``, ``grad_norm``, ``tokens``).
    micro_batches: micro-batches accumulated into it.
    micro_losses: (loss sum, token stats: ``loss.TOKEN_STATS``) per micro-batch. micro_dropped: dropped tokens
      per micro-batch.
    reruns: the micro-batches re-run dropless. skipped: the update was skipped (a non-finite gradient).
  """

  step: int
  device: dict[str, Any]
  micro_batches: int
  micro_losses: list
  micro_dropped: list
  reruns: list
  skipped: bool

  def host_metrics(self, skipped_updates_total: int, learning_rates: LearningRates, *, kl: bool = False
                   ) -> StepMetrics:
    """The step's metrics read to the host (blocks on its update), with the learning rate its update used
    (``learning_rates``, at the updates the optimizer applied before it: a skipped one does not count) and,
    where the loss has a KL term (``kl``), the mean KL to the reference."""
    device, micro, dropped = jax.device_get((self.device, self.micro_losses, self.micro_dropped))
    applied_before = self.step - 1 - (skipped_updates_total - int(bool(self.skipped)))  # step: count after it
    tokens, entropy, clipped, kl_sum, drift, with_old = np.sum(
        [np.asarray(stats, np.float64) for _, stats in micro], axis=0)
    return StepMetrics(
        step=self.step, loss=float(device["loss"]), grad_norm=float(device["grad_norm"]),
        tokens=int(device["tokens"]), micro_batches=self.micro_batches,
        micro_batch_loss_sums=[float(t) for t, _ in micro],
        micro_batch_tokens=[int(stats[0]) for _, stats in micro],
        dropped_tokens=[int(d) for d in dropped],
        reruns=len(self.reruns), rerun_micro_batches=list(self.reruns),
        skipped_update=self.skipped, skipped_updates_total=skipped_updates_total,
        learning_rate=learning_rates.at(applied_before),
        entropy=entropy / tokens if tokens else None, clip_fraction=clipped / tokens if tokens else None,
        kl=kl_sum / tokens if kl and tokens else None, ppo_kl=drift / with_old if with_old else None,
    )


@dataclasses.dataclass
class StepInProgress:
  """What belongs to the step in progress; ``reset()`` starts the next one."""

  micro: int = 0
  micro_losses: list = dataclasses.field(default_factory=list)  # (loss sum, token stats) per micro-batch
  micro_dropped: list = dataclasses.field(default_factory=list)
  reruns: list = dataclasses.field(default_factory=list)  # micro-batch indices re-run dropless
  pending_check: PendingOverflowCheck | None = None

  def record(self, micro_step: int, total: jax.Array, stats: jax.Array, dropped: jax.Array) -> None:
    """Micro-batch ``micro_step``'s loss sum, token stats (``loss.TOKEN_STATS``) and dropped tokens; a re-run's
    replace the discarded run's (which was masked to 0)."""
    if micro_step == len(self.micro_losses):
      self.micro_losses.append((total, stats))
      self.micro_dropped.append(dropped)
    else:
      self.micro_losses[micro_step] = (total, stats)

  def take_pending_check(self) -> PendingOverflowCheck | None:
    check, self.pending_check = self.pending_check, None
    return check

  def finish(self, step: int, device_metrics: dict[str, Any], *, skipped: bool) -> FinishedStep:
    """The step as ``step``'s finished update (``reset()`` then starts the next one)."""
    return FinishedStep(step=step, device=device_metrics, micro_batches=self.micro, micro_losses=self.micro_losses,
                        micro_dropped=self.micro_dropped, reruns=self.reruns, skipped=skipped)

  def reset(self) -> None:
    for field in dataclasses.fields(self):
      setattr(self, field.name, field.default_factory() if callable(field.default_factory) else field.default)

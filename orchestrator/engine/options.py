"""Engine options: everything about the engine that is not the model's shape (no JAX import).

The recipe schema (``orchestrator.config``) takes its engine defaults from here.
"""

from __future__ import annotations

import dataclasses

from orchestrator.engine.presets import ModelPreset


@dataclasses.dataclass(frozen=True)
class EngineOptions:
  """Everything about the engine that is not the model's shape.

  Attributes:
    rows, tokens_per_row: the fixed micro-batch shape; None takes the preset's.
    learning_rate, weight_decay, max_grad_norm: AdamW with global-norm clipping.
    clip_eps_low, clip_eps_high: the ratio clipping range of the loss.
    max_inflight: how many dispatched computations may be queued on the devices.
    seed: weight initialisation seed.
    aot: compile ahead of time (``compile()``, or lazily on the first payload)
      and dispatch the compiled executables; False dispatches through ``jax.jit``.
    checkpoint_dir: where ``save_checkpoint`` writes; None disables checkpoints.
    ragged_buffer_factor: MoE expert capacity factor (see ``moe``); -1 routes
      fully dropless. No effect on a dense model.
    retry_when_tokens_dropped: dropless replay — a micro-batch whose experts
      overflowed is discarded and re-run with a program that drops nothing.
    skip_nonfinite_updates: ``update()`` reads the gradient norm on the host and
      skips the optimizer step when it is not finite.
  """

  rows: int | None = None
  tokens_per_row: int | None = None
  learning_rate: float = 1e-3
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.28
  max_inflight: int = 2
  seed: int = 0
  aot: bool = True
  checkpoint_dir: str | None = None
  ragged_buffer_factor: float = -1.0
  retry_when_tokens_dropped: bool = False
  skip_nonfinite_updates: bool = False

  def validate(self, preset: ModelPreset) -> None:
    """Raises ValueError for option combinations that cannot work, naming the keys."""
    factor = float(self.ragged_buffer_factor)
    if factor != -1.0 and not factor > 0:
      raise ValueError(
          f"ragged_buffer_factor={self.ragged_buffer_factor} is invalid: use -1 (fully"
          " dropless) or a capacity factor > 0"
      )
    if self.retry_when_tokens_dropped and not preset.is_moe:
      raise ValueError(
          f"retry_when_tokens_dropped=True needs an MoE model, but preset {preset.name!r}"
          " is dense; pick an MoE preset (e.g. tiny_moe) or set retry_when_tokens_dropped=False"
      )
    if self.retry_when_tokens_dropped and factor == -1.0:
      raise ValueError(
          "retry_when_tokens_dropped=True with ragged_buffer_factor=-1 (fully dropless) has"
          " nothing to retry; set a capacity factor > 0 or retry_when_tokens_dropped=False"
      )
    if self.max_inflight < 1:
      raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")

  @property
  def capacity_factor(self) -> float | None:
    return None if float(self.ragged_buffer_factor) == -1.0 else float(self.ragged_buffer_factor)

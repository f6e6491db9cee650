"""The optimizer: AdamW with global-norm clipping, on a learning-rate schedule (``engine.lr_schedule``).

One definition for every engine that builds an optax optimizer from ``EngineOptions``:

* ``constant`` (the default): ``learning_rate`` at every update. Without warm-up
  the optimizer is built with the plain number, as it always was, so such a
  run trains bit for bit as before and its checkpoints keep their layout.
* ``linear``: from ``learning_rate`` down to 0 over ``decay_steps`` updates
  (``optax.linear_schedule``), then 0.
* ``cosine``: half a cosine from ``learning_rate`` down to 0 over
  ``decay_steps`` updates (``optax.cosine_decay_schedule``), then 0.

``warmup_steps`` > 0 puts a linear warm-up from 0 to ``learning_rate`` before
any of them (``optax.join_schedules``): update u < W uses ``lr · u / W``, and
update W + v uses the schedule's value at v. "Update u" counts the updates the
optimizer applied before it (optax's count: a skipped update does not count),
so the schedule is part of the optimizer state and a resumed run continues it
exactly. ``LearningRates`` gives the same value on the host, for each
step's record, from one table computed once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optax

from orchestrator.engine.options import LR_SCHEDULES, EngineOptions


def learning_rate_schedule(options: EngineOptions) -> float | optax.Schedule:
  """The learning rate optax is given: the number itself for a constant rate without warm-up, else a schedule
  of the update count (the module docstring defines each)."""
  lr = options.learning_rate
  if options.lr_schedule == "constant" and not options.warmup_steps:
    return lr
  if options.lr_schedule == "constant":
    main = optax.constant_schedule(lr)
  elif options.lr_schedule == "linear":
    main = optax.linear_schedule(lr, 0.0, options.decay_steps)
  elif options.lr_schedule == "cosine":
    main = optax.cosine_decay_schedule(lr, options.decay_steps)
  else:
    raise ValueError(f"engine.lr_schedule={options.lr_schedule!r}: use one of {', '.join(LR_SCHEDULES)}")
  if not options.warmup_steps:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, lr, options.warmup_steps), main],
                              [options.warmup_steps])


def make_optimizer(options: EngineOptions) -> optax.GradientTransformation:
  """AdamW (``weight_decay``) after clipping the gradient's global norm to ``max_grad_norm``, at the schedule's
  learning rate."""
  return optax.chain(optax.clip_by_global_norm(options.max_grad_norm),
                     optax.adamw(learning_rate_schedule(options), weight_decay=options.weight_decay))


class LearningRates:
  """The learning rate of each update, on the host: the schedule evaluated once, for updates 0 … warm-up +
  decay (the rate is constant after that)."""

  def __init__(self, options: EngineOptions):
    schedule: Any = learning_rate_schedule(options)
    if not callable(schedule):
      self._table = np.array([schedule], np.float64)
    else:
      last = options.warmup_steps + (options.decay_steps or 0)
      self._table = np.asarray(schedule(np.arange(last + 1)), np.float64)

  def at(self, update: int) -> float:
    """The rate the update applied after ``update`` others uses."""
    return float(self._table[min(max(update, 0), len(self._table) - 1)])

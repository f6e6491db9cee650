"""TrainerWorker: the orchestrator-facing trainer API over one engine.

In process today; the same surface can sit behind an RPC. Engines are duck-typed:
``fwd_bwd``, ``update``, ``get_metrics`` are required; ``prepare_fwd_bwd_input``
and ``wait_for_device`` are optional and looked up once, at construction.

Misuse is an error, never silently absorbed (``WorkerUsageError``): a second
``stage_fwd_bwd`` with one pending, ``fwd_bwd_staged`` with none,
``apply_deferred_update`` with no update owed, a micro-batch of a new step
while an update is still owed, staging on an engine that cannot.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

STAGING_METHODS = ("prepare_fwd_bwd_input", "wait_for_device")
REQUIRED_METHODS = ("fwd_bwd", "update", "get_metrics")


class WorkerUsageError(RuntimeError):
  """The worker was driven out of order (the message says what and what to call instead)."""


@dataclasses.dataclass(frozen=True)
class WorkerCapabilities:
  """What the engine can do, decided once when the worker is built."""

  can_stage: bool
  missing_staging_methods: tuple[str, ...]
  can_checkpoint: bool


class TrainerWorker:
  """Drives one engine through micro-batches, deferred updates and staged inputs.

  Args:
    engine: any object with ``fwd_bwd(x, apply_optimizer=False)``,
      ``update() -> int`` and ``get_metrics()``; staging also needs
      ``prepare_fwd_bwd_input(payload)`` and ``wait_for_device() -> float``.

  Raises:
    TypeError: the engine lacks a required method.
  """

  def __init__(self, engine: Any):
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(engine, m, None))]
    if missing:
      raise TypeError(
          f"{type(engine).__name__} cannot back a TrainerWorker: it lacks {', '.join(missing)}"
      )
    self.engine = engine
    missing_staging = tuple(m for m in STAGING_METHODS if not callable(getattr(engine, m, None)))
    self.capabilities = WorkerCapabilities(
        can_stage=not missing_staging,
        missing_staging_methods=missing_staging,
        can_checkpoint=callable(getattr(engine, "save_checkpoint", None)),
    )
    self._staged: Any = None
    self._staged_payload_id: int | None = None
    self._update_owed = False
    self.last_stage_s: float | None = None
    self.last_device_wait_s: float | None = None
    self.last_dispatch: Any = None

  # ---------------------------------------------------------------- state
  @property
  def update_owed(self) -> bool:
    """True between ``fwd_bwd(..., defer_update=True)`` and ``apply_deferred_update()``."""
    return self._update_owed

  @property
  def has_staged(self) -> bool:
    return self._staged is not None

  @property
  def staged_input(self) -> Any:
    """The prepared input waiting for ``fwd_bwd_staged`` (None if nothing is staged)."""
    return self._staged

  # ---------------------------------------------------------------- micro-batches
  def fwd_bwd(self, payload: Any, apply_optimizer: bool = False, defer_update: bool = False) -> Any:
    """Runs one micro-batch from its payload.

    With ``apply_optimizer`` and not ``defer_update``: the engine's ``fwd_bwd``
    then ``update()``. With ``defer_update``: the micro-batch runs and an
    update is owed; ``apply_deferred_update()`` must come before the next step's
    first micro-batch. Returns what the engine's ``fwd_bwd`` returned.

    Raises:
      WorkerUsageError: an update is still owed.
    """
    self._check_no_update_owed("fwd_bwd")
    return self._dispatch(payload, apply_optimizer, defer_update)

  def stage_fwd_bwd(self, payload: Any) -> float:
    """Prepares ``payload`` ahead (``engine.prepare_fwd_bwd_input``) and keeps it; returns its seconds.

    Allowed while an update is owed (that is the point of staging before the
    update). Does not dispatch anything.

    Raises:
      WorkerUsageError: the engine cannot stage, or an input is already staged.
    """
    if not self.capabilities.can_stage:
      raise WorkerUsageError(
          f"stage_fwd_bwd: the engine lacks {', '.join(self.capabilities.missing_staging_methods)};"
          " check worker.capabilities.can_stage before staging"
      )
    if self._staged is not None:
      raise WorkerUsageError(
          "stage_fwd_bwd: an input is already staged; dispatch it with fwd_bwd_staged() first"
      )
    start = time.perf_counter()
    self._staged = self.engine.prepare_fwd_bwd_input(payload)
    self.last_stage_s = time.perf_counter() - start
    return self.last_stage_s

  def fwd_bwd_staged(self, apply_optimizer: bool = False, defer_update: bool = False) -> Any:
    """Dispatches the staged input as the next micro-batch (same options as ``fwd_bwd``).

    Raises:
      WorkerUsageError: nothing is staged, or an update is still owed.
    """
    if self._staged is None:
      raise WorkerUsageError("fwd_bwd_staged: nothing is staged; call stage_fwd_bwd(payload) first")
    self._check_no_update_owed("fwd_bwd_staged")
    staged, self._staged = self._staged, None
    return self._dispatch(staged, apply_optimizer, defer_update)

  def apply_deferred_update(self) -> float:
    """Waits for the device (``wait_for_device``), then runs the owed ``update()``.

    Returns:
      The seconds ``wait_for_device`` blocked (also kept as ``last_device_wait_s``).

    Raises:
      WorkerUsageError: no update is owed.
    """
    if not self._update_owed:
      raise WorkerUsageError(
          "apply_deferred_update: no update is owed; defer one with fwd_bwd(..., defer_update=True)"
      )
    waited = self.engine.wait_for_device() if self.capabilities.can_stage else 0.0
    self.last_device_wait_s = waited
    self.engine.update()
    self._update_owed = False
    self.last_dispatch = getattr(self.engine, "last_dispatch", None)
    return waited

  def update(self) -> int:
    """Runs the engine's ``update()`` now, without waiting for the device.

    For a caller that dispatched a step's last micro-batch without
    ``apply_optimizer`` and has host work to do before the update.

    Raises:
      WorkerUsageError: an update is owed (use ``apply_deferred_update``).
    """
    self._check_no_update_owed("update")
    step = self.engine.update()
    self.last_dispatch = getattr(self.engine, "last_dispatch", None)
    return step

  def _dispatch(self, x: Any, apply_optimizer: bool, defer_update: bool) -> Any:
    result = self.engine.fwd_bwd(x, apply_optimizer=apply_optimizer and not defer_update)
    self.last_dispatch = getattr(self.engine, "last_dispatch", result)
    if defer_update:
      self._update_owed = True
    return result

  def _check_no_update_owed(self, call: str) -> None:
    if self._update_owed:
      raise WorkerUsageError(
          f"{call}: the previous step's update is still owed; call apply_deferred_update() first"
      )

  # ---------------------------------------------------------------- passthrough
  def get_metrics(self) -> dict[str, Any]:
    """The engine's metrics of its last update (may block until that update is done)."""
    return self.engine.get_metrics()

  def save_checkpoint(self, metadata: dict | None = None) -> Any:
    """Saves, through the engine, the training state as of the last applied update.

    Allowed while the next step's update is owed: a pipelined boundary
    checkpoints step k after step k+1's first micro-batch was dispatched.
    """
    return self.engine.save_checkpoint(metadata)

  def restore_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
    self._check_no_update_owed("restore_checkpoint")
    return self.engine.restore_checkpoint(*args, **kwargs)

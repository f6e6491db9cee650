"""The trainer side of the rig over a remote trainer: one snapshot, recorded calls per arm.

The rig (``orchestrator.rig``) needs what only the trainer's host can give: a
return to the same starting state before every arm, the engine calls each arm
made (with content digests of what they were given) and the compiles it
caused. ``RigHost`` wraps the served engine in the rig's own
``CallRecordingEngine`` for the length of an arm. The server is handed
``RigHost`` by whoever starts it (``run_rl serve-trainer``), so nothing in
``orchestrator.remote`` imports the rig.
"""

from __future__ import annotations

from typing import Any

from orchestrator.contract import WorkerUsageError
from orchestrator.engine.diagnostics import backend_compile_count
from orchestrator.rig.arms import FAULTS
from orchestrator.rig.recording_engine import CallRecordingEngine, require_snapshots
from orchestrator.rig.replay import payload_digest


class RigHost:
  """Per-arm engine instrumentation on the trainer's host (used by ``TrainerService``'s ``rig_*`` calls)."""

  def __init__(self, engine: Any):
    self._engine = engine
    self._snapshot = None
    self._proxy = None
    self._compiles_at_start = 0

  def info(self) -> dict:
    e = self._engine
    return {"rows": e.rows, "tokens_per_row": e.tokens_per_row, "vocab_size": e.preset.vocab_size,
            "rerun_dropped": bool(getattr(e, "rerun_dropped", False))}

  def _payload_digest(self, payload) -> str:
    e = self._engine
    return payload_digest(payload, rows=e.rows, tokens_per_row=e.tokens_per_row, vocab_size=e.preset.vocab_size,
                          routing=e.options.routing_shape(e.preset) if hasattr(e, "options") else None)

  def begin_arm(self, fault: str | None):
    """Restores the first arm's starting state and returns the recording proxy to drive.

    Raises:
      RigError (a ``ValueError``): the engine cannot snapshot and restore its state, or ``fault`` is none of
        ``FAULTS``.
      WorkerUsageError: micro-batches are accumulated (an arm starts at a step boundary).
    """
    require_snapshots(self._engine)
    if fault is not None and fault not in FAULTS:
      raise ValueError(f"rig fault {fault!r} is none of {', '.join(FAULTS)}")
    self._engine.wait_for_device()
    if self._snapshot is None:
      try:
        self._snapshot = self._engine.snapshot()
      except RuntimeError as e:  # micro-batches accumulated: misuse, not a failed trainer
        raise WorkerUsageError(f"rig_begin_arm: {e}") from None
    else:
      self._engine.restore(self._snapshot)
    self._proxy = CallRecordingEngine(self._engine, {}, fault, digest_of=self._payload_digest)
    self._compiles_at_start = backend_compile_count()
    return self._proxy

  def end_arm(self) -> tuple[list[list], int]:
    """The arm's engine calls (kind, content digest) and the compiles it caused; the proxy is dropped."""
    if self._proxy is None:
      raise WorkerUsageError("rig_end_arm without rig_begin_arm; begin an arm first")
    self._engine.wait_for_device()
    events = [list(event) for event in self._proxy.digest_events()]
    self._proxy = None
    return events, backend_compile_count() - self._compiles_at_start

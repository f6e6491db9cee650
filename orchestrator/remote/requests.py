"""What each ``Invoke`` method's request must hold, checked whole before a trainer server acts on it.

``REQUEST_CHECKS`` names every method the server knows; a check raises ``wire.WireError`` (a ``ValueError``)
or ``TypeError`` for a request it refuses, and reads nothing but the request.
"""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.remote import wire

MAX_WAIT_READY_S = 24 * 3600.0  # a completion wait longer than this is a mistake (trainer.timeout_s is 120 s)


def _no_fields(header, arrays) -> None:
  """The method reads nothing from its request."""


def _dispatch_fields(header, arrays) -> None:
  wire.read_flag(header, "apply_optimizer")
  wire.read_flag(header, "defer_update")


def _payload_fields(header, arrays) -> None:
  wire.decode_payload(header, arrays)
  _dispatch_fields(header, arrays)


def _wait_ready_fields(header, arrays) -> None:
  wire.read_int(header, "id", required=True)
  wire.read_seconds(header, "timeout_s", default_s=60.0, maximum_s=MAX_WAIT_READY_S)


def _save_checkpoint_fields(header, arrays) -> None:
  metadata = header.get("metadata", {})
  if not isinstance(metadata, dict):
    raise wire.WireError(f"save_checkpoint: metadata must be a JSON object, not {type(metadata).__name__}")


def _restore_checkpoint_fields(header, arrays) -> None:
  step = header.get("step")
  if step is not None and (type(step) is not int or step < 0):  # type(): a JSON true is no step
    raise wire.WireError(f"restore_checkpoint: step {step!r:.80} is not a checkpoint step; give a non-negative"
                         " integer (or leave it out for the latest)")


#: What each Invoke method's request must hold; a method not listed is UNIMPLEMENTED.
REQUEST_CHECKS: dict[str, Callable[[dict, dict], None]] = {
    "fwd_bwd": _payload_fields,
    "stage": lambda header, arrays: wire.decode_payload(header, arrays),
    "fwd_bwd_staged": _dispatch_fields,
    "apply_deferred_update": lambda header, arrays: wire.read_flag(header, "then_dispatch_staged"),
    "update": _no_fields,
    "wait_for_device": _no_fields,
    "device_memory": _no_fields,
    "get_metrics": _no_fields,
    "export_weights": _no_fields,
    "echo": _no_fields,
    "state_digest": _no_fields,
    "save_checkpoint": _save_checkpoint_fields,
    "restore_checkpoint": _restore_checkpoint_fields,
    "rig_begin_arm": lambda header, arrays: wire.read_text(header, "fault"),
    "rig_end_arm": _no_fields,
    "wait_ready": _wait_ready_fields,
    "bye": _no_fields,
}

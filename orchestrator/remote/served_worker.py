"""The worker a trainer server drives for its driver, and the ``Invoke`` methods that call it.

``ServedWorker`` owns one ``TrainerWorker`` over an engine from ``make_engine``
(a fresh one for each new driver: ``renew``) and answers each worker method
with its reply's bytes. Receipts carry server-clock times and a completion id;
the server's own watcher stamps when each computation finished, where it ran
(``wait_ready``). Misuse of the worker comes back as ``FAILED_PRECONDITION``
("WorkerUsageError: ..."), a checkpoint it does not hold as ``NOT_FOUND``, a bad
value as ``INVALID_ARGUMENT`` and any other failure as one ``INTERNAL`` line
(``refusals``); a refused call changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import jax

from orchestrator.contract import NoCheckpointError, WorkerCapabilities, WorkerUsageError
from orchestrator.contract.worker import Call, next_call_state
from orchestrator.loop.trainer_worker import TrainerWorker
from orchestrator.loop.watcher import CompletionWatcher
from orchestrator.remote import wire
from orchestrator.remote.refusals import Refused, failure, invalid, one_line
from orchestrator.remote.requests import MAX_WAIT_READY_S


def _receipt_json(receipt, ids: Callable[[Any, str, int, int], int | None]) -> dict | None:
  if receipt is None:
    return None
  return {"kind": receipt.kind, "step": receipt.step, "micro_step": receipt.micro_step,
          "id": ids(receipt.ready, receipt.kind, receipt.step, receipt.micro_step),
          "dispatched_at": receipt.dispatched_at, "mapping_s": receipt.mapping_s,
          "placement_s": receipt.placement_s, "host_wait_s": receipt.host_wait_s,
          "update": _receipt_json(receipt.update, ids)}


def _stage_json(stage) -> dict:
  """What a stage reply carries: its seconds and digest, and (since they were added; a driver that does not know
  them ignores them) what the staged input holds per device and the devices' memory after the stage."""
  held, memory = stage.staged_bytes_per_device, stage.memory
  return {"stage_s": stage.stage_s, "input_digest": stage.input_digest,
          "staged_bytes_per_device": None if held is None else list(held),
          "staged_bytes_by_field": stage.staged_bytes_by_field,
          "memory": None if memory is None else memory.to_json()}


def _number(value: Any) -> Any:
  """A metric as JSON: numbers keep their kind (an int stays an int), anything else becomes its text."""
  if hasattr(value, "item") and getattr(value, "size", 1) == 1:
    value = value.item()
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, (list, tuple)):  # per-micro-batch metrics stay lists, not their text
    return [_number(v) for v in value]
  try:
    return float(value)
  except (TypeError, ValueError):
    return str(value)


class ServedWorker:
  """The served worker; see the module docstring. The server calls it under its worker lock, but for
  ``wait_ready``, which reads only the watcher.

  Args:
    make_engine: builds a fresh engine (called now and on ``renew``).
    make_rig_host: builds the rig's instrumentation over each new engine (``orchestrator.rig.remote_host.RigHost``,
      handed in so that this package never imports the rig); None: the ``rig_*`` calls are refused.
  """

  def __init__(self, make_engine: Callable[[], Any], make_rig_host: Callable[[Any], Any] | None = None):
    self._make_engine = make_engine
    self._make_rig_host = make_rig_host
    self.renew()
    self._watcher = CompletionWatcher()
    self._next_id = 0

  def renew(self) -> None:
    """A fresh engine and worker: nothing of the last driver's state (or partial step) is kept."""
    self._engine = self._make_engine()
    self._worker = TrainerWorker(self._engine)
    self._rig = self._make_rig_host(self._engine) if self._make_rig_host else None
    # Micro-batches run since the last update (None: unknown, after a rig arm); the engine refuses update()
    # with none as a RuntimeError, which is checked here first so that the driver hears misuse, not a failure.
    self._micro_batches_since_update: int | None = 0

  @property
  def capabilities(self) -> WorkerCapabilities:
    return self._worker.capabilities

  @property
  def holds_partial_step(self) -> bool:
    """An update is owed or an input staged: what a driver that leaves now takes with it."""
    return self._worker.update_owed or self._worker.has_staged

  def call(self, method: str, header: dict, arrays: dict) -> bytes:
    """``_do_<method>`` (a method ``requests.REQUEST_CHECKS`` passed); misuse and bad values come back as what
    they are.

    Raises:
      Refused: the call's status and line.
    """
    try:
      reply = getattr(self, f"_do_{method}")(header, arrays)
    except WorkerUsageError as e:
      raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"WorkerUsageError: {e}") from None
    except NoCheckpointError as e:  # the trainer is fine; it lacks what was asked for
      raise Refused(grpc.StatusCode.NOT_FOUND, f"NoCheckpointError: {e}") from None
    except ValueError as e:
      raise invalid(e) from None
    except Exception as e:  # logged under the worker method's name; the guard sends the line
      raise failure(method, e) from None
    if method == "restore_checkpoint":  # the engine's accumulation starts over at the restored step
      self._micro_batches_since_update = 0
    return reply

  def _rig_host(self):
    """The rig's host this trainer was served with; WorkerUsageError when it has none."""
    if self._rig is None:
      raise WorkerUsageError("this trainer was started without the rig's host; serve it with run_rl serve-trainer")
    return self._rig

  def _watch(self, ready, kind: str, step: int, micro_step: int) -> int:
    self._next_id += 1
    self._watcher.watch(self._next_id, ready, kind=kind, step=step, micro_step=micro_step,
                        dispatched_at=time.perf_counter())
    return self._next_id

  def wait_ready(self, header) -> bytes:
    """When computation ``id`` finished, on the server's clock (it may wait up to ``timeout_s``)."""
    computation = wire.read_int(header, "id", required=True)
    timeout_s = wire.read_seconds(header, "timeout_s", default_s=60.0, maximum_s=MAX_WAIT_READY_S)
    try:
      ready_at = self._watcher.ready_at(computation, timeout_s=timeout_s)
    except KeyError:
      raise Refused(grpc.StatusCode.NOT_FOUND, f"no computation {computation} on this trainer") from None
    except TimeoutError as e:
      raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, str(e)) from None
    item = self._watcher.get(computation)
    if item is not None and item.error is not None:
      raise Refused(grpc.StatusCode.INTERNAL, f"the computation failed: {one_line(item.error)}")
    return wire.encode({"ready_at": ready_at})

  def _receipt(self, receipt) -> bytes:
    return wire.encode({"receipt": _receipt_json(receipt, self._watch)})

  def _counted(self, receipt):
    """``receipt`` of a micro-batch, counted towards the next update (reset when it applied one)."""
    if receipt.update is not None:
      self._micro_batches_since_update = 0
    elif self._micro_batches_since_update is not None:
      self._micro_batches_since_update += 1
    return receipt

  def _do_fwd_bwd(self, header, arrays) -> bytes:
    payload = wire.decode_payload(header, arrays)
    return self._receipt(self._counted(self._worker.fwd_bwd(
        payload, apply_optimizer=wire.read_flag(header, "apply_optimizer"),
        defer_update=wire.read_flag(header, "defer_update"))))

  def _do_stage(self, header, arrays) -> bytes:
    return wire.encode(_stage_json(self._worker.stage_fwd_bwd(wire.decode_payload(header, arrays))))

  def _do_fwd_bwd_staged(self, header, arrays) -> bytes:
    return self._receipt(self._counted(self._worker.fwd_bwd_staged(
        apply_optimizer=wire.read_flag(header, "apply_optimizer"),
        defer_update=wire.read_flag(header, "defer_update"))))

  def _do_apply_deferred_update(self, header, arrays) -> bytes:
    """The owed update; with ``then_dispatch_staged``, the staged input right after it (one round trip).

    Both halves are checked before the update runs: a request whose second half would be refused changes nothing.
    """
    then_dispatch_staged = wire.read_flag(header, "then_dispatch_staged")
    if then_dispatch_staged:
      next_call_state(self._worker.call_state, Call.APPLY_DEFERRED_UPDATE_THEN_STAGED)
    start = time.perf_counter()
    applied = self._worker.apply_deferred_update()
    call_s = time.perf_counter() - start
    self._micro_batches_since_update = 0
    staged = self._counted(self._worker.fwd_bwd_staged()) if then_dispatch_staged else None
    return wire.encode({"device_wait_s": applied.device_wait_s, "call_s": call_s,
                        "receipt": _receipt_json(applied.update, self._watch),
                        "staged_receipt": _receipt_json(staged, self._watch)})

  def _do_update(self, header, arrays) -> bytes:
    if self._micro_batches_since_update == 0 and not self._worker.update_owed:
      raise WorkerUsageError("update: no micro-batch ran since the last update, so there is nothing to apply;"
                             " run fwd_bwd at least once per step")
    receipt = self._worker.update()
    self._micro_batches_since_update = 0
    return self._receipt(receipt)

  def _do_wait_for_device(self, header, arrays) -> bytes:
    return wire.encode({"waited_s": self._worker.wait_for_device()})

  def _do_device_memory(self, header, arrays) -> bytes:
    memory = self._worker.device_memory()
    return wire.encode({"memory": None if memory is None else memory.to_json()})

  def _do_get_metrics(self, header, arrays) -> bytes:
    return wire.encode({"metrics": {k: _number(v) for k, v in self._worker.get_metrics().to_json().items()}})

  def _do_export_weights(self, header, arrays) -> bytes:
    weights = self._worker.export_weights()
    if weights is None:
      return wire.encode({"none": True})
    return wire.encode_tree(jax.device_get(weights))

  def _do_echo(self, header, arrays) -> bytes:
    """Receives a message and answers its size: the wire's own cost, for benchmarks."""
    return wire.encode({"bytes": sum(a.nbytes for a in arrays.values())})

  def _do_rig_begin_arm(self, header, arrays) -> bytes:
    """The rig: back to the state the first arm started from, with the engine's calls recorded."""
    self._worker = TrainerWorker(self._rig_host().begin_arm(wire.read_text(header, "fault")))
    self._micro_batches_since_update = 0  # an arm starts from a snapshot taken at a step boundary
    return wire.encode(self._rig.info())

  def _do_rig_end_arm(self, header, arrays) -> bytes:
    """The rig: the arm's engine calls (kind, content digest) and the compiles it caused."""
    events, compiles = self._rig_host().end_arm()
    self._worker = TrainerWorker(self._engine)
    self._micro_batches_since_update = None
    return wire.encode({"events": events, "compiles": compiles})

  def _do_state_digest(self, header, arrays) -> bytes:
    return wire.encode({"digest": self._worker.state_digest()})

  def _do_save_checkpoint(self, header, arrays) -> bytes:
    """Saves the trainer's state with the driver's ``metadata``, which must be a JSON object (absent: empty)."""
    metadata = header.get("metadata", {})
    if not isinstance(metadata, dict):
      raise ValueError(f"save_checkpoint: metadata must be a JSON object, not {type(metadata).__name__}")
    return wire.encode({"path": str(self._worker.save_checkpoint(metadata))})

  def _do_restore_checkpoint(self, header, arrays) -> bytes:
    """Restores checkpoint ``step`` (absent or null: the latest), a non-negative integer, checked before any read.

    The step is the driver's; it names a checkpoint by number, never a path (the
    engine's checkpointer also refuses one whose directory leads outside its own).
    """
    step = header.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
      raise ValueError(f"restore_checkpoint: step {step!r} is not a checkpoint step; give a non-negative integer"
                       " (or leave it out for the latest)")
    return wire.encode({"metadata": self._worker.restore_checkpoint(step)})

"""The contract between the RL program and a training engine: Protocols and typed receipts.

This module is the one place the engine contract is written (``docs/design.md``
§4 explains it). It imports nothing from JAX or from ``orchestrator.engine``:
the program, the recorder and the remote worker depend on it alone.

Capabilities are layered. ``TrainingEngine`` is what every engine must have;
``StagingEngine`` adds what staging needs; ``CheckpointingEngine``,
``WeightSource`` (with ``StateDigestingEngine``, its digest) and
``MemoryReportingEngine`` are optional extras the worker looks up once. All are
runtime-checkable, so ``isinstance(engine, StagingEngine)`` answers whether an
engine can stage (a method set to ``None`` counts as missing).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Receipt:
  """What one dispatched device computation hands back to its caller.

  Attributes:
    kind: ``"fwd_bwd"``, ``"fwd_bwd_dropless"`` or ``"update"``.
    step: the optimizer step the computation belongs to (for an update, the
      step it closes: after it, ``step + 1`` updates are applied).
    micro_step: index of the micro-batch within its step; -1 for an update.
    ready: a completion handle — anything with ``block_until_ready()`` that
      returns once the computation is done (a ``jax.Array``); None when the
      engine cannot say (then the computation counts as done on return).
    dispatched_at: ``time.perf_counter()`` when it was handed to the devices.
    mapping_s: host seconds spent turning the payload into model inputs inside
      this call (0 for a prepared input); None when the engine does not say.
    placement_s: host seconds spent issuing the copies onto the devices.
    host_wait_s: host seconds the call blocked on device work (an in-flight
      limit, a flag read under dropless re-runs, a non-finite check).
    update: the receipt of the update the same call ran (a worker's
      ``fwd_bwd(..., apply_optimizer=True)``); None otherwise.
  """

  kind: str
  step: int
  micro_step: int
  ready: Any
  dispatched_at: float
  mapping_s: float | None = None
  placement_s: float | None = None
  host_wait_s: float | None = None
  update: "Receipt | None" = None

  @property
  def host_seconds_known(self) -> bool:
    """Whether the engine reported how the call's host time splits."""
    return self.mapping_s is not None and self.host_wait_s is not None

  @classmethod
  def coerce(cls, result: Any, *, kind: str, step: int, micro_step: int) -> "Receipt":
    """A receipt for whatever a duck-typed engine returned.

    A ``Receipt`` passes through. Anything else (a ``jax.Array``, an int step
    count, None) becomes a receipt whose handle is the result itself when it
    can be waited on, stamped now, with its host seconds unknown — so an
    engine that returns no receipt gets no made-up timings.
    """
    if isinstance(result, Receipt):
      return result
    ready = result if callable(getattr(result, "block_until_ready", None)) else None
    return cls(kind=kind, step=step, micro_step=micro_step, ready=ready, dispatched_at=time.perf_counter())


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepMetrics:
  """One applied update's metrics, read to the host. Every field is None where the engine does not say.

  Attributes:
    step: updates applied before this one.
    loss: the step's mean loss per token.
    grad_norm: the global norm of the accumulated gradient.
    tokens: tokens that carried loss in the step.
    micro_batches: micro-batches accumulated into the update.
    micro_batch_loss_sums, micro_batch_tokens: per micro-batch, the loss sum and its token count.
    dropped_tokens: per micro-batch, tokens an MoE layer dropped in the kept computation (0 under replay).
    reruns: how many micro-batches were re-run dropless; rerun_micro_batches: which.
    skipped_update: the update was skipped (a non-finite gradient under the skip guard);
      skipped_updates_total: skipped so far in the run.
    learning_rate: the learning rate the update used (its schedule's value at the updates applied before it).
    entropy: the policy's mean entropy over the step's completion tokens (nats, of the distribution sampled
      from). clip_fraction: the share of those tokens whose ratio the clip bound. kl: their mean KL to the
      reference model (``engine.kl_beta`` > 0; None without one).
    device_peak_bytes: the most memory the fullest device of this process has held so far (the allocator's
      peak; None where the backend reports none, as a CPU's).
    compiles: programs this process compiled (or loaded from the persistent cache) since the last metrics.
    model_flops: the step's model FLOPs (``orchestrator.engine.flops``); peak_flops_per_s: the devices' summed
      peak (None where unknown), so MFU = model_flops / (step seconds · peak_flops_per_s).
    ppo_kl: the mean, over the completion tokens that carry the sampler's log-prob, of the sampler's log-prob
      minus the trainer's (verl's ``ppo_kl``, an estimate of KL(sampler ‖ trainer)): 0 on the sampler's own
      weights; it grows with staleness and with any mismatch between the two (None: no such token).
    extra: anything else the engine reports, by name (JSON-able values).
  """

  step: int | None = None
  loss: float | None = None
  grad_norm: float | None = None
  tokens: int | None = None
  micro_batches: int | None = None
  micro_batch_loss_sums: list[float] | None = None
  micro_batch_tokens: list[int] | None = None
  dropped_tokens: list[int] | None = None
  reruns: int | None = None
  rerun_micro_batches: list[int] | None = None
  skipped_update: bool | None = None
  skipped_updates_total: int | None = None
  learning_rate: float | None = None
  entropy: float | None = None
  clip_fraction: float | None = None
  kl: float | None = None
  device_peak_bytes: int | None = None
  compiles: int | None = None
  model_flops: float | None = None
  peak_flops_per_s: float | None = None
  ppo_kl: float | None = None
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def coerce(cls, metrics: "StepMetrics | Mapping[str, Any] | None") -> "StepMetrics":
    """A ``StepMetrics`` for what an engine returned: one passes through; a mapping's known keys become
    fields and the rest ``extra``; None or an empty mapping (no update yet) gives every field None."""
    if isinstance(metrics, StepMetrics):
      return metrics
    values = dict(metrics or {})
    known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
    return cls(**{k: values.pop(k) for k in list(values) if k in known}, extra=values)

  def to_json(self) -> dict[str, Any]:
    """The metrics as one flat JSON-able dict (``extra`` beside the fields; what the wire carries)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
    return dict(out, **self.extra)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceMemory:
  """The devices' memory as the backend's allocator reports it, one entry per device.

  The devices are this process's devices of the engine's mesh, in device-id order; every tuple
  has one entry per device in that order.

  Attributes:
    bytes_in_use: bytes allocated on each device now.
    bytes_limit: bytes each device's allocator may hand out in all.
    input_bytes: bytes one micro-batch's input holds on each device once placed (from its shapes, dtypes
      and shardings): what a stage adds.
  """

  bytes_in_use: tuple[int, ...]
  bytes_limit: tuple[int, ...]
  input_bytes: tuple[int, ...]

  @property
  def free_bytes(self) -> int:
    """The least free memory of any device (limit less in use)."""
    return min(limit - used for limit, used in zip(self.bytes_limit, self.bytes_in_use))

  def to_json(self) -> dict[str, list[int]]:
    return {name: list(getattr(self, name)) for name in ("bytes_in_use", "bytes_limit", "input_bytes")}

  @classmethod
  def from_json(cls, data: Mapping[str, Any] | None) -> "DeviceMemory | None":
    """``to_json``'s output back (None stays None).

    Raises:
      ValueError: a field is missing, not a list of whole numbers >= 0, or the lists differ in length.
    """
    if data is None:
      return None
    try:
      fields = {name: tuple(data[name]) for name in ("bytes_in_use", "bytes_limit", "input_bytes")}
    except (KeyError, TypeError) as e:
      raise ValueError(f"device memory {data!r:.200} lacks {e}; give bytes_in_use, bytes_limit and input_bytes"
                       " as lists of whole numbers") from None
    bad = [name for name, values in fields.items() if not values or any(type(v) is not int or v < 0 for v in values)]
    if bad or len({len(v) for v in fields.values()}) != 1:
      raise ValueError(f"device memory {data!r:.200}: {', '.join(bad) or 'the lists'} must be non-empty lists of"
                       " whole numbers >= 0, one per device")
    return cls(**fields)


@runtime_checkable
class PreparedInput(Protocol):
  """A micro-batch mapped to model inputs and placed on the devices, not yet dispatched.

  It may also say what it holds on the devices: ``bytes_per_device``, a tuple of bytes per device in
  device-id order (this process's devices), and ``bytes_by_field``, each input field's bytes over those
  devices (they sum to the same total); the worker records both with each stage (None where absent).
  """

  @property
  def digest(self) -> str:
    """A content digest of the inputs: the same payload gives the same digest."""
    ...


@runtime_checkable
class TrainingEngine(Protocol):
  """What every engine must do: accumulate micro-batches and apply one update per step.

  One caller drives an engine; it need not be thread-safe.
  """

  def fwd_bwd(self, payload_or_prepared: Any, apply_optimizer: bool = False) -> Receipt:
    """Runs forward and backward on one micro-batch and adds its gradients to the step.

    Must dispatch and return without waiting for the result (it may wait only
    to keep its own bounded number of computations in flight). With
    ``apply_optimizer``, also runs ``update()``. A bad payload raises
    ``ValueError`` and leaves the engine's state unchanged.

    Returns:
      The micro-batch's ``Receipt`` (an engine may return something else; the
      worker then coerces it and reports its host seconds as unknown).
    """
    ...

  def update(self) -> Receipt:
    """Applies the step's accumulated gradients and starts a new step.

    Must not wait for the update to finish on the devices. Must not donate or
    otherwise reuse the previous step's parameter buffers: the program reads
    step k's weights (metrics, checkpoint, weight sync) after step k+1's first
    micro-batch was dispatched.

    Returns:
      The update's ``Receipt``.
    """
    ...

  def get_metrics(self) -> StepMetrics:
    """The last applied update's metrics, read to the host (may block on that update).

    Returns a ``StepMetrics`` (every field None before the first update). An
    engine may return a mapping with the same keys instead; the worker coerces
    it (``StepMetrics.coerce``).
    """
    ...


@runtime_checkable
class StagingEngine(TrainingEngine, Protocol):
  """A ``TrainingEngine`` that can prepare its next input ahead and report device waits."""

  def prepare_fwd_bwd_input(self, payload: Any) -> PreparedInput:
    """Runs exactly the input mapping ``fwd_bwd`` would run, then starts the copy to the devices.

    Must return without waiting for the copy or for queued computations, and
    must change no step state (step, micro-batch count, weights, in-flight
    queue, a pending dropped-token check): it is called between a step's last
    ``fwd_bwd`` and its ``update()``. ``fwd_bwd(prepared)`` must then train
    bit for bit as ``fwd_bwd(payload)`` would, with no new trace or compile.
    The prepared input must not expose host buffers whose writes would change
    what trains.
    """
    ...

  def wait_for_device(self) -> float:
    """Blocks until every queued computation is done; returns the seconds it blocked.

    Dequeues nothing and writes no metrics. An error of the queued work is
    raised here. With nothing queued it returns the runtime's wait floor.
    """
    ...


@runtime_checkable
class CheckpointingEngine(Protocol):
  """An engine that can save and restore its training state."""

  def save_checkpoint(self, metadata: Mapping[str, Any] | None = None) -> str:
    """Writes the state as of the last ``update()`` (not micro-batches accumulated since).

    Must return only once the checkpoint is complete, with its path. A save
    that did not happen is an error, never a silent skip.
    """
    ...

  def restore_checkpoint(self, step: int | None = None) -> Mapping[str, Any]:
    """Loads the latest (or ``step``'s) checkpoint; drops accumulated micro-batches.

    Returns the checkpoint's metadata.
    """
    ...


@runtime_checkable
class StateDigestingEngine(Protocol):
  """An engine that can fingerprint its training state (a run's ``final_state_digest``; the rig's arms)."""

  def state_digest(self) -> str:
    """A hash of weights and optimizer state: equal digests mean bit-identical training."""
    ...


@runtime_checkable
class WeightSource(StateDigestingEngine, Protocol):
  """An engine whose weights can be exported (the weight sync) and fingerprinted (``state_digest``)."""

  def export_weights(self) -> Any:
    """The current weights as a pytree of device arrays, valid after the next dispatch.

    Must not copy to the host (the caller decides where the weights go) and
    must hand out buffers the engine never donates.
    """
    ...


@runtime_checkable
class MemoryReportingEngine(Protocol):
  """An engine that can say how full its devices are (the stage's memory gate and records read it)."""

  def device_memory(self) -> DeviceMemory | None:
    """The devices' memory now; None where the backend does not report it (CPU).

    Must not wait for the devices or change any state: it is read when a
    boundary is planned and right after each stage.
    """
    ...


@runtime_checkable
class SnapshotEngine(Protocol):
  """An engine whose whole training state can be copied on the devices and put back (the rig's arms).

  The rig snapshots once and restores before every arm, so each arm starts from
  the same state without a checkpoint on disk.
  """

  def snapshot(self) -> Any:
    """An on-device copy of weights, optimizer state and step, taken between steps.

    Must not be called with micro-batches accumulated (raises ``RuntimeError``);
    the copy must not alias buffers that later training donates or overwrites.
    """
    ...

  def restore(self, snapshot: Any) -> None:
    """Puts back a ``snapshot()``: the engine then trains bit for bit as it did from that point."""
    ...


def missing_methods(engine: Any, protocol: type) -> tuple[str, ...]:
  """The methods and properties of ``protocol`` that ``engine`` lacks (or has set to None), in the protocol's
  order.

  A method is present when it is callable and defined, not only forwarded: the lookup is static
  (``inspect.getattr_static``), as ``isinstance`` against a runtime-checkable Protocol does from Python
  3.12, so a proxy that forwards through ``__getattr__`` is judged the same on every Python version —
  by the methods it really has. A property is present when it is defined. Capability checks use this,
  never ``isinstance``, and a refusal names what it returns.
  """
  def present(name: str, is_method: bool) -> bool:
    defined = inspect.getattr_static(engine, name, None)
    return defined is not None and (not is_method or callable(getattr(engine, name, None)))

  return tuple(name for name, is_method in _protocol_members(protocol) if not present(name, is_method))


def _protocol_members(protocol: type) -> list[tuple[str, bool]]:
  """The public methods and properties ``protocol`` declares (with its bases), as (name, is a method)."""
  out: dict[str, bool] = {}
  for klass in reversed(protocol.__mro__):
    if klass in (object, Protocol) or not getattr(klass, "_is_protocol", False):
      continue
    for name, value in vars(klass).items():
      if not name.startswith("_") and name not in out and (callable(value) or isinstance(value, property)):
        out[name] = callable(value)
  return list(out.items())


def _protocol_methods(protocol: type) -> list[str]:
  return [name for name, is_method in _protocol_members(protocol) if is_method]


STAGING_METHODS = tuple(n for n in _protocol_methods(StagingEngine)
                        if n not in _protocol_methods(TrainingEngine))

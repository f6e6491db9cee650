"""The JAX training engine: gradient accumulation over micro-batches, one optimizer update per step.

It implements ``orchestrator.contract.StagingEngine``, ``CheckpointingEngine``,
``WeightSource`` and ``MemoryReportingEngine``; the contract's docstrings are
its specification. Sibling
modules hold the rest: the device state and what each program replaces
(``training_state``), the step in progress and its metrics (``step_record``),
the input path (``inputs``, with each process's block of a micro-batch in a job
of several), the programs (``programs``) and their math (``step_math``),
checkpoints (``checkpointing``), digests and compile counting
(``diagnostics``), the in-flight bound (``throttler``), packing
(``orchestrator.data.packing``).

How the hot path stays asynchronous: every input — a payload or a prepared
input — reaches the compiled step the same way (``prepare_fwd_bwd_input``:
host arrays placed on the exact shardings the step is compiled with), so a
prepared input never causes a new trace or compile, and nothing reads a device
value on the host until ``get_metrics`` or ``wait_for_device``.

Step k's parameter buffers are never donated: the program may still read them
(metrics, checkpoint, weight sync) after step k+1's first micro-batch is
dispatched. Gradient accumulators and optimizer state are donated.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orchestrator import phases
from orchestrator.contract import DeviceMemory, NoCheckpointError, Receipt, StepMetrics
from orchestrator.data.trajectory import Trajectory
from orchestrator.engine import mesh as mesh_lib
from orchestrator.engine.inputs import MicroBatchInputs, PreparedFwdBwdInput
from orchestrator.engine.placement import allocator_stats
from orchestrator.engine.programs import StepPrograms
from orchestrator.engine.checkpointing import Checkpointer
from orchestrator.engine.diagnostics import backend_compile_count
from orchestrator.engine.flops import peak_flops_per_s, step_model_flops
from orchestrator.engine.loss import LossConfig, SampledDistribution
from orchestrator.engine.optimizer import LearningRates, make_optimizer
from orchestrator.engine.options import EngineOptions
from orchestrator.models.presets import ModelPreset, load_preset
from orchestrator.engine.step_record import FinishedStep, PendingOverflowCheck, StepInProgress
from orchestrator.engine.throttler import InflightThrottler
from orchestrator.engine.training_state import TrainingState, device_copy

__all__ = ["JaxTrainingEngine", "PreparedFwdBwdInput", "EngineSnapshot", "build_engine",
           "backend_compile_count"]

_engine_ids = itertools.count(1)
log = logging.getLogger("step_boundary.engine")


@dataclasses.dataclass(frozen=True, eq=False)
class EngineSnapshot:
  """Params, optimizer state and step of one engine, copied on its devices."""

  params: Any
  opt_state: Any
  step: int
  engine_id: int


class JaxTrainingEngine:
  """Trains a Tunix Qwen3 with a GRPO-style loss, one optimizer step per M micro-batches.

  Build it with ``build_engine``. Not thread-safe: one caller drives it. It holds the device state
  (``TrainingState``: what each program reads and replaces), the step in progress (``StepInProgress``: what
  its metrics are read from), the input path (``MicroBatchInputs``) and the compiled programs (``StepPrograms``).
  """

  def __init__(self, preset: ModelPreset, mesh_config: mesh_lib.MeshConfig | None = None,
               options: EngineOptions | None = None, *, rows: int | None = None,
               tokens_per_row: int | None = None, checkpoint_dir: str | None = None, aot: bool = True,
               sampled: SampledDistribution | None = None):
    self.preset = preset
    self.options = dataclasses.replace(options) if options else EngineOptions()
    self.options.validate(preset)
    self.rows = rows or preset.rows
    self.tokens_per_row = tokens_per_row or preset.tokens_per_row
    self.mesh_config = mesh_lib.MeshConfig.parse(mesh_config)
    mesh_lib.check_batch_shape(self.mesh_config, self.rows, self.tokens_per_row)
    self.rerun_dropped = bool(self.options.retry_when_tokens_dropped)
    self.mesh, self.engine_id, self.aot = mesh_lib.make_mesh(self.mesh_config), next(_engine_ids), aot
    self._checkpointer = Checkpointer(checkpoint_dir) if checkpoint_dir else None
    optimizer = make_optimizer(self.options)
    self._learning_rates = LearningRates(self.options)
    self._throttler = InflightThrottler(self.options.max_inflight)
    self._host_wait_s = 0.0
    self._in_progress = StepInProgress()
    self._step = self._total_micro = self._skipped_updates = 0
    self._finished: FinishedStep | None = None
    if self.options.attention == "splash" and jax.default_backend() != "tpu":
      raise ValueError(f"engine.attention=splash runs Tunix's Pallas splash kernel, on a TPU only; this run's"
                       f" devices are {jax.default_backend()}: set engine.attention=xla")
    self._training = state = TrainingState(self.preset, self.options, self.mesh, optimizer,
                                           tokens_per_row=self.tokens_per_row)
    self._inputs = MicroBatchInputs(self.rows, self.tokens_per_row, self.preset.vocab_size, state.batch_shardings,
                                    self.options.routing_shape(self.preset))
    self._programs = StepPrograms(
        state.graphdefs, LossConfig(self.options.clip_eps_low, self.options.clip_eps_high, sampled,
                                    self.options.loss_aggregation, self.tokens_per_row, self.options.kl_beta,
                                    self.options.kl_estimator, self.options.logprob_chunk_tokens),
        optimizer, rerun_dropped=self.rerun_dropped, param_shardings=state.param_shardings,
        opt_shardings=state.opt_shardings, scalar_sharding=state.scalar_sharding,
        batch_shardings=state.batch_shardings, aot=aot, remat=self.options.remat,
        splash_mesh=self.mesh if self.options.attention == "splash" else None)
    self._compiles_seen = backend_compile_count()  # a step's metrics count the compiles since the last's
    # over the whole mesh: a step's model FLOPs are the global batch's, in a job of several processes too
    self._peak_flops = peak_flops_per_s([d.device_kind for d in self.mesh.devices.flat])
    self.trace_counts = self._programs.trace_counts  # traces per program (a retrace shows up here)
    self.compile_s = self._programs.compile_s

  def compile(self, dummy_payload: Sequence[Trajectory] | None = None) -> dict[str, float]:
    """Compiles the micro-batch and update programs ahead of time; returns seconds per program.

    Uses ``dummy_payload`` (or a one-trajectory payload) only for its shapes;
    nothing runs and no state changes. Calling it again is a no-op.
    """
    dummy_payload = dummy_payload or self._inputs.placeholder()
    host, state = self._inputs.pack(dummy_payload), self._training
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=state.batch_shardings[k])
             for k, v in host.items()}
    return self._programs.compile(state.params, state.opt_state, state.accumulators, batch, state.reference)

  def _program(self, name: str):
    if self.aot and not self._programs.compiled:  # built without build_engine: compile on first use
      self.compile()
    return self._programs.get(name)

  def prepare_fwd_bwd_input(self, payload: Sequence[Trajectory]) -> PreparedFwdBwdInput:
    """Packs ``payload`` and starts its copy onto the step's shardings (see ``StagingEngine``);
    a payload that cannot be packed raises ValueError naming the trajectory and the limit."""
    return self._inputs.prepare(payload, self.engine_id)

  def fwd_bwd(self, payload_or_prepared: Sequence[Trajectory] | PreparedFwdBwdInput,
              apply_optimizer: bool = False, *, dropless: bool = False) -> Receipt:
    """Forward and backward on one micro-batch, gradients added to the step (see ``TrainingEngine``).

    A payload goes through ``prepare_fwd_bwd_input`` first; a prepared input
    skips it — everything after is identical, bit for bit. Under dropless
    re-runs, first reads the previous micro-batch's overflow flag (one
    micro-batch late) and re-runs that micro-batch if it overflowed;
    ``dropless=True`` runs this one dropless from the start.

    Raises:
      ValueError: a bad payload, an input prepared by another engine, or
        ``dropless`` without ``retry_when_tokens_dropped``; state is unchanged.
    """
    if dropless and not self.rerun_dropped:
      raise ValueError("fwd_bwd(dropless=True) needs retry_when_tokens_dropped=True")
    if isinstance(payload_or_prepared, PreparedFwdBwdInput):
      prepared, mapping_s, placement_s = payload_or_prepared, 0.0, 0.0
      if prepared.engine_id != self.engine_id:
        raise ValueError(f"this input was prepared by engine {prepared.engine_id}, not this engine"
                         f" ({self.engine_id}); prepare it with this engine's prepare_fwd_bwd_input")
    else:
      prepared = self._inputs.prepare(payload_or_prepared, self.engine_id)
      mapping_s, placement_s = prepared.mapping_s, prepared.placement_s
    waited_before, current = self._host_wait_s, self._in_progress
    self._resolve_overflow_check()
    name = "accumulate_dropless" if dropless else "accumulate"
    total, overflow = self._dispatch_accumulate(name, prepared.arrays, current.micro)
    if self.rerun_dropped and not dropless:
      current.pending_check = PendingOverflowCheck(current.micro, overflow, prepared.arrays)
    receipt = Receipt(kind=name.replace("accumulate", "fwd_bwd"), step=self._step, micro_step=current.micro,
                      ready=total, dispatched_at=time.perf_counter(), mapping_s=mapping_s, placement_s=placement_s,
                      host_wait_s=self._host_wait_s - waited_before)
    current.micro += 1
    self._total_micro += 1
    if apply_optimizer:
      self.update()
    return receipt

  def _dispatch_accumulate(self, name: str, batch, micro_step: int):
    program = self._program(name)
    self._host_wait(self._throttler.wait_for_next)
    total, count, dropped, overflow = self._training.accumulate(program, batch)
    self._in_progress.record(micro_step, total, count, dropped)
    self._throttler.add(total)
    return total, overflow

  def _host_wait(self, fn, *args):
    start = time.perf_counter()
    try:
      return fn(*args)
    finally:  # summed over the engine's life; each call reports its own difference
      self._host_wait_s += time.perf_counter() - start

  def _resolve_overflow_check(self) -> None:
    """Reads the pending overflow flag on the host (blocking on its micro-batch); re-runs it if set."""
    check = self._in_progress.take_pending_check()
    if check is not None and bool(self._host_wait(jax.device_get, check.overflow)):
      self._in_progress.reruns.append(check.micro_step)
      self._dispatch_accumulate("accumulate_dropless", check.batch, check.micro_step)

  def resolve_pending_overflow(self) -> bool:
    """Does now what the next call would do first (read the flag, re-run if set); returns whether
    it re-ran. For callers that time micro-batches and re-runs apart (calibration, the bench)."""
    reruns = len(self._in_progress.reruns)
    self._resolve_overflow_check()
    return len(self._in_progress.reruns) > reruns

  @property
  def overflow_check_pending(self) -> bool:
    """True while a micro-batch's overflow flag waits to be read (dropless re-runs)."""
    return self._in_progress.pending_check is not None

  def update(self) -> Receipt:
    """Applies the mean accumulated gradient and starts a new step (see ``TrainingEngine``).

    Under dropless re-runs it first reads the last micro-batch's flag, so it
    waits on the host until that micro-batch is done.

    Raises:
      RuntimeError: no micro-batch was accumulated since the last update.
    """
    if self._in_progress.micro == 0:
      raise RuntimeError(f"update() at step {self._step} with no micro-batch accumulated; call"
                         " fwd_bwd at least once per step")
    waited_before, state = self._host_wait_s, self._training
    self._resolve_overflow_check()
    norm = None
    if self.options.skip_nonfinite_updates:
      norm = float(self._host_wait(jax.device_get, self._programs.grad_norm(state.grad_acc, state.denom_acc)))
    program = self._program("apply")
    self._host_wait(self._throttler.wait_for_next)
    skipped = norm is not None and not np.isfinite(norm)
    metrics = self._skip_update(norm) if skipped else state.apply(program)
    ready = metrics["grad_norm"]  # never an accumulator: the next micro-batch donates those
    self._finished = self._in_progress.finish(self._step + 1, metrics, skipped=skipped)
    receipt = Receipt(kind="update", step=self._step, micro_step=-1, ready=ready, dispatched_at=time.perf_counter(),
                      mapping_s=0.0, placement_s=0.0, host_wait_s=self._host_wait_s - waited_before)
    self._throttler.add(ready)
    self._step += 1
    self._in_progress.reset()
    return receipt

  def _skip_update(self, norm: float) -> dict[str, jax.Array]:
    self._skipped_updates += 1
    log.warning("update at step %d skipped: gradient norm is %s (skip_nonfinite_updates); weights and"
                " optimizer state unchanged, the step count advances (%d skipped so far)",
                self._step, norm, self._skipped_updates)
    self._training.zero_accumulators()
    return {"loss": jnp.float32(np.nan), "grad_norm": jnp.float32(norm), "tokens": jnp.float32(0)}

  def wait_for_device(self) -> float:
    """Blocks until every queued computation is done; returns the seconds it blocked (see ``StagingEngine``)."""
    return self._throttler.block_until_ready()

  def device_memory(self) -> DeviceMemory | None:
    """This process's devices' memory now, and what an input holds on each (see ``MemoryReportingEngine``);
    None where the backend reports no allocator statistics (CPU)."""
    stats = allocator_stats(self._inputs.devices)
    return None if stats is None else DeviceMemory(bytes_in_use=stats[0], bytes_limit=stats[1],
                                                   input_bytes=self._inputs.input_bytes)

  @property
  def train_step(self) -> int:
    """Optimizer updates applied so far."""
    return self._step

  @property
  def micro_step_count(self) -> int:
    """Micro-batches accumulated into the current (not yet updated) step."""
    return self._in_progress.micro

  @property
  def total_micro_steps(self) -> int:
    """Micro-batches dispatched over the engine's life (re-runs not counted)."""
    return self._total_micro

  @property
  def inflight_count(self) -> int:
    """Dispatched computations this engine still tracks as queued."""
    return len(self._throttler)

  def export_weights(self):
    """The current weights (a nested dict of jax.Array); the engine never donates them."""
    return self._training.params

  def reference_weights(self):
    """The KL term's frozen reference (``model.reference_checkpoint``'s weights, or the start's), or None
    without a KL term."""
    return self._training.reference[0] if self._training.reference else None

  def get_metrics(self) -> StepMetrics:
    """Metrics of the last applied update, read to the host (blocks on that update); all None before one."""
    if self._finished is None:
      return StepMetrics()
    metrics = self._finished.host_metrics(self._skipped_updates, self._learning_rates,
                                          kl=bool(self.options.kl_beta))
    compiles = backend_compile_count()
    counted, self._compiles_seen = compiles - self._compiles_seen, compiles
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in self._inputs.devices]
    flops = step_model_flops(self.preset, rows=self.rows, tokens_per_row=self.tokens_per_row,
                             micro_batches=metrics.micro_batches or 0)
    return dataclasses.replace(metrics, compiles=counted, model_flops=flops, peak_flops_per_s=self._peak_flops,
                               device_peak_bytes=None if None in peaks or not peaks else max(peaks))

  def state_digest(self) -> str:
    """A sha256 of params and optimizer state: equal digests mean bit-identical training state."""
    return self._training.digest()

  def snapshot(self) -> EngineSnapshot:
    """An on-device copy of the training state at a step boundary, for ``restore``.

    Lets one compiled engine run several arms from the same start without recompiling.
    """
    if self._in_progress.micro:
      raise RuntimeError(f"snapshot with {self._in_progress.micro} micro-batch(es) accumulated; take it"
                         " at a step boundary")
    self._throttler.wait_for_all()
    return EngineSnapshot(*self._training.copies(), self._step, self.engine_id)

  def restore(self, snapshot: EngineSnapshot) -> None:
    """Returns the engine to ``snapshot``'s state (the snapshot stays usable)."""
    if snapshot.engine_id != self.engine_id:
      raise ValueError(f"snapshot of engine {snapshot.engine_id} cannot restore engine {self.engine_id}")
    self._reset_to(device_copy(snapshot.params), device_copy(snapshot.opt_state), snapshot.step)
    self._finished = None

  def _reset_to(self, params: Any, opt_state: Any, step: int) -> None:
    """The one reset: new training state, a fresh step, empty accumulators."""
    self._throttler.wait_for_all()
    self._training.reset_to(params, opt_state)
    self._step = step
    self._in_progress.reset()

  def save_checkpoint(self, metadata: Mapping[str, Any] | None = None) -> str:
    """Writes params, optimizer state, step and ``metadata`` (see ``CheckpointingEngine``)."""
    if self._checkpointer is None:
      raise RuntimeError("checkpointing needs a directory: build the engine with checkpoint_dir=PATH")
    return self._checkpointer.save(self._step, self._training.checkpointed(), dict(metadata or {}))

  def restore_checkpoint(self, step: int | None = None) -> dict[str, Any]:
    """Loads the latest (or ``step``'s) checkpoint onto the current shardings; returns its metadata.

    Raises:
      NoCheckpointError: the engine keeps no checkpoints, or none of ``step``.
    """
    if self._checkpointer is None:
      raise NoCheckpointError("this engine keeps no checkpoints (it was built without a checkpoint directory), so"
                              " it has none to restore; build it with checkpoint_dir=PATH")
    state, metadata = self._checkpointer.restore(self._training.checkpointed(), step)
    self._reset_to(state["params"], state["opt_state"], int(metadata["step"]))
    return metadata


def build_engine(preset: str | ModelPreset = "tiny",
                 mesh: mesh_lib.MeshConfig | Mapping[str, int] | None = None, *,
                 rows: int | None = None, tokens_per_row: int | None = None,
                 checkpoint_dir: str | None = None, aot: bool = True, sampled: SampledDistribution | None = None,
                 **options: Any) -> JaxTrainingEngine:
  """A ready engine: model built, weights placed and, with ``aot`` (default), programs compiled.

  Args:
    preset: a preset name from ``configs/model`` or a ``ModelPreset``.
    mesh: axis sizes, e.g. ``{"fsdp": 2, "expert": 2}``; one device by default.
    rows, tokens_per_row: the fixed micro-batch shape; None takes the preset's.
    checkpoint_dir: where ``save_checkpoint`` writes; None disables checkpoints.
    aot: compile ahead of time and dispatch the compiled executables; False
      dispatches through ``jax.jit``.
    sampled: the distribution the rollouts' ``old_logprobs`` were sampled from (the loss takes its
      log-probs the same way); None: the model's own.
    **options: fields of ``EngineOptions`` (the recipe's ``engine`` section).

  Raises:
    ValueError: unknown preset or option, or a batch shape the mesh cannot split.
  """
  known = {f.name for f in dataclasses.fields(EngineOptions)}
  unknown = sorted(set(options) - known)
  if unknown:
    raise ValueError(f"build_engine: unknown options {unknown}; known: {sorted(known)}")
  if isinstance(preset, str):
    preset = load_preset(preset)
  engine = JaxTrainingEngine(preset, mesh_lib.MeshConfig.parse(mesh), EngineOptions(**options), rows=rows,
                             tokens_per_row=tokens_per_row, checkpoint_dir=checkpoint_dir, aot=aot, sampled=sampled)
  phases.mark("weights_placed")  # what follows, to the trainer built, is compilation
  if aot:
    engine.compile()
  return engine

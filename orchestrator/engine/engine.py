"""The JAX training engine: gradient accumulation over micro-batches, one optimizer update per step.

Contract (see DESIGN.md §4). Required: ``fwd_bwd``, ``update``, ``get_metrics``,
``save_checkpoint``, ``restore_checkpoint``, ``train_step``,
``micro_step_count``. Optional, for staging: ``prepare_fwd_bwd_input`` and
``wait_for_device``.

How the hot path stays asynchronous: every input is turned into host arrays,
placed with ``jax.device_put`` on the exact shardings the compiled step takes,
and dispatched; nothing reads a device value on the host until ``get_metrics``
or ``wait_for_device``. Payloads and prepared inputs reach the compiled step in
the same form (committed ``jax.Array`` on the same shardings), so a prepared
input never causes a new trace or compile.

Step k's parameter buffers are never donated: the program may still read them
(metrics, checkpoint, weight sync) after step k+1's first micro-batch is
dispatched. Gradient accumulators and optimizer state are donated.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax._src import dispatch as _jax_dispatch

from orchestrator.data.trajectory import Trajectory
from orchestrator.engine import inputs as inputs_lib
from orchestrator.engine import mesh as mesh_lib
from orchestrator.engine import model as model_lib
from orchestrator.engine import moe as moe_lib
from orchestrator.engine.loss import LossConfig, attention_mask, policy_loss_sum
from orchestrator.engine.options import EngineOptions
from orchestrator.engine.placement import place_tree
from orchestrator.engine.presets import ModelPreset, load_preset
from orchestrator.engine.throttler import InflightThrottler

# ---------------------------------------------------------------------------
# Compile counting: XLA backend compiles in this process, read by tests and the rig.
_compile_total = [0]


def _on_event_duration(event: str, duration_s: float, **_: Any) -> None:
  if event == _jax_dispatch.BACKEND_COMPILE_EVENT:
    _compile_total[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event_duration)


def backend_compile_count() -> int:
  """How many XLA backend compiles this process has run so far."""
  return _compile_total[0]


_engine_ids = itertools.count(1)
# On-device copies (snapshots): one jitted function, so repeated snapshots do not recompile.
_copy_tree = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))
log = logging.getLogger("step_boundary.engine")


@dataclasses.dataclass(frozen=True, eq=False)
class _PendingOverflowCheck:
  """The last micro-batch whose overflow flag the host has not read yet, with its own inputs."""

  micro_step: int
  overflow: jax.Array
  batch: Mapping[str, jax.Array]


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedFwdBwdInput:
  """A micro-batch already mapped to model inputs and placed on the step's shardings.

  Made by ``prepare_fwd_bwd_input``; consumed by ``fwd_bwd``. The copy to the
  devices may still be in flight when it is handed back.

  Attributes:
    arrays: the placed inputs, by field name (see ``inputs.FIELDS``).
    host_arrays: the host arrays they were placed from (never written after
      placement); ``digest`` is computed from them on first use, off the stage.
    loss_tokens: completion tokens the micro-batch adds to the loss denominator.
    num_trajectories: trajectories packed into it.
    mapping_s, placement_s: seconds spent packing and issuing the copies.
    engine_id: the engine that prepared it; another engine refuses it.
  """

  arrays: Mapping[str, jax.Array]
  host_arrays: Mapping[str, np.ndarray] = dataclasses.field(repr=False)
  loss_tokens: int
  num_trajectories: int
  mapping_s: float
  placement_s: float
  engine_id: int

  @functools.cached_property
  def digest(self) -> str:
    """Content digest of the inputs (same payload → same digest); hashed when first asked for,
    so a stage on the hot path does not pay for it."""
    return content_digest(self.host_arrays)


@dataclasses.dataclass(frozen=True, eq=False)
class Computation:
  """A dispatched device computation: ``ready`` becomes ready when it finishes.

  ``step`` is the optimizer step it belongs to (the engine's ``train_step`` at
  dispatch) and ``micro_step`` its index within that step (-1 for an update).
  """

  kind: str
  step: int
  micro_step: int
  ready: jax.Array
  dispatched_at: float


@dataclasses.dataclass(frozen=True, eq=False)
class EngineSnapshot:
  """Params, optimizer state and step of one engine, copied on its devices."""

  params: Any
  opt_state: Any
  step: int
  engine_id: int


def content_digest(host_arrays: Mapping[str, np.ndarray]) -> str:
  h = hashlib.blake2b(digest_size=16)
  for name in inputs_lib.FIELDS:
    h.update(name.encode())
    h.update(np.ascontiguousarray(host_arrays[name]).tobytes())
  return h.hexdigest()


def tree_digest(tree: Any) -> str:
  """sha256 over every leaf's path, dtype, shape and bytes (host copies)."""
  h = hashlib.sha256()
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  for path, leaf in leaves:
    arr = np.asarray(jax.device_get(leaf))
    h.update(jax.tree_util.keystr(path).encode())
    h.update(str(arr.dtype).encode())
    h.update(str(arr.shape).encode())
    h.update(np.ascontiguousarray(arr).tobytes())
  return h.hexdigest()


class JaxTrainingEngine:
  """Trains a Tunix Qwen3 with a GRPO-style loss, one optimizer step per M micro-batches.

  Build it with ``build_engine``. Not thread-safe: one caller drives it.
  """

  def __init__(
      self,
      preset: ModelPreset,
      mesh_config: mesh_lib.MeshConfig | None = None,
      options: EngineOptions | None = None,
  ):
    self.preset = preset
    self.options = options or EngineOptions()
    self.rows = self.options.rows or preset.rows
    self.tokens_per_row = self.options.tokens_per_row or preset.tokens_per_row
    self.mesh_config = mesh_lib.MeshConfig.parse(mesh_config)
    mesh_lib.check_batch_shape(self.mesh_config, self.rows, self.tokens_per_row)
    self.options.validate(preset)
    self.replay = bool(self.options.retry_when_tokens_dropped)
    self.mesh = mesh_lib.make_mesh(self.mesh_config)
    self.engine_id = next(_engine_ids)
    self._loss_config = LossConfig(self.options.clip_eps_low, self.options.clip_eps_high)
    self._optimizer = optax.chain(
        optax.clip_by_global_norm(self.options.max_grad_norm),
        optax.adamw(self.options.learning_rate, weight_decay=self.options.weight_decay),
    )
    self.trace_counts = {"accumulate": 0, "accumulate_dropless": 0, "apply": 0}
    self.compile_s: dict[str, float] = {}
    self._throttler = InflightThrottler(self.options.max_inflight)
    self._init_state()
    self._build_programs()
    self._compiled: dict[str, Any] = {}
    self.last_dispatch: Computation | None = None
    self.last_mapping_s = 0.0
    self.last_placement_s = 0.0
    # Seconds this engine has blocked its caller so far: in-flight-limit waits,
    # overflow-flag reads, non-finite checks. Callers difference it around a call.
    self.host_wait_total_s = 0.0
    self._checkpointer = None

  # ---------------------------------------------------------------- set-up
  def _init_state(self) -> None:
    graphdefs, host_params, specs = model_lib.build_model(
        self.preset, self.options.seed, self.options.capacity_factor
    )
    self._graphdefs = graphdefs
    self._param_shardings = model_lib.param_shardings(self.mesh, specs)
    self._params = jax.device_put(host_params, self._param_shardings)
    self._scalar_sharding = mesh_lib.replicated(self.mesh)
    opt_state = jax.jit(self._optimizer.init)(self._params)
    # Moments follow their param's sharding; step counters come back on one
    # device and are replicated over the mesh instead.
    self._opt_shardings = jax.tree.map(
        lambda x: x.sharding
        if isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding.mesh == self.mesh
        else self._scalar_sharding,
        opt_state,
    )
    self._opt_state = jax.device_put(opt_state, self._opt_shardings)
    self._batch_shardings = {
        name: mesh_lib.batch_sharding(self.mesh, 2) for name in inputs_lib.FIELDS
    }
    self._reset_accumulators()
    self._step = 0
    self._micro = 0
    self._total_micro = 0
    self._micro_losses: list[tuple[jax.Array, jax.Array]] = []
    self._micro_dropped: list[jax.Array] = []
    self._replayed: list[int] = []
    self._pending_check: _PendingOverflowCheck | None = None
    self._skipped_updates = 0
    self._last_step_metrics: dict[str, Any] | None = None

  def _reset_accumulators(self) -> None:
    if not hasattr(self, "_zeros_jit"):  # built once: a new jit per call would recompile
      self._zeros_jit = jax.jit(
          lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=self._param_shardings
      )
    self._grad_acc = self._zeros_jit(self._params)
    self._loss_acc = jax.device_put(np.float32(0), self._scalar_sharding)
    self._denom_acc = jax.device_put(np.float32(0), self._scalar_sharding)

  def _build_programs(self) -> None:
    loss_config = self._loss_config
    optimizer = self._optimizer
    replay = self.replay

    def make_loss_sum(graphdef):
      def loss_sum(params, batch):
        model = nnx.merge(graphdef, params)
        with moe_lib.routing_scope(batch["segment_ids"] > 0) as dropped:
          logits, _ = model(
              batch["input_tokens"],
              batch["positions"],
              None,
              attention_mask(batch["segment_ids"]),
          )
        total, count = policy_loss_sum(logits, batch, loss_config)
        dropped_tokens = sum(dropped) if dropped else jnp.float32(0)
        return total, (count, dropped_tokens)

      return loss_sum

    def make_accumulate(name, graphdef, mask_overflow):
      loss_sum = make_loss_sum(graphdef)

      def accumulate(params, grad_acc, loss_acc, denom_acc, batch):
        self.trace_counts[name] += 1  # runs at trace time only
        (total, (count, dropped)), grads = jax.value_and_grad(loss_sum, has_aux=True)(params, batch)
        overflow = dropped > 0
        if mask_overflow:
          # Dropless replay: an overflowed micro-batch adds nothing now; its re-run
          # adds its gradients once. Masked on the device, so nothing syncs here.
          # (x + 0 == x exactly, so a discarded micro-batch leaves no trace.)
          keep = jnp.logical_not(overflow)
          grads = jax.tree.map(lambda g: jnp.where(keep, g, jnp.zeros_like(g)), grads)
          total = jnp.where(keep, total, 0.0)
          count = jnp.where(keep, count, 0.0)
        grad_acc = jax.tree.map(jnp.add, grad_acc, grads)
        return grad_acc, loss_acc + total, denom_acc + count, total, count, dropped, overflow

      return accumulate

    def apply(params, opt_state, grad_acc, loss_acc, denom_acc):
      self.trace_counts["apply"] += 1
      scale = 1.0 / jnp.maximum(denom_acc, 1.0)
      grads = jax.tree.map(lambda g: g * scale, grad_acc)
      grad_norm = optax.tree.norm(grads)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      metrics = {
          "loss": loss_acc * scale,
          "grad_norm": grad_norm,
          "tokens": denom_acc,
      }
      zeros = jax.tree.map(jnp.zeros_like, grad_acc)
      return params, opt_state, zeros, jnp.zeros_like(loss_acc), jnp.zeros_like(denom_acc), metrics

    def grad_norm(grad_acc, denom_acc):
      scale = 1.0 / jnp.maximum(denom_acc, 1.0)
      return optax.tree.norm(jax.tree.map(lambda g: g * scale, grad_acc))

    s = self._scalar_sharding
    p = self._param_shardings
    accumulate_kwargs = dict(
        in_shardings=(p, p, s, s, self._batch_shardings),
        out_shardings=(p, s, s, s, s, s, s),
        donate_argnums=(1, 2, 3),
    )
    self._jits = {
        "accumulate": jax.jit(
            make_accumulate("accumulate", self._graphdefs["capacity"], replay), **accumulate_kwargs
        ),
    }
    if replay:
      self._jits["accumulate_dropless"] = jax.jit(
          make_accumulate("accumulate_dropless", self._graphdefs["dropless"], False),
          **accumulate_kwargs,
      )
    metric_shardings = {"loss": s, "grad_norm": s, "tokens": s}
    self._jits["apply"] = jax.jit(
        apply,
        in_shardings=(p, self._opt_shardings, p, s, s),
        out_shardings=(p, self._opt_shardings, p, s, s, metric_shardings),
        # Params (argument 0) are not donated: step k's weights stay readable
        # while step k+1 runs.
        donate_argnums=(1, 2, 3, 4),
    )
    self._grad_norm_jit = jax.jit(grad_norm, in_shardings=(p, s), out_shardings=s)

  # ---------------------------------------------------------------- compile
  def compile(self, dummy_payload: Sequence[Trajectory] | None = None) -> dict[str, float]:
    """Compiles the micro-batch and update programs ahead of time.

    Uses ``dummy_payload`` (or a one-trajectory payload) only for its shapes;
    nothing is executed and no state changes. Returns compile seconds per program.
    Calling it again is a no-op.
    """
    if self._compiled:
      return dict(self.compile_s)
    if dummy_payload is None:
      dummy_payload = [
          Trajectory(np.array([1], np.int32), np.array([2], np.int32), advantage=0.0)
      ]
    host = inputs_lib.pack_payload(
        dummy_payload,
        rows=self.rows,
        tokens_per_row=self.tokens_per_row,
        vocab_size=self.preset.vocab_size,
    )
    batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self._batch_shardings[k])
        for k, v in host.items()
    }
    args = {
        "accumulate": (self._params, self._grad_acc, self._loss_acc, self._denom_acc, batch),
        "accumulate_dropless": (self._params, self._grad_acc, self._loss_acc, self._denom_acc, batch),
        "apply": (self._params, self._opt_state, self._grad_acc, self._loss_acc, self._denom_acc),
    }
    for name, jitted in self._jits.items():
      start = time.perf_counter()
      self._compiled[name] = jitted.lower(*args[name]).compile()
      self.compile_s[name] = time.perf_counter() - start
    return dict(self.compile_s)

  def _program(self, name: str):
    if not self.options.aot:
      return self._jits[name]
    if not self._compiled:
      self.compile()
    return self._compiled[name]

  # ---------------------------------------------------------------- inputs
  def _map(self, payload: Sequence[Trajectory]) -> dict[str, np.ndarray]:
    return inputs_lib.pack_payload(
        payload,
        rows=self.rows,
        tokens_per_row=self.tokens_per_row,
        vocab_size=self.preset.vocab_size,
    )

  def prepare_fwd_bwd_input(self, payload: Sequence[Trajectory]) -> PreparedFwdBwdInput:
    """Maps ``payload`` to model inputs and starts their copy onto the step's shardings.

    Runs exactly the mapping ``fwd_bwd`` runs for a payload, then places every
    leaf on the sharding the compiled step takes. Returns without waiting for
    the copy. Changes no step state: micro-step count, step, weights, gradient
    accumulators and the in-flight queue are untouched, so it is safe between a
    step's last ``fwd_bwd`` and its ``update()``.

    Raises:
      ValueError: the payload cannot be packed (names the trajectory and limit).
    """
    start = time.perf_counter()
    host = self._map(payload)
    mapped = time.perf_counter()
    arrays = place_tree(host, self._batch_shardings)
    placed = time.perf_counter()
    return PreparedFwdBwdInput(
        arrays=arrays,
        host_arrays=host,
        loss_tokens=inputs_lib.count_loss_tokens(payload),
        num_trajectories=len(payload),
        mapping_s=mapped - start,
        placement_s=placed - mapped,
        engine_id=self.engine_id,
    )

  # ---------------------------------------------------------------- step
  def fwd_bwd(
      self,
      payload_or_prepared: Sequence[Trajectory] | PreparedFwdBwdInput,
      apply_optimizer: bool = False,
      *,
      dropless: bool = False,
  ) -> Computation:
    """Runs forward and backward on one micro-batch and adds its gradients to the step.

    With a payload, maps and places it first; with a ``PreparedFwdBwdInput``,
    skips both — everything after is identical, bit for bit. Dispatches and
    returns without waiting for the result (it waits only when ``max_inflight``
    computations are already queued). With ``apply_optimizer``, also runs
    ``update()``.

    Under dropless replay, first reads the previous micro-batch's overflow flag
    (one micro-batch late) and, if it overflowed, re-runs that micro-batch from
    its own kept inputs with the program that drops nothing. ``dropless=True``
    runs this micro-batch with that program from the start.

    Returns:
      The dispatched micro-batch computation.

    Raises:
      ValueError: a bad payload, or an input prepared by another engine; the
        engine's state is unchanged.
    """
    if isinstance(payload_or_prepared, PreparedFwdBwdInput):
      prepared = payload_or_prepared
      if prepared.engine_id != self.engine_id:
        raise ValueError(
            f"this input was prepared by engine {prepared.engine_id}, not this engine"
            f" ({self.engine_id}); prepare it with this engine's prepare_fwd_bwd_input"
        )
      batch = prepared.arrays
      self.last_mapping_s = self.last_placement_s = 0.0
    else:
      start = time.perf_counter()
      host = self._map(payload_or_prepared)
      mapped = time.perf_counter()
      batch = place_tree(host, self._batch_shardings)
      self.last_mapping_s = mapped - start
      self.last_placement_s = time.perf_counter() - mapped
    if dropless and not self.replay:
      raise ValueError("fwd_bwd(dropless=True) needs retry_when_tokens_dropped=True")
    self._resolve_overflow_check()
    computation = self._dispatch_accumulate(
        "accumulate_dropless" if dropless else "accumulate", batch, self._micro
    )
    if self.replay and not dropless:
      self._pending_check = _PendingOverflowCheck(self._micro, self._last_overflow, batch)
    self._micro += 1
    self._total_micro += 1
    if apply_optimizer:
      self.update()
    return computation

  def _dispatch_accumulate(self, name: str, batch, micro_step: int) -> Computation:
    program = self._program(name)
    self._host_wait(self._throttler.wait_for_next)
    grad_acc, loss_acc, denom_acc, total, count, dropped, overflow = program(
        self._params, self._grad_acc, self._loss_acc, self._denom_acc, batch
    )
    self._grad_acc, self._loss_acc, self._denom_acc = grad_acc, loss_acc, denom_acc
    if micro_step == len(self._micro_losses):
      self._micro_losses.append((total, count))
      self._micro_dropped.append(dropped)
    else:  # a replay: its loss replaces the discarded run's (which was masked to 0)
      self._micro_losses[micro_step] = (total, count)
    self._last_overflow = overflow
    computation = Computation(name, self._step, micro_step, total, time.perf_counter())
    self._throttler.add(total)
    self.last_dispatch = computation
    return computation

  def _host_wait(self, fn, *args):
    start = time.perf_counter()
    try:
      return fn(*args)
    finally:
      self.host_wait_total_s += time.perf_counter() - start

  def _resolve_overflow_check(self) -> None:
    """Reads the pending overflow flag on the host (blocking on its micro-batch); re-runs it if set."""
    check, self._pending_check = self._pending_check, None
    if check is None:
      return
    if bool(self._host_wait(jax.device_get, check.overflow)):
      self._replayed.append(check.micro_step)
      self._dispatch_accumulate("accumulate_dropless", check.batch, check.micro_step)

  def resolve_pending_overflow(self) -> bool:
    """Reads the pending overflow flag now (blocking on its micro-batch) and re-runs it if set.

    What the next ``fwd_bwd`` or ``update()`` would do first; for callers that
    time micro-batches and re-runs apart. Returns whether it re-ran one.
    """
    replays = len(self._replayed)
    self._resolve_overflow_check()
    return len(self._replayed) > replays

  @property
  def overflow_check_pending(self) -> bool:
    """True while a micro-batch's overflow flag waits to be read (dropless replay)."""
    return self._pending_check is not None

  def update(self) -> int:
    """Applies the accumulated gradients (divided by the summed token count) and starts a new step.

    Dispatches without waiting for the micro-batches. Step k's parameter
    buffers are not donated, so readers of step k's weights stay valid.

    Returns:
      The new step count.

    Raises:
      RuntimeError: no micro-batch was accumulated since the last update.
    """
    if self._micro == 0:
      raise RuntimeError(
          f"update() at step {self._step} with no micro-batch accumulated; call"
          " fwd_bwd at least once per step"
      )
    # Dropless replay: the last micro-batch's flag is read here, so update()
    # waits on the host until that micro-batch is done.
    self._resolve_overflow_check()
    skipped = False
    if self.options.skip_nonfinite_updates:
      norm = float(self._host_wait(jax.device_get, self._grad_norm_jit(self._grad_acc, self._denom_acc)))
      skipped = not np.isfinite(norm)
    program = self._program("apply")
    self._host_wait(self._throttler.wait_for_next)
    if skipped:
      self._skipped_updates += 1
      log.warning(
          "update at step %d skipped: gradient norm is %s (skip_nonfinite_updates);"
          " weights and optimizer state unchanged, the step count advances (%d skipped so far)",
          self._step, norm, self._skipped_updates,
      )
      self._reset_accumulators()
      metrics = {"loss": jnp.float32(np.nan), "grad_norm": jnp.float32(norm), "tokens": jnp.float32(0)}
      ready = metrics["grad_norm"]  # not the accumulators: the next micro-batch donates those
    else:
      params, opt_state, grad_acc, loss_acc, denom_acc, metrics = program(
          self._params, self._opt_state, self._grad_acc, self._loss_acc, self._denom_acc
      )
      self._params, self._opt_state = params, opt_state
      self._grad_acc, self._loss_acc, self._denom_acc = grad_acc, loss_acc, denom_acc
      ready = metrics["grad_norm"]
    self._last_step_metrics = {
        "step": self._step + 1,
        "device": metrics,
        "micro_batches": self._micro,
        "micro_losses": self._micro_losses,
        "micro_dropped": self._micro_dropped,
        "replayed": self._replayed,
        "skipped": skipped,
    }
    self._micro_losses, self._micro_dropped, self._replayed = [], [], []
    self.last_dispatch = Computation("update", self._step, -1, ready, time.perf_counter())
    self._throttler.add(ready)
    self._step += 1
    self._micro = 0
    return self._step

  def wait_for_device(self) -> float:
    """Blocks until every queued computation is ready; returns the seconds it blocked.

    Dequeues nothing and records no metrics. An error of the queued work is
    raised here.
    """
    return self._throttler.block_until_ready()

  # ---------------------------------------------------------------- state
  @property
  def train_step(self) -> int:
    """Optimizer updates applied so far."""
    return self._step

  @property
  def micro_step_count(self) -> int:
    """Micro-batches accumulated into the current (not yet updated) step."""
    return self._micro

  @property
  def total_micro_steps(self) -> int:
    return self._total_micro

  @property
  def params(self):
    """The current weights (a nested dict of jax.Array); never donated by the engine."""
    return self._params

  def get_metrics(self) -> dict[str, Any]:
    """Metrics of the last applied update, read to the host (blocks on that update).

    Returns an empty dict before the first update.
    """
    if self._last_step_metrics is None:
      return {}
    m = self._last_step_metrics
    device = jax.device_get(m["device"])
    micro = jax.device_get(m["micro_losses"])
    dropped = jax.device_get(m["micro_dropped"])
    return {
        "step": m["step"],
        "loss": float(device["loss"]),
        "grad_norm": float(device["grad_norm"]),
        "tokens": int(device["tokens"]),
        "micro_batches": m["micro_batches"],
        "micro_batch_loss_sums": [float(t) for t, _ in micro],
        "micro_batch_tokens": [int(c) for _, c in micro],
        "dropped_tokens": [int(d) for d in dropped],
        "replays": len(m["replayed"]),
        "replayed_micro_batches": list(m["replayed"]),
        "skipped_update": m["skipped"],
        "skipped_updates_total": self._skipped_updates,
    }

  def snapshot(self) -> "EngineSnapshot":
    """An on-device copy of the training state at a step boundary, for ``restore``.

    Lets one compiled engine replay several runs from the same start (the rig's
    arms, tests) without recompiling.
    """
    if self._micro:
      raise RuntimeError(
          f"snapshot with {self._micro} micro-batch(es) accumulated; take it at a step boundary"
      )
    self._throttler.wait_for_all()
    return EngineSnapshot(
        _copy_tree(self._params), _copy_tree(self._opt_state), self._step, self.engine_id
    )

  def restore(self, snapshot: "EngineSnapshot") -> None:
    """Returns the engine to ``snapshot``'s state (the snapshot stays usable)."""
    if snapshot.engine_id != self.engine_id:
      raise ValueError(
          f"snapshot of engine {snapshot.engine_id} cannot restore engine {self.engine_id}"
      )
    self._throttler.wait_for_all()
    self._params = _copy_tree(snapshot.params)
    self._opt_state = _copy_tree(snapshot.opt_state)
    self._reset_accumulators()
    self._step = snapshot.step
    self._micro = 0
    self._micro_losses, self._micro_dropped, self._replayed = [], [], []
    self._pending_check = None
    self._last_step_metrics = None
    self.last_dispatch = None

  def state_digest(self) -> str:
    """A sha256 of params and optimizer state: equal digests mean bit-identical training state."""
    return tree_digest({"params": self._params, "opt_state": self._opt_state})

  # ---------------------------------------------------------------- checkpoints
  def _manager(self):
    if self._checkpointer is None:
      if not self.options.checkpoint_dir:
        raise RuntimeError(
            "checkpointing needs a directory: build the engine with checkpoint_dir=PATH"
        )
      import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

      self._checkpointer = ocp.CheckpointManager(
          Path(self.options.checkpoint_dir).absolute(),
          options=ocp.CheckpointManagerOptions(max_to_keep=3, create=True),
      )
    return self._checkpointer

  def _flat_state(self) -> dict[str, Any]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(
        {"params": self._params, "opt_state": self._opt_state}
    )
    return {f"{i:05d}{jax.tree_util.keystr(p)}": x for i, (p, x) in enumerate(leaves)}

  def save_checkpoint(self, metadata: Mapping[str, Any] | None = None) -> str:
    """Writes params, optimizer state, step and ``metadata`` (JSON-able) under ``checkpoint_dir``.

    Saves the state as of the last ``update()``: micro-batches already
    accumulated into the next step are not part of it (a pipelined boundary
    checkpoints step k after step k+1's first micro-batch is dispatched).
    Returns the checkpoint's path once it is written.
    """
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

    manager = self._manager()
    manager.save(
        self._step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(self._flat_state()),
            metadata=ocp.args.JsonSave({"step": self._step, **dict(metadata or {})}),
        ),
    )
    # Synchronous: the optimizer state is donated by the next update.
    manager.wait_until_finished()
    return str(Path(manager.directory) / str(self._step))

  def restore_checkpoint(self, step: int | None = None) -> dict[str, Any]:
    """Loads the latest (or ``step``'s) checkpoint onto the current shardings.

    Returns the checkpoint's metadata. Drops any accumulated micro-batches.
    """
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

    manager = self._manager()
    step = manager.latest_step() if step is None else step
    if step is None:
      raise RuntimeError(f"no checkpoint under {self.options.checkpoint_dir}")
    self._throttler.wait_for_all()
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
        for k, v in self._flat_state().items()
    }
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), metadata=ocp.args.JsonRestore()
        ),
    )
    _, treedef = jax.tree_util.tree_flatten({"params": self._params, "opt_state": self._opt_state})
    flat = restored["state"]
    tree = jax.tree_util.tree_unflatten(treedef, [flat[k] for k in sorted(flat)])
    self._params, self._opt_state = tree["params"], tree["opt_state"]
    self._reset_accumulators()
    self._step = int(restored["metadata"]["step"])
    self._micro = 0
    self._micro_losses, self._micro_dropped, self._replayed = [], [], []
    self._pending_check = None
    return dict(restored["metadata"])


def build_engine(
    preset: str | ModelPreset = "tiny",
    mesh: mesh_lib.MeshConfig | Mapping[str, int] | None = None,
    **options: Any,
) -> JaxTrainingEngine:
  """A ready engine: model built, weights placed and, with ``aot`` (default), programs compiled.

  Args:
    preset: a preset name from ``configs/model`` or a ``ModelPreset``.
    mesh: axis sizes, e.g. ``{"fsdp": 2, "expert": 2}``; one device by default.
    **options: fields of ``EngineOptions``.

  Raises:
    ValueError: unknown preset or option, or a batch shape the mesh cannot split.
  """
  known = {f.name for f in dataclasses.fields(EngineOptions)}
  unknown = sorted(set(options) - known)
  if unknown:
    raise ValueError(f"build_engine: unknown options {unknown}; known: {sorted(known)}")
  if isinstance(preset, str):
    preset = load_preset(preset)
  engine = JaxTrainingEngine(preset, mesh_lib.MeshConfig.parse(mesh), EngineOptions(**options))
  if engine.options.aot:
    engine.compile()
  return engine

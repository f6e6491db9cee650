"""The add-on: a stock Tunix GRPO learner whose trainer no longer idles at step boundaries.

``install(learner, policy)`` changes three things on one ``RLLearner``
instance (docs/tunix.md):

1. **The drain.** The actor trainer's throttler becomes a ``CountingThrottler``
   that, outside OFF, does not drain the device after every micro-batch: the
   next micro-batch is dispatched while the previous one computes, bounded by
   the trainer's ``max_inflight_computations``.
2. **Placement on the producer thread.** In a staged mode each micro-batch is
   placed onto the actor's data sharding (with Tunix's own ``shard_input``,
   under the actor's mesh) as the producer thread queues it, so the trainer
   thread's ``shard_input`` finds it placed and passes it through.
3. **The next mini-batch produced ahead.** Where the next mini-batch's
   rollouts cannot depend on the updates in flight — the sampler holds its own
   weights, synced only at the end of the global step, and no evaluation comes
   first — the producer thread goes straight on to the next mini-batch of the
   global step when it has queued this one (in a staged mode), instead of
   waiting for the trainer to finish. At each boundary the policy plans
   (``StepBoundaryPolicy.plan``, with ``next_ready`` saying whether the next
   step's data could exist) and the record says whether it was produced ahead.

Nothing else changes: the same producer (sampling, rewards, advantages), the
same queue order, the same train step, in the same order on the device. The
weights a run reaches are bit for bit those of the stock learner (tested in
the shared-mesh and split layouts). Under ``optax.MultiSteps`` the update is
fused into the last micro-batch, so STAGE_BEFORE_UPDATE and
STAGE_AFTER_UPDATE behave alike here: there is no separate ``update()`` to
defer.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import jax
import numpy as np
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.queue import data_queue as queue_lib
from tunix.sft import sharding_utils

from integrations.tunix_grpo import compat
from integrations.tunix_grpo.report import GrpoBoundary, format_summary, summarize
from integrations.tunix_grpo.throttle import CountingThrottler
from orchestrator.loop.watcher import CompletionWatcher
from policies.step_boundary import Mode, StepBoundaryPolicy

log = logging.getLogger("step_boundary.tunix_grpo")

#: A queue read that took longer than this waited for the producer (a read of a queued item takes µs).
ROLLOUT_WAIT_RESOLUTION_S = 1e-3
#: Wait-floor samples taken at install: a wait on finished work, what a device wait reads with nothing to hide.
FLOOR_SAMPLES = 16
#: The learner's instance attribute naming the add-on installed on it: one at a time, so uninstall
#: always has the stock throttler and loop methods to put back, never another add-on's.
INSTALLED_ATTRIBUTE = "_step_boundary_addon"


class AddonUsageError(RuntimeError):
  """The add-on was asked to do something its state does not allow (a second install, a second uninstall)."""


def _check_max_inflight(max_inflight: Any) -> None:
  """An explicit in-flight bound must bound something: a positive integer (the throttler reads <= 0 as none)."""
  if max_inflight is None:
    return
  if isinstance(max_inflight, bool) or not isinstance(max_inflight, (int, np.integer)) or max_inflight < 1:
    raise ValueError(
        f"max_inflight={max_inflight!r}: the micro-batches allowed in flight must be an integer >= 1;"
        " pass e.g. max_inflight=2, or leave it unset to use the trainer's max_inflight_computations")


class _PlacingQueue:
  """The producer's queue, placing each queued micro-batch on the actor's data sharding first."""

  def __init__(self, inner: queue_lib.SimpleDataQueue, place):
    self._inner = inner
    self._place = place

  def put(self, item) -> None:
    self._inner.put(item if item is None or self._place is None else self._place(item))

  def get(self, block: bool = True, timeout: float | None = None):
    return self._inner.get(block=block, timeout=timeout)


@dataclasses.dataclass(frozen=True)
class _Producer:
  """What one mini-batch's production needs, and where it sits in its global step."""

  train_iterator: Any
  service_target_batch_size: int
  grad_acc_steps: int
  eval_ds: Any
  train_steps_at_start: int
  mini_batches_left: int  # after this one, in the same global step

  def next_in_global_step(self, num_iterations: int) -> "_Producer | None":
    if self.mini_batches_left == 0:
      return None
    return dataclasses.replace(self, train_steps_at_start=self.train_steps_at_start + num_iterations,
                               mini_batches_left=self.mini_batches_left - 1)


class _AheadSlot:
  """The one mini-batch produced ahead of the trainer, and the next one waiting to start.

  The producer thread ``offer``s the mini-batch after its own when it has queued its own; the trainer
  thread ``take``s one when it starts a mini-batch. One lock, so never two producers for one mini-batch,
  and at most one produced ahead (its inputs are already on the trainer's devices in a staged mode).
  """

  def __init__(self, start):
    self._start = start
    self._lock = threading.Lock()
    self._started = None
    self._waiting = None

  def offer(self, producer: "_Producer", start_iter: int) -> None:
    with self._lock:
      if self._started is None:
        self._started = self._start(producer, start_iter=start_iter)
      else:
        self._waiting = (producer, start_iter)

  def take(self):
    with self._lock:
      taken, self._started = self._started, None
      if self._waiting is not None:
        producer, start_iter = self._waiting
        self._waiting = None
        self._started = self._start(producer, start_iter=start_iter)
      return taken

  def busy(self) -> bool:
    """Whether a producer is running or due ahead (it then owns the learner's micro-batch count)."""
    with self._lock:
      return self._started is not None or self._waiting is not None


class StepBoundaryAddon:
  """Drives one Tunix RL learner's boundaries with a ``StepBoundaryPolicy``; see the module docstring.

  Use ``install``; ``summary()`` and ``records`` report what happened, ``uninstall()`` restores the learner.
  """

  def __init__(self, learner: Any, policy: StepBoundaryPolicy, *, max_inflight: int | None = None):
    _check_max_inflight(max_inflight)
    compat.check(learner)
    if vars(learner).get(INSTALLED_ATTRIBUTE) is not None:
      raise AddonUsageError(
          f"the step-boundary add-on is already installed on this learner ({type(learner).__name__}"
          f" at {id(learner):#x}); call uninstall() on the add-on install() returned before installing again")
    self.policy = policy
    self._learner = learner
    self._cluster = learner.rl_cluster
    self._trainer = self._cluster._actor_trainer
    inflight = self._trainer.config.max_inflight_computations if max_inflight is None else max_inflight
    self.throttler = CountingThrottler(inflight, drain_each_call=policy.mode is Mode.OFF)
    self.records: list[GrpoBoundary] = []
    self._watcher = CompletionWatcher()
    self._ahead = _AheadSlot(self._start_producer)
    self._mini_batches_left = 0
    self._pending: GrpoBoundary | None = None
    self._micro_batches = 0
    self._blocks_at_boundary = 0
    # Calibrated before anything on the learner changes, so a failure here leaves it stock.
    if policy.threshold_s is None or not policy.floor_samples:
      policy.calibrate(self._sample_wait_floor())
    self._saved = (self._trainer._throttler, learner.__dict__.get("_run_global_step"),
                   learner.__dict__.get("_run_all_micro_batch_steps"))
    self._trainer._throttler = self.throttler
    learner._run_global_step = self._run_global_step
    learner._run_all_micro_batch_steps = self._run_all_micro_batch_steps
    setattr(learner, INSTALLED_ATTRIBUTE, self)

  # ------------------------------------------------------------------ bring-up
  def _sample_wait_floor(self) -> list[float]:
    done = jax.block_until_ready(jax.numpy.zeros(()))
    samples = []
    for _ in range(FLOOR_SAMPLES):
      start = time.perf_counter()
      jax.block_until_ready(done)
      samples.append(time.perf_counter() - start)
    return samples

  @property
  def installed(self) -> bool:
    """Whether this add-on is the one installed on its learner now."""
    return vars(self._learner).get(INSTALLED_ATTRIBUTE) is self

  def uninstall(self) -> None:
    """Puts back the trainer's throttler and the learner's own loop methods, exactly as install found them.

    Raises:
      AddonUsageError: this add-on is not installed on its learner (uninstalled already).
    """
    if not self.installed:
      learner = f"{type(self._learner).__name__} at {id(self._learner):#x}"
      if vars(self._learner).get(INSTALLED_ATTRIBUTE) is not None:
        raise AddonUsageError(
            f"this step-boundary add-on was uninstalled from its learner ({learner}) and another add-on is"
            " installed there now; call uninstall() on the add-on the latest install() returned")
      raise AddonUsageError(
          f"this step-boundary add-on was uninstalled from its learner ({learner}) already; the learner"
          " runs stock Tunix, so there is nothing to undo: drop the second uninstall()")
    throttler, global_step, micro_steps = self._saved
    self._trainer._throttler = throttler
    for name, saved in (("_run_global_step", global_step), ("_run_all_micro_batch_steps", micro_steps)):
      if saved is None:
        self._learner.__dict__.pop(name, None)
      else:
        setattr(self._learner, name, saved)
    del self._learner.__dict__[INSTALLED_ATTRIBUTE]

  # ------------------------------------------------------------------ the learner's loops
  def _run_global_step(self, full_batch_size, mini_batch_size, service_target_batch_size, grad_acc_steps,
                       train_iterator, eval_ds, skip_jit) -> None:
    """Tunix's per-global-step loop, except that a producer started ahead owns the micro-batch count."""
    learner = self._learner
    count = full_batch_size // mini_batch_size
    for index in range(count):
      self._mini_batches_left = count - index - 1
      with learner.rl_cluster.perf.span_group("mini_batch_step"):
        learner._run_mini_batch_step(learner._iter_steps, service_target_batch_size, grad_acc_steps,
                                     train_iterator, eval_ds, skip_jit)
      if not self._ahead.busy():
        # As Tunix does: the producer's count follows the trainer's. A producer started
        # ahead was given this same value when it started and has counted on from it.
        learner._iter_steps = self._trainer.iter_steps

  def _start_producer(self, producer: "_Producer", *, start_iter: int | None = None):
    """Submits one mini-batch's production (``_prepare_data``) to the learner's executor."""
    learner = self._learner
    inner = queue_lib.SimpleDataQueue(maxsize=producer.grad_acc_steps * learner._num_iterations() + 1)
    place = self._place if self.policy.mode.staged else None
    future = learner.executor.submit(self._produce, producer, _PlacingQueue(inner, place), start_iter)
    return inner, future

  def _produce(self, producer: "_Producer", target: "_PlacingQueue", start_iter: int | None) -> None:
    """Runs on the producer thread: one mini-batch, then — where its rollouts cannot depend on the
    update in flight — the next mini-batch of the global step at once, queued behind it."""
    learner = self._learner
    if start_iter is not None:
      learner._iter_steps = start_iter  # what Tunix's loop would have set before this producer
    first_iter = learner._iter_steps
    learner._prepare_data(
        iterator=producer.train_iterator, proceed_num_steps=producer.grad_acc_steps,
        sample_repeat=learner._num_generations(), batch_repeat=learner._num_iterations(),
        service_target_batch_size=producer.service_target_batch_size, data_queue=target,
        async_loading=learner.can_enable_async_rollout, mode=rl_cluster_lib.Mode.TRAIN)
    after = producer.next_in_global_step(learner._num_iterations())
    if after is not None and self.policy.mode.staged and self._next_ready_ahead(after):
      self._ahead.offer(after, first_iter + producer.grad_acc_steps * learner._num_iterations())

  def _next_ready_ahead(self, producer: "_Producer") -> bool:
    """Whether the mini-batch ``producer`` makes can be sampled before the trainer reaches it."""
    return self._learner.should_sync_weights and not self._evaluation_first(producer.eval_ds,
                                                                            producer.train_steps_at_start)

  def _evaluation_first(self, eval_ds, train_steps: int) -> bool:
    """Whether a mini-batch starting at ``train_steps`` begins with Tunix's evaluation (on the sampler)."""
    return bool(eval_ds) and train_steps % self._learner._training_config.eval_every_n_steps == 0

  def _place(self, item: list) -> list:
    """Tunix's own ``shard_input`` under the actor's mesh: the trainer thread's call then passes it through."""
    with self._cluster._get_mesh_and_logical_axis_rules_cm(rl_cluster_lib.Role.ACTOR):
      axis = self._trainer.config.data_sharding_axis
      return [sharding_utils.shard_input(example, axis) for example in item]

  def _run_all_micro_batch_steps(self, initial_steps, service_target_batch_size, grad_acc_steps,
                                 train_iterator, eval_ds, skip_jit) -> None:
    """Tunix's per-mini-batch consumer loop, with boundaries planned and the next producer started ahead."""
    learner, cluster, trainer = self._learner, self._cluster, self._trainer
    producer = _Producer(train_iterator, service_target_batch_size, grad_acc_steps, eval_ds,
                         trainer.train_steps, self._mini_batches_left)
    inner, future = self._ahead.take() or self._start_producer(producer)
    items_per_mini_batch = grad_acc_steps * learner._num_iterations()
    consumed = 0
    curr_eval_ds = None
    with jax.profiler.StepTraceAnnotation("trainer", step_num=initial_steps):
      while True:
        asked_at = time.perf_counter()
        item = inner.get(block=True)
        got_at = time.perf_counter()
        if item is None:
          break
        if learner.can_enable_async_rollout:
          cluster.buffer_metrics({"actor_dequeue_time": (got_at - asked_at, np.mean)},
                                 mode=rl_cluster_lib.Mode.TRAIN)
        if not curr_eval_ds and self._evaluation_first(eval_ds, trainer.train_steps):
          curr_eval_ds = self._evaluate(eval_ds, service_target_batch_size)
        awaiting_dispatch = self._note_next_input(got_at, got_at - asked_at)
        steps_before = trainer.train_steps
        cluster.update_actor(item, curr_eval_ds, skip_jit)
        if awaiting_dispatch is not None:
          awaiting_dispatch.next_dispatch_at = self.throttler.last_added_at
        self._micro_batches += 1
        consumed += 1
        if trainer.train_steps != steps_before:
          self._at_boundary(end_of_mini_batch=consumed >= items_per_mini_batch, eval_ds=eval_ds)
    future.result()
    # The producer thread has decided by now whether the next mini-batch is being produced ahead.
    if self.records and self.records[-1].step == trainer.train_steps:
      self.records[-1].prefetched = self._ahead.busy()

  def _evaluate(self, eval_ds, service_target_batch_size: int):
    """Tunix's evaluation pass, unchanged (synchronous, on this thread)."""
    learner = self._learner
    eval_queue = queue_lib.SimpleDataQueue(maxsize=0)
    learner._eval_iter_steps = 0
    learner._prepare_data(iterator=iter(eval_ds), proceed_num_steps=-1, sample_repeat=learner._num_generations(),
                          batch_repeat=1, service_target_batch_size=service_target_batch_size,
                          data_queue=eval_queue, async_loading=False, mode=rl_cluster_lib.Mode.EVAL)
    return eval_queue.get(block=True)

  # ------------------------------------------------------------------ boundaries
  def _next_ready(self, end_of_mini_batch: bool, eval_ds) -> tuple[bool, str]:
    """Whether the next optimizer step's first micro-batch can exist before this update is applied."""
    if not end_of_mini_batch:
      return True, "the next optimizer step re-trains micro-batches already queued (num_iterations > 1)"
    if self._mini_batches_left == 0:
      return False, "the next global step samples on the weights this boundary's sync delivers"
    if not self._learner.should_sync_weights:
      return False, "the sampler shares the trained weights: the next mini-batch samples on this update"
    if self._evaluation_first(eval_ds, self._trainer.train_steps):
      return False, "the next mini-batch starts with an evaluation on the sampler"
    return True, "the sampler's weights change only at the global step's sync"

  def _at_boundary(self, *, end_of_mini_batch: bool, eval_ds) -> None:
    now = time.perf_counter()
    step = self._trainer.train_steps
    self._watcher.watch(step, self.throttler.last_computation, kind="micro_batch", step=step,
                        micro_step=-1, dispatched_at=now)
    self._settle(wait=False)
    next_ready, why = self._next_ready(end_of_mini_batch, eval_ds)
    plan = self.policy.plan(step, next_ready=next_ready)
    blocks = self.throttler.host_blocks - self._blocks_at_boundary
    self._blocks_at_boundary = self.throttler.host_blocks
    record = GrpoBoundary(step=step, global_step=self._cluster.global_steps, mode=plan.mode.value,
                          stage=plan.stage, next_ready=next_ready, prefetched=False,
                          reason=plan.reason if next_ready else why, at=now, host_blocks=blocks)
    self.records.append(record)
    self._pending = record

  def _note_next_input(self, got_at: float, read_s: float) -> GrpoBoundary | None:
    """The next step's first micro-batch is in hand: returns the boundary it follows, if any."""
    record, self._pending = self._pending, None
    if record is not None:
      record.next_input_at = got_at
      record.rollout_wait_s = read_s if read_s > ROLLOUT_WAIT_RESOLUTION_S else 0.0
    return record

  def _settle(self, wait: bool) -> None:
    """Fills in when each boundary's last micro-batch finished (from the watcher).

    The policy is not asked to judge these waits: its auto-disable protects an update that a
    stage could hold up, and under ``optax.MultiSteps`` the update went out with the last
    micro-batch, before the boundary, so nothing staged can delay it. The waits are reported
    (``summary()['low_device_waits']`` counts those under the calibrated threshold).
    """
    for record in self.records:
      if record.settled or record.next_dispatch_at is None:
        continue
      item = self._watcher.get(record.step)
      if item.ready_at is None and not wait:
        continue
      record.last_ready_at = self._watcher.ready_at(record.step)
      record.settled = True

  # ------------------------------------------------------------------ reports
  def summary(self) -> dict[str, Any]:
    self._settle(wait=True)
    return summarize(self.records, self.policy, host_blocks=self.throttler.host_blocks,
                     micro_batches=self._micro_batches, optimizer_steps=len(self.records))

  def format_summary(self) -> str:
    return format_summary(self.summary())


def install(learner: Any, policy: StepBoundaryPolicy | Mode | str = Mode.STAGE_BEFORE_UPDATE, *,
            max_inflight: int | None = None) -> StepBoundaryAddon:
  """Installs the step-boundary add-on on a stock Tunix RL learner (e.g. ``GRPOLearner``); call before ``train``.

  Args:
    learner: the learner, built as usual on its ``RLCluster``.
    policy: a ``StepBoundaryPolicy``, or a mode name for one with default settings.
    max_inflight: micro-batches allowed in flight, an integer >= 1 (default: the trainer's
      ``max_inflight_computations``).

  Raises:
    compat.UnsupportedTunixError: a Tunix version, learner or setting the add-on cannot drive exactly.
    AddonUsageError: the add-on is installed on ``learner`` already (uninstall that one first).
    ValueError: ``max_inflight`` is not an integer >= 1.
  """
  if not isinstance(policy, StepBoundaryPolicy):
    # No controls: the add-on measures no saving (the learner's loop records no boundary spans), so a control
    # would only give up a stage.
    policy = StepBoundaryPolicy(policy, control_every=0)
  return StepBoundaryAddon(learner, policy, max_inflight=max_inflight)

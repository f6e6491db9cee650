"""RLProgram: the optimizer-step loop, executing each step boundary the way the policy plans it.

Per boundary between step k and k+1 (DESIGN.md §4):

=====================  ==========================================================================
mode                   order
=====================  ==========================================================================
OFF                    fwd_bwd(last, apply_optimizer) → metrics, log, checkpoint, weight sync of k
                       → fwd_bwd(first)
PIPELINED              fwd_bwd(last, apply_optimizer) → fwd_bwd(first) → boundary work of k
STAGE_AFTER_UPDATE     fwd_bwd(last, apply_optimizer) → stage_fwd_bwd(first) → fwd_bwd_staged()
                       → boundary work of k
STAGE_BEFORE_UPDATE    fwd_bwd(last, defer_update) → stage_fwd_bwd(first) → apply_deferred_update()
                       → fwd_bwd_staged() → boundary work of k
=====================  ==========================================================================

"Boundary work" is reading step k's metrics, logging, checkpointing (cadence
from the config) and the weight sync. With ``sync_before_next_step`` the
checkpoint and the weight sync move before step k+1's first dispatch (for
runtimes where a weight transfer would queue behind that micro-batch).

A ``CompletionWatcher`` stamps when each computation becomes ready; from those
stamps every boundary gets one record (``records.jsonl``), and the run a
Chrome/Perfetto trace (``trace.json``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from orchestrator.trainer_worker import TrainerWorker
from orchestrator.watcher import CompletionWatcher
from policies import BoundaryPlan, StepBoundaryPolicy
from policies.step_boundary import format_seconds

log = logging.getLogger("step_boundary.program")


@dataclasses.dataclass(frozen=True)
class ProgramConfig:
  """How the step loop runs.

  Attributes:
    steps: optimizer steps to run.
    micro_batches_per_step: payloads per step (each source item must have this many).
    checkpoint_every: save a checkpoint after every N-th step (0: never).
    scored_checkpoint_steps: step counts whose checkpoints are scored; a
      checkpoint is written after each of them whatever the cadence.
    sync_before_next_step: checkpoint and weight sync of step k run before
      step k+1's first dispatch (their time then counts as boundary idle).
    calibration_samples: wait-floor samples taken at bring-up.
    out_dir: where records.jsonl and trace.json go (None: not written).
  """

  steps: int
  micro_batches_per_step: int
  checkpoint_every: int = 0
  scored_checkpoint_steps: tuple[int, ...] = ()
  sync_before_next_step: bool = False
  calibration_samples: int = 8
  out_dir: str | None = None

  def __post_init__(self):
    if self.steps < 1:
      raise ValueError(f"steps must be >= 1, got {self.steps}")
    if self.micro_batches_per_step < 1:
      raise ValueError(f"micro_batches_per_step must be >= 1, got {self.micro_batches_per_step}")
    if self.checkpoint_every < 0:
      raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")


class HostWeightStore:
  """The default weight sync: copies the updated weights to host memory, as a sampler receives them."""

  def __init__(self):
    self.version: int | None = None
    self.weights: Any = None
    self.syncs = 0

  def __call__(self, step: int, weights: Any) -> None:
    if weights is None:
      return
    import jax  # pylint: disable=import-outside-toplevel

    self.weights = jax.device_get(weights)
    self.version = step
    self.syncs += 1


@dataclasses.dataclass
class _Boundary:
  """What the loop knows about the boundary after one step, filled in as it happens."""

  step: int
  plan: BoundaryPlan | None
  staged: bool = False
  stage_s: float | None = None
  stage_start: float | None = None
  stage_end: float | None = None
  device_wait_s: float | None = None
  staged_input: Any = None  # its digest is read when the record is written, not on the stage
  low_wait: bool | None = None
  transition: str | None = None
  metrics: dict | None = None
  spans: dict = dataclasses.field(default_factory=dict)
  sync_done: bool = False
  observed: bool = False


@dataclasses.dataclass
class ProgramResult:
  records: list[dict]
  summary: dict
  records_path: str | None
  trace_path: str | None
  watched: list = dataclasses.field(default_factory=list)  # completion stamps, dispatch order
  host_spans: list = dataclasses.field(default_factory=list)
  run_start: float = 0.0


class RLProgram:
  """Drives a TrainerWorker through ``config.steps`` optimizer steps.

  Args:
    worker: the trainer.
    policy: plans every boundary (its capability fallback already applied).
    source: an iterable of steps, each a sequence of ``micro_batches_per_step`` payloads.
    config: the loop's settings.
    weight_sync: called as ``weight_sync(step, weights)`` after each step
      (default: ``HostWeightStore``).
    on_step: called with each finished boundary record (progress display).
    clock: seconds, monotonic.
  """

  def __init__(
      self,
      worker: TrainerWorker,
      policy: StepBoundaryPolicy,
      source: Iterable[Sequence[Any]],
      config: ProgramConfig,
      *,
      weight_sync: Callable[[int, Any], None] | None = None,
      on_step: Callable[[dict], None] | None = None,
      clock: Callable[[], float] = time.perf_counter,
  ):
    self.worker = worker
    self.policy = policy
    self.source = source
    self.config = config
    self.weight_sync = weight_sync if weight_sync is not None else HostWeightStore()
    self.on_step = on_step
    self.clock = clock
    self.records: list[dict] = []
    self.host_spans: list[tuple[str, float, float, int]] = []
    self._watcher: CompletionWatcher | None = None
    self._pending: _Boundary | None = None
    self._unfinished: _Boundary | None = None
    self._last_update_ready: float | None = None
    self._run_start = 0.0
    self.current_step: int | None = None  # the step being run (for error messages)
    self._records_file = None
    self.out_dir = Path(config.out_dir) if config.out_dir else None

  # ------------------------------------------------------------------ bring-up
  def calibrate(self) -> float | None:
    """Samples the wait floor (nothing in flight) and calibrates the policy; returns the threshold."""
    if not self.worker.capabilities.can_stage or not self.policy.requested_mode.staged:
      return self.policy.threshold_s
    wait = self.worker.engine.wait_for_device
    wait()  # the first call can pay one-off costs; it is not a floor sample
    samples = [wait() for _ in range(self.config.calibration_samples)]
    return self.policy.calibrate(samples)

  # ------------------------------------------------------------------ loop
  def run(self) -> ProgramResult:
    """Runs every step; returns records and summary. On an error, what was recorded is kept."""
    if self.out_dir:
      self.out_dir.mkdir(parents=True, exist_ok=True)
      self._records_file = (self.out_dir / "records.jsonl").open("w")
    self._watcher = CompletionWatcher(self.clock)
    self._run_start = self.clock()
    try:
      self.calibrate()
      self._announce_staging_state()
      self._loop()
      self._finish()
    finally:
      self._watcher.drain(timeout_s=600)
      self._watcher.close()
      if self._records_file:
        self._records_file.close()
      trace_path = self._write_trace()
    summary = self.summary()
    summary["trace_path"] = trace_path
    return ProgramResult(self.records, summary, summary.get("records_path"), trace_path,
                         self._watcher.items(), list(self.host_spans), self._run_start)

  def _steps(self) -> Iterator[Sequence[Any]]:
    m = self.config.micro_batches_per_step
    for k, payloads in enumerate(self.source):
      if k >= self.config.steps:
        return
      if len(payloads) != m:
        raise ValueError(
            f"step {k} has {len(payloads)} micro-batch payloads; micro_batches_per_step is {m}"
        )
      yield payloads

  def _loop(self) -> None:
    steps = self._steps()
    current = next(steps, None)
    if current is None:
      raise ValueError("the source yielded no steps")
    staged_for_current = False
    for k in range(self.config.steps):
      self.current_step = k
      nxt = next(steps, None) if k + 1 < self.config.steps else None
      if k + 1 < self.config.steps and nxt is None:
        raise ValueError(f"the source ran out after {k + 1} steps; {self.config.steps} were asked for")
      boundary = _Boundary(step=k, plan=None)
      last = len(current) - 1
      for i, payload in enumerate(current):
        use_staged = i == 0 and staged_for_current
        if i < last or nxt is None:
          self._micro_batch(k, i, payload, use_staged, apply_optimizer=i == last)
          if i == last:
            self._watch_update(k)
        else:
          boundary.plan = self.policy.plan(k)
          self._boundary(k, i, payload, use_staged, boundary, nxt[0])
      staged_for_current = boundary.staged
      if boundary.plan is None or boundary.plan.await_metrics:
        self._boundary_work(boundary)
      else:
        if self.config.sync_before_next_step:
          self._checkpoint_and_sync(boundary)
        self._pending = boundary
      self._unfinished = boundary
      current = nxt

  def _micro_batch(self, k, i, payload, use_staged, *, apply_optimizer=False, defer_update=False):
    call_start = self.clock()
    # A one-micro-batch step whose first is also its last: the previous step's
    # metrics must be read before this step's update replaces them.
    split_update = apply_optimizer and i == 0 and self._pending is not None
    apply_now = apply_optimizer and not split_update
    waited_before = getattr(self.worker.engine, "host_wait_total_s", None)
    if use_staged:
      result = self.worker.fwd_bwd_staged(apply_optimizer=apply_now, defer_update=defer_update)
    else:
      result = self.worker.fwd_bwd(payload, apply_optimizer=apply_now, defer_update=defer_update)
    dispatched_at = getattr(result, "dispatched_at", None) or self.clock()
    self._watcher.watch(
        ("fwd_bwd", k, i), getattr(result, "ready", result),
        kind="fwd_bwd", step=k, micro_step=i, dispatched_at=dispatched_at,
    )
    self._host_dispatch_spans(call_start, self.clock(), use_staged, waited_before)
    if i == 0:
      # Step k-1's boundary work runs now, behind step k's first micro-batch.
      if self._pending is not None:
        pending, self._pending = self._pending, None
        self._boundary_work(pending)
      if self._unfinished is not None:
        unfinished, self._unfinished = self._unfinished, None
        self._finish_record(unfinished, first_dispatch=dispatched_at)
    if split_update:
      self.worker.update()
    return result

  def _host_dispatch_spans(self, start: float, end: float, staged: bool, waited_before: float | None) -> None:
    """Splits a fwd_bwd call into prepare / host wait / dispatch, where the engine says how long each took.

    The wait is everything the engine blocked on inside the call: the in-flight
    limit, an overflow-flag read (dropless replay), a non-finite check.
    """
    engine = self.worker.engine
    mapping = getattr(engine, "last_mapping_s", None)
    if mapping is None or waited_before is None:
      self.host_spans.append(("fwd_bwd", start, end, 0))
      return
    prepare = 0.0 if staged else mapping + getattr(engine, "last_placement_s", 0.0)
    waited = engine.host_wait_total_s - waited_before
    t = start
    for name, seconds in (("prepare", prepare), ("host wait", waited)):
      if seconds > 0:
        self.host_spans.append((name, t, min(end, t + seconds), 0))
        t = min(end, t + seconds)
    self.host_spans.append(("dispatch", t, end, 0))

  def _watch_update(self, k: int) -> None:
    update = getattr(self.worker.engine, "last_dispatch", None)
    is_update = getattr(update, "kind", None) == "update"
    self._watcher.watch(
        ("update", k), update.ready if is_update else None, kind="update", step=k, micro_step=-1,
        dispatched_at=update.dispatched_at if is_update else self.clock(),
    )

  def _boundary(self, k, i, payload, use_staged, boundary: _Boundary, next_first) -> None:
    plan = boundary.plan
    if plan.stage and plan.stage_before_update:
      self._micro_batch(k, i, payload, use_staged, defer_update=True)
      self._stage(boundary, next_first)
      wait_start = self.clock()
      boundary.device_wait_s = self.worker.apply_deferred_update()
      waited_until = wait_start + boundary.device_wait_s
      self.host_spans.append(("wait for device", wait_start, waited_until, 0))
      self.host_spans.append(("update dispatch", waited_until, self.clock(), 0))
      self._watch_update(k)
      self._observe(boundary)
    elif plan.stage:
      self._micro_batch(k, i, payload, use_staged, apply_optimizer=True)
      self._watch_update(k)
      self._stage(boundary, next_first)
      # The device wait is known once the update's completion is stamped (boundary work).
    else:
      self._micro_batch(k, i, payload, use_staged, apply_optimizer=True)
      self._watch_update(k)

  def _stage(self, boundary: _Boundary, payload) -> None:
    boundary.stage_start = self.clock()
    boundary.stage_s = self.worker.stage_fwd_bwd(payload)
    boundary.stage_end = self.clock()
    boundary.staged = True
    boundary.staged_input = self.worker.staged_input
    self.host_spans.append(("stage", boundary.stage_start, boundary.stage_end, 0))

  def _observe(self, boundary: _Boundary) -> None:
    plan = boundary.plan
    delay = None
    threshold = self.policy.threshold_s
    if threshold is not None and boundary.device_wait_s < threshold:
      last_key = ("fwd_bwd", boundary.step, self.config.micro_batches_per_step - 1)
      try:
        last_ready = self._watcher.ready_at(last_key, timeout_s=5.0)
        delay = max(0.0, boundary.stage_end - last_ready)
      except (KeyError, TimeoutError):
        delay = None
    obs = self.policy.observe(
        boundary.step, stage_s=boundary.stage_s, device_wait_s=boundary.device_wait_s,
        probe=plan.probe, update_delay_s=delay,
    )
    boundary.low_wait = obs.low
    boundary.transition = obs.transition.kind if obs.transition else None
    boundary.observed = True
    self._log_staged(boundary)
    if obs.transition and not self.policy.mode.staged:
      log.warning(
          "[boundary] !!! staging (%s) is OFF from step %d on: %s",
          self.policy.requested_mode.name, boundary.step + 1, obs.transition.reason,
      )

  def _log_staged(self, boundary: _Boundary) -> None:
    plan = boundary.plan
    where = "before" if plan.stage_before_update else "after"
    probe = " (re-probe)" if plan.probe else ""
    low = " — below the threshold: the stage outlasted the compute" if boundary.low_wait else ""
    log.info(
        "[boundary] step %d STAGED%s %s update in %s; the device still computed %s after it%s",
        boundary.step, probe, where, format_seconds(boundary.stage_s),
        format_seconds(boundary.device_wait_s), low,
    )

  def _announce_staging_state(self) -> None:
    requested = self.policy.requested_mode
    if requested.staged and not self.policy.mode.staged:
      log.warning(
          "[boundary] !!! staging was requested (%s) but is OFF for this run: %s",
          requested.name, self.policy.reason,
      )

  # ------------------------------------------------------------------ boundary work
  def _checkpoint_and_sync(self, boundary: _Boundary) -> None:
    if boundary.sync_done:
      return
    boundary.sync_done = True
    k = boundary.step
    every = self.config.checkpoint_every
    due = (every and (k + 1) % every == 0) or (k + 1) in self.config.scored_checkpoint_steps
    if due and self.worker.capabilities.can_checkpoint:
      start = self.clock()
      scored = (k + 1) in self.config.scored_checkpoint_steps
      self.worker.save_checkpoint({"step": k + 1, "mode": self.policy.mode.value, "scored": scored})
      boundary.spans["checkpoint_s"] = self.clock() - start
      self.host_spans.append((f"checkpoint {k + 1}", start, self.clock(), 1))
    start = self.clock()
    self.weight_sync(k + 1, getattr(self.worker.engine, "params", None))
    boundary.spans["weight_sync_s"] = self.clock() - start
    self.host_spans.append((f"weight sync {k + 1}", start, self.clock(), 1))

  def _boundary_work(self, boundary: _Boundary) -> None:
    """Metrics, logging, checkpoint and weight sync of ``boundary.step``."""
    start = self.clock()
    boundary.metrics = self.worker.get_metrics()  # blocks until update k is done
    end = self.clock()
    update_key = ("update", boundary.step)
    self._watcher.observe_ready(update_key, end)
    # The read's own cost, not the wait for the update in front of it.
    update_ready = self._watcher.ready_at(update_key, timeout_s=600)
    boundary.spans["metrics_s"] = end - max(start, update_ready)
    boundary.spans["metrics_wait_s"] = max(0.0, update_ready - start)
    self.host_spans.append((f"metrics {boundary.step}", start, end, 1))
    if boundary.plan is not None and boundary.plan.stage and not boundary.observed:
      # Staged after the update: the device wait is how long the update still ran after the stage.
      update_ready = self._watcher.ready_at(("update", boundary.step), timeout_s=600)
      boundary.device_wait_s = max(0.0, update_ready - boundary.stage_end)
      self._observe(boundary)
    self._checkpoint_and_sync(boundary)

  # ------------------------------------------------------------------ records
  def _finish_record(self, boundary: _Boundary, first_dispatch: float | None) -> None:
    k = boundary.step
    w = self._watcher
    update = w.get(("update", k))
    update_ready = w.ready_at(("update", k), timeout_s=600)
    m = self.config.micro_batches_per_step
    last_ready = w.ready_at(("fwd_bwd", k, m - 1), timeout_s=600)
    micro_s = []
    prev_ready = self._last_update_ready
    for i in range(m):
      item = w.get(("fwd_bwd", k, i))
      ready = w.ready_at(item.key, timeout_s=600)
      begin = item.dispatched_at if prev_ready is None else max(item.dispatched_at, prev_ready)
      micro_s.append(ready - begin)
      prev_ready = ready
    update_start = max(update.dispatched_at, last_ready)
    update_s = update_ready - update_start
    if first_dispatch is not None:
      idle = max(0.0, first_dispatch - update_ready)
      strict = idle + max(0.0, update.dispatched_at - last_ready)
    else:
      idle = strict = None
    step_start = self._last_update_ready
    if step_start is None:
      step_start = w.get(("fwd_bwd", k, 0)).dispatched_at
    step_s = update_ready - step_start
    self._last_update_ready = update_ready
    plan = boundary.plan
    metrics = boundary.metrics or {}
    record = {
        "step": k,
        "mode": (plan.mode if plan else self.policy.mode).value,
        "staged": boundary.staged,
        "stage_before_update": bool(plan and plan.stage and plan.stage_before_update),
        "probe": bool(plan and plan.probe),
        "reason": plan.reason if plan else "last step",
        "stage_s": boundary.stage_s,
        "device_wait_s": boundary.device_wait_s,
        "low_wait": boundary.low_wait,
        "transition": boundary.transition,
        "update_s": update_s,
        "boundary_idle_s": idle,
        "boundary_idle_strict_s": strict,
        "step_s": step_s,
        "micro_batch_s": micro_s,
        "metrics_s": boundary.spans.get("metrics_s"),
        "metrics_wait_s": boundary.spans.get("metrics_wait_s"),
        "checkpoint_s": boundary.spans.get("checkpoint_s"),
        "weight_sync_s": boundary.spans.get("weight_sync_s"),
        "staged_digest": getattr(boundary.staged_input, "digest", None),
        "loss": metrics.get("loss"),
        "grad_norm": metrics.get("grad_norm"),
        "tokens": metrics.get("tokens"),
        "replays": metrics.get("replays"),
        "replayed_micro_batches": metrics.get("replayed_micro_batches"),
        "dropped_tokens": metrics.get("dropped_tokens"),
        "t_update_ready": update_ready - self._run_start,
        "t_next_first_dispatch": None if first_dispatch is None else first_dispatch - self._run_start,
    }
    self.records.append(record)
    if self._records_file:
      self._records_file.write(json.dumps(record) + "\n")
      self._records_file.flush()
    if self.on_step:
      self.on_step(record)

  def _finish(self) -> None:
    if self._pending is not None:
      pending, self._pending = self._pending, None
      self._boundary_work(pending)
    if self._unfinished is not None:
      unfinished, self._unfinished = self._unfinished, None
      if unfinished.metrics is None:
        self._boundary_work(unfinished)
      self._finish_record(unfinished, first_dispatch=None)

  # ------------------------------------------------------------------ outputs
  def summary(self) -> dict:
    idles = [r["boundary_idle_s"] for r in self.records if r["boundary_idle_s"] is not None]
    stricts = [r["boundary_idle_strict_s"] for r in self.records if r["boundary_idle_strict_s"] is not None]
    steps = [r["step_s"] for r in self.records]
    digest_fn = getattr(self.worker.engine, "state_digest", None)
    return {
        "steps": len(self.records),
        "requested_mode": self.policy.requested_mode.value,
        "final_mode": self.policy.mode.value,
        "median_boundary_idle_s": statistics.median(idles) if idles else None,
        "median_boundary_idle_strict_s": statistics.median(stricts) if stricts else None,
        "median_step_s": statistics.median(steps) if steps else None,
        "staged_boundaries": sum(1 for r in self.records if r["staged"]),
        "auto_disables": self.policy.counters.get("auto_disable", 0),
        "transitions": [dataclasses.asdict(t) | {"from_mode": t.from_mode.value, "to_mode": t.to_mode.value}
                        for t in self.policy.history],
        "policy_counters": dict(self.policy.counters),
        "threshold_s": self.policy.threshold_s,
        "wait_floor_max_s": max(self.policy.floor_samples) if self.policy.floor_samples else None,
        "final_state_digest": digest_fn() if callable(digest_fn) else None,
        "records_path": str(self.out_dir / "records.jsonl") if self.out_dir else None,
    }

  def _write_trace(self) -> str | None:
    if not self.out_dir:
      return None
    from orchestrator.trace import chrome_trace  # pylint: disable=import-outside-toplevel

    path = self.out_dir / "trace.json"
    path.write_text(json.dumps(chrome_trace(self._watcher.items(), self.host_spans, self.records, self._run_start)))
    return str(path)


def format_table(records: Sequence[dict]) -> str:
  """The per-step table printed at the end of a run."""
  def f(x, width=9, prec=4):
    return f"{x:{width}.{prec}f}" if isinstance(x, (int, float)) and x is not None else f"{'-':>{width}}"

  header = (f"{'step':>4}  {'mode':<19} {'staged':<6} {'stage_s':>9} {'wait_s':>9} {'update_s':>9}"
            f" {'idle_s':>9} {'strict_s':>9} {'step_s':>9} {'loss':>9}")
  lines = [header, "-" * len(header)]
  for r in records:
    lines.append(
        f"{r['step']:>4}  {r['mode']:<19} {('yes' if r['staged'] else 'no'):<6} {f(r['stage_s'])}"
        f" {f(r['device_wait_s'])} {f(r['update_s'])} {f(r['boundary_idle_s'])}"
        f" {f(r['boundary_idle_strict_s'])} {f(r['step_s'])} {f(r['loss'])}"
    )
  return "\n".join(lines)


def format_summary(summary: dict) -> str:
  s = format_seconds

  lines = [
      f"mode: requested {summary['requested_mode']}, ended {summary['final_mode']}",
      f"median boundary idle: {s(summary['median_boundary_idle_s'])}"
      f" (strict: {s(summary['median_boundary_idle_strict_s'])})",
      f"median step: {s(summary['median_step_s'])} over {summary['steps']} steps",
      f"staged boundaries: {summary['staged_boundaries']}; auto-disables: {summary['auto_disables']}",
      f"low-wait threshold: {s(summary['threshold_s'])} (wait floor max {s(summary['wait_floor_max_s'])})",
      f"final state digest: {summary['final_state_digest']}",
  ]
  if summary.get("records_path"):
    lines.append(f"records: {summary['records_path']}")
  if summary.get("trace_path"):
    lines.append(f"trace: {summary['trace_path']} (open in ui.perfetto.dev)")
  return "\n".join(lines)

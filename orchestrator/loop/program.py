"""RLProgram: the optimizer-step loop, executing each step boundary the way the policy plans it.

At the boundary after step k the program asks the policy for a ``BoundaryPlan``
and executes ``policies.call_order.boundary_actions(plan)`` in order — the one
description of each mode's call order (docs/design.md §5). The pipelining that
is the point of the product is there: in every mode but OFF the list puts step
k+1's first dispatch before step k's metrics, checkpoint and weight sync.

Step k's micro-batches: the first is dispatched by the boundary before it (or
at the start of the run), the middle ones at the start of the step, the last
by the step's own boundary. With one micro-batch per step the first is the
last, so the boundary it belongs to is planned when it is dispatched.

A step whose loss or gradient norm is not finite ends the run there
(``NonFiniteStepError``, raised once the step's record is written): no
checkpoint of it or of any later step is written, so the checkpoints on disk
are all from steps whose metrics were finite (docs/resume.md).

The ``Recorder`` owns the measurements: completion stamps, host spans, records,
trace and summary. The ``StepFeed`` (``loop/feed.py``) owns the source side:
taking steps, their positions, and a live source's stop-aware waits, each
micro-batch waited for and fetched once. The ``BoundaryPlanner``
(``loop/planning.py``) plans each boundary: the policy's plan and the action
list. A ``BoundaryState`` (``loop/boundary.py``) holds what is known of one
boundary as its actions run.
``BoundaryWork`` (``loop/boundary_work.py``) does a boundary's work besides
dispatching — metrics, checkpoint, weight sync, evaluation — and what a
boundary that ends early still owes; it keeps the run's checkpoints.
The program reaches its trainer only through
``orchestrator.contract.Worker`` and its steps only through ``StepSource`` (and,
for a live source, ``LiveSource``); it imports nothing from ``orchestrator.engine``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from orchestrator.contract import RunSummary, StepMetrics, StepSource, Worker
from orchestrator.data.sources import as_step_source
from orchestrator.distributed.agreement import KeyValueAgreement, SingleProcess, agree_on_stop
from orchestrator.loop.boundary import BoundaryState
from orchestrator.loop.boundary_work import BoundaryWork
from orchestrator.loop.feed import StepFeed
from orchestrator.loop.job_timings import merge_process_timings
from orchestrator.loop.live_waits import SourceFailed, StopInsideStep, StoppedWithoutCheckpointError, StopWhileWaiting
from orchestrator.loop.planning import BoundaryPlanner
from orchestrator.loop.policy_inputs import PolicyInputs
from orchestrator.loop.recorder import BoundaryRecord, Recorder, Span, fwd_bwd_key, update_key
from orchestrator.loop.watcher import Watched
from orchestrator.loop.weight_sync import HostWeightStore
from policies import BoundaryPlan, StepBoundaryPolicy
from policies.call_order import Action

__all__ = ["ProgramConfig", "ProgramResult", "RLProgram", "HostWeightStore", "NonFiniteStepError",
           "StoppedWithoutCheckpointError"]


class NonFiniteStepError(RuntimeError):
  """Step ``step``'s loss or gradient norm is not finite: the run stopped after recording it.

  Attributes:
    step, loss, grad_norm: the step and what its metrics read.
    checkpoint_steps: the steps the last checkpoint covers (None: no checkpoint); every checkpoint was
      written before this step's metrics were read, and none after.
    checkpoint_path: where this run wrote that checkpoint (None: none written by this run, e.g. the
      checkpoint a resumed run started from).
  """

  def __init__(self, step: int, metrics: StepMetrics, checkpoint_steps: int | None, checkpoint_path: str | None):
    loss, grad_norm = metrics.loss, metrics.grad_norm
    self.step, self.loss, self.grad_norm = step, loss, grad_norm
    self.checkpoint_steps, self.checkpoint_path = checkpoint_steps, checkpoint_path
    if checkpoint_steps is None:
      last = "no checkpoint was written"
    else:
      last = f"the last checkpoint covers {checkpoint_steps} steps" + (f" ({checkpoint_path})" if checkpoint_path
                                                                          else "")
    super().__init__(f"step {step}'s loss is {loss} and its gradient norm {grad_norm}: not finite, so the run"
                     f" stopped there and wrote no checkpoint of it or later; {last}")


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
    start_step: steps already done (a resumed run): the loop runs steps
      ``start_step .. steps - 1`` and appends to ``records.jsonl``.
    run_id: saved with every checkpoint, so a checkpoint names its run.
    config_sha256: the run's recipe digest (config.json's), saved with every checkpoint, so a resume can tell
      an edited config.json even where its own digest was removed.
    stop_grace_s: once a stop is asked for, how long a checkpoint may still wait for the rollouts it
      must carry (a live source at staleness >= 1) before the run ends without it.
    checkpoint_last_step: a run that completes writes a checkpoint after its last step (when the engine can),
      whatever the cadence, so its final weights are kept; once, where the cadence wrote it already.
    eval_every: a live source evaluates held-out prompts after every N-th step (0: never during the run), as
      boundary work after the weight sync: ``eval_prompts`` prompts greedily, and pass@k with ``eval_pass_k``
      completions sampled per prompt (0: none). The step loop waits for it (the device still computes the
      next step's first micro-batch, dispatched before it in the pipelined modes).
  """

  steps: int
  micro_batches_per_step: int
  checkpoint_every: int = 0
  scored_checkpoint_steps: tuple[int, ...] = ()
  sync_before_next_step: bool = False
  calibration_samples: int = 8
  out_dir: str | None = None
  start_step: int = 0
  run_id: str | None = None
  config_sha256: str | None = None
  stop_grace_s: float = 5.0
  checkpoint_last_step: bool = False
  eval_every: int = 0
  eval_prompts: int = 0
  eval_pass_k: int = 0

  def __post_init__(self):
    if self.steps < 1:
      raise ValueError(f"steps must be >= 1, got {self.steps}")
    if not 0 <= self.start_step < self.steps:
      raise ValueError(f"start_step must be in [0, steps), got {self.start_step} of {self.steps}")
    if self.micro_batches_per_step < 1:
      raise ValueError(f"micro_batches_per_step must be >= 1, got {self.micro_batches_per_step}")
    if self.checkpoint_every < 0:
      raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")

  def checkpoint_due(self, steps_done: int) -> bool:
    every = self.checkpoint_every
    return bool(every and steps_done % every == 0) or steps_done in self.scored_checkpoint_steps

  def checkpoint_wanted(self, steps_done: int, stop: bool, can_checkpoint: bool) -> bool:
    """Whether the boundary after ``steps_done`` steps writes a checkpoint: the cadence's or a scored step's, a
    stop's, or a completed run's last (the last two only where the engine can write one)."""
    last = self.checkpoint_last_step and steps_done == self.steps
    return self.checkpoint_due(steps_done) or ((stop or last) and can_checkpoint)


@dataclasses.dataclass
class ProgramResult:
  records: list[BoundaryRecord]
  summary: RunSummary | None
  records_path: str | None
  trace_path: str | None
  watched: list[Watched] = dataclasses.field(default_factory=list)  # completion stamps, dispatch order
  host_spans: list[Span] = dataclasses.field(default_factory=list)
  run_start: float = 0.0
  ended: str = "completed"  # or "stopped": a stop was asked for and honoured at a boundary
  stop_reason: str | None = None  # what asked for the stop (a signal's name), in whichever process it came
  last_step: int | None = None
  checkpoint_path: str | None = None  # the last checkpoint written


class RLProgram:
  """Drives a ``Worker`` through ``config.steps`` optimizer steps.

  Args:
    worker: the trainer (``orchestrator.contract.Worker``).
    policy: plans every boundary (its capability fallback already applied).
    source: a ``StepSource``, or any iterable of steps (each a sequence of
      ``micro_batches_per_step`` payloads; it then has no position to save).
      Which contract parts it has is checked once, here (``live_part``).
    config: the loop's settings.
    weight_sync: called as ``weight_sync(step, weights)`` after each step
      (default: a live source's own ``sync``, else ``HostWeightStore``).
    on_step: called with each finished ``BoundaryRecord`` (progress display). clock: seconds, monotonic.
    stop_requested: polled when each boundary is planned and while rollouts are
      awaited (``LiveWaits``); once it returns True that step is the last: its
      update is applied, a checkpoint is written (when the engine can, else
      ``StoppedWithoutCheckpointError``) and the run ends ``ended="stopped"``.
    previous_records: records of the steps before ``config.start_step`` (a
      resumed run), so the summary covers the whole run.
    first_plan: the plan a resumed run's first boundary was already given
      before the checkpoint (with one micro-batch per step it is planned
      inside the previous boundary), so the policy is not asked twice.
    agreement: in a job of several processes, what keeps every process on
      one path (``orchestrator.distributed.agreement``): the wait floor, a
      stop and each boundary's measurements are combined before the policy
      sees them (docs/distributed.md). Default: one process, nothing exchanged.
  """

  def __init__(self, worker: Worker, policy: StepBoundaryPolicy, source: StepSource | Iterable[Sequence[Any]],
               config: ProgramConfig, *, weight_sync: Callable[[int, Any], None] | None = None,
               on_step: Callable[[BoundaryRecord], None] | None = None,
               clock: Callable[[], float] = time.perf_counter,
               stop_requested: Callable[[], bool] | None = None,
               previous_records: Sequence[BoundaryRecord] = (), first_plan: BoundaryPlan | None = None,
               agreement: SingleProcess | None = None):
    self.worker = worker
    self.agreement = agreement or SingleProcess()
    self.policy = policy
    self.config = config
    self.stop_requested = stop_requested or (lambda: False)
    # A stop in a live source's waits names the latest checkpoint: ``work``'s, built below on this feed.
    self.feed = StepFeed(as_step_source(source), micro_batches_per_step=config.micro_batches_per_step,
                         start_step=config.start_step, steps=config.steps, stop_requested=self.stop_requested,
                         grace_s=config.stop_grace_s, latest=lambda: self.work.latest_checkpoint(),
                         local_stops=self.agreement.num_processes == 1)
    self.source, self.live = self.feed.source, self.feed.live
    self.clock = clock
    # the sampler's call spans are on perf_counter's time: a program on another clock (a test's) cannot ask
    on_devices = (self.live.sampling_on_trainer_devices_s
                  if self.live is not None and clock is time.perf_counter else None)
    self.recorder = Recorder(clock, config.micro_batches_per_step, config.out_dir, on_step,
                             previous_records=previous_records, sampling_on_devices=on_devices)
    self.policy_inputs = PolicyInputs(policy, worker, self.recorder, self.agreement,
                                      micro_batches_per_step=config.micro_batches_per_step)
    self.work = BoundaryWork(worker=worker, recorder=self.recorder, clock=clock, weight_sync=weight_sync,
                             feed=self.feed, policy=policy, policy_inputs=self.policy_inputs, config=config,
                             stop_requested=self.stop_requested)
    self.planner = BoundaryPlanner(policy=policy, policy_inputs=self.policy_inputs, feed=self.feed, config=config,
                                   first_plan=first_plan, one_process=not isinstance(self.agreement, KeyValueAgreement))
    self.current_step: int | None = None  # the step being run (for error messages)
    self._boundaries: dict[int, BoundaryState] = {}
    self._result = ProgramResult([], None, None, None)

  @property
  def records(self) -> list[BoundaryRecord]:
    return self.recorder.records

  @property
  def steps_done(self) -> int:
    """The steps finished so far, a resumed run's earlier ones included (its records, at their boundaries)."""
    last = self._result.last_step
    return self.config.start_step if last is None else last + 1

  def calibrate(self) -> float | None:
    """Samples the wait floor (nothing in flight) and calibrates the policy; returns the threshold."""
    return self.policy_inputs.calibrate(self.config.calibration_samples)

  def run(self) -> ProgramResult:
    """Runs every step; returns records and summary. On an error, what was recorded is kept."""
    self.recorder.start()
    try:
      self.calibrate()
      self._loop()
    except SourceFailed as failed:  # before any boundary was open (the run's first step)
      raise failed.error from None
    finally:
      trace_path = self.recorder.close()
    result = self._result
    result.checkpoint_path = self.work.checkpoint_path
    summary = self.recorder.summary(self.policy.report(), self.worker.state_digest()).replace(
        trace_path=trace_path, ended=result.ended, last_step=result.last_step, checkpoint_path=result.checkpoint_path)
    if isinstance(self.agreement, KeyValueAgreement):  # a job's: what agreeing cost, every process's timings
      summary = merge_process_timings(self.agreement, self.recorder, summary, trace_path)
    result.records, result.summary = self.records, summary
    result.records_path, result.trace_path = summary.records_path, trace_path
    result.watched, result.host_spans = self.recorder.watched(), list(self.recorder.spans)
    result.run_start = self.recorder.run_start
    return result

  def _loop(self) -> None:
    m, first = self.config.micro_batches_per_step, self.config.start_step
    self.current_step = first
    try:
      self._dispatch_micro(first, 0, self.feed.micro_batch(first, 0))
      for k in range(first, self.config.steps):
        if not self._step(k, m):
          return
    except StopInsideStep as stop:  # step k waited for a later micro-batch: the run ends after step k - 1
      self._end_inside(stop)

  def _step(self, k: int, m: int) -> bool:
    """Runs step k's middle micro-batches and its boundary; whether the run goes on."""
    self.current_step = k
    for i in range(1, m - 1):
      self._dispatch_micro(k, i, self.feed.micro_batch(k, i))
    boundary = self._boundaries.get(k) or self._open_boundary(k)
    for done, action in enumerate(boundary.actions):
      try:
        self._execute(action, boundary)
      except (StopWhileWaiting, SourceFailed) as stop:  # for step k+1's rollouts: it was never dispatched
        self._end_after(boundary, stop, boundary.actions[:done])
        break
      if boundary.non_finite:  # nothing more of this run: no checkpoint, no sync, no next step
        break
    boundary.rollout = self.live.step_stats(k) if self.live is not None else None
    ended = boundary.failed is not None or boundary.non_finite or boundary.stop
    self.recorder.finish_record(boundary, boundary.first_dispatch,
                                before_keeping=None if ended else self.policy_inputs.observe_saving)
    del self._boundaries[k]
    self.feed.forget(k)
    self._result.last_step = k
    if boundary.failed is not None:  # step k's record is written; the failure names the step it sampled
      raise boundary.failed.error
    if boundary.non_finite:
      raise NonFiniteStepError(k, boundary.metrics, self.work.checkpoint_steps, self.work.checkpoint_path)
    if boundary.stop:
      self._result.ended = "stopped"
      return False
    return True

  def _end_inside(self, stop: StopInsideStep) -> None:
    """A stop while step k waited for one of its later micro-batches: the run ends after step k - 1, as a stop
    at that boundary would have (checkpointed where the engine can: ``BoundaryWork.checkpoint_finished``, which
    refuses where this run finished no step); step k's dispatched micro-batches are dropped, never applied (no
    checkpoint holds a half-trained step)."""
    k, reason = stop.step, stop.reason
    self._result.stop_reason, self.current_step = reason, k - 1
    self.work.checkpoint_finished(k, reason, self._planned(k))
    self._result.ended = "stopped"

  def _planned(self, step: int) -> BoundaryPlan | None:
    """The plan of the boundary after ``step`` where it is planned already (None: not yet, or no plan): a
    checkpoint written after it was planned keeps it, so a resume does not ask the policy twice."""
    planned = self._boundaries.get(step)
    return planned.plan if planned else None

  def _end_after(self, boundary: BoundaryState, why: StopWhileWaiting | SourceFailed,
                 executed: tuple[Action, ...]) -> None:
    """Ends the run after step k as a stop at its planning would: update applied, then the boundary work it owes
    (``BoundaryWork.owed``: metrics read, checkpointed); after a failed source (step k+1's rollouts), not
    checkpointed (nothing can sync to it) but recorded."""
    failed = isinstance(why, SourceFailed)
    reason = "a failed rollout source" if failed else why.reason
    if failed:
      boundary.failed = why
    else:
      self.current_step, self._result.stop_reason, boundary.stop = boundary.step, reason, True
    ran = [Action.DEFERRED_UPDATE] if self.worker.update_owed else []
    if ran:  # staged before the update: the update waited behind the stage
      self._watch_update(boundary.step, self.worker.apply_deferred_update().update)
    ran += self.work.owed(boundary, failed=failed, stop_reason=self._result.stop_reason,
                          next_plan=self._planned(boundary.step + 1))
    boundary.ended_waiting(reason, (*executed, *ran))

  def _open_boundary(self, k: int) -> BoundaryState:
    """Plans the boundary after step k (just before its last micro-batch is dispatched), once any process's stop
    is agreed (every process then stops after step k)."""
    if self.live is not None:
      self.live.check()  # a failed rollout thread surfaces here, at the boundary
    stop = k + 1 < self.config.steps and self._agreed_stop(k)
    self._boundaries[k] = self.planner.plan(k, stop=stop)
    return self._boundaries[k]

  def _agreed_stop(self, k: int) -> bool:
    """Whether any process was asked to stop (every process then stops after step k)."""
    reason = agree_on_stop(self.agreement, k, self.stop_requested())
    self._result.stop_reason = reason or self._result.stop_reason
    return reason is not None

  def _dispatch_micro(self, k: int, i: int, payload: Any, *, staged: bool = False) -> float:
    """Dispatches micro-batch i of step k (the step's last defers its update where the plan says); a staged
    dispatch sends the staged input and takes no ``payload``."""
    defer = False
    if i == self.config.micro_batches_per_step - 1:
      boundary = self._boundaries.get(k) or self._open_boundary(k)
      boundary.last_dispatched = True
      defer = boundary.actions[0] is Action.DISPATCH_LAST_DEFERRED
    start = self.clock()
    if staged:
      receipt = self.worker.fwd_bwd_staged(defer_update=defer)
    else:
      receipt = self.worker.fwd_bwd(payload, defer_update=defer)
    self.recorder.watch(fwd_bwd_key(k, i), receipt, kind="fwd_bwd", step=k, micro_step=i)
    self.recorder.dispatch_spans(start, self.clock(), receipt)
    return receipt.dispatched_at

  def _next_step_first(self, boundary: BoundaryState) -> Any:
    """Step k+1's first micro-batch, for the stage or the dispatch (whichever takes it: one fetch)."""
    payload = self.feed.micro_batch(boundary.step + 1, 0)
    boundary.rollout_wait_s = self.feed.rollout_wait_s(boundary.step + 1)
    return payload

  def _execute(self, action: Action, boundary: BoundaryState) -> None:
    """Runs one action of ``boundary``'s list (see ``policies.call_order``)."""
    k, m = boundary.step, self.config.micro_batches_per_step
    if action in (Action.DISPATCH_LAST, Action.DISPATCH_LAST_DEFERRED):
      if not boundary.last_dispatched:  # with M = 1 the boundary before dispatched it as a first
        self._dispatch_micro(k, m - 1, self.feed.micro_batch(k, m - 1))
    elif action is Action.STAGE_FIRST:
      boundary.stage = self.worker.stage_fwd_bwd(self._next_step_first(boundary))
      self.recorder.stage_span(boundary.stage)
    elif action is Action.DEFERRED_UPDATE:
      applied = self.worker.apply_deferred_update()
      boundary.device_wait_s = applied.device_wait_s
      if applied.update_returned_at is not None:  # the update first, queued behind the last micro-batch
        self.recorder.span("update dispatch", applied.wait_started_at, applied.update_returned_at)
        self.recorder.span("wait for device", applied.update_returned_at, self.clock())
      else:
        waited_until = applied.wait_started_at + applied.device_wait_s
        self.recorder.span("wait for device", applied.wait_started_at, waited_until)
        self.recorder.span("update dispatch", waited_until, self.clock())
      self._watch_update(k, applied.update)
      # Observe (an exchange between processes) after the next dispatch, off the idle path; with M = 1 that
      # dispatch plans the next boundary, which needs the observation.
      boundary.observe_after_dispatch = m > 1 and any(a.dispatches_first for a in boundary.actions)
      if not boundary.observe_after_dispatch:
        self.policy_inputs.observe(boundary)
    elif action is Action.UPDATE:
      start = self.clock()
      self._watch_update(k, self.worker.update())
      self.recorder.span("update dispatch", start, self.clock())
    elif action.dispatches_first:
      self.current_step = k + 1
      staged = action is Action.DISPATCH_FIRST_STAGED  # its input is the stage's: no payload to fetch
      boundary.first_dispatch = self._dispatch_micro(
          k + 1, 0, None if staged else self._next_step_first(boundary), staged=staged)
      self.current_step = k
      if boundary.observe_after_dispatch:
        self.policy_inputs.observe(boundary)
    else:  # the boundary work: the metrics, the checkpoint and the weight sync
      self.work.run(action, boundary, stop_reason=self._result.stop_reason, next_plan=self._planned(k + 1))

  def _watch_update(self, k: int, receipt) -> None:
    self.recorder.watch(update_key(k), receipt, kind="update", step=k, micro_step=-1)

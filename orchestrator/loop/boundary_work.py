"""BoundaryWork: what a step boundary does besides dispatching — step k's metrics, its checkpoint, the weight
sync and the held-out evaluation after it.

This is the work PIPELINED moves behind step k+1's first dispatch (``policies.call_order``): the program runs
the boundary's actions in their order and hands these to ``BoundaryWork`` (``run``), which reads and writes
through the worker, the recorder (spans, records on disk before a checkpoint) and the feed (the source's
position, a live source's waits for the rollouts a checkpoint carries). A boundary that ends early — a stop or
a failed source while step k+1's rollouts were awaited, a stop inside a step — ends here too: the work it still
owes, or the checkpoint of the steps finished before it. ``BoundaryWork`` keeps what the run's checkpoints were
(the last one's path and the steps it covers), so it also says where a run that cannot checkpoint continues
from (``latest_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from orchestrator.contract import WeightsOverWire, WeightTransfer, Worker
from orchestrator.loop.boundary import BoundaryState
from orchestrator.loop.live_waits import StoppedWithoutCheckpointError, latest_checkpoint
from orchestrator.loop.recorder import Lane, Recorder, update_key
from orchestrator.loop.weight_sync import HostWeightStore
from policies import BoundaryPlan
from policies.call_order import Action


class BoundaryWork:
  """The boundary work of one run.

  Args:
    worker: the trainer. recorder: the run's measurements. clock: seconds, monotonic.
    weight_sync: called as ``weight_sync(done, weights)`` after each step (None: the feed's live source's own
      ``sync``, else a ``HostWeightStore``).
    feed: the run's ``StepFeed`` (positions; a live source's waits and evaluations).
    policy, policy_inputs: the policy (its state goes in a checkpoint) and what feeds it (a stage judged when
      the metrics are read).
    config: the loop's ``ProgramConfig``.
    stop_requested: the program's stop flag (an evaluation gives up on a stop).

  Attributes:
    checkpoint_path: the last checkpoint this run wrote (None: none yet).
    checkpoint_steps: the steps the last checkpoint covers (a resumed run's: the one it started from; None:
      none).

  Raises:
    ValueError: ``config`` asks for checkpoints (a cadence, scored steps) and the worker's engine cannot write
      them.
  """

  def __init__(self, *, worker: Worker, recorder: Recorder, clock: Callable[[], float],
               weight_sync: Callable[[int, Any], Any] | None = None, feed=None, policy=None, policy_inputs=None,
               config=None, stop_requested: Callable[[], Any] = lambda: None):
    if weight_sync is None:
      weight_sync = feed.live.sync if feed is not None and feed.live is not None else HostWeightStore()
    self.worker, self.recorder, self.clock, self.weight_sync = worker, recorder, clock, weight_sync
    self.feed, self.policy, self.policy_inputs, self.config = feed, policy, policy_inputs, config
    self.stop_requested = stop_requested
    self.checkpoint_path: str | None = None
    self.checkpoint_steps: int | None = (config.start_step or None) if config is not None else None
    if (config is not None and (config.checkpoint_every or config.scored_checkpoint_steps)
        and not worker.capabilities.can_checkpoint):
      raise ValueError("checkpoints are asked for (checkpoint_every / scored_checkpoint_steps) but the engine"
                       " has no save_checkpoint / restore_checkpoint; turn checkpoints off or use an engine"
                       " that can write them")

  def run(self, action: Action, boundary: BoundaryState, *, stop_reason: str | None,
          next_plan: BoundaryPlan | None) -> None:
    """Runs ``action`` of ``boundary``'s list where it is boundary work (``Action.METRICS``,
    ``Action.CHECKPOINT_AND_SYNC``): step k's metrics (read already where a checkpoint came first), or its
    checkpoint and weight sync (``checkpoint_and_sync``; ``next_plan``: the next boundary's plan, made before
    this checkpoint with one micro-batch per step)."""
    if action is Action.METRICS:
      if boundary.metrics is None:  # read already where a checkpoint came first (sync_before_next_step)
        self.read_metrics(boundary)
    elif action is Action.CHECKPOINT_AND_SYNC:
      self.checkpoint_and_sync(boundary, stop_reason=stop_reason, next_plan=next_plan)

  def owed(self, boundary: BoundaryState, *, failed: bool, stop_reason: str | None,
           next_plan: BoundaryPlan | None) -> list[Action]:
    """The work ``boundary`` still owes when it ends while step k+1's rollouts are awaited (its update applied):
    step k's metrics where they were not read, and its checkpoint and sync where none was written — not after a
    failed source (``failed``: nothing can sync to it), nor after a step whose metrics are not finite. Returns the
    actions it ran, in order."""
    ran = []
    if boundary.metrics is None:
      self.read_metrics(boundary)
      ran.append(Action.METRICS)
    if boundary.non_finite:  # never saved, never synced: the run ends with the step's error
      return ran
    if not (boundary.checkpoint_path or failed):
      self.checkpoint_and_sync(boundary, stop_reason=stop_reason, next_plan=next_plan)
      ran.append(Action.CHECKPOINT_AND_SYNC)
    return ran

  def read_metrics(self, boundary: BoundaryState) -> None:
    """Reads step k's metrics (blocks until update k is done); a stage after the update is judged here."""
    start = self.clock()
    metrics = self.worker.get_metrics()
    end = self.clock()
    key = update_key(boundary.step)
    self.recorder.observe_ready(key, end)
    update_ready = self.recorder.ready_at(key)
    self.recorder.span(f"metrics {boundary.step}", start, end, Lane.BOUNDARY_WORK)
    if boundary.metrics_read(metrics, started_at=start, ended_at=end, update_ready_at=update_ready):
      self.policy_inputs.observe(boundary)

  def metadata(self, done: int, pending_record: dict[str, Any] | None = None,
               next_plan: BoundaryPlan | None = None) -> dict[str, Any]:
    """What a checkpoint after ``done`` steps holds beside the engine state: the whole run's state (the step,
    the run's id, the policy's state, the source's position before step ``done``, ``next_plan``: the next
    boundary's plan when it was made before the checkpoint) and ``pending_record``: step ``done - 1``'s record
    as known at the save (a resume restores it if a kill came between the checkpoint and that record's line)."""
    config, policy = self.config, self.policy
    return {"step": done, "run_id": config.run_id, "config_sha256": config.config_sha256, "mode": policy.mode.value,
            "scored": done in config.scored_checkpoint_steps, "records_count": done,
            "source_state": self.feed.position_before(done), "policy_state": policy.state_dict(),
            "next_plan": next_plan.to_json() if next_plan else None, "pending_record": pending_record}

  def checkpoint_and_sync(self, boundary: BoundaryState, *, stop_reason: str | None,
                          next_plan: BoundaryPlan | None) -> None:
    """Step k's checkpoint where one is wanted (``ProgramConfig.checkpoint_wanted``; a live source's rollouts
    it carries waited for first), then its weight sync and the evaluation after it. ``stop_reason``: what asked
    for the stop that makes this the run's last boundary (None: no stop)."""
    done = boundary.step + 1
    if self.config.checkpoint_wanted(done, boundary.stop, self.worker.capabilities.can_checkpoint):
      if boundary.metrics is None:  # sync_before_next_step: read them first (the save waits for the update too)
        self.read_metrics(boundary)
        if boundary.non_finite:  # never saved
          return
      boundary.checkpoint_path = self._save(done, boundary.step, stop_reason if boundary.stop else None,
                                            lambda: self.recorder.provisional_record(boundary), next_plan,
                                            spans=boundary.spans)
    weights = self.sync(boundary.spans, done)
    self.evaluate(weights, done, boundary.spans)

  def checkpoint_finished(self, done: int, stop_reason: str, next_plan: BoundaryPlan | None) -> None:
    """A stop (``stop_reason``: what asked) while step ``done`` waited for one of its later micro-batches: the
    checkpoint after the ``done`` steps finished (whose last record is on disk already), unless the last
    checkpoint is that one or the engine writes none. ``next_plan``: step ``done``'s boundary's, where it was
    planned before its last micro-batch (a resume must not plan it again).

    Raises:
      StoppedWithoutCheckpointError: this run finished no step before step ``done`` (it is the run's first):
        nothing of it to checkpoint; the message names the latest checkpoint.
    """
    if done == self.config.start_step:
      line, resumable = self.latest_checkpoint()
      raise StoppedWithoutCheckpointError(f"stopped by {stop_reason} while step {done} waited for its rollouts,"
                                          f" before this run finished a step; {line}", resumable=resumable)
    if self.checkpoint_steps == done or not self.worker.capabilities.can_checkpoint:
      return
    last_record = self.recorder.records[-1].to_json()
    self._save(done, done - 1, stop_reason, lambda: last_record, next_plan)

  def latest_checkpoint(self) -> tuple[str, bool]:
    """Where this run continues from if it cannot checkpoint its last steps (``live_waits.latest_checkpoint``):
    the line's end, and whether there is such a checkpoint."""
    return latest_checkpoint(self.recorder.records, written=self.checkpoint_path,
                             written_steps=self.checkpoint_steps, resumed_from=self.config.start_step)

  def _save(self, done: int, step: int, stopping: str | None, pending_record: Callable[[], dict[str, Any]],
            next_plan: BoundaryPlan | None, *, spans: dict | None = None) -> str:
    """Writes the checkpoint after ``done`` steps (``step``: the last of them) once a live source has the
    rollouts it carries; every record before it is on disk first. Its seconds, the wait not counted, go in
    ``spans["checkpoint_s"]``. Returns its path."""
    if self.feed.waits is not None:  # the rollouts it carries (docs/resume.md)
      self.feed.waits.checkpoint(step, stopping)
    start = self.clock()
    self.recorder.sync_records()
    path = self.worker.save_checkpoint(self.metadata(done, pending_record(), next_plan))
    self.checkpoint_path, self.checkpoint_steps = path, done
    end = self.clock()
    if spans is not None:
      spans["checkpoint_s"] = end - start
    self.recorder.span(f"checkpoint {done}", start, end, Lane.BOUNDARY_WORK)
    return path

  def sync(self, spans: dict, done: int) -> Any:
    """Step ``done - 1``'s weight sync: the weights exported and handed to ``weight_sync``.

    Its seconds go in ``spans["weight_sync_s"]``. A sync that copies the weights onto a sampler's own devices
    says what it moved (a ``WeightTransfer``): its bytes and seconds go in the record too, and the transfer
    gets a span of its own inside the sync's. So does the export of a trainer in another process
    (``WeightsOverWire``), which is the weights crossing the wire: the reply's bytes and the call's seconds.
    Returns the weights exported.
    """
    clock, recorder = self.clock, self.recorder
    start = clock()
    weights = self.worker.export_weights()
    wired = self.worker.last_export if isinstance(self.worker, WeightsOverWire) else None
    moved = self.weight_sync(done, weights)
    end = clock()
    spans["weight_sync_s"] = end - start
    recorder.span(f"weight sync {done}", start, end, Lane.BOUNDARY_WORK)
    if isinstance(wired, WeightTransfer):
      spans["weight_sync_wire_bytes"] = wired.bytes
      spans["weight_sync_wire_s"] = wired.seconds
      recorder.span(f"weight wire transfer {done}", wired.started_at, wired.ended_at, Lane.BOUNDARY_WORK)
    if isinstance(moved, WeightTransfer):
      spans["weight_sync_bytes"] = moved.bytes
      spans["weight_transfer_s"] = moved.seconds
      recorder.span(f"weight transfer {done}", moved.started_at, moved.ended_at, Lane.BOUNDARY_WORK)
    return weights

  def evaluate(self, weights: Any, done: int, spans: dict) -> None:
    """The held-out evaluation of the weights after ``done`` steps, where ``config.eval_every`` asks for one
    then (and the source is live), after the weight sync: on the live source's sampler in its turn (a stop
    asked for while it waits skips it). Its figures and seconds go in ``spans`` (step ``done - 1``'s record)
    and a span of the trace."""
    live, config = self.feed.live, self.config
    if live is None or not (config.eval_every and config.eval_prompts and done % config.eval_every == 0):
      return
    start = self.clock()
    score = live.evaluate(weights, done, config.eval_prompts, pass_k=config.eval_pass_k, stop=self.stop_requested)
    end = self.clock()
    if score is None:
      return
    spans.update(eval_s=end - start, eval_accuracy=score.accuracy, eval_pass_at_k=score.pass_at_k)
    self.recorder.span(f"evaluation {done}", start, end, Lane.BOUNDARY_WORK)

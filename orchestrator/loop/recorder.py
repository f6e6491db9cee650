"""The run's recorder: completion stamps, host spans, one ``BoundaryRecord`` per step, outputs.

The program tells the recorder what it dispatched (receipts) and what the host
did (spans); the recorder's ``CompletionWatcher`` stamps when each computation
became ready, off the hot path. From those it builds each step's record
(``records.jsonl``), the run's Chrome/Perfetto trace (``trace.json``) and the
summary. Formatting for people (the table, the summary lines) lives with the CLI.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import socket
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

from orchestrator.contract import Receipt, RolloutSummary, RunSummary, StepMetrics, StepTimings
from orchestrator.loop.trace import chrome_trace
from orchestrator.loop.watcher import CompletionWatcher, Watched
from policies import PolicyReport
from policies.saving import estimate_from_records

#: How long the recorder waits for a computation's ready stamp before it gives up. A bound, not an expected
#: wait: the stamps a record asks for are of computations the loop has seen finish (their metrics read, or a
#: later computation's), so they come within the watcher's wake-up; at close, work still in flight (a failed
#: step's) gets this long to finish before the trace is written. Ten minutes is far beyond any one step's
#: computation here, so a stamp that takes longer is a stuck watcher, and the run ends naming it, not hangs.
STAMP_TIMEOUT_S = 600


class Lane(enum.IntEnum):
  """Host threads of the trace: the step loop, and the boundary work it runs."""

  STEP_LOOP = 0
  BOUNDARY_WORK = 1


@dataclasses.dataclass(frozen=True)
class Span:
  """Host time spent on one thing (seconds on the run's clock)."""

  name: str
  start: float
  end: float
  lane: Lane = Lane.STEP_LOOP
  args: dict | None = None  # shown with the span in the trace (a stage's bytes by field)


@dataclasses.dataclass
class BoundaryRecord:
  """Everything measured about one optimizer step and the boundary after it (docs/design.md §6).

  Times ending in ``_s`` are seconds; ``t_*`` are seconds since the run started.
  ``boundary_idle_s`` is the gap between update k finishing and step k+1's
  first micro-batch being dispatched; ``boundary_idle_strict_s`` adds idle
  between the last micro-batch finishing and the update's dispatch. Both are
  None after the last step.

  Device memory, per device of this process in device-id order (lists), where a boundary staged:
  ``staged_bytes_per_device`` is what the staged input holds (None: the engine does not say), and
  ``staged_bytes_by_field`` the same by input field, over this process's devices,
  ``device_bytes_in_use`` and ``device_bytes_limit`` what the allocator reported right after the stage
  (None: the backend does not report it, e.g. CPU). ``device_free_bytes`` is the free memory of the
  fullest device (over every process) the plan was given, on any boundary the memory gate looked at.
  """

  step: int
  mode: str
  staged: bool
  stage_before_update: bool
  probe: bool
  reason: str
  actions: list[str]
  stage_s: float | None
  device_wait_s: float | None
  low_wait: bool | None
  transition: str | None
  update_s: float
  boundary_idle_s: float | None
  boundary_idle_strict_s: float | None
  step_s: float
  micro_batch_s: list[float]
  metrics_s: float | None
  metrics_wait_s: float | None
  checkpoint_s: float | None
  checkpoint_path: str | None
  weight_sync_s: float | None
  staged_digest: str | None
  loss: float | None
  grad_norm: float | None
  tokens: int | None
  reruns: int | None
  rerun_micro_batches: list[int] | None
  dropped_tokens: list[int] | None
  t_update_ready: float
  t_next_first_dispatch: float | None
  # A live source: whether the next step could be staged, what waiting for it cost, what was sampled.
  next_ready: bool | None = None
  rollout_wait_s: float | None = None
  weights_version: int | None = None
  staleness: int | None = None
  reward_mean: float | None = None
  reward_std: float | None = None
  accuracy: float | None = None
  sampled_tokens_per_s: float | None = None
  micro_batch_wait_s: float | None = None  # inside the step: waits for its micro-batches after the first
  # Several processes: each process's stage_s and device_wait_s, in process order (the policy saw the max).
  per_process: dict | None = None
  # Restored from the checkpoint after this step (the run was killed before writing it): what the record knew
  # when the checkpoint was saved; the checkpoint's and weight sync's own times, and what came after, are None.
  restored_from_checkpoint: int | None = None
  staged_bytes_per_device: list[int] | None = None
  staged_bytes_by_field: dict[str, int] | None = None  # the same bytes by input field (their sum over devices)
  device_bytes_in_use: list[int] | None = None
  device_bytes_limit: list[int] | None = None
  device_free_bytes: int | None = None
  # The weight sync to a sampler on devices of its own (rollouts.placement: split): the bytes written there
  # and the transfer's seconds (part of weight_sync_s). None where the sync copies to host memory.
  weight_sync_bytes: int | None = None
  weight_transfer_s: float | None = None
  # The weight sync from a trainer in another process (trainer.location: remote): the bytes of the export's
  # reply as received and the export call's seconds (part of weight_sync_s). None for a trainer in this process.
  weight_sync_wire_bytes: int | None = None
  weight_sync_wire_s: float | None = None
  # A control: a boundary that would have staged ran unstaged, to measure what staging saves (None: a record of a
  # version before controls).
  control: bool | None = None
  # The measured step saving (control − staged, mean seconds) the policy judged by once this step was in; None
  # until enough controls since staging last turned on (policies.saving).
  saving_s: float | None = None
  # The learning rate the step's update used (engine.lr_schedule), the policy's mean entropy over the step's
  # completion tokens and the share of them the ratio's clip bound; None where the engine does not say.
  learning_rate: float | None = None
  entropy: float | None = None
  clip_fraction: float | None = None
  kl: float | None = None  # the mean KL to the reference (engine.kl_beta > 0)
  # A live source: the step's rewards' range, its completions' lengths and the share cut at the length limit
  # (RolloutStats; None for fixed-length answers).
  reward_min: float | None = None
  reward_max: float | None = None
  completion_tokens_mean: float | None = None
  completion_tokens_max: int | None = None
  truncated_fraction: float | None = None
  # An evaluation after this step (task.eval_every): the weights after step + 1 updates on held-out prompts,
  # greedy, and pass@k over eval_pass_k sampled completions per prompt; eval_s: how long the step loop waited
  # for it. None where the step had none.
  eval_accuracy: float | None = None
  eval_pass_at_k: float | None = None
  eval_s: float | None = None
  # What the step took of the devices (``StepMetrics``): the fullest device's peak memory so far (None: not
  # reported, as on a CPU), the programs compiled since the last step's metrics, the step's model FLOPs and
  # their share of the devices' peak over step_s (MFU; None where the peak is unknown).
  device_peak_bytes: int | None = None
  compiles: int | None = None
  model_flops: float | None = None
  mfu: float | None = None
  # The sampler's log-probs against the trainer's (``StepMetrics.ppo_kl``, verl's): 0 on the sampler's weights.
  ppo_kl: float | None = None
  # A live source: the mean of the step's per-group reward stds, and the share of its groups whose rewards are
  # all equal (no gradient) (RolloutStats).
  reward_group_std: float | None = None
  frac_reward_zero_std: float | None = None
  # A live source with in-flight updates: the oldest and newest version of the step's completion tokens, and their
  # mean age (the step minus the version, in updates) (RolloutStats; None without in-flight updates).
  token_version_min: int | None = None
  token_version_max: int | None = None
  token_age_mean: float | None = None
  # A live source: the seconds the sampler waited for a version's weight sync over the calls that sampled the
  # step's rollouts, before a batch and with in-flight updates between decode chunks (RolloutStats).
  sampler_sync_wait_s: float | None = None
  # A live source whose sampler computes on the trainer's devices (``rollouts.placement: shared``): the seconds of
  # the step (from the update before it to its own) in which a sampling call ran there, work no boundary mode
  # changes; None where the sampler computes elsewhere (LiveSource.sampling_on_trainer_devices_s).
  sampling_on_trainer_devices_s: float | None = None

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> "BoundaryRecord":
    """A record read back from ``records.jsonl`` (unknown keys are ignored, missing ones None)."""
    return cls(**{f.name: data.get(f.name) for f in dataclasses.fields(cls)})


def _memory_fields(boundary) -> dict[str, Any]:
  """The record's device-memory fields (``BoundaryRecord``) from the boundary's stage and headroom."""
  stage, headroom = boundary.stage, boundary.headroom
  memory = stage.memory if stage is not None else None
  held = stage.staged_bytes_per_device if stage is not None else None
  by_field = stage.staged_bytes_by_field if stage is not None else None
  return {"staged_bytes_per_device": None if held is None else list(held),
          "staged_bytes_by_field": None if by_field is None else dict(by_field),
          "device_bytes_in_use": None if memory is None else list(memory.bytes_in_use),
          "device_bytes_limit": None if memory is None else list(memory.bytes_limit),
          "device_free_bytes": None if headroom is None else headroom.free_bytes}


def _median_present(values) -> float | None:
  present = [v for v in values if v is not None]
  return statistics.median(present) if present else None


def _sum_present(values) -> int | None:
  present = [v for v in values if v is not None]
  return sum(present) if present else None


def _largest_by_field(values) -> dict[str, int] | None:
  """The largest staged input's bytes by field (inputs of one run have one shape: any staged one's), or None."""
  present = [v for v in values if v]
  return max(present, key=lambda v: sum(v.values())) if present else None


def _mfu(metrics: StepMetrics, step_s: float) -> float | None:
  """The step's model FLOPs over what the devices could compute in ``step_s`` (None: a figure unknown)."""
  if not metrics.model_flops or not metrics.peak_flops_per_s or step_s <= 0:
    return None
  return metrics.model_flops / (step_s * metrics.peak_flops_per_s)


def _peak(values) -> int | None:
  """The largest number in lists of numbers (None where every list is None)."""
  present = [max(v) for v in values if v]
  return max(present) if present else None


def fwd_bwd_key(step: int, micro_step: int) -> tuple:
  return ("fwd_bwd", step, micro_step)


def update_key(step: int) -> tuple:
  return ("update", step)


class Recorder:
  """Owns the completion watcher, the spans and the records of one run.

  Args:
    clock: the run's clock (seconds, monotonic).
    micro_batches_per_step: M.
    out_dir: where ``records.jsonl`` and ``trace.json`` go (None: not written).
    on_record: called with each finished record (progress display).
    sampling_on_devices: a live source's ``sampling_on_trainer_devices_s`` (on ``clock``'s time), which each
      record asks about its step's span; None: no source samples on the trainer's devices.
  """

  def __init__(self, clock: Callable[[], float], micro_batches_per_step: int, out_dir: str | None = None,
               on_record: Callable[[BoundaryRecord], None] | None = None, *,
               previous_records: Sequence[BoundaryRecord] = (),
               sampling_on_devices: Callable[[float, float], float | None] | None = None):
    self.clock = clock
    self._sampling_on_devices = sampling_on_devices
    self.m = micro_batches_per_step
    self.out_dir = Path(out_dir) if out_dir else None
    self.on_record = on_record
    self.records: list[BoundaryRecord] = list(previous_records)
    self._carried = len(self.records)  # a resumed run's earlier segments' records: this segment starts after
    self._append = bool(previous_records)
    self._first_own = len(self.records)  # records before it are an earlier segment's (their own clock and trace)
    self.spans: list[Span] = []
    self.run_start = 0.0
    self._watcher: CompletionWatcher | None = None
    self._records_file = None
    self._last_update_ready: float | None = None

  # ---------------------------------------------------------------- lifetime
  def start(self) -> None:
    if self.out_dir:
      self.out_dir.mkdir(parents=True, exist_ok=True)
      self._records_file = (self.out_dir / "records.jsonl").open("a" if self._append else "w")
    self._watcher = CompletionWatcher(self.clock)
    self.run_start = self.clock()
    self.wall_start = time.time()  # lines up the traces of a job's processes (one host, or NTP across hosts)

  def close(self) -> str | None:
    """Waits for every stamp, closes the records file, writes the trace; returns its path."""
    self._watcher.drain(timeout_s=STAMP_TIMEOUT_S)
    self._watcher.close()
    if self._records_file:
      self._records_file.close()
    if not self.out_dir:
      return None
    path = self.out_dir / "trace.json"
    path.write_text(json.dumps(self._trace()))
    return str(path)

  def _trace(self) -> dict[str, Any]:
    """This segment's trace: its own records only (an earlier segment's trace holds its steps, on its clock)."""
    return chrome_trace(self.watched(), self.spans, self.records[self._first_own:], self.run_start)

  def trace_events(self, limit: int) -> list[dict[str, Any]]:
    """This process's trace events (the last ``limit`` of them), for process 0 to merge into the run's trace."""
    events = self._trace()["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    timed = sorted((e for e in events if e["ph"] != "M"), key=lambda e: e["ts"])
    return meta + timed[-limit:]

  # ---------------------------------------------------------------- what happened
  def watch(self, key: Hashable, receipt: Receipt, *, kind: str, step: int, micro_step: int) -> None:
    self._watcher.watch(key, receipt.ready, kind=kind, step=step, micro_step=micro_step,
                        dispatched_at=receipt.dispatched_at)

  def span(self, name: str, start: float, end: float, lane: Lane = Lane.STEP_LOOP, args: dict | None = None) -> None:
    self.spans.append(Span(name, start, end, lane, args))

  def stage_span(self, stage) -> None:
    """A stage's span (a ``StageReceipt``), carrying what the staged input holds by field where it is known."""
    by_field = stage.staged_bytes_by_field
    args = None if by_field is None else {"bytes": sum(by_field.values()),
                                          **{f"bytes {name}": n for name, n in by_field.items()}}
    self.span("stage", stage.started_at, stage.ended_at, args=args)

  def dispatch_spans(self, start: float, end: float, receipt: Receipt) -> None:
    """Splits a ``fwd_bwd`` call into prepare / host wait / dispatch, as far as its receipt says."""
    if not receipt.host_seconds_known:
      self.span("fwd_bwd", start, end)
      return
    t = start
    for name, seconds in (("prepare", receipt.mapping_s + (receipt.placement_s or 0.0)),
                          ("host wait", receipt.host_wait_s)):
      if seconds > 0:
        self.span(name, t, min(end, t + seconds))
        t = min(end, t + seconds)
    self.span("dispatch", t, end)

  def sampling_on_devices_s(self, k: int) -> float | None:
    """The seconds a sampling call ran on the trainer's devices from step k's first dispatch until now; None
    where the sampler computes elsewhere (or the clock cannot say)."""
    if self._sampling_on_devices is None:
      return None
    first = self._watcher.get(fwd_bwd_key(k, 0))
    return None if first is None else self._sampling_on_devices(first.dispatched_at, self.clock())

  def ready_at(self, key: Hashable, timeout_s: float = STAMP_TIMEOUT_S) -> float:
    return self._watcher.ready_at(key, timeout_s=timeout_s)

  def observe_ready(self, key: Hashable, at: float) -> None:
    self._watcher.observe_ready(key, at)

  def watched(self) -> list[Watched]:
    return self._watcher.items()

  # ---------------------------------------------------------------- records
  def _micro_batch_seconds(self, k: int) -> list[float]:
    """Per micro-batch of step k: ready minus its start (dispatch, or the previous ready)."""
    out, prev_ready = [], self._last_update_ready
    for i in range(self.m):
      item = self._watcher.get(fwd_bwd_key(k, i))
      ready = self.ready_at(item.key)
      begin = item.dispatched_at if prev_ready is None else max(item.dispatched_at, prev_ready)
      out.append(ready - begin)
      prev_ready = ready
    return out

  def provisional_record(self, boundary) -> dict[str, Any]:
    """Step ``boundary.step``'s record as far as it is known now, as JSON, without keeping it: what a
    checkpoint saved before the record is written carries, so that a kill between the two loses no record."""
    return self._build_record(boundary, boundary.first_dispatch).to_json()

  def _build_record(self, boundary, first_dispatch: float | None) -> BoundaryRecord:
    k = boundary.step
    update = self._watcher.get(update_key(k))
    update_ready = self.ready_at(update_key(k))
    last_ready = self.ready_at(fwd_bwd_key(k, self.m - 1))
    micro_s = self._micro_batch_seconds(k)
    idle = strict = None
    if first_dispatch is not None:
      idle = max(0.0, first_dispatch - update_ready)
      strict = idle + max(0.0, update.dispatched_at - last_ready)
    step_start = self._last_update_ready
    if step_start is None:
      step_start = self._watcher.get(fwd_bwd_key(k, 0)).dispatched_at
    plan, metrics, spans = boundary.plan, boundary.metrics or StepMetrics(), boundary.spans
    return BoundaryRecord(
        step=k, mode=boundary.mode, staged=boundary.stage is not None,
        stage_before_update=bool(plan and plan.stage and plan.stage_before_update),
        probe=bool(plan and plan.probe), reason=plan.reason if plan else "last step",
        actions=[a.value for a in boundary.actions],
        stage_s=boundary.stage.stage_s if boundary.stage else None,
        device_wait_s=boundary.device_wait_s, low_wait=boundary.low_wait, transition=boundary.transition,
        update_s=update_ready - max(update.dispatched_at, last_ready),
        boundary_idle_s=idle, boundary_idle_strict_s=strict, step_s=update_ready - step_start,
        micro_batch_s=micro_s, metrics_s=spans.get("metrics_s"), metrics_wait_s=spans.get("metrics_wait_s"),
        checkpoint_s=spans.get("checkpoint_s"), checkpoint_path=boundary.checkpoint_path,
        weight_sync_s=spans.get("weight_sync_s"),
        staged_digest=boundary.stage.input_digest if boundary.stage else None,
        loss=metrics.loss, grad_norm=metrics.grad_norm, tokens=metrics.tokens, learning_rate=metrics.learning_rate,
        entropy=metrics.entropy, clip_fraction=metrics.clip_fraction, kl=metrics.kl,
        reruns=metrics.reruns, rerun_micro_batches=metrics.rerun_micro_batches,
        dropped_tokens=metrics.dropped_tokens,
        t_update_ready=update_ready - self.run_start,
        t_next_first_dispatch=None if first_dispatch is None else first_dispatch - self.run_start,
        next_ready=boundary.next_ready, rollout_wait_s=boundary.rollout_wait_s,
        **(dataclasses.asdict(boundary.rollout) if boundary.rollout else {}),
        per_process=boundary.per_process, **_memory_fields(boundary),
        weight_sync_bytes=spans.get("weight_sync_bytes"), weight_transfer_s=spans.get("weight_transfer_s"),
        weight_sync_wire_bytes=spans.get("weight_sync_wire_bytes"), weight_sync_wire_s=spans.get("weight_sync_wire_s"),
        control=bool(plan and plan.control),
        eval_accuracy=spans.get("eval_accuracy"), eval_pass_at_k=spans.get("eval_pass_at_k"),
        eval_s=spans.get("eval_s"), device_peak_bytes=metrics.device_peak_bytes, compiles=metrics.compiles,
        model_flops=metrics.model_flops, mfu=_mfu(metrics, update_ready - step_start), ppo_kl=metrics.ppo_kl,
        sampling_on_trainer_devices_s=(None if self._sampling_on_devices is None
                                       else self._sampling_on_devices(step_start, update_ready)),
    )

  def sync_records(self) -> None:
    """Puts the records written so far on disk (before a checkpoint that covers them is saved)."""
    if self._records_file:
      self._records_file.flush()
      os.fsync(self._records_file.fileno())

  def finish_record(self, boundary, first_dispatch: float | None,
                    before_keeping: Callable[[BoundaryRecord], None] | None = None) -> BoundaryRecord:
    """Builds, keeps and writes step ``boundary.step``'s record (see ``BoundaryRecord``); ``before_keeping`` is
    given it first (it may fill in what is learned from it: the measured saving)."""
    record = self._build_record(boundary, first_dispatch)
    if before_keeping is not None:
      before_keeping(record)
    self._last_update_ready = self.ready_at(update_key(boundary.step))
    self.records.append(record)
    if self._records_file:
      self._records_file.write(json.dumps(record.to_json()) + "\n")
      self._records_file.flush()
    if self.on_record:
      self.on_record(record)
    return record

  def summary(self, policy: PolicyReport, final_state_digest: str | None) -> RunSummary:
    """The run's summary from the records so far, the policy's report and the final digest."""
    idles = [r.boundary_idle_s for r in self.records if r.boundary_idle_s is not None]
    stricts = [r.boundary_idle_strict_s for r in self.records if r.boundary_idle_strict_s is not None]
    steps = [r.step_s for r in self.records]
    timings = StepTimings(steps=len(self.records),
                          median_boundary_idle_s=statistics.median(idles) if idles else None,
                          median_boundary_idle_strict_s=statistics.median(stricts) if stricts else None,
                          median_step_s=statistics.median(steps) if steps else None,
                          staged_boundaries=sum(1 for r in self.records if r.staged),
                          peak_staged_bytes_per_device=_peak(r.staged_bytes_per_device for r in self.records),
                          staged_bytes_by_field=_largest_by_field(r.staged_bytes_by_field for r in self.records),
                          peak_device_bytes_in_use=_peak(r.device_bytes_in_use for r in self.records),
                          staged_before_update=sum(1 for r in self.records if r.staged and r.stage_before_update),
                          measured_saving=estimate_from_records(self.records),
                          peak_device_bytes=max((r.device_peak_bytes for r in self.records
                                                 if r.device_peak_bytes is not None), default=None),
                          median_mfu=_median_present(r.mfu for r in self.records),
                          compiles_after_first_step=self._compiles_after_first_steps(),
                          boundaries=sum(1 for r in self.records if r.t_next_first_dispatch is not None),
                          boundary_held=_boundary_held(self.records))
    return RunSummary(timings=timings, policy=policy, final_state_digest=final_state_digest,
                      records_path=str(self.out_dir / "records.jsonl") if self.out_dir else None,
                      rollouts=self._rollout_summary())

  def _compiles_after_first_steps(self) -> int | None:
    """Compiles counted after each segment's first step (each process compiles its programs at its first)."""
    starts = {0, self._carried}
    return _sum_present(r.compiles for i, r in enumerate(self.records) if i not in starts)

  def process_timings(self) -> dict[str, Any]:
    """This process's own timings (a job of several processes merges every process's into the summary)."""
    def median(values):
      values = [v for v in values if v is not None]
      return statistics.median(values) if values else None

    return {"host": socket.gethostname(),
            "median_boundary_idle_s": median(r.boundary_idle_s for r in self.records),
            "median_step_s": median(r.step_s for r in self.records),
            "median_stage_s": median(r.stage_s for r in self.records),
            "median_device_wait_s": median(r.device_wait_s for r in self.records),
            "boundary_idle_s": [r.boundary_idle_s for r in self.records]}

  def _rollout_summary(self) -> RolloutSummary | None:
    rewards = [r.reward_mean for r in self.records if r.reward_mean is not None]
    if not rewards:
      return None
    waits = [r.rollout_wait_s for r in self.records if r.rollout_wait_s is not None]
    return RolloutSummary(reward_first_step=rewards[0], reward_last_10_steps=statistics.fmean(rewards[-10:]),
                          median_rollout_wait_s=statistics.median(waits) if waits else None,
                          boundaries_next_not_ready=sum(1 for r in self.records if r.next_ready is False))


def _boundary_held(records) -> dict[str, float | None] | None:
  """``StepTimings.boundary_held``: what the boundaries held, medians (None where no boundary staged). The device
  wait is the before-update stages' (after the update, a stage waits on the update, not the last micro-batch)."""
  staged = [r for r in records if r.staged]
  if not staged:
    return None

  def work(r):  # None where no part was measured (a restored record, a remote one without spans)
    parts = [x for x in (r.metrics_s, r.checkpoint_s, r.weight_sync_s) if x is not None]
    return sum(parts) if parts else None

  return {"stage_s": _median_present(r.stage_s for r in staged),
          "device_wait_s": _median_present(r.device_wait_s for r in staged if r.stage_before_update),
          "update_s": _median_present(r.update_s for r in records),
          "boundary_work_s": _median_present(work(r) for r in records),
          "control_idle_s": _median_present(r.boundary_idle_s for r in records if r.control)}

"""What a run hands back: the ``RunSummary`` and the typed parts it is built from.

Each part has one owner: the recorder measures the step timings and the
rollouts, the policy reports its own story (``policies.PolicyReport``), the
program adds how the run ended and, in a job of several processes, every
process's timings; the live loop adds its evaluation, the application the run's
identity and files. ``RunSummary.to_json()`` is ``summary.json``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from policies import PolicyReport
from policies.saving import SavingEstimate


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepTimings:
  """Medians over every record of the run (a resumed run's earlier records included).

  ``peak_staged_bytes_per_device`` is the most a staged input held on one device, ``staged_bytes_by_field`` a
  staged input's bytes by field (the largest's, over this process's devices; their sum is a micro-batch's), and
  ``peak_device_bytes_in_use`` the most a device had in use right after a stage (None: not reported;
  records of versions before these fields count as not reported). ``staged_before_update`` counts the staged
  boundaries that staged before the update (the rest staged after it); ``measured_saving`` is what staging
  saved, control boundaries against staged ones (``policies.saving``; None: not measured).
  """

  steps: int
  median_boundary_idle_s: float | None
  median_boundary_idle_strict_s: float | None
  median_step_s: float | None
  staged_boundaries: int
  peak_staged_bytes_per_device: int | None = None
  peak_device_bytes_in_use: int | None = None
  staged_bytes_by_field: dict[str, int] | None = None
  staged_before_update: int = 0
  measured_saving: SavingEstimate | None = None
  #: The most memory a device held during the run (the allocator's peak, None where not reported), the median
  #: step's model FLOP utilisation (None where the devices' peak is unknown) and the programs compiled after
  #: the first step's metrics (0: nothing recompiled; None: not counted).
  peak_device_bytes: int | None = None
  median_mfu: float | None = None
  compiles_after_first_step: int | None = None
  #: The boundaries the run had: steps whose boundary dispatched the next step's first micro-batch (a completed
  #: run's last step has none; a run stopped inside a step, its last finished step does). None: not counted.
  boundaries: int | None = None
  #: What a boundary held, medians in seconds: ``stage_s`` (mapping the next input and starting its copy) and
  #: ``device_wait_s`` (how long the device still computed after the stage) over the staged boundaries,
  #: ``update_s`` and ``boundary_work_s`` (metrics, checkpoint, weight sync) over every step, ``control_idle_s``
  #: over the control boundaries (None without one). None where no boundary staged.
  boundary_held: dict[str, float | None] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSummary:
  """A live run's rewards and waits for rollouts."""

  reward_first_step: float
  reward_last_10_steps: float
  median_rollout_wait_s: float | None
  boundaries_next_not_ready: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Evaluation:
  """Greedy accuracy on held-out prompts before the first step and after the last; ``during_run``: the
  evaluations after every ``task.eval_every``-th step (this run's and a resumed run's earlier segments'), each
  ``{"updates", "accuracy", "pass_k", "pass_at_k"}`` (``pass_at_k`` None without ``task.eval_pass_k``)."""

  eval_accuracy_start: float
  eval_prompts: int
  eval_accuracy_end: float
  during_run: list[dict] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessTimings:
  """One process's own timings in a job of several processes."""

  process_id: int
  host: str
  wall_start: float
  median_boundary_idle_s: float | None
  median_step_s: float | None
  median_stage_s: float | None
  median_device_wait_s: float | None
  boundary_idle_s: list[float | None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgreementCost:
  """What keeping a job's processes on one path cost: exchanges and their seconds."""

  exchanges: int
  median_s: float | None
  max_s: float | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSummary:
  """The run's summary. Optional parts are None where they do not apply and then absent from the JSON.

  Attributes:
    timings: the step and boundary medians.
    policy: the policy's report (modes, transitions, counters, threshold).
    final_state_digest: the engine's state digest at the end (None if it cannot say).
    records_path, trace_path: the files written (None when the run writes none).
    ended: ``completed``, ``stopped`` (a stop honoured at a boundary), ``signal`` or ``error``.
    last_step: the last step run; checkpoint_path: the last checkpoint written.
    rollouts, evaluation: a live run's.
    processes, agreement: a job of several processes'.
    trainer: where a remote trainer ran (its address and clock offset).
    run: what the application adds (run id, recording, reward plot, the signal and how to resume).
  """

  timings: StepTimings
  policy: PolicyReport
  final_state_digest: str | None
  records_path: str | None = None
  trace_path: str | None = None
  ended: str = "completed"
  last_step: int | None = None
  checkpoint_path: str | None = None
  rollouts: RolloutSummary | None = None
  evaluation: Evaluation | None = None
  processes: tuple[ProcessTimings, ...] | None = None
  agreement: AgreementCost | None = None
  trainer: Mapping[str, Any] | None = None
  run: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def replace(self, **changes: Any) -> "RunSummary":
    return dataclasses.replace(self, **changes)

  def to_json(self) -> dict[str, Any]:
    """``summary.json``: one flat dict, each part's fields at the top level (processes as a list)."""
    timings, policy = dataclasses.asdict(self.timings), self.policy.to_json()
    memory = {key: timings.pop(key) for key in ("peak_staged_bytes_per_device", "peak_device_bytes_in_use",
                                                "staged_bytes_by_field")}
    saving = self.timings.measured_saving
    newest = {"staged_before_update": timings.pop("staged_before_update"),
              "measured_saving": saving.to_json() if saving is not None else None}
    timings.pop("measured_saving")
    devices = {key: timings.pop(key) for key in ("peak_device_bytes", "median_mfu", "compiles_after_first_step",
                                                 "boundary_held")}
    # The order summary.json has always had: the step count and the modes first.
    out: dict[str, Any] = {"steps": timings.pop("steps"), "requested_mode": policy.pop("requested_mode"),
                           "final_mode": policy.pop("final_mode")}
    out.update(timings)
    out.update(policy)
    out.update(final_state_digest=self.final_state_digest, records_path=self.records_path)
    if self.rollouts is not None:
      out.update(dataclasses.asdict(self.rollouts))
    out.update(trace_path=self.trace_path, ended=self.ended, last_step=self.last_step,
               checkpoint_path=self.checkpoint_path)
    if self.processes is not None:
      out["processes"] = [dataclasses.asdict(p) for p in self.processes]
    if self.agreement is not None:
      out["agreement"] = dataclasses.asdict(self.agreement)
    if self.evaluation is not None:
      out.update(dataclasses.asdict(self.evaluation))
    if self.trainer is not None:
      out["trainer"] = dict(self.trainer)
    out.update(self.run)
    out.update(memory)  # newer keys go last: the order of every earlier key stays as it was
    out.update(newest)
    out.update(devices)
    return out

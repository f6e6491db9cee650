"""PolicyInputs: what the step-boundary policy is given from the run, agreed between a job's processes first.

The policy plans and judges on measurements: the wait floor sampled at bring-up, the devices' memory headroom a
boundary is planned with, what each staged boundary measured, and each staged or control boundary's sample of
the measured saving (its idle and step seconds, from the records). In a job of several processes each is
exchanged and combined (``orchestrator.distributed.agreement``) before the policy sees it, so every process's
policy decides the same (docs/distributed.md); in a run of one the exchange is this process's value alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.contract import Worker
from orchestrator.distributed.agreement import SingleProcess, agree_on_headroom, agree_on_measurements
from orchestrator.loop.boundary import BoundaryState
from orchestrator.loop.recorder import BoundaryRecord, Recorder
from policies import DeviceHeadroom, StepBoundaryPolicy
from policies.saving import BoundarySample, boundary_sample


class PolicyInputs:
  """Measures, agrees and hands ``policy`` what it plans and judges with.

  Args:
    policy: the run's policy.
    worker: the trainer, which samples the wait floor and reports its devices' memory.
    recorder: the completion stamps a staged boundary's update delay is read from, and the records a
      boundary's saving sample is taken from.
    agreement: the job's processes (``SingleProcess`` for a run of one).
    micro_batches_per_step: payloads per step (the last one's stamp bounds the update delay).
  """

  def __init__(self, policy: StepBoundaryPolicy, worker: Worker, recorder: Recorder, agreement: SingleProcess, *,
               micro_batches_per_step: int):
    self.policy, self.worker, self.recorder, self.agreement = policy, worker, recorder, agreement
    self.micro_batches_per_step = micro_batches_per_step

  def calibrate(self, samples_wanted: int) -> float | None:
    """Samples the wait floor (nothing in flight) and calibrates the policy; returns the threshold.

    A resumed policy keeps the floor it measured before (its threshold stays the run's); a policy that will
    never stage needs none.
    """
    policy = self.policy
    if not self.worker.capabilities.can_stage or not policy.requested_mode.staged or policy.floor_samples:
      return policy.threshold_s
    samples = self.worker.sample_wait_floor(samples_wanted)
    # Every process calibrates on the slowest floor, so each reaches the same threshold.
    return policy.calibrate(self.agreement.combine("wait floor", {"samples": list(samples)})["samples"])

  def headroom(self, step: int) -> DeviceHeadroom | None:
    """What the memory gate plans boundary ``step`` with (read when the boundary is planned, just before the
    step's last micro-batch is dispatched); None, with no exchange, where the gate cannot apply: it is off, the
    run never stages, or the worker does not report memory — each the same in every process of a job."""
    policy, worker = self.policy, self.worker
    if not (policy.gates_on_memory and policy.requested_mode.staged and worker.capabilities.can_report_memory):
      return None
    return agree_on_headroom(self.agreement, step, worker.device_memory())

  def observe(self, boundary: BoundaryState) -> None:
    """Feeds a staged boundary's measurements (every process's, combined) to the policy; notes what it judged."""
    threshold = self.policy.threshold_s
    measured = boundary.measurements(self.recorder, self.micro_batches_per_step, threshold)
    seen, boundary.per_process = agree_on_measurements(self.agreement, boundary.step, measured, threshold)
    boundary.judged(self.policy.observe(
        boundary.step, stage_s=seen["stage_s"], device_wait_s=seen["device_wait_s"], probe=boundary.plan.probe,
        update_delay_s=seen["update_delay_s"], rollout_wait_s=seen["rollout_wait_s"],
        sampling_on_devices_s=seen["sampling_on_devices_s"]))

  def observe_saving(self, record: BoundaryRecord) -> None:
    """Feeds the policy the sample ``record`` completes (``record`` built, not kept yet: the recorder's last
    records come before it), then notes on it the saving the policy judges by (``saving_s``: the measured
    saving's mean, None while there is not enough of it)."""
    self._observe_sample([*self.recorder.records[-2:], record])
    saving = self.policy.measured_saving
    record.saving_s = saving.step_s.mean if saving.enough else None

  def _observe_sample(self, records: Sequence[BoundaryRecord]) -> None:
    """Feeds the policy the sample of the boundary before the last record (the seconds of its step and the
    next, which the last record completes), where that boundary staged or was a control: every process's, combined (the slowest
    process's seconds), so each process's policy decides the same. Its plan, and so whether there is an
    exchange, is the same in every process."""
    if len(records) < 3 or not (records[-2].staged or records[-2].control):
      return
    record = records[-2]
    sample = boundary_sample(records[-3], record, records[-1])
    local = None if sample is None else {"boundary_idle_s": sample.boundary_idle_s, "step_s": sample.step_s}
    seen = self.agreement.combine(f"saving step {record.step}",
                                  local or {"boundary_idle_s": None, "step_s": None})
    if seen["boundary_idle_s"] is None or seen["step_s"] is None:
      return
    self.policy.observe_saving(record.step, BoundarySample(seen["boundary_idle_s"], seen["step_s"]),
                               control=bool(record.control))

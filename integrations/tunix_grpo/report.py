"""What the add-on measured at each optimizer-step boundary, and its summary.

Times are the host's ``time.perf_counter`` seconds. A boundary is the dispatch
of an optimizer step's last micro-batch (which, under Tunix's
``optax.MultiSteps``, carries the update). ``idle_s`` is how long the trainer's
devices sat idle there: from the moment that micro-batch finished to the
dispatch of the next step's first one (0 when the next was queued behind it).
``device_wait_s`` is what a wait for the device would have read once the next
step's first micro-batch was in hand: the compute still left to hide behind.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from policies.units import format_seconds


@dataclasses.dataclass
class GrpoBoundary:
  """One optimizer-step boundary of a Tunix GRPO run driven by the add-on."""

  step: int
  global_step: int
  mode: str
  stage: bool
  next_ready: bool
  prefetched: bool
  reason: str
  at: float
  host_blocks: int
  last_ready_at: float | None = None
  next_input_at: float | None = None
  next_dispatch_at: float | None = None
  rollout_wait_s: float | None = None
  settled: bool = False

  @property
  def idle_s(self) -> float | None:
    if self.last_ready_at is None or self.next_dispatch_at is None:
      return None
    return max(0.0, self.next_dispatch_at - self.last_ready_at)

  @property
  def stage_s(self) -> float | None:
    return None if self.next_input_at is None else max(0.0, self.next_input_at - self.at)

  @property
  def device_wait_s(self) -> float | None:
    if self.last_ready_at is None or self.next_input_at is None:
      return None
    return max(0.0, self.last_ready_at - self.next_input_at)

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out.update(idle_s=self.idle_s, stage_s=self.stage_s, device_wait_s=self.device_wait_s)
    return out


def _median(values) -> float | None:
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def summarize(records: list[GrpoBoundary], policy, *, host_blocks: int, micro_batches: int,
              optimizer_steps: int) -> dict[str, Any]:
  """Totals over a run: host blocks per optimizer step, staged share, median idle and wait."""
  between = [r for r in records if r.next_dispatch_at is not None]
  report = policy.report()
  return {
      "requested_mode": report.requested_mode.value,
      "final_mode": report.final_mode.value,
      "optimizer_steps": optimizer_steps,
      "micro_batches": micro_batches,
      "host_blocks": host_blocks,
      "host_blocks_per_step": host_blocks / optimizer_steps if optimizer_steps else None,
      "boundaries": len(between),
      "staged_share": (sum(r.stage for r in between) / len(between)) if between else None,
      "prefetched": sum(r.prefetched for r in records),
      "median_idle_s": _median(r.idle_s for r in between),
      "median_device_wait_s": _median(r.device_wait_s for r in between if r.stage),
      "low_device_waits": sum(1 for r in between if r.stage and r.device_wait_s is not None
                              and report.threshold_s is not None and r.device_wait_s < report.threshold_s),
      "policy_counters": report.counters,
      "threshold_s": report.threshold_s,
      "transitions": [f"{t.from_mode.value}->{t.to_mode.value} ({t.kind}) at step {t.step}"
                      for t in report.transitions],
  }


def format_summary(summary: dict[str, Any]) -> str:
  staged = summary["staged_share"]
  blocks = summary["host_blocks_per_step"]
  lines = [
      f"step-boundary add-on: {summary['optimizer_steps']} optimizer steps, {summary['boundaries']} boundaries,"
      f" mode {summary['requested_mode']} (now {summary['final_mode']})",
      f"  host blocks per step {'-' if blocks is None else f'{blocks:.2f}'}"
      f" ({summary['host_blocks']} over {summary['micro_batches']} micro-batches)",
      f"  staged {'-' if staged is None else f'{100 * staged:.0f}%'} of boundaries,"
      f" {summary['prefetched']} next mini-batches produced ahead",
      f"  median device idle at a boundary {format_seconds(summary['median_idle_s'])},"
      f" median device wait when staged {format_seconds(summary['median_device_wait_s'])}"
      f" ({summary['low_device_waits']} under the threshold {format_seconds(summary['threshold_s'])})",
  ]
  lines += [f"  {t}" for t in summary["transitions"]]
  return "\n".join(lines)

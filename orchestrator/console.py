"""What ``run_rl`` prints for people: the per-step table and the summary lines."""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.recorder import BoundaryRecord
from policies.step_boundary import format_seconds


def _cell(x, width=9, prec=4) -> str:
  return f"{x:{width}.{prec}f}" if isinstance(x, (int, float)) else f"{'-':>{width}}"


def format_table(records: Sequence[BoundaryRecord]) -> str:
  """The per-step table printed at the end of a run."""
  header = (f"{'step':>4}  {'mode':<19} {'staged':<6} {'stage_s':>9} {'wait_s':>9} {'update_s':>9}"
            f" {'idle_s':>9} {'strict_s':>9} {'step_s':>9} {'loss':>9}")
  lines = [header, "-" * len(header)]
  for r in records:
    lines.append(
        f"{r.step:>4}  {r.mode:<19} {('yes' if r.staged else 'no'):<6} {_cell(r.stage_s)}"
        f" {_cell(r.device_wait_s)} {_cell(r.update_s)} {_cell(r.boundary_idle_s)}"
        f" {_cell(r.boundary_idle_strict_s)} {_cell(r.step_s)} {_cell(r.loss)}"
    )
  return "\n".join(lines)


def format_summary(summary: dict) -> str:
  """The summary lines printed after the table."""
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


def progress_postfix(record: BoundaryRecord) -> dict[str, str]:
  """The progress bar's fields after one step."""
  idle = record.boundary_idle_s
  return {"step_s": f"{record.step_s:.3f}", "idle_s": "-" if idle is None else f"{idle:.4f}",
          "loss": "-" if record.loss is None else f"{record.loss:.4f}"}

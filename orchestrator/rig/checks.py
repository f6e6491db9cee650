"""The rig's checks: per arm, across arms, and each arm's measurements against its predicted bands.

Per arm, the engine calls it made are checked against the recording and the
call order; across arms, re-runs and final state against the first arm.

A ``Check`` says what kind it is: a failed ``CORRECTNESS`` check fails ``run_rl rig``;
a ``PREDICTION`` check (a measurement against the boundary model's band) is
reported only, since its outcome depends on the machine's timing.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable

from orchestrator.rig.arms import Arm
from policies.call_order import Action, engine_calls_between

#: The fewest measurements a prediction band is scored on; fewer make it unscorable, not failed.
MIN_SCORED = 3


class CheckKind(enum.Enum):
  CORRECTNESS = "correctness"  # training, or the rig's own protocol: a failure fails the run
  PREDICTION = "prediction"  # a measurement in or out of a predicted band: reported only


@dataclasses.dataclass(frozen=True, kw_only=True)
class Check:
  """One check's outcome. ``ok`` is None when there was too little to judge (``status`` "unscorable")."""

  name: str
  kind: CheckKind
  arm: str  # the arm checked; "*" for a check of the whole rig run
  ok: bool | None
  detail: str

  @property
  def status(self) -> str:
    return "unscorable" if self.ok is None else "pass" if self.ok else "fail"

  @property
  def fails_run(self) -> bool:
    """Whether this outcome fails ``run_rl rig``: a failed correctness check (a missed band never does)."""
    return self.kind is CheckKind.CORRECTNESS and self.ok is False

  def to_json(self) -> dict:
    """The check as ``report.json`` holds it."""
    return {"name": self.name, "arm": self.arm, "status": self.status, "detail": self.detail,
            "kind": self.kind.value}


def failing_checks(checks: Iterable[Check]) -> list[Check]:
  """The checks that fail the run (see ``Check.fails_run``)."""
  return [c for c in checks if c.fails_run]


def _expected_windows(arm_records, steps_digests) -> list[list[tuple[str, str | None]]]:
  """The engine calls each record's actions put between step k's last fwd_bwd and step k+1's first.

  A record stores the ``policies.call_order`` actions its boundary executed
  (the last step's are ``boundary_actions(None)``); a prepare must carry step
  k+1's first micro-batch.
  """
  windows = []
  for r in arm_records:
    k = r.step
    nxt = steps_digests[k + 1][0] if k + 1 < len(steps_digests) else None
    calls = engine_calls_between(tuple(Action(a) for a in r.actions))
    windows.append([(call, nxt if call == "prepare" else None) for call in calls])
  return windows


def _windows(events, m) -> tuple[list[list], list[list[str | None]]]:
  """Splits a call log into per-step fwd_bwd digests and the calls after each step's last one."""
  steps, windows = [], []
  current, window, in_window = [], [], False
  for kind, d in events:
    if kind == "fwd_bwd":
      if in_window:
        windows.append(window)
        window, in_window = [], False
      current.append(d)
      if len(current) == m:
        steps.append(current)
        current, in_window = [], True
    elif in_window:
      window.append((kind, d))
    # calls before a step's last micro-batch (none in any mode) are ignored here
  if in_window:
    windows.append(window)
  if current:
    steps.append(current)
  return steps, windows


def check_arm(arm: Arm, result, events, compiles_delta, expected_digests, expected_tokens, m) -> list[Check]:
  """One arm's correctness: its micro-batches and their order, loss denominators, updates, call order, compiles."""
  checks = []

  def add(name, ok, detail):
    checks.append(Check(name=name, kind=CheckKind.CORRECTNESS, arm=arm.name, ok=ok, detail=detail))

  got_steps, windows = _windows(events, m)
  flat_got = [d for s in got_steps for d in s]
  flat_expected = [d for s in expected_digests for d in s]
  add("micro_batches_in_order", flat_got == flat_expected,
      f"{sum(a == b for a, b in zip(flat_got, flat_expected))}/{len(flat_expected)} micro-batches"
      f" match the recording's order (got {len(flat_got)})")
  tokens = [r.tokens for r in result.records]
  add("loss_denominators", tokens == expected_tokens,
      f"summed loss denominators per step {tokens} vs expected {expected_tokens}")
  updates_per_window = [sum(1 for kind, _ in w if kind == "update") for w in windows]
  add("update_before_next_step", updates_per_window == [1] * len(expected_digests),
      f"updates after each step's last micro-batch: {updates_per_window}")
  expected_windows = _expected_windows(result.records, expected_digests)
  add("stages_where_planned", windows == expected_windows,
      "calls between each step's last micro-batch and the next step's first follow the"
      f" mode's call order ({sum(a == b for a, b in zip(windows, expected_windows))}/{len(expected_windows)}"
      " boundaries)")
  add("no_compile_after_warmup", compiles_delta == 0, f"{compiles_delta} compiles during the arm")
  return checks


def cross_arm_checks(report: dict, reference: dict) -> list[Check]:
  """An arm against the first arm (both ``_arm_report`` dicts): the same re-runs and the same final state."""
  same_reruns = report["reruns"] == reference["reruns"]
  same_state = report["final_state_digest"] == reference["final_state_digest"]
  return [
      Check(name="rerun_counts_equal", kind=CheckKind.CORRECTNESS, arm=report["name"], ok=same_reruns,
            detail=f"re-runs per step {report['reruns']} vs {reference['name']} {reference['reruns']}"),
      Check(name="final_state_identical", kind=CheckKind.CORRECTNESS, arm=report["name"], ok=same_state,
            detail=f"state digest {report['final_state_digest'][:16]}… vs {reference['name']}"
                   f" {reference['final_state_digest'][:16]}…"),
  ]


def _score(name, arm, measured, lo, hi, n) -> Check:
  if measured is None or n < MIN_SCORED:
    return Check(name=name, kind=CheckKind.PREDICTION, arm=arm, ok=None,
                 detail=f"{n} boundaries measured; at least {MIN_SCORED} are needed to score a band")
  return Check(name=name, kind=CheckKind.PREDICTION, arm=arm, ok=lo <= measured <= hi,
               detail=f"measured median {measured:.6f} s, predicted band [{lo:.6f}, {hi:.6f}] s")


def prediction_checks(report: dict, pred: dict, n_records: int) -> list[Check]:
  """An arm's measured median boundary idle and step time against its predicted bands (``pred``)."""
  idle = report["boundary_idle_s"]["median"] if report["boundary_idle_s"] else None
  return [_score("prediction_boundary_idle", report["name"], idle, *pred["boundary_idle_band_s"], n_records - 1),
          _score("prediction_step_s", report["name"], report["step_s"]["median"], *pred["step_band_s"], n_records)]


def predictions_written_first(predictions: dict, first_arm_started_monotonic_s: float) -> Check:
  """That ``predictions.json`` was written before the first scored arm started (a correctness check)."""
  return Check(name="predictions_written_first", kind=CheckKind.CORRECTNESS, arm="*",
               ok=predictions["written_at_monotonic_s"] <= first_arm_started_monotonic_s,
               detail=f"predictions.json written at {predictions['written_at']}, before the first scored arm")

"""The rig's checks: per arm, across arms, and each arm's measurements against its predicted bands.

Per arm, the engine calls it made are checked against the recording and the
call order; across arms, re-runs and final state against the first arm.
"""

from __future__ import annotations

from orchestrator.rig.arms import Arm
from policies.call_order import Action, engine_calls_between


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


def check_arm(arm: Arm, result, events, compiles_delta, expected_digests, expected_tokens, m) -> list[dict]:
  """One arm's correctness: its micro-batches and their order, loss denominators, updates, call order, compiles."""
  checks = []

  def add(name, ok, detail):
    checks.append({"name": name, "arm": arm.name, "status": "pass" if ok else "fail", "detail": detail})

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


def _score(name, arm, measured, lo, hi, n, min_n=3):
  if measured is None or n < min_n:
    return {"name": name, "arm": arm, "status": "unscorable",
            "detail": f"{n} boundaries measured; at least {min_n} are needed to score a band"}
  ok = lo <= measured <= hi
  return {"name": name, "arm": arm, "status": "pass" if ok else "fail",
          "detail": f"measured median {measured:.6f} s, predicted band [{lo:.6f}, {hi:.6f}] s"}


def cross_arm_checks(report: dict, reference: dict) -> list[dict]:
  """An arm against the first arm (both ``_arm_report`` dicts): the same re-runs and the same final state."""
  same_reruns = report["reruns"] == reference["reruns"]
  same_state = report["final_state_digest"] == reference["final_state_digest"]
  return [
      {"name": "rerun_counts_equal", "arm": report["name"], "status": "pass" if same_reruns else "fail",
       "detail": f"re-runs per step {report['reruns']} vs {reference['name']} {reference['reruns']}"},
      {"name": "final_state_identical", "arm": report["name"], "status": "pass" if same_state else "fail",
       "detail": f"state digest {report['final_state_digest'][:16]}… vs {reference['name']}"
                 f" {reference['final_state_digest'][:16]}…"},
  ]


def prediction_checks(report: dict, pred: dict, n_records: int) -> list[dict]:
  """An arm's measured median boundary idle and step time against its predicted bands (``pred``)."""
  idle = report["boundary_idle_s"]["median"] if report["boundary_idle_s"] else None
  return [_score("prediction_boundary_idle", report["name"], idle, *pred["boundary_idle_band_s"], n_records - 1),
          _score("prediction_step_s", report["name"], report["step_s"]["median"], *pred["step_band_s"], n_records)]


def predictions_written_first(predictions: dict, first_arm_started_monotonic_s: float) -> dict:
  """That ``predictions.json`` was written before the first scored arm started."""
  return {
      "name": "predictions_written_first", "arm": "*",
      "status": "pass" if predictions["written_at_monotonic_s"] <= first_arm_started_monotonic_s else "fail",
      "detail": f"predictions.json written at {predictions['written_at']}, before the first scored arm",
  }

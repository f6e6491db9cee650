"""Rig outputs: report.md, report.json, trace.json (Perfetto) and timeline.png."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

from orchestrator.loop.trace import chrome_trace
from orchestrator.rig.checks import Check, CheckKind
from policies.saving import welch_interval
from policies.units import format_seconds as fs

COLORS = {"micro-batch": "#4C78A8", "re-run": "#9ECAE9", "update": "#54A24B", "idle": "#E45756", "stage": "#F58518",
          "prepare": "#EECA3B", "dispatch": "#72B7B2", "wait": "#B279A2", "boundary work": "#9D9D9D"}
HOST_KINDS = {"stage": "stage", "prepare": "prepare", "dispatch": "dispatch", "update dispatch": "dispatch",
              "fwd_bwd": "dispatch", "host wait": "wait", "wait for device": "wait"}


def verdict(checks: Iterable[Check]) -> dict:
  """How many correctness checks passed, failed and were unscorable: what the verdict and the exit code count
  (a missed prediction band is the machine's noise, not a broken run: ``prediction_score`` counts those)."""
  counts = {"pass": 0, "fail": 0, "unscorable": 0}
  for c in checks:
    if c.kind is CheckKind.CORRECTNESS:
      counts[c.status] += 1
  return counts


def prediction_score(checks: Iterable[Check]) -> dict:
  """The prediction bands: how many were scored, how many of those the measurement fell within, how many
  were unscorable (too few boundaries)."""
  bands = [c for c in checks if c.kind is CheckKind.PREDICTION]
  scored = [c for c in bands if c.ok is not None]
  return {"within_band": sum(1 for c in scored if c.ok), "scored": len(scored),
          "unscorable": len(bands) - len(scored)}


def verdict_line(checks: Sequence[Check]) -> str:
  """``verdict: 12 passed, 0 failed, 0 unscorable; predictions: 3/4 within band`` (correctness first)."""
  counts, bands = verdict(checks), prediction_score(checks)
  unscorable = f", {bands['unscorable']} unscorable" if bands["unscorable"] else ""
  return (f"verdict: {counts['pass']} passed, {counts['fail']} failed, {counts['unscorable']} unscorable;"
          f" predictions: {bands['within_band']}/{bands['scored']} within band{unscorable}")


def targets(arms, components) -> list[dict]:
  """The rig's targets, measured (never asserted)."""
  by_mode = {}
  for a in arms:
    by_mode.setdefault(a["mode"], a)
  out = []
  before, off = by_mode.get("stage_before_update"), by_mode.get("off")
  if before:
    idle = before["boundary_idle_s"]["median"]
    micro = before["micro_batch_s"]["median"]
    out.append({"target": "STAGE_BEFORE_UPDATE idle <= 1% of a micro-batch",
                "measured": f"{idle / micro:.2%} ({fs(idle)} of {fs(micro)})", "met": idle <= 0.01 * micro})
    if off:
      off_idle = off["boundary_idle_s"]["median"]
      out.append({"target": "STAGE_BEFORE_UPDATE idle <= 5% of OFF's",
                  "measured": f"{fs(idle)} vs OFF {fs(off_idle)}",
                  "met": idle <= 0.05 * off_idle if off_idle > 0 else idle == 0})
    bound = components.compute_bound_s
    step = before["step_s"]["median"]
    out.append({"target": "STAGE_BEFORE_UPDATE step within 2% of the compute-only bound",
                "measured": f"{step:.4f} s vs bound {bound:.4f} s ({step / bound - 1:+.2%})",
                "met": step <= 1.02 * bound})
  after, pipelined = by_mode.get("stage_after_update"), by_mode.get("pipelined")
  if before and after and pipelined:
    a, p, b = (x["boundary_idle_s"]["median"] for x in (after, pipelined, before))
    out.append({"target": "STAGE_AFTER_UPDATE idle between PIPELINED and STAGE_BEFORE_UPDATE",
                "measured": f"before {fs(b)} <= after {fs(a)} <= pipelined {fs(p)}",
                "met": b <= a <= p})
  return out


#: The modes the rig compares, each (mode, against): what the first saves over the second.
COMPARISONS = (("stage_before_update", "off"), ("stage_before_update", "pipelined"), ("pipelined", "off"),
               ("stage_after_update", "pipelined"))


def _compared_arms(arms) -> tuple[dict[str, list], list[str]]:
  """The arms each mode is compared with (by mode), and the arms left out, named with why: a faulted arm, or one
  whose staging turned itself off (it ended in another mode than it ran for)."""
  by_mode: dict[str, list] = {}
  left_out = []
  for a in arms:
    if a["fault"] or a.get("final_mode", a["mode"]) != a["mode"]:
      left_out.append(a["name"] + (f" (fault: {a['fault']})" if a["fault"] else f" (ended {a['final_mode']})"))
    else:
      by_mode.setdefault(a["mode"], []).append(a)
  return by_mode, left_out


def _step_samples(records) -> list[float]:
  """An arm's step seconds for a comparison: after its first step (no boundary before it), and without the
  steps a control boundary touches (a step runs from one update to the next, so control k's unstaged boundary
  is in step k + 1, and step k ends at it)."""
  touched = {k + d for k, r in enumerate(records) if r.get("control") for d in (0, 1)}
  return [r["step_s"] for k, r in enumerate(records) if k >= 1 and k not in touched and r.get("step_s") is not None]


def _idle_samples(records) -> list[float]:
  """An arm's boundary idle for a comparison: each boundary (its last step has none after it) but controls."""
  return [r["boundary_idle_s"] for r in records[:-1] if not r.get("control") and r.get("boundary_idle_s") is not None]


def comparisons(arms) -> list[dict]:
  """What each mode saves over another, step seconds and boundary idle, with a 95 % Welch interval.

  An arm counts for the mode it ran in (``_compared_arms``); within it, its control boundaries are left out
  (``_step_samples``, ``_idle_samples``). With two arms or more a side, the samples are the arms' medians, so
  the interval counts the drift from arm to arm; otherwise they are the arms' steps pooled, and the row says the
  interval counts no drift between arms. The share is the saving over the mean of the other mode's samples. A
  pair the arms lack, or with fewer than two samples a side, is left out."""
  by_mode, _ = _compared_arms(arms)

  def side(mode, take, by_arm):
    if by_arm:
      return [statistics.median(xs) for xs in (take(a["records"]) for a in by_mode[mode]) if xs]
    return [x for a in by_mode[mode] for x in take(a["records"])]

  rows = []
  for mode, against in COMPARISONS:
    if mode not in by_mode or against not in by_mode:
      continue
    arm_counts = [len(by_mode[mode]), len(by_mode[against])]
    by_arm = min(arm_counts) >= 2
    steps_mode, steps_against = (side(m, _step_samples, by_arm) for m in (mode, against))
    idle_mode, idle_against = (side(m, _idle_samples, by_arm) for m in (mode, against))
    try:
      step, idle = welch_interval(steps_against, steps_mode), welch_interval(idle_against, idle_mode)
    except ValueError:  # fewer than two samples a side
      continue
    against_step_s = statistics.fmean(steps_against)
    samples = ("arm medians" if by_arm else
               f"steps pooled ({arm_counts[0]} arm{'s' * (arm_counts[0] > 1)} / {arm_counts[1]}: no drift between"
               " arms counted)")
    rows.append({"mode": mode, "against": against, "arms": arm_counts, "samples": samples,
                 "n": [len(steps_mode), len(steps_against)], "step_saving_s": step.to_json(),
                 "step_saving_share": {k: v / against_step_s for k, v in step.to_json().items()},
                 "boundary_idle_saving_s": idle.to_json()})
  return rows


def left_out_of_comparisons(arms) -> list[str]:
  """The arms no comparison counts, each with why (``_compared_arms``)."""
  return _compared_arms(arms)[1]


def write_reports(out: Path, arms, predictions, checks: Sequence[Check], components, traces, recipe,
                  recording, fitted: dict | None = None) -> dict:
  """Writes every report file into ``out``; returns ``report.json``'s content (checks as ``Check.to_json``)."""
  counts = verdict(checks)
  line = verdict_line(checks)
  target_rows = targets(arms, components)
  report = {
      "recipe": recipe.name,
      "recording": str(recording.path),
      "components": predictions["components"],
      "arms": [{k: v for k, v in a.items() if k != "records"} for a in arms],
      "predictions": predictions,
      "fitted_predictions": fitted or {},
      "checks": [c.to_json() for c in checks],
      "targets": target_rows,
      "comparisons": comparisons(arms),
      "left_out_of_comparisons": left_out_of_comparisons(arms),
      "verdict": counts,
      "predictions_score": prediction_score(checks),
      "verdict_line": line,
  }
  (out / "report.json").write_text(json.dumps(report, indent=2))
  (out / "records.json").write_text(json.dumps({a["name"]: a["records"] for a in arms}, indent=1))
  _write_trace(out / "trace.json", traces)
  try:
    _write_timeline(out / "timeline.png", traces)
    report["timeline"] = str(out / "timeline.png")
  except ImportError as e:  # matplotlib is a dependency; keep the rest of the report regardless
    report["timeline"] = f"not drawn: {e}"
  (out / "report.md").write_text(_markdown(report, arms, components))
  return report


def _markdown(report, arms, components) -> str:
  def st(s):
    return "-" if not s else f"{fs(s['median'])} ({fs(s['min'])}–{fs(s['max'])})"

  c = components
  lines = [
      f"# Rig report: {report['recipe']}", "",
      f"Recording: `{report['recording']}`", "",
      f"**{report['verdict_line']}**", "",
      "## Calibration", "",
      f"micro-batch {fs(c.micro_batch_s)}, input preparation {fs(c.map_s)}"
      f" ({c.map_s / c.micro_batch_s:.1%} of a micro-batch), update {fs(c.update_s)},"
      f" boundary work (metrics {fs(c.metrics_s)}, weight sync {fs(c.weight_sync_s)}),"
      f" dispatch {fs(c.dispatch_s)}, wait floor {fs(c.wait_floor_s)};"
      f" {c.micro_batches_per_step} micro-batches per step; update waits for the last"
      f" micro-batch: {'yes' if c.update_overlap_share == 0 else 'no'};"
      f" dropless re-runs: {c.reruns_per_step:.1f} per step of {fs(c.rerun_s)} each."
      f" Compute-only bound per step: {c.compute_bound_s:.4f} s.", "",
      "## Arms (median, min–max)", "",
      "| arm | ended in | boundary idle | strict idle | step | micro-batch | device wait | stage | prep share | boundary work | re-runs |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for a in arms:
    fault = f" (fault: {a['fault']})" if a["fault"] else ""
    ended = a["final_mode"] + (f" ({a['auto_disables']} auto-disable)" if a["auto_disables"] else "")
    lines.append(
        f"| {a['name']}{fault} | {ended} | {st(a['boundary_idle_s'])} | {st(a['boundary_idle_strict_s'])} |"
        f" {st(a['step_s'])} | {st(a['micro_batch_s'])} | {st(a['device_wait_s'])} | {st(a['stage_s'])} |"
        f" {a['prepare_share_of_micro_batch']:.1%} | {st(a['boundary_work_s'])} | {a['reruns']} |")
  lines += _comparisons_markdown(report["comparisons"], report["left_out_of_comparisons"])
  lines += _saving_markdown(arms)
  lines += ["", "## Predictions vs measurements", "",
            "| arm | predicted idle | band | measured | predicted step | band | measured |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
  for p, a in zip(report["predictions"]["arms"], arms):
    lo, hi = p["boundary_idle_band_s"]
    slo, shi = p["step_band_s"]
    lines.append(
        f"| {p['name']} | {fs(p['boundary_idle_s'])} | {fs(lo)}–{fs(hi)} |"
        f" {fs(a['boundary_idle_s']['median']) if a['boundary_idle_s'] else '-'} |"
        f" {p['step_s']:.4f} s | {slo:.4f}–{shi:.4f} s | {a['step_s']['median']:.4f} s |")
  lines += _fitted_markdown(report["fitted_predictions"])
  lines += ["", f"Predictions written at {report['predictions']['written_at']}, before the first scored arm.",
            "", "## Targets (measured, not asserted)", "", "| target | measured | met |", "| --- | --- | --- |"]
  for t in report["targets"]:
    lines.append(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |")
  lines += ["", "## Checks", "", "| check | arm | status | detail |", "| --- | --- | --- | --- |"]
  for ch in report["checks"]:
    lines.append(f"| {ch['name']} | {ch['arm']} | {ch['status'].upper()} | {ch['detail']} |")
  lines += ["", "Final state digests: " + ", ".join(f"{a['name']} `{a['final_state_digest'][:16]}…`" for a in arms),
            "", "Files: `report.json`, `records.json`, `predictions.json`, `trace.json` (ui.perfetto.dev),"
            " `timeline.png`.", ""]
  return "\n".join(lines)


def _comparisons_markdown(rows, left_out=()) -> list[str]:
  """The modes compared: what each saves over another per step and per boundary, with its interval; the arms
  left out, named."""
  if not rows and not left_out:
    return []
  lines = ["", "## Modes compared (saving per step and per boundary, 95 % Welch interval)", "",
           "| mode | against | arms | samples | saving per step | share of a step | boundary idle saved |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    step, share, idle = r["step_saving_s"], r["step_saving_share"], r["boundary_idle_saving_s"]
    lines.append(f"| {r['mode']} | {r['against']} | {r['arms'][0]} / {r['arms'][1]} |"
                 f" {r['samples']}: {r['n'][0]} / {r['n'][1]} |"
                 f" {fs(step['mean'])} ({fs(step['low'])} to {fs(step['high'])})"
                 f" | {share['mean']:+.2%} ({share['low']:+.2%} to {share['high']:+.2%}) |"
                 f" {fs(idle['mean'])} ({fs(idle['low'])} to {fs(idle['high'])}) |")
  if left_out:
    lines += ["", "Left out of the comparisons: " + ", ".join(left_out) + "."]
  return lines


def _saving_markdown(arms) -> list[str]:
  """Each staged arm's measured saving: its control boundaries against its staged ones (docs/design.md §6)."""
  rows = [a for a in arms if a.get("measured_saving")]
  if not rows:
    return []
  lines = ["", "## Measured saving (control boundaries against staged ones, 95 % interval)", "",
           "| arm | per step | boundary idle | staged | controls |", "| --- | --- | --- | --- | --- |"]
  for a in rows:
    saving = a["measured_saving"]
    step, idle = saving["step_s"], saving["boundary_idle_s"]
    if step is None:
      figures = f"not enough controls yet ({saving['control_n']} of {saving['min_controls']}) | -"
    else:
      figures = (f"{fs(step['mean'])} ({fs(step['low'])} to {fs(step['high'])}) |"
                 f" {fs(idle['mean'])} ({fs(idle['low'])} to {fs(idle['high'])})")
    lines.append(f"| {a['name']} | {figures} | {saving['staged_n']} | {saving['control_n']} |")
  return lines


def _fitted_markdown(fitted: dict) -> list[str]:
  """The arms predicted from components fitted on the OFF arm and one staged arm (``rig.fitted_predictions``)."""
  if not fitted or not fitted.get("arms"):
    return ["", f"No fitted predictions: {fitted.get('error', 'no records') if fitted else 'not computed'}."]
  def rng(lo_hi, fmt):
    lo, hi = lo_hi
    return "" if hi - lo <= 1e-9 else f" ({fmt(lo)}–{fmt(hi)})"
  lines = ["", f"## Predictions from the fit on {' and '.join(fitted['fitted_on'])} only", "",
           "Components fitted from those arms' records (`simulate --from` does the same); every other arm is a true"
           " prediction. A range is what the components the fit cannot identify allow. *At own compute*: the"
           " same boundary components with the device compute the arm itself measured (its micro-batches and"
           " update), which takes the machine's drift in compute between arms out of the error.", "",
           "| arm | predicted idle | measured idle | predicted step | measured step | step error | micro-batch"
           " | at own compute: step | error |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for a in fitted["arms"]:
    name = a["name"] + (" (fit)" if a["fitted_on"] else "")
    idle = "-" if a["measured_boundary_idle_s"] is None else fs(a["measured_boundary_idle_s"])
    err = a["step_s"] / a["measured_step_s"] - 1
    own = a.get("at_own_compute")
    own_cells = (f"{own['step_s']:.4f} s | {own['step_s'] / a['measured_step_s'] - 1:+.1%}" if own else "- | -")
    lines.append(f"| {name} | {fs(a['boundary_idle_s'])}{rng(a['boundary_idle_range_s'], fs)} | {idle} |"
                 f" {a['step_s']:.4f} s{rng(a['step_range_s'], lambda x: f'{x:.4f}')} |"
                 f" {a['measured_step_s']:.4f} s | {err:+.1%} | {fs(a['measured_micro_batch_s'])} | {own_cells} |")
  for u in fitted["unidentified"]:
    lines.append(f"\nUnidentified: {u['name']} — {u['why']}.")
  return lines


def _write_trace(path: Path, traces) -> None:
  events = []
  for index, (name, result) in enumerate(traces):
    arm_trace = chrome_trace(result.watched, result.host_spans, result.records, result.run_start)
    for e in arm_trace["traceEvents"]:
      e = dict(e)
      e["pid"] = index * 10 + e["pid"]
      if e.get("name") == "process_name":
        e["args"] = {"name": f"{name}: {e['args']['name']}"}
      events.append(e)
  path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _boundary_segments(result):
  """Device and host segments around one boundary (the middle one), relative to its last micro-batch."""
  records = result.records
  if len(records) < 2:
    return [], 0.0
  k = (len(records) - 1) // 2
  watched = [w for w in result.watched if w.ready_at is not None]
  segs, prev_ready = [], None
  for w in watched:
    start = w.dispatched_at if prev_ready is None else max(w.dispatched_at, prev_ready)
    prev_ready = w.ready_at
    name = "update" if w.kind == "update" else "micro-batch"
    segs.append(("device", name, start, w.ready_at, w.step, w.micro_step))
  m = max(w.micro_step for w in watched) + 1
  last = next(s for s in segs if s[4] == k and s[5] == m - 1 and s[1] == "micro-batch")
  first_next = next(s for s in segs if s[4] == k + 1 and s[5] == 0 and s[1] == "micro-batch")
  t0, t1 = last[2], first_next[3]
  window_start = min(t0, next(w.dispatched_at for w in watched if w.step == k and w.micro_step == m - 1))
  out = [(lane, name, a - t0, b - t0) for lane, name, a, b, *_ in segs if b >= window_start and a <= t1]
  r = records[k]
  if r.boundary_idle_s:
    ready = r.t_update_ready + result.run_start
    out.append(("device", "idle", ready - t0, ready + r.boundary_idle_s - t0))
  for span in result.host_spans:
    if span.end >= window_start and span.start <= t1:
      out.append(("host", HOST_KINDS.get(span.name, "boundary work"), span.start - t0, span.end - t0))
  return out, t1 - t0


def _write_timeline(path: Path, traces) -> None:
  import matplotlib  # import here: a missing matplotlib costs the timeline only (write_reports catches it)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # import here: after the backend is chosen
  from matplotlib.patches import Patch  # import here: as matplotlib, above

  n = len(traces)
  fig, ax = plt.subplots(figsize=(12, 1.1 * n + 1.2))
  labels, y = [], 0
  for name, result in traces:
    segs, _ = _boundary_segments(result)
    for lane_index, lane in enumerate(("host", "device")):
      row = y + lane_index
      for seg_lane, kind, a, b in segs:
        if seg_lane == lane:
          ax.broken_barh([(a, max(b - a, 1e-6))], (row - 0.4, 0.8), color=COLORS[kind])
      labels.append(f"{name} · {lane}")
    y += 2
  ax.set_yticks(range(len(labels)))
  ax.set_yticklabels(labels, fontsize=8)
  ax.set_xlabel("seconds from the start of step k's last micro-batch")
  ax.set_title("One step boundary per arm (middle boundary of each run)")
  ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper center",
            bbox_to_anchor=(0.5, -0.25), ncol=len(COLORS), fontsize=8)
  ax.invert_yaxis()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)

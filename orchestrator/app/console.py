"""What ``run_rl`` prints for people: the progress, the per-step table and the summary lines."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from orchestrator.loop.sample_log import SAMPLES_FILE, describe, last_sample
from orchestrator.phases import PHASES
from policies.saving import MIN_CONTROLS
from policies.step_boundary import Mode
from policies.units import format_bytes, format_seconds

if TYPE_CHECKING:  # annotations only: launch prints with this module before anything JAX-side is loaded
  from orchestrator.contract import RunSummary
  from orchestrator.loop.recorder import BoundaryRecord


def _cell(x, width=9, prec=4) -> str:
  return f"{x:{width}.{prec}f}" if isinstance(x, (int, float)) else f"{'-':>{width}}"


def format_table(records: Sequence[BoundaryRecord], *, max_rows: int = 40) -> str:
  """The per-step table printed at the end of a run (a long run shows its first and last steps).

  A live run adds the rollouts' columns: mean reward, accuracy, the weights
  version they were sampled with, and how long the boundary waited for them.
  """
  live = any(r.reward_mean is not None for r in records)
  header = (f"{'step':>4}  {'mode':<19} {'staged':<6} {'stage_s':>9} {'wait_s':>9} {'update_s':>9}"
            f" {'idle_s':>9} {'strict_s':>9} {'step_s':>9} {'loss':>9}")
  if live:
    header += f" {'reward':>7} {'acc':>6} {'ver':>4} {'rollout_s':>9}"
  lines = [header, "-" * len(header)]
  shown = list(records) if len(records) <= max_rows else list(records[: max_rows // 2]) + [None] + list(
      records[-max_rows // 2:])
  for r in shown:
    if r is None:
      lines.append(f"{'...':>4}  ({len(records) - max_rows} more steps in records.jsonl)")
      continue
    line = (f"{r.step:>4}  {r.mode:<19} {('yes' if r.staged else 'no'):<6} {_cell(r.stage_s)}"
            f" {_cell(r.device_wait_s)} {_cell(r.update_s)} {_cell(r.boundary_idle_s)}"
            f" {_cell(r.boundary_idle_strict_s)} {_cell(r.step_s)} {_cell(r.loss)}")
    if live:
      line += (f" {_cell(r.reward_mean, 7, 3)} {_cell(r.accuracy, 6, 3)}"
               f" {r.weights_version if r.weights_version is not None else '-':>4} {_cell(r.rollout_wait_s)}")
    lines.append(line)
  return "\n".join(lines)


#: Why a boundary that could have staged ran unstaged, by the policy's counter (``policies.step_boundary``).
UNSTAGED_BECAUSE = {"excluded_boundaries": "for a scored checkpoint", "no_memory_headroom": "short of device memory",
                    "controls": "as controls, to measure the saving",
                    "next_not_ready": "waiting for this boundary's weights (on-policy rollouts)"}


def scheduler_line(summary: RunSummary) -> str:
  """What the scheduler did, in words: how many boundaries staged before the update, after it and why, and how
  many ran unstaged and why (the run's last step has no boundary; a run stopped inside a step, its last
  finished step has one)."""
  timings, policy = summary.timings, summary.policy
  boundaries = timings.boundaries if timings.boundaries is not None else max(0, timings.steps - 1)
  counters = policy.counters
  staged, before = timings.staged_boundaries, timings.staged_before_update
  after = staged - before
  if policy.requested_mode is Mode.STAGE_AFTER_UPDATE:
    after_why = " (the mode stages there)" if after else ""
  else:
    for_rollouts = counters.get("staged_after_update_for_rollouts", 0)
    after_why = f" ({for_rollouts} because the next step's rollouts were not sampled yet)" if for_rollouts else ""
  unstaged = boundaries - staged
  whys = [f"{counters[key]} {words}" for key, words in UNSTAGED_BECAUSE.items() if counters.get(key)]
  rest = unstaged - sum(counters.get(key, 0) for key in UNSTAGED_BECAUSE)
  if rest > 0:
    whys.append(f"{rest} with staging off" if whys else "staging off")
  return (f"what the scheduler did: of {boundaries} {'boundary' if boundaries == 1 else 'boundaries'}, {before} staged the next step's first"
          f" micro-batch before the update, {after} after it{after_why}; {unstaged} ran unstaged"
          + (f" ({', '.join(whys)})" if unstaged and whys else ""))


def saving_line(summary: RunSummary) -> str | None:
  """What staging saved, measured from control boundaries (None: the run never asked to stage)."""
  saving, s = summary.timings.measured_saving, format_seconds
  if saving is None or not summary.policy.requested_mode.staged:
    return None
  if not saving.enough:
    return (f"measured saving: not enough controls yet ({saving.control_n} of {MIN_CONTROLS}, beside"
            f" {saving.staged_n} staged boundaries; step_boundary.control_every sets how often)")
  idle, step = saving.boundary_idle_s, saving.step_s
  verdict = ("staging cost time" if step.below_zero else "staging saved time" if step.low > 0
             else "no difference beyond the noise")
  if step.below_zero and summary.policy.final_mode.staged and not summary.policy.counters.get("saving_disable"):
    # this figure is over every record at 95 %; the policy judges its window at fixed looks, at stricter levels
    verdict += ", though not beyond the policy's stricter looks (design.md §6), so staging stayed on"
  line = (f"measured saving per step: {s(step.mean, zero='none')} (95 % interval {s(step.low)} to {s(step.high)}):"
          f" {verdict}; boundary idle saved: {s(idle.mean, zero='none, neither had any')}; over"
          f" {saving.staged_n} staged and {saving.control_n} control boundaries")
  held = summary.timings.boundary_held
  if step.below_zero or step.low > 0 or not held:
    return line
  return line + "\n" + held_line(held, summary.policy.threshold_s, idle_saving=idle)


def held_line(held: dict, threshold_s: float | None, *, idle_saving=None) -> str:
  """What the boundary held where staging made no difference beyond the noise: its parts, measured, and why
  nothing was left to remove where the measurements say so: the control boundaries idled no longer than the
  low-wait threshold, the boundary idle saved is not above zero beyond the noise, and the device still computed,
  after a stage, at least the threshold and the stage's own time (so an unstaged preparation had that to hide
  behind)."""
  s = format_seconds

  def part(key, zero=None):
    return s(held.get(key), zero=zero)  # "-" where not measured

  line = (f"what the boundary held (medians): a stage of {part('stage_s')}, an update of {part('update_s')},"
          f" boundary work of {part('boundary_work_s')}; the device still computed {part('device_wait_s')} after a"
          f" stage; control boundaries idled {part('control_idle_s', zero='none')}")
  control_idle, waited, stage = held.get("control_idle_s"), held.get("device_wait_s"), held.get("stage_s")
  grounded = (control_idle is not None and threshold_s is not None and waited is not None and stage is not None
              and control_idle <= threshold_s and waited >= max(threshold_s, stage)
              and (idle_saving is None or idle_saving.low <= 0))
  if grounded:
    line += (": an unstaged input's preparation hid behind the device's queued work as well as a staged one's,"
             " so nothing was left for staging to remove")
  return line


def format_summary(summary: RunSummary) -> str:
  """The summary lines printed after the table."""
  s, timings, policy = format_seconds, summary.timings, summary.policy
  lines = [
      f"mode: requested {policy.requested_mode.value}, ended {policy.final_mode.value}",
      f"median boundary idle: {s(timings.median_boundary_idle_s, zero='none, the device never waited')}"
      f" (strict: {s(timings.median_boundary_idle_strict_s, zero='none')})",
      f"median step: {s(timings.median_step_s)} over {timings.steps} steps",
      f"staged boundaries: {timings.staged_boundaries}; auto-disables: {policy.auto_disables}",
      *filter(None, [staged_bytes_line(timings), device_line(timings)]),
      scheduler_line(summary),
      *filter(None, [saving_line(summary)]),
      f"low-wait threshold: {s(policy.threshold_s)} (wait floor max {s(policy.wait_floor_max_s)})",
      f"final state digest: {summary.final_state_digest}",
  ]
  loaded = (summary.run or {}).get("loaded_weights") or {}
  if "weights_digest" in loaded:
    lines.append(f"loaded weights: {loaded['model.checkpoint']}, digest {loaded['weights_digest']} (an export's"
                 " export.json names it for the same weights)")
  if "reference_weights_digest" in loaded:
    lines.append(f"KL reference: {loaded['model.reference_checkpoint']}, digest"
                 f" {loaded['reference_weights_digest']}")
  if startup := (summary.run or {}).get("startup_s"):
    lines.append("start-up, seconds from the process's start: "
                 + ", ".join(f"{PHASES[phase]} {seconds:.1f}"  # in the order they came: a live run samples
                             for phase, seconds in sorted(startup.items(), key=lambda item: item[1])))
  if (r := summary.rollouts) is not None:
    lines.append(f"reward: first step {r.reward_first_step:.3f}, last {min(10, timings.steps)} steps"
                 f" {r.reward_last_10_steps:.3f}; median rollout wait"
                 f" {s(r.median_rollout_wait_s, zero='none, the rollouts were ready')}")
  if (e := summary.evaluation) is not None and e.eval_accuracy_end is not None:
    lines.append(f"held-out greedy accuracy ({e.eval_prompts} prompts):"
                 f" {e.eval_accuracy_start:.3f} at the start, {e.eval_accuracy_end:.3f} at the end")
    if e.during_run:
      lines.append(evaluations_line(e.during_run))
  if summary.records_path and (sample := last_sample(Path(summary.records_path).parent)) is not None:
    lines.append(f"a sample, {describe(sample)}")
    lines.append(f"samples: {Path(summary.records_path).parent / SAMPLES_FILE}")
  if summary.records_path:
    lines.append(f"records: {summary.records_path}")
  if summary.trace_path:
    lines.append(f"trace: {summary.trace_path} (open in ui.perfetto.dev)")
  return "\n".join(lines)


def staged_bytes_line(timings) -> str | None:
  """What a staged input held on this process's devices (a job's other processes hold their own rows): per
  micro-batch, by field (largest first), and on the fullest device."""
  by_field = timings.staged_bytes_by_field
  if not by_field:
    return None
  fields = ", ".join(f"{name} {format_bytes(n)}" for name, n in sorted(by_field.items(), key=lambda kv: -kv[1]))
  per_device = timings.peak_staged_bytes_per_device
  device = f"; at most {format_bytes(per_device)} on one device" if per_device is not None else ""
  return (f"staged input: {format_bytes(sum(by_field.values()))} per micro-batch on this process's devices"
          f" ({fields}){device}")


def device_line(timings) -> str | None:
  """What the run took of its devices, where the backend says: the fullest device's peak memory, the median
  step's model FLOP utilisation, and any program compiled after the first step (a recompile: a shape or
  sharding changed). None where there is nothing to say (a CPU run that recompiled nothing)."""
  parts = []
  if timings.peak_device_bytes is not None:
    parts.append(f"peak memory {format_bytes(timings.peak_device_bytes)} on the fullest device")
  if timings.median_mfu is not None:
    parts.append(f"model FLOP utilisation {100 * timings.median_mfu:.1f} % (median step; 6 x parameters x positions"
                 " + attention, over the chips' bf16 peak)")
  compiles = timings.compiles_after_first_step
  if compiles:
    parts.append(f"{compiles} programs compiled after the first step (records.jsonl's compiles says when)")
  elif compiles == 0 and parts:
    parts.append("nothing compiled after the first step")
  return "devices: " + "; ".join(parts) if parts else None


#: The evaluations during the run a closing line shows in full; more are thinned to this many, evenly.
EVALUATIONS_SHOWN = 8


def evaluations_line(during_run: list[dict]) -> str:
  """The evaluations during the run in a line: after how many updates, greedy accuracy (and pass@k)."""
  shown = during_run
  if len(shown) > EVALUATIONS_SHOWN:
    last = len(shown) - 1
    shown = [shown[round(i * last / (EVALUATIONS_SHOWN - 1))] for i in range(EVALUATIONS_SHOWN)]
  def one(e):
    passed = f" (pass@{e['pass_k']} {e['pass_at_k']:.3f})" if e.get("pass_at_k") is not None else ""
    return f"{e['updates']}: {e['accuracy']:.3f}{passed}"
  more = f" ({len(during_run)} in all; records.jsonl has each)" if len(shown) < len(during_run) else ""
  return "held-out greedy accuracy during the run, after N updates: " + ", ".join(map(one, shown)) + more


#: The progress bar's layout: tqdm's default without the rate (the postfix's step time says it), so that a live
#: run's step time, reward and accuracy fit in 80 columns beside the bar.
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"
#: Where stderr is not a terminal, about this many plain progress lines over a run instead of a bar.
PLAIN_LINES = 20


def progress_postfix(record: BoundaryRecord) -> str:
  """The progress bar's postfix after one step: short, so that it fits beside the bar (``BAR_FORMAT``)."""
  step = f"step={record.step_s:.3f}s"
  if record.reward_mean is not None:
    return f"{step} reward={record.reward_mean:.3f} acc={_number(record.accuracy, '.2f')}"
  idle = record.boundary_idle_s
  return f"{step} idle={_number(idle, '.4f')}{'s' if idle is not None else ''} loss={_number(record.loss, '.4f')}"


def progress_fields(record: BoundaryRecord) -> str:
  """Every field of a plain progress line (``Progress``): the step's timings, loss and, live, its rollouts."""
  fields = {"step_s": _number(record.step_s, ".3f"), "idle_s": _number(record.boundary_idle_s, ".4f"),
            "loss": _number(record.loss, ".4f"), "boundary": boundary_word(record)}
  if record.reward_mean is not None:
    fields.update(reward=_number(record.reward_mean, ".3f"), acc=_number(record.accuracy, ".2f"),
                  ver=str(record.weights_version), tok_s=_number(record.sampled_tokens_per_s, ".0f"),
                  rollout_wait_s=_number(record.rollout_wait_s, ".3f"))
  return " ".join(f"{key}={value}" for key, value in fields.items())


def boundary_word(record: BoundaryRecord) -> str:
  """What the boundary after the record's step did, in one word: staged before or after the update, a control,
  unstaged, or none (the run's last step)."""
  if record.boundary_idle_s is None and not record.staged:
    return "none"
  if record.staged:
    return "staged-before-update" if record.stage_before_update else "staged-after-update"
  return "control" if record.control else "unstaged"


def _number(value, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def plain_every(steps: int) -> int:
  """Steps between two plain progress lines for a run of ``steps`` steps: ``ceil(steps / PLAIN_LINES)``, so
  a long run prints about 20 lines and one of up to 20 steps a line after every step."""
  return max(1, math.ceil(steps / PLAIN_LINES))


class Progress:
  """The run's progress on ``stream`` (stderr), as tqdm and Tunix show it: a bar at a terminal; where the
  stream is not a terminal (a log file, a pipe, CI), no bar but one plain line every ``plain_every`` steps of
  those this run has left, and after its last step.

  Called with each finished ``BoundaryRecord`` (the program's ``on_step``).
  """

  def __init__(self, desc: str, *, total: int, initial: int = 0, stream: TextIO | None = None,
               terminal: bool | None = None):
    self.desc, self.total, self.initial = desc, total, initial
    self.stream = stream if stream is not None else sys.stderr
    if terminal is None:
      terminal = self.stream.isatty()
    self.every = plain_every(total - initial)
    self.bar = (tqdm(total=total, initial=initial, desc=desc, unit="step", file=self.stream, dynamic_ncols=True,
                     bar_format=BAR_FORMAT) if terminal else None)

  def __call__(self, record: BoundaryRecord) -> None:
    if self.bar is not None:
      self.bar.set_postfix_str(progress_postfix(record), refresh=False)
      self.bar.update(1)
      return
    done = record.step + 1
    if (done - self.initial) % self.every == 0 or done == self.total:
      print(f"[progress] {self.desc}: step {done}/{self.total} {progress_fields(record)}", file=self.stream,
            flush=True)

  def logging_redirected(self) -> contextlib.AbstractContextManager:
    """Log lines written while this is held go above the bar (tqdm's), not through it; without a bar they go
    where they went."""
    return logging_redirect_tqdm() if self.bar is not None else contextlib.nullcontext()

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()

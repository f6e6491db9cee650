"""The accelerator benchmark's decisions and output, from numbers alone (no JAX): sizes, steps, rows, table.

``orchestrator.bench.accelerator`` is the command; ``accelerator_device`` its
device side (it builds, times and runs); this module decides the next size to
try, the steps per arm, and turns each arm's records into its row of the table.
"""

from __future__ import annotations

import dataclasses
import statistics

from policies import Mode

MODES = (Mode.OFF, Mode.PIPELINED, Mode.STAGE_AFTER_UPDATE, Mode.STAGE_BEFORE_UPDATE)
SIZING_SHARE = 1 / 3  # of the budget, at most, for building and timing sizes
WARMUP_STEPS = 2
MAX_GROWTH_PER_TRY = 64.0  # a try scales the compute by at most this (timings of tiny sizes are overhead)
MEMORY_SHARE = 0.6  # a grown size may use at most this share of the device's memory (peak, scaled)
MAX_LAYERS = 64


@dataclasses.dataclass(frozen=True)
class Size:
  """What sizing chooses: the preset, its layer count, and the micro-batch shape."""

  preset: str
  num_layers: int
  rows: int
  tokens_per_row: int

  def describe(self) -> str:
    return (f"{self.preset} with {self.num_layers} layers, {self.rows} rows x {self.tokens_per_row} tokens"
            f" ({self.rows * self.tokens_per_row:,} tokens per micro-batch)")


def in_window(micro_s: float, target_s: float) -> bool:
  return 0.6 * target_s <= micro_s <= 2 * target_s


def _round_rows(rows: float, devices: int) -> int:
  return max(devices, int(round(rows / devices)) * devices)


def next_size(size: Size, micro_s: float, target_s: float, *, devices: int, max_tokens_per_device: int,
              memory: tuple[int, int] | None = None) -> Size | None:
  """The size to try after ``size`` took ``micro_s`` per micro-batch; None when it is in the window or none moves.

  Compute scales about linearly in rows and in layers, so the next size scales
  by ``target_s / micro_s`` (at most ``MAX_GROWTH_PER_TRY``, at least 1/16):
  rows first, as far as ``max_tokens_per_device`` tokens per device allow, then
  layers. ``memory`` is (peak bytes in use, bytes limit) of a device: a growth
  that would take the peak past ``MEMORY_SHARE`` of the limit is cut back.
  Rows stay a multiple of ``devices`` (they split over the mesh).
  """
  if in_window(micro_s, target_s):
    return None
  factor = min(MAX_GROWTH_PER_TRY, max(1 / 16, target_s / max(micro_s, 1e-9)))
  if memory is not None and factor > 1:
    peak, limit = memory
    factor = max(1.0, min(factor, MEMORY_SHARE * limit / max(peak, 1)))
  rows, layers = size.rows, size.num_layers
  if factor >= 1:
    row_cap = max(rows, _round_rows(max_tokens_per_device * devices / size.tokens_per_row, devices))
    new_rows = max(rows, min(row_cap, _round_rows(rows * factor, devices)))
    rest = factor * rows / new_rows
    new_layers = min(MAX_LAYERS, max(layers, round(layers * rest))) if rest >= 1.25 else layers
  else:
    new_rows = _round_rows(rows * factor, devices)
    rest = factor * rows / new_rows
    new_layers = max(1, round(layers * rest)) if rest <= 0.8 else layers
  new = dataclasses.replace(size, rows=new_rows, num_layers=new_layers)
  return None if new == size else new


def steps_per_arm(seconds_left: float, *, step_s: float, arm_overhead_s: float, generate_step_s: float,
                  arms: int, max_steps: int) -> int:
  """How many steps each arm runs so that generating them and ``arms`` arms fit ``seconds_left`` (2 at least)."""
  per_step = generate_step_s + arms * 1.1 * step_s
  fit = (seconds_left - arms * arm_overhead_s) / max(per_step, 1e-9)
  return max(2, min(max_steps, int(fit)))


class StopAfter:
  """A program's ``stop_requested``: true once ``clock()`` passes ``at``, but never before ``min_steps`` steps.

  The program polls it once per boundary, in step order (boundary k before k+1), so the n-th call comes
  at step n-1: stopping there ends the run after n steps.
  """

  def __init__(self, at: float, clock, min_steps: int = 2):
    self.at, self.clock, self.min_steps = at, clock, min_steps
    self.calls = 0

  def __call__(self) -> bool:
    self.calls += 1
    return self.calls >= self.min_steps and self.clock() > self.at


def _median(values) -> float | None:
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def _most_on_one_device(value):
  """A record's per-device figure (a list in device order) as the most on any one device; a number as is."""
  if isinstance(value, (list, tuple)):
    known = [v for v in value if v is not None]
    return max(known) if known else None
  return value


def mode_row(mode: Mode, records: list, policy, digest: str | None, inputs: dict, device_memory: dict | None,
             *, steps_asked: int, wall_s: float, input_copy: dict | None = None) -> dict:
  """One mode's figures from its records, the engine's input timings (``inputs``) and the device's memory.

  ``staged_bytes_per_device``, ``device_bytes_in_use`` and ``device_bytes_limit`` are read from the
  records where they carry them. Otherwise staged bytes are those of one micro-batch's input on a device
  (``input_copy``, measured at sizing: every input has the compiled shape) where the mode staged, and
  device memory is the device's own figure after the arm; the row says which (``*_from``).
  """
  boundaries = records[:-1]
  staged = [r for r in boundaries if r.staged]
  field = lambda name, rs: _median(_most_on_one_device(getattr(r, name, None)) for r in rs)  # noqa: E731
  in_use, limit = field("device_bytes_in_use", records), field("device_bytes_limit", records)
  memory_from = "records" if in_use is not None else None
  if in_use is None and device_memory:
    in_use, limit, memory_from = device_memory.get("bytes_in_use"), device_memory.get("bytes_limit"), "device"
  staged_bytes = field("staged_bytes_per_device", staged)
  staged_from = "records" if staged_bytes is not None else None
  if staged_bytes is None and staged and input_copy:
    staged_bytes, staged_from = input_copy.get("bytes_per_device"), "input shape"
  return {
      "mode": mode.value, "steps": len(records), "steps_asked": steps_asked, "cut_short": len(records) < steps_asked,
      "wall_s": wall_s,
      "median_step_s": _median(r.step_s for r in records),
      "median_micro_batch_s": _median(x for r in records for x in r.micro_batch_s),
      "median_boundary_idle_s": _median(r.boundary_idle_s for r in boundaries),
      "median_boundary_idle_strict_s": _median(r.boundary_idle_strict_s for r in boundaries),
      "median_stage_s": _median(r.stage_s for r in staged),
      "median_device_wait_s": _median(r.device_wait_s for r in staged),
      "boundaries": len(boundaries), "staged_boundaries": len(staged),
      "auto_disables": policy.auto_disables, "final_mode": policy.final_mode.value,
      "median_mapping_s": _median(inputs["mapping_s"]), "median_placement_s": _median(inputs["placement_s"]),
      "inputs_timed": len(inputs["mapping_s"]),
      "input_bytes_per_micro_batch": (input_copy or {}).get("bytes"),
      "staged_bytes_per_device": staged_bytes, "staged_bytes_from": staged_from,
      "device_bytes_in_use": in_use, "device_bytes_limit": limit, "device_memory_from": memory_from,
      "device_peak_bytes_in_use": (device_memory or {}).get("peak_bytes_in_use"),
      "final_state_digest": digest,
  }


def digest_verdict(rows: list[dict]) -> tuple[str, int]:
  """The digests line and the exit status: identical (0), which mode differs (1), or not comparable (3)."""
  cut = [r for r in rows if r["cut_short"]]
  if cut:
    names = ", ".join(f"{r['mode']} ({r['steps']} of {r['steps_asked']} steps)" for r in cut)
    return f"digests: not compared: cut short by the time budget: {names}", 3
  reference = rows[0]["final_state_digest"]
  differ = [r["mode"] for r in rows if r["final_state_digest"] != reference]
  if not differ:
    return f"digests: identical ({reference})", 0
  return f"digests: DIFFER: {', '.join(differ)} differ from {rows[0]['mode']} ({reference})", 1


def _fmt(value, scale: float = 1.0, digits: int = 3) -> str:
  return "-" if value is None else f"{value * scale:.{digits}f}"


def format_table(rows: list[dict]) -> list[str]:
  """The per-mode table (seconds as ms where they are small; bytes as MB and GB)."""
  head = (f"{'mode':<20} {'steps':>5} {'step_s':>8} {'idle_ms':>9} {'strict_ms':>9} {'stage_ms':>9}"
          f" {'staged':>7} {'map_ms':>8} {'copy_ms':>8} {'staged_MB/dev':>13} {'mem_GB':>7}  digest")
  lines = [head, "-" * len(head)]
  for r in rows:
    lines.append(
        f"{r['mode']:<20} {r['steps']:>5} {_fmt(r['median_step_s'], 1, 4):>8}"
        f" {_fmt(r['median_boundary_idle_s'], 1e3):>9} {_fmt(r['median_boundary_idle_strict_s'], 1e3):>9}"
        f" {_fmt(r['median_stage_s'], 1e3):>9} {r['staged_boundaries']:>3}/{r['boundaries']:<3}"
        f" {_fmt(r['median_mapping_s'], 1e3):>8} {_fmt(r['median_placement_s'], 1e3):>8}"
        f" {_fmt(r['staged_bytes_per_device'], 1e-6, 2):>13} {_fmt(r['device_bytes_in_use'], 1e-9, 2):>7}"
        f"  {(r['final_state_digest'] or '-')[:12]}")
  return lines


class Printed:
  """Prints lines and keeps them, so the JSON holds everything printed."""

  def __init__(self):
    self.lines: list[str] = []

  def __call__(self, line: str = "") -> None:
    self.lines.append(line)
    print(line, flush=True)

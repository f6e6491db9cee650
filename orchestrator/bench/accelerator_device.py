"""The accelerator benchmark's device side: what JAX sees, sizing, the warm-up and the four arms.

``orchestrator.bench.accelerator`` imports this module once the host core is
reserved (JAX and numpy start here). The engine is the JAX engine built with the
recipe's engine options (as the rig's ``LocalRigTrainer`` builds it), sized by
``accelerator_plan.next_size``; every arm runs the real ``RLProgram`` over a
``TrainerWorker`` from one snapshot, with the policy ``policy_from_recipe`` gives.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time

import jax

from orchestrator.assembly import policy_from_recipe, program_config
from orchestrator.bench.accelerator_plan import (MODES, SIZING_SHARE, WARMUP_STEPS, Size, StopAfter, format_table,
                                                 in_window, mode_row, next_size, steps_per_arm)
from orchestrator.data.synthetic import SyntheticRollouts
from orchestrator.engine import build_engine
from orchestrator.models.presets import load_preset
from orchestrator.loop.program import RLProgram
from orchestrator.loop.trainer_worker import TrainerWorker
from orchestrator.rig.calibration import calibrate
from policies import Mode

COPY_REPEATS = 3


class InputMeter:
  """The engine as the worker sees it, keeping each micro-batch input's host seconds: mapping, and issuing its copy.

  An unstaged micro-batch's come from its ``fwd_bwd`` receipt, a staged one's
  from its prepared input (its ``fwd_bwd`` receipt then says 0, and is not
  counted twice). It has no checkpoint methods, so an arm that stops early
  writes no checkpoint.
  """

  def __init__(self, engine):
    self._engine = engine
    self._prepared = None
    self.inputs: dict[str, list] = {"mapping_s": [], "placement_s": []}

  def _keep(self, mapping_s, placement_s) -> None:
    self.inputs["mapping_s"].append(mapping_s)
    self.inputs["placement_s"].append(placement_s)

  def fwd_bwd(self, x, apply_optimizer=False):
    receipt = self._engine.fwd_bwd(x, apply_optimizer)
    if x is self._prepared:
      self._prepared = None
    else:
      self._keep(receipt.mapping_s, receipt.placement_s)
    return receipt

  def prepare_fwd_bwd_input(self, payload):
    self._prepared = self._engine.prepare_fwd_bwd_input(payload)
    self._keep(self._prepared.mapping_s, self._prepared.placement_s)
    return self._prepared

  def update(self):
    return self._engine.update()

  def wait_for_device(self) -> float:
    return self._engine.wait_for_device()

  def get_metrics(self):
    return self._engine.get_metrics()

  def export_weights(self):
    return self._engine.export_weights()

  def state_digest(self) -> str:
    return self._engine.state_digest()


@dataclasses.dataclass
class Bench:
  """One benchmark's settings and clock: the arguments, the recipe, where lines go, the devices, the budget."""

  args: object
  recipe: object
  say: object
  devices: list
  started: float
  deadline: float

  @property
  def micro_batches(self) -> int:
    return self.recipe.batch.micro_batches_per_step

  def memory(self) -> dict | None:
    return device_memory(self.devices[0])


def device_memory(device) -> dict | None:
  """The device's own memory figures (bytes in use, peak, limit), or None where it has none (a CPU)."""
  try:
    stats = device.memory_stats()
  except (RuntimeError, NotImplementedError, AttributeError):
    return None
  if not stats:
    return None
  return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def local_devices(count: int | None) -> tuple[list, dict]:
  """The first ``count`` local devices (all by default) and their description; ValueError when there are fewer."""
  local = jax.local_devices()
  if count is not None and count > len(local):
    raise ValueError(f"--devices {count}: this host has {len(local)} {local[0].platform} device(s)")
  used = local[:count] if count else local
  memory = device_memory(used[0]) or {}
  return used, {"platform": used[0].platform, "kind": used[0].device_kind, "count": jax.device_count(),
                "local_count": len(local), "used": len(used), "bytes_limit": memory.get("bytes_limit")}


def _build(bench: Bench, size: Size):
  preset = load_preset(size.preset, num_layers=size.num_layers)
  options = {f.name: getattr(bench.recipe.engine, f.name) for f in dataclasses.fields(bench.recipe.engine)
             if f.name != "backend"}
  return build_engine(preset, mesh={"fsdp": len(bench.devices)}, rows=size.rows, tokens_per_row=size.tokens_per_row,
                      **options)


def _rollouts(bench: Bench, engine) -> SyntheticRollouts:
  return SyntheticRollouts(engine.preset.vocab_size, engine.rows, engine.tokens_per_row, seed=bench.args.seed)


def time_copy(engine, payload) -> dict:
  """One micro-batch's input alone, the device idle: its bytes, mapping, and its copy from issue to arrays ready."""
  samples = []
  for _ in range(COPY_REPEATS):
    engine.wait_for_device()
    t0 = time.perf_counter()
    prepared = engine.prepare_fwd_bwd_input(payload)
    jax.block_until_ready(prepared.arrays)
    samples.append((time.perf_counter() - t0, prepared.mapping_s, prepared.placement_s))
  arrays = prepared.arrays.values()
  copy_s = statistics.median(total - mapping for total, mapping, _ in samples)
  nbytes = sum(a.nbytes for a in prepared.host_arrays.values())
  return {"bytes": nbytes,
          "bytes_per_device": sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in arrays),
          "mapping_s": statistics.median(s[1] for s in samples),
          "issue_s": statistics.median(s[2] for s in samples),
          "copy_s": copy_s, "gb_per_s": nbytes / copy_s / 1e9 if copy_s > 0 else None}


def measure(bench: Bench, size: Size):
  """Builds ``size`` and times it: the rig's calibration (micro-batch, preparation, update, floor) and the copy.

  Returns the engine, its initial snapshot and what was measured.
  """
  t0 = time.perf_counter()
  engine = _build(bench, size)
  built_s = time.perf_counter() - t0
  source = _rollouts(bench, engine)
  g0 = time.perf_counter()
  steps = [source.step(s, bench.micro_batches) for s in range(WARMUP_STEPS)]
  generate_step_s = (time.perf_counter() - g0) / WARMUP_STEPS
  start = engine.snapshot()
  components, noise = calibrate(engine, steps, start)
  copy = time_copy(engine, steps[0][0])
  engine.restore(start)
  return engine, start, {
      "size": dataclasses.asdict(size), "build_s": built_s, "generate_step_s": generate_step_s,
      "micro_batch_s": components.micro_batch_s, "prepare_s": components.map_s,
      "update_s": components.update_s, "dispatch_s": components.dispatch_s, "wait_floor_s": components.wait_floor_s,
      "micro_batch_spread": noise, "copy": copy, "memory": bench.memory(), "try_s": time.perf_counter() - t0}


def _first_size(bench: Bench) -> Size:
  args, preset = bench.args, load_preset(bench.args.preset)
  n = len(bench.devices)
  rows = args.rows or preset.rows
  return Size(args.preset, args.layers or preset.num_layers, max(n, -(-rows // n) * n),
              args.tokens_per_row or preset.tokens_per_row)


def _why_stop(bench: Bench, tries: list, size: Size, nxt: Size | None) -> str | None:
  """Why sizing ends after ``size`` (None: try ``nxt``)."""
  last, args = tries[-1], bench.args
  if nxt is None:
    return "in the target window" if in_window(last["micro_batch_s"], args.target_s) else "no size moves it closer"
  if len(tries) >= args.max_tries:
    return f"--max-tries {args.max_tries} reached"
  # The try's parts scale apart: the build with the layers (a smaller size builds no faster), generating rollouts
  # with the rows, the micro-batches it ran (two per micro-batch of a step: each alone, then back to back) with
  # both; the rest stays.
  rows, layers = nxt.rows / size.rows, nxt.num_layers / size.num_layers
  build, generate = last["build_s"], WARMUP_STEPS * last["generate_step_s"]
  compute = 2 * bench.micro_batches * WARMUP_STEPS * last["micro_batch_s"]
  rest = max(0.0, last["try_s"] - build - generate - compute)
  estimate = build * max(1.0, layers) + generate * rows + compute * rows * layers + rest
  if time.perf_counter() + estimate > bench.started + SIZING_SHARE * (bench.deadline - bench.started):
    return "the sizing share of the budget is spent"
  return None


def _try_line(index: int, entry: dict) -> str:
  copy = entry["copy"]
  return (f"size {index}: {Size(**entry['size']).describe()}: micro-batch {entry['micro_batch_s']:.4f} s, update"
          f" {entry['update_s']:.4f} s, input {copy['bytes'] / 1e6:.2f} MB copied in {copy['copy_s'] * 1e3:.3f} ms"
          f" (build {entry['build_s']:.1f} s)")


def size_model(bench: Bench):
  """Grows the size from the preset until a micro-batch takes about ``--target-s`` (bounded tries and time).

  Returns the engine built at the chosen size, its snapshot, the size, every
  try and why sizing ended. A larger size that fails to build or run (out of
  device memory) ends sizing at the size before it, built again.
  """
  size, tries = _first_size(bench), []
  engine, start, entry = measure(bench, size)
  while True:
    tries.append(entry)
    bench.say(_try_line(len(tries), entry))
    peak, limit = (entry["memory"] or {}).get("peak_bytes_in_use"), (entry["memory"] or {}).get("bytes_limit")
    nxt = next_size(size, entry["micro_batch_s"], bench.args.target_s, devices=len(bench.devices),
                    max_tokens_per_device=bench.args.max_tokens_per_device,
                    memory=(peak, limit) if peak and limit else None)
    why = _why_stop(bench, tries, size, nxt)
    if why:
      return engine, start, size, tries, why
    del engine, start
    gc.collect()
    failed = None
    try:
      engine, start, entry = measure(bench, nxt)
    except (jax.errors.JaxRuntimeError, MemoryError) as e:
      failed = (str(e).splitlines() or [type(e).__name__])[0][:160]
    if failed is not None:  # out of the except block, so the failed engine's arrays are freed first
      bench.say(f"size {len(tries) + 1}: {nxt.describe()} failed ({failed}); back to size {len(tries)}")
      gc.collect()
      engine = _build(bench, size)
      return engine, engine.snapshot(), size, tries, "the next size did not fit"
    size = nxt


def run_arm(bench: Bench, engine, start, mode: Mode, steps: list, stop_at: float):
  """One arm from ``start``: the program over ``steps``; ends after the step where the clock passes ``stop_at``
  (two steps at least: one boundary)."""
  engine.restore(start)
  meter = InputMeter(engine)
  worker = TrainerWorker(meter)
  policy = policy_from_recipe(bench.recipe, worker.capabilities, mode=mode, steps=len(steps))
  config = dataclasses.replace(program_config(bench.recipe, None, steps=len(steps)), checkpoint_every=0,
                               scored_checkpoint_steps=())
  t0 = time.perf_counter()
  result = RLProgram(worker, policy, steps, config, stop_requested=StopAfter(stop_at, time.perf_counter)).run()
  engine.wait_for_device()
  return result, meter.inputs, time.perf_counter() - t0


def _plan(bench: Bench, engine, start, entry: dict, margin_s: float) -> dict:
  """The warm-up run (two steps, first-run costs) and, from it, the steps per arm."""
  warm = [_rollouts(bench, engine).step(s, bench.micro_batches) for s in range(WARMUP_STEPS)]
  result, _, wall = run_arm(bench, engine, start, Mode.STAGE_BEFORE_UPDATE, warm, float("inf"))
  step_s = max(r.step_s for r in result.records)
  overhead = max(0.0, wall - sum(r.step_s for r in result.records))
  left = bench.deadline - margin_s - time.perf_counter()
  n = steps_per_arm(left, step_s=step_s, arm_overhead_s=overhead, generate_step_s=entry["generate_step_s"],
                    arms=len(MODES), max_steps=bench.args.max_steps)
  return {"steps_per_arm": n, "micro_batches_per_step": bench.micro_batches, "warmup_step_s": step_s,
          "arm_overhead_s": overhead, "seconds_left_for_arms": left, "margin_s": margin_s}


def _staging_notes(rows: list[dict]) -> list[str]:
  notes = []
  for r in rows:
    if Mode(r["mode"]).staged and r["staged_boundaries"] < r["boundaries"]:
      notes.append(f"{r['mode']}: {r['staged_boundaries']} of {r['boundaries']} boundaries staged, final mode"
                   f" {r['final_mode']} (auto-disables: {r['auto_disables']}); --wait-threshold-s 0 pins the policy")
  return notes


def _arms(bench: Bench, engine, start, payloads: list, margin_s: float, copy: dict) -> list[dict]:
  rows = []
  for index, mode in enumerate(MODES):
    now = time.perf_counter()
    share = (bench.deadline - margin_s - now) / (len(MODES) - index)
    fed = payloads if index == 0 else payloads[:rows[0]["steps"]]
    bench.say(f"arm {index + 1}/{len(MODES)}: {mode.value}, {len(fed)} steps")
    stop_at = now + share if index == 0 else bench.deadline - margin_s
    result, inputs, wall = run_arm(bench, engine, start, mode, fed, stop_at)
    summary = result.summary
    asked = len(result.records) if index == 0 else len(fed)  # the first arm sets the others' length
    rows.append(mode_row(mode, result.records, summary.policy, summary.final_state_digest, inputs, bench.memory(),
                         steps_asked=asked, wall_s=wall, input_copy=copy))
    if index == 0 and len(result.records) < len(fed):
      bench.say(f"{mode.value} ended after {len(result.records)} of {len(fed)} steps (its share of the budget);"
                " the other arms run as many")
  return rows


def run_bench(args, recipe, say, devices: tuple[list, dict], *, started: float, deadline: float) -> dict:
  """Sizing, warm-up, the four arms and the table on ``devices`` (``local_devices``); returns what the JSON holds
  (less the verdict)."""
  devices, described = devices
  limit = described["bytes_limit"]
  say(f"devices: {described['platform']} x{described['used']} used of {described['count']} ({described['kind']});"
      f" memory per device: {'unknown' if limit is None else f'{limit / 1e9:.1f} GB'}")
  bench = Bench(args, recipe, say, devices, started, deadline)
  engine, start, size, tries, why = size_model(bench)
  entry = tries[-1]  # the chosen size's (a larger one that failed is not among the tries)
  copy = entry["copy"]
  say(f"size: {size.describe()} ({why}); micro-batch {entry['micro_batch_s']:.4f} s against a target of"
      f" {args.target_s} s")
  rate = "-" if copy["gb_per_s"] is None else f"{copy['gb_per_s']:.2f} GB/s"
  say(f"input per micro-batch: {copy['bytes'] / 1e6:.3f} MB ({copy['bytes_per_device'] / 1e6:.3f} MB per device);"
      f" alone: mapping {copy['mapping_s'] * 1e3:.3f} ms, copy {copy['copy_s'] * 1e3:.3f} ms ({rate})")
  margin_s = min(10.0, max(2.0, 0.02 * (deadline - started)))
  plan = _plan(bench, engine, start, entry, margin_s)
  say(f"plan: {plan['steps_per_arm']} steps per arm of {plan['micro_batches_per_step']} micro-batches (warm-up"
      f" step {plan['warmup_step_s']:.4f} s, {plan['arm_overhead_s']:.2f} s per arm besides its steps,"
      f" {plan['seconds_left_for_arms']:.0f} s left)")
  if plan["seconds_left_for_arms"] <= 0:
    say(f"the budget was spent before the arms ({time.perf_counter() - started:.0f} s): each arm runs the least,"
        " 2 steps; give more --minutes")
  source = _rollouts(bench, engine)
  payloads = [source.step(s, bench.micro_batches) for s in range(plan["steps_per_arm"])]
  rows = _arms(bench, engine, start, payloads, margin_s, copy)
  for line in format_table(rows) + _staging_notes(rows):
    say(line)
  say("map_ms, copy_ms: median host seconds per micro-batch input, packing it and issuing its host-to-device copy"
      " (engine receipts and staged inputs; an accelerator completes the transfer after the call, the line"
      " 'input per micro-batch' times it alone); staged_MB/dev, mem_GB: from the records where they carry them,"
      " else the input's shape and the device's own figures")
  return {"devices": described, "size": dataclasses.asdict(size),
          "sizing": {"tries": tries, "ended": why, "target_s": args.target_s}, "input_copy": copy, "plan": plan,
          "policy": {"wait_threshold_s": recipe.step_boundary.wait_threshold_s,
                     "disable_after": recipe.step_boundary.disable_after},
          "modes": rows}

"""Component times for the boundary model's predictions, measured before the first scored arm.

``calibrate`` times an engine in this process, each part alone on the device
(micro-batch, input preparation, dispatch, update, re-runs, boundary work, the
wait floor), then micro-batches back to back. ``calibrate_worker`` measures the
same parts through a worker's own calls (a remote trainer's), so the wire's
costs (round trips, payload transfer) are part of the components.
"""

from __future__ import annotations

import statistics
import time

import jax

from orchestrator.loop.weight_sync import HostWeightStore
from policies.boundary_model import Components


def _time_parts(engine, steps) -> dict[str, list]:
  """Each part of every step alone on the device: prepare, dispatch, micro-batch, re-run, update, work."""
  parts = {k: [] for k in ("micro", "prepare", "dispatch", "update", "metrics", "sync", "rerun", "reruns")}
  store = HostWeightStore()

  def rerun_if_overflowed() -> int:  # times a re-run apart from the micro-batch after it
    t0 = time.perf_counter()
    if not engine.resolve_pending_overflow():
      return 0
    engine.wait_for_device()
    parts["rerun"].append(time.perf_counter() - t0)
    return 1

  for payloads in steps:  # every step: re-run counts vary from step to step
    step_reruns = 0
    for p in payloads:
      engine.wait_for_device()
      t0 = time.perf_counter()
      prepared = engine.prepare_fwd_bwd_input(p)
      jax.block_until_ready(prepared.arrays)
      t1 = time.perf_counter()
      receipt = engine.fwd_bwd(prepared)
      t2 = time.perf_counter()
      receipt.ready.block_until_ready()
      parts["prepare"].append(t1 - t0)
      parts["dispatch"].append(t2 - t1)
      parts["micro"].append(time.perf_counter() - t1)
      if engine.rerun_dropped:
        step_reruns += rerun_if_overflowed()
    parts["reruns"].append(step_reruns)
    t0 = time.perf_counter()
    engine.update().ready.block_until_ready()
    parts["update"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    engine.get_metrics()
    t1 = time.perf_counter()
    store(engine.train_step, engine.export_weights())
    parts["metrics"].append(t1 - t0)
    parts["sync"].append(time.perf_counter() - t1)
  return parts


def _back_to_back_spacing(engine, steps) -> list[float]:
  """The steady-state spacing of completions with every micro-batch of a step queued at once.

  Back to back, a micro-batch is slower than alone on an idle device (the host's
  work shares the memory bus); step time is made of this spacing.
  """
  spacing = []
  for payloads in steps:
    prepared = [engine.prepare_fwd_bwd_input(p) for p in payloads]
    jax.block_until_ready([x.arrays for x in prepared])
    done = [engine.fwd_bwd(x) for x in prepared]
    done[0].ready.block_until_ready()
    t_first = time.perf_counter()
    done[-1].ready.block_until_ready()
    spacing.append((time.perf_counter() - t_first) / (len(done) - 1))
    engine.update()
    engine.wait_for_device()
  return spacing


def calibrate(engine, steps, snapshot, *, floor_samples: int = 8) -> tuple[Components, float]:
  """Measures component times on unstaged, serialised steps (device idle between parts).

  Runs every step of the plan once, each part alone on the device (re-runs
  timed apart from the micro-batch after them), then restores ``snapshot``.
  Returns the components and the relative spread (stdev / mean) of the
  micro-batch samples: how noisy this machine is right now.
  """
  parts = _time_parts(engine, steps)
  engine.wait_for_device()
  floor = [engine.wait_for_device() for _ in range(floor_samples)]
  engine.restore(snapshot)
  spacing = []
  # Under dropless re-runs each fwd_bwd first reads the previous flag, so micro-batches
  # never queue back to back; the serial figure is the right one there.
  if len(steps[0]) > 1 and not engine.rerun_dropped:
    spacing = _back_to_back_spacing(engine, steps)
    engine.restore(snapshot)
  samples = spacing if len(spacing) > 1 else parts["micro"]
  noise = statistics.stdev(samples) / statistics.mean(samples) if len(samples) > 1 else 0.0
  return Components(
      micro_batch_s=statistics.median(spacing) if spacing else statistics.median(parts["micro"]),
      map_s=statistics.median(parts["prepare"]),
      update_s=statistics.median(parts["update"]),
      metrics_s=statistics.median(parts["metrics"]),
      weight_sync_s=statistics.median(parts["sync"]),
      dispatch_s=statistics.median(parts["dispatch"]),
      wait_floor_s=max(floor),
      micro_batches_per_step=len(steps[0]),
      # A read of the last micro-batch's overflow flag keeps update() until that micro-batch is done.
      update_overlap_share=0.0 if engine.rerun_dropped else 1.0,
      # The arms are scored on median step seconds: predict the typical step.
      reruns_per_step=statistics.median(parts["reruns"]) if parts["reruns"] else 0.0,
      rerun_s=statistics.median(parts["rerun"]) if parts["rerun"] else 0.0,
  ), noise


def _ready(receipt) -> float:
  """When a remote computation finished, on this host's clock."""
  return receipt.ready.block_until_ready().ready_at


def calibrate_worker(worker, steps, *, floor_samples: int = 8) -> tuple[Components, float]:
  """Component times measured through the worker's own calls (each part alone, then back to back).

  Per step: each micro-batch staged (prepare: the call, payload transfer
  included), dispatched (dispatch: the call) and waited for (micro-batch: to
  its completion stamp); then the update alone, then the metrics read
  (boundary work). Then every step's micro-batches queued back to back: their
  completion spacing is the micro-batch time the arms see. The wait floor is
  the worker's own (a round trip, remotely). The caller restores the state.
  """
  parts = {k: [] for k in ("micro", "prepare", "dispatch", "update", "work")}
  for payloads in steps:
    for p in payloads:
      t0 = time.perf_counter()
      worker.stage_fwd_bwd(p)
      t1 = time.perf_counter()
      receipt = worker.fwd_bwd_staged()
      t2 = time.perf_counter()
      parts["micro"].append(_ready(receipt) - t1)
      parts["prepare"].append(t1 - t0)
      parts["dispatch"].append(t2 - t1)
    t0 = time.perf_counter()
    parts["update"].append(_ready(worker.update()) - t0)
    t0 = time.perf_counter()
    worker.get_metrics()
    parts["work"].append(time.perf_counter() - t0)
  floor = worker.sample_wait_floor(floor_samples)
  spacing = []
  if len(steps[0]) > 1:
    for payloads in steps:
      receipts = [worker.fwd_bwd(p) for p in payloads]
      first, last = _ready(receipts[0]), _ready(receipts[-1])
      spacing.append((last - first) / (len(receipts) - 1))
      worker.update()
  samples = spacing if len(spacing) > 1 else parts["micro"]
  noise = statistics.stdev(samples) / statistics.mean(samples) if len(samples) > 1 else 0.0
  return Components(
      micro_batch_s=statistics.median(samples), map_s=statistics.median(parts["prepare"]),
      update_s=statistics.median(parts["update"]), metrics_s=statistics.median(parts["work"]),
      dispatch_s=statistics.median(parts["dispatch"]), wait_floor_s=max(floor),
      micro_batches_per_step=len(steps[0]),
  ), noise

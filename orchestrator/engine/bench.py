"""Engine benchmark: where the time of one micro-batch and one update goes, per preset.

    python -m orchestrator.engine.bench [--presets tiny small] [--moe-presets tiny_moe small_moe] [--repeats 5]

Prints one JSON object per preset (medians over ``--repeats``, seconds):
compile, micro-batch compute (dispatch → ready on an idle device), input
mapping, placement, ``fwd_bwd`` dispatch, update compute, the
``wait_for_device`` floor (nothing in flight), and how long a prepare takes
while a micro-batch computes. For MoE presets, per routing layout (fully
dropless; re-runs without overflow; re-runs with overflow): micro-batch seconds,
re-run seconds, re-runs per step and how long ``update()`` blocks the host. Reserves one host core first (see
``host_threads``), as the default run does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from orchestrator.host.host_threads import reserve_host_core


def _median(xs):
  return statistics.median(xs) if xs else None


def bench_preset(preset: str, repeats: int, micro_batches: int = 2) -> dict:
  import jax  # import here: numpy's and JAX's threads start after main's reserve_host_core

  from orchestrator.data.synthetic import SyntheticRollouts
  from orchestrator.engine import build_engine

  start = time.perf_counter()
  engine = build_engine(preset)
  build_s = time.perf_counter() - start
  source = SyntheticRollouts(engine.preset.vocab_size, engine.rows, engine.tokens_per_row, seed=1)
  # Warm-up: one full step, so allocation and first-run costs are not measured.
  for i, p in enumerate(source.step(0, micro_batches)):
    engine.fwd_bwd(p, apply_optimizer=i == micro_batches - 1)
  engine.wait_for_device()

  compute, mapping, placement, dispatch, update, floor, prepare_busy = [], [], [], [], [], [], []
  for r in range(repeats):
    payloads = source.step(r + 1, micro_batches)
    for i, p in enumerate(payloads):
      prepared = engine.prepare_fwd_bwd_input(p)
      jax.block_until_ready(prepared.arrays)
      mapping.append(prepared.mapping_s)
      placement.append(prepared.placement_s)
      t0 = time.perf_counter()
      computation = engine.fwd_bwd(prepared)
      t1 = time.perf_counter()
      if i == micro_batches - 1:
        nxt = engine.prepare_fwd_bwd_input(source.micro_batch(r + 2, 0))
        prepare_busy.append(nxt.mapping_s + nxt.placement_s)
      computation.ready.block_until_ready()
      t2 = time.perf_counter()
      dispatch.append(t1 - t0)
      compute.append(t2 - t0)
    t0 = time.perf_counter()
    engine.update().ready.block_until_ready()
    update.append(time.perf_counter() - t0)
    floor.extend(engine.wait_for_device() for _ in range(5))
  micro_s = _median(compute)
  prep_s = _median(mapping) + _median(placement)
  return {
      "preset": preset,
      "rows": engine.rows,
      "tokens_per_row": engine.tokens_per_row,
      "devices": len(engine.mesh.devices.flat),
      "build_s": build_s,
      "compile_s": engine.compile_s,
      "micro_batch_compute_s": micro_s,
      "input_mapping_s": _median(mapping),
      "placement_s": _median(placement),
      "prepare_share_of_micro_batch": prep_s / micro_s if micro_s else None,
      "prepare_while_computing_s": _median(prepare_busy),
      "fwd_bwd_dispatch_s": _median(dispatch),
      "update_s": _median(update),
      "wait_for_device_floor_s": _median(floor),
      "wait_for_device_floor_max_s": max(floor),
      "repeats": repeats,
  }


def bench_moe(preset: str, repeats: int, overflow_factor: float = 0.5) -> dict:
  """MoE layouts: micro-batch seconds with and without overflow, re-run seconds, and how
  long ``update()`` blocks the host in each layout (dispatch of the last micro-batch → return)."""
  from orchestrator.data.synthetic import SyntheticRollouts  # import here: see bench_preset
  from orchestrator.engine import build_engine

  layouts = {
      "dropless": dict(ragged_buffer_factor=-1),
      "rerun_no_overflow": dict(ragged_buffer_factor=64.0, retry_when_tokens_dropped=True),
      "rerun_overflow": dict(ragged_buffer_factor=overflow_factor, retry_when_tokens_dropped=True),
  }
  out = {"preset": preset}
  for name, options in layouts.items():
    engine = build_engine(preset, **options)
    source = SyntheticRollouts(engine.preset.vocab_size, engine.rows, engine.tokens_per_row, seed=2)
    compute, update_block, rerun, reruns = [], [], [], []
    for r in range(repeats + 1):  # the first round warms up
      payloads = source.step(r, 2)
      engine.wait_for_device()
      t0 = time.perf_counter()
      first = engine.fwd_bwd(payloads[0])
      first.ready.block_until_ready()
      t1 = time.perf_counter()
      engine.fwd_bwd(payloads[1])
      t2 = time.perf_counter()
      engine.update()
      t3 = time.perf_counter()
      engine.wait_for_device()
      metrics = engine.get_metrics()
      if engine.rerun_dropped:
        t4 = time.perf_counter()
        engine.fwd_bwd(payloads[0], dropless=True).ready.block_until_ready()
        t5 = time.perf_counter()
        engine.update()
        engine.wait_for_device()
      if r == 0:
        continue
      compute.append(t1 - t0)
      update_block.append(t3 - t2)
      reruns.append(metrics.reruns)
      if engine.rerun_dropped:
        rerun.append(t5 - t4)
    out[name] = {
        "micro_batch_s": _median(compute),
        "rerun_s": _median(rerun),
        "update_blocks_host_s": _median(update_block),
        "reruns_per_step": _median(reruns),
    }
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--moe-presets", nargs="*", default=["tiny_moe", "small_moe"])
  parser.add_argument("--no-reserve-host-core", action="store_true")
  args = parser.parse_args(argv)
  reservation = None if args.no_reserve_host_core else reserve_host_core()
  results = []
  for preset in args.presets:
    result = bench_preset(preset, args.repeats)
    result["host_core_reservation"] = None if reservation is None else reservation.reason
    results.append(result)
    print(json.dumps(result, indent=2), flush=True)
  for preset in args.moe_presets:
    print(json.dumps(bench_moe(preset, args.repeats), indent=2), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())

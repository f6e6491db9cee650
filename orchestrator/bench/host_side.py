"""The host side of a stage at a realistic shape: mapping and placement per micro-batch, with and without routing.

    python -m orchestrator.bench.host_side [--rows 8] [--tokens-per-row 8192] [--layers 48] [--top-k 8]
                                           [--experts 128] [--repeats 7] [--rig] [--out DIR]

The seed's micro-batch is 64 rows × 65,536 tokens of a many-layer top-k MoE
whose routing replay carries each token's experts in every layer. Scaled to
this machine (by default 1/64 of its tokens: 8 rows × 8,192, two trajectories
a row), the micro-batch keeps its long rows and, with ``--layers``/``--top-k``,
the routing array of a Qwen3-30B-A3B-like model (48 layers × top-8 int16: 768 B
a token, 96 % of the staged bytes). Per arm — ``plain`` (the packed fields) and
``routing`` (with the routing array) — the benchmark stages ``--repeats``
micro-batches through the engine's own input path
(``engine.inputs.MicroBatchInputs.prepare``: packing, then placement on the
device) and reports, per micro-batch, the median seconds of mapping and of
placement with their range, the bytes staged, and the host memory a stage
allocates beyond the payload it is given (``tracemalloc``'s peak over the
stage: the packed arrays, held until the step takes them).

``--rig`` then runs the reduced rig with routing replay on ``tiny_moe`` at 8
rows of 512 tokens (a recording made here, in ``--out``; about a minute):
OFF and STAGE_BEFORE_UPDATE, twice each, the boundary idle of each measured —
the host's mapping and placement show up as idle where the input is not staged
and are gone where it is. (On one CPU core a micro-batch of the realistic shape
computes for many seconds, so the rig runs a shorter one.)

One XLA core, the host the other. Then one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from orchestrator.data.packing import RoutingShape
from orchestrator.data.trajectory import Trajectory
from orchestrator.host.host_threads import reserve_host_core

ARMS = ("plain", "routing")
#: The rig's shape: tiny_moe at rows of 512 tokens, routing replayed (a micro-batch computes in about half a
#: second on one CPU core; longer rows or a wider model take seconds each).
RIG_OVERRIDES = ("model=tiny_moe", "batch.rows=8", "batch.tokens_per_row=512", "batch.micro_batches_per_step=2",
                 "rollouts.prompt_len_median=150", "rollouts.completion_len_median=80", "rollouts.groups=160",
                 "rollouts.generations_per_group=4", "moe.router_replay=true", "engine.ragged_buffer_factor=-1",
                 "engine.retry_when_tokens_dropped=false", "step_boundary.control_every=0",
                 "step_boundary.disable_after=1000")


def payload(rows: int, tokens_per_row: int, routing, *, vocab_size: int = 32_000, seed: int = 0):
  """Two trajectories a row, each half a row (prompt a quarter of it), with routing when ``routing`` is given."""
  rng = np.random.default_rng(seed)
  half, out = tokens_per_row // 2, []
  for _ in range(2 * rows):
    prompt = rng.integers(1, vocab_size, half // 4, dtype=np.int32)
    completion = rng.integers(1, vocab_size, half - len(prompt), dtype=np.int32)
    ids = None
    if routing is not None:  # distinct experts per token and layer, as a top-k gives
      ids = (rng.integers(0, routing.num_experts, (half, routing.layers, 1))
             + np.arange(routing.top_k)) % routing.num_experts
      ids = ids.astype(np.int16)
    out.append(Trajectory(prompt, completion, float(rng.standard_normal()),
                          -rng.exponential(1.0, len(completion)).astype(np.float32), routing=ids))
  return out


def _inputs(rows: int, tokens_per_row: int, routing, vocab_size: int):
  from orchestrator.engine import mesh as mesh_lib  # import here: after the core plan (see main)
  from orchestrator.engine.inputs import MicroBatchInputs, input_shardings

  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig.parse(None))
  return MicroBatchInputs(rows, tokens_per_row, vocab_size, input_shardings(mesh, routing=routing is not None),
                          routing)


def stage_arm(rows: int, tokens_per_row: int, routing, repeats: int, vocab_size: int = 32_000) -> dict:
  """Per micro-batch: mapping and placement seconds (median, range), staged bytes, host bytes a stage adds."""
  import jax  # import here: after the core plan (see main)

  inputs = _inputs(rows, tokens_per_row, routing, vocab_size)
  mapping, placement, added = [], [], []
  for repeat in range(repeats + 1):  # the first stage warms the placement path up: not counted
    given = payload(rows, tokens_per_row, routing, vocab_size=vocab_size, seed=repeat)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    prepared = inputs.prepare(given, engine_id=0)
    jax.block_until_ready(list(prepared.arrays.values()))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    if repeat:
      mapping.append(prepared.mapping_s)
      placement.append(prepared.placement_s)
      added.append(peak - before)
    by_field = prepared.bytes_by_field
    del prepared
  return {"mapping_s": _spread(mapping), "placement_s": _spread(placement),
          "stage_s": _spread([m + p for m, p in zip(mapping, placement)]),
          "staged_bytes": sum(by_field.values()), "staged_bytes_by_field": by_field,
          "host_bytes_added": int(statistics.median(added))}


def _spread(xs: list[float]) -> dict:
  return {"median": statistics.median(xs), "low": min(xs), "high": max(xs)}


def run_rig(out: Path) -> dict:
  """The reduced rig at long rows with routing replay: OFF and STAGE_BEFORE_UPDATE, twice each; each arm's
  median boundary idle and step seconds from its report."""
  recipe = ["--recipe", "recipes/rig_cpu_moe.yaml", *RIG_OVERRIDES]
  run = lambda *argv: subprocess.run([sys.executable, "-m", "orchestrator.app.cli", *argv], check=True,
                                     capture_output=True, text=True)
  run("record", *recipe, "--out", str(out / "recording"))
  run("rig", *recipe, "steps=6", "--recording", str(out / "recording"), "--out", str(out / "rig"), "--arms",
      "off", "stage_before_update", "off", "stage_before_update")
  report = json.loads((out / "rig" / "report.json").read_text())
  # each arm's medians over its steps (the report's per-arm summaries)
  return {arm["name"]: {"mode": arm["mode"], "boundary_idle_s": arm["boundary_idle_s"]["median"],
                        "step_s": arm["step_s"]["median"],
                        "stage_s": (arm["stage_s"] or {"median": 0.0})["median"]} for arm in report["arms"]}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--tokens-per-row", type=int, default=8192)
  parser.add_argument("--layers", type=int, default=48)
  parser.add_argument("--top-k", type=int, default=8)
  parser.add_argument("--experts", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--rig", action="store_true", help="also run the reduced rig with routing (about a minute)")
  parser.add_argument("--out", type=Path, default=None, help="where the rig writes (default: a temporary directory)")
  args = parser.parse_args(argv)
  reserve_host_core()  # one XLA core, the host the other: before JAX starts
  routing = RoutingShape(layers=args.layers, top_k=args.top_k, num_experts=args.experts)
  result = {"rows": args.rows, "tokens_per_row": args.tokens_per_row, "routing": dataclasses.asdict(routing), "arms": {}}
  for name, shape in (("plain", None), ("routing", routing)):
    arm = stage_arm(args.rows, args.tokens_per_row, shape, args.repeats)
    result["arms"][name] = arm
    print(f"{name}: {arm['staged_bytes'] / 1e6:.1f} MB per micro-batch; mapping"
          f" {arm['mapping_s']['median'] * 1e3:.1f} ms ({arm['mapping_s']['low'] * 1e3:.1f}–"
          f"{arm['mapping_s']['high'] * 1e3:.1f}), placement {arm['placement_s']['median'] * 1e3:.1f} ms"
          f" ({arm['placement_s']['low'] * 1e3:.1f}–{arm['placement_s']['high'] * 1e3:.1f}); a stage allocates"
          f" {arm['host_bytes_added'] / 1e6:.1f} MB on the host", flush=True)
  if args.rig:
    with tempfile.TemporaryDirectory() as scratch:
      out = args.out or Path(scratch)
      started = time.perf_counter()
      result["rig"] = run_rig(out)
      for name, arm in result["rig"].items():
        print(f"rig {name}: boundary idle {arm['boundary_idle_s'] * 1e3:.1f} ms, step {arm['step_s'] * 1e3:.1f} ms,"
              f" stage {arm['stage_s'] * 1e3:.1f} ms", flush=True)
      result["rig_s"] = time.perf_counter() - started
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

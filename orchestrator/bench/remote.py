"""What the wire costs: the RPC round-trip floor, payload throughput against a raw socket, and per-boundary overhead.

    python -m orchestrator.bench.remote [--samples 200] [--steps 12]

1. A trainer is spawned on loopback (``run_rl serve-trainer``, tiny model); the
   round trip of ``wait_for_device`` with nothing in flight — the floor the
   policy calibrates on — is sampled: median and p99.
2. Payloads of 1, 16 and 64 MB travel as one message (chunked) to the trainer,
   which answers their size; the same bytes go through a raw loopback TCP
   socket to a thread that reads them and answers. Throughput of each, and
   gRPC's share of raw (best of ``--repeats``).
3. The same synthetic run (tiny model, OFF and STAGE_BEFORE_UPDATE) with a local
   and a remote trainer: median step, median boundary idle, and the remote
   overhead per boundary.
Then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from orchestrator import recipe as recipe_lib
from orchestrator.remote import protocol, wire
from orchestrator.remote.client import RemoteTrainerWorker
from orchestrator.remote.spawn import SpawnedTrainer

SIZES_MB = (1, 16, 64)
#: The spawned trainer's time to listen and each call's deadline: far beyond what the tiny model's calls take,
#: the largest message's included, so only a hung trainer ends the benchmark.
TRAINER_TIMEOUT_S = 120
#: One run of the local/remote comparison: a few steps of the tiny model take well under a minute; fifteen
#: minutes means it hung.
RUN_TIMEOUT_S = 900
RECIPE = ["model=tiny", "rollouts.source=synthetic", "batch.micro_batches_per_step=2", "run.reserve_host_core=true"]


def _recipe(*overrides):
  return recipe_lib.resolve(None, overrides=[*RECIPE, *overrides]).recipe


def _spawned(tmp: Path):
  recipe = _recipe()
  child = SpawnedTrainer(recipe_lib.to_dict(recipe), recipe_path=tmp / "recipe.json", checkpoint_dir=None,
                         address="127.0.0.1:0", timeout_s=TRAINER_TIMEOUT_S, log_path=tmp / "trainer.log")
  worker = RemoteTrainerWorker(child.address, recipe_digest=protocol.recipe_digest(recipe), token=child.token,
                               limits=protocol.Limits(timeout_s=TRAINER_TIMEOUT_S))
  return child, worker


def round_trip_floor(worker, samples: int) -> dict:
  floor = worker.sample_wait_floor(samples)
  ordered = sorted(floor)
  return {"median_s": statistics.median(floor), "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
          "samples": samples}


def _raw_socket_seconds(data: bytes) -> float:
  """Seconds to push ``data`` through a loopback TCP socket to a reader thread and get its 8-byte answer."""
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)

  def reader():
    conn, _ = server.accept()
    with conn:
      left = len(data)
      while left:
        left -= len(conn.recv(min(left, 1 << 20)))
      conn.sendall(len(data).to_bytes(8, "little"))

  thread = threading.Thread(target=reader, daemon=True)
  thread.start()
  with socket.create_connection(server.getsockname()) as client:
    start = time.perf_counter()
    client.sendall(data)
    client.recv(8)
    seconds = time.perf_counter() - start
  thread.join()
  server.close()
  return seconds


def throughput(worker, repeats: int) -> list[dict]:
  rows = []
  for mb in SIZES_MB:
    array = np.random.default_rng(mb).integers(0, 255, mb << 20, dtype=np.uint8)
    grpc_s, raw_s = [], []
    for _ in range(repeats):
      start = time.perf_counter()
      header, _ = worker._call({"method": "echo"}, wire.encode_parts({"method": "echo"}, {"data": array}))
      grpc_s.append(time.perf_counter() - start)
      assert header["bytes"] == array.nbytes
      raw_s.append(_raw_socket_seconds(array.tobytes()))
    grpc_mb_s, raw_mb_s = mb / min(grpc_s), mb / min(raw_s)
    rows.append({"payload_mb": mb, "grpc_mb_per_s": grpc_mb_s, "raw_socket_mb_per_s": raw_mb_s,
                 "share_of_raw": grpc_mb_s / raw_mb_s})
  return rows


def _run(location: str, mode_flags: list[str], steps: int, out: Path) -> dict:
  extra = ["trainer.location=remote", "trainer.spawn=true"] if location == "remote" else []
  cmd = [sys.executable, "-m", "orchestrator.app.cli", *RECIPE, f"steps={steps}", *extra, *mode_flags, "--out", str(out)]
  subprocess.run(cmd, check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
  records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
  summary = json.loads((out / "summary.json").read_text())
  idle = [r["boundary_idle_s"] for r in records[:-1] if r.get("boundary_idle_s") is not None]
  return {"median_step_s": statistics.median(r["step_s"] for r in records[2:] or records),
          "median_idle_s": statistics.median(idle) if idle else None,
          "wait_floor_max_s": summary.get("wait_floor_max_s"), "threshold_s": summary.get("threshold_s"),
          "digest": summary["final_state_digest"]}


def boundary_overhead(steps: int, tmp: Path) -> list[dict]:
  rows = []
  for mode, flags in (("off", ["--no-pipeline_step_boundary"]), ("stage_before_update", [])):
    local = _run("local", flags, steps, tmp / f"local-{mode}")
    remote = _run("remote", flags, steps, tmp / f"remote-{mode}")
    rows.append({"mode": mode, "local": local, "remote": remote,
                 "overhead_per_boundary_s": remote["median_step_s"] - local["median_step_s"],
                 "same_digest": local["digest"] == remote["digest"]})
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--samples", type=int, default=200)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--steps", type=int, default=12)
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as name:
    tmp = Path(name)
    child, worker = _spawned(tmp)
    try:
      floor = round_trip_floor(worker, args.samples)
      rates = throughput(worker, args.repeats)
    finally:
      worker.close()
      child.stop()
    overhead = boundary_overhead(args.steps, tmp)
  ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
  print(f"RPC round-trip floor (wait_for_device, nothing in flight): median {ms(floor['median_s'])},"
        f" p99 {ms(floor['p99_s'])} over {floor['samples']}")
  print(f"{'payload':>8} {'gRPC MB/s':>10} {'raw MB/s':>10} {'share':>6}")
  for r in rates:
    print(f"{r['payload_mb']:>6} MB {r['grpc_mb_per_s']:10.0f} {r['raw_socket_mb_per_s']:10.0f}"
          f" {100 * r['share_of_raw']:5.0f}%")
  print(f"{'mode':20} {'local step':>11} {'remote step':>12} {'overhead':>9} {'local idle':>11} {'remote idle':>12}"
        " floor→threshold (remote)")
  for r in overhead:
    lo, re_ = r["local"], r["remote"]
    idle = lambda x: "-" if x is None else ms(x)  # noqa: E731
    print(f"{r['mode']:20} {ms(lo['median_step_s']):>11} {ms(re_['median_step_s']):>12}"
          f" {ms(r['overhead_per_boundary_s']):>9} {idle(lo['median_idle_s']):>11} {idle(re_['median_idle_s']):>12}"
          f" {idle(re_['wait_floor_max_s'])}→{idle(re_['threshold_s'])}  same digest: {r['same_digest']}")
  print(json.dumps({"round_trip_floor": floor, "throughput": rates, "boundary_overhead": overhead}))
  return 0


if __name__ == "__main__":
  os.environ.setdefault("PYTHONUNBUFFERED", "1")
  sys.exit(main())

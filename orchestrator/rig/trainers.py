"""Where the rig's arms run: the engine in this process, or a remote trainer (``trainer.location: remote``).

Both give the rig the same four things: the batch shape, a calibration
(component times), and per arm a run of the real ``RLProgram`` from the same
starting state with the engine calls recorded, and the compiles the arm caused.
The local one drives the engine directly; the remote one drives a
``RemoteTrainerWorker`` whose server records the calls (``remote.rig_host``)
and calibrates through the worker's calls, so the wire's costs (round trips,
payload transfer) are part of the components it predicts with.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

from orchestrator.loop.program import RLProgram
from orchestrator.app.runner import policy_from_recipe, program_config
from policies.boundary_model import Components


@dataclasses.dataclass(frozen=True)
class BatchShape:
  rows: int
  tokens_per_row: int
  vocab_size: int
  rerun_dropped: bool


def _arm_config(recipe, n_steps):
  return dataclasses.replace(program_config(recipe, None, steps=n_steps), checkpoint_every=0,
                             scored_checkpoint_steps=())


class LocalRigTrainer:
  """The rig's engine in this process (built once, snapshotted, restored before each arm)."""

  def __init__(self, recipe):
    from orchestrator.engine import build_engine  # pylint: disable=import-outside-toplevel

    options = {f.name: getattr(recipe.engine, f.name) for f in dataclasses.fields(recipe.engine)
               if f.name != "backend"}
    self.recipe = recipe
    self.engine = build_engine(recipe.model, mesh=dataclasses.asdict(recipe.mesh), rows=recipe.batch.rows,
                               tokens_per_row=recipe.batch.tokens_per_row, **options)
    self.shape = BatchShape(self.engine.rows, self.engine.tokens_per_row, self.engine.preset.vocab_size,
                            self.engine.rerun_dropped)
    self.snapshot = self.engine.snapshot()

  def run_arm(self, arm, arm_steps, n_steps, digests: dict):
    from orchestrator.engine import backend_compile_count  # pylint: disable=import-outside-toplevel
    from orchestrator.rig.rig import CallRecordingEngine  # pylint: disable=import-outside-toplevel
    from orchestrator.loop.trainer_worker import TrainerWorker  # pylint: disable=import-outside-toplevel

    self.engine.restore(self.snapshot)
    proxy = CallRecordingEngine(self.engine, digests, arm.fault)
    worker = TrainerWorker(proxy)
    policy = policy_from_recipe(self.recipe, worker.capabilities, mode=arm.mode, steps=n_steps)
    compiles = backend_compile_count()
    result = RLProgram(worker, policy, arm_steps[:n_steps], _arm_config(self.recipe, n_steps)).run()
    self.engine.wait_for_device()
    return result, proxy.digest_events(), backend_compile_count() - compiles, policy

  def calibrate(self, steps):
    from orchestrator.rig.rig import calibrate  # pylint: disable=import-outside-toplevel

    return calibrate(self.engine, steps, self.snapshot)

  def close(self) -> None:
    pass


class RemoteRigTrainer:
  """The rig's arms over a remote trainer (spawned on loopback with ``trainer.spawn``, or at ``trainer.address``)."""

  def __init__(self, recipe, out: Path):
    from orchestrator.app.runner import make_worker  # pylint: disable=import-outside-toplevel

    self.recipe = recipe
    self._closers: list = []
    out.mkdir(parents=True, exist_ok=True)
    self.worker, self.trainer_info = make_worker(recipe, out, self._closers)
    info = self.worker.rig_begin_arm(None)  # the state every arm starts from is this one
    self.worker.rig_end_arm()
    self.shape = BatchShape(info["rows"], info["tokens_per_row"], info["vocab_size"], info["rerun_dropped"])

  def run_arm(self, arm, arm_steps, n_steps, digests: dict):
    del digests  # the trainer digests what it was given by content
    self.worker.rig_begin_arm(arm.fault)
    policy = policy_from_recipe(self.recipe, self.worker.capabilities, mode=arm.mode, steps=n_steps)
    result = RLProgram(self.worker, policy, arm_steps[:n_steps], _arm_config(self.recipe, n_steps)).run()
    events, compiles = self.worker.rig_end_arm()
    return result, [tuple(e) for e in events], compiles, policy

  def calibrate(self, steps):
    self.worker.rig_begin_arm(None)
    try:
      return calibrate_worker(self.worker, steps)
    finally:
      self.worker.rig_end_arm()

  def close(self) -> None:
    while self._closers:
      self._closers.pop()()


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
      micro_batch_s=statistics.median(samples), prepare_s=statistics.median(parts["prepare"]),
      update_s=statistics.median(parts["update"]), boundary_work_s=statistics.median(parts["work"]),
      dispatch_s=statistics.median(parts["dispatch"]), wait_floor_s=max(floor),
      micro_batches_per_step=len(steps[0]),
  ), noise

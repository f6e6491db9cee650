"""Where the rig's arms run: the engine in this process, or a remote trainer (``trainer.location: remote``).

Both give the rig the same four things: the batch shape, a calibration
(component times), and per arm a run of the real ``RLProgram`` from the same
starting state with the engine calls recorded, and the compiles the arm caused.
The local one drives the engine directly; the remote one drives a
``RemoteTrainerWorker`` whose server records the calls (``rig.remote_host``)
and calibrates through the worker's calls, so the wire's costs (round trips,
payload transfer) are part of the components it predicts with.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from orchestrator.assembly import make_worker, policy_from_recipe, program_config
from orchestrator.data.packing import RoutingShape
from orchestrator.engine import backend_compile_count, build_engine
from orchestrator.engine.options import CHECKPOINTING_BACKENDS
from orchestrator.loop.program import RLProgram
from orchestrator.loop.trainer_worker import TrainerWorker
from orchestrator.rig.calibration import calibrate, calibrate_worker
from orchestrator.rig.recording_engine import CallRecordingEngine, require_snapshots


@dataclasses.dataclass(frozen=True)
class BatchShape:
  rows: int
  tokens_per_row: int
  vocab_size: int
  rerun_dropped: bool
  routing: RoutingShape | None = None  # the engine replays routing: payload digests count it


def recipe_batch_shape(recipe) -> BatchShape:
  """The micro-batch the recipe asks the rig's engine for: ``batch.rows`` and ``batch.tokens_per_row``, unset
  the model's (the rig replays recordings, so never a live task's fitted size, ``Recipe.micro_batch_shape``).
  Whether it re-runs dropped tokens is the engine's to say: False here."""
  preset = recipe.model_preset()
  return BatchShape(recipe.batch.rows or preset.rows, recipe.batch.tokens_per_row or preset.tokens_per_row,
                    preset.vocab_size, False, recipe.engine.routing_shape(preset))


def _arm_config(recipe, n_steps):
  return dataclasses.replace(program_config(recipe, None, steps=n_steps), checkpoint_every=0,
                             scored_checkpoint_steps=())


class LocalRigTrainer:
  """The rig's engine in this process (built once, snapshotted, restored before each arm)."""

  def __init__(self, recipe):
    options = {f.name: getattr(recipe.engine, f.name) for f in dataclasses.fields(recipe.engine)
               if f.name != "backend"}
    self.recipe = recipe
    asked = recipe_batch_shape(recipe)
    self.engine = build_engine(recipe.model_preset(), mesh=dataclasses.asdict(recipe.mesh), rows=asked.rows,
                               tokens_per_row=asked.tokens_per_row, **options)
    require_snapshots(self.engine)
    self.shape = BatchShape(self.engine.rows, self.engine.tokens_per_row, self.engine.preset.vocab_size,
                            self.engine.rerun_dropped, recipe.engine.routing_shape(self.engine.preset))
    self.snapshot = self.engine.snapshot()

  def run_arm(self, arm, arm_steps, n_steps, digests: dict):
    self.engine.restore(self.snapshot)
    proxy = CallRecordingEngine(self.engine, digests, arm.fault)
    worker = TrainerWorker(proxy)
    policy = policy_from_recipe(self.recipe, worker.capabilities, mode=arm.mode, steps=n_steps)
    compiles = backend_compile_count()
    result = RLProgram(worker, policy, arm_steps[:n_steps], _arm_config(self.recipe, n_steps)).run()
    self.engine.wait_for_device()
    return result, proxy.digest_events(), backend_compile_count() - compiles

  def calibrate(self, steps):
    return calibrate(self.engine, steps, self.snapshot)

  def close(self) -> None:
    pass


class RemoteRigTrainer:
  """The rig's arms over a remote trainer (spawned on loopback with ``trainer.spawn``, or at ``trainer.address``)."""

  def __init__(self, recipe, out: Path):
    self.recipe = recipe
    self._closers: list = []
    out.mkdir(parents=True, exist_ok=True)
    self.worker, self.trainer_info = make_worker(recipe, self._closers, checkpoint_dir=_checkpoint_dir(recipe, out),
                                                 write_dir=out)
    info = self.worker.rig_begin_arm(None)  # the state every arm starts from is this one
    self.worker.rig_end_arm()
    self.shape = BatchShape(info["rows"], info["tokens_per_row"], info["vocab_size"], info["rerun_dropped"],
                            recipe.engine.routing_shape(recipe.model_preset()))

  def run_arm(self, arm, arm_steps, n_steps, digests: dict):
    del digests  # the trainer digests what it was given by content
    self.worker.rig_begin_arm(arm.fault)
    policy = policy_from_recipe(self.recipe, self.worker.capabilities, mode=arm.mode, steps=n_steps)
    result = RLProgram(self.worker, policy, arm_steps[:n_steps], _arm_config(self.recipe, n_steps)).run()
    events, compiles = self.worker.rig_end_arm()
    return result, [tuple(e) for e in events], compiles

  def calibrate(self, steps):
    self.worker.rig_begin_arm(None)
    try:
      return calibrate_worker(self.worker, steps)
    finally:
      self.worker.rig_end_arm()

  def close(self) -> None:
    while self._closers:
      self._closers.pop()()


def _checkpoint_dir(recipe, out: Path) -> str | None:
  """Where a trainer the rig spawns would keep checkpoints (its arms ask for none): the recipe's directory, else
  ``out/checkpoints``, as a run's; None for an engine that writes none."""
  if recipe.engine.backend not in CHECKPOINTING_BACKENDS:
    return None
  return str(Path(recipe.checkpoint.directory or out / "checkpoints").absolute())

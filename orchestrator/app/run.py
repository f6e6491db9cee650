"""A run as ``run_rl`` builds it: the factory's trainer, policy and program (``orchestrator.assembly``), and
what the application adds around them, into a ``RunHandle``.

Around the program the application adds the progress display (``StepProgress``),
the metrics log and the samples, the held-out evaluations at the run's start
and end, the digests of the weights a checkpoint loaded, and the final
checkpoint an export or an extending resume starts from (``keeps_final_weights``).
A resume (``resume.ResumePoint``) restores its checkpoint, the source's and the
policy's positions, and carries the records it covers. Where the run's files go
is the caller's to say (``launch``: its checkpoint directory, the directory it
writes into).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from orchestrator import phases
from orchestrator.app.resume import ResumePoint, set_aside_late_checkpoints
from orchestrator.assembly import make_worker, policy_from_recipe, program_config
from orchestrator.contract import Evaluation, live_part
from orchestrator.host.host_threads import settle_core_plan
from orchestrator.loop.metrics_log import MetricsLog, open_metrics_log
from orchestrator.loop.program import RLProgram
from orchestrator.loop.recorder import BoundaryRecord
from orchestrator.loop.sample_log import SAMPLES_FILE, SampleLog
from orchestrator.recipe import Recipe
from policies import BoundaryPlan


def keeps_final_weights(recipe: Recipe) -> bool:
  """Whether a completed run checkpoints its last step (what `run_rl export` and an extending resume start
  from): always, but with a trainer served elsewhere (``trainer.address``, not spawned), whose
  ``--checkpoint-dir`` every driver it serves shares: there a run writes only the checkpoints it asks for
  (``checkpoint.every`` / ``scored_steps``), so the next run's final checkpoint cannot collide with this one's."""
  return recipe.trainer.location == "local" or recipe.trainer.spawn


def warn_small_held_out_split(live, asked: int) -> None:
  """A warning, once, where the held-out split holds fewer prompts than ``task.eval_prompts`` asks for: a list
  of prompts (a dataset's) is then evaluated whole, and a built-in task's draws repeat prompts."""
  held = live.held_out_count(asked)
  if held >= asked:
    return
  used = live.eval_prompt_count(asked)
  what = (f"each evaluation uses those {used}" if used < asked
          else f"each evaluation draws {asked} from those {held}, so prompts repeat")
  logging.getLogger("step_boundary.run").warning(
      "task.eval_prompts=%d, but the held-out split holds %d prompts: %s (hold out more prompts for a finer"
      " figure)", asked, held, what)


@runtime_checkable
class StepProgress(Protocol):
  """What shows a run's progress as it goes (``run_rl``'s bar or plain lines, ``app.console.Progress``).

  ``build_run`` makes one from the step the run starts at (a resumed run's is
  its checkpoint's), in process 0 of a job only.
  """

  def __call__(self, record: BoundaryRecord) -> None:
    """Shows one finished step (the program's ``on_step``)."""

  def logging_redirected(self) -> contextlib.AbstractContextManager:
    """Held while the program runs: where log lines go meanwhile, so that they do not break the display."""

  def close(self) -> None:
    """Ends the display after the run (also after a failure); called once."""


@dataclasses.dataclass
class RunHandle:
  """A built run: ``run()`` it; ``current_step`` names the step if it fails.

  With a live source it also evaluates greedy accuracy on held-out prompts
  with the weights the run starts from and with those it ends with
  (``eval_accuracy_start`` / ``_end``). Both evaluations run after the last
  step, the first on a host copy of the start's weights: greedy sampling is
  a program of its own, and its compile then stays off the way to the first
  step (the figure is the same whenever it is computed).
  """

  program: RLProgram
  progress: StepProgress | None
  eval_prompts: int = 0
  metrics: MetricsLog | None = None
  samples: SampleLog | None = None
  # model.checkpoint's weights as the trainer loaded them: the directory and their digest (an export's
  # weights_digest: export.json), before any step; None without model.checkpoint, or a remote trainer
  loaded_weights: dict | None = None
  closers: list = dataclasses.field(default_factory=list)
  trainer_info: dict | None = None

  def run(self):
    live = self.program.live if self.eval_prompts else None
    worker, start, stop = self.program.worker, self.program.config.start_step, self.program.stop_requested
    try:
      start_weights = host_copy(worker.export_weights()) if live is not None else None
      if live is not None and self.program.config.eval_every and start == 0:
        live.keep_start_weights(start_weights)  # an evaluation during the run takes the sampler's own weights
      with self.progress.logging_redirected() if self.progress is not None else contextlib.nullcontext():
        result = self.program.run()
    finally:
      self.program.source.close()
    if self.samples is not None:  # a stop's last step too: the closing sample is the last step's
      self.samples.finish(result.last_step)
    if live is not None:  # both, also where one gives up (a stop): in a job each gathers the weights, a collective
      # An evaluation waits for the sampler, which a stuck sampling thread holds: a stop skips it (None).
      before = live.evaluate(start_weights, start, self.eval_prompts, stop=stop)
      done = (result.last_step or 0) + 1
      after = live.evaluate(worker.export_weights(), done, self.eval_prompts, stop=stop)
      if before is not None and after is not None:
        result.summary = result.summary.replace(evaluation=Evaluation(
            eval_accuracy_start=before.accuracy, eval_prompts=self.eval_prompts, eval_accuracy_end=after.accuracy,
            during_run=[{"updates": r.step + 1, "accuracy": r.eval_accuracy,
                         "pass_k": self.program.config.eval_pass_k if r.eval_pass_at_k is not None else 0,
                         "pass_at_k": r.eval_pass_at_k} for r in result.records if r.eval_accuracy is not None]))
    if self.trainer_info:
      result.summary = result.summary.replace(trainer=self.trainer_info)
    if self.loaded_weights:
      result.summary = result.summary.replace(run=dict(result.summary.run, loaded_weights=self.loaded_weights))
    # When the run started (Unix seconds): the origin of every record's t_* times and of trace.json's.
    started = self.program.recorder.wall_start
    first = next((r for r in result.records if r.step == start), None)
    if first is not None:
      phases.mark("first_update", started + first.t_update_ready)
    result.summary = result.summary.replace(run=dict(result.summary.run, run_started_at=started,
                                                     startup_s=phases.seconds_from_start()))
    return result

  @property
  def current_step(self):
    return self.program.current_step

  def stop_keeps(self) -> str:
    """What a stop now would end with (``signals.STOP_KEEPS``' keys): a checkpoint to resume from ("kept": a
    finished step of an engine that writes them, or the checkpoint a resumed run started from), one once the
    first step finishes, or none (an engine that writes no checkpoints)."""
    if not self.program.worker.capabilities.can_checkpoint:
      return "none"
    return "kept" if self.program.steps_done else "after the first step"

  def close(self):
    """Closes the progress, the metrics log (its events flushed), then the remote trainer (and a spawned
    one's process), if any; a second call does nothing."""
    if self.progress is not None:
      self.progress.close()
    try:
      if self.metrics is not None:
        self.metrics.close()
    finally:
      while self.closers:
        self.closers.pop()()


def host_copy(weights):
  """``weights`` copied to host memory (numpy arrays; None stays None): the engine's next updates leave it as it
  is, and it holds no device memory. In a job of several processes, the whole weights: those sharded over the
  processes are gathered first (a collective every process issues here, at the same point)."""
  # import here: JAX starts after the host settings (setup_host); importing this module loads none
  import jax
  from orchestrator.live.placement import gather_across_processes

  return jax.device_get(gather_across_processes(weights)[0])


def _loaded_weights(recipe: Recipe, worker) -> dict | None:
  """The checkpoints' weights as a trainer of this process loaded them, before any step: model.checkpoint's
  directory and digest (``diagnostics.tree_digest``, an export's ``weights_digest``), and beside it
  model.reference_checkpoint's, the KL term's reference; None without either. Every process of a job calls it
  (the digest gathers the weights)."""
  reference = recipe.model.reference_checkpoint if recipe.engine.kl_beta else None
  if not (recipe.model.checkpoint or reference) or recipe.trainer.location != "local":
    return None
  from orchestrator.engine.diagnostics import tree_digest  # import here: JAX-side (after setup_host)

  loaded = {}
  if recipe.model.checkpoint:
    loaded.update({"model.checkpoint": str(recipe.model.checkpoint),
                   "weights_digest": tree_digest(worker.export_weights())})
  if reference and (weights := worker.reference_weights()) is not None:
    loaded.update({"model.reference_checkpoint": str(reference), "reference_weights_digest": tree_digest(weights)})
  return loaded or None


def build_run(recipe: Recipe, out: Path, *, source, run_id: str, checkpoint_dir: str | None,
              resume: ResumePoint | None = None, stop_requested=None,
              progress: Callable[..., StepProgress] | None = None, job=None, write_dir: Path | None = None,
              config_sha256: str | None = None) -> RunHandle:
  """Builds the engine, worker, policy and program for a validated recipe and a checked source.

  ``out`` is the run's directory (the metrics dashboard names the run after
  it), ``checkpoint_dir`` where its trainer keeps checkpoints, ``write_dir``
  (default ``out``) where this segment writes its records and trace. With
  ``resume``, the engine restores that checkpoint, the source and the policy
  continue from the positions it saved, and the records it covers are
  carried. ``progress(initial=step)`` makes the display of the steps from
  ``step`` on. In a job of several processes (``job``), every process builds
  the same run; only process 0 writes records and the trace and shows
  progress.
  """
  closers: list = []
  live = live_part(source)
  if live is not None:  # after the run's evaluations (RunHandle.close)
    closers.append(live.release)
  write_dir = write_dir or out
  # A new live run samples its first steps while the trainer is built: asking for step 0 starts the sampling
  # thread, and its work overlaps the trainer's (a resume sets the source's position first, in _build_program).
  # What a step samples does not depend on when it is sampled (docs/live-loop.md).
  sampling = live_part(source) if resume is None else None
  try:
    if sampling is not None:
      sampling.ready(0, 0.0)
    worker, trainer_info = make_worker(recipe, closers, checkpoint_dir=checkpoint_dir, write_dir=write_dir)
    if resume is not None and checkpoint_dir and recipe.trainer.location == "remote":  # one process (schema)
      # The trainer answered only once the last driver's calls were done: what they saved is on disk now.
      from orchestrator.engine.checkpointing import read_checkpoints  # import here: JAX-side, remote resumes only

      set_aside_late_checkpoints(resume, read_checkpoints(checkpoint_dir), run_id=run_id,
                                 checkpoint_dir=checkpoint_dir, segment=write_dir)
    phases.mark("trainer_built")
    loaded = _loaded_weights(recipe, worker)  # before a resume restores its checkpoint
    handle = _build_program(recipe, write_dir, worker, source=source, run_id=run_id, config_sha256=config_sha256,
                            resume=resume, run_name=out.name, stop_requested=stop_requested,
                            progress=progress if job is None or job.is_primary else None, job=job)
  except BaseException:
    if sampling is not None:  # RunHandle.run would have closed it
      source.close()
    while closers:
      closers.pop()()
    raise
  handle.closers, handle.trainer_info, handle.loaded_weights = closers, trainer_info, loaded
  return handle


def _build_program(recipe: Recipe, out: Path, worker, *, source, run_id: str, config_sha256: str | None, resume,
                   run_name: str, stop_requested, progress: Callable[..., StepProgress] | None,
                   job=None) -> RunHandle:
  policy = policy_from_recipe(recipe, worker.capabilities)
  start_step, previous, first_plan = 0, [], None
  if resume is not None:
    worker.restore_checkpoint(resume.checkpoint_step)
    source.set_state(resume.metadata["source_state"])
    if live_part(source) is not None:  # a live source samples the next steps from these weights
      source.sync(resume.steps_done, worker.export_weights())
    policy.load_state_dict(resume.metadata["policy_state"])
    start_step, previous = resume.steps_done, [BoundaryRecord.from_json(r) for r in resume.previous_records]
    if resume.metadata.get("next_plan"):
      first_plan = BoundaryPlan.from_json(resume.metadata["next_plan"])
  primary = job is None or job.is_primary
  # What sees each finished record: the core plan (start-up ends at the first update), the progress, the metrics
  # log (opened below).
  steps_done: list = [lambda record: settle_core_plan()]
  shown = progress(initial=start_step) if progress is not None else None
  if shown is not None:
    steps_done.append(shown)

  def on_step(record):
    for see in steps_done:
      see(record)

  live = recipe.rollouts.source == "sampler"
  eval_prompts = live_part(source).eval_prompt_count(recipe.task.eval_prompts) if live else 0
  if live and primary:
    warn_small_held_out_split(live_part(source), recipe.task.eval_prompts)
  config = dataclasses.replace(program_config(recipe, out if primary else None, start_step=start_step,
                                              run_id=run_id, config_sha256=config_sha256),
                               checkpoint_last_step=keeps_final_weights(recipe),
                               eval_every=(recipe.task.eval_every or 0) if live else 0, eval_prompts=eval_prompts,
                               eval_pass_k=(recipe.task.eval_pass_k or 0) if live else 0)
  program = RLProgram(worker, policy, source, config, on_step=on_step, stop_requested=stop_requested,
                      previous_records=previous, first_plan=first_plan, agreement=job.agreement if job else None)
  # Opened last, once nothing here can fail any more: the handle's close() is what flushes and closes it.
  # the dashboard's run is the run directory's (a resumed segment writes into its own directory, out)
  metrics = open_metrics_log(recipe.metrics.backends, out, run_name=run_name, run_id=run_id,
                             moe=recipe.model_preset().is_moe) if primary else None
  if metrics is not None:
    steps_done.append(metrics)
  samples = None
  if live and primary and recipe.metrics.samples_every:
    samples = SampleLog(out / SAMPLES_FILE, source, recipe.metrics.samples_every, first_step=start_step,
                        last_step=recipe.steps - 1, text=metrics.write_text if metrics is not None else None)
    steps_done.append(samples)
  return RunHandle(program, shown, eval_prompts, metrics=metrics, samples=samples)

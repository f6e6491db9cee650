"""Each step's scalars where dashboards look: TensorBoard event files in the run's directory (and W&B).

``SCALARS`` is the one table of what is logged: a name per scalar and how it
is computed from the step's ``BoundaryRecord``. A ``MetricsLog`` is the
program's ``on_step`` callable: it writes one step's scalars, at the global
step number, when that step's record is finished — in the pipelined modes
after step k+1's first micro-batch is dispatched, so the writes run while the
device computes. A step's scalars are one event (one summary of many values,
as TensorBoard reads them), not an event per scalar as tensorboardX's
``add_scalar`` makes them, which took most of a millisecond of the step's host
time for the default recipe's 30 (docs/benchmarks.md). The events go to
tensorboardX's ``FileWriter``, whose own thread does the file I/O.

TensorBoard is written through tensorboardX directly, not
through Tunix's ``MetricsLogger``: that logger routes every scalar through
``jax.monitoring``'s process-wide listeners (and its ``close`` clears every
listener of the process, anyone's), and metrax's ``TensorboardBackend``, which
it builds, calls ``jax.process_index()`` when it is made — a remote trainer's
driver starts no JAX. Both end in this same ``FileWriter``.
"""

from __future__ import annotations

import html
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from tensorboardX import FileWriter
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.summary import text as text_summary

from orchestrator.loop.recorder import BoundaryRecord

#: Where a segment's TensorBoard events go, inside the directory the segment writes (the run's for the run as
#: started, ``segments/N/`` for a resume).
TENSORBOARD_DIR = "tensorboard"
#: The W&B project every run logs to (a run is named by its directory and identified by its run id).
WANDB_PROJECT = "step-boundary"
# tensorboardX's writer thread flushes the event file this often: a run that ends at once (a second Ctrl-C, a
# lost peer) keeps every step up to the last flush; every other ending closes the writer, which flushes all.
FLUSH_S = 5
# Events queued for the writer thread before an add waits for it: many steps' worth, so the step loop never does.
MAX_QUEUE = 4096


def _mean(values: Sequence[float] | None) -> float | None:
  return statistics.fmean(values) if values else None


def _per_second(amount: float | None, seconds: float | None) -> float | None:
  return amount / seconds if amount is not None and seconds else None


def _total(values: Sequence[int] | None) -> int | None:
  return sum(values) if values else None


#: Every scalar logged per optimizer step: its name, and how it is computed from the step's record. A None
#: (a field the record does not have: no stage, not a live run, the last step's idle) logs nothing that step.
SCALARS: dict[str, Callable[[BoundaryRecord], float | int | None]] = {
    "boundary/idle_s": lambda r: r.boundary_idle_s,
    "boundary/idle_strict_s": lambda r: r.boundary_idle_strict_s,
    "boundary/stage_s": lambda r: r.stage_s,
    "boundary/device_wait_s": lambda r: r.device_wait_s,
    "boundary/staged": lambda r: int(r.staged),
    "boundary/saving_s": lambda r: r.saving_s,  # measured: control − staged step seconds, once enough controls
    "timing/step_s": lambda r: r.step_s,
    "timing/update_s": lambda r: r.update_s,
    "timing/micro_batch_s": lambda r: _mean(r.micro_batch_s),  # the mean over the step's micro-batches
    "train/loss": lambda r: r.loss,
    "train/grad_norm": lambda r: r.grad_norm,
    "train/learning_rate": lambda r: r.learning_rate,
    "train/entropy": lambda r: r.entropy,  # nats per completion token, of the distribution sampled from
    "train/clip_fraction": lambda r: r.clip_fraction,  # completion tokens whose ratio the clip bound
    "train/kl": lambda r: r.kl,  # mean KL to the reference per completion token (engine.kl_beta > 0)
    "train/ppo_kl": lambda r: r.ppo_kl,  # sampler's log-prob − trainer's, per completion token (verl's ppo_kl)
    "train/tokens_per_s": lambda r: _per_second(r.tokens, r.step_s),  # tokens that carried loss, per step second
    "rollout/reward_mean": lambda r: r.reward_mean,
    "rollout/reward_std": lambda r: r.reward_std,  # over the step's completions, pooled
    "rollout/reward_group_std": lambda r: r.reward_group_std,  # the mean of its groups' stds (TRL's reward_std)
    "rollout/frac_reward_zero_std": lambda r: r.frac_reward_zero_std,  # groups with equal rewards: no gradient
    "rollout/reward_min": lambda r: r.reward_min,
    "rollout/reward_max": lambda r: r.reward_max,
    "rollout/completion_tokens_mean": lambda r: r.completion_tokens_mean,
    "rollout/completion_tokens_max": lambda r: r.completion_tokens_max,
    "rollout/truncated_fraction": lambda r: r.truncated_fraction,  # cut at the length limit (no end sampled)
    "rollout/accuracy": lambda r: r.accuracy,
    "rollout/staleness": lambda r: r.staleness,
    # in-flight updates: the step's completion tokens' versions (oldest, newest) and mean age in updates
    "rollout/token_version_min": lambda r: r.token_version_min,
    "rollout/token_version_max": lambda r: r.token_version_max,
    "rollout/token_age_mean": lambda r: r.token_age_mean,
    "rollout/sampler_sync_wait_s": lambda r: r.sampler_sync_wait_s,  # the sampler's pause for weights (a sync)
    "rollout/wait_s": lambda r: r.rollout_wait_s,  # how long the boundary waited for the next step's rollouts
    "rollout/sampled_tokens_per_s": lambda r: r.sampled_tokens_per_s,
    "rollout/micro_batch_wait_s": lambda r: r.micro_batch_wait_s,  # inside the step, after its first micro-batch
    "memory/staged_bytes": lambda r: _total(r.staged_bytes_per_device),  # summed over this process's devices
    # task.eval_every: held-out prompts, of the weights after this step's update
    "eval/accuracy": lambda r: r.eval_accuracy,  # greedy
    "eval/pass_at_k": lambda r: r.eval_pass_at_k,  # one of task.eval_pass_k sampled completions passes
    "eval/seconds": lambda r: r.eval_s,  # how long the step loop waited for the evaluation
}


#: What an MoE model's steps add (a dense model's records say 0 dropped and no re-runs, which mean nothing there).
MOE_SCALARS: dict[str, Callable[[BoundaryRecord], float | int | None]] = {
    "moe/dropped_tokens": lambda r: _total(r.dropped_tokens),  # in the kept computation, over the step's micro-batches
    "moe/reruns": lambda r: r.reruns,  # micro-batches re-run dropless (engine.retry_when_tokens_dropped)
}


def scalars(record: BoundaryRecord, *, moe: bool = False) -> dict[str, float]:
  """The step's scalars (``SCALARS``, and ``MOE_SCALARS`` for an MoE model), leaving out those its record does
  not have."""
  table = {**SCALARS, **MOE_SCALARS} if moe else SCALARS
  values = {name: compute(record) for name, compute in table.items()}
  return {name: float(value) for name, value in values.items() if value is not None}


class TensorBoardLog:
  """Scalars into an event file in ``directory`` (created); TensorBoard reads it with ``--logdir``."""

  def __init__(self, directory: Path):
    self.directory = directory
    self._writer = FileWriter(str(directory), max_queue=MAX_QUEUE, flush_secs=FLUSH_S)

  def write(self, step: int, values: dict[str, float]) -> None:
    """One event at ``step`` holding every value (none: no event)."""
    if values:
      self._writer.add_summary(
          Summary(value=[Summary.Value(tag=name, simple_value=value) for name, value in values.items()]), step)

  def write_text(self, step: int, tag: str, text: str) -> None:
    self._writer.add_summary(text_summary(tag, text), step)

  def close(self) -> None:
    self._writer.close()  # waits for the writer thread to write every queued event, then flushes


class WandbLog:
  """Scalars to a W&B run identified by the run's id, so a resumed segment continues the same W&B run."""

  def __init__(self, directory: Path, *, run_name: str, run_id: str | None):
    import wandb  # import here: an optional package (metrics.backends refuses wandb where it is not installed)

    directory.mkdir(parents=True, exist_ok=True)
    self._run = wandb.init(project=WANDB_PROJECT, name=run_name, id=run_id, resume="allow", dir=str(directory))

  def write(self, step: int, values: dict[str, float]) -> None:
    self._run.log(values, step=step)

  def write_text(self, step: int, tag: str, text: str) -> None:
    import wandb  # import here: an optional package, imported when this log was made

    self._run.log({tag: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

  def close(self) -> None:
    self._run.finish()


class MetricsLog:
  """The program's ``on_step``: each finished record's scalars, at its global step, to every backend."""

  def __init__(self, sinks: Sequence[TensorBoardLog | WandbLog], *, moe: bool = False):
    self.sinks, self.moe = list(sinks), moe

  def __call__(self, record: BoundaryRecord) -> None:
    values = scalars(record, moe=self.moe)
    for sink in self.sinks:
      sink.write(record.step, values)

  def write_text(self, step: int, tag: str, text: str) -> None:
    """``text`` under ``tag`` at ``step`` in every backend (TensorBoard's text tab; a W&B HTML panel)."""
    for sink in self.sinks:
      sink.write_text(step, tag, text)

  def close(self) -> None:
    """Flushes and closes every backend (a second call does nothing); the first backend's error is raised
    after the others are closed."""
    sinks, self.sinks = self.sinks, []
    failure = None
    for sink in sinks:
      try:
        sink.close()
      except Exception as e:  # pylint: disable=broad-except
        failure = failure or e
    if failure is not None:
      raise failure


def open_metrics_log(backends: Sequence[str], write_dir: Path, *, run_name: str,
                     run_id: str | None = None, moe: bool = False) -> MetricsLog | None:
  """The backends ``metrics.backends`` names, writing into ``write_dir`` (this segment's directory), with
  ``MOE_SCALARS`` for an MoE model (``moe``); None when it names none."""
  if not backends:
    return None
  sinks: list[TensorBoardLog | WandbLog] = []
  try:
    for name in backends:
      if name == "tensorboard":
        sinks.append(TensorBoardLog(write_dir / TENSORBOARD_DIR))
      elif name == "wandb":
        sinks.append(WandbLog(write_dir, run_name=run_name, run_id=run_id))
      else:
        raise ValueError(f"metrics.backends: {name!r} is not a metrics backend (the recipe's schema lists them)")
  except BaseException:
    MetricsLog(sinks).close()
    raise
  return MetricsLog(sinks, moe=moe)

"""What the add-on relies on in Tunix, checked before it touches a learner.

The add-on drives Tunix's RL learner from the inside: it replaces the actor
trainer's in-flight throttler, wraps the queue the producer thread fills, and
runs the learner's per-mini-batch loop with a prefetch slot. Those are private
attributes and the loop's order of calls, which a Tunix release may change
without notice. So ``check`` refuses — with one line naming what is wrong and
what to do — on a Tunix version the add-on was not built against, on a learner
or trainer that lacks an attribute it uses, and on settings whose data path it
does not reproduce bit for bit. It never falls back to a guess.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

#: Tunix releases whose learner loop the add-on reproduces (read and tested against each).
SUPPORTED_TUNIX_VERSIONS = ("0.1.7",)

#: (object, attribute, why): everything private or loop-shaped the add-on reads or replaces.
LEARNER_ATTRIBUTES = (
    ("rl_cluster", "the cluster whose actor trainer it drives"),
    ("executor", "the one-thread executor the producer runs on"),
    ("_prepare_data", "the producer that samples, scores and queues micro-batches"),
    ("_run_global_step", "the per-global-step loop it runs with a prefetch slot"),
    ("_run_all_micro_batch_steps", "the per-mini-batch loop it replaces"),
    ("_iter_steps", "the producer's micro-batch count"),
    ("_num_iterations", "how often each micro-batch is trained"),
    ("_num_generations", "the group size the producer repeats prompts by"),
    ("_training_config", "the batch sizes"),
    ("can_enable_async_rollout", "whether the producer queues each micro-batch at once"),
    ("should_sync_weights", "whether the sampler holds its own copy of the weights"),
)
CLUSTER_ATTRIBUTES = (
    ("_actor_trainer", "the actor trainer (RLCluster builds it with no factory hook)"),
    ("_get_mesh_and_logical_axis_rules_cm", "the actor's mesh context for placing inputs"),
    ("global_steps", "the global step count"),
)
TRAINER_ATTRIBUTES = (
    ("_throttler", "the in-flight throttler it replaces"),
    ("_train_steps", "the optimizer step count"),
    ("_iter_steps", "the micro-batch count"),
    ("config", "the data sharding axis and in-flight limit"),
)


class UnsupportedTunixError(RuntimeError):
  """The installed Tunix, or this learner, is not one the add-on can drive exactly."""


def installed_version() -> str | None:
  try:
    return metadata.version("google-tunix")
  except metadata.PackageNotFoundError:
    return None


def _missing(obj: Any, names) -> list[str]:
  return [name for name, _ in names if not hasattr(obj, name)]


def check(learner: Any, *, version: str | None = None) -> None:
  """Raises UnsupportedTunixError (one line) unless the add-on can drive ``learner`` exactly.

  Args:
    learner: a Tunix ``RLLearner`` (``GRPOLearner`` and its subclasses).
    version: the Tunix version to check (default: the installed one).
  """
  version = installed_version() if version is None else version
  if version is None:
    raise UnsupportedTunixError(
        f"google-tunix is not installed; install google-tunix=={SUPPORTED_TUNIX_VERSIONS[-1]}")
  if version not in SUPPORTED_TUNIX_VERSIONS:
    raise UnsupportedTunixError(
        f"google-tunix {version} is installed but the step-boundary add-on was built for"
        f" {', '.join(SUPPORTED_TUNIX_VERSIONS)}; install google-tunix=={SUPPORTED_TUNIX_VERSIONS[-1]}"
        " or run without the add-on")
  where = [("learner", learner, LEARNER_ATTRIBUTES)]
  cluster = getattr(learner, "rl_cluster", None)
  if cluster is not None:
    where.append(("learner.rl_cluster", cluster, CLUSTER_ATTRIBUTES))
    trainer = getattr(cluster, "_actor_trainer", None)
    if trainer is not None:
      where.append(("the actor trainer", trainer, TRAINER_ATTRIBUTES))
  for label, obj, names in where:
    missing = _missing(obj, names)
    if missing:
      raise UnsupportedTunixError(
          f"{label} ({type(obj).__name__}) lacks {', '.join(missing)}, which the step-boundary add-on"
          f" relies on (google-tunix {version}); pass a stock Tunix RL learner, or run without the add-on")
  _check_settings(learner)


def _check_settings(learner: Any) -> None:
  """Settings whose data path the add-on does not reproduce: refused, not approximated."""
  cluster = learner.rl_cluster
  config = learner._training_config
  if getattr(config, "max_seq_token_per_tpu", None) is not None:
    raise UnsupportedTunixError(
        f"training_config.max_seq_token_per_tpu={config.max_seq_token_per_tpu}: sequence packing re-cuts"
        " micro-batches after they are queued, so they cannot be placed ahead; unset it or run without the add-on")
  if hasattr(cluster, "_critic_trainer"):
    raise UnsupportedTunixError(
        "the cluster has a critic trainer (PPO); the step-boundary add-on drives the actor only;"
        " run PPO without the add-on")
  if getattr(cluster.cluster_config, "offload_to_cpu", False):
    raise UnsupportedTunixError(
        "cluster_config.offload_to_cpu=True moves the actor between host and device around every update;"
        " set it to False or run without the add-on")
  trainer = cluster._actor_trainer
  throttler = trainer._throttler
  for name in ("add_computation", "wait_for_next", "wait_for_all"):
    if not callable(getattr(throttler, name, None)):
      raise UnsupportedTunixError(
          f"the actor trainer's throttler ({type(throttler).__name__}) lacks {name}(); pass a stock Tunix"
          " RL learner, or run without the add-on")

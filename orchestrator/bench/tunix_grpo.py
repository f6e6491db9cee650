"""Stock Tunix GRPO against the same run with the step-boundary add-on, side by side.

    python -m orchestrator.bench.tunix_grpo [--global-steps 8] [--repeats 2]

A tiny random Qwen3 learns the ``first_letter`` task with Tunix's own
``RLCluster`` and ``GRPOLearner`` (vanilla rollout, the character tokenizer).
Each arm runs in its own child process, the same seeds and data, so every arm
must reach the same weights (the digest column): on the host's accelerator
where it has one (``--platform auto``; one process at a time holds it, and the
children run in turn), else on two forced CPU devices (``--platform cpu``).
Two layouts: (a) ``shared`` — one mesh for trainer and sampler, one mini-batch
per global step (little to stage); (b) ``split`` — the sampler on its own
device (skipped, and said so, on an accelerator of one device), four mini-batches per global step, each trained twice (GRPO's
``num_iterations`` = 2), so the next mini-batch's rollouts can be sampled while
the trainer works; (c) ``shared`` with (b)'s four mini-batches trained twice, what one accelerator device
can stage. Stock and add-on runs alternate (``--repeats`` of each).
Prints seconds per optimizer step after the first two global steps (compiles),
median and range over the runs, host blocks per step, the share of boundaries
staged and whether every run reached stock's weights; then one JSON object.

``build_learner`` and ``run_arm`` are also what the tests use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import threading
import zlib

from orchestrator.host.compilation_cache import use_compilation_cache
from orchestrator.host.host_threads import reserve_host_core

WARMUP_GLOBAL_STEPS = 2
#: Tokens sampled per completion (answers are shorter; the rest is scored by the shaped reward).
GENERATION_STEPS = 4
#: What ``Toy.sampled`` may say the sampler draws from (``Toy``'s docstring).
SAMPLED = ("vocabulary", "answer")
#: The rewards ``Toy.reward`` may name (``Toy``'s docstring).
REWARDS = ("shaped", "exact")
#: Every toy samples at this temperature and trains without a KL term.
TEMPERATURE, KL_BETA = 1.0, 0.0


@dataclasses.dataclass(frozen=True)
class Toy:
  """One toy GRPO configuration.

  Attributes:
    layout: ``shared`` (trainer and sampler on one mesh, sharing weights) or
      ``split`` (the sampler on its own device, synced each global step).
    mini_batches: optimizer steps per global step.
    micro_batches: micro-batches per optimizer step (gradient accumulation).
    prompts: prompts per micro-batch (each sampled ``generations`` times).
    global_steps: global steps to train.
    num_iterations: GRPO's μ (each micro-batch trained this often).
    preset: the model preset.
    task: the live task (``first_letter``, ``reverse``, ``modular_addition``).
    sampled: ``vocabulary``: every id of a model whose vocabulary is cut to the
      character tokenizer's (rounded up to 16), so sampled ids mostly decode
      to characters; ``answer``: only the ids of the task's answer letters
      (``tasks.tokenizer.sampled_token_ids``, what the live sampler allows),
      every other id of the preset's own vocabulary forbidden in each call the
      rollout makes to Tunix's sampler.
    completion_tokens: tokens sampled per completion.
    reward: ``shaped``: 1 for the exact answer, else up to 0.25 for answer
      letters, plus a small bonus keyed on Tunix's trajectory id (so a run that
      named trajectories differently would train differently); ``exact``: 1
      for the exact answer, else 0 (the task's own reward, ``run_rl``'s).
    weight_decay: AdamW's (1e-4 is optax's default).
    max_grad_norm: the gradient's global norm is clipped to it before AdamW;
      None: no clipping.
    clip_eps_low: the lower clip of the policy ratio (Tunix's ``epsilon``;
      0.2 is its default).
    clip_eps_high: the upper clip, set as the ``epsilon_high`` Tunix's GRPO
      loss reads where its config has one; None: ``clip_eps_low``.
    rollout_prompts: prompts per rollout call (Tunix's
      ``rollout_micro_batch_size``); None: Tunix's default, the micro-batch.
  """

  layout: str = "shared"
  mini_batches: int = 1
  micro_batches: int = 2
  prompts: int = 2
  generations: int = 4
  global_steps: int = 3
  num_iterations: int = 1
  preset: str = "tiny"
  task: str = "first_letter"
  learning_rate: float = 3e-3
  seed: int = 0
  sampled: str = "vocabulary"
  completion_tokens: int = GENERATION_STEPS
  reward: str = "shaped"
  weight_decay: float = 1e-4
  max_grad_norm: float | None = None
  clip_eps_low: float = 0.2
  clip_eps_high: float | None = None
  rollout_prompts: int | None = None

  def __post_init__(self):
    if self.sampled not in SAMPLED:
      raise ValueError(f"sampled={self.sampled!r}: use one of {', '.join(SAMPLED)}")
    if self.reward not in REWARDS:
      raise ValueError(f"reward={self.reward!r}: use one of {', '.join(REWARDS)}")


def toy_vocab_size(toy: Toy) -> int:
  """The vocabulary of the toy's model: the preset's, or (sampling the whole vocabulary) the character
  tokenizer's rounded up to 16, so that rewards differ within a group from the first step and GRPO has a
  signal to learn from."""
  # import here: the models and tasks import numpy, whose threads start after the child's host settings (see main)
  from orchestrator.models.presets import load_preset
  from orchestrator.tasks.tokenizer import CharTokenizer

  if toy.sampled == "vocabulary":
    return -(-CharTokenizer().vocab_size // 16) * 16
  return load_preset(toy.preset).vocab_size


def toy_sampled_ids(toy: Toy) -> list[int]:
  """The ids the toy's rollouts may sample: the answer letters' (as the live sampler's) or every id."""
  # import here: the tasks import numpy, whose threads start after the child's host settings (see main)
  from orchestrator.tasks import tasks as tasks_lib
  from orchestrator.tasks.tokenizer import CharTokenizer, sampled_token_ids

  if toy.sampled == "answer":
    return sampled_token_ids(CharTokenizer(), tasks_lib.make_task(toy.task).answer_alphabet)
  return list(range(toy_vocab_size(toy)))


def _meshes(layout: str):
  import jax  # import here: JAX starts only after reserve_host_core, in the child (see main)
  import numpy as np

  def mesh_on(devices):
    return jax.sharding.Mesh(np.array(devices).reshape(len(devices), 1, 1), ("fsdp", "context", "expert"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 3)

  devices = jax.devices()
  if layout == "split" and len(devices) < 2:
    raise ValueError("the split layout needs two devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
  actor = mesh_on(devices[:1])
  return actor, (mesh_on(devices[1:2]) if layout == "split" else actor)


def _cluster_config(toy: Toy, actor_mesh, rollout_mesh):
  """Tunix's ``ClusterConfig`` for ``toy``: its batch sizes, optimizer and rollout settings."""
  import optax  # import here: JAX starts only after reserve_host_core, in the child (see main)
  from tunix.rl import rl_cluster as rlc
  from tunix.rl.rollout import base_rollout

  from orchestrator.tasks import tasks as tasks_lib

  micro = toy.prompts
  mini = micro * toy.micro_batches
  optimizer = optax.adamw(toy.learning_rate, weight_decay=toy.weight_decay)
  if toy.max_grad_norm is not None:
    optimizer = optax.chain(optax.clip_by_global_norm(toy.max_grad_norm), optimizer)
  return rlc.ClusterConfig(
      role_to_mesh={rlc.Role.ACTOR: actor_mesh, rlc.Role.REFERENCE: actor_mesh, rlc.Role.ROLLOUT: rollout_mesh},
      rollout_engine="vanilla", offload_to_cpu=False,
      training_config=rlc.RLTrainingConfig(
          actor_optimizer=optimizer, eval_every_n_steps=10**6,
          max_steps=toy.global_steps * toy.mini_batches * toy.num_iterations,
          mini_batch_size=mini, train_micro_batch_size=micro, rollout_micro_batch_size=toy.rollout_prompts),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=toy.completion_tokens, max_prompt_length=tasks_lib.MAX_PROMPT_LENGTH,
          kv_cache_size=tasks_lib.MAX_PROMPT_LENGTH + toy.completion_tokens, temperature=TEMPERATURE,
          seed=toy.seed))


def keep_static_fields_plain(rollout) -> None:
  """Makes the sampling states of Tunix's vanilla rollout keep their prompt length as an int, as the live
  sampler's do (``live.tunix_sampler`` says why: a long process that samples and compiles, as a test process
  running both arms does, would otherwise meet JAX comparing two Arrays inside a trace). The same sampler object
  otherwise; it changes no value sampled."""
  from orchestrator.live.tunix_sampler import with_plain_static_fields  # import here: it brings Tunix, as the caller

  sampler = rollout._sampler  # pylint: disable=protected-access  # the vanilla rollout's own

  class PlainStaticFieldsSampler(type(sampler)):
    def init_sample_state(self, *args, **kwargs):
      return with_plain_static_fields(super().init_sample_state(*args, **kwargs))

  sampler.__class__ = PlainStaticFieldsSampler


def sample_only(rollout, allowed_ids: list[int], vocab_size: int) -> None:
  """Makes every call Tunix's vanilla rollout makes to its sampler forbid all ids but ``allowed_ids``.

  Tunix's ``RolloutConfig`` has no forbidden or allowed ids, while its ``Sampler`` takes ``forbidden_tokens``
  in each call, and the vanilla rollout calls it with the config's settings alone. So the rollout's sampler
  becomes an instance of a subclass whose call adds them (the same object otherwise: its weights, which the
  trainer shares, and its compiled programs). The ids go as one array in a one-element list, as the live
  sampler passes them (``live.sampler.LiveSampler``), so both arms sample through the same programs.
  """
  import numpy as np  # import here: numpy's threads start after the host settings, in the child (see main)

  allowed = set(allowed_ids)
  forbidden = [np.asarray([i for i in range(vocab_size) if i not in allowed], np.int32)]
  sampler = rollout._sampler  # pylint: disable=protected-access  # the vanilla rollout's own
  stock_call = type(sampler).__call__

  class AllowedIdsSampler(type(sampler)):
    def __call__(self, *args, **kwargs):
      return stock_call(self, *args, forbidden_tokens=forbidden, **kwargs)

  sampler.__class__ = AllowedIdsSampler


def _reward_fn(toy: Toy, task):
  """The reward Tunix trains on (``Toy.reward``)."""
  alphabet = set(task.answer_alphabet)

  def answer_reward(prompts, completions, answer, trajectory_ids, **_):
    """1 for the exact answer; shaped: otherwise up to 0.25 for a completion made of answer characters.

    Shaped, plus a small bonus keyed on Tunix's trajectory id, so that a run which named trajectories
    differently from stock would train differently (the identity tests would see it).
    """
    out = []
    for completion, expected, trajectory in zip(completions, answer, trajectory_ids):
      text = str(completion).strip()
      if toy.reward == "exact":
        out.append(1.0 if text == str(expected) else 0.0)
        continue
      shaped = 0.25 * sum(ch in alphabet for ch in text) / len(text) if text else 0.0
      bonus = 0.01 * (zlib.crc32(str(trajectory).encode()) % 4)
      out.append((1.0 if text == str(expected) else shaped) + bonus)
    return out

  return answer_reward


def build_learner(toy: Toy):
  """A stock Tunix ``GRPOLearner`` for ``toy`` and its training data (a list of global batches)."""
  import jax  # import here: JAX starts only after reserve_host_core, in the child (see main)
  import numpy as np
  from flax import nnx
  from tunix.rl import rl_cluster as rlc
  from tunix.rl.grpo import grpo_learner

  from orchestrator.engine import model as model_lib
  from orchestrator.models.presets import load_preset
  from orchestrator.tasks import tasks as tasks_lib
  from orchestrator.tasks.tokenizer import CharTokenizer

  actor_mesh, rollout_mesh = _meshes(toy.layout)
  tokenizer = CharTokenizer()
  vocab_size = toy_vocab_size(toy)
  preset = load_preset(toy.preset, vocab_size=vocab_size)
  graphdefs, params, specs = model_lib.build_model(preset, toy.seed)
  placed = jax.tree.map(lambda x, spec: jax.device_put(np.asarray(x), jax.sharding.NamedSharding(actor_mesh, spec)),
                        params, specs)
  task = tasks_lib.make_task(toy.task)
  cluster = rlc.RLCluster(actor=nnx.merge(graphdefs["dropless"], placed), tokenizer=tokenizer,
                          cluster_config=_cluster_config(toy, actor_mesh, rollout_mesh))
  keep_static_fields_plain(cluster.rollout)
  if toy.sampled == "answer":
    sample_only(cluster.rollout, toy_sampled_ids(toy), vocab_size)
  algo_config = grpo_learner.GRPOConfig(num_generations=toy.generations, num_iterations=toy.num_iterations,
                                        beta=KL_BETA, epsilon=toy.clip_eps_low)
  if toy.clip_eps_high is not None:
    algo_config.epsilon_high = toy.clip_eps_high  # Tunix's GRPO loss reads it where the config has it
  learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=_reward_fn(toy, task), algo_config=algo_config)
  full = toy.prompts * toy.micro_batches * toy.mini_batches
  problems = [task.problem(toy.seed, "train", i) for i in range(full * toy.global_steps)]
  data = [{"prompts": np.array([p.prompt for p in problems[i:i + full]]),
           "answer": np.array([p.answer for p in problems[i:i + full]])}
          for i in range(0, len(problems), full)]
  return learner, data


def _time_global_steps(learner) -> list[float]:
  """Wraps the learner's per-global-step loop (stock or the add-on's) with a clock."""
  times: list[float] = []
  inner = learner._run_global_step

  def timed(*args, **kwargs):
    start = time.perf_counter()
    inner(*args, **kwargs)
    times.append(time.perf_counter() - start)

  learner._run_global_step = timed
  return times


class _CountPlacements:
  """Counts Tunix's input placements (``shard_input`` → ``make_array_from_process_local_data``) by thread."""

  def __enter__(self) -> dict[str, int]:
    import jax  # import here: JAX starts only after reserve_host_core, in the child (see main)

    counts = {"trainer_thread": 0, "other_threads": 0}
    self._inner = inner = jax.make_array_from_process_local_data

    def counted(*args, **kwargs):
      main = threading.current_thread() is threading.main_thread()
      counts["trainer_thread" if main else "other_threads"] += 1
      return inner(*args, **kwargs)

    jax.make_array_from_process_local_data = counted
    return counts

  def __exit__(self, *exc) -> None:
    import jax  # import here: JAX starts only after reserve_host_core, in the child (see main)

    jax.make_array_from_process_local_data = self._inner


def run_arm(toy: Toy, mode: str | None, *, corrupt_staging: bool = False) -> dict:
  """Trains ``toy`` stock (``mode`` None) or with the add-on in ``mode``; returns digest and figures."""
  from flax import nnx  # import here: JAX starts only after reserve_host_core, in the child (see main)

  from orchestrator.engine.diagnostics import tree_digest
  from integrations.tunix_grpo import install
  from integrations.tunix_grpo.throttle import instrument_stock

  learner, data = build_learner(toy)
  addon = None
  if mode is None:
    throttler = instrument_stock(learner)
  else:
    addon = install(learner, mode)
    throttler = addon.throttler
    if corrupt_staging:  # negative control: every staged micro-batch's advantages flipped
      place = addon._place
      addon._place = lambda item: [dataclasses.replace(ex, advantages=-ex.advantages) for ex in place(item)]
  times = _time_global_steps(learner)
  with _CountPlacements() as placements:
    learner.train(data)
  trainer = learner.rl_cluster.actor_trainer
  steps = trainer.train_steps
  timed = times[WARMUP_GLOBAL_STEPS:] or times
  out = {
      "mode": mode or "stock", "layout": toy.layout, "optimizer_steps": steps,
      "digest": tree_digest(nnx.state(trainer.model, nnx.Param)),
      "host_blocks": throttler.host_blocks, "host_blocks_per_step": throttler.host_blocks / max(steps, 1),
      "seconds_per_step": statistics.median(timed) / (toy.mini_batches * toy.num_iterations),
      "staged_share": 0.0, "prefetched": 0, "placements": placements,
  }
  if addon is not None:
    summary = addon.summary()
    out.update(staged_share=summary["staged_share"] or 0.0, prefetched=summary["prefetched"],
               median_idle_s=summary["median_idle_s"], policy_counters=summary["policy_counters"],
               final_mode=summary["final_mode"], records=[r.to_json() for r in addon.records],
               summary_text=addon.format_summary())
    addon.uninstall()
    out["uninstalled"] = (type(trainer._throttler).__name__ == "InflightThrottler"
                          and "_run_all_micro_batch_steps" not in vars(learner)
                          and "_run_global_step" not in vars(learner))
  return out


#: The child's environment on the CPU: two forced devices, so the split layout has a device for its sampler.
FORCED_CPU_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
#: Seconds a child that only reports the host's devices may take (an accelerator's runtime starts in 10-20 s).
PROBE_TIMEOUT_S = 120


def host_devices() -> tuple[str, int]:
  """(platform, devices) JAX finds on this host, asked of a child process, so that this one never holds an
  accelerator the arms' children need (one process at a time can hold a TPU); ("cpu", 0) where the child
  fails or JAX_PLATFORMS already says cpu."""
  if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
    return "cpu", 0
  probe = "import jax; print(jax.default_backend(), jax.device_count())"
  try:
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                          check=False)
    platform, count = proc.stdout.split()[-2:]
    return platform, int(count)
  except (subprocess.TimeoutExpired, ValueError):
    return "cpu", 0


def run_arms_in_child(toy: Toy, arms: list[tuple[str | None, dict]], *, reserve_host_core: bool = False,
                      timeout_s: float = 900, accelerator: bool = False) -> list[dict]:
  """``run_arm`` for each (mode, flags) in order, in one fresh process: on two forced CPU devices, or with
  ``accelerator`` on the devices JAX finds.

  Each arm builds its own learner from the same seeds; the process is shared only to import once.
  """
  env = dict(os.environ) if accelerator else dict(os.environ, **FORCED_CPU_ENV)
  request = json.dumps({"toy": dataclasses.asdict(toy), "arms": arms, "reserve_host_core": reserve_host_core})
  proc = subprocess.run([sys.executable, "-m", "orchestrator.bench.tunix_grpo", "--child", request],
                        capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"arms {[m or 'stock' for m, _ in arms]} ({toy.layout}) failed:\n{proc.stderr[-4000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def run_arm_in_child(toy: Toy, mode: str | None, *, reserve_host_core: bool = False, accelerator: bool = False,
                     **flags) -> dict:
  """One arm in its own process (what the benchmark does, so arms never share a warm process)."""
  return run_arms_in_child(toy, [(mode, flags)], reserve_host_core=reserve_host_core, accelerator=accelerator)[0]


CONFIGS = {
    "a_shared_one_mini_batch": Toy(layout="shared", mini_batches=1, micro_batches=2),
    "b_split_four_mini_batches": Toy(layout="split", mini_batches=4, micro_batches=2, num_iterations=2),
    # (b)'s optimizer steps on one mesh: what an accelerator of one device can stage
    "c_shared_four_mini_batches": Toy(layout="shared", mini_batches=4, micro_batches=2, num_iterations=2),
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--global-steps", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternating (medians reported)")
  parser.add_argument("--preset", default="tiny")
  parser.add_argument("--task", default="first_letter")
  parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
  parser.add_argument("--no-reserve-host-core", dest="reserve", action="store_false",
                      help="let XLA take every core (host work then cannot overlap compute)")
  parser.add_argument("--platform", choices=("auto", "cpu"), default="auto",
                      help="auto: the host's accelerator where it has one, else two forced CPU devices; cpu: those")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    request = json.loads(args.child)
    if request["reserve_host_core"]:
      reserve_host_core()
    use_compilation_cache()  # the arms' processes compile the same programs: later ones load them
    toy = Toy(**request["toy"])
    print(json.dumps([run_arm(toy, mode, **flags) for mode, flags in request["arms"]]))
    return 0
  platform, devices = host_devices() if args.platform == "auto" else ("cpu", 0)
  accelerator = platform != "cpu"
  print(f"arms on {f'{devices} {platform} device(s)' if accelerator else 'two forced CPU devices'}", flush=True)
  rows = []
  for name in args.configs.split(","):
    toy = dataclasses.replace(CONFIGS[name], global_steps=args.global_steps, preset=args.preset, task=args.task)
    if accelerator and toy.layout == "split" and devices < 2:
      print(f"{name}: skipped: the split layout needs two devices, this host's accelerator has {devices}")
      continue
    arms = {"stock": [], "stage_before_update": []}
    for _ in range(args.repeats):  # stock and the add-on alternate
      for arm in arms:
        arms[arm].append(run_arm_in_child(toy, None if arm == "stock" else arm, reserve_host_core=args.reserve,
                                          accelerator=accelerator))
    rows += _rows(name, arms, platform)
  print(f"{'config':28} {'arm':20} {'s/step (range)':>24} {'vs stock':>9} {'blocks/step':>12} {'staged':>7}"
        " digest = stock's")
  for r in rows:
    low, high = r["seconds_per_step_range"]
    print(f"{r['config']:28} {r['arm']:20} {r['seconds_per_step']:9.4f} ({low:.4f}-{high:.4f})"
          f" {100 * r['vs_stock']:+8.1f}% {r['host_blocks_per_step']:12.2f} {100 * r['staged_share']:6.0f}%"
          f" {r['digest']} {'yes' if r['same_digest_as_stock'] else 'NO'}")
  print(json.dumps(rows))
  return 0 if all(r["same_digest_as_stock"] for r in rows) else 1


def _rows(config: str, arms: dict[str, list[dict]], platform: str) -> list[dict]:
  """One row per arm: median seconds per step and their range over its runs, against stock's median, and
  whether every run of every arm reached stock's first run's weights."""
  stock_s = statistics.median(r["seconds_per_step"] for r in arms["stock"])
  stock_digest = arms["stock"][0]["digest"]
  rows = []
  for arm, runs in arms.items():
    seconds = [r["seconds_per_step"] for r in runs]
    rows.append({"config": config, "platform": platform, "arm": arm, "runs": len(runs),
                 "seconds_per_step": statistics.median(seconds), "seconds_per_step_range": [min(seconds), max(seconds)],
                 "vs_stock": statistics.median(seconds) / stock_s - 1,
                 "host_blocks_per_step": runs[0]["host_blocks_per_step"], "staged_share": runs[0]["staged_share"],
                 "digest": runs[0]["digest"][:12],
                 "same_digest_as_stock": all(r["digest"] == stock_digest for r in runs)})
  return rows


if __name__ == "__main__":
  sys.exit(main())

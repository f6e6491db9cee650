"""The recipe schema: one dataclass per section, each validating itself, and ``Recipe`` over them.

The plain sections are here; the two validated by loading files are modules of
their own (``model_section``: checkpoints and tokenizers; ``task_section``:
datasets, rewards and tokenizers). A new key is one field on its section (with
its check in that section's ``validate``); the engine's keys are
``EngineOptions``' fields. Every problem a user can cause raises ``RecipeError``
(``checks``) with one message naming the key, the value and the fix. Nothing
here imports JAX: a recipe is validated before JAX starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from typing import Any, Literal, get_args

from orchestrator import addresses
from orchestrator.engine.mesh_shape import MeshConfig
from orchestrator.engine.options import EngineOptions
from orchestrator.live import placement_rule
from orchestrator.models.presets import ModelPreset
from orchestrator.recipe.checks import RecipeError, at_least, at_most
from orchestrator.recipe.model_section import DEFAULT_PRESET, ModelSection
from orchestrator.recipe.task_section import DATASET, TaskSection
from orchestrator.tasks.tasks import max_generation_steps
from policies import Mode
from policies.saving import DEFAULT_CONTROL_EVERY


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


#: The seeds a recipe may give (every ``*.seed`` key): JAX's PRNG takes a signed 64-bit integer, and numpy's
#: seeding (synthetic rollouts, tasks, sampling seeds, the initial weights' extra draws) none below 0.
SEED_RANGE = (0, 2**63 - 1)


def _check_seeds(recipe: Any) -> None:
  """Every seed key of every section is an integer JAX and numpy can both seed with (found by name, so a
  new ``*.seed`` key is checked too): a seed out of range fails only at bring-up, after the run directory
  was claimed."""
  low, high = SEED_RANGE
  for section in dataclasses.fields(recipe):
    values = getattr(recipe, section.name)
    if not dataclasses.is_dataclass(values):
      continue
    for field in dataclasses.fields(values):
      if field.name == "seed" or field.name.endswith("_seed"):
        seed = getattr(values, field.name)
        if isinstance(seed, bool) or not isinstance(seed, int) or not low <= seed <= high:
          raise RecipeError(f"{section.name}.{field.name}={seed} is out of range: a seed must be an integer in"
                            f" [{low}, 2**63 - 1 = {high}] (JAX's PRNG takes signed 64-bit seeds, numpy none"
                            " below 0)")


class MeshSection(MeshConfig):
  """Device mesh axis sizes (``orchestrator.engine.mesh_shape.MeshConfig``); their product is the devices."""

  def validate(self) -> None:
    try:
      MeshConfig.validate(self)
    except ValueError as e:
      raise RecipeError(str(e)) from None


@dataclasses.dataclass
class BatchSection:
  """The shape of one optimizer step."""

  micro_batches_per_step: int = 3
  rows: int | None = None  # None: derived (Recipe.micro_batch_shape)
  tokens_per_row: int | None = None

  def validate(self) -> None:
    at_least("batch", self, ("micro_batches_per_step", "rows", "tokens_per_row"), 1)
    at_most("batch", self, ("micro_batches_per_step",), 100_000)
    at_most("batch", self, ("rows", "tokens_per_row"), 1 << 24)


#: Where each step's trajectories come from (``rollouts.source``): made up, read from a recording, or sampled live.
RolloutSource = Literal["synthetic", "recording", "sampler"]
ROLLOUT_SOURCES: tuple[str, ...] = get_args(RolloutSource)
#: Where the live loop's sampler runs (``rollouts.placement``: ``orchestrator.live.placement_rule.Placement``).
PLACEMENTS = placement_rule.PLACEMENTS


#: The most ``rollouts.stop`` strings, and the longest (a completion is searched for each after it is sampled).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
#: Keys only the live loop reads: set for a run that samples nothing, they are refused
#: (``Recipe._refuse_live_only_keys``), or dropped where the command line replaces a live recipe's sampler.
LIVE_ONLY_KEYS = ("task.reward", "task.reward_timeout_s", "model.chat_template", "rollouts.batch_steps",
                  "rollouts.micro_batches_per_call", "rollouts.placement", "rollouts.devices", "engine.epochs",
                  "metrics.samples_every", "task.eval_every", "task.eval_pass_k", "rollouts.top_p", "rollouts.top_k",
                  "rollouts.stop", "rollouts.advantage_scaling", "rollouts.in_flight_updates",
                  "rollouts.decode_chunk_tokens")
#: How a group's advantages are scaled (``rollouts.advantage_scaling``): over the group's reward std (GRPO's, as
#: Tunix computes them), or not at all (Dr. GRPO's: the std's division weighs groups by how little they differ).
ADVANTAGE_SCALINGS = ("group", "none")
#: ``rollouts.decode_chunk_tokens`` unset: a generation decodes in this many chunks (fewer where the completion
#: limit does not split so: ``decode_chunks``), so an in-flight run has points to take new weights at whatever its
#: completions' length.
DEFAULT_DECODE_CHUNKS = 4


def decode_chunk_size(decode_chunk_tokens: int | None, completion_limit_tokens: int) -> int:
  """The tokens of a decode chunk (the last may be shorter): ``decode_chunk_tokens``, or unset the completion limit
  over ``DEFAULT_DECODE_CHUNKS``, rounded up (the sampler decodes chunks of one size)."""
  if decode_chunk_tokens is None:
    return -(-completion_limit_tokens // DEFAULT_DECODE_CHUNKS)
  return decode_chunk_tokens


def decode_chunks(decode_chunk_tokens: int | None, completion_limit_tokens: int) -> int:
  """How many chunks a generation of up to ``completion_limit_tokens`` decodes in, ``decode_chunk_size`` tokens at
  a time (unset: ``DEFAULT_DECODE_CHUNKS``, fewer where the limit does not split into as many chunks of one size:
  as many as it has tokens below four, three for five or six tokens)."""
  return -(-completion_limit_tokens // decode_chunk_size(decode_chunk_tokens, completion_limit_tokens))


@dataclasses.dataclass
class RolloutsSection:
  """Where each step's trajectories come from: ``sampler`` samples them live from the model being trained."""

  source: RolloutSource = "synthetic"
  recording: str | None = None
  seed: int = 0
  generations_per_group: int = 4
  fill: float = 0.85
  # The live loop (source: sampler).
  # Sampled batch b (batch_steps × engine.epochs optimizer steps) samples with the weights at the start of batch
  # b - max_staleness (floored at 0); 0 = on-policy at each batch's first step.
  max_staleness: int = 1
  batch_steps: int = 1  # optimizer steps per sampled batch (per pass over it): N × micro_batches_per_step sampled
  # Micro-batches the sampler generates in one call ('batch': a whole sampled batch): larger calls use the devices
  # better and queue fewer computations beside the trainer's; smaller ones stream sooner (each is published when
  # its call is done).
  micro_batches_per_call: int | str = 1
  groups_per_micro_batch: int = 4
  temperature: float = 1.0
  # Truncation of each token's distribution (as vLLM's and Tunix's): top_p, the smallest set of ids holding that
  # much probability (1.0: off); top_k, the most likely ids (0: off; more than the vocabulary: off). The
  # log-probs trained on stay the full tempered distribution's (orchestrator.engine.loss).
  top_p: float = 1.0
  top_k: int = 0
  # Strings that end a completion where one first occurs: its tokens are kept through the one that completed it
  # (trained on, as an eos), and the reward sees the text before it (vLLM's include_stop_str_in_output=False).
  stop: list[str] = dataclasses.field(default_factory=list)
  # Each completion's advantage is its reward minus its group's mean, divided by the group's std (group) or not
  # (none: Dr. GRPO, with engine.loss_aggregation=seq_mean_token_sum_norm).
  advantage_scaling: str = "group"
  # In-flight weight updates: a version the trainer publishes reaches the sampler between decode chunks of a
  # generation under way (each chunk decode_chunk_tokens tokens; None: the completion limit in
  # DEFAULT_DECODE_CHUNKS chunks). Which version each chunk samples with is a function of counts
  # (BatchSchedule.chunk_version); every token records it, and is trained against that policy's log-prob.
  in_flight_updates: bool = False
  decode_chunk_tokens: int | None = None
  record_to: str | None = None  # a live run writes the rollouts it trained on as a recording there
  # shared: the sampler runs on the trainer's devices; split: on rollouts.devices local devices of its own
  # (those after the mesh's), with its own copy of the weights, which the weight sync copies device to device;
  # process: in a process of its own on the host's cores (its own interpreter and XLA client, never an
  # accelerator), sent each version's weights as host arrays; auto: process on a CPU host, shared where the
  # trainer holds an accelerator in one process (orchestrator.live.placement_rule).
  placement: placement_rule.Placement = "shared"
  devices: int | None = None  # split: the sampler's devices (default 1)
  # Shape of recordings made by `run_rl record` (log-normal lengths, medians in tokens).
  groups: int = 256
  prompt_len_median: float = 24.0
  completion_len_median: float = 16.0

  def validate(self) -> None:
    at_least("rollouts", self, ("generations_per_group", "groups", "prompt_len_median",
                                 "completion_len_median"), 1)
    at_most("rollouts", self, ("generations_per_group",), 65_536)
    at_least("rollouts", self, ("max_staleness",), 0)
    at_most("rollouts", self, ("max_staleness",), 16)
    at_least("rollouts", self, ("groups_per_micro_batch", "batch_steps"), 1)
    at_most("rollouts", self, ("groups_per_micro_batch", "batch_steps"), 4096)
    if self.micro_batches_per_call != "batch":
      at_least("rollouts", self, ("micro_batches_per_call",), 1)
      at_most("rollouts", self, ("micro_batches_per_call",), 4096)
    if self.source == "sampler" and self.generations_per_group < 2:
      raise RecipeError(f"rollouts.generations_per_group={self.generations_per_group} is out of range for the"
                        " live loop: GRPO compares a group's completions, use >= 2")
    if not (self.temperature > 0 and math.isfinite(self.temperature)):
      raise RecipeError(f"rollouts.temperature={self.temperature} is out of range: it must be a finite number > 0")
    self._check_sampling()
    if not 0 < self.fill <= 1:
      raise RecipeError(f"rollouts.fill={self.fill} is out of range: it must be in (0, 1]")
    if self.source not in ROLLOUT_SOURCES:
      raise RecipeError(f"rollouts.source={self.source!r}: use one of {', '.join(map(repr, ROLLOUT_SOURCES))}")
    if self.source == "recording" and not self.recording:
      raise RecipeError("rollouts.source=recording needs rollouts.recording=DIR")
    if self.placement not in PLACEMENTS:
      raise RecipeError(f"rollouts.placement={self.placement!r}: use one of {', '.join(PLACEMENTS)}")
    if self.advantage_scaling not in ADVANTAGE_SCALINGS:
      raise RecipeError(f"rollouts.advantage_scaling={self.advantage_scaling!r}: use group (divide by the group's"
                        " reward std, GRPO's) or none (Dr. GRPO's)")
    self._check_in_flight()
    if self.devices is not None:
      at_least("rollouts", self, ("devices",), 1)
      at_most("rollouts", self, ("devices",), 65_536)
      if self.placement != "split":
        raise RecipeError(f"rollouts.devices={self.devices} is for rollouts.placement=split (a sampler on devices"
                          " of its own); the shared sampler runs on the trainer's devices, so drop it or set"
                          " rollouts.placement=split")

  def _check_in_flight(self) -> None:
    """``in_flight_updates`` and ``decode_chunk_tokens`` on their own; against the completion limit, the staleness
    and the engine in ``check_in_flight``."""
    if not isinstance(self.in_flight_updates, bool):
      raise RecipeError(f"rollouts.in_flight_updates={self.in_flight_updates!r} is not a boolean; use true or false")
    chunk = self.decode_chunk_tokens
    if chunk is None:
      return
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
      raise RecipeError(f"rollouts.decode_chunk_tokens={chunk!r} is out of range: it must be a whole number of"
                        " tokens >= 1 (the tokens decoded between two points where new weights may land), or"
                        " unset for the completion limit in four chunks")
    if not self.in_flight_updates:
      raise RecipeError(f"rollouts.decode_chunk_tokens={chunk} is read only with rollouts.in_flight_updates=true"
                        " (without it a generation decodes whole on one version); set"
                        " rollouts.in_flight_updates=true, or drop it")

  def _check_sampling(self) -> None:
    """``top_p``, ``top_k`` and ``stop``: each refused in one line naming its range."""
    top_p = self.top_p
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not (math.isfinite(top_p)
                                                                              and 0 < top_p <= 1):
      raise RecipeError(f"rollouts.top_p={top_p} is out of range: it must be a finite number in (0, 1], the"
                        " probability mass each token is drawn from (1.0: off)")
    top_k = self.top_k
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
      raise RecipeError(f"rollouts.top_k={top_k} is out of range: it must be a whole number >= 0, the most likely"
                        " ids each token is drawn from (0: off)")
    stop = self.stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
      raise RecipeError(f"rollouts.stop={stop!r} is not a list of strings; give one, e.g. rollouts.stop=['</answer>'],"
                        " or [] for none")
    if len(stop) > MAX_STOP_STRINGS:
      raise RecipeError(f"rollouts.stop lists {len(stop)} strings; it must list at most {MAX_STOP_STRINGS}")
    for i, text in enumerate(stop):
      if not 1 <= len(text) <= MAX_STOP_STRING_CHARS:
        raise RecipeError(f"rollouts.stop[{i}]={text[:40]!r}{'...' if len(text) > 40 else ''} is {len(text)}"
                          f" characters long: each stop string must be 1 to {MAX_STOP_STRING_CHARS} characters")


@dataclasses.dataclass
class CheckpointSection:
  """Checkpoint directory, cadence, and the steps whose checkpoints are scored."""

  directory: str | None = None  # None: <run directory>/checkpoints
  every: int = 0  # 0: only the scored steps (and a stop's)
  scored_steps: list[int] = dataclasses.field(default_factory=list)

  def validate(self, steps: int) -> None:
    at_least("checkpoint", self, ("every",), 0)
    bad = [n for n in self.scored_steps if not 1 <= n <= steps]
    if bad:
      raise RecipeError(f"checkpoint.scored_steps {bad} are outside the run's steps 1..{steps}")


@dataclasses.dataclass
class StepBoundarySection:
  """The switches of the step-boundary scheduler (docs/run_rl.md describes each)."""

  pipeline_step_boundary: bool = True
  stage_next_microbatch: bool | None = None  # None: follows pipeline_step_boundary
  stage_before_update: bool = True
  require_staging: bool = False
  wait_threshold_s: float | Literal["auto"] = "auto"  # auto: calibrated at the run's start
  disable_after: int = 2
  reprobe_every: int | None = None
  exclude_checkpoint_boundaries: bool = True
  sync_before_next_step: bool = False
  calibration_samples: int = 8
  # The free device memory a stage needs: "auto" (the staged input's bytes + max(10 %, 64 MiB)), bytes, or 0 (off).
  min_free_device_bytes: int | str = "auto"
  # One in each K boundaries that would stage runs unstaged, to measure what staging saves (0: no controls).
  control_every: int = DEFAULT_CONTROL_EVERY

  @property
  def staging_requested(self) -> bool:
    return self.pipeline_step_boundary if self.stage_next_microbatch is None else self.stage_next_microbatch

  @property
  def mode(self) -> Mode:
    """The policy mode the switches select."""
    if not self.pipeline_step_boundary:
      return Mode.OFF
    if not self.staging_requested:
      return Mode.PIPELINED
    return Mode.STAGE_BEFORE_UPDATE if self.stage_before_update else Mode.STAGE_AFTER_UPDATE

  def validate(self) -> None:
    at_least("step_boundary", self, ("disable_after", "calibration_samples", "reprobe_every"), 1)
    at_most("step_boundary", self, ("calibration_samples",), 10_000)
    at_least("step_boundary", self, ("control_every",), 0)
    if self.control_every == 1:  # every boundary a control: nothing would stage, and nothing measure against
      raise RecipeError("step_boundary.control_every=1 makes every boundary that would stage a control, so nothing"
                        " stages and there is no staged step to measure against; use 0 (no controls) or a number"
                        f" >= 2 (the default, {DEFAULT_CONTROL_EVERY}: one boundary in {DEFAULT_CONTROL_EVERY})")
    t = self.wait_threshold_s
    if t != "auto" and t < 0:
      raise RecipeError(f"step_boundary.wait_threshold_s={t} is out of range: use 'auto' or a number >= 0")
    free = self.min_free_device_bytes
    if free != "auto" and (type(free) is not int or not 0 <= free <= 1 << 50):
      raise RecipeError(f"step_boundary.min_free_device_bytes={free!r} is out of range: use 'auto', 0 (no memory"
                        f" gate) or a whole number of bytes up to {1 << 50:,}")
    if self.stage_next_microbatch and not self.pipeline_step_boundary:
      raise RecipeError(
          "step_boundary.stage_next_microbatch=true needs step_boundary.pipeline_step_boundary=true:"
          " staging moves work across a pipelined boundary; turn pipelining on, or staging off")
    if self.require_staging and not self.staging_requested:
      off = "pipeline_step_boundary" if not self.pipeline_step_boundary else "stage_next_microbatch"
      raise RecipeError(f"step_boundary.require_staging=true but staging is off ({off}=false);"
                        " turn staging on or drop require_staging")


@dataclasses.dataclass
class SimulateSection:
  """Component times for ``run_rl simulate``, in place of a calibration (docs/rig.md gives each one's
  meaning and scaling rule). Seconds unless the name says otherwise."""

  micro_batch_s: float = 1.0
  first_micro_batch_extra_s: float = 0.0  # a step's first micro-batch, beside the host's boundary work (< 0: faster)
  update_s: float = 0.05
  map_s: float | None = None  # host: map one micro-batch and issue its copy (None: input_copy_s, else 0.07)
  input_copy_s: float | None = None  # the earlier spelling of map_s (a host cost, serial with the dispatch)
  copy_s: float = 0.0  # device-side transfer of one micro-batch's inputs
  sync_copy: bool = False  # an unstaged copy queues behind the update on the compute stream
  host_runs_ahead: bool = False  # a step's micro-batches are dispatched without waiting for the device
  metrics_s: float = 0.2  # the metrics read (before: all boundary work; the other terms default to 0)
  logging_s: float = 0.0
  checkpoint_s: float = 0.0  # per boundary (a checkpoint every N steps: its seconds / N)
  weight_sync_s: float = 0.0
  update_overlap_share: float | None = None  # 0..1; None: from update_waits_for_last, else 1
  update_waits_for_last: bool | None = None  # the earlier spelling: true is update_overlap_share 0, false 1
  dispatch_s: float = 0.0005
  gap_per_dispatch_s: float = 0.0
  wait_floor_s: float = 0.0
  rollout_wait_s: float = 0.0
  reruns_per_step: float = 0.0
  rerun_s: float | None = None  # None: one micro-batch
  tokens_per_device: int | None = None  # None: rows × tokens_per_row ÷ devices
  hosts: int | None = None  # None: distributed.num_processes, else 1
  # One host maps and sends every device its inputs (a single-controller runtime), rather than each its own.
  single_controller: bool = False
  bytes_per_token: float | None = None  # the staged input's (None: the packed fields')
  host_link_gb_s: float | None = None  # the feeding host's link: copy_s from the bytes it sends (instead of copy_s)
  # The job the times above were measured on (None: this recipe's own); the scaling rules take them to this one.
  reference_rows: int | None = None
  reference_tokens_per_row: int | None = None
  reference_devices: int | None = None
  reference_hosts: int | None = None
  reference_bytes_per_token: float | None = None  # None: this recipe's bytes per token
  reference_single_controller: bool | None = None  # None: as this recipe's

  def validate(self) -> None:
    at_least("simulate", self, ("micro_batch_s", "update_s", "map_s", "input_copy_s", "copy_s", "metrics_s",
                                 "logging_s", "checkpoint_s", "weight_sync_s", "update_overlap_share",
                                 "dispatch_s", "gap_per_dispatch_s", "wait_floor_s", "rollout_wait_s",
                                 "reruns_per_step", "rerun_s"), 0)
    at_most("simulate", self, ("update_overlap_share",), 1)
    # Negative where the first micro-batch computes faster (the host idle beside it), never below nothing.
    if self.first_micro_batch_extra_s < -self.micro_batch_s:
      raise RecipeError(f"simulate.first_micro_batch_extra_s={self.first_micro_batch_extra_s} is out of range: a"
                        f" first micro-batch cannot take less than nothing, so it must be >= -simulate.micro_batch_s"
                        f" ({-self.micro_batch_s})")
    at_least("simulate", self, ("tokens_per_device", "hosts", "reference_rows", "reference_tokens_per_row",
                                 "reference_devices", "reference_hosts", "bytes_per_token",
                                 "reference_bytes_per_token"), 1)
    if self.host_link_gb_s is not None and not self.host_link_gb_s > 0:
      raise RecipeError(f"simulate.host_link_gb_s={self.host_link_gb_s} is out of range: a link carries"
                        " more than nothing, so it must be > 0")
    if self.host_link_gb_s is not None and self.copy_s:
      raise RecipeError(f"simulate.copy_s={self.copy_s} and simulate.host_link_gb_s={self.host_link_gb_s} are"
                        " both set; the link gives the copy's seconds from its bytes: keep only one of them")
    for new, old in (("map_s", "input_copy_s"), ("update_overlap_share", "update_waits_for_last")):
      if getattr(self, new) is not None and getattr(self, old) is not None:
        raise RecipeError(f"simulate.{old}={getattr(self, old)} and simulate.{new}={getattr(self, new)} are both"
                          f" set; {old} is the earlier spelling of {new}: keep only simulate.{new}")

  @property
  def resolved_map_s(self) -> float:
    return next(v for v in (self.map_s, self.input_copy_s, 0.07) if v is not None)

  @property
  def resolved_update_overlap_share(self) -> float:
    if self.update_overlap_share is not None:
      return self.update_overlap_share
    return 0.0 if self.update_waits_for_last else 1.0


#: Where the trainer runs (``trainer.location``): in this process, or behind ``run_rl serve-trainer``.
TrainerLocation = Literal["local", "remote"]
TRAINER_LOCATIONS: tuple[str, ...] = get_args(TrainerLocation)


@dataclasses.dataclass
class TrainerSection:
  """Where the trainer runs: in this process, or behind ``run_rl serve-trainer`` (docs/remote.md)."""

  location: TrainerLocation = "local"
  address: str | None = None  # remote: HOST:PORT of serve-trainer (spawn: loopback, default a free port)
  spawn: bool = False  # remote: start serve-trainer on loopback as a child, drive it, stop it
  token_file: str | None = None  # the shared token (else $STEP_BOUNDARY_TRAINER_TOKEN)
  timeout_s: float = 120.0  # every call's deadline; a silent trainer ends the run within it
  max_message_bytes: int = 1 << 30  # per message, both ways

  def validate(self) -> None:
    if self.location not in TRAINER_LOCATIONS:
      raise RecipeError(f"trainer.location={self.location!r}: use {' or '.join(TRAINER_LOCATIONS)}")
    at_least("trainer", self, ("timeout_s",), 0.1)
    at_most("trainer", self, ("timeout_s",), 86_400)
    at_least("trainer", self, ("max_message_bytes",), 1 << 20)
    at_most("trainer", self, ("max_message_bytes",), 1 << 34)
    if self.location == "local":
      if self.spawn or self.address:
        key = "spawn" if self.spawn else "address"
        raise RecipeError(f"trainer.{key} is set but trainer.location=local; set trainer.location=remote or drop it")
      return
    if not self.spawn and not self.address:
      raise RecipeError("trainer.location=remote needs trainer.address=HOST:PORT of a running serve-trainer,"
                        " or trainer.spawn=true to start one on loopback")
    try:
      host, port = addresses.split_address(self.address or "127.0.0.1:0")
    except addresses.AddressError as e:
      raise RecipeError(f"trainer.address: {e}") from None
    if self.spawn and not addresses.is_loopback(host):
      raise RecipeError(f"trainer.spawn=true starts the trainer on loopback; trainer.address={self.address} is"
                        " not a loopback address (use 127.0.0.1:PORT, or drop spawn and start serve-trainer there)")
    if not self.spawn and port == 0:
      raise RecipeError(f"trainer.address={self.address}: give the port serve-trainer listens on")


@dataclasses.dataclass
class DistributedSection:
  """Several JAX processes (multi-controller) training one model (docs/distributed.md).

  ``num_processes`` unset: one process and no distributed runtime. Set alone,
  ``run_rl`` starts that many local processes itself (CPU devices split among
  them). With ``process_id`` and ``coordinator_address`` this process is one
  member of a job started elsewhere (one ``run_rl`` per host);
  ``detect_cluster`` lets JAX read all three from the cluster instead.
  """

  num_processes: int | None = None  # None: no distributed runtime; N >= 1: a job of N processes
  process_id: int | None = None  # this process's id in [0, num_processes) (or $STEP_BOUNDARY_PROCESS_ID)
  coordinator_address: str | None = None  # HOST:PORT where process 0 serves the coordinator
  detect_cluster: bool = False  # JAX finds the coordinator, the count and this id (TPU pod slice, SLURM, ...)
  timeout_s: float = 60.0  # a process silent this long ends the others; bring-up's limit too

  @property
  def enabled(self) -> bool:
    return self.num_processes is not None or self.detect_cluster

  @property
  def launches_local(self) -> bool:
    """This ``run_rl`` starts the processes itself (no identity given, no cluster to detect)."""
    return self.enabled and not self.detect_cluster and self.process_id is None and self.coordinator_address is None

  def validate(self) -> None:
    at_least("distributed", self, ("num_processes",), 1)
    at_most("distributed", self, ("num_processes",), 4096)
    at_least("distributed", self, ("timeout_s",), 1.0)
    at_most("distributed", self, ("timeout_s",), 86_400)
    given = [k for k in ("num_processes", "process_id", "coordinator_address") if getattr(self, k) is not None]
    if self.detect_cluster:
      if given:
        raise RecipeError(f"distributed.{given[0]}={getattr(self, given[0])} is set with distributed.detect_cluster="
                          "true, which reads it from the cluster; drop one of the two")
      return
    if self.process_id is not None and self.num_processes is None:
      raise RecipeError(f"distributed.process_id={self.process_id} needs distributed.num_processes (the job's size)")
    if self.process_id is not None and not 0 <= self.process_id < self.num_processes:
      raise RecipeError(f"distributed.process_id={self.process_id} is out of range: it must be in"
                        f" [0, {self.num_processes - 1}] for distributed.num_processes={self.num_processes}")
    if (self.process_id is None) != (self.coordinator_address is None):
      have, missing = (("process_id", "coordinator_address") if self.coordinator_address is None
                       else ("coordinator_address", "process_id"))
      raise RecipeError(f"distributed.{have} is set but distributed.{missing} is not: a process of a job started"
                        " elsewhere needs both (or neither, and run_rl starts the processes here)")
    if self.coordinator_address is not None:
      try:
        _, port = addresses.split_address(self.coordinator_address)
      except addresses.AddressError as e:
        raise RecipeError(f"distributed.coordinator_address: {e}") from None
      if port == 0:
        raise RecipeError(f"distributed.coordinator_address={self.coordinator_address}: give the port process 0"
                          " serves the coordinator on (every process must name the same one)")


#: What ``metrics.backends`` may name: TensorBoard event files in the run's directory, a W&B run.
METRICS_BACKENDS = ("tensorboard", "wandb")


def _importable(package: str) -> bool:
  """Whether ``package`` can be imported here, found without importing it (validation runs before JAX)."""
  return importlib.util.find_spec(package) is not None


@dataclasses.dataclass
class MetricsSection:
  """Where each step's scalars go besides ``records.jsonl`` (``orchestrator/loop/metrics_log.py``)."""

  backends: list[str] = dataclasses.field(default_factory=lambda: ["tensorboard"])  # []: no logging
  # A live run writes a few completions of every N-th step to samples.jsonl and the dashboards (0: none).
  samples_every: int = 25

  def validate(self) -> None:
    at_least("metrics", self, ("samples_every",), 0)
    at_most("metrics", self, ("samples_every",), 10**9)
    given = f"metrics.backends={self.backends!r}"
    for name in self.backends:
      if name not in METRICS_BACKENDS:
        raise RecipeError(f"{given}: {name!r} is not a metrics backend; use a list of"
                          f" {', '.join(METRICS_BACKENDS)} (or [] for none)")
    if len(set(self.backends)) != len(self.backends):
      raise RecipeError(f"{given} names a backend twice; name each once")
    if "wandb" in self.backends and not _importable("wandb"):
      raise RecipeError(f"{given}: the wandb package is not installed; pip install wandb, or drop wandb from"
                        " metrics.backends")


@dataclasses.dataclass
class RunSection:
  """Where outputs go and how the host is set up."""

  out: str | None = None  # None: runs/<recipe name>-<time>
  reserve_host_core: bool | str = "auto"  # auto: from host_threads.AUTO_RESERVE_MIN_CORES cores on (host_threads)

  def validate(self) -> None:
    if isinstance(self.reserve_host_core, str):
      self.reserve_host_core = self.reserve_host_core.strip().lower()
    if self.reserve_host_core not in (True, False, "auto"):
      raise RecipeError(f"run.reserve_host_core={self.reserve_host_core!r}: use auto, true or false")


#: The most ids a built-in task's answer alphabet may leave the sampler to forbid in a checkpoint's vocabulary:
#: Tunix's sampler masks each forbidden id as its own index (SmolLM2's 49,149 exhausted 16 GB at its first call).
MAX_FORBIDDEN_IDS = 4096


@dataclasses.dataclass
class Recipe:
  """A full run description; ``recipes/*.yaml`` set any subset of it.

  A new key is one field on its section (with its check in that section's
  ``validate``); the engine's keys are ``EngineOptions``' fields.
  """

  name: str = "unnamed"
  description: str = ""
  model: ModelSection = dataclasses.field(default_factory=ModelSection)
  steps: int = 6
  mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
  batch: BatchSection = dataclasses.field(default_factory=BatchSection)
  engine: EngineOptions = dataclasses.field(default_factory=EngineOptions)
  rollouts: RolloutsSection = dataclasses.field(default_factory=RolloutsSection)
  task: TaskSection = dataclasses.field(default_factory=TaskSection)
  checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
  step_boundary: StepBoundarySection = dataclasses.field(default_factory=StepBoundarySection)
  simulate: SimulateSection = dataclasses.field(default_factory=SimulateSection)
  trainer: TrainerSection = dataclasses.field(default_factory=TrainerSection)
  distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)
  run: RunSection = dataclasses.field(default_factory=RunSection)
  metrics: MetricsSection = dataclasses.field(default_factory=MetricsSection)

  # ---------------------------------------------------------------- derived
  def model_preset(self) -> ModelPreset:
    """The model's sizes (``ModelSection.load``): what every part that builds a model is given."""
    return self.model.load()

  def live_task(self):
    """The live loop's task, read (a dataset: every row checked) with the tokenizer the sampler uses."""
    return self.task.make(self.model.tokenizer())

  def micro_batch_shape(self) -> tuple[int, int]:
    """(rows, tokens per row) of one micro-batch: ``batch.rows`` and ``batch.tokens_per_row`` where set.

    Unset, a live run's fit its task, so no step computes rows of padding: a row holds one trajectory of the
    longest prompt and completion (with ``batch.rows`` set, as many as the sampled trajectories need), and there
    is a row per trajectory a micro-batch samples, each rounded up to split over the mesh. Any other run's are
    the model's (its preset's sizes).
    """
    preset = self.model_preset()
    rows, tokens = self.batch.rows, self.batch.tokens_per_row
    if self.rollouts.source != "sampler" or (rows and tokens):
      return rows or preset.rows, tokens or preset.tokens_per_row
    trajectories, per_trajectory = self.live_trajectories()
    if tokens is None:
      tokens = _round_up(per_trajectory * (math.ceil(trajectories / rows) if rows else 1), self.mesh.context)
    if rows is None:
      rows = _round_up(math.ceil(trajectories / max(1, tokens // per_trajectory)), self.mesh.row_shards)
    return rows, tokens

  def live_trajectories(self) -> tuple[int, int]:
    """(trajectories a micro-batch samples, tokens of the longest one) of a live run; the task (a dataset: read
    whole) is made once for the sections that decide them."""
    r = self.rollouts
    key = (repr(self.task), repr(self.model), r.groups_per_micro_batch, r.generations_per_group)
    cached = self.__dict__.get("_trajectories")
    if cached is None or cached[0] != key:
      task = self.live_task()
      cached = (key, (r.groups_per_micro_batch * r.generations_per_group,
                      task.max_prompt_tokens + max_generation_steps(task)))
      self.__dict__["_trajectories"] = cached
    return cached[1]

  def derived_sizes(self) -> dict[str, tuple[int, str]]:
    """Each size key left unset whose value the run derives: the key → (the value it runs with, where that
    comes from, as ``"derived: ..."``). config.json records these values as the run's."""
    derived = {}
    shape = dict(zip(("rows", "tokens_per_row"), self.micro_batch_shape()))
    if self.rollouts.source == "sampler":
      trajectories, per_trajectory = self.live_trajectories()
      sources = {"rows": f"derived: rows for the {trajectories} trajectories a micro-batch samples",
                 "tokens_per_row": f"derived: the task's longest trajectory ({per_trajectory} tokens) per trajectory"
                                   " a row holds"}
    else:
      origin = (f"model.preset {self.model.preset or DEFAULT_PRESET}" if self.model.preset or not self.model.checkpoint
                else "a checkpoint's model (the default)")
      sources = {key: f"derived: {origin}'s {key}" for key in shape}
    for key, value in shape.items():
      if getattr(self.batch, key) is None:
        derived[f"batch.{key}"] = (value, sources[key])
    if self.rollouts.source == "sampler" and self.task.name == DATASET:
      task = self.live_task()
      if self.task.max_prompt_tokens is None:
        derived["task.max_prompt_tokens"] = (task.max_prompt_tokens, "derived: the longest prompt (bos included)")
      if self.task.max_completion_tokens is None:
        derived["task.max_completion_tokens"] = (task.max_answer_length, "derived: the longest answer")
    return derived

  @property
  def staging_requested(self) -> bool:
    return self.step_boundary.staging_requested

  @property
  def mode(self) -> Mode:
    return self.step_boundary.mode

  @property
  def wait_threshold(self) -> float | None:
    t = self.step_boundary.wait_threshold_s
    return None if t == "auto" else float(t)

  @property
  def excluded_steps(self) -> list[int]:
    """Boundaries (by step index) the policy must not stage across."""
    if not self.step_boundary.exclude_checkpoint_boundaries:
      return []
    return sorted({n - 1 for n in self.checkpoint.scored_steps})

  # ---------------------------------------------------------------- validation
  def validate(self) -> None:
    """Raises RecipeError for out-of-range values and contradictory settings, one key at a time."""
    at_least("", self, ("steps",), 1)
    at_most("", self, ("steps",), 1_000_000_000)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", self.name):
      raise RecipeError(f"name={self.name!r}: use letters, digits, '.', '_' and '-' (it names the run's directory)")
    for section in (self.model, self.mesh, self.batch, self.rollouts, self.task, self.step_boundary, self.simulate,
                    self.trainer, self.distributed, self.run, self.metrics):
      section.validate()
    _check_seeds(self)
    self.checkpoint.validate(self.steps)
    preset = self.model_preset()
    if self.rollouts.source != "sampler":
      self._refuse_live_only_keys()
    else:
      self._check_sampler_calls()
      if self.task.name == DATASET:  # every row and every reward entry, before anything runs
        self.task.make_reward(self.live_task())
    if self.rollouts.stop and self.rollouts.source == "sampler" and self.task.name != DATASET:
      raise RecipeError(f"rollouts.stop={self.rollouts.stop!r} ends free-text completions, but task.name="
                        f"{self.task.name} is a built-in task whose answers have a fixed length (no end is"
                        " sampled); drop rollouts.stop, or train on a dataset (task.name=dataset)")
    if self.model.reference_checkpoint is not None and not self.engine.kl_beta:
      raise RecipeError(f"model.reference_checkpoint={self.model.reference_checkpoint} is the KL term's reference,"
                        " but engine.kl_beta is 0 (no KL term, so no reference is built); set engine.kl_beta > 0,"
                        " or drop model.reference_checkpoint")
    rows, tokens = self.micro_batch_shape()
    try:
      self.engine.validate(preset)
      self.mesh.check_batch_shape(rows, tokens)
    except ValueError as e:
      raise RecipeError(str(e)) from None
    if self.engine.warmup_steps and self.engine.warmup_steps >= self.steps:
      raise RecipeError(f"engine.warmup_steps={self.engine.warmup_steps} leaves none of the run's {self.steps} steps"
                        " at the peak rate (engine.learning_rate is reached after the warm-up's last update); use"
                        f" at most {self.steps - 1}, or run more steps")
    if rows * tokens > 1 << 28:
      raise RecipeError(f"batch.rows × batch.tokens_per_row = {rows * tokens:,} tokens per micro-batch is out of"
                        f" range: it must be <= {1 << 28:,}")
    if self.rollouts.source == "synthetic" and tokens < 4:
      raise RecipeError(f"batch.tokens_per_row={tokens} is too short for synthetic rollouts: use >= 4")
    context = self.model.context_tokens()
    if self.rollouts.source != "sampler" and context is not None and tokens > context:
      raise RecipeError(f"batch.tokens_per_row={tokens} is longer than the model's context of {context} tokens"
                        f" ({self.model.context_source()}), and one"
                        f" trajectory may fill a row; lower batch.tokens_per_row to at most {context}")
    if self.rollouts.source == "sampler":
      self._validate_live(preset, rows, tokens)
    if self.engine.backend == "tunix_peft":
      self._validate_tunix_backend()
    if self.distributed.enabled:
      self._validate_distributed()

  def _validate_live(self, preset, rows: int, tokens: int) -> None:
    if self.engine.backend != "jax":
      raise RecipeError(f"rollouts.source=sampler trains with engine.backend=jax, not {self.engine.backend}; set"
                        " engine.backend=jax or use rollouts.source=recording")
    if self.trainer.location == "remote" and self.rollouts.placement == "split":
      raise RecipeError("rollouts.placement=split puts the sampler on devices beside the trainer's, which a"
                        " remote trainer does not share; use rollouts.placement=shared or trainer.location=local")
    tokenizer = self.model.tokenizer()
    if tokenizer.vocab_size > preset.vocab_size:
      where = (f"model.checkpoint={self.model.checkpoint}: its tokenizer.json has {tokenizer.vocab_size} ids"
               if self.model.checkpoint else f"the live loop's tokenizer has {tokenizer.vocab_size} ids")
      raise RecipeError(f"{where}, more than the model's vocabulary of {preset.vocab_size}; use the checkpoint's"
                        " own tokenizer, or a model with a larger vocabulary")
    trajectories, per_trajectory = self.live_trajectories()
    task = self.live_task()
    if task.answer_alphabet is not None and self.model.checkpoint:
      forbidden = preset.vocab_size - len(set(tokenizer.encode(task.answer_alphabet)))
      if forbidden > MAX_FORBIDDEN_IDS:
        raise RecipeError(f"task.name={self.task.name} samples answers from the {len(task.answer_alphabet)}"
                          f" characters {task.answer_alphabet!r}, so the sampler would forbid {forbidden:,} of the"
                          f" model's {preset.vocab_size:,} ids; Tunix's sampler masks each one as its own index,"
                          f" which exhausts memory past {MAX_FORBIDDEN_IDS:,}: use task.name=dataset (free-text"
                          " answers, any id) with this checkpoint")
    context = self.model.context_tokens()
    if context is not None and per_trajectory > context:
      raise RecipeError(f"task.max_prompt_tokens + task.max_completion_tokens = {task.max_prompt_tokens} +"
                        f" {max_generation_steps(task)} = {per_trajectory} tokens is longer than the model's context"
                        f" of {context} ({self.model.context_source()});"
                        " lower task.max_prompt_tokens or task.max_completion_tokens")
    if tokens < per_trajectory or trajectories > rows * (tokens // per_trajectory):
      raise RecipeError(
          f"rollouts.groups_per_micro_batch × generations_per_group = {trajectories} trajectories of up to"
          f" {per_trajectory} tokens may not fit batch.rows={rows} × batch.tokens_per_row={tokens};"
          " raise rows or tokens_per_row, or sample fewer groups per micro-batch")
    if self.rollouts.in_flight_updates:
      check_in_flight(self, max_generation_steps(task))

  def _completion_limit_source(self) -> str:
    """Where the completion limit comes from, in words."""
    if self.task.name == DATASET:
      given = self.task.max_completion_tokens
      return f"task.max_completion_tokens={given}" if given is not None else "the longest answer's tokens"
    return f"task.name={self.task.name}'s answer length"

  def micro_batches_per_call(self) -> int:
    """How many micro-batches the live sampler generates in one call (``rollouts.micro_batches_per_call``, with
    'batch' resolved to a sampled batch's)."""
    per_call = self.rollouts.micro_batches_per_call
    return self.rollouts.batch_steps * self.batch.micro_batches_per_step if per_call == "batch" else per_call

  def _check_sampler_calls(self) -> None:
    """A sampled batch must split into whole sampler calls."""
    per_batch = self.rollouts.batch_steps * self.batch.micro_batches_per_step
    per_call = self.micro_batches_per_call()
    if per_batch % per_call:
      raise RecipeError(f"rollouts.micro_batches_per_call={per_call} does not divide a sampled batch of {per_batch}"
                        f" micro-batches (rollouts.batch_steps={self.rollouts.batch_steps} ×"
                        f" batch.micro_batches_per_step={self.batch.micro_batches_per_step}); use a divisor of"
                        f" {per_batch}")

  def _refuse_live_only_keys(self) -> None:
    """Keys only the live loop reads, set for a run that samples nothing: it would ignore them silently."""
    given = [("task.name", self.task.name)] if self.task.name == DATASET else []
    for key in LIVE_ONLY_KEYS:
      section, leaf = key.split(".")
      value = getattr(getattr(self, section), leaf)
      if value != getattr(type(getattr(self, section))(), leaf):
        given.append((key, value))
    if given:
      key, value = given[0]
      raise RecipeError(f"{key}={value} is read by the live loop only, but rollouts.source={self.rollouts.source}"
                        " trains on rollouts it does not sample; set rollouts.source=sampler, or drop it")

  def _validate_distributed(self) -> None:
    d = self.distributed
    if self.rollouts.source == "sampler" and self.rollouts.placement == "split":
      raise RecipeError("rollouts.placement=split puts the sampler on local devices beside the trainer's, but with"
                        " distributed.* set the mesh takes every device of the job; use rollouts.placement=shared"
                        " or process (every process samples on its first device, or in a process of its own) or"
                        " drop distributed.*")
    if self.trainer.location != "local":
      raise RecipeError("trainer.location=remote drives one trainer process; several JAX processes train"
                        " in place (trainer.location=local), so drop one of the two")
    if self.engine.backend != "jax":
      raise RecipeError(f"engine.backend={self.engine.backend} runs on one process; several JAX processes need"
                        " engine.backend=jax")
    if d.launches_local and self.mesh.num_devices % d.num_processes:
      raise RecipeError(f"distributed.num_processes={d.num_processes} does not split the mesh's"
                        f" {self.mesh.num_devices} devices evenly; use a divisor of {self.mesh.num_devices}")

  def _validate_tunix_backend(self) -> None:
    if self.mesh.num_devices != 1:
      raise RecipeError(f"engine.backend=tunix_peft runs on one device; the mesh asks for {self.mesh.num_devices}")
    if self.checkpoint.every or self.checkpoint.scored_steps:
      raise RecipeError("engine.backend=tunix_peft does not write checkpoints; set checkpoint.every=0 and no"
                        " checkpoint.scored_steps, or use engine.backend=jax")


def validate(recipe: Recipe) -> None:
  """Raises RecipeError for out-of-range values and contradictory settings (``Recipe.validate``)."""
  recipe.validate()


def check_in_flight(recipe: Recipe, completion_limit_tokens: int) -> None:
  """``recipe``'s in-flight updates against the rest of it (``Recipe.validate``'s, for a live run; kept out of the
  class, which is long enough): they need a version newer than a batch's own to exist while it samples, a point
  inside a generation to take it at, and a sampler that can record what each token was sampled with (every
  placement takes them: the sampler's own process asks the loop for each chunk's weights).

  Raises:
    RecipeError: the first of these that fails, in one line naming the key, the value and the fix.
  """
  r = recipe.rollouts
  if r.max_staleness == 0:
    raise RecipeError("rollouts.in_flight_updates=true has nothing to take at rollouts.max_staleness=0: each"
                      " batch already samples with the newest weights there are (no update lands while it is"
                      " sampled); set rollouts.max_staleness >= 1, or drop rollouts.in_flight_updates")
  chunk = r.decode_chunk_tokens
  if chunk is not None and chunk >= completion_limit_tokens:
    raise RecipeError(f"rollouts.decode_chunk_tokens={chunk} leaves no point inside a generation for new weights"
                      f" to land at: the completion limit is {completion_limit_tokens} tokens"
                      f" ({recipe._completion_limit_source()}); use fewer than {completion_limit_tokens}, or unset it"
                      " for four chunks")
  if decode_chunks(chunk, completion_limit_tokens) < 2:
    raise RecipeError(f"rollouts.in_flight_updates=true needs a point inside a generation to take new weights"
                      f" at, but completions are {completion_limit_tokens} token long"
                      f" ({recipe._completion_limit_source()}): one chunk; drop rollouts.in_flight_updates, or"
                      " train on longer completions")
  if recipe.engine.router_replay:
    # The routing is recorded by one forward pass of the sampling weights over each finished sequence
    # (LiveSampler): a generation that switched weights has no one set of sampling weights to record it with.
    raise RecipeError("rollouts.in_flight_updates=true switches weights inside a generation, but"
                      " engine.router_replay=true records each sequence's experts with the one set of weights"
                      " that sampled it; drop one of the two")



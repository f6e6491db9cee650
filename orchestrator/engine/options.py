"""Engine options: the recipe's ``engine`` section and the engine's settings, one type (no JAX import).

``EngineOptions`` is both what ``build_engine(**options)`` takes and what a
recipe's ``engine:`` section holds, so a new engine setting is one field here
(plus its check in ``validate``). The batch shape, mesh and checkpoint
directory live in their own recipe sections and are passed to the engine apart.
"""

from __future__ import annotations

import dataclasses
import math

from orchestrator.data import packing
from orchestrator.models.families import FAMILIES
from orchestrator.models.presets import ModelPreset

#: Engine backends by recipe name (``engine.backend``): module and builder, imported on use.
BACKENDS: dict[str, str] = {
    "jax": "orchestrator.engine.engine:build_engine",
    "tunix_peft": "orchestrator.engine.tunix_adapter:build_tunix_engine",
}
#: The backends that write checkpoints (and so can stop cleanly and resume).
CHECKPOINTING_BACKENDS = ("jax",)


#: The compute dtypes ``engine.dtype`` may name (``orchestrator.engine.model`` maps them to JAX's).
COMPUTE_DTYPES = ("float32", "bfloat16")  # some families take fewer: families.Family.compute_dtypes

#: ``engine.lr_schedule``'s values (``orchestrator.engine.optimizer`` defines each).
LR_SCHEDULES = ("constant", "linear", "cosine")

#: ``engine.loss_aggregation``'s values (``orchestrator.engine.loss.policy_loss_sum`` defines each).
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")

#: ``engine.kl_estimator``'s values: the per-token KL estimators Tunix and verl name so
#: (``orchestrator.engine.loss.per_token_kl`` defines each).
KL_ESTIMATORS = ("k1", "k3")

#: ``engine.remat``'s values: what each decoder layer keeps for the backward pass (``orchestrator.engine.model``):
#: ``none`` everything, ``dots`` only its weight matmuls' outputs (the rest, attention's probabilities
#: included, is recomputed layer by layer), ``full`` only its input (the whole layer is recomputed).
REMAT_POLICIES = ("none", "dots", "full")

#: ``engine.attention``'s values: ``xla``, the family's attention as Tunix writes it (scores and probabilities
#: [rows, heads, T, T] per layer); ``splash``, Tunix's Pallas splash kernel (TPU only; families with
#: ``Family.flash_attention``), blockwise, holding no probability tensor.
ATTENTIONS = ("xla", "splash")

#: The most tokens ``engine.logprob_chunk_tokens`` may name (a chunk's [tokens, vocabulary] logits exist at once).
MAX_LOGPROB_CHUNK_TOKENS = 1 << 20

#: The largest finite float32: optimizer hyperparameters past it are inf on the devices.
FLOAT32_MAX = 3.4028234663852886e38


@dataclasses.dataclass
class EngineOptions:
  """Everything about the engine that is not the model's shape, the mesh or where checkpoints go.

  Attributes:
    backend: which engine runs the steps (see ``BACKENDS``): ``jax`` (this
      package's engine, stages its inputs) or ``tunix_peft`` (a stock Tunix
      ``PeftTrainer`` with staging added: dense models, one device, no checkpoints).
    learning_rate, weight_decay, max_grad_norm: AdamW with global-norm clipping.
    lr_schedule, warmup_steps, decay_steps: the learning rate per update (``LR_SCHEDULES``; see
      ``orchestrator.engine.optimizer``): a linear warm-up over ``warmup_steps`` updates, then constant, or
      decaying to 0 over ``decay_steps`` updates (linear or cosine; they need it).
    clip_eps_low, clip_eps_high: the ratio clipping range of the loss: [1 - low, 1 + high] (DAPO's ε_low, ε_high).
    kl_beta, kl_estimator: a KL penalty β · KL(policy ‖ reference) per completion token, the reference being
      the run's starting weights (a frozen copy, on the trainer's devices beside the weights: twice their
      memory); 0 builds no reference. The estimator is ``k1`` or ``k3`` (``KL_ESTIMATORS``).
    loss_aggregation: how token losses average into the step's loss (``LOSS_AGGREGATIONS``): per token, per
      sequence, or over a constant (Dr. GRPO); ``orchestrator.engine.loss.policy_loss_sum`` has the formulas.
    max_inflight: how many dispatched computations may be queued on the devices.
    seed: weight initialisation seed.
    ragged_buffer_factor: MoE expert capacity factor (see ``moe``); -1 routes
      fully dropless. No effect on a dense model.
    retry_when_tokens_dropped: a micro-batch whose experts dropped tokens is
      discarded and re-run with a program that drops nothing (dropless re-run).
    router_replay: rollout routing replay (MoE only): every trajectory carries the experts the sampler's MoE
      layers chose for each of its tokens, they travel in the micro-batch (``packing.ROUTING``), and the
      trainer's forward routes each token to them instead of its own top-k (``moe``).
    skip_nonfinite_updates: ``update()`` reads the gradient norm on the host and
      skips the optimizer step when it is not finite.
    dtype: the compute dtype of the forward and backward passes (``COMPUTE_DTYPES``);
      weights, gradients' accumulation and the optimizer state stay float32.
    remat: what the backward pass keeps of each decoder layer's forward (``REMAT_POLICIES``): ``none`` keeps
      every activation (fastest, most memory), ``dots`` keeps the weight matmuls' outputs and recomputes the
      rest (attention's [rows, heads, T, T] probabilities among it), ``full`` recomputes the whole layer from
      its input. An MoE layer recomputes its experts' computation but keeps its routing (the drop counts leave
      the layer).
    attention: how attention computes (``ATTENTIONS``): ``xla`` as the family's Tunix model writes it, or
      ``splash``, Tunix's Pallas splash kernel on a TPU (Qwen2 and Qwen3 families), blockwise over the packed
      rows' segments, holding no [rows, heads, T, T] probabilities.
    logprob_chunk_tokens: the tokens whose logits over the whole vocabulary exist at once: log-probs, entropy
      and the loss are computed over the micro-batch's tokens in chunks of this many, each chunk's logits
      recomputed in the backward pass, so no [tokens, vocabulary] array is ever whole (at 1,024 tokens and
      Qwen3's 151,936 ids a chunk's float32 logits take 0.6 GB, the whole of 32 × 1,024 tokens 20 GB).
    epochs: passes over each sampled batch of the live loop (GRPO's μ, Tunix's ``num_iterations``): a batch
      serves ``rollouts.batch_steps`` × ``epochs`` optimizer steps. The live source schedules them; the engine
      trains each step as any other.
  """

  backend: str = "jax"
  learning_rate: float = 1e-3
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  lr_schedule: str = "constant"
  warmup_steps: int = 0
  decay_steps: int | None = None
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.28
  loss_aggregation: str = "token_mean"
  kl_beta: float = 0.0
  kl_estimator: str = "k3"
  max_inflight: int = 2
  seed: int = 0
  ragged_buffer_factor: float = -1.0
  retry_when_tokens_dropped: bool = False
  router_replay: bool = False
  skip_nonfinite_updates: bool = False
  dtype: str = "float32"
  remat: str = "none"
  attention: str = "xla"
  logprob_chunk_tokens: int = 1024
  epochs: int = 1

  def validate(self, preset: ModelPreset | None = None) -> None:
    """Raises ValueError naming the ``engine.*`` key, its value and the fix."""
    if self.backend not in BACKENDS:
      raise ValueError(f"engine.backend={self.backend!r} is not a backend; use one of {sorted(BACKENDS)}")
    for key in ("learning_rate", "max_grad_norm"):
      value = getattr(self, key)
      if not (math.isfinite(value) and value > 0):
        raise ValueError(f"engine.{key}={value} is out of range: it must be a finite number > 0")
      if value > FLOAT32_MAX:  # the optimizer holds it as a float32: it would be inf there
        raise ValueError(f"engine.{key}={value} is out of range: it must be <= {FLOAT32_MAX:.4g} (the largest"
                         " float32, which the optimizer computes in)")
    for key in ("weight_decay", "clip_eps_low", "clip_eps_high", "kl_beta"):
      value = getattr(self, key)
      if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"engine.{key}={value} is out of range: it must be a finite number >= 0")
    if self.clip_eps_low >= 1:  # the ratio's lower bound 1 - low must stay above 0 for [low, high] to bracket 1
      raise ValueError(f"engine.clip_eps_low={self.clip_eps_low} is out of range: the clip range"
                       f" [1 - clip_eps_low, 1 + clip_eps_high] = [{1 - self.clip_eps_low:g},"
                       f" {1 + self.clip_eps_high:g}] must bracket 1 with a lower bound above 0; use a value in [0, 1)")
    self._validate_schedule()
    if self.kl_estimator not in KL_ESTIMATORS:
      raise ValueError(f"engine.kl_estimator={self.kl_estimator!r} is not an estimator; use one of"
                       f" {', '.join(KL_ESTIMATORS)}")
    if self.loss_aggregation not in LOSS_AGGREGATIONS:
      raise ValueError(f"engine.loss_aggregation={self.loss_aggregation!r} is not an aggregation; use one of"
                       f" {', '.join(LOSS_AGGREGATIONS)}")
    if self.dtype not in COMPUTE_DTYPES:
      raise ValueError(f"engine.dtype={self.dtype!r} is not a compute dtype; use one of {', '.join(COMPUTE_DTYPES)}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"engine.remat={self.remat!r} is not a remat policy; use one of {', '.join(REMAT_POLICIES)}"
                       " (none: keep every activation, dots: keep the matmuls' outputs, full: recompute each layer)")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"engine.attention={self.attention!r} is not an attention; use one of {', '.join(ATTENTIONS)}")
    chunk = self.logprob_chunk_tokens
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= MAX_LOGPROB_CHUNK_TOKENS:
      raise ValueError(f"engine.logprob_chunk_tokens={chunk!r} is out of range: it must be a whole number in"
                       f" [1, {MAX_LOGPROB_CHUNK_TOKENS}], the tokens whose logits over the vocabulary exist at once"
                       " (e.g. 1024)")
    if not 1 <= self.max_inflight <= 1024:
      raise ValueError(f"engine.max_inflight={self.max_inflight} is out of range: it must be in [1, 1024]")
    if not 1 <= self.epochs <= 1024:
      raise ValueError(f"engine.epochs={self.epochs} is out of range: it must be in [1, 1024]")
    if preset is not None:
      self._validate_for(preset)
    factor = float(self.ragged_buffer_factor)
    if factor != -1.0 and not (math.isfinite(factor) and factor > 0):
      raise ValueError(
          f"engine.ragged_buffer_factor={self.ragged_buffer_factor} is out of range: use -1 (fully"
          " dropless) or a capacity factor > 0"
      )
    if self.retry_when_tokens_dropped and factor == -1.0:
      raise ValueError(
          "engine.retry_when_tokens_dropped=true with engine.ragged_buffer_factor=-1 (fully"
          " dropless) has nothing to re-run; set a capacity factor > 0 or turn the retry off"
      )

  def _validate_schedule(self) -> None:
    if self.lr_schedule not in LR_SCHEDULES:
      raise ValueError(f"engine.lr_schedule={self.lr_schedule!r} is not a schedule; use one of"
                       f" {', '.join(LR_SCHEDULES)}")
    # The schedule's values are tabled once per engine (optimizer.LearningRates): a million updates is 8 MB.
    if not 0 <= self.warmup_steps <= 10**6:
      raise ValueError(f"engine.warmup_steps={self.warmup_steps} is out of range: it must be in [0, 10**6]")
    if self.lr_schedule == "constant":
      if self.decay_steps is not None:
        raise ValueError(f"engine.decay_steps={self.decay_steps} is for a decaying schedule, but"
                         " engine.lr_schedule=constant; set engine.lr_schedule=linear or cosine, or drop it")
    elif self.decay_steps is None:
      raise ValueError(f"engine.lr_schedule={self.lr_schedule} needs engine.decay_steps: the updates over which"
                       " the rate decays to 0 after the warm-up (a recipe run by run_rl derives the run's steps"
                       " after the warm-up)")
    elif not 1 <= self.decay_steps <= 10**6:
      raise ValueError(f"engine.decay_steps={self.decay_steps} is out of range: it must be in [1, 10**6]")

  def _validate_for(self, preset: ModelPreset) -> None:
    if self.retry_when_tokens_dropped and not preset.is_moe:
      raise ValueError(
          f"engine.retry_when_tokens_dropped=true needs an MoE model, but {preset.name!r} is"
          " dense; pick an MoE preset (e.g. tiny_moe) or turn the retry off"
      )
    if self.router_replay and not preset.is_moe:
      raise ValueError(f"engine.router_replay=true replays the experts an MoE model's sampler chose, but"
                       f" {preset.name!r} is dense (it has no experts to route to); pick an MoE model or turn"
                       " the replay off")
    if self.backend == "tunix_peft" and preset.is_moe:
      raise ValueError(
          f"engine.backend=tunix_peft trains dense models only, but {preset.name!r} is MoE;"
          " use engine.backend=jax or a dense preset"
      )
    family = FAMILIES[preset.family]
    if self.attention == "splash" and not family.flash_attention:
      raise ValueError(f"engine.attention=splash: {preset.name} is a {family.name} model, whose Tunix model has no"
                       " splash attention (the qwen2 and qwen3 families do); set engine.attention=xla")
    if self.dtype not in family.compute_dtypes:
      raise ValueError(f"engine.dtype={self.dtype}: {preset.name} is a {family.name} model, and Tunix's"
                       f" {family.model_class} computes in {' or '.join(family.compute_dtypes)} only; set"
                       f" engine.dtype={family.compute_dtypes[0]}")

  def routing_shape(self, preset: ModelPreset) -> packing.RoutingShape | None:
    """What each token's replayed routing holds (None: no replay)."""
    if not self.router_replay:
      return None
    return packing.RoutingShape(layers=preset.num_layers, top_k=preset.num_experts_per_tok,
                                num_experts=preset.num_experts)

  @property
  def capacity_factor(self) -> float | None:
    return None if float(self.ragged_buffer_factor) == -1.0 else float(self.ragged_buffer_factor)

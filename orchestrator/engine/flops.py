"""Model FLOPs of a training step and the peak a chip computes at: model FLOP utilisation (MFU).

MFU is the share of the devices' peak that the model's own arithmetic would
take at the measured step time: 6 FLOPs per trained parameter and position (2
forward, 4 backward; an MoE counts its router and the experts each token is routed
to), plus attention's score and value products, 12 · layers · T · heads · head_dim
per position (the full T × T square the dense attention computes). Every position of
a micro-batch's rows counts, its padding included (the shape the devices compute, as
MaxText counts a packed row): a micro-batch filled to 85 % reads 1/0.85 above its
real tokens' share. Recomputation (``engine.remat``) and dropless re-runs are not
model FLOPs: they lower MFU, as they should. No JAX here: the peak is looked up by
the device's kind.
"""

from __future__ import annotations

from orchestrator.models.presets import ModelPreset

#: bf16 dense peak FLOP/s of one device, by ``jax.Device.device_kind`` (published figures; the MXU's bf16 rate
#: is what a bf16 step can reach, and what a float32 step is measured against too).
PEAK_FLOPS_PER_S = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5": 459e12,  # v5p
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
}


def matmul_params_per_token(preset: ModelPreset) -> int:
  """The weights each token is multiplied by in a forward pass: attention's projections, the MLP's (an MoE's
  router and its ``num_experts_per_tok`` experts), the head; not the embedding lookup."""
  d, heads, kv, hd = preset.embed_dim, preset.num_heads, preset.num_kv_heads, preset.head_dim
  attention = d * heads * hd * 2 + d * kv * hd * 2
  mlp = 3 * d * preset.hidden_dim
  if preset.is_moe:
    mlp = d * preset.num_experts + preset.num_experts_per_tok * mlp
  return preset.num_layers * (attention + mlp) + d * preset.vocab_size


def step_model_flops(preset: ModelPreset, *, rows: int, tokens_per_row: int, micro_batches: int) -> float:
  """A step's model FLOPs, forward and backward, over ``micro_batches`` micro-batches of rows × tokens."""
  tokens = rows * tokens_per_row * micro_batches
  attention = 12 * preset.num_layers * tokens_per_row * preset.num_heads * preset.head_dim
  return float(tokens * (6 * matmul_params_per_token(preset) + attention))


def peak_flops_per_s(device_kinds: list[str]) -> float | None:
  """The devices' summed peak FLOP/s (None where a kind is not in ``PEAK_FLOPS_PER_S``: a CPU)."""
  peaks = [PEAK_FLOPS_PER_S.get(kind) for kind in device_kinds]
  return None if not peaks or None in peaks else float(sum(peaks))

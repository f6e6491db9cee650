"""Gemma 3 checkpoints (``gemma3_text``): Tunix's Gemma3 loaded from Hugging Face names computes what Hugging
Face's Gemma 3 computes, samples through its cache what a full forward predicts, and exports back.

The reference forward is written here in float64 numpy from Hugging Face's
definition, from the safetensors and ``config.json`` alone: the embedding
scaled by the square root of its width, four norms a layer that multiply by
one plus their weight, query and key norms, every sixth layer global and the
rest within a sliding window, each kind with its own rotary base (the global
one scaled linearly), the query scaled by ``query_pre_attn_scalar``, a tanh
GELU, and tied embeddings. Seeded random weights (norms included) in two
layouts: grouped key/value heads, and as many key/value heads as query heads
(which Tunix stores as one fused projection).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from orchestrator.engine import model as model_lib
from orchestrator.models import hf_checkpoint
from orchestrator.models.presets import load_preset
from orchestrator.tasks.hf_tokenizer import HFTokenizer, char_tokenizer_json
from orchestrator.live.sampler import LiveSampler
from orchestrator.tasks.tokenizer import sampled_token_ids
from tests.checkpoint_files import write_safetensors

#: float32 through 7 layers against float64: measured max |difference| about 1e-5 on logits up to about 10.
LOGIT_TOLERANCE = 1e-3
LENGTH = 14  # tokens per test sequence: more than the sliding window, so the window masks

#: Two layouts: grouped key/value heads with Gemma 3 1B's settings, and one key/value head per query head with
#: a linear rotary scaling and the query scaled by the width per head (which differs from head_dim here).
LAYOUTS = {
    "grouped": dict(num_kv_heads=2, sliding_window=5, query_pre_attn_scalar=None, global_rope_scale=1.0),
    "fused": dict(num_kv_heads=4, head_dim=8, sliding_window=4, query_pre_attn_scalar=16, global_rope_scale=8.0),
}


def gemma3_preset(**changes):
  """The tiny preset as a 7-layer Gemma 3 (layer 5 global, the others sliding)."""
  return dataclasses.replace(load_preset("tiny"), family="gemma3", num_layers=7, use_tied_embedding=True,
                             local_rope_theta=10_000.0, **changes)


def write_gemma3(directory, preset, seed: int = 0):
  """A Gemma 3 checkpoint of ``preset``'s sizes with seeded normal weights (norm weights too)."""
  rng = np.random.default_rng(seed)
  directory.mkdir(parents=True)
  tensors = {name: (rng.standard_normal(shape) * (0.3 if "norm" in name else 0.1)).astype(np.float32)
             for name, shape in hf_checkpoint.expected_tensors(preset).items()}
  write_safetensors(directory / "model.safetensors", tensors)
  (directory / "config.json").write_text(json.dumps(hf_checkpoint.export_config(preset)))
  char_tokenizer_json(directory)
  return directory


def reference_logits(directory, ids: list[int]) -> np.ndarray:
  """Hugging Face's Gemma 3 text forward in float64 numpy, from the safetensors and config.json alone."""
  config = json.loads((directory / "config.json").read_text())
  w = {name: value.astype(np.float64) for name, value in load_file(str(directory / "model.safetensors")).items()}
  heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
  eps, length, window = config["rms_norm_eps"], len(ids), config["sliding_window"]
  factor = (config.get("rope_scaling") or {}).get("factor", 1.0)

  def rms_norm(x, weight):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + weight)

  def rotation(base, scale):
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim) / scale
    angles = np.arange(length)[:, None] * inv_freq[None]
    return np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))

  rotations = {"full_attention": rotation(config["rope_theta"], factor),
               "sliding_attention": rotation(config["rope_local_base_freq"], 1.0)}
  query, key = np.arange(length)[:, None], np.arange(length)[None, :]
  masks = {"full_attention": key <= query, "sliding_attention": (key <= query) & (query - key < window)}

  def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

  x = w["model.embed_tokens.weight"][ids] * np.sqrt(config["hidden_size"])
  for layer, kind in enumerate(config["layer_types"]):
    p = f"model.layers.{layer}."
    cos, sin = rotations[kind]

    def rotate(t):  # (heads, length, head_dim)
      half = head_dim // 2
      return t * cos + np.concatenate([-t[..., half:], t[..., :half]], -1) * sin

    def project(name, n):
      out = (h @ w[p + f"self_attn.{name}_proj.weight"].T).reshape(length, n, head_dim).transpose(1, 0, 2)
      return rms_norm(out, w[p + f"self_attn.{name}_norm.weight"]) if name in ("q", "k") else out

    h = rms_norm(x, w[p + "input_layernorm.weight"])
    q, k, v = rotate(project("q", heads)), rotate(project("k", kv_heads)), project("v", kv_heads)
    k, v = np.repeat(k, heads // kv_heads, axis=0), np.repeat(v, heads // kv_heads, axis=0)
    scores = np.where(masks[kind], q @ k.transpose(0, 2, 1) * config["query_pre_attn_scalar"] ** -0.5, -np.inf)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    attended = (scores / scores.sum(-1, keepdims=True)) @ v
    out = attended.transpose(1, 0, 2).reshape(length, heads * head_dim) @ w[p + "self_attn.o_proj.weight"].T
    x = x + rms_norm(out, w[p + "post_attention_layernorm.weight"])
    h = rms_norm(x, w[p + "pre_feedforward_layernorm.weight"])
    gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
    x = x + rms_norm((gelu_tanh(gate) * up) @ w[p + "mlp.down_proj.weight"].T,
                     w[p + "post_feedforward_layernorm.weight"])
  return rms_norm(x, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T


def engine_logits(preset, ids: list[int]) -> np.ndarray:
  graphdefs, params, _ = model_lib.build_model(preset, seed=0)
  tokens = jnp.asarray([ids], jnp.int32)
  mask = jnp.tril(jnp.ones((len(ids), len(ids)), bool))[None]
  logits, _ = nnx.merge(graphdefs["dropless"], params)(tokens, jnp.arange(len(ids))[None], None, mask)
  return np.asarray(logits[0], np.float64)


@pytest.mark.engine
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_engine_s_logits_equal_hugging_face_s_gemma3_forward(tmp_path, layout):
  """Negative controls: the same weights with the window as wide as the sequence, and (fused layout) with the
  query scaled by the other size Tunix offers, each move the logits far past the tolerance."""
  directory = write_gemma3(tmp_path / layout, gemma3_preset(**LAYOUTS[layout]))
  preset = hf_checkpoint.load_preset_from_checkpoint(directory)
  ids = [int(i) for i in np.random.default_rng(1).integers(0, preset.vocab_size, LENGTH)]
  reference = reference_logits(directory, ids)
  difference = np.max(np.abs(engine_logits(preset, ids) - reference))
  print(f"{layout}: max |engine - reference| = {difference:.2e} (logits up to {np.max(np.abs(reference)):.1f})")
  assert difference < LOGIT_TOLERANCE
  wide = dataclasses.replace(preset, sliding_window=LENGTH)
  assert np.max(np.abs(engine_logits(wide, ids) - reference)) > 100 * LOGIT_TOLERANCE
  if layout == "fused":  # scaled by head_dim (8) instead of the width per head (16)
    other_scale = dataclasses.replace(preset, query_pre_attn_scalar=preset.head_dim)
    assert np.max(np.abs(engine_logits(other_scale, ids) - reference)) > 100 * LOGIT_TOLERANCE


@pytest.mark.engine
def test_sampling_through_the_cache_gives_the_full_forward_s_log_probs(tmp_path):
  """Tunix's sampler decodes through its cache with the sliding window's decode mask; each sampled token's
  log-prob must be the full forward's over the prompt and the tokens before it. (With the pad id sampleable,
  this seed samples it as the second token, and Tunix hides it from every later token as padding.)"""
  directory = write_gemma3(tmp_path / "g", gemma3_preset(**LAYOUTS["grouped"]))
  preset = hf_checkpoint.load_preset_from_checkpoint(directory)
  tokenizer = HFTokenizer(directory)
  sampler = LiveSampler(preset, tokenizer, seed=0, max_prompt_length=8, max_generation_steps=8)
  samples = sampler.sample(["12+34=", "7+8="], seed=3)
  allowed = np.zeros(preset.vocab_size, bool)
  allowed[sampled_token_ids(tokenizer, None)] = True
  for prompt, completion, logprobs in zip(samples.prompt_ids, samples.completion_ids, samples.logprobs):
    ids = [int(i) for i in np.concatenate([prompt, completion])]
    assert len(ids) > preset.sliding_window  # the window masks while decoding
    logits = np.where(allowed, engine_logits(preset, ids), -np.inf)
    top = logits.max(-1, keepdims=True)
    full = logits - top - np.log(np.sum(np.exp(logits - top), -1, keepdims=True))
    expected = [full[len(prompt) - 1 + i, token] for i, token in enumerate(completion)]
    np.testing.assert_allclose(logprobs, expected, atol=1e-4)


@pytest.mark.engine
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_export_writes_back_the_tensors_a_checkpoint_was_loaded_from(tmp_path, layout):
  """Both of Tunix's attention layouts (query and joined key/value weights; one joined q/k/v weight when there
  are as many key/value heads as query heads) unjoin into Hugging Face's tensors, bit for bit."""
  directory = write_gemma3(tmp_path / layout, gemma3_preset(**LAYOUTS[layout]))
  preset = hf_checkpoint.load_preset_from_checkpoint(directory)
  _, params, _ = model_lib.build_model(preset, seed=0)
  layer = params["layers"][0]["attn"]
  assert ("qkv_einsum" in layer) == (layout == "fused")
  written = load_file(str(directory / "model.safetensors"))
  exported = hf_checkpoint.export_tensors(jax.device_get(params), preset)
  assert set(exported) == set(written)
  for name, value in written.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=name)

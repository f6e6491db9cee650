"""Sliding-window settings (Gemma 3's ``config.json``): read into the preset, refused by name where Tunix's Gemma3
runs something else, written back as they were read. Without JAX."""

from __future__ import annotations

import dataclasses

import pytest

from orchestrator.models import hf_checkpoint, local_global
from orchestrator.models.presets import CONFIGS_ENV, DEFAULT_CONFIGS_DIR, load_preset

SIZES = {"num_layers": 7, "head_dim": 16, "embed_dim": 64, "num_heads": 4}


def gemma3_config(**changes):
  preset = dataclasses.replace(load_preset("tiny_gemma3"), num_layers=7, sliding_window=5)
  return dict(hf_checkpoint.export_config(preset), **changes)


@pytest.mark.spec
def test_the_settings_read_back_as_written():
  preset = dataclasses.replace(load_preset("tiny_gemma3"), global_rope_scale=8.0, local_rope_theta=5_000.0)
  config = hf_checkpoint.export_config(preset)
  assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
  read = local_global.settings_from_config(config, dataclasses.asdict(preset), "here")
  assert read == local_global.settings(preset) == {"sliding_window": 8, "local_rope_theta": 5_000.0,
                                                   "global_rope_scale": 8.0, "query_pre_attn_scalar": 16}
  assert local_global.layer_types(7) == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
  # transformers' defaults where config.json gives none
  bare = {k: v for k, v in config.items() if k not in ("sliding_window", "rope_local_base_freq", "rope_scaling",
                                                        "layer_types", "query_pre_attn_scalar")}
  assert local_global.settings_from_config(bare, dict(SIZES, head_dim=256), "here") == {
      "sliding_window": 4096, "local_rope_theta": 10_000.0, "global_rope_scale": 1.0, "query_pre_attn_scalar": 256}


@pytest.mark.spec
@pytest.mark.parametrize("change, words", [
    ({"layer_types": ["full_attention"] * 7}, "layer_types gives layer 0 full_attention where Tunix's Gemma3 runs"
                                              " sliding_attention"),
    ({"layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
     "layer_types gives 6 entries for num_hidden_layers=7 layers"),
    ({"layer_types": "sliding"}, "layer_types='sliding' must be a list"),
    ({"sliding_window_pattern": 4}, "sliding_window_pattern=4"),
    ({"sliding_window": 0}, "sliding_window=0 must be a whole number"),
    ({"sliding_window": 4.5}, "sliding_window=4.5 must be a whole number"),
    ({"query_pre_attn_scalar": 100}, "query_pre_attn_scalar=100; Tunix's Gemma3 scales queries by the head size"),
    ({"query_pre_attn_scalar": ...}, "query_pre_attn_scalar=256 (transformers' default: config.json gives none)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8}}, "rope_scaling={'rope_type': 'yarn', 'factor': 8}"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, "use {\"rope_type\": \"linear\""),
    ({"rope_local_base_freq": -1}, "rope_local_base_freq=-1 must be a finite number > 0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 8.0, "partial_rotary_factor": 0.5}},
     "'partial_rotary_factor': 0.5}; Tunix's Gemma3 scales"),
    ({"query_pre_attn_scalar": [16]}, "query_pre_attn_scalar=[16]; Tunix's Gemma3 scales queries"),
    ({"rope_scaling": {"rope_type": "linear", "factor": float("inf")}}, "rope_scaling={'rope_type': 'linear',"
                                                                        " 'factor': inf}"),
])
def test_settings_tunix_does_not_run_are_refused_by_name(change, words):
  config = {key: value for key, value in gemma3_config(**change).items() if value is not ...}
  with pytest.raises(ValueError) as e:
    local_global.settings_from_config(config, SIZES, "here")
  assert str(e.value).startswith("here: ") and words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.spec
@pytest.mark.parametrize("line, words", [
    ("use_tied_embedding: false", "use_tied_embedding=False, but Tunix's Gemma3 runs use_tied_embedding=True"),
    ("norm_eps: 1.0e-5", "norm_eps=1e-05, but Tunix's Gemma3 runs norm_eps=1e-06"),
    ("global_rope_scale: 0.5", "global_rope_scale=0.5 must be >= 1"),
    ("sliding_window: 0", "sliding_window=0 must be a whole number of tokens >= 1"),
    ("global_rope_scale: .inf", "global_rope_scale=inf must be a finite number"),
    ("norm_eps: one", "norm_eps='one' must be a finite number"),
])
def test_a_gemma3_preset_file_with_a_setting_tunix_does_not_run_is_refused(tmp_path, monkeypatch, line, words):
  """A preset file is checked as a checkpoint's config.json is: Tunix's Gemma3 would ignore these silently."""
  (tmp_path / "model").mkdir()
  base = (DEFAULT_CONFIGS_DIR / "model" / "tiny_gemma3.yaml").read_text()
  key = line.split(":")[0]
  kept = [kept for kept in base.splitlines() if not kept.startswith(f"{key}:")]
  (tmp_path / "model" / "bad.yaml").write_text("\n".join([*kept, line]) + "\n")
  monkeypatch.setenv(CONFIGS_ENV, str(tmp_path))
  with pytest.raises(ValueError) as e:
    load_preset("bad")
  assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.spec
def test_a_preset_s_number_yaml_reads_as_a_string_is_a_number(tmp_path, monkeypatch):
  """YAML reads ``1e-6`` (no dot) as a string: a preset saying norm_eps: 1e-6 means the number."""
  (tmp_path / "model").mkdir()
  base = (DEFAULT_CONFIGS_DIR / "model" / "tiny_gemma3.yaml").read_text()
  (tmp_path / "model" / "eps.yaml").write_text(base.replace("norm_eps: 1.0e-6", "norm_eps: 1e-6"))
  monkeypatch.setenv(CONFIGS_ENV, str(tmp_path))
  assert load_preset("eps").norm_eps == 1e-6


@pytest.mark.spec
def test_a_gemma3_config_without_head_dim_takes_transformers_default(tmp_path):
  """transformers' Gemma3TextConfig defaults head_dim to 256 and Qwen3Config to 128; Qwen2's, Llama's and Qwen3
  MoE's derive it as hidden_size / num_attention_heads."""
  def without_head_dim(config):
    return {key: value for key, value in config.items() if key != "head_dim"}

  assert hf_checkpoint.preset_from_config(tmp_path, without_head_dim(gemma3_config())).head_dim == 256
  for preset, family, head_dim in (("tiny", "qwen3", 128), ("tiny", "qwen2", 16), ("tiny", "llama", 16),
                                   ("tiny_moe", "qwen3", 16)):
    config = without_head_dim(hf_checkpoint.export_config(dataclasses.replace(load_preset(preset), family=family)))
    assert hf_checkpoint.preset_from_config(tmp_path, config).head_dim == head_dim, (preset, family)

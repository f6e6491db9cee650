"""Rotary settings saved by transformers 5 (``rope_parameters``) read as the older keys, so a base or scaling
given only there is never skipped; both forms given must agree. Without JAX."""

from __future__ import annotations

import dataclasses
import json

import pytest

from orchestrator.models import hf_checkpoint, rope_parameters
from orchestrator.models.presets import load_preset
from tests.checkpoint_files import write_directory

GEMMA3_V5 = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 500_000.0},
             "sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0}}


def _without(config, *names):
  return {key: value for key, value in config.items() if key not in names}


@pytest.mark.spec
def test_a_gemma3_config_of_transformers_5_gives_the_preset_its_older_form_gives(tmp_path):
  """Negative control: the same config read with ``rope_parameters`` ignored (as it was) loses the scaling and
  both bases."""
  older = dataclasses.replace(load_preset("tiny_gemma3"), global_rope_scale=8.0, rope_theta=500_000.0,
                              local_rope_theta=20_000.0)
  old_config = hf_checkpoint.export_config(older)
  new_config = dict(_without(old_config, "rope_theta", "rope_scaling", "rope_local_base_freq"),
                    rope_parameters=GEMMA3_V5)
  presets = {}
  for form, config in (("older", old_config), ("newer", new_config)):
    directory = write_directory(tmp_path / form, preset_name="tiny_gemma3")
    (directory / "config.json").write_text(json.dumps(config))
    presets[form] = hf_checkpoint.load_preset_from_checkpoint(directory)
  assert dataclasses.replace(presets["newer"], checkpoint=None, name="x") == dataclasses.replace(
      presets["older"], checkpoint=None, name="x")
  assert (presets["newer"].global_rope_scale, presets["newer"].rope_theta, presets["newer"].local_rope_theta) == (
      8.0, 500_000.0, 20_000.0)
  ignored = hf_checkpoint.preset_from_config(tmp_path, dict(_without(new_config, "rope_parameters")))
  assert (ignored.global_rope_scale, ignored.rope_theta, ignored.local_rope_theta) == (1.0, 1_000_000.0, 10_000.0)
  # Export writes the older keys only, which read back to the same preset.
  written = hf_checkpoint.export_config(presets["newer"], base=new_config)
  assert "rope_parameters" not in written and written["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}


@pytest.mark.spec
def test_a_qwen3_config_of_transformers_5_is_read_with_its_base(tmp_path):
  """Its base was read as transformers' default (10,000) and the checkpoint refused as another base than 1e6."""
  directory = write_directory(tmp_path / "q", rope_theta=..., rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 1_000_000.0})
  assert hf_checkpoint.load_preset_from_checkpoint(directory).rope_theta == 1_000_000.0
  scaled = write_directory(tmp_path / "s", rope_theta=..., rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                            "rope_theta": 1_000_000.0})
  with pytest.raises(hf_checkpoint.CheckpointDirError, match=r"rope_scaling=\{'rope_type': 'yarn', 'factor': 4.0\}"):
    hf_checkpoint.load_preset_from_checkpoint(scaled)


@pytest.mark.spec
@pytest.mark.parametrize("config, words", [
    ({"rope_theta": 10_000.0, "rope_parameters": {"rope_theta": 1_000_000.0}},
     "rope_theta=10000.0 but rope_parameters.rope_theta gives 1000000.0; the two forms must agree"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": {"rope_type": "linear", "factor": 4.0}},
     "rope_scaling={'type': 'linear', 'factor': 2.0} but rope_parameters gives"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "scales the sliding-window layers' rotary positions"),
    ({"rope_parameters": {"full_attention": {}, "rope_theta": 1.0}}, "mixes per-layer-kind entries with others"),
    ({"rope_parameters": [1]}, "rope_parameters=[1] must be an object"),
    ({"rope_parameters": {"full_attention": 3}}, "rope_parameters.full_attention=3 must be an object"),
])
def test_rope_parameters_that_cannot_be_read_or_disagree_are_refused(config, words):
  with pytest.raises(ValueError) as e:
    rope_parameters.as_legacy_keys(config, "here")
  assert str(e.value).startswith("here: ") and words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.spec
def test_agreeing_forms_and_configs_without_it_read_as_they_are():
  assert rope_parameters.as_legacy_keys({"rope_theta": 5.0}, "here") == {"rope_theta": 5.0}
  # transformers 5 copies a partial_rotary_factor into the parameters; 1 rotates the whole head, as here
  neutral = {"rope_parameters": {"rope_type": "default", "rope_theta": 5.0, "partial_rotary_factor": 1.0}}
  assert rope_parameters.as_legacy_keys(neutral, "here") == {"rope_theta": 5.0, "rope_scaling": None}
  half = {"rope_parameters": {"rope_type": "default", "rope_theta": 5.0, "partial_rotary_factor": 0.5}}
  assert rope_parameters.as_legacy_keys(half, "here")["rope_scaling"] == {"rope_type": "default",
                                                                          "partial_rotary_factor": 0.5}
  both = {"rope_theta": 5.0, "rope_scaling": {"type": "linear", "factor": 2.0},
          "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5.0}}
  assert rope_parameters.as_legacy_keys(both, "here") == {"rope_theta": 5.0,
                                                          "rope_scaling": {"rope_type": "linear", "factor": 2.0}}

"""Hugging Face checkpoint directories for tests, written without JAX: safetensors files by hand (any dtype
per tensor, in any order, or damaged on purpose) and a tiny preset's shapes filled with seeded values."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from orchestrator.models import hf_checkpoint
from orchestrator.models.presets import load_preset
from orchestrator.tasks.hf_tokenizer import char_tokenizer_json

#: safetensors' name of each numpy dtype the tests write.
DTYPE_NAMES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float16): "F16",
               np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
  """``tensors`` as one safetensors file, in the order given, each in its own array's dtype."""
  header, offset = {}, 0
  for name, array in tensors.items():
    size = array.nbytes
    header[name] = {"dtype": DTYPE_NAMES[array.dtype], "shape": list(array.shape),
                    "data_offsets": [offset, offset + size]}
    offset += size
  raw = json.dumps(header).encode()
  path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(np.ascontiguousarray(a).tobytes()
                                                                   for a in tensors.values()))


def preset_tensors(preset_name: str = "tiny", seed: int = 0) -> dict[str, np.ndarray]:
  """Every tensor of the preset's Hugging Face checkpoint, float32, seeded normal values."""
  rng = np.random.default_rng(seed)
  return {name: (rng.standard_normal(shape) * 0.1).astype(np.float32)
          for name, shape in hf_checkpoint.expected_tensors(load_preset(preset_name)).items()}


def write_directory(directory: Path, tensors: dict[str, np.ndarray] | None = None, *, preset_name: str = "tiny",
                    **config_changes) -> Path:
  """A checkpoint directory of the preset's sizes (``config.json`` changed by ``config_changes``; a key
  given as ``...`` is left out), its tensors in ``model.safetensors``, with the character tokenizer."""
  directory.mkdir(parents=True, exist_ok=True)
  config = dict(hf_checkpoint.export_config(load_preset(preset_name)), **config_changes)
  config = {key: value for key, value in config.items() if value is not ...}
  (directory / hf_checkpoint.CONFIG_FILE).write_text(json.dumps(config))
  write_safetensors(directory / "model.safetensors", preset_tensors(preset_name) if tensors is None else tensors)
  char_tokenizer_json(directory)
  return directory

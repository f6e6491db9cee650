"""Hugging Face checkpoints: read through Tunix's loader, trained on by run_rl, written back by run_rl export.

The checkpoint the tests load is the tiny preset's own initial weights written
in Hugging Face layout with the character tokenizer as ``tokenizer.json``: a run
on it must be bit-identical to the preset's run, which pins the tensor mapping,
the tokenizer and the sampler's stop (an off-by-one transpose, a missing bos or
a wrong eos changes the digest).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tunix.models.qwen3 import params as qwen3_params

from orchestrator import recipe as recipe_lib
from orchestrator.app import cli
from orchestrator.engine import model as model_lib
from orchestrator.models import hf_checkpoint
from orchestrator.engine.diagnostics import tree_digest
from orchestrator.models.presets import load_preset
from orchestrator.tasks.hf_tokenizer import HFTokenizer, TokenizerError, char_tokenizer_json
from orchestrator.tasks.tokenizer import CharTokenizer
from orchestrator.live.sampler import LiveSampler
from tests.checkpoint_files import preset_tensors, write_directory, write_safetensors

#: A short live run of the tiny preset (the default recipe's task, small sizes), its sampler in this process:
#: where the sampler runs is not what these runs test (tests/live/test_sampler_process.py pins that its own process
#: samples the same), and a process of its own would start JAX again for every run.
LIVE = ["steps=2", "rollouts.groups_per_micro_batch=2", "batch.rows=4", "task.eval_prompts=4",
        "checkpoint.every=2", "run.reserve_host_core=false", "rollouts.placement=shared"]


def write_checkpoint(directory, preset_name: str, *, seed: int = 0, tokenizer: bool = True,
                     family: str | None = None):
  """The preset's initial weights (seed ``seed``) as a Hugging Face checkpoint in ``directory``, of the preset's
  family or of ``family`` (a Gemma 3 is the ``tiny_gemma3`` preset: its settings are the family's own)."""
  if family == "gemma3" and not preset_name.endswith("_gemma3"):
    preset_name = f"{preset_name}_gemma3"
  preset = load_preset(preset_name)
  preset = dataclasses.replace(preset, family=family) if family else preset
  _, params, _ = model_lib.build_model(preset, seed)
  directory.mkdir(parents=True, exist_ok=True)
  save_file(hf_checkpoint.export_tensors(jax.device_get(params), preset), str(directory / "model.safetensors"))
  (directory / "config.json").write_text(json.dumps(hf_checkpoint.export_config(preset)))
  if tokenizer:
    char_tokenizer_json(directory)
  return params


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
  directory = tmp_path_factory.mktemp("hf") / "tiny"
  write_checkpoint(directory, "tiny")
  return directory


@pytest.fixture(autouse=True)
def _no_switches(monkeypatch):
  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)


def _summary(run):
  return json.loads((run / "summary.json").read_text())


@pytest.mark.engine
@pytest.mark.parametrize("preset_name", ["tiny", "tiny_moe", "tiny_gemma3"])
def test_a_checkpoint_loads_to_the_weights_it_was_written_from(tmp_path, preset_name):
  params = write_checkpoint(tmp_path, preset_name, seed=3, tokenizer=False)
  loaded = hf_checkpoint.load_preset_from_checkpoint(tmp_path)
  assert hf_checkpoint.disagreement(load_preset(preset_name), loaded) is None
  _, again, _ = model_lib.build_model(loaded, seed=0)  # the seed is not used: the weights are the file's
  assert tree_digest(again) == tree_digest(params)


@pytest.mark.engine
def test_a_transposed_tensor_is_caught_by_its_shape_and_a_swapped_one_by_the_weights(tmp_path):
  """Negative controls: the mapping is checked, not assumed."""
  write_checkpoint(tmp_path, "tiny", tokenizer=False)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  name = "model.layers.0.self_attn.k_proj.weight"
  save_file(dict(tensors, **{name: np.ascontiguousarray(tensors[name].T)}), str(tmp_path / "model.safetensors"))
  with pytest.raises(hf_checkpoint.CheckpointDirError, match=rf"tensor {name} has shape \[64, 32\]"):
    hf_checkpoint.load_preset_from_checkpoint(tmp_path)
  up, gate = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"
  save_file(dict(tensors, **{up: tensors[gate], gate: tensors[up]}), str(tmp_path / "model.safetensors"))
  _, params, _ = model_lib.build_model(hf_checkpoint.load_preset_from_checkpoint(tmp_path), 0)
  _, original, _ = model_lib.build_model(load_preset("tiny"), 0)
  assert tree_digest(params) != tree_digest(original)


@pytest.mark.engine
def test_the_character_tokenizer_as_tokenizer_json_encodes_and_stops_alike(tiny_checkpoint):
  ours, theirs = CharTokenizer(), HFTokenizer(tiny_checkpoint)
  text = "1st:abcd> 3+4%7="
  assert theirs.encode(text) == ours.encode(text)
  assert (theirs.bos_id(), theirs.eos_id(), theirs.pad_id(), theirs.vocab_size) == (1, 2, 0, ours.vocab_size)
  ids = ours.encode("abc") + [2] + ours.encode("zz")
  assert theirs.decode(ids) == ours.decode(ids) == "abc"


@pytest.mark.engine
def test_a_chat_template_formats_the_prompt(tmp_path):
  char_tokenizer_json(tmp_path)
  settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
  settings["chat_template"] = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt %}>{% endif %}")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
  assert HFTokenizer(tmp_path, chat_template=True).format_prompt("1+2") == "user:1+2>"
  assert HFTokenizer(tmp_path).format_prompt("1+2") == "1+2"


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, tmp_path_factory):
  """A live run of 4 steps on the checkpoint (checkpoints after steps 2 and 4), and the preset's own run."""
  root = tmp_path_factory.mktemp("trained")
  with pytest.MonkeyPatch.context() as env:  # module scope: the autouse fixture does not cover it
    for name in recipe_lib.ENV_SWITCHES:
      env.delenv(name, raising=False)
    assert cli.main(LIVE + ["steps=4", "model=tiny", "--out", str(root / "preset")]) == 0
    assert cli.main(LIVE + ["steps=4", f"model.checkpoint={tiny_checkpoint}", "--out", str(root / "run")]) == 0
  return root


@pytest.mark.e2e
def test_a_live_run_on_the_checkpoint_is_the_preset_s_run_and_exports_back(trained, tiny_checkpoint, tmp_path,
                                                                          capsys):
  """Loading the preset's weights from a checkpoint trains bit for bit like the preset; the trained weights
  exported from the run's checkpoint load back to the same weights digest."""
  run = trained / "run"
  assert _summary(run)["final_state_digest"] == _summary(trained / "preset")["final_state_digest"]
  assert str(tiny_checkpoint) in json.loads((run / "config.json").read_text())["config"]["model"]["checkpoint"]
  capsys.readouterr()

  exported = tmp_path / "exported"
  assert cli.main(["export", str(run), "--out", str(exported)]) == 0
  said = capsys.readouterr()
  assert "weights digest" in said.out and "Metadata file does not exist" not in said.err  # orbax's, no news
  written = json.loads((exported / "export.json").read_text())
  assert written["step"] == 4 and written["checkpoint"].endswith("checkpoints/4")
  assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
      p.name for p in exported.iterdir()}
  _, params, _ = model_lib.build_model(hf_checkpoint.load_preset_from_checkpoint(exported), 0)
  assert tree_digest(params) == written["weights_digest"]
  _, initial, _ = model_lib.build_model(load_preset("tiny"), 0)
  assert written["weights_digest"] != tree_digest(initial)  # trained weights, not the start's
  # the run names the digest of the weights it loaded (the preset's, here), in config.json and its summary
  loaded = json.loads((run / "config.json").read_text())["loaded_weights"]
  assert loaded["weights_digest"] == tree_digest(initial) and str(tiny_checkpoint) in loaded["model.checkpoint"]
  assert _summary(run)["loaded_weights"] == loaded

  assert cli.main(["export", str(run), "--out", str(exported)]) == 2  # never into an existing directory
  assert "already exists" in capsys.readouterr().err


@pytest.mark.e2e
def test_export_passes_over_a_checkpoint_of_another_run(trained, tmp_path, capsys):
  run = tmp_path / "run"
  shutil.copytree(trained / "run", run)
  checkpoints = json.loads((run / "config.json").read_text())["config"]["checkpoint"]["directory"]
  assert checkpoints is None  # inside the run directory: the copy has its own
  metadata = run / "checkpoints" / "4" / "metadata" / "metadata"
  saved = json.loads(metadata.read_text())
  metadata.write_text(json.dumps(dict(saved, run_id="someone-else")))
  capsys.readouterr()
  assert cli.main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
  captured = capsys.readouterr()
  assert "passing over checkpoint(s) 4" in captured.err and "belongs to another run" in captured.err
  assert json.loads((tmp_path / "out" / "export.json").read_text())["step"] == 2
  assert cli.main(["export", str(run), "--checkpoint", "4", "--out", str(tmp_path / "again")]) == 2
  assert "belongs to another run" in capsys.readouterr().err and not (tmp_path / "again").exists()
  assert cli.main(["export", str(run), "--out", str(run / "exported")]) == 2  # the run's files are its own
  assert "is inside the run directory" in capsys.readouterr().err and not (run / "exported").exists()


@pytest.mark.engine
def test_refusals_of_checkpoint_directories(tiny_checkpoint, tmp_path):
  """Each bad directory is refused by validation, before anything is built, in one line naming the fix."""
  def refused(**changes):
    values = {"model.checkpoint": str(tiny_checkpoint), "rollouts.source": "sampler", **changes}
    recipe = recipe_lib.build({k: recipe_lib.coerce(k, v) for k, v in values.items()})
    with pytest.raises(recipe_lib.RecipeError) as e:
      recipe.validate()
    assert "\n" not in str(e.value)
    return str(e.value)

  assert "no such directory" in refused(**{"model.checkpoint": str(tmp_path / "missing")})
  assert "has no config.json" in refused(**{"model.checkpoint": str(tmp_path)})
  real_lstat = hf_checkpoint.os.lstat

  def lstat_denied(path, *args, **kwargs):  # a directory this user may not look into (mode 000, as non-root)
    if str(path).startswith(str(tmp_path / "locked")):
      raise PermissionError(13, "Permission denied", str(path))
    return real_lstat(path, *args, **kwargs)

  (tmp_path / "locked").mkdir()
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(hf_checkpoint.os, "lstat", lstat_denied)
    assert refused(**{"model.checkpoint": str(tmp_path / "locked")}).endswith(
        "locked cannot be read (Permission denied); give a directory you can read")
  gpt2 = tmp_path / "gpt2"
  shutil.copytree(tiny_checkpoint, gpt2)
  (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "hidden_size": 64}))
  assert "names model_type='gpt2'; this trainer runs the model types qwen3" in refused(
      **{"model.checkpoint": str(gpt2)})
  message = refused(**{"model.preset": "small"})
  assert "model.preset=small and model.checkpoint=" in message and "disagree" in message
  no_tokenizer = tmp_path / "no_tokenizer"
  shutil.copytree(tiny_checkpoint, no_tokenizer)
  (no_tokenizer / "tokenizer.json").unlink()
  assert "has no tokenizer.json" in refused(**{"model.checkpoint": str(no_tokenizer)})
  wide = tmp_path / "wide"
  shutil.copytree(tiny_checkpoint, wide)
  char_tokenizer_json(wide, alphabet="".join(chr(0x4E00 + i) for i in range(600)))
  assert "more than the model's vocabulary of 512" in refused(**{"model.checkpoint": str(wide)})
  torn = tmp_path / "torn"
  shutil.copytree(tiny_checkpoint, torn)
  tensors = load_file(str(torn / "model.safetensors"))
  del tensors["model.layers.1.mlp.down_proj.weight"]
  save_file(tensors, str(torn / "model.safetensors"))
  assert "1 of the model's 25 tensors are missing" in refused(**{"model.checkpoint": str(torn)})
  assert "needs model.checkpoint" in refused(**{"model.checkpoint": None, "model.chat_template": True})


@pytest.mark.e2e
def test_a_dataset_on_the_checkpoint_samples_free_text_that_ends_at_its_eos_in_bfloat16(tiny_checkpoint, tmp_path):
  """With a checkpoint's tokenizer a dataset's completions are free text: any id the tokenizer has, up to
  task.max_completion_tokens, ending at the eos; bfloat16 compute trains (finite losses)."""
  run = tmp_path / "run"
  assert cli.main(["--recipe", "recipes/dataset_example.yaml", f"model.checkpoint={tiny_checkpoint}", "steps=2",
                   "checkpoint.every=0", "task.max_completion_tokens=6", "engine.dtype=bfloat16",
                   "run.reserve_host_core=false", "--out", str(run)]) == 0
  records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
  assert len(records) == 2 and all(r["reward_mean"] is not None and np.isfinite(r["loss"]) for r in records)


@pytest.mark.e2e
def test_a_resume_refuses_a_prompt_file_or_tokenizer_that_changed(tiny_checkpoint, tmp_path, capsys):
  """config.json fingerprints the files a run reads; a resume that would read others is refused, and the
  restored file resumes."""
  prompts = tmp_path / "prompts.jsonl"
  shutil.copyfile("examples/prompts.jsonl", prompts)
  checkpoint = tmp_path / "model"
  shutil.copytree(tiny_checkpoint, checkpoint)
  run = tmp_path / "run"
  assert cli.main(["--recipe", "recipes/dataset_example.yaml", f"model.checkpoint={checkpoint}", f"task.path={prompts}",
                   "steps=2", "rollouts.groups_per_micro_batch=2", "batch.rows=4", "task.eval_prompts=4",
                   "checkpoint.every=1", "run.reserve_host_core=false", "--out", str(run)]) == 0
  saved = json.loads((run / "config.json").read_text())["inputs"]
  assert set(saved) == {"task.path", "model.checkpoint"} and "tokenizer.json" in saved["model.checkpoint"]["files"]
  original = prompts.read_text()
  prompts.write_text(original.replace('"answer": "0"', '"answer": "1"', 1))  # one answer edited
  capsys.readouterr()
  assert cli.main(["--resume", str(run), "--steps", "3"]) == 2
  assert f"task.path: {prompts} changed since the run started" in capsys.readouterr().err
  prompts.write_text(original)
  (checkpoint / "tokenizer_config.json").write_text((checkpoint / "tokenizer_config.json").read_text() + " ")
  assert cli.main(["--resume", str(run), "--steps", "3"]) == 2
  assert "model.checkpoint" in capsys.readouterr().err
  shutil.copyfile(tiny_checkpoint / "tokenizer_config.json", checkpoint / "tokenizer_config.json")
  assert cli.main(["--resume", str(run), "--steps", "3"]) == 0


# ---------------------------------------------------------------- what a checkpoint holds is what loads, or nothing
def _weights_digest(directory) -> str:
  _, params, _ = model_lib.build_model(hf_checkpoint.load_preset_from_checkpoint(directory), 0)
  return tree_digest(params)


@pytest.mark.engine
@pytest.mark.parametrize("first", [np.float16, np.float32])
def test_every_tensor_is_read_as_its_own_header_s_dtype(tmp_path, first):
  """A file whose first tensor is F16 or F32 and the rest BF16 loads each tensor's own values: the weights of
  the file holding their float32 upcasts. Negative control: Tunix's loader, which maps a whole file as its
  first tensor's dtype, reads BF16 1.0 as F16 1.875 (or fails on F32 first)."""
  tensors = dict(preset_tensors(), **{"model.norm.weight": np.ones(64, np.float32)})
  mixed = {name: x.astype(first if i == 0 else ml_dtypes.bfloat16) for i, (name, x) in enumerate(tensors.items())}
  write_directory(tmp_path / "mixed", mixed)
  write_directory(tmp_path / "upcast", {name: x.astype(np.float32) for name, x in mixed.items()})
  assert _weights_digest(tmp_path / "mixed") == _weights_digest(tmp_path / "upcast")
  config = model_lib.model_config(hf_checkpoint.load_preset_from_checkpoint(tmp_path / "mixed"))
  if first is np.float16:
    tunix = qwen3_params.create_model_from_safe_tensors(str(tmp_path / "mixed"), config)
    assert np.all(np.asarray(tunix.final_norm.w[...]) == 1.875)
  else:
    with pytest.raises(Exception):
      qwen3_params.create_model_from_safe_tensors(str(tmp_path / "mixed"), config)


def _sharded(directory, index_edit=None):
  """The tiny checkpoint in two shards with their index (edited by ``index_edit(weight_map)``)."""
  tensors = preset_tensors()
  write_directory(directory, {}).joinpath("model.safetensors").unlink()
  names = list(tensors)
  weight_map = {}
  for i, part in enumerate((names[:10], names[10:])):
    file = f"model-0000{i + 1}-of-00002.safetensors"
    write_safetensors(directory / file, {name: tensors[name] for name in part})
    weight_map.update(dict.fromkeys(part, file))
  if index_edit:
    index_edit(weight_map)
  (directory / hf_checkpoint.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.engine
def test_a_sharded_checkpoint_with_its_index_loads_the_same_weights(tmp_path):
  """The control for the refusals below: shards and an index that agree load like one file."""
  _sharded(tmp_path / "sharded")
  write_directory(tmp_path / "one")
  assert _weights_digest(tmp_path / "sharded") == _weights_digest(tmp_path / "one")


def _tensors_with(**changes):
  """The tiny checkpoint's tensors with some replaced (names given with "__" for ".")."""
  return dict(preset_tensors(), **{name.replace("__", "."): x for name, x in changes.items()})


def _fifo(directory, name):
  write_directory(directory)
  (directory / name).unlink(missing_ok=True)
  os.mkfifo(directory / name)


def _raw_safetensors(header: bytes, data_bytes: int) -> bytes:
  return len(header).to_bytes(8, "little") + header + bytes(data_bytes)


UP = "model.layers.0.mlp.up_proj.weight"
with_nan = preset_tensors()[UP].copy()
with_nan[3, 5] = np.nan
#: (id, how the directory is written, the refusal's words): each one edit of the tiny checkpoint.
CHECKPOINT_REFUSALS = [
    ("third-layer", lambda d: write_directory(d, dict(preset_tensors(), **{
        n.replace("layers.1.", "layers.2."): x for n, x in preset_tensors().items() if "layers.1." in n})),
     "11 tensor(s) in its *.safetensors are not the model's (model.layers.2.self_attn.q_proj.weight,"),
    ("one-unused-tensor", lambda d: write_directory(d, _tensors_with(rotary__inv_freq=np.ones(8, np.float32))),
     "1 tensor(s) in its *.safetensors are not the model's (rotary.inv_freq, in model.safetensors)"),
    ("in-two-files", lambda d: (write_directory(d), write_safetensors(
        d / "extra.safetensors", {"model.norm.weight": preset_tensors()["model.norm.weight"]})),
     "tensor model.norm.weight is in both extra.safetensors and model.safetensors"),
    ("index-elsewhere", lambda d: _sharded(d, lambda m: m.update({"model.norm.weight": "model-00002-of-00002"
                                                                                     ".safetensors"})),
     "tensor model.norm.weight is in model-00001-of-00002.safetensors but model.safetensors.index.json places it"),
    ("index-shard-missing", lambda d: _sharded(d, lambda m: m.update({"lm_head.bias": "model-00003.safetensors"})),
     "places 1 tensor(s) in files that do not hold them (first: lm_head.bias in model-00003.safetensors)"),
    ("fp8", lambda d: write_directory(d, _tensors_with(**{UP.replace(".", "__"): preset_tensors()[UP].astype(
        ml_dtypes.float8_e4m3fn)})), f"tensor {UP} in"),
    ("nan", lambda d: write_directory(d, _tensors_with(**{UP.replace(".", "__"): with_nan})),
     f"tensor {UP} in"),
    ("inf-bf16", lambda d: write_directory(d, {n: (np.full_like(x, np.inf) if n == UP else x).astype(
        ml_dtypes.bfloat16) for n, x in preset_tensors().items()}), f"holds 8,192 NaN or infinite value(s) of 8,192"),
    ("kv-heads", lambda d: write_directory(d, num_key_value_heads=3),
     "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ("layers-a-string", lambda d: write_directory(d, num_hidden_layers="2"), "num_hidden_layers='2' must be"),
    ("vocab-missing", lambda d: write_directory(d, vocab_size=...), "vocab_size=None must be a whole number"),
    ("hidden-zero", lambda d: write_directory(d, hidden_size=0), "hidden_size=0 must be a whole number in [1,"),
    ("head-dim-odd", lambda d: write_directory(d, head_dim=15), "head_dim=15 is odd"),
    ("hidden-not-whole-heads", lambda d: write_directory(d, model_type="llama", head_dim=..., hidden_size=66),
     "hidden_size=66 is not a multiple of num_attention_heads=4 and no head_dim is given"),  # Qwen3's defaults to 128
    ("context-zero", lambda d: write_directory(d, max_position_embeddings=0), "max_position_embeddings=0 must be"),
    ("context-float", lambda d: write_directory(d, max_position_embeddings=4096.0),
     "max_position_embeddings=4096.0 must be"),
    ("more-experts-per-token", lambda d: write_directory(d, preset_name="tiny_moe", num_experts_per_tok=99),
     "num_experts_per_tok=99 is more than num_experts="),
    ("fifo-weights", lambda d: _fifo(d, "model.safetensors"), "is a FIFO (named pipe)"),
    ("fifo-config", lambda d: _fifo(d, "config.json"), "config.json"),
    ("fifo-index", lambda d: _fifo(d, hf_checkpoint.INDEX_FILE), "is a FIFO (named pipe)"),
    ("truncated", lambda d: (write_directory(d), (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:-100])), "past the file's"),
    ("header-length-past-the-end", lambda d: (write_directory(d), (d / "model.safetensors").write_bytes(
        (10**9).to_bytes(8, "little") + b"{}")), "its header claims 1,000,000,000 bytes but 2 follow"),
    ("name-twice-in-a-header", lambda d: (write_directory(d), (d / "model.safetensors").write_bytes(
        _raw_safetensors(b'{"model.norm.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
                         b' "model.norm.weight": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', 8))),
     "names tensor model.norm.weight twice"),
    ("overlapping-tensors", lambda d: (write_directory(d), (d / "model.safetensors").write_bytes(
        _raw_safetensors(b'{"model.norm.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},'
                         b' "lm_head.weight": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', 8))),
     "tensors model.norm.weight and lm_head.weight overlap"),
    ("size-not-the-shape-s", lambda d: (write_directory(d), (d / "model.safetensors").write_bytes(
        _raw_safetensors(b'{"model.norm.weight": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 8]}}', 8))),
     "tensor model.norm.weight, BF16 of shape [2], is 4 bytes but its header gives it 8"),
]


@pytest.mark.engine
@pytest.mark.parametrize("case", CHECKPOINT_REFUSALS, ids=[c[0] for c in CHECKPOINT_REFUSALS])
def test_a_checkpoint_that_would_load_other_weights_is_refused_naming_what(case, tmp_path):
  """Each directory is one edit of one that loads (the control: ``write_directory`` alone, checked here
  too), refused in one line by the check pass, before anything is built."""
  _, write, words = case
  write_directory(tmp_path / "good")
  hf_checkpoint.load_preset_from_checkpoint(tmp_path / "good")
  write(tmp_path / "bad")
  with pytest.raises(hf_checkpoint.CheckpointDirError) as e:
    hf_checkpoint.load_preset_from_checkpoint(tmp_path / "bad")
  assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.engine
def test_fifo_and_nan_refusals_name_the_file_and_the_dtype(tmp_path):
  """Words the table's fragments leave out: the FIFO's role, an FP8 tensor's dtype, a NaN's count."""
  _fifo(tmp_path / "fifo", "config.json")
  with pytest.raises(hf_checkpoint.CheckpointDirError, match=r"model.checkpoint's config.json .* is a FIFO"):
    hf_checkpoint.load_preset_from_checkpoint(tmp_path / "fifo")
  write_directory(tmp_path / "fp8", _tensors_with(**{UP.replace(".", "__"): preset_tensors()[UP].astype(
      ml_dtypes.float8_e4m3fn)}))
  with pytest.raises(hf_checkpoint.CheckpointDirError, match="is F8_E4M3; the loader reads F32, BF16, F16"):
    hf_checkpoint.load_preset_from_checkpoint(tmp_path / "fp8")
  write_directory(tmp_path / "nan", _tensors_with(**{UP.replace(".", "__"): with_nan}))
  with pytest.raises(hf_checkpoint.CheckpointDirError, match=r"holds 1 NaN or infinite value\(s\) of 8,192"):
    hf_checkpoint.load_preset_from_checkpoint(tmp_path / "nan")


def _with_template(directory, template: str, *, file: str | None = None):
  """The character tokenizer in ``directory`` with ``template`` as its chat template (in
  tokenizer_config.json, or in ``file``)."""
  char_tokenizer_json(directory)
  if file:
    (directory / file).write_text(template)
    return directory
  settings = json.loads((directory / "tokenizer_config.json").read_text())
  (directory / "tokenizer_config.json").write_text(json.dumps(dict(settings, chat_template=template)))
  return directory


#: (id, template, file it is in (None: tokenizer_config.json), the refusal's words).
TEMPLATE_REFUSALS = [
    ("raise-exception", "{{ raise_exception('only user and assistant roles') }}", None,
     "fails on a prompt (TemplateError: only user and assistant roles)"),
    ("undefined-function", "{{ render_tools(messages) }}", None,
     "fails on a prompt (UndefinedError: 'render_tools' is undefined)"),
    ("syntax-error", "{% for m in messages %}{{ m.content }}", None, "does not parse (Unexpected end of template."),
    ("unencodable-character", "[{{ messages[0].content }}]", None,
     "writes the character '[', which tokenizer.json's vocabulary cannot encode"),
    ("jinja-file-raises", "{{ raise_exception('no system prompt') }}", "chat_template.jinja",
     "chat_template.jinja fails on a prompt (TemplateError: no system prompt)"),
]


@pytest.mark.engine
@pytest.mark.parametrize("case", TEMPLATE_REFUSALS, ids=[c[0] for c in TEMPLATE_REFUSALS])
def test_a_chat_template_that_fails_is_refused_when_the_tokenizer_is_made(case, tmp_path):
  """One probe prompt is rendered and its template text encoded up front. Control: the same directory
  without model.chat_template makes a tokenizer (the template is not read)."""
  _, template, file, words = case
  directory = _with_template(tmp_path, template, file=file)
  HFTokenizer(directory)
  with pytest.raises(TokenizerError) as e:
    HFTokenizer(directory, chat_template=True)
  message = str(e.value)
  assert words in message and "\n" not in message
  assert str(directory / (file or "tokenizer_config.json")) in message


@pytest.mark.engine
@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json",
                                  "chat_template.jinja"])
def test_a_tokenizer_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path, name):
  """Control: the regular files make a tokenizer with its chat template."""
  _with_template(tmp_path, "{{ messages[0].content }}", file="chat_template.jinja")
  HFTokenizer(tmp_path, chat_template=True)
  (tmp_path / name).unlink(missing_ok=True)
  os.mkfifo(tmp_path / name)
  with pytest.raises(TokenizerError, match=rf"model.checkpoint's .*{name} is a FIFO \(named pipe\)"):
    HFTokenizer(tmp_path, chat_template=True)


def _validate(checkpoint, *overrides: str) -> None:
  values = dict(item.split("=", 1) for item in (f"model.checkpoint={checkpoint}", *overrides))
  recipe_lib.build({k: recipe_lib.coerce(k, v) for k, v in values.items()}).validate()


@pytest.mark.engine
def test_a_trajectory_longer_than_the_model_s_context_is_refused(tmp_path):
  """The live loop's prompt + completion, or another source's row, against config.json's
  max_position_embeddings. Controls: a context that holds them validates."""
  write_directory(tmp_path / "long", max_position_embeddings=64)
  _validate(tmp_path / "long", "rollouts.source=sampler", "rollouts.groups_per_micro_batch=2")
  _validate(tmp_path / "long", "batch.tokens_per_row=64")
  write_directory(tmp_path / "short", max_position_embeddings=8)
  with pytest.raises(recipe_lib.RecipeError, match=r"task.max_prompt_tokens \+ task.max_completion_tokens = \d+ \+"
                     r" \d+ = \d+ tokens is longer than the model's context of 8 .*lower task.max_prompt_tokens"):
    _validate(tmp_path / "short", "rollouts.source=sampler", "rollouts.groups_per_micro_batch=2")
  with pytest.raises(recipe_lib.RecipeError, match="batch.tokens_per_row=64 is longer than the model's context of 8"
                                                   " tokens .* lower batch.tokens_per_row to at most 8"):
    _validate(tmp_path / "short", "batch.tokens_per_row=64")


@pytest.mark.engine
@pytest.mark.parametrize("file, content, words", [
    ("generation_config.json", {"eos_token_id": "2"}, "generation_config.json's eos_token_id '2' is not one of"),
    ("config.json", {"eos_token_id": [2, 9999]}, "config.json's eos_token_id 9999 is not one of the tokenizer's"),
    ("tokenizer_config.json", [], "tokenizer_config.json holds a JSON list, not an object"),
])
def test_tokenizer_settings_that_would_be_skipped_are_refused(tmp_path, file, content, words):
  """An eos id the sampler could not stop at, or a settings file that is not an object, was passed over.
  Control: ids that are token ids, or null (none), make a tokenizer that stops at them."""
  char_tokenizer_json(tmp_path)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
  assert HFTokenizer(tmp_path).eos_ids == [2, 5]
  (tmp_path / file).write_text(json.dumps(content))
  with pytest.raises(TokenizerError) as e:
    HFTokenizer(tmp_path)
  assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_a_checkpoint_of_another_family_trains_exports_and_loads_back(tmp_path, family):
  """Each family's tiny checkpoint: a live run trains it, export writes the family's Hugging Face names back,
  and the export loads to the digest export.json names."""
  checkpoint = tmp_path / family
  write_checkpoint(checkpoint, "tiny", family=family)
  run, exported = tmp_path / "run", tmp_path / "exported"
  assert cli.main(LIVE + [f"model.checkpoint={checkpoint}", "--out", str(run)]) == 0
  assert cli.main(["export", str(run), "--out", str(exported)]) == 0
  config = json.loads((exported / "config.json").read_text())
  assert config["model_type"] == {"gemma3": "gemma3_text"}.get(family, family) and "rope_theta" in config
  loaded = hf_checkpoint.load_preset_from_checkpoint(exported)
  _, params, _ = model_lib.build_model(loaded, 0)
  assert loaded.family == family
  assert tree_digest(params) == json.loads((exported / "export.json").read_text())["weights_digest"]
  names = set(load_file(str(exported / "model.safetensors")))
  assert ("model.layers.0.self_attn.q_proj.bias" in names) == (family == "qwen2")
  assert any("q_norm" in name for name in names) == (family == "gemma3")
  assert ("model.layers.0.pre_feedforward_layernorm.weight" in names) == (family == "gemma3")
  if family == "gemma3":
    assert config["sliding_window"] == 8 and config["layer_types"][5] == "full_attention"


@pytest.mark.engine
def test_the_sampler_on_a_checkpoint_compiles_prefill_and_decode_once(tiny_checkpoint):
  """A checkpoint's weights arrive committed to a device and a weight sync's do not; jit keys on that, so
  without the sampler placing its first version as it places every later one, the first sync compiled prefill
  and decode again (a 9–14 s stall at step 1 on a 135M model)."""
  compiled: list[str] = []

  def count(event, _secs, **fields):
    if event == "/jax/core/compile/backend_compile_duration":
      compiled.append(str(fields.get("fun_name")))

  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    preset = hf_checkpoint.load_preset_from_checkpoint(tiny_checkpoint)
    sampler = LiveSampler(preset, HFTokenizer(tiny_checkpoint), seed=0, max_prompt_length=16,
                          max_generation_steps=4, alphabet="abcdefgh")
    sampler.sample(["1st:dahb>"] * 4, seed=1)
    assert any("_prefill_fn" in name for name in compiled) and any("_decode_fn" in name for name in compiled)
    _, trained, _ = model_lib.build_model(preset, seed=0)
    before = len(compiled)
    for version in (1, 2):
      sampler.sync(trained, version)
      sampler.sample(["1st:dahb>"] * 4, seed=1 + version)
    assert not [name for name in compiled[before:] if "_prefill_fn" in name or "_decode_fn" in name]
  finally:
    jax.monitoring.unregister_event_duration_listener(count)

"""``run_rl import-gguf``: a GGUF file of each family imports to the weights it was written from, its
tokenizer rebuilt; bad files and outputs are refused in one line with nothing written."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time

import gguf
import jax
import numpy as np
import pytest
import safetensors
import safetensors.numpy

import orchestrator.models
from orchestrator.app import cli
from orchestrator.engine import model as model_lib
from orchestrator.models import hf_checkpoint
from orchestrator.engine.diagnostics import tree_digest
from orchestrator.models.presets import load_preset
from orchestrator.tasks.hf_tokenizer import HFTokenizer
from tests.gguf_files import _vocab, write_gguf

pytestmark = pytest.mark.engine


def _family_weights(family: str, seed: int = 0):
  """A tiny model of ``family`` (its vocabulary the test GGUF's), its params and its Hugging Face tensors."""
  preset = dataclasses.replace(load_preset("tiny"), family=family, vocab_size=len(_vocab()),
                               rope_theta=1_000_000 if family == "qwen3" else 10_000.0, use_tied_embedding=True)
  _, params, _ = model_lib.build_model(preset, seed)
  params = jax.device_get(params)
  return preset, params, hf_checkpoint.export_tensors(params, preset), hf_checkpoint.export_config(preset)


def _import(tmp_path, gguf_file, capsys, out_name="imported"):
  out = tmp_path / out_name
  code = cli.main(["import-gguf", str(gguf_file), "--out", str(out)])
  captured = capsys.readouterr()
  return code, out, captured


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_gguf_of_each_family_imports_to_the_weights_it_was_written_from(tmp_path, capsys, family):
  preset, params, tensors, config = _family_weights(family)
  source = write_gguf(tmp_path / "model.gguf", tensors, config, architecture=family, permute=family == "llama")
  code, out, captured = _import(tmp_path, source, capsys)
  assert code == 0, captured.err
  assert f"a {family} model, 2 layers" in captured.out
  loaded = hf_checkpoint.load_preset_from_checkpoint(out)
  assert loaded.family == family and hf_checkpoint.disagreement(preset, loaded) is None
  _, again, _ = model_lib.build_model(loaded, seed=1)  # the seed is not used: the weights are the file's
  assert tree_digest(again) == tree_digest(params)
  written = json.loads((out / "config.json").read_text())
  assert written["rope_theta"] == config["rope_theta"] and written["tie_word_embeddings"] is True
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial sibling left


def test_the_query_and_key_rows_are_put_back_in_hugging_face_s_order(tmp_path, capsys):
  """Negative control: a Llama file written without llama.cpp's permutation imports to other weights, so the
  import's inverse permutation is what makes the round trip exact."""
  _, params, tensors, config = _family_weights("llama")
  source = write_gguf(tmp_path / "unpermuted.gguf", tensors, config, permute=False)
  code, out, _ = _import(tmp_path, source, capsys)
  assert code == 0
  _, again, _ = model_lib.build_model(hf_checkpoint.load_preset_from_checkpoint(out), seed=0)
  assert tree_digest(again) != tree_digest(params)
  assert np.array_equal(again["layers"][0]["attn"]["v_proj"]["w"], params["layers"][0]["attn"]["v_proj"]["w"])


def test_the_tokenizer_is_rebuilt_with_its_merges_special_tokens_and_chat_template(tmp_path, capsys):
  _, _, tensors, config = _family_weights("llama")
  code, out, _ = _import(tmp_path, write_gguf(tmp_path / "m.gguf", tensors, config), capsys)
  assert code == 0
  vocab = _vocab()
  tokenizer = HFTokenizer(out, chat_template=True)
  assert tokenizer.encode(" the thin") == [vocab.index("Ġthe"), vocab.index("Ġt"), vocab.index("h"),
                                           vocab.index("in")]
  assert tokenizer.encode("42") == [vocab.index("4"), vocab.index("2")]  # digits one by one (smollm)
  assert tokenizer.decode(tokenizer.encode("Hello, the world!")) == "Hello, the world!"
  assert tokenizer.bos_id() is None and tokenizer.eos_ids == [2]  # add_bos_token false in the file
  assert tokenizer.format_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  assert tokenizer.encode("<|im_start|>")[0] == 1


def test_a_quantised_gguf_imports_dequantized(tmp_path, capsys):
  preset, params, tensors, config = _family_weights("llama")
  source = write_gguf(tmp_path / "q8.gguf", tensors, config, quantization=gguf.GGMLQuantizationType.Q8_0)
  code, out, _ = _import(tmp_path, source, capsys)
  assert code == 0
  _, again, _ = model_lib.build_model(hf_checkpoint.load_preset_from_checkpoint(out), seed=0)
  original = params["layers"][0]["mlp"]["up_proj"]["kernel"]
  imported = again["layers"][0]["mlp"]["up_proj"]["kernel"]
  # Q8_0: a scale per 32 values, 8-bit steps of it
  assert 0 < np.max(np.abs(np.asarray(imported) - original)) <= np.max(np.abs(original)) / 127


def _refused(tmp_path, capsys, source, out_name="out"):
  existed = (tmp_path / out_name).exists()
  code, out, captured = _import(tmp_path, source, capsys, out_name)
  assert code == 2 and captured.out == ""
  line = captured.err.strip()
  assert "\n" not in line and "Traceback" not in line and line.startswith("run_rl import-gguf: error: ")
  assert out.exists() == existed and not (existed and any(out.iterdir()))
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
  return line


def test_bad_files_and_outputs_are_refused_in_one_line_with_nothing_written(tmp_path, capsys):
  _, _, tensors, config = _family_weights("llama")
  good = write_gguf(tmp_path / "good.gguf", tensors, config)
  assert "no such file" in _refused(tmp_path, capsys, tmp_path / "missing.gguf")
  fifo = tmp_path / "pipe.gguf"
  os.mkfifo(fifo)  # never opened: a read would block until a writer came
  assert f"{fifo} is a FIFO (named pipe), not a file" in _refused(tmp_path, capsys, fifo)
  fifo.unlink()
  (tmp_path / "dir.gguf").mkdir()
  assert "dir.gguf is a directory, not a file" in _refused(tmp_path, capsys, tmp_path / "dir.gguf")
  (tmp_path / "dir.gguf").rmdir()
  text = tmp_path / "notes.txt"
  text.write_text("not a model")
  assert "is not a GGUF file" in _refused(tmp_path, capsys, text)
  truncated = tmp_path / "truncated.gguf"
  truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
  assert "truncated or damaged" in _refused(tmp_path, capsys, truncated)
  other = write_gguf(tmp_path / "gpt2.gguf", tensors, config, architecture="gpt2")
  assert "general.architecture='gpt2'" in _refused(tmp_path, capsys, other)
  gemma = write_gguf(tmp_path / "gemma3.gguf", tensors, config, architecture="gemma3")
  assert "train its Hugging Face directory with model.checkpoint=DIR" in _refused(tmp_path, capsys, gemma)
  (tmp_path / "taken").mkdir()
  assert "already exists" in _refused(tmp_path, capsys, good, out_name="taken")


@pytest.mark.parametrize("failure", [
    safetensors.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"),
    OSError(28, "No space left on device"),
], ids=["safetensors", "os"])
def test_a_write_that_fails_is_refused_in_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, failure):
  """A full disk while the weights are written: safetensors reports it as its own error, not an OSError."""
  _, _, tensors, config = _family_weights("llama")
  good = write_gguf(tmp_path / "good.gguf", tensors, config)

  def full_disk(*args, **kwargs):
    raise failure

  monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
  line = _refused(tmp_path, capsys, good)
  assert "writing" in line and "failed" in line and "nothing is at --out" in line


def test_missing_parents_of_out_are_made_and_removed_again_when_the_write_fails(tmp_path, capsys, monkeypatch):
  """As the README runs it on a fresh clone: `--out models/NAME` where models/ does not exist yet."""
  _, _, tensors, config = _family_weights("llama")
  good = write_gguf(tmp_path / "good.gguf", tensors, config)
  code, out, captured = _import(tmp_path, good, capsys, out_name="models/deeper/imported")
  assert code == 0, captured.err
  assert (out / "config.json").is_file()

  def full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
  line = _refused(tmp_path, capsys, good, out_name="made/for/it")
  assert "nothing is at --out" in line
  assert not (tmp_path / "made").exists()  # the parents it made are gone with the failed write
  (tmp_path / "file").write_text("not a directory")
  assert "is not a writable directory" in _refused(tmp_path, capsys, good, out_name="file/below/it")


def test_a_killed_import_s_partial_folder_is_removed_by_the_next_import_and_sigterm_removes_its_own(tmp_path, capsys,
                                                                                                    monkeypatch):
  _, _, tensors, config = _family_weights("llama")
  good = write_gguf(tmp_path / "good.gguf", tensors, config)
  killed = tmp_path / ".imported.0a1b2c3d.partial"  # what a SIGKILL mid-write leaves
  killed.mkdir()
  code, out, captured = _import(tmp_path, good, capsys)
  assert code == 0 and not killed.exists()
  assert f"removed {killed}, the partial folder of an import to {out} that was killed before it finished" in captured.err

  def terminated(*args, **kwargs):  # SIGTERM arrives while the weights are written
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1)

  monkeypatch.setattr(safetensors.numpy, "save_file", terminated)
  code, out, captured = _import(tmp_path, good, capsys, out_name="second")
  assert code == 143 and "stopped by SIGTERM; nothing is at --out" in captured.err
  assert not out.exists() and not list(tmp_path.glob(".second.*"))


def test_a_quantisation_gguf_cannot_dequantize_is_refused_naming_the_tensor(tmp_path, capsys):
  _, _, tensors, config = _family_weights("llama")
  source = write_gguf(tmp_path / "q.gguf", tensors, config)
  reader = gguf.GGUFReader(str(source))
  writer = gguf.GGUFWriter(str(tmp_path / "q81.gguf"), "llama")
  for field in reader.fields.values():
    if not field.name.startswith("GGUF.") and field.name != "general.architecture":
      writer.add_key_value(field.name, field.contents(), field.types[0],
                           sub_type=field.types[-1] if len(field.types) > 1 else None)
  q81 = gguf.GGMLQuantizationType.Q8_1
  block, size = gguf.GGML_QUANT_SIZES[q81]
  for tensor in reader.tensors:
    if tensor.name == "blk.0.ffn_up.weight":
      rows = int(tensor.shape[1])
      writer.add_tensor(tensor.name, np.zeros((rows, int(tensor.shape[0]) // block * size), np.uint8),
                        raw_dtype=q81)
    else:
      writer.add_tensor(tensor.name, np.asarray(tensor.data).reshape(tuple(int(n) for n in reversed(tensor.shape))))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  line = _refused(tmp_path, capsys, tmp_path / "q81.gguf")
  assert "blk.0.ffn_up.weight is Q8_1" in line and "cannot dequantize" in line


def test_without_the_gguf_package_the_command_says_how_to_install_it(tmp_path, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, "gguf", None)
  monkeypatch.delitem(sys.modules, "orchestrator.models.gguf_file", raising=False)
  monkeypatch.delattr(orchestrator.models, "gguf_file", raising=False)  # else the import finds it there
  line = _refused(tmp_path, capsys, tmp_path / "any.gguf")
  assert "pip install -e '.[gguf]'" in line

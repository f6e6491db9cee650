"""Recordings: round trip, deterministic replay across processes, read-only, and every bad-recording error."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from orchestrator.data.packing import RoutingShape, content_digest, pack_payload
from orchestrator.data.recording import (
    DATA_FILE, MANIFEST, RecordingError, decode_group, encode_group, open_recording, write_recording,
)
from orchestrator.data.replay import replay_steps
from orchestrator.data.synthetic import RolloutShape, generate_groups
from tests.conftest import REPO

SHAPE = RolloutShape(groups=24, generations_per_group=4, prompt_len_median=10, completion_len_median=8,
                     max_tokens=64, vocab_size=512, seed=3)
BATCH = dict(rows=4, tokens_per_row=64, micro_batches_per_step=2)


@pytest.fixture
def recording_dir(tmp_path):
  write_recording(tmp_path / "rec", generate_groups(SHAPE), vocab_size=512, produced_by={"test": True})
  return tmp_path / "rec"


@pytest.mark.engine
def test_group_encoding_round_trips():
  group = next(generate_groups(SHAPE))
  back = decode_group(encode_group(group))
  assert back.group_id == group.group_id and back.policy_version == group.policy_version
  np.testing.assert_array_equal(back.prompt_ids, group.prompt_ids)
  for a, b in zip(back.completions, group.completions):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(back.old_logprobs, group.old_logprobs):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(back.advantages, group.advantages)
  np.testing.assert_array_equal(back.rewards, group.rewards)


@pytest.mark.engine
def test_recording_round_trip_and_manifest(recording_dir):
  manifest = json.loads((recording_dir / MANIFEST).read_text())
  assert manifest["schema_version"] == 1 and manifest["num_groups"] == 24
  assert manifest["num_trajectories"] == 96 and manifest["generations_per_group"] == [4]
  assert len(manifest["record_digests"]) == 24 and manifest["produced_by"] == {"test": True}
  rec = open_recording(recording_dir, vocab_size=512)
  steps = replay_steps(rec, steps=2, **BATCH)
  originals = list(generate_groups(SHAPE))
  first = steps[0][0]
  np.testing.assert_array_equal(first[0].prompt_ids, originals[0].prompt_ids)
  np.testing.assert_array_equal(first[0].completion_ids, originals[0].completions[0])
  assert {t.group_id for t in first} <= {g.group_id for g in originals[:6]}
  for step in steps:
    for payload in step:  # whole groups, each micro-batch packs
      pack_payload(payload, rows=4, tokens_per_row=64, vocab_size=512)
      groups = [t.group_id for t in payload]
      assert all(groups.count(g) == 4 for g in set(groups))


ROUTING = RoutingShape(layers=3, top_k=2, num_experts=6)


@pytest.mark.engine
def test_routing_rides_in_the_recording_and_replays_with_each_trajectory(tmp_path):
  shape = dataclasses.replace(SHAPE, routing=ROUTING)
  manifest = write_recording(tmp_path / "rec", generate_groups(shape), vocab_size=512, produced_by={})
  assert manifest["routing"] == {"layers": 3, "top_k": 2}
  originals = list(generate_groups(shape))
  # routing is drawn after a group's other draws: the first group is the same as without it
  np.testing.assert_array_equal(originals[0].completions[-1], next(generate_groups(SHAPE)).completions[-1])
  rec = open_recording(tmp_path / "rec", vocab_size=512, routing=ROUTING)
  first = replay_steps(rec, steps=1, **BATCH)[0][0][0]
  np.testing.assert_array_equal(first.routing, originals[0].routing[0])
  assert first.routing.shape == (first.num_tokens, 3, 2) and first.routing.dtype == np.int16
  other = RoutingShape(layers=4, top_k=2, num_experts=6)
  with pytest.raises(RecordingError, match=re.escape("carries routing for {'layers': 3, 'top_k': 2} (layers,"
                                                     " experts per token), but the model has 4 MoE layers of top-2")):
    open_recording(tmp_path / "rec", vocab_size=512, routing=other)


@pytest.mark.engine
def test_replaying_routing_from_a_recording_without_it_is_refused(recording_dir):
  with pytest.raises(RecordingError, match="was recorded without routing, but engine.router_replay is on"):
    open_recording(recording_dir, vocab_size=512, routing=ROUTING)
  open_recording(recording_dir, vocab_size=512)  # without replay it is a good recording


@pytest.mark.engine
@pytest.mark.parametrize("corrupt, message", [
    (lambda r: r.__setitem__((2, 1, 0), 6), "routing holds expert id 6, outside the model's 6 experts [0, 6)"),
    (lambda r: r.__setitem__((2, 1, 1), r[2, 1, 0]), "routing gives one token the same expert twice in a layer"),
])
def test_routing_ids_the_model_cannot_take_are_refused_with_the_record(tmp_path, corrupt, message):
  groups = list(generate_groups(dataclasses.replace(SHAPE, groups=3, routing=ROUTING)))
  corrupt(groups[1].routing[2])
  write_recording(tmp_path / "rec", iter(groups), vocab_size=512, produced_by={})
  with pytest.raises(RecordingError, match=re.escape("record 1 (group 1) generation 2 ") + ".*" + re.escape(message)):
    open_recording(tmp_path / "rec", vocab_size=512, routing=ROUTING)


REPLAY_CHILD = """
import json, sys
from orchestrator.data.recording import open_recording
from orchestrator.data.packing import content_digest, pack_payload
from orchestrator.data.replay import replay_steps
rec = open_recording(sys.argv[1], vocab_size=512)
steps = replay_steps(rec, rows=4, tokens_per_row=64, micro_batches_per_step=2, steps=3)
print(json.dumps([[content_digest(pack_payload(p, rows=4, tokens_per_row=64, vocab_size=512)) for p in s] for s in steps]))
print("CHILD-OK")
"""


@pytest.mark.e2e
def test_replay_is_byte_for_byte_deterministic_across_processes(recording_dir):
  rec = open_recording(recording_dir, vocab_size=512)
  here = [[content_digest(pack_payload(p, rows=4, tokens_per_row=64, vocab_size=512)) for p in s]
          for s in replay_steps(rec, steps=3, **BATCH)]
  env = dict(os.environ, PYTHONPATH=str(REPO))
  proc = subprocess.run([sys.executable, "-c", REPLAY_CHILD, str(recording_dir)], capture_output=True,
                        text=True, env=env, cwd=REPO, timeout=300)
  assert proc.returncode == 0 and "CHILD-OK" in proc.stdout, proc.stderr[-3000:]
  assert json.loads(proc.stdout.splitlines()[0]) == here


def _digests(step):
  return [content_digest(pack_payload(p, rows=4, tokens_per_row=64, vocab_size=512)) for p in step]


@pytest.mark.engine
@pytest.mark.parametrize("taken", [0, 1, 3])
def test_replay_iterator_state_saves_and_restores(recording_dir, taken):
  """A restored iterator yields exactly the steps the original would have yielded next,
  even when a group was carried over from the last payload."""
  from orchestrator.data.replay import replay_pipeline

  rec = open_recording(recording_dir, vocab_size=512)
  m = BATCH["micro_batches_per_step"]
  first = iter(replay_pipeline(rec, rows=4, tokens_per_row=64, micro_batches_per_step=m))
  for _ in range(taken):
    next(first)
  state = first.get_state()
  expected = [_digests(next(first)) for _ in range(2)]
  second = iter(replay_pipeline(rec, rows=4, tokens_per_row=64, micro_batches_per_step=m))
  second.set_state(state)
  assert [_digests(next(second)) for _ in range(2)] == expected
  fresh = iter(replay_pipeline(rec, rows=4, tokens_per_row=64, micro_batches_per_step=m))
  if taken:  # negative control: without the state, a fresh iterator starts elsewhere
    assert _digests(next(fresh)) != expected[0]


@pytest.mark.engine
def test_replay_never_writes_to_the_recording(recording_dir):
  before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in recording_dir.iterdir()}
  replay_steps(open_recording(recording_dir, vocab_size=512), steps=3, **BATCH)
  after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in recording_dir.iterdir()}
  assert after == before


@pytest.mark.e2e
def test_missing_manifest(recording_dir):
  (recording_dir / MANIFEST).unlink()
  with pytest.raises(RecordingError, match=r"manifest.json: no manifest; record one with `run_rl record"):
    open_recording(recording_dir)


@pytest.mark.engine
def test_unknown_schema_version(recording_dir):
  manifest = json.loads((recording_dir / MANIFEST).read_text())
  manifest["schema_version"] = 99
  (recording_dir / MANIFEST).write_text(json.dumps(manifest))
  with pytest.raises(RecordingError, match="schema_version 99 is not supported"):
    open_recording(recording_dir)


@pytest.mark.engine
def test_digest_mismatch_names_the_record(recording_dir):
  manifest = json.loads((recording_dir / MANIFEST).read_text())
  manifest["record_digests"][5] = "0" * 64
  (recording_dir / MANIFEST).write_text(json.dumps(manifest))
  with pytest.raises(RecordingError, match=r"groups.array_record record 5: content digest does not match"):
    open_recording(recording_dir)


@pytest.mark.engine
def test_truncated_file(recording_dir):
  data = recording_dir / DATA_FILE
  data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
  with pytest.raises(RecordingError, match=r"groups.array_record.*(truncated|corrupt)"):
    open_recording(recording_dir)


@pytest.mark.engine
def test_token_ids_outside_the_vocabulary(recording_dir):
  with pytest.raises(RecordingError, match=r"record 0 \(group 0\) .*token id \d+ is outside the model's vocabulary \[0, 100\)"):
    open_recording(recording_dir, vocab_size=100)


@pytest.mark.engine
def test_too_few_trajectories_for_the_steps(recording_dir):
  rec = open_recording(recording_dir, vocab_size=512)
  with pytest.raises(RecordingError, match=r"make only \d+ steps of 2 micro-batches of 4 rows x 64 tokens; 50 were asked for"):
    replay_steps(rec, steps=50, **BATCH)


@pytest.mark.engine
def test_group_larger_than_a_micro_batch(recording_dir):
  rec = open_recording(recording_dir, vocab_size=512)
  with pytest.raises(RecordingError, match=r"group 0: its 4 trajectories do not fit one micro-batch of 1 rows x 64"):
    replay_steps(rec, rows=1, tokens_per_row=64, micro_batches_per_step=1, steps=1)


@pytest.mark.engine
def test_shipped_recording_is_valid_and_small():
  path = REPO / "recordings" / "rig_small"
  rec = open_recording(path, vocab_size=512)
  size = sum(p.stat().st_size for p in path.iterdir())
  assert size < 4 * 2**20 and rec.manifest["num_trajectories"] >= 1000

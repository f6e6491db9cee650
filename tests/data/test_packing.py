"""Payload mapping: packing layout, determinism, fresh buffers, and bad payloads refused cleanly; the whole-payload
check refuses exactly what a check one trajectory at a time refuses, naming the first fault."""

from __future__ import annotations

import dataclasses
import fractions
import re

import numpy as np
import pytest

from orchestrator.data import packing
from orchestrator.data.trajectory import Trajectory
from orchestrator.data.packing import (FIELDS, ROUTING as ROUTING_FIELD, RoutingShape, bytes_per_token_by_field,
                                       content_digest, pack_payload)


def _traj(prompt, completion, adv=1.0, old=None, group=0):
  return Trajectory(np.array(prompt, np.int32), np.array(completion, np.int32), adv, old, group)


@pytest.mark.spec
def test_packing_lays_out_segments_targets_and_masks():
  old = np.array([-0.5, -1.5], np.float32)
  payload = [_traj([5, 6, 7], [8, 9], adv=2.0, old=old), _traj([1], [2, 3], adv=-1.0)]
  out = pack_payload(payload, rows=2, tokens_per_row=8, vocab_size=16)
  assert set(out) == set(FIELDS)
  row = {k: v[0] for k, v in out.items()}
  np.testing.assert_array_equal(row["input_tokens"], [5, 6, 7, 8, 9, 1, 2, 3])
  assert not out["segment_ids"][1].any()  # both fit in row 0; row 1 is padding
  np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 1, 1, 2, 2, 2])
  np.testing.assert_array_equal(row["positions"], [0, 1, 2, 3, 4, 0, 1, 2])
  # Position t predicts t+1 inside its segment; the last token of a segment predicts nothing.
  np.testing.assert_array_equal(row["target_tokens"], [6, 7, 8, 9, 0, 2, 3, 0])
  np.testing.assert_array_equal(row["loss_mask"], [0, 0, 1, 1, 0, 1, 1, 0])
  np.testing.assert_array_equal(row["advantages"], [0, 0, 2, 2, 0, -1, -1, 0])
  np.testing.assert_array_equal(row["old_logprobs"], [0, 0, -0.5, -1.5, 0, 0, 0, 0])
  np.testing.assert_array_equal(row["old_logprobs_mask"], [0, 0, 1, 1, 0, 0, 0, 0])


@pytest.mark.spec
def test_packing_is_first_fit_in_payload_order():
  payload = [_traj([1] * 3, [2] * 3), _traj([1] * 4, [2] * 3), _traj([1], [2])]
  out = pack_payload(payload, rows=2, tokens_per_row=8, vocab_size=4)
  # 6 tokens -> row 0; 7 tokens -> row 1; 2 tokens -> row 0 (first row with room).
  np.testing.assert_array_equal(out["segment_ids"][0], [1, 1, 1, 1, 1, 1, 2, 2])
  np.testing.assert_array_equal(out["segment_ids"][1], [1] * 7 + [0])


@pytest.mark.engine
def test_packing_is_deterministic_and_returns_fresh_buffers(tiny_source):
  payload = tiny_source.micro_batch(0, 0)
  a = pack_payload(payload, rows=4, tokens_per_row=64, vocab_size=512)
  b = pack_payload(payload, rows=4, tokens_per_row=64, vocab_size=512)
  for name in FIELDS:
    np.testing.assert_array_equal(a[name], b[name])
    assert not np.shares_memory(a[name], b[name])


@pytest.mark.engine
@pytest.mark.parametrize(
    "payload,message",
    [
        ([], "payload is empty"),
        ([_traj([1] * 60, [2] * 10)], r"payload\[0\] has 70 tokens .* more than tokens_per_row=64"),
        ([_traj([1], [600])], r"payload\[0\].completion_ids holds token id 600, outside the model's vocabulary \[0, 512\)"),
        ([_traj([1], [2]), _traj([-1], [2])], r"payload\[1\].prompt_ids holds token id -1"),
        ([Trajectory(np.array([1.0]), np.array([2], np.int32), 1.0)], r"payload\[0\].prompt_ids has dtype float64"),
        ([_traj([1], [2, 3], old=np.zeros(3, np.float32))], r"payload\[0\].old_logprobs has shape \(3,\).*\(2,\)"),
        ([_traj([1], [])], r"payload\[0\].completion_ids is empty"),
        ([_traj([1], [2], adv=float("nan"))], r"payload\[0\].advantage is nan"),
        ([_traj([1] * 40, [2] * 20)] * 5, r"payload does not fit: payload\[4\] \(60 tokens\) finds no room in 4 rows of 64"),
        ("not a list", "payload must be a list of Trajectory"),
    ],
    ids=["empty", "too-long", "vocab-high", "vocab-negative", "dtype", "old-logprobs-shape",
         "empty-completion", "nan-advantage", "too-many-rows", "wrong-type"],
)
def test_bad_payload_is_refused_and_changes_nothing(tiny_engine, payload, message):
  before = (tiny_engine.train_step, tiny_engine.micro_step_count, tiny_engine.total_micro_steps)
  digest = tiny_engine.state_digest()
  with pytest.raises(ValueError, match=message):
    tiny_engine.fwd_bwd(payload)
  with pytest.raises(ValueError, match=message):
    tiny_engine.prepare_fwd_bwd_input(payload)
  assert (tiny_engine.train_step, tiny_engine.micro_step_count, tiny_engine.total_micro_steps) == before
  assert tiny_engine.state_digest() == digest


ROUTING = RoutingShape(layers=2, top_k=2, num_experts=4)


def _routed(prompt, completion, adv=1.0):
  n = len(prompt) + len(completion)
  ids = np.stack([np.arange(n) % 4, (np.arange(n) + 1) % 4], axis=-1)  # two distinct experts per token
  return dataclasses.replace(_traj(prompt, completion, adv), routing=np.stack([ids, ids[:, ::-1]], 1).astype(np.int16))


@pytest.mark.spec
def test_routing_is_packed_where_its_tokens_are_and_counted_in_the_digest():
  a, b = _routed([1, 2], [3, 4, 5]), _routed([6], [7, 8])
  out = pack_payload([a, b], rows=2, tokens_per_row=6, vocab_size=16, routing=ROUTING)
  assert out[ROUTING_FIELD].shape == (2, 6, 2, 2) and out[ROUTING_FIELD].dtype == np.int16
  assert np.array_equal(out[ROUTING_FIELD][0, :5], a.routing) and np.array_equal(out[ROUTING_FIELD][1, :3], b.routing)
  assert not out[ROUTING_FIELD][0, 5:].any()  # padding routes nowhere (the mask keeps it out)
  other = dataclasses.replace(a, routing=a.routing.copy())
  other.routing[4, 1, 0] = 3 - other.routing[4, 1, 0]
  changed = pack_payload([other, b], rows=2, tokens_per_row=6, vocab_size=16, routing=ROUTING)
  assert content_digest(changed) != content_digest(out)
  plain = pack_payload([a, b], rows=2, tokens_per_row=6, vocab_size=16)
  assert ROUTING_FIELD not in plain and content_digest(plain) != content_digest(out)
  assert bytes_per_token_by_field(ROUTING)[ROUTING_FIELD] == 2 * 2 * 2
  assert sum(bytes_per_token_by_field().values()) == sum(dtype.itemsize for dtype in FIELDS.values())


@pytest.mark.spec
@pytest.mark.parametrize("routing, message", [
    (None, "payload[0] carries no routing, but the engine replays"),
    (np.zeros((4, 2, 2), np.int16), "payload[0] routing has shape (4, 2, 2); it must be (5, 2, 2)"),
    (np.zeros((5, 2, 2), np.float32), "routing has dtype float32; expert ids must be integers"),
    (np.full((5, 2, 2), 4, np.int16), "routing holds expert id 4, outside the model's 4 experts [0, 4)"),
    (np.full((5, 2, 2), -1, np.int16), "routing holds expert id -1"),
])
def test_a_payload_whose_routing_does_not_fit_the_model_is_refused(routing, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    pack_payload([dataclasses.replace(_traj([1, 2], [3, 4, 5]), routing=routing)], rows=2, tokens_per_row=8,
                 vocab_size=16, routing=ROUTING)


def _faults(traj: Trajectory, routed: bool) -> dict:
  """Each way one trajectory can be refused, as a replacement of it."""
  c = len(traj.completion_ids)
  faults = {
      "id-too-high": dataclasses.replace(traj, completion_ids=np.full(c, 16, np.int32)),
      "id-negative": dataclasses.replace(traj, prompt_ids=np.array([-1], np.int32)),
      "id-uint64": dataclasses.replace(traj, prompt_ids=np.array([2**64 - 1], np.uint64)),
      "float-ids": dataclasses.replace(traj, prompt_ids=np.array([1.0])),
      "2-d-ids": dataclasses.replace(traj, prompt_ids=np.array([[1]], np.int32)),
      "list-ids": dataclasses.replace(traj, prompt_ids=[1]),
      "empty-completion": dataclasses.replace(traj, completion_ids=np.array([], np.int32)),
      "too-long": dataclasses.replace(traj, prompt_ids=np.ones(9, np.int32)),
      "nan-advantage": dataclasses.replace(traj, advantage=float("nan")),
      "huge-advantage": dataclasses.replace(traj, advantage=2e6),
      "string-advantage": dataclasses.replace(traj, advantage="1.0"),
      "logprob-shape": dataclasses.replace(traj, old_logprobs=np.zeros(c + 1, np.float32)),
      "logprob-dtype": dataclasses.replace(traj, old_logprobs=np.zeros(c, np.int32)),
      "logprob-inf": dataclasses.replace(traj, old_logprobs=np.full(c, -np.inf, np.float32)),
      "logprob-positive": dataclasses.replace(traj, old_logprobs=np.full(c, 0.5, np.float32)),
      "not-a-trajectory": (traj.prompt_ids, traj.completion_ids),
      # values of kinds the whole-payload check does not read as they are: the check one at a time decides
      "long-double-advantage": dataclasses.replace(traj, advantage=np.longdouble(1e6) + np.longdouble(5e-11)),
      "fraction-advantage": dataclasses.replace(traj, advantage=fractions.Fraction(1, 3)),
      "huge-int-advantage": dataclasses.replace(traj, advantage=10**400),
      "timedelta-ids": dataclasses.replace(traj, prompt_ids=np.array([1, 2], "m8[s]")),
      "masked-ids": dataclasses.replace(traj, prompt_ids=np.ma.array([1, 2], mask=[True, True])),
  }
  if routed:
    faults["routing-expert"] = dataclasses.replace(traj, routing=np.full_like(traj.routing, 4))
    faults["routing-missing"] = dataclasses.replace(traj, routing=None)
  return faults


@pytest.mark.spec
@pytest.mark.parametrize("routed", [False, True], ids=["plain", "routed"])
def test_the_whole_payload_check_refuses_what_a_check_one_at_a_time_refuses_and_names_the_first(routed):
  """``validate_payload`` checks the values over the whole payload at once (the host's time per micro-batch); for
  every fault, alone or after another one later in the payload, it raises exactly what checking one trajectory
  at a time, in order, raises; a payload without faults passes both."""
  rng = np.random.default_rng(0)
  shape = ROUTING if routed else None

  def good(i):
    t = _routed([1 + i % 5, 2], [3, 4, 5]) if routed else _traj([1 + i % 5, 2], [3, 4, 5])
    return dataclasses.replace(t, advantage=float(rng.normal()), old_logprobs=(
        None if i % 3 == 0 else -rng.random(3).astype(np.float32 if i % 2 else np.float64)))

  payload = [good(i) for i in range(6)]
  packing.validate_payload(payload, tokens_per_row=8, vocab_size=16, routing=shape)
  packing._raise_first_invalid(payload, tokens_per_row=8, vocab_size=16, routing=shape)
  checked = 0
  for name, bad in _faults(payload[2], routed).items():
    for later in (None, *_faults(payload[4], routed).values()):
      trial = [*payload[:2], bad, *payload[3:]]
      if later is not None:
        trial[4] = later
      with pytest.raises(Exception) as one_at_a_time:
        packing._raise_first_invalid(trial, tokens_per_row=8, vocab_size=16, routing=shape)
      with pytest.raises(Exception) as whole:
        packing.validate_payload(trial, tokens_per_row=8, vocab_size=16, routing=shape)
      assert (type(whole.value), str(whole.value)) == (type(one_at_a_time.value), str(one_at_a_time.value)), name
      if isinstance(whole.value, ValueError):
        assert "payload[2]" in str(whole.value), name
      checked += 1
  assert checked == len(_faults(payload[2], routed)) * (1 + len(_faults(payload[4], routed)))

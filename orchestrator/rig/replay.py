"""What every arm replays: a recording cut into steps of payloads, and what those steps must produce."""

from __future__ import annotations

import dataclasses

from orchestrator.data.packing import content_digest, count_loss_tokens, pack_payload
from orchestrator.data.replay import replay_steps


@dataclasses.dataclass
class ReplayPlan:
  """The steps every arm is fed, with the content digests and loss denominators the checks expect of them."""

  steps: list
  expected_digests: list[list[str]]
  expected_tokens: list[int]
  digest_by_payload: dict[int, str]


def payload_digest(payload, *, rows: int, tokens_per_row: int, vocab_size: int, routing=None) -> str:
  """The content digest of a payload as the engine packs it (what a prepared input's ``digest`` gives; with
  ``routing``, a ``packing.RoutingShape``, the routing counts)."""
  return content_digest(pack_payload(payload, rows=rows, tokens_per_row=tokens_per_row, vocab_size=vocab_size,
                                     routing=routing))


def replay_plan(shape, recording, m: int, steps: int) -> ReplayPlan:
  """``steps`` steps of ``m`` micro-batches from ``recording``, packed to ``shape`` (a ``BatchShape``)."""
  plan = replay_steps(recording, rows=shape.rows, tokens_per_row=shape.tokens_per_row,
                      micro_batches_per_step=m, steps=steps)
  expected = [[payload_digest(p, rows=shape.rows, tokens_per_row=shape.tokens_per_row,
                              vocab_size=shape.vocab_size, routing=shape.routing) for p in step]
              for step in plan]
  # Each payload's true content digest, by identity: an arm fed another order shows it.
  by_payload = {id(p): d for step, ds in zip(plan, expected) for p, d in zip(step, ds)}
  return ReplayPlan(plan, expected, [sum(count_loss_tokens(p) for p in step) for step in plan], by_payload)

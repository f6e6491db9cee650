"""The learning-rate schedule (``engine.lr_schedule``, ``warmup_steps``, ``decay_steps``): its values against
hand-computed ones, the engine applying them (a warm-up's first update moves nothing), the rate in each step's
metrics, and a constant rate building the optimizer exactly as before."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from orchestrator.engine.optimizer import LearningRates, learning_rate_schedule
from orchestrator.engine.options import EngineOptions

pytestmark = pytest.mark.engine

LR = 0.01


def _hand(schedule: str, warmup: int, decay: int, update: int) -> float:
  """The schedule as its docstring defines it, in plain Python."""
  if update < warmup:
    return LR * update / warmup
  v = update - warmup
  if schedule == "constant":
    return LR
  fraction = min(v, decay) / decay
  return LR * (1 - fraction) if schedule == "linear" else LR * 0.5 * (1 + math.cos(math.pi * fraction))


@pytest.mark.parametrize("schedule,warmup,decay", [("constant", 4, None), ("linear", 0, 10), ("linear", 3, 10),
                                                   ("cosine", 0, 8), ("cosine", 5, 20)])
def test_each_schedule_takes_the_values_its_definition_gives(schedule, warmup, decay):
  rates = LearningRates(EngineOptions(learning_rate=LR, lr_schedule=schedule, warmup_steps=warmup,
                                      decay_steps=decay))
  for update in (0, 1, warmup, warmup + 1, warmup + (decay or 4) // 2, warmup + (decay or 4), 10_000):
    assert rates.at(update) == pytest.approx(_hand(schedule, warmup, decay or 1, update), rel=1e-6, abs=1e-9)


def test_a_constant_rate_without_warm_up_is_the_plain_number_as_before():
  """So a default run builds the optimizer it always built: same digest, same checkpoint layout."""
  assert learning_rate_schedule(EngineOptions(learning_rate=LR)) == LR
  assert callable(learning_rate_schedule(EngineOptions(learning_rate=LR, warmup_steps=2)))


@pytest.mark.parametrize("options,message", [
    ({"lr_schedule": "step"}, "engine.lr_schedule='step' is not a schedule; use one of constant, linear, cosine"),
    ({"lr_schedule": "cosine"}, "engine.lr_schedule=cosine needs engine.decay_steps"),
    ({"decay_steps": 5}, "engine.decay_steps=5 is for a decaying schedule"),
    ({"lr_schedule": "linear", "decay_steps": 0}, "engine.decay_steps=0 is out of range"),
    ({"warmup_steps": -1}, "engine.warmup_steps=-1 is out of range"),
])
def test_bad_schedules_are_refused_naming_the_key(options, message):
  with pytest.raises(ValueError, match=None) as e:
    EngineOptions(**options).validate()
  assert message in str(e.value)


def test_the_engine_follows_the_schedule_and_records_each_rate(tiny_source):
  from orchestrator.engine import build_engine

  engine = build_engine("tiny", learning_rate=LR, lr_schedule="linear", warmup_steps=2, decay_steps=2)
  weights = [jax.device_get(engine.export_weights())]
  rates = []
  for step in range(5):
    engine.fwd_bwd(tiny_source.micro_batch(step, 0), apply_optimizer=True)
    rates.append(engine.get_metrics().learning_rate)
    weights.append(jax.device_get(engine.export_weights()))
  assert rates == pytest.approx([0.0, LR / 2, LR, LR / 2, 0.0])
  moved = [any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(weights[i]), jax.tree.leaves(weights[i + 1])))
           for i in range(5)]
  assert moved == [False, True, True, True, False]  # a rate of 0 moves nothing (AdamW's decay is scaled by it too)


def test_a_constant_rate_moves_the_weights_at_the_first_update_negative_control(tiny_source):
  from orchestrator.engine import build_engine

  engine = build_engine("tiny", learning_rate=LR)
  before = jax.device_get(engine.export_weights())
  engine.fwd_bwd(tiny_source.micro_batch(0, 0), apply_optimizer=True)
  assert engine.get_metrics().learning_rate == pytest.approx(LR)
  after = jax.device_get(engine.export_weights())
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))

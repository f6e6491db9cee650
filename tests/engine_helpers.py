"""Helpers for engine tests: run steps unstaged and staged, and a device-side gate."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def run_unstaged(engine, steps):
  """Every micro-batch from its payload; returns per-step metrics."""
  metrics = []
  for payloads in steps:
    for i, p in enumerate(payloads):
      engine.fwd_bwd(p, apply_optimizer=i == len(payloads) - 1)
    metrics.append(engine.get_metrics())
  return metrics


def run_staged(engine, steps, *, before_update=True, stage_payload=None):
  """The staged order: the next step's first micro-batch is prepared before (or after)
  this step's update; every other micro-batch goes in as a prepared input too.

  ``stage_payload(step_index, payloads_of_next_step)`` picks what gets staged
  (default: the next step's first micro-batch) — a hook for negative controls.
  """
  stage_payload = stage_payload or (lambda k, nxt: nxt[0])
  metrics = []
  staged = engine.prepare_fwd_bwd_input(steps[0][0])
  for k, payloads in enumerate(steps):
    for i, p in enumerate(payloads):
      if i == 0:
        engine.fwd_bwd(staged)
      else:
        engine.fwd_bwd(engine.prepare_fwd_bwd_input(p))
    nxt = steps[k + 1] if k + 1 < len(steps) else None
    if nxt is not None and before_update:
      staged = engine.prepare_fwd_bwd_input(stage_payload(k, nxt))
      engine.wait_for_device()
      engine.update()
    else:
      engine.update()
      if nxt is not None:
        staged = engine.prepare_fwd_bwd_input(stage_payload(k, nxt))
    metrics.append(engine.get_metrics())
  return metrics


class LongComputation:
  """A device computation long enough that host work of a few ms finishes first.

  Sized once against this machine (about ``target_s``); tests assert on its
  readiness, never on how long anything took. (A host callback would make a
  gate the test could open, but XLA's CPU client runs callback computations
  synchronously at dispatch.)
  """

  def __init__(self, target_s: float = 1.5):
    self._fn = jax.jit(
        lambda a, n: jax.lax.fori_loop(0, n, lambda i, a: jnp.tanh(a @ a), a)
    )
    self._a = jnp.ones((256, 256), jnp.float32) / 256
    probe = 20
    start = time.perf_counter()
    self._fn(self._a, probe).block_until_ready()
    per_iter = (time.perf_counter() - start) / probe
    self.iterations = max(probe, int(target_s / max(per_iter, 1e-6)))

  def dispatch(self) -> jax.Array:
    return self._fn(self._a, self.iterations)


class FailedComputation:
  """Stands in for a queued device computation that failed: its error surfaces on wait."""

  def block_until_ready(self):
    raise RuntimeError("injected device failure")

  def is_ready(self):
    return True

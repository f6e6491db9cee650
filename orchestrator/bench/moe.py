"""The engine's MoE step against stock Tunix's, per second.

    python -m orchestrator.bench.moe [--presets small_moe small_moe16] [--rounds 5] [--steps 4]

Per preset, two arms on the same model sizes, the same packed micro-batches
(synthetic rollouts at the preset's shape) and the same clipped policy loss:

- ``engine``: ``build_engine`` (the ``jax`` backend) with MoE routed through
  ``orchestrator.engine.moe`` — each expert computes only the tokens routed to
  it — dropless (``engine.ragged_buffer_factor`` -1);
- ``tunix``: Tunix's ``PeftTrainer`` over Tunix's own Qwen3 with its own
  ``MoELayer``, which on a CPU (or without a mesh) runs every expert on every
  token and masks.

Both run ``--micro-batches`` micro-batches and one update per step, one XLA
core (the host keeps the other), each arm's programs compiled before timing.
Rounds alternate the arms' order; per arm the median seconds per step and its
range over rounds, and the engine's as a ratio of Tunix's in the same round.
Then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from orchestrator.host.host_threads import reserve_host_core

ARMS = ("engine", "tunix")


def _batches(preset, micro_batches: int, steps: int, seed: int = 3):
  """``steps`` steps of ``micro_batches`` payloads at the preset's shape."""
  from orchestrator.data.synthetic import SyntheticRollouts  # import here: after the core plan (see main)

  source = SyntheticRollouts(preset.vocab_size, preset.rows, preset.tokens_per_row, seed=seed)
  return [[source.micro_batch(step, i) for i in range(micro_batches)] for step in range(steps)]


class EngineArm:
  """The engine's MoE: routed experts, dropless."""

  def __init__(self, preset, micro_batches: int):
    from orchestrator.engine import build_engine  # import here: after the core plan (see main)

    self.engine = build_engine(preset, ragged_buffer_factor=-1.0, learning_rate=1e-4)

  def step(self, payloads) -> None:
    for payload in payloads:
      self.engine.fwd_bwd(payload)
    self.engine.update()
    self.engine.get_metrics()  # blocks until the update is done


class TunixArm:
  """Stock Tunix: ``PeftTrainer`` over Tunix's Qwen3 with its own MoE layer (every expert on every token on a
  CPU), gradient accumulation Tunix's own, the same loss."""

  def __init__(self, preset, micro_batches: int):
    # import here: after the core plan (see main)
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tunix.sft import peft_trainer

    from orchestrator.data.packing import pack_payload
    from orchestrator.engine import model as model_lib
    from orchestrator.engine.loss import LossConfig, attention_mask, policy_loss_sum

    self.model = model = model_lib.model_class(preset)(model_lib.model_config(preset), rngs=nnx.Rngs(0))
    config = LossConfig()

    def loss_fn(model, input_tokens, target_tokens, segment_ids, positions, loss_mask, advantages, old_logprobs,
                old_logprobs_mask):
      batch = {"target_tokens": target_tokens, "loss_mask": loss_mask, "advantages": advantages,
               "old_logprobs": old_logprobs, "old_logprobs_mask": old_logprobs_mask}
      logits, _ = model(input_tokens, positions, None, attention_mask(segment_ids))
      total, denominator, _ = policy_loss_sum(logits, batch, config)
      return total / jnp.maximum(denominator, 1.0)

    trainer = peft_trainer.PeftTrainer(
        model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4)),
        peft_trainer.TrainingConfig(eval_every_n_steps=10**9, gradient_accumulation_steps=micro_batches),
    ).with_loss_fn(loss_fn)
    self._train_step, _ = trainer.jit_train_and_eval_step()
    self._pack = lambda payload: {k: jax.device_put(v) for k, v in pack_payload(
        payload, rows=preset.rows, tokens_per_row=preset.tokens_per_row, vocab_size=preset.vocab_size).items()}
    self._block = jax.block_until_ready

  def step(self, payloads) -> None:
    losses = [self._train_step(self._pack(payload))[0] for payload in payloads]
    self._block(losses)


def time_steps(arm, steps) -> list[float]:
  """Seconds of each step (its micro-batches and update, done)."""
  out = []
  for payloads in steps:
    start = time.perf_counter()
    arm.step(payloads)
    out.append(time.perf_counter() - start)
  return out


def summarise(per_round: dict[str, list[float]]) -> dict:
  """Per arm the median over rounds of each round's median step, with its range; the engine's per-round ratio
  to Tunix's."""
  ratios = [e / t for e, t in zip(per_round["engine"], per_round["tunix"])]
  out = {arm: {"step_s": statistics.median(v), "low_s": min(v), "high_s": max(v)} for arm, v in per_round.items()}
  out["ratio"] = {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}
  return out


def run_preset(name: str, *, rounds: int, steps: int, micro_batches: int) -> dict:
  from orchestrator.models.presets import load_preset  # import here: after the core plan (see main)

  preset = load_preset(name)
  batches = _batches(preset, micro_batches, steps + 1)
  arms = {"engine": EngineArm(preset, micro_batches), "tunix": TunixArm(preset, micro_batches)}
  for arm in arms.values():  # compiles, and the first step's allocations
    arm.step(batches[0])
  per_round: dict[str, list[float]] = {arm: [] for arm in ARMS}
  for r in range(rounds):
    for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
      per_round[arm].append(statistics.median(time_steps(arms[arm], batches[1:])))
  return {"preset": name, "experts": preset.num_experts, "experts_per_token": preset.num_experts_per_tok,
          "rows": preset.rows, "tokens_per_row": preset.tokens_per_row, "micro_batches": micro_batches,
          "rounds": rounds, "steps_per_round": steps, **summarise(per_round)}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--presets", nargs="+", default=["small_moe", "small_moe16"])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=4, help="timed steps per arm and round")
  parser.add_argument("--micro-batches", type=int, default=2)
  args = parser.parse_args(argv)
  reserve_host_core()  # one XLA core, the host the other: before JAX starts
  results = []
  for name in args.presets:
    result = run_preset(name, rounds=args.rounds, steps=args.steps, micro_batches=args.micro_batches)
    results.append(result)
    e, t, ratio = result["engine"], result["tunix"], result["ratio"]
    print(f"{name} ({result['experts']} experts, top-{result['experts_per_token']}, {result['rows']}×"
          f"{result['tokens_per_row']} tokens × {result['micro_batches']} micro-batches): engine"
          f" {e['step_s'] * 1e3:.1f} ms/step ({e['low_s'] * 1e3:.1f}–{e['high_s'] * 1e3:.1f}), Tunix"
          f" {t['step_s'] * 1e3:.1f} ms/step ({t['low_s'] * 1e3:.1f}–{t['high_s'] * 1e3:.1f}); engine/Tunix"
          f" {ratio['median']:.2f} ({ratio['low']:.2f}–{ratio['high']:.2f})", flush=True)
  print(json.dumps(results))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

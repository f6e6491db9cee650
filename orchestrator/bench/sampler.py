"""The live sampler against Tunix's own sampler: sampled tokens per second on the same model, prompts and batch.

    python -m orchestrator.bench.sampler [--recipe recipes/default.yaml] [--repeats 7]

One process, its XLA pool on one core as the default run's sampler process
has it (``reserve_host_core``). A sampled batch of the recipe (its
micro-batches' prompts, each repeated for its group) is sampled three ways,
in rotated order per repeat, after one warm-up call each (the compiles):

- ``run``: ``shared_sampler.sample_micro_batches``, what the run's sampling
  thread calls per sampled batch: sampling, cutting at eos, rewards, checks;
- ``sampler``: ``LiveSampler.sample``, the sampling alone;
- ``tunix``: the same Tunix ``Sampler`` object called directly with the same
  arguments (what ``LiveSampler`` wraps).

Prints per way the median seconds per batch (range), completion tokens per
second and prompt-and-completion tokens per second, and each way's seconds
over Tunix's; then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from orchestrator import recipe as recipe_lib
from orchestrator.host.host_threads import reserve_host_core


def _ways(recipe):
  """The three callables, each sampling the recipe's first sampled batch, and its token counts."""
  # import here: JAX starts after reserve_host_core (see main)
  from orchestrator.live.rollouts import LiveShape
  from orchestrator.live.sampler import NEVER_SAMPLED, LiveSampler
  from orchestrator.live.shared_sampler import sample_micro_batches
  from orchestrator.tasks.tasks import max_generation_steps

  r, task = recipe.rollouts, recipe.live_task()
  shape = LiveShape(recipe.steps, recipe.batch.micro_batches_per_step, r.groups_per_micro_batch,
                    r.generations_per_group, r.max_staleness, r.temperature, r.seed, r.batch_steps,
                    recipe.engine.epochs, recipe.micro_batches_per_call())
  sampler = LiveSampler(recipe.model_preset(), recipe.model.tokenizer(), seed=recipe.engine.seed,
                        max_prompt_length=task.max_prompt_tokens, max_generation_steps=max_generation_steps(task),
                        alphabet=task.answer_alphabet, dtype=recipe.engine.dtype)
  count = shape.micro_batches_per_batch
  problems = [task.problem(shape.seed, "train", j) for j in range(count * r.groups_per_micro_batch)]
  prompts = [p.prompt for p in problems for _ in range(r.generations_per_group)]
  formatted = [sampler.model_prompt(p) for p in prompts]
  reward = recipe.task.make_reward(task)

  tunix_sampler, forbidden = sampler._sampler, sampler._forbidden  # pylint: disable=protected-access  # what it wraps

  def tunix():
    return tunix_sampler(formatted, max_generation_steps=sampler.max_generation_steps,
                         max_prompt_length=sampler.max_prompt_length, temperature=r.temperature, top_p=1.0, seed=1,
                         return_logprobs=True, forbidden_tokens=forbidden, eos_tokens=[NEVER_SAMPLED])

  samples = sampler.sample(prompts, seed=1, temperature=r.temperature)
  tokens = {"completion": sum(len(c) for c in samples.completion_ids),
            "prompt": sum(len(p) for p in samples.prompt_ids)}
  ways = {"run": lambda: sample_micro_batches(sampler, task, reward, shape, 0, 0, count),
          "sampler": lambda: sampler.sample(prompts, seed=1, temperature=r.temperature),
          "tunix": tunix}
  return ways, tokens, len(prompts)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--recipe", default=None, help="a live recipe (default: the default recipe)")
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args(argv)
  recipe = recipe_lib.resolve(args.recipe).recipe
  if recipe.rollouts.source != "sampler":
    print(f"bench.sampler: error: {args.recipe} is not a live recipe (rollouts.source=sampler)", file=sys.stderr)
    return 2
  reservation = reserve_host_core()
  ways, tokens, completions = _ways(recipe)
  for call in ways.values():  # warm-up: each way's compiles
    call()
  seconds: dict[str, list[float]] = {name: [] for name in ways}
  names = list(ways)
  for i in range(args.repeats):
    for name in names[i % len(names):] + names[:i % len(names)]:
      start = time.perf_counter()
      ways[name]()
      seconds[name].append(time.perf_counter() - start)
  tunix = statistics.median(seconds["tunix"])
  rows = {}
  for name, times in seconds.items():
    median = statistics.median(times)
    rows[name] = {"batch_s": median, "range_s": [min(times), max(times)],
                  "completion_tokens_per_s": tokens["completion"] / median,
                  "tokens_per_s": (tokens["completion"] + tokens["prompt"]) / median, "of_tunix": median / tunix}
    print(f"{name:8} {1000 * median:8.1f} ms ({1000 * min(times):.1f}-{1000 * max(times):.1f})"
          f"  {rows[name]['completion_tokens_per_s']:9.0f} completion tokens/s"
          f"  {rows[name]['tokens_per_s']:9.0f} tokens/s  {rows[name]['of_tunix']:.2f} of Tunix's seconds")
  print(json.dumps({"rows": rows, "completions": completions, "tokens": tokens, "repeats": args.repeats,
                    "host_core_reservation": reservation.reason}))
  return 0


if __name__ == "__main__":
  sys.exit(main())

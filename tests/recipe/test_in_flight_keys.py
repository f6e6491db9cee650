"""``rollouts.in_flight_updates`` and ``rollouts.decode_chunk_tokens``: each bad value refused in one line naming
the key, the value and the fix, in the order the checks run; the keys off (their defaults) leave a recipe as it
was."""

from __future__ import annotations

import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.recipe import schema

pytestmark = pytest.mark.spec

#: A live task whose completions are 4 tokens long (``task.name=reverse``, length 4): room for chunks.
FOUR_TOKEN_COMPLETIONS = ["task.name=reverse", "task.length=4"]


def _refusal(*overrides: str) -> str:
  with pytest.raises(recipe_lib.RecipeError) as e:
    recipe_lib.resolve(env={}, overrides=list(overrides))
  assert "\n" not in str(e.value)
  return str(e.value)


def _resolves(*overrides: str):
  """The recipe ``overrides`` make, which must take in-flight updates (the negative controls)."""
  recipe = recipe_lib.resolve(env={}, overrides=list(overrides)).recipe
  assert recipe.rollouts.in_flight_updates is True
  return recipe


def test_the_keys_default_to_off_and_a_whole_completion():
  recipe = recipe_lib.resolve(env={}).recipe
  assert recipe.rollouts.in_flight_updates is False
  assert recipe.rollouts.decode_chunk_tokens is None
  assert "rollouts.in_flight_updates" in schema.LIVE_ONLY_KEYS
  assert "rollouts.decode_chunk_tokens" in schema.LIVE_ONLY_KEYS


@pytest.mark.parametrize("given, refusal", [
    ("0", "rollouts.decode_chunk_tokens=0 is out of range: it must be a whole number of tokens >= 1"),
    ("-3", "rollouts.decode_chunk_tokens=-3 is out of range: it must be a whole number of tokens >= 1"),
    ("2.5", "rollouts.decode_chunk_tokens: expected a whole number"),
    ("many", "rollouts.decode_chunk_tokens: expected int"),
])
def test_a_chunk_that_is_not_a_positive_whole_number_is_refused(given, refusal):
  """Negative control: 2 tokens of a 4-token completion resolves."""
  assert refusal in _refusal(*FOUR_TOKEN_COMPLETIONS, "rollouts.in_flight_updates=true",
                             f"rollouts.decode_chunk_tokens={given}")
  _resolves(*FOUR_TOKEN_COMPLETIONS, "rollouts.in_flight_updates=true",
                                   "rollouts.decode_chunk_tokens=2")


@pytest.mark.parametrize("chunk", [4, 5, 1000])
def test_a_chunk_as_long_as_the_completion_limit_or_longer_is_refused_naming_the_limit(chunk):
  """One chunk would hold the whole completion: nowhere for a new version to land. Negative control: 3 tokens
  (two chunks) passes."""
  refusal = _refusal(*FOUR_TOKEN_COMPLETIONS, "rollouts.in_flight_updates=true",
                     f"rollouts.decode_chunk_tokens={chunk}")
  assert refusal.startswith(f"rollouts.decode_chunk_tokens={chunk} leaves no point inside a generation")
  assert "the completion limit is 4 tokens (task.name=reverse's answer length); use fewer than 4" in refusal
  _resolves(*FOUR_TOKEN_COMPLETIONS, "rollouts.in_flight_updates=true",
                                   "rollouts.decode_chunk_tokens=3")


def test_a_chunk_without_in_flight_updates_is_refused_as_unread():
  refusal = _refusal(*FOUR_TOKEN_COMPLETIONS, "rollouts.decode_chunk_tokens=2")
  assert refusal.startswith("rollouts.decode_chunk_tokens=2 is read only with rollouts.in_flight_updates=true")


@pytest.mark.parametrize("source", [["rollouts.source=synthetic"],
                                    ["rollouts.source=recording", "rollouts.recording=recordings/rig_small"]])
def test_in_flight_updates_without_a_sampler_are_refused(source):
  """A recorded (or made-up) source has no generation to update; negative control: the same source without the
  key resolves."""
  refusal = _refusal(*source, "model=tiny", "rollouts.in_flight_updates=true")
  assert refusal.startswith("rollouts.in_flight_updates=True is read by the live loop only, but rollouts.source=")
  recipe_lib.resolve(env={}, overrides=[*source, "model=tiny"])


def test_in_flight_updates_at_staleness_zero_are_refused():
  refusal = _refusal(*FOUR_TOKEN_COMPLETIONS, "rollouts.in_flight_updates=true", "rollouts.max_staleness=0")
  assert refusal.startswith("rollouts.in_flight_updates=true has nothing to take at rollouts.max_staleness=0")
  _resolves(*FOUR_TOKEN_COMPLETIONS, "rollouts.in_flight_updates=true",
                                   "rollouts.max_staleness=2")


def test_in_flight_updates_on_one_token_completions_are_refused():
  """The default task's answers are one token: one chunk whatever the chunk size."""
  refusal = _refusal("rollouts.in_flight_updates=true")
  assert refusal.startswith("rollouts.in_flight_updates=true needs a point inside a generation")
  assert "task.name=first_letter's answer length" in refusal


def test_in_flight_updates_with_router_replay_are_refused():
  """The routing of a finished sequence is recorded with one set of weights. Negative control: the MoE recipe
  without the replay passes this check."""
  moe = ["model=tiny_moe", *FOUR_TOKEN_COMPLETIONS, "rollouts.in_flight_updates=true"]
  refusal = _refusal(*moe, "engine.router_replay=true")
  assert "engine.router_replay=true records each sequence's experts with the one set of weights" in refusal
  _resolves(*moe)


@pytest.mark.parametrize("chunk, limit, chunks", [(None, 1, 1), (None, 3, 3), (None, 4, 4), (None, 5, 3), (None, 6, 3),
                                                  (None, 7, 4), (None, 1000, 4), (1, 4, 4), (3, 4, 2), (16, 100, 7),
                                                  (100, 100, 1)])
def test_decode_chunks_counts_the_chunks_of_a_generation(chunk, limit, chunks):
  """Chunks of one size (``decode_chunk_size``), the last possibly shorter, cover the limit: five or six tokens
  in four would need two sizes, so they go in three chunks of two."""
  size = schema.decode_chunk_size(chunk, limit)
  assert schema.decode_chunks(chunk, limit) == chunks
  assert (chunks - 1) * size < limit <= chunks * size


@pytest.mark.parametrize("checkpoints", ["checkpoint.every=2", "checkpoint.scored_steps=[3]"])
def test_in_flight_updates_take_checkpoints_inside_the_run(checkpoints):
  """A checkpoint inside the run carries the generation under way at its position (``RolloutPositions``), so
  the recipe takes checkpoints there as any other."""
  _resolves(*FOUR_TOKEN_COMPLETIONS, "steps=8", "rollouts.in_flight_updates=true", checkpoints)


def test_in_flight_updates_resolve_wherever_the_live_loop_runs():
  """Every placement (the trainer's devices, devices of its own, a process of its own, or auto), beside a local or
  a remote trainer, in a job of one process or several: the sampler takes each chunk's version where it runs."""
  base = [*FOUR_TOKEN_COMPLETIONS, "rollouts.in_flight_updates=true"]
  for placement in ("shared", "split", "process", "auto"):
    assert _resolves(*base, f"rollouts.placement={placement}").rollouts.placement == placement
  assert _resolves(*base, "distributed.num_processes=2", "mesh.fsdp=2").distributed.num_processes == 2
  assert _resolves(*base, "trainer.location=remote", "trainer.address=localhost:5000").trainer.location == "remote"

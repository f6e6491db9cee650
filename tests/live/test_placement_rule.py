"""Where ``rollouts.placement`` puts the live loop's sampler (``placement_rule.choose_placement``): ``auto`` is a
process of its own on a CPU host and the trainer's devices beside an accelerator held by one process; an explicit
``process`` never opens the accelerator; the words say where and why."""

from __future__ import annotations

import pytest

from orchestrator.live.placement_rule import PLACEMENTS, choose_placement

pytestmark = pytest.mark.spec


@pytest.mark.parametrize("platform, processes, local, want", [
    ("cpu", 1, True, "process"),
    ("cpu", 4, True, "process"),
    ("tpu", 1, True, "shared"),
    ("gpu", 1, True, "shared"),
    ("tpu", 2, True, "process"),  # a job of several processes: each holds its own share of the accelerator
    ("tpu", 1, False, "process"),  # the trainer is served elsewhere: this process holds no accelerator for it
])
def test_auto_chooses_by_the_trainers_devices(platform, processes, local, want):
  kind, where = choose_placement("auto", platform=platform, processes=processes, trainer_local=local)
  assert kind == want
  assert "rollouts.placement=auto" in where
  assert ("host's cores" in where) == (want == "process")


def test_auto_beside_a_tpu_says_it_shares_the_trainers_devices():
  kind, where = choose_placement("auto", platform="tpu", processes=1, trainer_local=True)
  assert (kind, where.split(" (")[0]) == ("shared", "on the trainer's TPU devices")


@pytest.mark.parametrize("platform", ["cpu", "tpu", "gpu"])
def test_an_explicit_placement_is_kept_and_process_stays_on_the_hosts_cores(platform):
  for requested in ("shared", "split", "process"):
    kind, where = choose_placement(requested, platform=platform, processes=1, trainer_local=True)
    assert kind == requested and f"rollouts.placement={requested}" in where
  _, where = choose_placement("process", platform=platform, processes=1, trainer_local=True)
  assert "host's cores" in where
  assert (f"never on the {platform.upper()}" in where) == (platform != "cpu")


def test_every_placement_a_recipe_may_name_is_resolved():
  from orchestrator.recipe.schema import PLACEMENTS as SCHEMA_PLACEMENTS  # the recipe reads the same table

  assert SCHEMA_PLACEMENTS is PLACEMENTS and "auto" in PLACEMENTS
  for requested in PLACEMENTS:
    kind, _ = choose_placement(requested, platform="tpu", processes=1, trainer_local=True)
    assert kind in ("shared", "split", "process")

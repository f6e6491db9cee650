"""The live loop on a mesh, with the sampler on the trainer's devices (shared) or on devices of its own (split).

Each scenario runs in a child process with forced host devices (XLA's flag must be set before JAX starts):
trainer on devices 0 and 1, a split sampler on 2 and 3. Every boundary mode must train to one digest at
staleness 0 and 1; a sampler's weights are replicated, so both placements sample the same rollouts and reach
the same digest; a sync that skips the transfer is caught.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_child

#: In the long tier (docs/testing.md): a 4-device child that builds two engines and runs 21 live runs; the suite
#: keeps a split sampler's runs on devices of its own (tests/live/test_in_flight_runs.py).
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

_PRELUDE = '''
import json
import jax
from orchestrator.engine import build_engine
from orchestrator.engine.mesh_shape import MeshConfig
from orchestrator.models.presets import load_preset
from orchestrator.live.placement import sampler_placement
from orchestrator.live.rollouts import LiveRollouts, LiveShape
from orchestrator.live.sampler import LiveSampler
from orchestrator.tasks.tasks import FirstLetter
from orchestrator.tasks.tokenizer import CharTokenizer
from orchestrator.loop.program import ProgramConfig, RLProgram
from orchestrator.loop.trainer_worker import TrainerWorker
from policies import Mode, StepBoundaryPolicy

STEPS, MICRO = 3, 2
TASK = FirstLetter(length=4, letters=8)

def sampler(preset, mesh, kind):
  return LiveSampler(load_preset(preset), CharTokenizer(), seed=0, max_prompt_length=16, max_generation_steps=1,
                     alphabet=TASK.answer_alphabet, placement=sampler_placement(kind, mesh, 2))

def run(engine, start, initial, smp, mode, staleness, source_cls=LiveRollouts):
  engine.restore(start)
  smp.sync(initial, 0)
  source = source_cls(smp, TASK, LiveShape(STEPS, MICRO, 2, 4, staleness, seed=3))
  policy = StepBoundaryPolicy(mode, wait_threshold_s=0.0)
  try:
    result = RLProgram(TrainerWorker(engine), policy, source, ProgramConfig(steps=STEPS, micro_batches_per_step=MICRO),
                       weight_sync=source.sync).run()
  finally:
    source.close()
  leaves = jax.tree.leaves(smp._sampler.transformer_state)
  held = {d.id for leaf in leaves for d in getattr(leaf, "value", leaf).devices()}
  rs = result.records
  return {"digest": result.summary.final_state_digest, "staged": [r.staged for r in rs[:-1]],
          "versions": [r.weights_version for r in rs], "bytes": [r.weight_sync_bytes for r in rs],
          "transfer_s": [r.weight_transfer_s for r in rs], "rewards": [r.reward_mean for r in rs],
          "reruns": sum(r.reruns or 0 for r in rs), "sampler_devices": sorted(held)}
'''

_CHILD = _PRELUDE + '''
mesh = MeshConfig(fsdp=2)
engine = build_engine("tiny", mesh={"fsdp": 2}, rows=4, learning_rate=3e-3)
start, initial = engine.snapshot(), engine.export_weights()
samplers = {kind: sampler("tiny", mesh, kind) for kind in ("shared", "split")}
out = {f"{kind} {s} {mode.value}": run(engine, start, initial, samplers[kind], mode, s)
       for kind in samplers for s in (0, 1) for mode in Mode}

class SkipsTheTransfer(LiveRollouts):
  """Negative control: every version's sync delivers the initial weights (the copy never happens)."""
  def sync(self, version, weights):
    return super().sync(version, initial)

out["skipped"] = run(engine, start, initial, samplers["split"], Mode.STAGE_BEFORE_UPDATE, 1, SkipsTheTransfer)
out["param_bytes"] = sum(x.nbytes for x in jax.tree.leaves(initial))

# MoE on an expert mesh, routing with a capacity that drops tokens, so micro-batches are re-run dropless.
mesh = MeshConfig(expert=2)
engine = build_engine("tiny_moe", mesh={"expert": 2}, rows=4, learning_rate=3e-3, ragged_buffer_factor=0.5,
                      retry_when_tokens_dropped=True)
start, initial = engine.snapshot(), engine.export_weights()
smp = sampler("tiny_moe", mesh, "split")
out["moe"] = {mode.value: run(engine, start, initial, smp, mode, 1) for mode in Mode}
print("RESULT " + json.dumps(out))
print("CHILD-OK")
'''


def _result(stdout: str) -> dict:
  line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
  return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def child():
  """Every scenario's runs, from one child process (one start of JAX; the engines compile once each)."""
  return _result(run_child(_CHILD, devices=4))


@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("kind", ["shared", "split"])
def test_every_mode_trains_to_one_digest_on_a_mesh(child, kind, staleness):
  runs = {key: run for key, run in child.items() if key.startswith(f"{kind} {staleness} ")}
  assert len(runs) == 4
  assert len({run["digest"] for run in runs.values()}) == 1, runs
  assert len({tuple(run["rewards"]) for run in runs.values()}) == 1


@pytest.mark.parametrize("staleness", [0, 1])
def test_both_placements_sample_the_same_rollouts_and_reach_the_same_digest(child, staleness):
  """The sampler's weights are replicated wherever it runs, so it computes what one device computes."""
  shared, split = child[f"shared {staleness} off"], child[f"split {staleness} off"]
  assert shared["rewards"] == split["rewards"] and shared["digest"] == split["digest"]
  assert child["shared 0 off"]["digest"] != child["shared 1 off"]["digest"]  # staleness changes what trains


def test_the_split_sampler_holds_its_weights_on_its_own_devices_and_the_sync_moves_them(child):
  split, shared = child["split 1 stage_before_update"], child["shared 1 stage_before_update"]
  assert split["sampler_devices"] == [2, 3] and shared["sampler_devices"] == [0, 1]
  # Every sync but the last step's copies the weights once per sampler device; the last step has a sync too.
  assert split["bytes"] == [2 * child["param_bytes"]] * 3
  assert all(t is not None and t > 0 for t in split["transfer_s"])
  assert shared["bytes"] == [None] * 3 and shared["transfer_s"] == [None] * 3


@pytest.mark.parametrize("mode", ["stage_before_update", "stage_after_update"])
def test_with_a_split_sampler_at_staleness_1_every_boundary_stages(child, mode):
  run = child[f"split 1 {mode}"]
  assert run["staged"] == [True] * 2 and run["versions"] == [0, 0, 1]
  assert child[f"split 0 {mode}"]["staged"] == [False] * 2  # on-policy: nothing can be staged


def test_a_sync_that_skips_the_transfer_changes_what_trains(child):
  """Negative control: the sampler reading the initial weights at every version is caught by the digest."""
  assert child["skipped"]["digest"] != child["split 1 stage_before_update"]["digest"]
  assert child["skipped"]["versions"] == [0, 0, 1]  # the versions alone would not show it


def test_a_live_moe_run_with_dropless_re_runs_keeps_one_digest_across_modes_on_a_mesh(child):
  runs = child["moe"]
  assert len({run["digest"] for run in runs.values()}) == 1, runs
  assert all(run["reruns"] > 0 for run in runs.values())  # micro-batches did drop tokens and were re-run
  assert all(run["staged"] == [True] * 2 for key, run in runs.items() if key.startswith("stage"))

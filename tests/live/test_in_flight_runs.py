"""In-flight weight updates end to end (``run_rl`` on the tiny model, the sampler in the loop's process): a run is a
function of its recipe (twice, in every step-boundary mode and with evaluations between chunks, one digest), its
records show the versions changing inside a generation exactly where the schedule says (and not where it says one
version) and the sampler's pauses for a sync, the key off is the run without it, a resume from a checkpoint
inside a generation reaches the uninterrupted digest, an extension the digest of a longer run, and a sampler on
devices of its own (split) or in a process of its own, and a remote trainer, the digest of the sampler and trainer
in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.app import cli
from orchestrator.live.rollout_batches import BatchSchedule
from tests.conftest import run_child

pytestmark = pytest.mark.e2e

STEPS = 5
#: One step a sampled batch, one sampler call a batch (four 1-token chunks of a 4-token answer), at staleness 2:
#: batch b's chunks sample with versions b - 2, b - 2, b - 1, b - 1 from step 2 on, and each boundary can stage
#: (its next call needs only the version synced before it). Two letters: a reversal is right by chance one time
#: in sixteen, so groups differ in reward and what is sampled moves the weights.
RUN = [f"steps={STEPS}", "task.name=reverse", "task.length=4", "task.letters=2", "rollouts.placement=shared", "rollouts.max_staleness=2",
       "rollouts.batch_steps=1", "engine.epochs=1", "rollouts.micro_batches_per_call=batch",
       "run.reserve_host_core=false", "metrics.samples_every=0", "task.eval_prompts=8"]
IN_FLIGHT = ["rollouts.in_flight_updates=true"]
MODES = {"STAGE_BEFORE_UPDATE": [], "STAGE_AFTER_UPDATE": ["step_boundary.stage_before_update=false"],
         "PIPELINED": ["step_boundary.stage_next_microbatch=false"], "OFF": ["step_boundary.pipeline_step_boundary=false"]}


def _run(out: Path, *overrides: str) -> Path:
  assert cli.main([*RUN, *overrides, "--out", str(out)]) == 0
  return out


def _digest(run: Path) -> str:
  return json.loads((_latest(run) / "summary.json").read_text())["final_state_digest"]


def _latest(run: Path) -> Path:
  """Where the run's latest segment wrote (``segments/N/`` after a resume, the run's directory before)."""
  segments = sorted((int(p.name), p) for p in (run / "segments").glob("*") if p.name.isdigit())
  return segments[-1][1] if segments else run


def _records(run: Path) -> list[dict]:
  return [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("in_flight")
  made = {mode: _run(root / mode, *IN_FLIGHT, *switches) for mode, switches in MODES.items()}
  made["again"] = _run(root / "again", *IN_FLIGHT)
  made["evaluated"] = _run(root / "evaluated", *IN_FLIGHT, "task.eval_every=2")
  made["off"] = _run(root / "off", "rollouts.in_flight_updates=false")
  made["without"] = _run(root / "without")
  return made


def test_two_runs_and_every_mode_train_to_one_digest(runs):
  digests = {name: _digest(runs[name]) for name in [*MODES, "again"]}
  assert len(set(digests.values())) == 1, digests
  # the modes differ where it matters: the default stages boundaries, OFF none
  assert any(r["staged"] for r in _records(runs["STAGE_BEFORE_UPDATE"]))
  assert not any(r["staged"] for r in _records(runs["OFF"]))


def test_records_show_each_steps_token_versions_as_the_schedule_gives_them(runs):
  """Steps 0 and 1 sample with version 0 throughout (the schedule gives their batches one version: the negative
  control, min == max); from step 2 on a generation's later chunks take the next version (min < max)."""
  schedule = BatchSchedule(micro_batches_per_step=2, generations_per_group=4, max_staleness=2, in_flight_updates=True,
                           micro_batches_per_call=2, chunks_per_call=4)
  for name in MODES:
    records = _records(runs[name])
    assert [(r["token_version_min"], r["token_version_max"]) for r in records] == [
        (min(schedule.call_versions(step, 0)), max(schedule.call_versions(step, 0))) for step in range(STEPS)]
    assert [(r["token_version_min"], r["token_version_max"]) for r in records] == [(0, 0), (0, 0), (0, 1), (1, 2),
                                                                                   (2, 3)]
    assert [r["weights_version"] for r in records] == [0, 0, 0, 1, 2]  # the batch's own: its oldest tokens'
    assert [r["token_age_mean"] for r in records] == [0.0, 1.0, 1.5, 1.5, 1.5]
    assert all(r["sampler_sync_wait_s"] >= 0.0 for r in records)  # the sampler's pauses for a sync, recorded


def test_the_key_off_is_the_run_without_it_and_on_it_changes_what_trains(runs):
  assert any(r["reward_mean"] > 0 for r in _records(runs["off"]))  # the rollouts move the weights
  assert _digest(runs["off"]) == _digest(runs["without"])
  assert _digest(runs["off"]) != _digest(runs["again"])  # negative control: in-flight updates do change the run
  assert all(r["token_version_min"] is None and r["token_version_max"] is None and r["sampler_sync_wait_s"] >= 0.0
             for r in _records(runs["off"]))


def test_evaluations_between_chunks_leave_what_trains_alone(runs):
  """An evaluation at a boundary takes the sampler while a generation waits for that boundary's sync (the
  generation's wait holds no turn on it): the run ends, evaluated, at the digest of the run without them."""
  evaluated = _records(runs["evaluated"])
  assert [r["eval_accuracy"] is not None for r in evaluated] == [step % 2 == 1 for step in range(STEPS)]
  assert _digest(runs["evaluated"]) == _digest(runs["again"])


def test_a_resume_inside_a_generation_reaches_the_uninterrupted_digest(runs, tmp_path):
  """``checkpoint.every=2``: the position before step 2 cuts batch 3's generation after its second chunk, and the
  one before step 4 cuts batch 5's (past the end, for an extension), so each checkpoint carries a generation part
  sampled. The run trains to the digest of the run without checkpoints, and resumed from either checkpoint (the
  later ones removed) to that digest again, every step recorded once."""
  import shutil

  run = _run(tmp_path / "checkpointed", *IN_FLIGHT, "checkpoint.every=2")
  assert _digest(run) == _digest(runs["again"])
  for kept in (2, 4):
    copy = tmp_path / f"from_{kept}"
    shutil.copytree(run, copy)
    for checkpoint in (copy / "checkpoints").iterdir():
      if checkpoint.name.isdigit() and int(checkpoint.name) > kept:
        shutil.rmtree(checkpoint)
    assert cli.main(["--resume", str(copy)]) == 0
    assert _latest(copy) != copy and _digest(copy) == _digest(runs["again"]), kept
    assert [r["step"] for r in _records(_latest(copy))] == list(range(kept, STEPS))


def test_an_in_flight_run_extended_from_its_last_checkpoint_trains_like_a_longer_run(tmp_path):
  """The last step's checkpoint carries batch 6's generation up to its cut (past the end: its later chunks need
  version 5, which an extension's first sync delivers): extended by two steps, the run reaches the digest of a
  run two steps longer."""
  longer = _run(tmp_path / "longer", *IN_FLIGHT, f"steps={STEPS + 2}")
  run = _run(tmp_path / "extended", *IN_FLIGHT)
  assert cli.main(["--resume", str(run), "--steps", str(STEPS + 2)]) == 0
  assert _latest(run) != run and _digest(run) == _digest(longer)
  assert [r["step"] for r in _records(_latest(run))] == [STEPS, STEPS + 1]


def test_a_sampler_on_devices_of_its_own_takes_in_flight_updates_to_the_same_digest(runs, tmp_path):
  """``rollouts.placement=split`` (a child with two forced host devices: the trainer on the first, the sampler on
  the second): each version is copied onto the sampler's device at its sync and reaches the generation under way
  between chunks exactly as with the sampler on the trainer's device, so the run reaches the shared run's digest
  with the same versions per token; its records say the copy ran and that no sampling ran on the trainer's
  device."""
  out = tmp_path / "split"
  code = (f"import sys\nfrom orchestrator.app import cli\n"
          f"assert cli.main({[*RUN, *IN_FLIGHT, 'rollouts.placement=split', '--out', str(out)]!r}) == 0\n"
          "print('CHILD-OK')\n")
  run_child(code, devices=2)
  assert _digest(out) == _digest(runs["STAGE_BEFORE_UPDATE"])
  records = _records(out)
  assert [(r["token_version_min"], r["token_version_max"]) for r in records] == [
      (r["token_version_min"], r["token_version_max"]) for r in _records(runs["STAGE_BEFORE_UPDATE"])]
  assert all(r["weight_transfer_s"] is not None for r in records[:-1])
  assert all(r["sampling_on_trainer_devices_s"] is None for r in records)
  assert all(r["sampling_on_trainer_devices_s"] is not None for r in _records(runs["STAGE_BEFORE_UPDATE"]))


def test_a_remote_trainer_s_versions_reach_the_generation_under_way_to_the_local_digest(runs, tmp_path):
  """``trainer.location=remote`` (a spawned trainer behind gRPC): each version comes over the wire at the sync
  and reaches the driver's generation under way between chunks, as a local trainer's does: the local run's
  digest and token versions, and every sync's wire bytes recorded (none in the local run)."""
  out = _run(tmp_path / "remote", *IN_FLIGHT, "trainer.location=remote", "trainer.spawn=true")
  assert _digest(out) == _digest(runs["STAGE_BEFORE_UPDATE"])
  records, local = _records(out), _records(runs["STAGE_BEFORE_UPDATE"])
  assert [(r["token_version_min"], r["token_version_max"]) for r in records] == [
      (r["token_version_min"], r["token_version_max"]) for r in local]
  assert all(r["weight_sync_wire_bytes"] for r in records) and not any(r["weight_sync_wire_bytes"] for r in local)


def test_a_sampler_in_a_process_of_its_own_takes_in_flight_updates_to_the_same_digest(runs, tmp_path):
  """``rollouts.placement=process``: the sampler's process asks the loop for each chunk's weights, and the
  evaluations between chunks go to it while a chunk waits: the run reaches the shared run's digest (with the same
  evaluations) and token versions; no sampling runs on the trainer's devices."""
  out = _run(tmp_path / "process", *IN_FLIGHT, "rollouts.placement=process", "task.eval_every=2")
  assert _digest(out) == _digest(runs["evaluated"])
  records, shared = _records(out), _records(runs["evaluated"])
  assert [(r["token_version_min"], r["token_version_max"]) for r in records] == [
      (r["token_version_min"], r["token_version_max"]) for r in shared]
  assert [r["eval_accuracy"] for r in records] == [r["eval_accuracy"] for r in shared]
  assert any(r["eval_accuracy"] is not None for r in records)
  assert all(r["sampling_on_trainer_devices_s"] is None for r in records)

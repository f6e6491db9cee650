"""The in-flight updates benchmark: what it reads from a run's records, its summary over rounds, its refusals, and
two arms end to end on the tiny recipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.bench import in_flight
from tests.conftest import REPO


def _run_dir(path, rewards, *, pause_s=0.25, digest="d1", step_s=0.5):
  """A run directory whose steps each take ``step_s`` from the first step's start, with these rewards."""
  path.mkdir()
  records = [{"step": i, "t_update_ready": 10.0 + step_s * (i + 1), "step_s": step_s, "reward_mean": r,
              "completion_tokens_mean": 4.0, "sampler_sync_wait_s": pause_s if i else None,
              "rollout_wait_s": 0.125, "micro_batch_wait_s": 0.0} for i, r in enumerate(rewards)]
  (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  (path / "summary.json").write_text(json.dumps({"final_state_digest": digest, "eval_accuracy_end": 0.5}))
  return path


@pytest.mark.spec
def test_a_runs_metrics_are_read_from_its_records(tmp_path):
  """Seconds to reward run from the first step's start to the update of the first step whose trailing mean
  reaches the threshold; a pause of None (a step that waited for nothing measured) counts as none."""
  run = _run_dir(tmp_path / "run", [0.0, 0.0, 0.5, 0.5, 1.0, 1.0])
  m = in_flight.run_metrics(run, reward=0.5, window=2, completions_per_step=8)
  assert m["step_reward_reached"] == 3 and m["seconds_to_reward"] == 2.0  # steps 2, 3: mean 0.5, at 4 x 0.5 s
  assert m["run_s"] == 3.0 and m["sampler_pause_s"] == 1.25 and m["sampler_pause_share"] == 1.25 / 3.0
  assert m["tokens_per_s"] == 6 * 4.0 * 8 / 3.0 and m["trainer_rollout_wait_s"] == 0.75
  assert m["reward_last_steps"] == 1.0 and m["final_state_digest"] == "d1"
  never = in_flight.run_metrics(_run_dir(tmp_path / "never", [0.0, 0.25, 0.25]), reward=0.5, window=2,
                                completions_per_step=8)
  assert never["seconds_to_reward"] is None and never["step_reward_reached"] is None  # negative control


@pytest.mark.spec
def test_a_batch_trained_twice_counts_its_sampling_once(tmp_path):
  """With two passes over each batch of two steps, steps 2, 3 (and 6, 7, ...) retrain what steps 0, 1 sampled:
  their records repeat the batch's pause and tokens, which count once."""
  run = _run_dir(tmp_path / "run", [0.0] * 8, pause_s=0.5)
  once = in_flight.run_metrics(run, reward=0.5, window=2, completions_per_step=8, batch_steps=2, epochs=2)
  every = in_flight.run_metrics(run, reward=0.5, window=2, completions_per_step=8)
  assert once["sampler_pause_s"] == 3 * 0.5 and once["tokens_per_s"] == 4 * 4.0 * 8 / 4.0  # steps 0, 1, 4, 5
  assert every["sampler_pause_s"] == 7 * 0.5  # negative control: every record counted


@pytest.mark.spec
def test_the_summary_gives_each_metrics_median_and_range_and_flags_a_rerun_that_differs():
  rounds = [{"seconds_to_reward": s, "sampler_pause_s": p, "sampler_pause_share": 0.1, "tokens_per_s": 100.0,
             "trainer_rollout_wait_s": 0.0, "run_s": 3.0, "median_step_s": 0.1, "reward_last_steps": 0.5,
             "eval_accuracy_end": None, "final_state_digest": d}
            for s, p, d in [(1.0, 0.5, "a"), (None, 0.25, "b"), (3.0, 1.0, "c")]]
  summary = in_flight.summarize({"same": rounds, "differs": rounds},
                                {"same": dict(rounds[0]), "differs": dict(rounds[0], final_state_digest="b")})
  assert summary["same"]["seconds_to_reward"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 2}
  assert summary["same"]["sampler_pause_s"] == {"median": 0.5, "min": 0.25, "max": 1.0, "n": 3}
  assert summary["same"]["reward_reached"] == 2 and summary["same"]["eval_accuracy_end"] is None
  assert summary["same"]["rerun_same_digest"] and not summary["differs"]["rerun_same_digest"]
  assert summary["differs"]["digests"] == ["a", "b", "c"] and summary["differs"]["rerun_digest"] == "b"


@pytest.mark.spec
@pytest.mark.parametrize("args, named", [
    (["--seeds", "1", "1"], "--seeds 1 1"), (["--seeds", "-1"], "--seeds -1"), (["--steps", "0"], "--steps 0"), (["--reward", "1.5"], "--reward 1.5"),
    (["--window", "0"], "--window 0"), (["--window", "61"], "--window 61"),
    (["--recipe", "no-such.yaml"], "no-such.yaml"), (["--recipe", str(REPO / "recipes/replay_small.yaml")], "arm"),
])
def test_bad_arguments_are_refused_in_one_line_before_anything_runs(args, named, tmp_path, capsys):
  out = tmp_path / "bench"
  assert in_flight.main([*args, "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and named in err and not out.exists()


@pytest.mark.spec
def test_a_recipe_the_steps_asked_for_make_invalid_is_refused_before_anything_runs(tmp_path, capsys):
  """The arms are checked with ``--steps`` applied: a warm-up longer than the run is refused here, not by the
  first arm's run_rl after the output directory exists."""
  recipe = tmp_path / "warm.yaml"
  recipe.write_text((REPO / "recipes/live_in_flight.yaml").read_text().replace("engine:\n", "engine:\n  warmup_steps: 5\n"))
  out = tmp_path / "bench"
  assert in_flight.main(["--recipe", str(recipe), "--steps", "3", "--window", "2", "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "engine.warmup_steps=5" in err and not out.exists()


@pytest.mark.spec
def test_an_arm_that_fails_ends_the_benchmark_in_one_line_naming_it_and_its_output(tmp_path, capsys, monkeypatch):
  """Each arm runs without this shell's step-boundary switches (the recipe and the arm's overrides alone, as
  checked); a run that exits non-zero stops the benchmark with exit 1 and one line."""
  calls = []

  def fake_run(command, *, env, **kwargs):
    calls.append((command, env))
    return subprocess.CompletedProcess(command, 3)

  monkeypatch.setattr(in_flight.subprocess, "run", fake_run)
  monkeypatch.setenv("STAGE_BEFORE_UPDATE", "0")
  out = tmp_path / "bench"
  assert in_flight.main(["--out", str(out), "--seeds", "4"]) == 1
  err = capsys.readouterr().err.strip()
  assert err == f"bench.in_flight: arm boundary_s0, seed 4: run_rl exited 3; its output: {out / 'seed4-boundary_s0.log'}"
  (command, env), = calls
  assert "STAGE_BEFORE_UPDATE" not in env and "PATH" in env
  assert command[-5:] == ["rollouts.in_flight_updates=false", "rollouts.max_staleness=0", "engine.seed=4",
                          "rollouts.seed=4", "steps=60"]


@pytest.mark.spec
def test_an_existing_out_directory_is_refused_and_left_as_it_was(tmp_path, capsys):
  out = tmp_path / "bench"
  out.mkdir()
  (out / "report.json").write_text("another benchmark's")
  assert in_flight.main(["--out", str(out)]) == 2
  assert "--out" in capsys.readouterr().err and (out / "report.json").read_text() == "another benchmark's"


@pytest.mark.e2e
@pytest.mark.slow  # four run_rl processes, one after another
def test_two_arms_run_interleaved_and_a_rerun_reaches_each_arms_digest(tmp_path):
  """Batch-boundary updates at staleness 0 and in-flight updates at 2, four steps, one seed and its rerun: each
  run's directory and line, the table and report.json; the arms train differently (in-flight updates change what
  the sampler samples with) and each rerun reaches its arm's digest."""
  out = tmp_path / "bench"
  env = dict(os.environ, PYTHONPATH=str(REPO))
  code = ("import sys; from orchestrator.bench import in_flight as b; "
          "b.ARMS = {k: b.ARMS[k] for k in ('boundary_s0', 'in_flight_s2')}; "
          "sys.exit(b.main(sys.argv[1:]))")
  proc = subprocess.run([sys.executable, "-c", code, "--steps", "4", "--seeds", "5", "--window", "2",
                         "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((out / "report.json").read_text())
  assert list(report["summary"]) == ["boundary_s0", "in_flight_s2"] and report["steps"] == 4
  for arm in ("boundary_s0", "in_flight_s2"):
    for name in ("seed5", "rerun-seed5"):
      assert (out / f"{name}-{arm}" / "records.jsonl").exists() and f"{name} {arm}: " in proc.stdout
    assert report["summary"][arm]["rerun_same_digest"] and report["summary"][arm]["sampler_pause_s"]["min"] >= 0.0
    assert json.loads((out / f"seed5-{arm}" / "config.json").read_text())["config"]["rollouts"]["seed"] == 5
  assert report["summary"]["boundary_s0"]["digests"] != report["summary"]["in_flight_s2"]["digests"]
  assert "boundary_s0" in proc.stdout.split("\nrerun-seed5 in_flight_s2")[1]  # the table, after the runs
  assert json.loads(proc.stdout.splitlines()[-1])["summary"] == report["summary"]  # one JSON object last

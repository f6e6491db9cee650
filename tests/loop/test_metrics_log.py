"""Metrics where users look: TensorBoard events in the run directory, the trace's tracks, the progress display.

Event files are read back record by record (TFRecord framing, ``tensorboardX``'s
``Event`` proto): neither TensorBoard nor TensorFlow is installed here.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from tensorboardX.proto import event_pb2
from tqdm import tqdm

from orchestrator import recipe as recipe_lib
from orchestrator.app import cli, console
from orchestrator.loop import metrics_log
from orchestrator.loop.metrics_log import SCALARS, TENSORBOARD_DIR
from orchestrator.loop.recorder import BoundaryRecord
from orchestrator.loop.trace import chrome_trace
from orchestrator.recipe import schema
from orchestrator.run_files import run_dir
from tests.conftest import REPO

SYNTHETIC = ["model=tiny", "rollouts.source=synthetic", "batch.rows=4", "batch.micro_batches_per_step=2",
             "run.reserve_host_core=false"]


@pytest.fixture(autouse=True)
def _no_env_switches(monkeypatch):
  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)


def read_events(path: Path) -> list[event_pb2.Event]:
  """Every event of one event file (each record: length, its CRC, the data, the data's CRC)."""
  data, events, at = path.read_bytes(), [], 0
  while at < len(data):
    (length,) = struct.unpack("<Q", data[at:at + 8])
    events.append(event_pb2.Event.FromString(data[at + 12:at + 12 + length]))
    at += 12 + length + 4
  return events


def event_files(directory: Path) -> list[Path]:
  return sorted(directory.glob("events.out.tfevents.*"))


def read_scalars(directory: Path) -> dict[str, dict[int, float]]:
  """{tag: {step: value}} over the event files in ``directory``."""
  out: dict[str, dict[int, float]] = {}
  for path in event_files(directory):
    for event in read_events(path):
      for value in event.summary.value:
        out.setdefault(value.tag, {})[event.step] = value.simple_value
  return out


def _records(directory: Path) -> list[BoundaryRecord]:
  return [BoundaryRecord.from_json(json.loads(line)) for line in (directory / "records.jsonl").read_text().splitlines()]


def _assert_events_match_records(directory: Path, records: list[BoundaryRecord]) -> dict:
  """Every scalar of every record is in ``directory``'s events, at the record's step, as ``SCALARS`` computes it
  (event values are float32)."""
  logged = read_scalars(directory / TENSORBOARD_DIR)
  for record in records:
    for name, value in metrics_log.scalars(record).items():
      assert logged[name][record.step] == pytest.approx(value, rel=1e-6, abs=1e-30), (name, record.step)
  return logged


@pytest.mark.e2e
def test_a_run_writes_every_steps_scalars_to_tensorboard_in_its_directory(tmp_path):
  run = tmp_path / "run"
  assert cli.main(SYNTHETIC + ["steps=3", "--out", str(run)]) == 0
  (events,) = event_files(run / TENSORBOARD_DIR)
  logged = _assert_events_match_records(run, _records(run))
  steps = [0, 1, 2]
  for name in ("boundary/idle_s", "boundary/idle_strict_s"):  # none after the last step
    assert sorted(logged[name]) == steps[:-1]
  for name in ("timing/step_s", "timing/update_s", "timing/micro_batch_s", "train/loss", "train/grad_norm",
               "train/tokens_per_s", "boundary/staged"):
    assert sorted(logged[name]) == steps, name
  assert not [name for name in logged if name.startswith("rollout/")]  # not a live run
  assert events.stat().st_size > 0


@pytest.mark.e2e
def test_a_live_run_logs_its_rewards(tmp_path):
  """The default recipe (the live loop), cut to four steps, its sampler in this process (where it runs is not
  what this tests)."""
  run = tmp_path / "run"
  assert cli.main(["steps=4", "task.eval_prompts=4", "run.reserve_host_core=false", "metrics.samples_every=2",
                   "rollouts.placement=shared", "--out", str(run)]) == 0
  logged = _assert_events_match_records(run, _records(run))
  # a few completions of steps 0 and 2 (the cadence) and 3 (the last, whatever the cadence), to read, in
  # samples.jsonl and in TensorBoard's text tab
  samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
  assert [s["step"] for s in samples] == [0] * 4 + [2] * 4 + [3] * 4
  assert all(s["prompt"].startswith("1st:") and len(s["completion"]) == 1 and s["truncated"] is None
             for s in samples)
  texts = [v.tensor.string_val[0].decode() for path in event_files(run / TENSORBOARD_DIR)
           for event in read_events(path) for v in event.summary.value if v.tag.startswith("samples")]
  assert len(texts) == 3 and json.dumps(samples[0]["prompt"]) in texts[0]
  for name in ("rollout/reward_mean", "rollout/reward_std", "rollout/accuracy", "rollout/staleness",
               "rollout/sampled_tokens_per_s", "train/loss", "timing/step_s", "train/ppo_kl",
               "rollout/reward_group_std", "rollout/frac_reward_zero_std", "rollout/sampler_sync_wait_s"):
    assert sorted(logged[name]) == [0, 1, 2, 3], name
  assert sorted(logged["boundary/idle_s"]) == [0, 1, 2]
  trace = json.loads((run / "trace.json").read_text())["traceEvents"]
  rewards = [e["args"]["reward"] for e in trace if e["ph"] == "C" and e["name"] == "reward"]
  assert rewards == [r.reward_mean for r in _records(run)]


@pytest.mark.e2e
def test_no_backends_writes_no_event_file(tmp_path):
  """The negative control: the same run with metrics.backends=[] writes no tensorboard directory."""
  run = tmp_path / "run"
  assert cli.main(SYNTHETIC + ["steps=2", "metrics.backends=[]", "--out", str(run)]) == 0
  assert (run / "records.jsonl").is_file()
  assert not (run / TENSORBOARD_DIR).exists() and not list(run.rglob("events.out.tfevents.*"))


@pytest.mark.e2e
def test_a_resumed_segment_logs_in_its_own_directory_and_leaves_the_earlier_events_alone(tmp_path):
  run = tmp_path / "run"
  assert cli.main(SYNTHETIC + ["steps=2", "checkpoint.every=2", "--out", str(run)]) == 0
  (first,) = event_files(run / TENSORBOARD_DIR)
  before = hashlib.sha256(first.read_bytes()).hexdigest()
  assert cli.main(["--resume", str(run), "--steps", "4"]) == 0
  segment = run_dir.latest_segment(run)
  assert segment != run
  assert event_files(run / TENSORBOARD_DIR) == [first]
  assert hashlib.sha256(first.read_bytes()).hexdigest() == before
  logged = _assert_events_match_records(segment, _records(segment))
  assert sorted(logged["timing/step_s"]) == [2, 3]  # the global steps continue
  assert sorted(read_scalars(run / TENSORBOARD_DIR)["timing/step_s"]) == [0, 1]


REFUSALS = [
    ("unknown", "metrics.backends=[tensorboard, mlflow]",
     "metrics.backends=['tensorboard', 'mlflow']: 'mlflow' is not a metrics backend; use a list of tensorboard, wandb"),
    ("twice", "metrics.backends=tensorboard,tensorboard", "names a backend twice"),
    ("wandb-missing", "metrics.backends=[wandb]",
     "metrics.backends=['wandb']: the wandb package is not installed; pip install wandb, or drop wandb"),
]


@pytest.mark.e2e
@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_bad_backends_are_refused_in_one_line_writing_nothing(case, tmp_path, capsys, monkeypatch):
  _, override, message = case
  if "wandb" in override:  # whether or not it is installed where the suite runs
    monkeypatch.setattr(schema, "_importable", lambda package: False)
  out = tmp_path / "out"
  code = cli.main(SYNTHETIC + [override, "--out", str(out)])
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.strip()]
  assert code == 2 and len(lines) == 1 and lines[0].startswith("run_rl: error:"), err
  assert message in lines[0]
  assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the table, the trace, the progress
def _record(**changed) -> BoundaryRecord:
  fields = dict(step=4, mode="stage_before_update", staged=True, stage_before_update=True, probe=False, reason="",
                actions=[], stage_s=0.003, device_wait_s=0.5, low_wait=False, transition=None, update_s=0.06,
                boundary_idle_s=0.0001, boundary_idle_strict_s=0.002, step_s=0.25, micro_batch_s=[0.1, 0.3],
                metrics_s=None, metrics_wait_s=None, checkpoint_s=None, checkpoint_path=None, weight_sync_s=None,
                staged_digest=None, loss=0.47, grad_norm=1.5, tokens=1000, reruns=None, rerun_micro_batches=None,
                dropped_tokens=None, t_update_ready=2.0, t_next_first_dispatch=2.0001, rollout_wait_s=0.058,
                weights_version=3, staleness=1, reward_mean=0.172, reward_std=0.3, accuracy=0.125,
                sampled_tokens_per_s=1234.0, micro_batch_wait_s=0.004, staged_bytes_per_device=[100, 200],
                saving_s=0.0012, learning_rate=0.001, entropy=1.25, clip_fraction=0.125, kl=0.01, reward_min=0.0, reward_max=1.0, completion_tokens_mean=3.5,
                completion_tokens_max=6, truncated_fraction=0.25, eval_accuracy=0.75, eval_pass_at_k=0.875,
                eval_s=0.04, ppo_kl=0.002, reward_group_std=0.25, frac_reward_zero_std=0.5, token_version_min=2,
                token_version_max=3, token_age_mean=1.25, sampler_sync_wait_s=0.375)
  fields.update(changed)
  return BoundaryRecord(**fields)


@pytest.mark.engine
def test_the_scalar_table_computes_each_name_from_the_record():
  assert metrics_log.scalars(_record()) == {
      "boundary/idle_s": 0.0001, "boundary/idle_strict_s": 0.002, "boundary/stage_s": 0.003,
      "boundary/device_wait_s": 0.5, "boundary/staged": 1.0, "boundary/saving_s": 0.0012, "timing/step_s": 0.25, "timing/update_s": 0.06,
      "timing/micro_batch_s": 0.2, "train/loss": 0.47, "train/grad_norm": 1.5, "train/learning_rate": 0.001, "train/entropy": 1.25, "train/clip_fraction": 0.125, "train/kl": 0.01, "train/ppo_kl": 0.002,
      "rollout/reward_group_std": 0.25, "rollout/frac_reward_zero_std": 0.5, "rollout/token_version_min": 2.0,
      "rollout/token_version_max": 3.0, "rollout/token_age_mean": 1.25, "rollout/sampler_sync_wait_s": 0.375,
      "train/tokens_per_s": 4000.0, "rollout/reward_mean": 0.172, "rollout/reward_std": 0.3, "rollout/reward_min": 0.0,
      "rollout/reward_max": 1.0, "rollout/completion_tokens_mean": 3.5, "rollout/completion_tokens_max": 6.0,
      "rollout/truncated_fraction": 0.25, "rollout/accuracy": 0.125, "rollout/staleness": 1.0,
      "rollout/wait_s": 0.058, "rollout/sampled_tokens_per_s": 1234.0, "rollout/micro_batch_wait_s": 0.004,
      "memory/staged_bytes": 300.0, "eval/accuracy": 0.75, "eval/pass_at_k": 0.875, "eval/seconds": 0.04}
  bare = _record(eval_accuracy=None, eval_pass_at_k=None, eval_s=None, staged=False, stage_s=None, device_wait_s=None, boundary_idle_s=None, boundary_idle_strict_s=None,
                 grad_norm=None, tokens=None, rollout_wait_s=None, weights_version=None, staleness=None,
                 reward_mean=None, reward_std=None, accuracy=None, sampled_tokens_per_s=None,
                 micro_batch_wait_s=None, staged_bytes_per_device=None, saving_s=None, learning_rate=None, entropy=None, clip_fraction=None, kl=None,
                 reward_min=None, reward_max=None, completion_tokens_mean=None, completion_tokens_max=None,
                 truncated_fraction=None, ppo_kl=None, reward_group_std=None, frac_reward_zero_std=None,
                 token_version_min=None, token_version_max=None, token_age_mean=None, sampler_sync_wait_s=None)
  assert set(metrics_log.scalars(bare)) == {"boundary/staged", "timing/step_s", "timing/update_s",
                                            "timing/micro_batch_s", "train/loss"}
  assert set(metrics_log.scalars(_record())) == set(SCALARS)


@pytest.mark.spec
def test_a_steps_scalars_are_one_event_and_a_step_without_any_writes_none(tmp_path):
  """One summary of many values per step, as TensorBoard reads it (an event per scalar cost most of a millisecond
  of host time a step); the values and steps are the ones written, and the text goes in an event of its own."""
  log = metrics_log.TensorBoardLog(tmp_path)
  log.write(3, {"train/loss": 0.5, "timing/step_s": 0.25, "boundary/staged": 1.0})
  log.write(4, {})
  log.write(5, {"train/loss": 0.25})
  log.write_text(5, "samples", "a sample")
  log.close()
  events = [e for path in event_files(tmp_path) for e in read_events(path) if e.HasField("summary")]
  assert [(e.step, [v.tag for v in e.summary.value]) for e in events] == [
      (3, ["train/loss", "timing/step_s", "boundary/staged"]), (5, ["train/loss"]), (5, ["samples/text_summary"])]
  assert read_scalars(tmp_path)["train/loss"] == {3: 0.5, 5: 0.25}


@pytest.mark.spec
def test_an_moe_models_steps_add_dropped_tokens_and_reruns_and_a_dense_models_do_not():
  record = _record(dropped_tokens=[3, 0], reruns=1, rerun_micro_batches=[0])
  assert {k: v for k, v in metrics_log.scalars(record, moe=True).items() if k.startswith("moe/")} == {
      "moe/dropped_tokens": 3.0, "moe/reruns": 1.0}
  assert not [name for name in metrics_log.scalars(record) if name.startswith("moe/")]  # a dense model's


@pytest.mark.e2e
def test_an_moe_run_logs_dropped_tokens_and_reruns_per_step(tmp_path):
  run = tmp_path / "run"
  assert cli.main(["model=tiny_moe", *SYNTHETIC[1:], "steps=2", "engine.ragged_buffer_factor=0.9",
                   "engine.retry_when_tokens_dropped=true", "--out", str(run)]) == 0
  logged, records = read_scalars(run / TENSORBOARD_DIR), _records(run)
  assert logged["moe/reruns"] == {r.step: float(r.reruns) for r in records}
  assert logged["moe/dropped_tokens"] == {r.step: float(sum(r.dropped_tokens)) for r in records}


@pytest.mark.engine
def test_closing_the_log_twice_writes_the_events_once(tmp_path):
  log = metrics_log.open_metrics_log(["tensorboard"], tmp_path, run_name="r")
  log(_record(step=0))
  log(_record(step=1, loss=0.25))
  log.close()
  log.close()
  assert read_scalars(tmp_path / TENSORBOARD_DIR)["train/loss"] == {0: pytest.approx(0.47), 1: 0.25}
  assert metrics_log.open_metrics_log([], tmp_path / "none", run_name="r") is None
  assert not (tmp_path / "none").exists()


@pytest.mark.engine
def test_the_trace_names_device_slices_by_kind_and_draws_counters():
  watched = [SimpleNamespace(kind="fwd_bwd", step=4, micro_step=i, dispatched_at=1.0 + i, ready_at=1.5 + i)
             for i in range(2)] + [SimpleNamespace(kind="update", step=4, micro_step=-1, dispatched_at=2.5,
                                                   ready_at=3.0)]
  events = chrome_trace(watched, [], [_record(), _record(step=5, reward_mean=None, rollout_wait_s=None)], 0.0)
  events = events["traceEvents"]
  slices = [(e["name"], e["args"]) for e in events if e["ph"] == "X" and e.get("cat") != "idle"]
  assert slices == [("fwd_bwd", {"step": 4, "micro_step": 0}), ("fwd_bwd", {"step": 4, "micro_step": 1}),
                    ("update", {"step": 4, "micro_step": -1})]
  counters = [(e["name"], e["ts"], e["args"]) for e in events if e["ph"] == "C"]
  assert counters == [("loss", 2e6, {"loss": 0.47}), ("reward", 2e6, {"reward": 0.172}),
                      ("rollout wait (s)", 2e6, {"rollout wait (s)": 0.058}), ("loss", 2e6, {"loss": 0.47})]


@pytest.mark.engine
@pytest.mark.parametrize("elapsed", [21.0, 3725.0])
def test_a_live_bars_step_time_reward_and_accuracy_fit_in_80_columns(elapsed):
  line = tqdm.format_meter(150, 300, elapsed, ncols=80, prefix="default", unit="step", bar_format=console.BAR_FORMAT,
                           postfix=console.progress_postfix(_record()))
  assert len(line) <= 80 and "step=0.250s reward=0.172 acc=0.12" in line, line


@pytest.mark.engine
def test_off_a_terminal_progress_is_a_plain_line_every_twentieth_of_the_run():
  assert [console.plain_every(n) for n in (1, 20, 21, 300, 1000)] == [1, 1, 2, 15, 50]
  stream = io.StringIO()
  progress = console.Progress("default", total=300, initial=0, stream=stream)  # a StringIO is no terminal
  for step in range(300):
    progress(_record(step=step))
  progress.close()
  lines = stream.getvalue().splitlines()
  assert len(lines) == 20 and progress.bar is None
  assert lines[0].startswith("[progress] default: step 15/300 step_s=0.250 ") and "reward=0.172" in lines[0]
  assert lines[-1].startswith("[progress] default: step 300/300 ")
  resumed = io.StringIO()
  progress = console.Progress("default", total=5, initial=3, stream=resumed)
  for step in (3, 4):
    progress(_record(step=step))
  assert [line.split(" step_s")[0] for line in resumed.getvalue().splitlines()] == [
      "[progress] default: step 4/5", "[progress] default: step 5/5"]


@pytest.mark.e2e
def test_the_metrics_log_loads_no_jax():
  """A remote trainer's driver runs without JAX, and logs its metrics all the same."""
  code = ("import sys\nimport orchestrator.loop.metrics_log\n"
          "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.spec
def test_the_progress_is_the_step_progress_build_run_takes_and_moves_logging_above_its_bar_only():
  """``console.Progress`` fills ``app.run.StepProgress``; while the program runs, log lines go through tqdm where
  there is a bar, and where they went where there is none. Negative control: an object without
  ``logging_redirected`` is no ``StepProgress``."""
  import logging

  from orchestrator.app.run import StepProgress
  from tqdm.contrib.logging import _TqdmLoggingHandler

  plain = console.Progress("default", total=3, stream=io.StringIO())
  bar = console.Progress("default", total=3, stream=io.StringIO(), terminal=True)
  assert isinstance(plain, StepProgress) and isinstance(bar, StepProgress)
  assert not isinstance(SimpleNamespace(close=lambda: None), StepProgress)
  root = logging.getLogger()
  before = list(root.handlers)
  with plain.logging_redirected():
    assert root.handlers == before
  with bar.logging_redirected():
    assert any(isinstance(h, _TqdmLoggingHandler) for h in root.handlers)
  assert root.handlers == before
  bar.close()

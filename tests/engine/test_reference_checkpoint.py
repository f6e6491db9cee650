"""``model.reference_checkpoint``: the KL term's frozen reference read from a checkpoint of the model's family
and sizes, instead of the weights the run starts from."""

from __future__ import annotations

import json

import pytest

from orchestrator.app import cli
from tests.checkpoint_files import preset_tensors, write_directory

RUN = ["rollouts.source=synthetic", "batch.micro_batches_per_step=2", "run.reserve_host_core=false", "steps=3",
       "engine.kl_beta=0.5", "metrics.backends=[]"]


def _run(tmp_path, name, *extra):
  out = tmp_path / f"run-{name}"
  assert cli.main([*RUN, *extra, "--out", str(out)]) == 0
  records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
  return json.loads((out / "summary.json").read_text())["final_state_digest"], [r["kl"] for r in records]


@pytest.mark.e2e
def test_the_reference_is_the_checkpoint_named_and_by_default_the_start(tmp_path):
  """The model's own checkpoint named as the reference trains exactly as the default reference (the start);
  another checkpoint of the same sizes makes the KL at step 0 positive and the run train otherwise."""
  model = write_directory(tmp_path / "model")
  other = write_directory(tmp_path / "other", preset_tensors(seed=7))
  start = [f"model.checkpoint={model}"]
  default_digest, default_kl = _run(tmp_path, "default", *start)
  same_digest, same_kl = _run(tmp_path, "same", *start, f"model.reference_checkpoint={model}")
  other_digest, other_kl = _run(tmp_path, "other", *start, f"model.reference_checkpoint={other}")
  assert default_kl[0] == pytest.approx(0, abs=1e-6) and same_kl == default_kl and same_digest == default_digest
  assert other_kl[0] > 1e-3 and other_digest != default_digest
  # each run names the digests of the weights it loaded, the reference's beside the policy's
  same, other = (json.loads((tmp_path / f"run-{n}" / "config.json").read_text())["loaded_weights"]
                 for n in ("same", "other"))
  assert same["reference_weights_digest"] == same["weights_digest"] == other["weights_digest"]
  assert other["reference_weights_digest"] != other["weights_digest"]


@pytest.mark.e2e
@pytest.mark.parametrize("case,expected", [
    ("no-kl", "is the KL term's reference, but engine.kl_beta is 0"),
    ("other-sizes", "is not a checkpoint of the model trained"),
    ("other-norm-eps", "/model): its config.json has rms_norm_eps=1e-05 (the trained model's 1e-06); the KL term"
                       " computes the reference with the trained model's settings"),
    ("shorter-context", "is longer than the model's context of 8 tokens (max_position_embeddings in"
                        " model.reference_checkpoint's config.json)"),
    ("missing", "/nowhere"),
])
def test_a_reference_that_cannot_serve_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys, case,
                                                                                         expected):
  model = write_directory(tmp_path / "model")
  reference = {"no-kl": model, "missing": tmp_path / "nowhere",
               "other-sizes": lambda: write_directory(tmp_path / "wide", preset_name="small"),
               "other-norm-eps": lambda: write_directory(tmp_path / "eps", rms_norm_eps=1e-5),
               "shorter-context": lambda: write_directory(tmp_path / "short", max_position_embeddings=8)}[case]
  reference = reference() if callable(reference) else reference
  kl = ["engine.kl_beta=0"] if case == "no-kl" else []
  out = tmp_path / "out"
  code = cli.main([*RUN, *kl, f"model.checkpoint={model}", f"model.reference_checkpoint={reference}",
                   "--out", str(out)])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and expected in err[0] and "Traceback" not in err[0]
  assert not out.exists()


@pytest.mark.e2e
def test_a_resume_whose_reference_changed_is_refused_and_one_whose_did_not_continues(tmp_path, capsys):
  """No checkpoint of the run holds the reference's weights: a resume reads them again, so it must find what the
  run read at its start."""
  model = write_directory(tmp_path / "model")
  reference = write_directory(tmp_path / "reference", preset_tensors(seed=7))
  run = tmp_path / "run"
  argv = [*RUN, "steps=2", f"model.checkpoint={model}", f"model.reference_checkpoint={reference}"]
  assert cli.main([*argv, "--out", str(run)]) == 0
  assert cli.main(["--resume", str(run), "--steps", "3"]) == 0  # the negative control: unchanged, it continues
  write_directory(reference, preset_tensors(seed=8))
  capsys.readouterr()
  assert cli.main(["--resume", str(run), "--steps", "4"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and f"model.reference_checkpoint: {reference} changed since the run started" in err[0]

"""The least memory a run's training needs (``app/memory_bound.py``), checked before anything is built: the
shapes measured on a TPU v5e pass, one that cannot fit is refused in one line naming the fix."""

from __future__ import annotations

import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.app import cli, memory_bound

GIB = 2 ** 30
V5E_BYTES = 15.75 * GIB  # one TPU v5e chip's bytes_limit


@pytest.fixture(autouse=True)
def _no_switches(monkeypatch):
  for name in recipe_lib.ENV_SWITCHES:
    monkeypatch.delenv(name, raising=False)


@pytest.mark.spec
@pytest.mark.parametrize("kl", [[], ["engine.kl_beta=0.04"]], ids=["no-kl", "kl"])
def test_the_qwen3_0p6b_shape_measured_on_a_v5e_passes_and_a_doubled_one_does_not(kl):
  """Qwen3-0.6B's shape at 32 × 1,024 tokens trained in 11.7 GiB on one v5e (docs/benchmarks.md): its lower
  bound must be under the chip's memory, with a KL reference too; at 8× the rows it cannot fit."""
  recipe = recipe_lib.resolve("recipes/tpu_qwen3_0p6b_shape.yaml", overrides=kl).recipe
  need = sum(memory_bound.least_training_bytes(recipe).values())
  assert 8 * GIB < need < V5E_BYTES
  if not kl:
    assert need < 11.7 * GIB  # below what the chip measured the run to hold at its peak
  wide = recipe_lib.resolve("recipes/tpu_qwen3_0p6b_shape.yaml", overrides=[*kl, "batch.rows=256"]).recipe
  assert sum(memory_bound.least_training_bytes(wide).values()) > V5E_BYTES


@pytest.mark.engine
def test_a_micro_batch_that_cannot_fit_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys,
                                                                                        monkeypatch):
  monkeypatch.setattr(memory_bound, "devices_memory_bytes", lambda n: (4 * GIB, "the test's 4 GiB"))
  out = tmp_path / "out"
  code = cli.main(["rollouts.source=synthetic", "batch.rows=4096", "batch.tokens_per_row=4096",
                   "run.reserve_host_core=false", "--out", str(out)])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and not out.exists()
  assert err[0].startswith("run_rl: error: batch.rows × batch.tokens_per_row = 4,096 × 4,096 tokens per micro-batch"
                           " cannot train model tiny in the test's 4 GiB (4.0 GiB): it needs at least 8.0 GiB")
  assert err[0].endswith("; lower batch.rows or batch.tokens_per_row")
  quarter = recipe_lib.resolve(None, overrides=["rollouts.source=synthetic", "batch.rows=1024",
                                                "batch.tokens_per_row=4096"]).recipe
  memory_bound.check_training_fits(quarter)  # the control: a quarter of the rows fits the same 4 GiB

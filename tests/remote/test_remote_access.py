"""Who may drive a served trainer and what it opens for them.

A token by default (written to a file only its owner can read), token files
that others can read refused on both ends, checkpoint steps that are numbers
naming directories inside the checkpoint directory, and a port that no second
server can share. One ``serve-trainer`` child (tiny model) serves the tests that
need a live trainer; the rest run in this process and stop before anything is built.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.app import cli, serve_trainer
from orchestrator.contract import NoCheckpointError
from orchestrator.engine.checkpointing import Checkpointer
from orchestrator.remote import protocol, spawn, wire
from orchestrator.remote.client import RemoteTrainerWorker, TrainerRefusedError
from orchestrator.remote.server import start_server

BASE = ["model=tiny", "rollouts.source=synthetic", "steps=1", "run.reserve_host_core=false"]
SERVE = "run_rl serve-trainer: error: "


def _recipe():
  return recipe_lib.resolve(None, overrides=BASE).recipe


def _quiet_env() -> dict:
  """This environment without the recipe's switches or a trainer token."""
  return {k: v for k, v in os.environ.items() if k not in recipe_lib.ENV_SWITCHES and k != protocol.TOKEN_ENV}


def _connect(address, token):
  return RemoteTrainerWorker(address, recipe_digest=protocol.recipe_digest(_recipe()), token=token,
                             limits=protocol.Limits(timeout_s=60))


def _one_error_line(capsys) -> str:
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and "Traceback" not in err, err
  return lines[0]


@dataclasses.dataclass
class Served:
  """The module's serve-trainer: where it listens, what it printed and wrote, its process and its stderr."""

  address: str
  ready_line: str
  token_file: Path
  checkpoints: Path
  process: subprocess.Popen
  log: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """``run_rl serve-trainer`` with no token given, and no token in its environment."""
  root = tmp_path_factory.mktemp("served")
  checkpoints = root / "run" / "checkpoints"
  log = root / "serve.log"
  with open(log, "wb") as err:
    process = subprocess.Popen([sys.executable, "-m", "orchestrator.app.cli", "serve-trainer", *BASE, "--listen",
                                "127.0.0.1:0", "--checkpoint-dir", str(checkpoints)], stdout=subprocess.PIPE,
                               stderr=err, text=True, env=_quiet_env())
  line = process.stdout.readline()
  if "listening on " not in line:
    process.kill()
    pytest.fail(f"serve-trainer did not come up: {log.read_text()[-3000:]}")
  yield Served(line.split("listening on ")[1].split()[0], line.strip(), root / "run" / "trainer.token", checkpoints,
               process, log)
  if process.poll() is None:
    process.terminate()
    process.wait(timeout=30)
  process.stdout.close()


# ---------------------------------------------------------------- a token by default
@pytest.mark.e2e
def test_serve_trainer_without_a_token_writes_one_only_its_owner_can_read(served):
  assert f"token in {served.token_file} (mode 0600)" in served.ready_line
  assert "; devices: " in served.ready_line and " × cpu, the mesh uses 1; JAX " in served.ready_line
  info = served.token_file.lstat()
  assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
  assert len(served.token_file.read_text().strip()) >= 43  # secrets.token_urlsafe(32)


@pytest.mark.e2e
def test_a_driver_without_the_servers_token_is_refused(served):
  for token in (None, "not-the-token"):
    with pytest.raises(TrainerRefusedError, match="wrong or missing trainer token"):
      _connect(served.address, token)


@pytest.mark.e2e
def test_a_driver_with_the_token_file_runs(served, tmp_path, capsys):
  code = cli.main([*BASE, "trainer.location=remote", f"trainer.address={served.address}",
                   f"trainer.token_file={served.token_file}", "--out", str(tmp_path / "run")])
  err = capsys.readouterr().err
  assert code == 0, err
  assert json.loads((tmp_path / "run" / "summary.json").read_text())["trainer"]["location"] == "remote"
  opening = next(line for line in err.splitlines() if line.startswith("run_rl: recipe "))
  assert opening.endswith("; devices: the remote trainer's (its serve-trainer line names them)"), opening


def _serve_without_serving(monkeypatch, argv, env=None) -> dict:
  """``run_rl serve-trainer argv`` up to where it would build the trainer: what it would serve with."""
  handed = {}

  def record(recipe, listen, checkpoint_dir, token, token_described, *, exit_with_driver):
    handed.update(token=token, described=token_described)
    return 0

  monkeypatch.setattr(serve_trainer, "_serve", record)
  monkeypatch.delenv(protocol.TOKEN_ENV, raising=False)
  for name, value in (env or {}).items():
    monkeypatch.setenv(name, value)
  handed["code"] = cli.main(["serve-trainer", *BASE, *argv])
  return handed


@pytest.mark.e2e
def test_insecure_no_token_serves_without_a_token_on_loopback_and_writes_no_file(monkeypatch, tmp_path):
  handed = _serve_without_serving(monkeypatch, ["--insecure-no-token", "--checkpoint-dir", str(tmp_path / "c")])
  assert handed["code"] == 0 and handed["token"] is None
  assert handed["described"] == "no token (--insecure-no-token): any local user can drive it"
  assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e
def test_insecure_no_token_is_refused_off_loopback(monkeypatch, capsys):
  handed = _serve_without_serving(monkeypatch, ["--insecure-no-token", "--listen", "0.0.0.0:0"])
  assert handed == {"code": 2}
  assert _one_error_line(capsys) == (
      f"{SERVE}--insecure-no-token with --listen 0.0.0.0:0: off loopback a trainer needs a token; drop"
      " --insecure-no-token (a token is then generated) or listen on 127.0.0.1")


@pytest.mark.e2e
def test_a_token_in_the_environment_is_used_and_no_file_is_written(monkeypatch, tmp_path):
  """What ``trainer.spawn`` relies on: its child gets the token in its environment, not a second file."""
  handed = _serve_without_serving(monkeypatch, ["--checkpoint-dir", str(tmp_path / "c")],
                                  env={protocol.TOKEN_ENV: "from-the-driver"})
  assert handed["code"] == 0 and handed["token"] == "from-the-driver"
  assert handed["described"] == f"token from ${protocol.TOKEN_ENV}"
  assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e
def test_a_spawned_trainers_recipe_drops_the_drivers_token_file():
  """A file would win over the token the driver hands its child (and connects with)."""
  driver = recipe_lib.to_dict(recipe_lib.resolve(None, overrides=[*BASE, "trainer.token_file=/some/token"]).recipe)
  assert spawn.child_recipe(driver)["trainer"]["token_file"] is None
  assert driver["trainer"]["token_file"] == "/some/token"


@pytest.mark.e2e
def test_a_generated_token_never_replaces_a_file(monkeypatch, tmp_path, capsys):
  existing = tmp_path / "trainer.token"
  existing.write_text("someone else's")
  handed = _serve_without_serving(monkeypatch, ["--token-out", str(existing)])
  assert handed == {"code": 2} and existing.read_text() == "someone else's"
  assert _one_error_line(capsys) == (
      f"{SERVE}token file {existing} already exists (a server that did not stop cleanly?); remove it, reuse it"
      " with --token-file, or give another with --token-out FILE")
  with pytest.raises(FileExistsError):
    protocol.write_new_token(existing)


@pytest.mark.e2e
def test_a_generated_token_file_is_created_private_and_removed_at_the_end(monkeypatch, tmp_path):
  path = tmp_path / "deep" / "t.token"
  seen = {}

  def record(recipe, listen, checkpoint_dir, token, token_described, *, exit_with_driver):
    seen.update(mode=stat.S_IMODE(path.stat().st_mode), token=token, on_disk=path.read_text().strip())
    return 0

  monkeypatch.setattr(serve_trainer, "_serve", record)
  monkeypatch.delenv(protocol.TOKEN_ENV, raising=False)
  assert cli.main(["serve-trainer", *BASE, "--token-out", str(path)]) == 0
  assert seen["mode"] == 0o600 and seen["token"] == seen["on_disk"]
  assert not path.exists()


# ---------------------------------------------------------------- token files must be private
def _token_file(tmp_path, mode: int, name: str = "token") -> Path:
  path = tmp_path / name
  path.write_text("a-shared-token\n")
  path.chmod(mode)
  return path


@pytest.mark.e2e
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_token_file_others_can_read_is_refused_by_serve_trainer_and_the_driver(mode, tmp_path, capsys, monkeypatch):
  monkeypatch.delenv(protocol.TOKEN_ENV, raising=False)
  path = _token_file(tmp_path, mode)
  why = (f"trainer token file {path} has mode {mode:04o}: its group or others can access it; make it private:"
         f" chmod 600 {path}")
  assert cli.main(["serve-trainer", *BASE, "--token-file", str(path)]) == 2
  assert _one_error_line(capsys) == f"{SERVE}{why}"
  out = tmp_path / "run"
  assert cli.main([*BASE, "trainer.location=remote", "trainer.address=127.0.0.1:5000", f"trainer.token_file={path}",
                   "--out", str(out)]) == 2
  assert _one_error_line(capsys) == f"run_rl: error: trainer.token_file: {why}"
  assert not out.exists()


@pytest.mark.engine
def test_a_private_token_file_is_read_through_a_link_and_judged_by_the_file_it_names(tmp_path):
  private, loose = _token_file(tmp_path, 0o600, "private"), _token_file(tmp_path, 0o644, "loose")
  (tmp_path / "to-private").symlink_to(private)
  (tmp_path / "to-loose").symlink_to(loose)
  assert protocol.read_token(str(tmp_path / "to-private")) == "a-shared-token"
  with pytest.raises(protocol.AddressError, match="has mode 0644"):
    protocol.read_token(str(tmp_path / "to-loose"))


# ---------------------------------------------------------------- an exclusive port
@pytest.mark.e2e
def test_a_second_serve_trainer_on_a_taken_port_is_refused(served, capsys, monkeypatch):
  monkeypatch.delenv(protocol.TOKEN_ENV, raising=False)
  assert cli.main(["serve-trainer", *BASE, "--listen", served.address, "--insecure-no-token"]) == 2
  assert _one_error_line(capsys) == (
      f"{SERVE}--listen {served.address}: the address is in use (another server listens there); choose another port,"
      " or stop the server on it")


class _NoCalls:
  def handler(self):
    return grpc.method_handlers_generic_handler(protocol.SERVICE, {})


@pytest.mark.e2e
def test_no_server_can_share_the_trainers_port(served):
  """gRPC shares ports by default (SO_REUSEPORT): a squatter would take some of the drivers' connections."""
  squatter = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # gRPC's defaults: port sharing on
  with pytest.raises(RuntimeError, match="Failed to bind"):
    squatter.add_insecure_port(served.address)
  squatter.stop(None)
  with pytest.raises(protocol.AddressError, match=f"cannot listen on {served.address}: the address is in use"):
    start_server(_NoCalls(), served.address, protocol.Limits())


# ---------------------------------------------------------------- paths the driver cannot steer
@pytest.mark.e2e
def test_a_step_that_is_no_number_and_metadata_that_is_no_object_are_refused_as_invalid(served):
  """Refused before the trainer reads or writes anything: its state is as it was."""
  worker = _connect(served.address, served.token_file.read_text().strip())
  try:
    before, checkpoints = worker.state_digest(), sorted(served.checkpoints.iterdir())
    for step in ("../../other/checkpoints/4", "0", 1.0, -1, True, [0]):
      with pytest.raises(ValueError, match=r"restore_checkpoint: step .* is not a checkpoint step; give a non-neg"):
        worker.restore_checkpoint(step)
    with pytest.raises(ValueError, match="save_checkpoint: metadata must be a JSON object, not list"):
      worker._call({"method": "save_checkpoint", "metadata": [1, 2]})  # pylint: disable=protected-access
    assert worker.state_digest() == before and sorted(served.checkpoints.iterdir()) == checkpoints
    call = worker._connection.channel.stream_stream(f"/{protocol.SERVICE}/Invoke")  # pylint: disable=protected-access
    with pytest.raises(grpc.RpcError) as excinfo:
      list(call(wire.chunks(wire.encode({"method": "restore_checkpoint", "step": "../x/4"})), timeout=60,
                metadata=worker._connection.metadata()))  # pylint: disable=protected-access
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  finally:
    worker.close()


@pytest.mark.e2e
def test_a_checkpoint_that_leads_outside_the_directory_is_refused(served, tmp_path):
  """Another run's checkpoint, linked in as step 7: refused; the trainer's own checkpoint still restores."""
  worker = _connect(served.address, served.token_file.read_text().strip())
  try:
    saved = Path(worker.save_checkpoint({"who": "this run"}))
    other = tmp_path / "other" / "checkpoints"
    other.mkdir(parents=True)
    shutil.copytree(saved, other / "7")
    (served.checkpoints / "7").symlink_to(other / "7")
    with pytest.raises(ValueError, match=f"checkpoint 7 in {served.checkpoints} leads to {other / '7'}, outside"):
      worker.restore_checkpoint(7)
    assert worker.restore_checkpoint(int(saved.name))["who"] == "this run"
  finally:
    worker.close()
    (served.checkpoints / "7").unlink(missing_ok=True)


@pytest.mark.engine
def test_the_checkpointer_reads_nothing_for_a_step_it_refuses(tmp_path, monkeypatch):
  outside = tmp_path / "other"
  outside.mkdir()
  checkpointer = Checkpointer(tmp_path / "ckpt")
  (checkpointer.directory / "3").symlink_to(outside)
  reads = []
  manager = checkpointer._manager  # pylint: disable=protected-access
  monkeypatch.setattr(manager, "restore", lambda *a, **k: reads.append(a))
  for step in ("../other", -2, 2.0, False, 3):
    with pytest.raises(ValueError):
      checkpointer.restore({"w": np.zeros(2)}, step)
  with pytest.raises(ValueError, match="leads to .* outside that directory"):
    checkpointer.save(3, {"w": np.zeros(2)}, {})
  assert reads == [] and list(outside.iterdir()) == []
  assert checkpointer.step_path(np.int64(5)) == checkpointer.directory.resolve() / "5"


@pytest.mark.engine
def test_a_callers_metadata_cannot_overwrite_the_checkpoints_step_and_an_absent_step_is_named(tmp_path):
  """What restore trusts (the step) is the checkpoint's own; a step with no checkpoint is refused by name."""
  import jax.numpy as jnp  # import here: JAX only for the arrays a checkpoint holds (the module needs none)

  checkpointer = Checkpointer(tmp_path / "ckpt")
  state = {"w": jnp.arange(3.0)}
  checkpointer.save(1, state, {"step": 999, "run_id": "r1"})
  restored, metadata = checkpointer.restore(state, 1)
  assert metadata == {"step": 1, "run_id": "r1"} and np.array_equal(restored["w"], state["w"])
  with pytest.raises(NoCheckpointError, match=r"no checkpoint of step 5 in .* \(it holds steps 1\); give one of"):
    checkpointer.restore(state, 5)


@pytest.mark.engine
def test_a_checkpointer_with_no_checkpoint_says_so_and_restores_the_latest_once_there_is_one(tmp_path):
  import jax.numpy as jnp  # import here: JAX only for the arrays a checkpoint holds (the module needs none)

  checkpointer = Checkpointer(tmp_path / "ckpt")
  state = {"w": jnp.arange(3.0)}
  with pytest.raises(NoCheckpointError, match=r"no checkpoint in .* \(it holds none\)"):
    checkpointer.restore(state)
  checkpointer.save(2, state, {})  # the negative control: with one there, the latest is restored
  assert checkpointer.restore(state)[1] == {"step": 2}


@pytest.mark.engine
def test_a_failed_restores_late_reads_are_not_reported_but_every_other_unraisable_error_is(monkeypatch):
  import types

  from orchestrator.engine import checkpointing

  reported = []
  monkeypatch.setattr(sys, "unraisablehook", reported.append)
  checkpointing.quiet_abandoned_reads()
  checkpointing.quiet_abandoned_reads()  # idempotent: one wrapper
  late_read = types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed"))
  other = types.SimpleNamespace(exc_value=RuntimeError("something else"))
  sys.unraisablehook(late_read)
  sys.unraisablehook(other)  # the negative control: reported as before
  assert reported == [other]


@pytest.mark.engine
def test_a_token_loses_its_trailing_newline_and_one_a_header_cannot_carry_is_refused(monkeypatch, tmp_path):
  monkeypatch.setenv(protocol.TOKEN_ENV, "s3cret\n")
  assert protocol.read_token() == "s3cret"
  monkeypatch.setenv(protocol.TOKEN_ENV, "two words")
  with pytest.raises(protocol.AddressError, match=r"holds a token with ' ', which a gRPC header cannot carry"):
    protocol.read_token()
  path = tmp_path / "token"
  path.write_text("caf\u00e9\n", encoding="utf-8")
  path.chmod(0o600)
  with pytest.raises(protocol.AddressError, match=r"trainer token file .* holds a token with 'é'"):
    protocol.read_token(str(path))


# ---------------------------------------------------------------- the end
@pytest.mark.e2e
def test_the_token_file_goes_when_the_server_stops(served):
  """Last in the module: it stops the module's server (a stop request is a normal end: exit 0)."""
  served.process.terminate()
  assert served.process.wait(timeout=60) == 0, served.log.read_text()[-2000:]
  assert not served.token_file.exists()

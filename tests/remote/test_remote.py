"""The trainer behind gRPC: the wire layout, the handshake's refusals, and remote = local bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import grpc
import numpy as np
import pytest

from orchestrator.app import cli
from orchestrator import recipe as recipe_lib
from orchestrator.data.trajectory import Trajectory
from orchestrator.remote import protocol, wire
from orchestrator.run_files import run_dir

TOKEN = "test-token-0123456789"
BASE = ["model=tiny", "rollouts.source=synthetic", "steps=3", "batch.micro_batches_per_step=2",
        "run.reserve_host_core=false"]


# ---------------------------------------------------------------- the wire layout
def _payload():
  return [Trajectory(np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int32), 0.1 + 0.2,
                     np.array([-0.5, -1.25, -2.0], np.float32), 3),
          Trajectory(np.arange(2, dtype=np.int64), np.arange(4, dtype=np.int32), -1e-300, None, 1,
                     np.arange(24, dtype=np.int16).reshape(6, 2, 2))]  # routing replay's expert ids


@pytest.mark.spec
def test_a_payload_round_trips_bit_for_bit_through_chunks():
  parts = wire.encode_payload("fwd_bwd", _payload(), defer_update=True)
  header, arrays = wire.decode(wire.join(wire.chunks(parts, 7), 1 << 20))
  assert wire.join(wire.chunks(parts, 7), 1 << 20) == wire.join(wire.chunks(b"".join(parts), 5), 1 << 20)
  assert header["method"] == "fwd_bwd" and header["defer_update"] is True
  for sent, got in zip(_payload(), wire.decode_payload(header, arrays)):
    assert sent.advantage == got.advantage and sent.group_id == got.group_id
    for field in ("prompt_ids", "completion_ids", "old_logprobs", "routing"):
      a, b = getattr(sent, field), getattr(got, field)
      assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b))


@pytest.mark.spec
def test_a_weight_tree_keeps_its_integer_keys_and_dtypes():
  import ml_dtypes

  tree = {"layers": {0: {"w": np.ones((2, 2), ml_dtypes.bfloat16)}, 1: {"w": np.zeros(3)}}, "emb": np.arange(4.0)}
  header, arrays = wire.decode(b"".join(wire.encode_tree(tree)))
  got = wire.decode_tree(header, arrays)
  assert set(got["layers"]) == {0, 1} and got["layers"][0]["w"].dtype == ml_dtypes.bfloat16
  assert np.array_equal(got["emb"], tree["emb"])


@pytest.mark.spec
@pytest.mark.parametrize("mutate, named", [
    (lambda m: b"XXXX" + m[4:], "not a trainer message"),
    (lambda m: m + b"\0", "bytes follow the last array"),
    (lambda m: m[:-1], "does not match"),
    (lambda m: m.replace(b'"int32"', b'"obj32"', 1), "not one of the plain numeric types"),
    (lambda m: m[:8] + b"\xff" + m[9:], "not UTF-8 JSON"),
])
def test_a_malformed_message_is_refused_by_name(mutate, named):
  message = wire.encode({"method": "x"}, {"a": np.arange(4, dtype=np.int32)})
  with pytest.raises(wire.WireError, match=named):
    wire.decode(mutate(message))


@pytest.mark.spec
def test_a_stream_past_the_limit_is_refused_before_it_is_all_read():
  read = []

  def pieces():
    for _ in range(10):
      read.append(1)
      yield b"x" * 1000

  with pytest.raises(wire.MessageTooLarge, match="2,500-byte limit"):
    wire.join(pieces(), 2500)
  assert len(read) == 3


@pytest.mark.spec
def test_addresses_and_tokens():
  assert protocol.split_address("[::1]:50051") == ("::1", 50051)
  assert protocol.is_loopback("127.0.0.5") and protocol.is_loopback("localhost") and protocol.is_loopback("::1")
  assert not protocol.is_loopback("0.0.0.0") and not protocol.is_loopback("10.1.2.3")
  with pytest.raises(protocol.AddressError, match="HOST:PORT"):
    protocol.split_address("localhost")
  assert protocol.tokens_match("a", None) and protocol.tokens_match("abc", "abc")
  assert not protocol.tokens_match("abd", "abc") and not protocol.tokens_match(None, "abc")


# ---------------------------------------------------------------- a server in this process
def _recipe(*overrides):
  return recipe_lib.resolve(None, overrides=[*BASE, *overrides]).recipe


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  """A tiny-model trainer on a free loopback port, with a token; yields its address."""
  from orchestrator.remote.server import TrainerService, start_server
  from orchestrator.assembly import build_engine_from_recipe

  recipe = _recipe()
  ckpt = str(tmp_path_factory.mktemp("server-ckpt"))
  limits = protocol.Limits(max_message_bytes=2 << 20, timeout_s=60)
  service = TrainerService(lambda: build_engine_from_recipe(recipe, checkpoint_dir=ckpt),
                           recipe_digest=protocol.recipe_digest(recipe), token=TOKEN, limits=limits)
  grpc_server, port = start_server(service, "127.0.0.1:0", limits)
  yield f"127.0.0.1:{port}"
  grpc_server.stop(0)


def _connect(address, token=TOKEN, recipe=None, **limits):
  from orchestrator.remote.client import RemoteTrainerWorker

  return RemoteTrainerWorker(address, recipe_digest=protocol.recipe_digest(recipe or _recipe()), token=token,
                             limits=protocol.Limits(timeout_s=30, **limits))


def _connect_once_it_is_free(address, timeout_s: float = 60) -> None:
  """Connects and leaves, once the trainer has let its last driver go (it refuses a second one until then)."""
  import time

  from orchestrator.remote.connection import TrainerRefusedError

  deadline = time.monotonic() + timeout_s
  while True:
    try:
      _connect(address).close()
      return
    except TrainerRefusedError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.1)


def _refusal(excinfo) -> str:
  message = str(excinfo.value)
  assert "\n" not in message
  return message


@pytest.mark.engine
def test_a_wrong_or_missing_token_is_refused(server):
  from orchestrator.remote.client import TrainerRefusedError

  for token in ("wrong", None):
    with pytest.raises(TrainerRefusedError) as excinfo:
      _connect(server, token=token)
    assert "wrong or missing trainer token" in _refusal(excinfo)


@pytest.mark.engine
def test_another_protocol_version_is_refused(server):
  channel = grpc.insecure_channel(server)
  hello = channel.unary_unary(f"/{protocol.SERVICE}/Hello")
  with pytest.raises(grpc.RpcError) as excinfo:
    hello(wire.encode({"protocol": 999, "recipe_digest": protocol.recipe_digest(_recipe())}),
          metadata=[(protocol.TOKEN_HEADER, TOKEN)], timeout=30)
  assert excinfo.value.code() == grpc.StatusCode.FAILED_PRECONDITION
  assert f"protocol version 999 does not match the trainer's {protocol.PROTOCOL_VERSION}" in excinfo.value.details()
  channel.close()


@pytest.mark.engine
def test_another_recipe_and_a_second_driver_are_refused(server):
  from orchestrator.remote.client import TrainerRefusedError

  with pytest.raises(TrainerRefusedError) as excinfo:
    _connect(server, recipe=_recipe("engine.learning_rate=0.5"))
  assert "is not the one the trainer was started with" in _refusal(excinfo)
  first = _connect(server)
  try:
    with pytest.raises(TrainerRefusedError) as excinfo:
      _connect(server)
    assert "one driver at a time" in _refusal(excinfo)
  finally:
    first.close()
  _connect(server).close()  # free again


@pytest.mark.engine
def test_an_oversized_message_is_refused_on_either_side(server):
  from orchestrator.remote.client import TrainerRefusedError

  big = [Trajectory(np.zeros(700_000, np.int32), np.zeros(4, np.int32), 0.0)]  # ~2.8 MB
  worker = _connect(server, max_message_bytes=1 << 30)
  try:
    with pytest.raises(TrainerRefusedError) as excinfo:
      worker.fwd_bwd(big)
    assert "2,097,152-byte limit" in _refusal(excinfo)
  finally:
    worker.close()
  worker = _connect(server, max_message_bytes=1 << 20)
  try:
    with pytest.raises(wire.MessageTooLarge, match="over the 1,048,576-byte limit"):
      worker.fwd_bwd(big)
  finally:
    worker.close()


@pytest.mark.engine
def test_restoring_a_checkpoint_the_trainer_does_not_hold_is_not_found_in_one_line(server):
  """NOT_FOUND, named by the driver as what it is, not INTERNAL; the negative control: a bad step is still
  INVALID_ARGUMENT (a ValueError of its own), so the status tells the two apart."""
  from orchestrator.contract import NoCheckpointError

  worker = _connect(server)
  try:
    with pytest.raises(NoCheckpointError) as excinfo:
      worker.restore_checkpoint(999_999)
    message = _refusal(excinfo)
    assert "has no such checkpoint (restore_checkpoint: NOT_FOUND)" in message, message
    assert "no checkpoint of step 999999 in" in message, message
    with pytest.raises(ValueError) as excinfo:
      worker.restore_checkpoint(-1)
    assert not isinstance(excinfo.value, NoCheckpointError) and "is not a checkpoint step" in str(excinfo.value)
  finally:
    worker.close()


@pytest.mark.engine
def test_a_stage_over_the_wire_says_what_its_input_holds_on_the_devices(server, monkeypatch):
  from orchestrator.assembly import batch_shape
  from orchestrator.data.packing import pack_payload

  vocab, rows, tokens = batch_shape(_recipe())
  packed = pack_payload(_payload(), rows=rows, tokens_per_row=tokens, vocab_size=vocab)
  worker = _connect(server)
  try:
    assert not worker.capabilities.can_report_memory and worker.device_memory() is None  # a CPU trainer
    receipt = worker.stage_fwd_bwd(_payload())
    assert receipt.staged_bytes_per_device == (sum(a.nbytes for a in packed.values()),)  # one device
    assert receipt.staged_bytes_by_field == {name: a.nbytes for name, a in packed.items()}
    assert receipt.memory is None and receipt.input_digest
    worker.fwd_bwd_staged()
    # A trainer of a version before memory reports answers a stage with its seconds and digest alone.
    monkeypatch.setattr(worker, "_call", lambda header, parts=None: ({"stage_s": 0.01, "input_digest": "d"}, {}))
    old = worker.stage_fwd_bwd(_payload())
    assert (old.staged_bytes_per_device, old.memory, old.input_digest) == (None, None, "d")
    assert old.staged_bytes_by_field is None
  finally:
    monkeypatch.undo()
    worker.close()


@pytest.mark.engine
def test_an_export_says_what_crossed_the_wire(server):
  """``last_export`` is the reply as received: the weights' bytes and the header listing them, and the call's
  seconds (the weight sync records them)."""
  worker = _connect(server)
  try:
    assert worker.last_export is None  # nothing exported yet
    weights = worker.export_weights()
    moved = worker.last_export
  finally:
    worker.close()
  params = sum(leaf.nbytes for leaf in _leaves(weights))
  assert moved.bytes == wire.message_size(wire.encode_tree(weights)) and params < moved.bytes < params + 16384
  assert 0 < moved.seconds == pytest.approx(moved.ended_at - moved.started_at)


def _leaves(tree):
  """The arrays of a nested dict of weights (the driver's host copy), without JAX."""
  return [leaf for value in tree.values() for leaf in (_leaves(value) if isinstance(value, dict) else [value])]


def _run(tmp_path, name, capsys, *args, env=None):
  out = tmp_path / name
  old = dict(os.environ)
  try:
    for key in recipe_lib.ENV_SWITCHES:
      os.environ.pop(key, None)
    os.environ.update(env or {})
    code = cli.main([*BASE, *args, "--out", str(out)])
  finally:
    os.environ.clear()
    os.environ.update(old)
  err = capsys.readouterr().err
  assert code == 0, err
  return json.loads((out / "summary.json").read_text())


MODES = {"stage_before_update": [], "stage_after_update": ["--no-stage_before_update"],
         "pipelined": ["--no-stage_next_microbatch"], "off": ["--no-pipeline_step_boundary"]}


@pytest.mark.e2e
def test_remote_and_local_trainers_reach_the_same_digest_in_every_mode(server, tmp_path, capsys):
  local = _run(tmp_path, "local", capsys)
  remote = {}
  for mode, flags in MODES.items():
    summary = _run(tmp_path, mode, capsys, *flags, "trainer.location=remote", f"trainer.address={server}",
                   env={protocol.TOKEN_ENV: TOKEN})
    remote[mode] = summary["final_state_digest"]
    assert summary["trainer"]["location"] == "remote"
    assert abs(summary["trainer"]["clock_offset_s"]) < 1.0  # one host: the clocks agree to within a round trip
    # A trainer served to every driver keeps one checkpoint directory: a run writes only those it asks for.
    assert summary["checkpoint_path"] is None
  assert set(remote.values()) == {local["final_state_digest"]}
  assert local["checkpoint_path"].endswith("local/checkpoints/3")  # negative control: a local run keeps its last


@pytest.mark.e2e
def test_a_remote_run_without_the_token_is_refused_before_it_starts(server, tmp_path, capsys):
  code = cli.main([*BASE, "trainer.location=remote", "trainer.address=10.9.9.9:50051", "--out",
                   str(tmp_path / "x")])
  err = capsys.readouterr().err
  assert code == 2 and "is not loopback and no token is set" in err and len(err.strip().splitlines()) == 1
  assert not (tmp_path / "x").exists()


@pytest.mark.e2e
def test_serve_trainer_refuses_a_non_loopback_bind_without_a_token(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != protocol.TOKEN_ENV}
  proc = subprocess.run([sys.executable, "-m", "orchestrator.app.cli", "serve-trainer", "model=tiny",
                         "--listen", "0.0.0.0:0", "--insecure-no-token"], capture_output=True, text=True, env=env,
                        timeout=120, check=False)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      "run_rl serve-trainer: error: --insecure-no-token with --listen 0.0.0.0:0: off loopback a trainer needs a"
      " token; drop --insecure-no-token (a token is then generated) or listen on 127.0.0.1"]


@pytest.mark.e2e
def test_spawned_trainer_runs_and_stops_with_the_run(tmp_path, capsys):
  summary = _run(tmp_path, "spawned", capsys, "trainer.location=remote", "trainer.spawn=true")
  assert summary["trainer"]["spawned"] is True
  assert summary["checkpoint_path"].endswith("spawned/checkpoints/3")  # the run's own directory: its last step's
  local = _run(tmp_path, "local", capsys)
  assert summary["final_state_digest"] == local["final_state_digest"]
  leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "spawned" / "trainer_recipe.json")],
                            capture_output=True, text=True, check=False)
  assert leftover.stdout.strip() == ""


# ---------------------------------------------------------------- faults (child processes)
def _wait_for(predicate, timeout_s: float, what: str):
  import time

  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if predicate():
      return
    time.sleep(0.1)
  raise AssertionError(f"timed out waiting for {what}")


def _child_env():
  env = {k: v for k, v in os.environ.items() if k not in recipe_lib.ENV_SWITCHES}
  return dict(env, **{protocol.TOKEN_ENV: TOKEN})


@pytest.mark.e2e
@pytest.mark.slow
def test_a_trainer_killed_mid_run_ends_the_driver_within_its_timeout(tmp_path):
  import time

  out = tmp_path / "run"
  driver = subprocess.Popen([sys.executable, "-m", "orchestrator.app.cli", *BASE, "steps=100000", "trainer.location=remote",
                             "trainer.spawn=true", "trainer.timeout_s=10", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env())
  records = out / "records.jsonl"
  _wait_for(lambda: records.exists() and len(records.read_text().splitlines()) >= 3, 180, "three steps")
  subprocess.run(["pkill", "-9", "-f", str(out / "trainer_recipe.json")], check=True)
  killed = time.monotonic()
  _, err = driver.communicate(timeout=60)
  assert time.monotonic() - killed < 10
  assert driver.returncode == 1
  [failure] = [line for line in err.splitlines() if "the run failed" in line]
  assert "TrainerLostError: the trainer at 127.0.0.1:" in failure
  assert "stopped answering during step" in failure and "micro-batch" in failure
  assert "Traceback" not in err and len(records.read_text().splitlines()) >= 3
  assert json.loads((out / "summary.json").read_text())["ended"] == "error"


@pytest.mark.e2e
@pytest.mark.slow
def test_a_driver_killed_mid_run_leaves_the_trainer_ready_to_resume(tmp_path, capsys, monkeypatch):
  from orchestrator.app import run as app_run  # JAX-side: this module's spec tests must not load it

  ckpt = tmp_path / "ckpt"
  server = subprocess.Popen([sys.executable, "-m", "orchestrator.app.cli", "serve-trainer", *BASE, "--listen",
                             "127.0.0.1:0", "--checkpoint-dir", str(ckpt)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env())
  try:
    line = server.stdout.readline()
    address = line.split("listening on ")[1].split()[0]
    remote = ["trainer.location=remote", f"trainer.address={address}", f"checkpoint.directory={ckpt}",
              "checkpoint.every=2"]
    out = tmp_path / "run"
    driver = subprocess.Popen([sys.executable, "-m", "orchestrator.app.cli", *BASE, *remote, "steps=100000", "--out",
                               str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_child_env())
    _wait_for(lambda: (ckpt / "4").is_dir(), 180, "a checkpoint at step 4")
    driver.kill()
    driver.wait()
    # The trainer may finish a save the killed driver asked for only after the next driver chose its checkpoint
    # (it takes that driver once the call is done): made certain here by holding the newest checkpoint back
    # until the resume connects. The resume retrains those steps (the late checkpoint kept aside), and the
    # trainer's fresh worker, which listed it, writes that step again.
    _connect_once_it_is_free(address)  # the trainer answers once the killed driver's last call is done
    late = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    shutil.move(str(ckpt / str(late)), str(tmp_path / "late"))
    connect = app_run.make_worker

    def finish_the_last_save_then_connect(*args, **kwargs):
      shutil.move(str(tmp_path / "late"), str(ckpt / str(late)))  # before the trainer's fresh worker lists it
      return connect(*args, **kwargs)

    monkeypatch.setattr(app_run, "make_worker", finish_the_last_save_then_connect)
    # The trainer notices, drops the partial step and takes a new driver, which resumes.
    os.environ[protocol.TOKEN_ENV] = TOKEN
    try:
      code = cli.main(["--resume", str(out), "--steps", "8"])
    finally:
      del os.environ[protocol.TOKEN_ENV]
      monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"checkpoint {late} of this run appeared in {ckpt}" in err
    segment = run_dir.latest_segment(out)
    assert (segment / run_dir.SUPERSEDED_CHECKPOINTS / str(late)).is_dir()
    resumed = json.loads((segment / "summary.json").read_text())["final_state_digest"]
  finally:
    server.terminate()
    _, server_err = server.communicate(timeout=30)
  assert "the driver left" in server_err
  reference = _run(tmp_path, "reference", capsys, "steps=8", "checkpoint.every=2")
  assert resumed == reference["final_state_digest"]


@pytest.mark.e2e
@pytest.mark.slow
def test_ctrl_c_on_a_spawned_trainer_run_stops_cleanly_and_leaves_no_trainer(tmp_path):
  """SIGINT to the whole process group, as a terminal sends it: the driver checkpoints through its trainer."""
  import signal

  out = tmp_path / "run"
  driver = subprocess.Popen([sys.executable, "-m", "orchestrator.app.cli", *BASE, "steps=100000", "trainer.location=remote",
                             "trainer.spawn=true", "--out", str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_child_env(), start_new_session=True)
  records = out / "records.jsonl"
  _wait_for(lambda: records.exists() and len(records.read_text().splitlines()) >= 3, 180, "three steps")
  os.killpg(driver.pid, signal.SIGINT)
  _, err = driver.communicate(timeout=120)
  assert driver.returncode == 130, err
  summary = json.loads((out / "summary.json").read_text())
  assert summary["ended"] == "signal" and "TrainerLostError" not in err
  assert any((out / "checkpoints").iterdir())
  _wait_for(lambda: subprocess.run(["pgrep", "-f", str(out / "trainer_recipe.json")], capture_output=True,
                                   check=False).returncode == 1, 30, "the spawned trainer to exit")


@pytest.mark.e2e
@pytest.mark.slow
def test_a_spawned_trainer_exits_when_its_driver_is_killed(tmp_path):
  out = tmp_path / "run"
  driver = subprocess.Popen([sys.executable, "-m", "orchestrator.app.cli", *BASE, "steps=100000", "trainer.location=remote",
                             "trainer.spawn=true", "--out", str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=_child_env())
  _wait_for(lambda: (out / "records.jsonl").exists(), 180, "the first step")
  driver.kill()
  driver.wait()
  _wait_for(lambda: subprocess.run(["pgrep", "-f", str(out / "trainer_recipe.json")], capture_output=True,
                                   check=False).returncode == 1, 30, "the orphaned trainer to exit")

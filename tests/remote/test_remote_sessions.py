"""The remote trainer's ways in: sessions, validate-then-act, and the wire decoder's limits.

Every refusal here is checked the way another local user would meet it: on the raw gRPC channel, with the
token but without (or with someone else's) session, and the trainer's state digest read before and after.
"""

from __future__ import annotations

import json
import logging
import struct
import time

import grpc
import numpy as np
import pytest

from orchestrator import recipe as recipe_lib
from orchestrator.assembly import batch_shape, build_engine_from_recipe
from orchestrator.contract import WorkerUsageError
from orchestrator.data.synthetic import SyntheticRollouts
from orchestrator.remote import protocol, wire
from orchestrator.remote.client import RemoteTrainerWorker, TrainerLostError, TrainerRefusedError
from orchestrator.remote.requests import REQUEST_CHECKS
from orchestrator.remote.server import TrainerService, start_server
from tests.fakes import RecordingEngine

pytestmark = pytest.mark.engine

TOKEN = "sessions-token-0123456789"
BASE = ["model=tiny", "rollouts.source=synthetic", "steps=3", "batch.micro_batches_per_step=2",
        "run.reserve_host_core=false"]
ATTACH_DEADLINE_S = 5.0  # slack for a loaded machine between a test's Hello and its next call
CALL_TIMEOUT_S = 60


# ---------------------------------------------------------------- a tiny-model trainer in this process
def _recipe():
  return recipe_lib.resolve(None, overrides=BASE).recipe


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
  """A tiny-model trainer on a free loopback port, with a token and a short attach deadline.

  Yields (address, checkpoint directory).
  """
  recipe = _recipe()
  checkpoints = tmp_path_factory.mktemp("session-ckpt")
  limits = protocol.Limits(max_message_bytes=8 << 20, timeout_s=CALL_TIMEOUT_S)
  service = TrainerService(lambda: build_engine_from_recipe(recipe, checkpoint_dir=str(checkpoints)),
                           recipe_digest=protocol.recipe_digest(recipe), token=TOKEN, limits=limits,
                           attach_deadline_s=ATTACH_DEADLINE_S)
  server, port = start_server(service, "127.0.0.1:0", limits)
  yield f"127.0.0.1:{port}", checkpoints
  server.stop(0)


@pytest.fixture(scope="module")
def rollouts():
  vocab_size, rows, tokens_per_row = batch_shape(_recipe())
  return SyntheticRollouts(vocab_size, rows, tokens_per_row, seed=7)


def _connect(address: str) -> RemoteTrainerWorker:
  return RemoteTrainerWorker(address, recipe_digest=protocol.recipe_digest(_recipe()), token=TOKEN,
                             limits=protocol.Limits(timeout_s=CALL_TIMEOUT_S))


def _metadata(session: str | None, token: str | None = TOKEN) -> list[tuple[str, str]]:
  meta = [] if token is None else [(protocol.TOKEN_HEADER, token)]
  return meta if session is None else [*meta, (protocol.SESSION_HEADER, session)]


def _session_of(worker: RemoteTrainerWorker) -> str:
  return dict(worker._connection.metadata())[protocol.SESSION_HEADER]


def _raw_invoke(address: str, message, *, session: str | None, token: str | None = TOKEN):
  """One Invoke on a fresh channel, as any client could send it; returns (header, arrays)."""
  channel = grpc.insecure_channel(address)
  try:
    pieces = channel.stream_stream(f"/{protocol.SERVICE}/Invoke")(
        wire.chunks(message), metadata=_metadata(session, token), timeout=CALL_TIMEOUT_S)
    return wire.decode(wire.join(pieces, 1 << 30))
  finally:
    channel.close()


def _raw_unary(address: str, name: str, message: bytes, *, session: str | None, token: str | None = TOKEN) -> dict:
  channel = grpc.insecure_channel(address)
  try:
    reply = channel.unary_unary(f"/{protocol.SERVICE}/{name}")(
        message, metadata=_metadata(session, token), timeout=CALL_TIMEOUT_S)
    return wire.decode(reply)[0]
  finally:
    channel.close()


def _raw_attach_first(address: str, *, session: str | None, token: str | None = TOKEN) -> dict:
  """The first message of an Attach stream (then the stream is closed)."""
  channel = grpc.insecure_channel(address)
  try:
    stream = channel.unary_stream(f"/{protocol.SERVICE}/Attach")(
        wire.encode({}), metadata=_metadata(session, token), timeout=CALL_TIMEOUT_S)
    first = wire.decode(next(stream))[0]
    stream.cancel()
    return first
  finally:
    channel.close()


def _refusal(call) -> grpc.RpcError:
  """The gRPC error ``call()`` ends in; it must be one line without a server traceback, and never UNKNOWN."""
  with pytest.raises(grpc.RpcError) as excinfo:
    call()
  error = excinfo.value
  assert error.code() != grpc.StatusCode.UNKNOWN, error.details()
  assert "\n" not in error.details() and "Traceback" not in error.details()
  return error


def _hello_message() -> bytes:
  return wire.encode({"protocol": protocol.PROTOCOL_VERSION, "recipe_digest": protocol.recipe_digest(_recipe())})


def _every_request(rollouts) -> dict[str, list]:
  """A well-formed request of every Invoke method the server knows (reading or changing its state, or neither)."""
  payload = rollouts.micro_batch(0, 0)
  requests = {
      "fwd_bwd": wire.encode_payload("fwd_bwd", payload, apply_optimizer=True),
      "stage": wire.encode_payload("stage", payload),
      "fwd_bwd_staged": wire.encode_parts({"method": "fwd_bwd_staged", "apply_optimizer": True}),
      "apply_deferred_update": wire.encode_parts({"method": "apply_deferred_update"}),
      "save_checkpoint": wire.encode_parts({"method": "save_checkpoint", "metadata": {"step": 999, "forged": True}}),
      "restore_checkpoint": wire.encode_parts({"method": "restore_checkpoint", "step": None}),
      "rig_begin_arm": wire.encode_parts({"method": "rig_begin_arm", "fault": None}),
      "wait_ready": wire.encode_parts({"method": "wait_ready", "id": 1, "timeout_s": 1}),
  }
  for method in REQUEST_CHECKS:
    requests.setdefault(method, wire.encode_parts({"method": method}))
  assert set(requests) == set(REQUEST_CHECKS)  # every method the server knows is tried
  return requests


def _files(directory) -> list[str]:
  return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def _assert_nothing_is_served_without_a_session(address: str, rollouts, session: str | None, code) -> None:
  for method, message in _every_request(rollouts).items():
    error = _refusal(lambda: _raw_invoke(address, message, session=session))
    assert error.code() == code, (method, error.code(), error.details())
  assert _refusal(lambda: _raw_unary(address, "Clock", wire.encode({}), session=session)).code() == code
  assert _refusal(lambda: _raw_attach_first(address, session=session)).code() == code


# ---------------------------------------------------------------- sessions
def test_a_call_without_a_session_is_refused_and_changes_nothing(trainer, rollouts):
  address, checkpoints = trainer
  driver = _connect(address)
  try:
    fresh = driver.state_digest()
    driver.fwd_bwd(rollouts.micro_batch(0, 0), apply_optimizer=True)
    trained, files = driver.state_digest(), _files(checkpoints)
    assert trained != fresh
    # While a driver is attached: the token alone opens nothing.
    _assert_nothing_is_served_without_a_session(address, rollouts, None, grpc.StatusCode.UNAUTHENTICATED)
    assert driver.state_digest() == trained and _files(checkpoints) == files
    with pytest.raises(TrainerRefusedError, match="one driver at a time"):
      _connect(address)  # the sessionless bye did not free the trainer either
  finally:
    driver.close()
  # While nobody drives: the last driver's weights, digest, metrics and checkpoints stay out of reach.
  _assert_nothing_is_served_without_a_session(address, rollouts, None, grpc.StatusCode.UNAUTHENTICATED)
  assert _files(checkpoints) == files
  successor = _connect(address)
  try:
    assert successor.state_digest() == fresh  # a new driver starts from a fresh worker, not the forged state
  finally:
    successor.close()


def test_a_session_this_trainer_never_issued_is_unauthenticated(trainer, rollouts):
  address, _ = trainer
  for made_up in ("0" * 32, "not-a-session"):
    error = _refusal(lambda: _raw_invoke(address, wire.encode_parts({"method": "state_digest"}), session=made_up))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "not one this trainer issued" in error.details()


def test_a_stale_session_is_refused_while_nobody_and_while_another_driver_drives(trainer, rollouts):
  address, checkpoints = trainer
  earlier = _connect(address)
  stale = _session_of(earlier)
  earlier.close()
  error = _refusal(lambda: _raw_invoke(address, wire.encode_parts({"method": "state_digest"}), session=stale))
  assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "no longer drives this trainer" in error.details()
  current = _connect(address)
  try:
    before, files = current.state_digest(), _files(checkpoints)
    _assert_nothing_is_served_without_a_session(address, rollouts, stale, grpc.StatusCode.FAILED_PRECONDITION)
    assert current.state_digest() == before and _files(checkpoints) == files
    with pytest.raises(TrainerRefusedError, match="one driver at a time"):
      _connect(address)  # the stale bye did not free the trainer
  finally:
    current.close()


def _connect_once_free(address: str, limit_s: float = 120.0):
  """A driver, as soon as the trainer takes one (polled, so how late the lapse comes does not matter)."""
  give_up = time.monotonic() + limit_s
  while True:
    try:
      return _connect(address)
    except TrainerRefusedError:
      if time.monotonic() > give_up:
        raise
      time.sleep(0.25)


def test_a_hello_without_attach_frees_the_trainer_after_the_deadline(trainer):
  address, _ = trainer
  claimed = _raw_unary(address, "Hello", _hello_message(), session=None)["session"]
  with pytest.raises(TrainerRefusedError, match="left to attach"):
    _connect(address)
  # Before Attach the session may sample the clock, but no worker call is served.
  assert "server_time" in _raw_unary(address, "Clock", wire.encode({}), session=claimed)
  error = _refusal(lambda: _raw_invoke(address, wire.encode_parts({"method": "state_digest"}), session=claimed))
  assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "has not attached yet" in error.details()
  driver = _connect_once_free(address)  # the claim lapses: the trainer takes the next driver
  try:
    late = _refusal(lambda: _raw_attach_first(address, session=claimed))
    assert late.code() == grpc.StatusCode.FAILED_PRECONDITION and "no longer drives" in late.details()
    assert driver.state_digest() is not None
  finally:
    driver.close()


def test_a_hello_then_attach_within_the_deadline_drives(trainer):
  address, _ = trainer
  claimed = _raw_unary(address, "Hello", _hello_message(), session=None)["session"]
  assert _raw_attach_first(address, session=claimed)["attached"] is True
  # Its stream is closed again: the driver left, and the next one is served.
  driver = _connect(address)
  driver.close()


# ---------------------------------------------------------------- validate, then act
def test_a_refused_apply_deferred_update_leaves_the_state_unchanged(trainer, rollouts):
  address, _ = trainer
  driver = _connect(address)
  try:
    driver.fwd_bwd(rollouts.micro_batch(0, 0), defer_update=True)
    before = driver.state_digest()
    request = wire.encode_parts({"method": "apply_deferred_update", "then_dispatch_staged": True})
    error = _refusal(lambda: _raw_invoke(address, request, session=_session_of(driver)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details().startswith("WorkerUsageError: ") and "nothing is staged" in error.details()
    assert driver.state_digest() == before
    driver.apply_deferred_update()  # the update is still owed, and applies now
    assert driver.state_digest() != before
  finally:
    driver.close()


def test_update_with_nothing_accumulated_is_misuse_not_a_lost_trainer(trainer, rollouts):
  address, _ = trainer
  driver = _connect(address)
  try:
    before = driver.state_digest()
    with pytest.raises(WorkerUsageError, match="no micro-batch ran since the last update"):
      driver.update()
    driver.fwd_bwd(rollouts.micro_batch(0, 0), apply_optimizer=True)
    after_step = driver.state_digest()
    with pytest.raises(WorkerUsageError, match="no micro-batch ran since the last update"):
      driver.update()  # the step's update already ran with its micro-batch
    assert after_step != before and driver.state_digest() == after_step
    driver.fwd_bwd(rollouts.micro_batch(1, 0))
    driver.update()  # with a micro-batch accumulated, update() is served as before
    assert driver.state_digest() != after_step
  finally:
    driver.close()


def _bad_fields(rollouts) -> dict[str, tuple[list, str]]:
  payload = rollouts.micro_batch(0, 0)
  flat = wire.encode_payload("fwd_bwd", payload)
  header, arrays = wire.decode(b"".join(flat))
  arrays = {**arrays, "t0.prompt_ids": np.stack([arrays["t0.prompt_ids"]] * 2)}
  return {
      "completion id": (wire.encode_parts({"method": "wait_ready", "id": "abc"}), "give a non-negative integer"),
      "metadata list": (wire.encode_parts({"method": "save_checkpoint", "metadata": [1, 2]}),
                        "metadata must be a JSON object, not list"),
      "flag text": (wire.encode_payload("fwd_bwd", payload, defer_update="yes"), "give true or false"),
      "step text": (wire.encode_parts({"method": "restore_checkpoint", "step": "latest"}), "is not a checkpoint step"),
      "2-D prompt": (wire.encode_parts(header, arrays), "token ids are one integer row"),
      "NaN advantage": (wire.encode_parts({**header, "trajectories": [{"advantage": "nan", "group_id": 0}]}, arrays),
                        "not a finite number"),
      "timeout forever": (wire.encode_parts({"method": "wait_ready", "id": 1, "timeout_s": 1e300}),
                          "number of seconds in"),
  }


def test_mistyped_fields_are_invalid_arguments_and_change_nothing(trainer, rollouts):
  address, checkpoints = trainer
  driver = _connect(address)
  try:
    before, files = driver.state_digest(), _files(checkpoints)
    for case, (message, named) in _bad_fields(rollouts).items():
      error = _refusal(lambda: _raw_invoke(address, message, session=_session_of(driver)))
      assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, error.details())
      assert error.details().startswith("ValueError: ") and named in error.details(), (case, error.details())
    unknown = _refusal(lambda: _raw_invoke(address, wire.encode_parts({"method": "_new_worker"}),
                                           session=_session_of(driver)))
    assert unknown.code() == grpc.StatusCode.UNIMPLEMENTED
    assert driver.state_digest() == before and _files(checkpoints) == files
  finally:
    driver.close()


# ---------------------------------------------------------------- the wire decoder's limits
def _message(header_text: str, body: bytes = b"") -> bytes:
  raw = header_text.encode()
  return wire.MAGIC + struct.pack("<I", len(raw)) + raw + body


def _with_array(spec: dict, body: bytes = b"") -> bytes:
  return _message(json.dumps({"method": "echo", "arrays": [spec]}), body)


def _nested(depth: int) -> str:
  return '{"method":"echo","deep":' + "[" * (depth - 1) + "]" * (depth - 1) + ',"arrays":[]}'


BAD_MESSAGES = {
    "nested 200,000 deep": (_nested(200_000), "nests deeper than 32"),
    "nested 10,000 deep": (_nested(10_000), "nests deeper than 32"),
    "nested 33 deep": (_nested(33), "nests deeper than 32"),
    "NaN": ('{"method":"echo","x":NaN,"arrays":[]}', "holds NaN"),
    "a 5,000-digit integer": ('{"method":"echo","x":' + "7" * 5000 + ',"arrays":[]}', "JSON cannot carry"),
    "a list, not an object": ("[1, 2]", "must be a JSON object"),
}
BAD_ARRAYS = {
    "shape [2**62, 4]": ({"name": "a", "dtype": "int32", "shape": [2**62, 4], "nbytes": 0}, "overflows a 64-bit size"),
    "shape [10**30]": ({"name": "a", "dtype": "uint8", "shape": [10**30], "nbytes": 0}, "overflows a 64-bit size"),
    "shape [0, 2**62, 2**62]": ({"name": "a", "dtype": "int8", "shape": [0, 2**62, 2**62], "nbytes": 0},
                                "overflows a 64-bit size"),
    "negative dimension": ({"name": "a", "dtype": "int8", "shape": [-1], "nbytes": 0}, "non-negative integers"),
    "a boolean dimension": ({"name": "a", "dtype": "int8", "shape": [True], "nbytes": 1}, "non-negative integers"),
    "shape text": ({"name": "a", "dtype": "int8", "shape": "4", "nbytes": 4}, "non-negative integers"),
    "33 dimensions": ({"name": "a", "dtype": "int8", "shape": [1] * 33, "nbytes": 1}, "at most 32"),
    "nbytes text": ({"name": "a", "dtype": "int8", "shape": [4], "nbytes": "4"}, "nbytes '4'"),
    "wrong nbytes": ({"name": "a", "dtype": "int32", "shape": [4], "nbytes": 4}, "does not match"),
    "a list dtype": ({"name": "a", "dtype": ["int32"], "shape": [1], "nbytes": 4}, "plain numeric types"),
    "a missing shape": ({"name": "a", "dtype": "int8", "nbytes": 0}, "lacks shape"),
}


@pytest.mark.parametrize("case", sorted(BAD_MESSAGES))
def test_the_decoder_refuses_a_header_past_its_limits_by_name(case):
  header_text, named = BAD_MESSAGES[case]
  with pytest.raises(wire.WireError, match=named):
    wire.decode(_message(header_text))


@pytest.mark.parametrize("case", sorted(BAD_ARRAYS))
def test_the_decoder_refuses_an_impossible_array_by_name(case):
  spec, named = BAD_ARRAYS[case]
  with pytest.raises(wire.WireError, match=named):
    wire.decode(_with_array(spec, b"\0" * 4))


def test_the_decoder_takes_what_is_just_within_its_limits():
  """Positive control: 32 levels, 32 dimensions and an empty array with a huge dimension decode."""
  header, _ = wire.decode(_message(_nested(32)))
  assert header["method"] == "echo"
  _, arrays = wire.decode(_with_array({"name": "a", "dtype": "int8", "shape": [1] * 32, "nbytes": 1}, b"\1"))
  assert arrays["a"].ndim == 32
  _, arrays = wire.decode(_with_array({"name": "a", "dtype": "int8", "shape": [0, 2**40], "nbytes": 0}))
  assert arrays["a"].shape == (0, 2**40)


def test_deep_and_overflowing_requests_come_back_invalid_with_no_traceback(trainer):
  address, _ = trainer
  driver = _connect(address)
  try:
    before = driver.state_digest()
    cases = [*BAD_MESSAGES.values(), *((_with_array(spec, b"\0" * 4), named) for spec, named in BAD_ARRAYS.values())]
    for message, named in cases:
      raw = message if isinstance(message, bytes) else _message(message)
      error = _refusal(lambda: _raw_invoke(address, raw, session=_session_of(driver)))
      assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and named in error.details(), error.details()
    assert driver.state_digest() == before
  finally:
    driver.close()
  # Hello decodes before any session exists: the same limits, the same answer.
  error = _refusal(lambda: _raw_unary(address, "Hello", _message(_nested(10_000)), session=None))
  assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "nests deeper than 32" in error.details()


# ---------------------------------------------------------------- the last resort (a fake engine: no JAX work)
class _EngineWhoseMetricsFail(RecordingEngine):
  def get_metrics(self):
    raise KeyError("loss_scale")


def test_a_server_failure_is_one_internal_line_and_its_traceback_stays_in_the_log(caplog):
  service = TrainerService(_EngineWhoseMetricsFail, recipe_digest="fake", token=None,
                           limits=protocol.Limits(timeout_s=CALL_TIMEOUT_S))
  server, port = start_server(service, "127.0.0.1:0", protocol.Limits(timeout_s=CALL_TIMEOUT_S))
  address = f"127.0.0.1:{port}"
  try:
    # Without a token on loopback, the session is the only thing that keeps another local user out.
    error = _refusal(lambda: _raw_invoke(address, wire.encode_parts({"method": "get_metrics"}), session=None,
                                         token=None))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    driver = RemoteTrainerWorker(address, recipe_digest="fake", limits=protocol.Limits(timeout_s=CALL_TIMEOUT_S))
    try:
      with caplog.at_level(logging.ERROR, logger="step_boundary.remote"):
        with pytest.raises(TrainerLostError) as excinfo:
          driver.get_metrics()
      message = str(excinfo.value)
      assert "INTERNAL" in message and "get_metrics failed on the trainer: KeyError: 'loss_scale'" in message
      assert "\n" not in message and "Traceback" not in message
      [record] = [r for r in caplog.records if "get_metrics failed" in r.getMessage()]
      assert record.exc_info is not None  # the traceback is on the server's side
      assert driver.state_digest() == "state-0"  # the trainer still serves its driver
    finally:
      driver.close()
  finally:
    server.stop(0)

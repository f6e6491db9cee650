"""``run_rl serve-trainer``: host a recipe's trainer behind gRPC until SIGINT or SIGTERM.

    run_rl serve-trainer --recipe R [--listen 127.0.0.1:50051] [--checkpoint-dir DIR]
                         [--token-file F | --token-out F | --insecure-no-token] [key=value ...]

Binds loopback by default, and its port alone (a second server cannot share it).
Every call must carry the shared token: the one given (``--token-file``, the
recipe's ``trainer.token_file`` or ``$STEP_BOUNDARY_TRAINER_TOKEN``), else a fresh
one it writes to a new file only its owner can read (``--token-out``, default
``trainer.token`` beside the checkpoint directory) and removes when it stops.
``--insecure-no-token`` serves without one, on loopback only. Prints one line,
``run_rl serve-trainer: listening on HOST:PORT (...)``, naming the token's
source, once it accepts drivers.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from orchestrator.app.arguments import parse_subcommand, subcommand_parser
from orchestrator.app.host import NOISY_LOGGERS, setup_host
from orchestrator.remote import protocol
from orchestrator.run_files.run_dir import default_out

TOKEN_FILE_NAME = "trainer.token"


class _Refused(Exception):
  """A serve-trainer command line that cannot be served (the message says why and what to do)."""


@dataclasses.dataclass(frozen=True)
class _TokenPlan:
  """The server's token: ``token`` as given, or a new one to write to ``new_file``, or none (``described``)."""

  token: str | None
  new_file: Path | None
  described: str


def _refuse(message: str) -> int:
  print(f"run_rl serve-trainer: error: {message}", file=sys.stderr)
  return 2


def serve_main(argv: list[str]) -> int:
  """``run_rl serve-trainer argv``: serves until a stop signal (0), or refuses in one line before building (2).

  A generated token's file is written before the trainer is built and removed when this returns.
  """
  p = subcommand_parser("serve-trainer", "Host the recipe's trainer behind gRPC for one driver at a time.")
  p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to bind (default 127.0.0.1:0, a free port)")
  p.add_argument("--checkpoint-dir", help="where checkpoints are written (default: the recipe's"
                 " checkpoint.directory, else runs/<recipe>-trainer-<time>/checkpoints)")
  p.add_argument("--token-file", help="file holding the shared token, private to its owner (default: the recipe's"
                 f" trainer.token_file, else ${protocol.TOKEN_ENV}, else a new token in --token-out)")
  p.add_argument("--token-out", help=f"new file for a generated token (default: {TOKEN_FILE_NAME} beside the"
                 " checkpoint directory); never replaces a file")
  p.add_argument("--insecure-no-token", action="store_true",
                 help="serve without a token: any local user can drive the trainer (loopback only)")
  p.add_argument("--exit-with-driver", action="store_true",
                 help="stop when the first driver leaves, however it left (trainer.spawn uses this)")
  args, resolved = parse_subcommand(p, argv)
  if args is None:
    return resolved
  recipe = resolved.recipe
  if recipe.distributed.enabled:
    return _refuse("distributed.* is set, but serve-trainer hosts a trainer of one process; drop distributed.*")
  try:
    host, _ = protocol.split_address(args.listen)
  except protocol.AddressError as e:
    return _refuse(f"--listen: {e}")
  checkpoint_dir = Path(args.checkpoint_dir or recipe.checkpoint.directory or (
      default_out(f"{recipe.name}-trainer") / "checkpoints")).absolute()
  try:
    plan = _choose_token(args, recipe.trainer.token_file, host, checkpoint_dir)
    _refuse_a_taken_address(args.listen)
    token, written = _make_token(plan)
  except _Refused as e:
    return _refuse(str(e))
  try:
    if hasattr(os, "sched_setaffinity"):  # a driver that spawned this may have been pinned to its host core
      try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
      except OSError:
        pass
    setup_host(recipe, among_runs=False)  # its driver's claim is its own run's: not a neighbour to yield to
    return _serve(recipe, args.listen, str(checkpoint_dir), token, plan.described,
                  exit_with_driver=args.exit_with_driver)
  finally:
    if written is not None:
      _remove_if_unchanged(plan.new_file, written)


def _choose_token(args, recipe_token_file: str | None, host: str, checkpoint_dir: Path) -> _TokenPlan:
  """Where the server's token comes from, from the command line; reads a given token file.

  Raises:
    _Refused: a token file that cannot be used, flags that contradict each other, ``--insecure-no-token``
      off loopback, or a generated token's file that already exists.
  """
  given_file = args.token_file or recipe_token_file
  try:
    token = protocol.read_token(given_file)
  except protocol.AddressError as e:
    raise _Refused(str(e)) from None
  source = (f"--token-file {given_file}" if args.token_file else f"trainer.token_file={given_file}" if given_file
            else f"${protocol.TOKEN_ENV}")
  if args.insecure_no_token:
    if token is not None or args.token_out:
      given = source if token is not None else f"--token-out {args.token_out}"
      raise _Refused(f"--insecure-no-token serves without a token, but {given} is given too; drop one of them")
    if not protocol.is_loopback(host):
      raise _Refused(f"--insecure-no-token with --listen {args.listen}: off loopback a trainer needs a token; drop"
                     " --insecure-no-token (a token is then generated) or listen on 127.0.0.1")
    return _TokenPlan(None, None, "no token (--insecure-no-token): any local user can drive it")
  if token is not None:
    if args.token_out:
      raise _Refused(f"--token-out {args.token_out} names a file for a generated token, but the token comes from"
                     f" {source}; drop --token-out")
    return _TokenPlan(token, None, f"token from {source}")
  path = Path(args.token_out or checkpoint_dir.parent / TOKEN_FILE_NAME).absolute()
  if path.exists() or path.is_symlink():
    raise _Refused(f"token file {path} already exists (a server that did not stop cleanly?); remove it, reuse it"
                   " with --token-file, or give another with --token-out FILE")
  return _TokenPlan(None, path, f"token in {path} (mode 0600)")


def _refuse_a_taken_address(listen: str) -> None:
  """Refuses ``listen`` when another socket holds its port, before anything is built.

  A plain bind (no port sharing) fails exactly when the server's own would;
  other failures (an address not on this host) are left to the server's bind.
  """
  host, port = protocol.split_address(listen)
  if port == 0:
    return
  try:
    addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
  except socket.gaierror:
    return
  for family, kind, proto, _, address in addresses:
    with socket.socket(family, kind, proto) as probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: a closed port is free
      try:
        probe.bind(address)
      except OSError as e:
        if e.errno == errno.EADDRINUSE:
          raise _Refused(f"--listen {listen}: the address is in use (another server listens there); choose another"
                         " port, or stop the server on it") from None


def _make_token(plan: _TokenPlan) -> tuple[str | None, os.stat_result | None]:
  """The token to serve with and, for a generated one, its new file's identity (to remove it at the end)."""
  if plan.new_file is None:
    return plan.token, None
  try:
    token = protocol.write_new_token(plan.new_file)
    return token, plan.new_file.stat()
  except OSError as e:
    raise _Refused(f"cannot write the token file {plan.new_file}: {e.strerror or e}; give a writable new path with"
                   " --token-out FILE") from None


def _remove_if_unchanged(path: Path, written: os.stat_result) -> None:
  """Removes the token file this server wrote (its token dies with the server), unless it was replaced since."""
  try:
    now = path.stat()
    if (now.st_dev, now.st_ino) == (written.st_dev, written.st_ino):
      path.unlink()
  except OSError:
    pass


def _serve(recipe, listen: str, checkpoint_dir: str, token: str | None, token_described: str, *,
           exit_with_driver: bool) -> int:
  # import here: gRPC and the engines load after setup_host (a refusal loads neither)
  from orchestrator.assembly import build_engine_from_recipe
  from orchestrator.engine.mesh import check_devices, describe_devices  # import here: JAX-side (after setup_host)
  from orchestrator.remote.server import TrainerService, start_server  # import here: JAX-side (after setup_host)
  from orchestrator.rig.remote_host import RigHost  # import here: JAX-side (after setup_host)

  try:
    check_devices(recipe.mesh)
  except ValueError as e:
    return _refuse(str(e))
  for noisy in NOISY_LOGGERS:
    logging.getLogger(noisy).setLevel(logging.WARNING)
  limits = protocol.Limits(max_message_bytes=recipe.trainer.max_message_bytes, timeout_s=recipe.trainer.timeout_s)

  def make_engine():
    return build_engine_from_recipe(recipe, checkpoint_dir=checkpoint_dir)

  stop = threading.Event()
  service = TrainerService(make_engine, recipe_digest=protocol.recipe_digest(recipe), token=token, limits=limits,
                           on_driver_left=stop.set if exit_with_driver else None, make_rig_host=RigHost)
  try:
    server, port = start_server(service, listen, limits)
  except (protocol.AddressError, RuntimeError) as e:
    return _refuse(str(e))
  host, _ = protocol.split_address(listen)
  for sig in (signal.SIGINT, signal.SIGTERM):  # a stop request is the normal end of a server: exit 0
    if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored by whoever started it (nohup): stays so
      signal.signal(sig, lambda signum, frame: stop.set())
  print(f"run_rl serve-trainer: listening on {host}:{port} (recipe {recipe.name}, model {recipe.model.name},"
        f" protocol {protocol.PROTOCOL_VERSION}, {token_described}; checkpoints in {checkpoint_dir};"
        f" {describe_devices(recipe.mesh)})", flush=True)
  stop.wait()
  server.stop(grace=2).wait()
  print("run_rl serve-trainer: stopped", file=sys.stderr)
  return 0

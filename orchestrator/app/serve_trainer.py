"""``run_rl serve-trainer``: host a recipe's trainer behind gRPC until SIGINT or SIGTERM.

    run_rl serve-trainer --recipe R [--listen 127.0.0.1:50051] [--checkpoint-dir DIR] [--token-file F] [key=value ...]

Binds loopback by default. Any other address needs a shared token (``--token-file``
or ``$STEP_BOUNDARY_TRAINER_TOKEN``), checked on every call. Prints one line,
``run_rl serve-trainer: listening on HOST:PORT``, once it accepts drivers.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

from orchestrator.app.arguments import parse_subcommand, subcommand_parser
from orchestrator.app.host import NOISY_LOGGERS, setup_host
from orchestrator.app.run_dir import default_out
from orchestrator.remote import protocol


def _refuse(message: str) -> int:
  print(f"run_rl serve-trainer: error: {message}", file=sys.stderr)
  return 2


def serve_main(argv: list[str]) -> int:
  p = subcommand_parser("serve-trainer", "Host the recipe's trainer behind gRPC for one driver at a time.")
  p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to bind (default 127.0.0.1:0, a free port)")
  p.add_argument("--checkpoint-dir", help="where checkpoints are written (default: the recipe's"
                 " checkpoint.directory, else runs/<recipe>-trainer-<time>/checkpoints)")
  p.add_argument("--token-file", help="file holding the shared token (default: $STEP_BOUNDARY_TRAINER_TOKEN)")
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
  try:
    token = protocol.read_token(args.token_file or recipe.trainer.token_file)
  except protocol.AddressError as e:
    return _refuse(str(e))
  if not protocol.is_loopback(host) and token is None:
    return _refuse(f"--listen {args.listen} is not a loopback address and no token is set; a trainer reachable"
                   f" from other hosts needs one: set ${protocol.TOKEN_ENV} or --token-file")
  checkpoint_dir = args.checkpoint_dir or recipe.checkpoint.directory or str(
      default_out(f"{recipe.name}-trainer") / "checkpoints")
  if hasattr(os, "sched_setaffinity"):  # a driver that spawned this may have been pinned to its host core
    try:
      os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:
      pass
  setup_host(recipe)
  return _serve(recipe, args.listen, str(Path(checkpoint_dir).absolute()), token,
                exit_with_driver=args.exit_with_driver)


def _serve(recipe, listen: str, checkpoint_dir: str, token: str | None, *, exit_with_driver: bool) -> int:
  # import here: gRPC and the engines load after setup_host (a refusal loads neither)
  from orchestrator.app.runner import build_engine_from_recipe
  from orchestrator.engine.mesh import check_devices  # import here: JAX-side (after setup_host)
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
    signal.signal(sig, lambda signum, frame: stop.set())
  print(f"run_rl serve-trainer: listening on {host}:{port} (recipe {recipe.name}, model {recipe.model},"
        f" protocol {protocol.PROTOCOL_VERSION}, {'token required' if token else 'loopback, no token'};"
        f" checkpoints in {checkpoint_dir})", flush=True)
  stop.wait()
  server.stop(grace=2).wait()
  print("run_rl serve-trainer: stopped", file=sys.stderr)
  return 0

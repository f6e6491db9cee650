"""``trainer.spawn: true``: start ``run_rl serve-trainer`` on loopback as a child, connect, and stop it at the end.

The child gets the driver's resolved recipe (as JSON, which is YAML), a fresh
random token in its environment and the run's checkpoint directory. That token
is the one both ends use: the child writes no token file of its own, and its
recipe drops the driver's ``trainer.token_file``. It takes every core back and
reserves its own host core, as a local run does. It runs in its own session (a
terminal's Ctrl-C is the driver's to handle) and exits when its driver leaves
(``--exit-with-driver``). Its first stdout line names the port it bound.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

from orchestrator.host.host_threads import PJRT_NPROC_BEFORE_RESERVING
from orchestrator.remote import protocol


class SpawnError(RuntimeError):
  """The child trainer did not come up (the message holds the end of its stderr)."""


def child_recipe(recipe_dict: dict) -> dict:
  """The recipe the child serves: the driver's without ``trainer.token_file``.

  A token file in the recipe would win over the token handed to the child in its environment, the one the
  driver connects with.
  """
  trainer = {**recipe_dict.get("trainer", {}), "token_file": None}
  return {**recipe_dict, "trainer": trainer}


class SpawnedTrainer:
  """A serve-trainer child process on loopback; ``address`` and ``token`` to connect with."""

  def __init__(self, recipe_dict: dict, *, recipe_path: Path, checkpoint_dir: str | None, address: str,
               timeout_s: float, log_path: Path):
    recipe_path.write_text(json.dumps(child_recipe(recipe_dict), indent=1, default=str), encoding="utf-8")
    self.token = secrets.token_hex(16)
    env = dict(os.environ, **{protocol.TOKEN_ENV: self.token})
    # The pool size the user set is kept (it changes the last bits of some sums); the one this process chose
    # when it reserved its host core is not (the child reserves its own).
    if "value" in PJRT_NPROC_BEFORE_RESERVING:
      env.pop("PJRT_NPROC", None)
      if PJRT_NPROC_BEFORE_RESERVING["value"] is not None:
        env["PJRT_NPROC"] = PJRT_NPROC_BEFORE_RESERVING["value"]
    cmd = [sys.executable, "-m", "orchestrator.app.cli", "serve-trainer", "--recipe", str(recipe_path),
           "--listen", address, "--exit-with-driver"]
    if checkpoint_dir:
      cmd += ["--checkpoint-dir", checkpoint_dir]
    self.log_path = log_path
    self._log = open(log_path, "ab")  # pylint: disable=consider-using-with
    # Its own session: a Ctrl-C at the terminal reaches the driver alone, which stops at a boundary,
    # checkpoints through this trainer and then stops it. It exits by itself when its driver leaves,
    # so a driver killed outright leaves no trainer behind.
    self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
    self.address = self._wait_for_port(address, timeout_s)

  def _wait_for_port(self, address: str, timeout_s: float) -> str:
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(self.process.stdout.readline().decode()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    text = line[0] if line else ""
    marker = "listening on "
    if marker not in text:
      self.stop()
      tail = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
      why = "exited" if self.process.poll() is not None else f"did not listen within {timeout_s:g} s"
      raise SpawnError(f"the spawned trainer {why}: {' | '.join(tail) or 'no output'} (log: {self.log_path})")
    host, _ = protocol.split_address(address)
    return f"{host}:{protocol.split_address(text.split(marker, 1)[1].split()[0])[1]}"

  def stop(self, grace_s: float = 10.0) -> None:
    if self.process.poll() is None:
      self.process.terminate()
      deadline = time.monotonic() + grace_s
      while self.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
      if self.process.poll() is None:
        self.process.kill()
        self.process.wait()
    if self.process.stdout:
      self.process.stdout.close()
    self._log.close()

"""``distributed.num_processes=N`` on one host: start N ``run_rl`` processes, watch them, say how they ended.

Each child is the same ``run_rl`` command with its identity in the environment
(``STEP_BOUNDARY_PROCESS_ID``, ``STEP_BOUNDARY_COORDINATOR_ADDRESS``, a free
loopback port), its share of the mesh's devices as forced CPU devices, and the
run's output directory pinned. Process 0 keeps this terminal (its table,
summary and refusals are the run's; its stdout is relayed without Gloo's
connection notices); the others write to ``OUT/processes/process_<i>.log``.

The launcher imports no JAX and holds no device. It stays in the terminal's
process group with its children, so a Ctrl-C reaches every process and they
agree to stop at the same boundary; it ignores that first signal itself. When
a process fails, it tells the others, which end at once; when one dies, the
others end by themselves (their watchdog, or JAX's) within
``distributed.timeout_s``; any still running after that are killed, and one
line names the process that failed or died first (not one that another's
failure ended: ``ENDED_BY_PEER_EXIT``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from orchestrator.addresses import free_loopback_port

#: Exit codes every process reports alike (a refusal, a stop): the launcher passes them on.
_SHARED_ENDINGS = (2, 130, 143)
#: The exit code of a process that another process's failure or silence ended: the launcher names the other one.
ENDED_BY_PEER_EXIT = 3
LOGS_DIR = "processes"
#: After a process fails, the others end within ``distributed.timeout_s`` (told, or their watchdog, or JAX's);
#: this is the time they are given beyond that to exit before the launcher kills them.
PEER_EXIT_GRACE_S = 5
#: How long the launcher waits for the thread relaying process 0's output once every process has ended: the
#: pipe is closed by then and the thread ends at once, unless something process 0 started still holds it open.
RELAY_JOIN_TIMEOUT_S = 5
#: Set to "1" in each process this launcher starts: the launcher, not the process, reports how it ended.
LAUNCHED_ENV = "STEP_BOUNDARY_LAUNCHED"


def child_env(base: dict, *, process_id: int, coordinator: str, devices_per_process: int) -> dict:
  """The environment of local process ``process_id``: its identity and its forced CPU devices."""
  flags = [f for f in base.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  env = dict(base, JAX_PLATFORMS="cpu", STEP_BOUNDARY_PROCESS_ID=str(process_id),
             STEP_BOUNDARY_COORDINATOR_ADDRESS=coordinator,
             XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_process}"]))
  env[LAUNCHED_ENV] = "1"
  env.pop("PJRT_NPROC", None)  # each process sizes XLA's pool itself (run.reserve_host_core)
  return env


def _relay_stdout(stream) -> None:
  """Process 0's stdout (the run's table and summary) to ours, less Gloo's connection notices."""
  for line in iter(stream.readline, b""):
    if not line.startswith(b"[Gloo] "):
      sys.stdout.buffer.write(line)
      sys.stdout.buffer.flush()


def _signal_name(returncode: int) -> str:
  try:
    return signal.Signals(-returncode).name
  except ValueError:
    return f"signal {-returncode}"


def _last_step(out: Path) -> int | None:
  """The step process 0 was at when it ended, from the summary it wrote on the way out (None if none)."""
  try:
    step = json.loads((out / "summary.json").read_text(encoding="utf-8")).get("last_step")
  except (OSError, ValueError):
    return None
  return step if isinstance(step, int) else None


def has_complete_checkpoint(out: Path) -> bool:
  """Whether the run in ``out`` wrote a complete checkpoint: a step directory in its checkpoint directory
  (``checkpoint.directory`` in its config.json, else ``out/checkpoints``). Orbax writes a checkpoint under a
  temporary name and renames it to its step once complete, so a name of digits alone is a complete one."""
  try:
    config = json.loads((out / "config.json").read_text(encoding="utf-8")).get("config", {})
    directory = (config.get("checkpoint") or {}).get("directory")
  except (OSError, ValueError, AttributeError):
    return False
  checkpoints = Path(directory) if directory else out / "checkpoints"
  try:
    return any(p.name.isdigit() and p.is_dir() for p in checkpoints.iterdir())
  except OSError:
    return False


def resume_hint(out: Path) -> str:
  """What is left of the run in ``out`` after it died, and what to do: `--resume` only where a complete
  checkpoint exists to continue from, else start the run again."""
  if not (out / "config.json").is_file():
    return "nothing was written"
  records = f"records so far are in {out / 'records.jsonl'}"
  if has_complete_checkpoint(out):
    return f"{records}; `run_rl --resume {out}` continues from the last complete checkpoint"
  return f"{records}; no checkpoint was written, so it cannot be resumed: start the run again with another --out"


class LocalJob:
  """N local ``run_rl`` processes of one run (see the module docstring)."""

  def __init__(self, argv: list[str], *, num_processes: int, devices_per_process: int, out: Path,
               timeout_s: float):
    self.argv, self.n, self.out, self.timeout_s = list(argv), num_processes, out, timeout_s
    self.devices_per_process = devices_per_process
    self.coordinator = f"127.0.0.1:{free_loopback_port()}"
    self._log_dir = Path(tempfile.mkdtemp(prefix="run_rl-processes-"))
    self.log_paths = {i: self._log_dir / f"process_{i}.log" for i in range(1, num_processes)}
    self.processes: list[subprocess.Popen] = []
    self._relay: threading.Thread | None = None

  def run(self) -> int:
    """Starts the processes, waits for them, and returns the run's exit code."""
    # a signal ignored by whoever started the run stays ignored, here and in the processes (they inherit it)
    previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
      self._start()
      returncodes, first = self._wait()
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)
      self._kill_all()
      if self._relay is not None:
        self._relay.join(timeout=RELAY_JOIN_TIMEOUT_S)
      logs = self._keep_logs()
    return self._report(returncodes, first, logs)

  def _start(self) -> None:
    cmd = [sys.executable, "-m", "orchestrator.app.cli", *self.argv]
    for i in range(self.n):
      env = child_env(os.environ, process_id=i, coordinator=self.coordinator,
                      devices_per_process=self.devices_per_process)
      out = subprocess.PIPE if i == 0 else open(self.log_paths[i], "wb")  # pylint: disable=consider-using-with
      self.processes.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=None if i == 0 else subprocess.STDOUT))
      if i == 0:
        self._relay = threading.Thread(target=_relay_stdout, args=(self.processes[0].stdout,), daemon=True)
        self._relay.start()
      else:
        out.close()

  def _on_signal(self, signum: int, frame) -> None:
    del frame
    if signum == signal.SIGTERM:  # sent to the launcher alone: pass it on, the processes stop at a boundary
      for p in self.processes:
        if p.poll() is None:
          p.send_signal(signal.SIGTERM)
    # SIGINT from a terminal reaches every process of the group already: nothing to do here.

  def _wait(self) -> tuple[list[int | None], int | None]:
    """Waits for every process; after the first failure, at most ``timeout_s`` + ``PEER_EXIT_GRACE_S`` for the
    rest. Returns the exit codes and the process that failed first: one that ended for a reason of its own,
    before one that ended because another failed or went silent (``ENDED_BY_PEER_EXIT``: it may exit before
    the process it names has finished exiting)."""
    first, deadline = None, None
    while True:
      codes = [p.poll() for p in self.processes]
      if first is None or codes[first] == ENDED_BY_PEER_EXIT:
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        own = [i for i in failed if codes[i] != ENDED_BY_PEER_EXIT]
        first = (own or failed or [None])[0]
        if first is not None and deadline is None:
          deadline = time.monotonic() + self.timeout_s + PEER_EXIT_GRACE_S
      if all(c is not None for c in codes):
        return codes, first
      if deadline is not None and time.monotonic() > deadline:
        return codes, first
      time.sleep(0.05)

  def _kill_all(self) -> None:
    for p in self.processes:
      if p.poll() is None:
        p.kill()
    for p in self.processes:
      p.wait()

  def _keep_logs(self) -> dict[int, Path]:
    """Moves the processes' logs into the run directory once process 0 claimed it (else leaves them)."""
    if not (self.out / "config.json").is_file():
      return dict(self.log_paths)
    target = self.out / LOGS_DIR
    target.mkdir(exist_ok=True)
    kept = {}
    for i, path in self.log_paths.items():
      if path.exists():
        kept[i] = Path(shutil.move(str(path), target / path.name))
    shutil.rmtree(self._log_dir, ignore_errors=True)
    return kept

  def _report(self, returncodes: list[int | None], first: int | None, logs: dict[int, Path]) -> int:
    if first is None:
      return 0
    code = returncodes[first]
    if code in _SHARED_ENDINGS and all(c == code for c in returncodes):
      return code  # process 0 said why (a refusal, a stop)
    pid = self.processes[first].pid
    if code is not None and code < 0:
      how = f"was killed by {_signal_name(code)}"
    else:
      how = f"failed (exit {code})"
      if first in logs and logs[first].exists():
        lines = [l for l in logs[first].read_text(errors="replace").splitlines() if l.startswith("run_rl")]
        if lines:
          how += ": " + lines[-1].removeprefix("run_rl: ").removeprefix(f"process {first} of {self.n}: ")
    where = resume_hint(self.out)
    step = _last_step(self.out)
    if step is not None:
      how += f" while process 0 was at step {step}"
    log = f"; its log: {logs[first]}" if first in logs else ""
    print(f"\nrun_rl: process {first} of {self.n} (pid {pid}) {how}; the other processes were ended ({where}){log}",
          file=sys.stderr, flush=True)
    return 1

"""Joining a multi-controller JAX job: ``jax.distributed.initialize`` with this run's settings.

Must run before JAX starts a backend (before the first ``jax.devices()``):
the backend's collectives are chosen when it starts. On CPU they are Gloo's,
so processes on one host or several can all-reduce; a one-process job goes
through them too, which is what makes its bits comparable with a job of
several processes (XLA's in-process CPU collectives sum in another order).

The size of XLA's CPU thread pool is fixed too, to the job's device count, in
every process: XLA splits some loops into as many parallel partitions as the
pool has threads (an MoE layer's cumulative sums, for one), and the pool
otherwise grows with the devices a process holds — so a process of four
devices and two of two would compile different code and differ in the last
bits.

A process that cannot join ends with one line, never with JAX's C++ check
failure: before JAX is called, process 0 checks it can bind the coordinator's
port and every other process waits (up to ``distributed.timeout_s``) until
the coordinator accepts a TCP connection; while JAX connects, a deadline of
``distributed.timeout_s`` ends the process with one line (exit 1) before
JAX's own, longer limit would abort it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading
import time

from orchestrator.addresses import AddressError, split_address

#: JAX's own heartbeat ends a process whose peer is gone; ours must fire first, with one line: JAX's is given
#: this many times ``distributed.timeout_s``, plus a margin that keeps it clear of ours at the smallest timeouts.
_JAX_HEARTBEAT_FACTOR = 3
_JAX_HEARTBEAT_MARGIN_S = 10
#: JAX aborts a connect that outlives its limit; ours (``distributed.timeout_s``) must come first, with one line.
_JAX_CONNECT_GRACE_S = 30
_RETRY_S = 0.2


class DistributedError(RuntimeError):
  """This process could not join the job (the message names the coordinator, the id and the fix)."""


@dataclasses.dataclass(frozen=True)
class ProcessIdentity:
  """Who this process is in the job."""

  process_id: int
  num_processes: int
  coordinator_address: str | None

  @property
  def is_primary(self) -> bool:
    """Process 0 writes the run's records, trace and summary."""
    return self.process_id == 0


#: The environment variable XLA's CPU client sizes its thread pool from.
XLA_THREADS_ENV = "PJRT_NPROC"


def fix_xla_threads(job_devices: int) -> int:
  """Sizes XLA's CPU pool to ``job_devices`` threads (before the backend starts); returns it."""
  os.environ[XLA_THREADS_ENV] = str(job_devices)
  return job_devices


def join(section) -> ProcessIdentity:
  """Joins the job the recipe's ``distributed`` section describes; returns this process's identity.

  If the job has not assembled within ``section.timeout_s``, this process
  ends itself with one line and exit 1 (``_Deadline``).

  Raises:
    DistributedError: the coordinator's port is taken (process 0), the
      coordinator was not reached in time (the others), or JAX refused the job.
  """
  timeout_s = max(1, int(round(section.timeout_s)))
  deadline = time.monotonic() + timeout_s
  if not section.detect_cluster:  # a cluster's coordinator is JAX's to find
    check_coordinator(section, timeout_s, deadline)
  import jax  # import here: bringup loads before the host settings
  from jax._src import distributed as jax_distributed  # import here: bringup loads before the host settings

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  sigterm = signal.getsignal(signal.SIGTERM)
  kwargs = dict(initialization_timeout=timeout_s + _JAX_CONNECT_GRACE_S,
                heartbeat_timeout_seconds=_JAX_HEARTBEAT_FACTOR * timeout_s + _JAX_HEARTBEAT_MARGIN_S)
  try:
    with _Deadline(deadline, _assembly_line(section, timeout_s)):
      if section.detect_cluster:
        jax.distributed.initialize(**kwargs)
      else:
        jax.distributed.initialize(section.coordinator_address, section.num_processes, section.process_id,
                                   **kwargs)
  except Exception as e:  # pylint: disable=broad-except  # JAX raises several runtime error types here
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise DistributedError(
        f"{_who(section)} could not join the job through {_where(section)} ({first_line[:200]}); start every"
        " process with the same distributed.num_processes and coordinator_address, each with its own"
        " distributed.process_id") from None
  _restore_sigterm(sigterm)
  state = jax_distributed.global_state  # the identity without starting a backend (jax.process_index would)
  return ProcessIdentity(int(state.process_id), int(state.num_processes), state.coordinator_address)


def _who(section) -> str:
  if section.process_id is None:
    return "this process"
  return f"process {section.process_id} of {section.num_processes}"


def _where(section) -> str:
  return "the cluster's coordinator" if section.detect_cluster else f"the coordinator at {section.coordinator_address}"


def _assembly_line(section, timeout_s: int) -> str:
  """The line of a job that did not assemble in time: who waited, where, for how long, and what to do."""
  verb = "waited for" if section.detect_cluster else "serves" if section.process_id == 0 else "reached"
  waited = f"{verb} {_where(section)}"
  return (f"{_who(section)} {waited} but the job did not assemble within {timeout_s} s (distributed.timeout_s):"
          " not every process connected; start all of them within that time, with the same"
          " distributed.num_processes and coordinator_address, or raise distributed.timeout_s")


class _Deadline:
  """Ends this process with one line (exit 1) if the block is still running at ``deadline``.

  JAX's connect waits for every process and, past its own limit, aborts the
  process with a C++ check failure; a process still connecting when process 0
  left retries until that limit too. JAX's limit is set beyond this one, and
  its connect releases the GIL, so this thread speaks first. ``os._exit``: the
  half-joined runtime has nothing to save, and its teardown would only log.
  """

  def __init__(self, deadline: float, line: str):
    self._deadline, self._line = deadline, line
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="step-boundary-join-deadline", daemon=True)

  def __enter__(self) -> "_Deadline":
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._done.set()

  def _watch(self) -> None:
    if not self._done.wait(max(0.0, self._deadline - time.monotonic())):
      print(f"run_rl: error: {self._line}", file=sys.stderr, flush=True)
      os._exit(1)


def check_coordinator(section, timeout_s: float, deadline: float) -> None:
  """Before JAX is called: process 0 can bind the coordinator's port; any other process can reach it by
  ``deadline`` (retrying: process 0 may start later). JAX would abort the process on either failure.

  Raises:
    DistributedError: the port is taken, or the coordinator did not accept a connection in time.
  """
  host, port = split_address(section.coordinator_address)
  if section.process_id == 0:
    _check_bindable(section, port)
    return
  reason = "no answer"
  while True:
    try:
      with socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
        return
    except OSError as e:
      reason = (e.strerror or "no answer").lower()
    if time.monotonic() + _RETRY_S >= deadline:
      raise DistributedError(
          f"{_who(section)} could not reach the coordinator at {section.coordinator_address} within {timeout_s:g} s"
          f" ({reason}); start process 0 there (it serves the coordinator), check"
          " distributed.coordinator_address, or raise distributed.timeout_s")
    time.sleep(_RETRY_S)


def _check_bindable(section, port: int) -> None:
  """Process 0's coordinator binds every address on ``port`` (JAX's default; ``JAX_COORDINATOR_BIND_ADDRESS``
  overrides it): bind it once here, as gRPC will (``SO_REUSEADDR``), so a port in use is one line."""
  bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or f"[::]:{port}"
  try:
    host, port = split_address(bind)
  except AddressError as e:
    raise DistributedError(f"JAX_COORDINATOR_BIND_ADDRESS: {e}") from None
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  try:
    sock = socket.socket(family, socket.SOCK_STREAM)
  except OSError:  # no IPv6 on this host: gRPC falls back to IPv4
    host, family = "0.0.0.0", socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
  with sock:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
      sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
      sock.bind((host, port))
    except OSError as e:
      raise DistributedError(
          f"process 0 of {section.num_processes} cannot serve the coordinator on port {port}"
          f" (distributed.coordinator_address={section.coordinator_address}): {(e.strerror or str(e)).lower()};"
          " free the port, or start every process with another distributed.coordinator_address") from None


def _restore_sigterm(handler) -> None:
  """Puts back the SIGTERM handler of before the join (default: end the process). JAX's preemption notifier
  takes SIGTERM over when the job is joined and nothing here acts on it: the run stops through its own
  agreement (launch's StopSignals, installed when the run starts), and until then a process of a job that
  fails at bring-up must end on the first SIGTERM, not ignore it."""
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, handler if handler is not None else signal.SIG_DFL)


def key_value_client():
  """The coordinator's key-value client of this job (None before ``join``)."""
  from jax._src import distributed as jax_distributed  # import here: bringup loads before the host settings

  return jax_distributed.global_state.client

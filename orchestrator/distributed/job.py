"""This process's place in the run: alone, or one member of a multi-controller job.

``Job`` carries what the rest of ``run_rl`` needs to know: whether this is the
primary (process 0 writes the run's files), the agreement the program and the
bring-up exchange through, and the watchdog. ``single()`` is the job of a run
of one process without a distributed runtime.

The job owns what happens when its watchdog reports a lost peer
(``on_lost_peer``, told the run's step in flight through ``current_step``) and
when this process fails (``report_failure``: the peers are told, so they end
at once naming this process), and admits its processes (``admit``: the same
settings and version in every one) before any device work.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from orchestrator.distributed import admission
from orchestrator.distributed.agreement import KeyValueAgreement, SingleProcess
from orchestrator.distributed.bringup import ProcessIdentity, join, key_value_client
from orchestrator.distributed.launcher import ENDED_BY_PEER_EXIT
from orchestrator.distributed.watchdog import Watchdog

_END_BARRIER = "step_boundary/end"


def end_on_lost_peer(job: Job, line: str) -> None:
  """The default answer to a lost peer: one line naming it, then ``job.end_for_peer()`` (a peer inside a
  collective with a dead process would otherwise wait forever)."""
  print(f"run_rl: {job.label}{line}; ending this process", file=sys.stderr, flush=True)
  job.end_for_peer()


def _exit_now(code: int) -> None:
  """Ends this process with ``code`` once its lines are out, skipping JAX's teardown (see ``Job.leave_failed``)."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def no_step_yet() -> int | None:
  """The step in flight before a run is built: none."""
  return None


@dataclasses.dataclass
class Job:
  """This process's place in the run (see the module docstring).

  ``on_lost_peer(job, line)`` runs on the watchdog's thread when a peer is
  lost and is expected to end the process; ``current_step()`` is the run's
  step in flight (None before the run is built), for that handler to name.
  """

  identity: ProcessIdentity
  agreement: SingleProcess
  watchdog: Watchdog | None = None
  distributed: bool = False
  on_lost_peer: Callable[[Job, str], Any] = end_on_lost_peer
  current_step: Callable[[], int | None] = no_step_yet

  @property
  def is_primary(self) -> bool:
    return self.identity.is_primary

  @property
  def label(self) -> str:
    """``process i of N: `` for a job of several processes, else nothing (prefixes its lines)."""
    return f"process {self.identity.process_id} of {self.identity.num_processes}: " if self.distributed else ""

  def report_lost_peer(self, line: str) -> None:
    """What the watchdog calls with its one line about a lost peer: hands it to ``on_lost_peer``."""
    self.on_lost_peer(self, line)

  def report_failure(self, error: BaseException) -> None:
    """This process failed with ``error``. If a peer failed or died first (a collective with it failed here
    too), the watchdog ends this process naming that peer, and this never returns; else the peers are told
    the error's first line, and each one's watchdog ends it naming this process. A run of one process has
    nobody to tell."""
    if self.watchdog is None:
      return
    self.watchdog.wait_for_peers()
    try:
      self.watchdog.post_failure(f"{type(error).__name__}: {error}")
      if self.is_primary:  # it serves the coordinator: it stays until the peers have read the line
        self.watchdog.wait_until_peers_end()
    except Exception:  # pylint: disable=broad-except  # the coordinator is gone: the peers end by JAX's heartbeat
      return

  def end_for_peer(self) -> None:
    """Ends this process, exit ``ENDED_BY_PEER_EXIT``, after a peer failed or went silent (the caller said which,
    in one line): tells a process 0 that failed, and waits for its peers to end, that this one is ending."""
    if self.watchdog is not None:
      self.watchdog.post_ending()
    _exit_now(ENDED_BY_PEER_EXIT)

  def leave_failed(self, code: int) -> int:
    """Leaves the job after this process failed (or stopped apart from the others): returns ``code`` in a run of
    one process; in a job of several it ends this process at once with ``code``, since JAX's teardown would
    wait at the job's shutdown barrier for processes that are ending too, or abort this one (another exit code,
    JAX's lines) where process 0, the coordinator, is gone first."""
    self.finish(succeeded=False)
    if self.watchdog is None:
      return code
    _exit_now(code)

  def admit(self, settings: Mapping[str, Any]) -> None:
    """Compares ``settings`` (what must agree: the recipe less this process's identity and output paths) and
    the version across the job's processes: the job's first exchange, before any device work. A run of one
    process has nothing to compare.

    Raises:
      admission.JobMismatchError: in every process alike, naming the first difference.
      ProcessLostError / AgreementError: a process did not reach admission, or is at another exchange.
    """
    if self.distributed and self.identity.num_processes > 1:
      admission.admit(self.agreement, key_value_client(), settings)

  def first_refusal(self, refusal: Exception | None) -> str | None:
    """Every process's refusal (or None) exchanged: the first one, naming its process, or None.

    Every process refuses together, so none goes on to wait for the others.
    """
    texts = self.agreement.exchange("preflight", None if refusal is None else str(refusal))
    for process_id, text in enumerate(texts):
      if text is not None:
        alike = all(t == text for t in texts)  # every process refused the same input: say it once
        return text if alike else f"process {process_id} of {len(texts)}: {text}"
    return None

  def finish(self, succeeded: bool) -> None:
    """Leaves the job: after a success every process waits for the others, so none outlives the
    coordinator (process 0); after a failure it leaves at once and the others notice."""
    if not self.distributed:
      return
    if self.watchdog is not None:
      self.watchdog.stop()
    if not succeeded:
      return
    import jax  # import here: the job loads before the host settings

    client = key_value_client()
    try:
      client.wait_at_barrier(_END_BARRIER, int(self.agreement.timeout_s * 1000))
    except Exception as e:  # pylint: disable=broad-except
      print(f"run_rl: {self.label}the other processes did not finish within {self.agreement.timeout_s:g} s ({e})",
            file=sys.stderr, flush=True)
      return
    jax.distributed.shutdown()


def single() -> Job:
  return Job(ProcessIdentity(0, 1, None), SingleProcess())


def join_job(section, *, on_lost_peer: Callable[[Job, str], Any] = end_on_lost_peer) -> Job:
  """Joins the job ``section`` describes and starts the watchdog, which reports a lost peer to the job's
  ``on_lost_peer`` (see ``bringup.join``)."""
  identity = join(section)
  client = key_value_client()
  agreement = KeyValueAgreement(client, identity.process_id, identity.num_processes, timeout_s=section.timeout_s)
  job = Job(identity, agreement, distributed=True, on_lost_peer=on_lost_peer)
  if identity.num_processes > 1:
    job.watchdog = Watchdog(client, identity.process_id, identity.num_processes, timeout_s=section.timeout_s,
                            on_lost=job.report_lost_peer).start()
  return job

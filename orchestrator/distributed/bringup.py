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
"""

from __future__ import annotations

import dataclasses
import os

#: JAX's own heartbeat ends a process whose peer is gone; ours must fire first, with one line.
_JAX_HEARTBEAT_FACTOR = 3


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

  Raises:
    DistributedError: the coordinator was not reached, or the job did not
      assemble, within ``section.timeout_s``.
  """
  import jax  # import here: bringup loads before the host settings
  from jax._src import distributed as jax_distributed  # import here: bringup loads before the host settings

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  timeout_s = max(1, int(round(section.timeout_s)))
  kwargs = dict(initialization_timeout=timeout_s,
                heartbeat_timeout_seconds=_JAX_HEARTBEAT_FACTOR * timeout_s + 10)
  where = "the cluster's coordinator" if section.detect_cluster else f"the coordinator at {section.coordinator_address}"
  try:
    if section.detect_cluster:
      jax.distributed.initialize(**kwargs)
    else:
      jax.distributed.initialize(section.coordinator_address, section.num_processes, section.process_id, **kwargs)
  except Exception as e:  # pylint: disable=broad-except  # JAX raises several runtime error types here
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise DistributedError(
        f"process {section.process_id if section.process_id is not None else '?'} could not join the job through"
        f" {where} within {timeout_s} s ({first_line[:200]}); start every process with the same"
        " distributed.num_processes and coordinator_address, process 0 first, or raise distributed.timeout_s"
    ) from None
  state = jax_distributed.global_state  # the identity without starting a backend (jax.process_index would)
  return ProcessIdentity(int(state.process_id), int(state.num_processes), state.coordinator_address)


def key_value_client():
  """The coordinator's key-value client of this job (None before ``join``)."""
  from jax._src import distributed as jax_distributed  # import here: bringup loads before the host settings

  return jax_distributed.global_state.client

"""Several JAX processes (multi-controller) training one model: bring-up, agreement, liveness, local launch.

* ``bringup``: joins this process to the job (``jax.distributed``) before JAX
  starts its backend, with CPU collectives where the devices are CPUs.
* ``agreement``: the host-side exchanges that keep every process on the same
  path at each boundary (the policy's inputs combined, a stop agreed, a
  refusal shared), through the coordinator's key-value store — never through
  the devices, so no exchange waits behind queued compute.
* ``watchdog``: a heartbeat per process; one that fails or goes silent ends
  the others with one line naming it.
* ``launcher``: ``distributed.num_processes=N`` on one host starts N local
  processes and reports how they ended.

The call order and the rules are in docs/distributed.md.
"""

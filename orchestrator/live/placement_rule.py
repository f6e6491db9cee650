"""Where ``rollouts.placement: auto`` puts the live loop's sampler, and why (no JAX: a rule over facts).

One process at a time may hold an accelerator (a TPU's runtime refuses a second
one; a GPU's is shared badly), so a sampler in a process of its own belongs on
the host's cores, and there it is slower than the accelerator by far. On a CPU
host the opposite holds: the trainer's XLA client would run the sampler's
programs between its own, and a process of its own keeps them apart.
"""

from __future__ import annotations

from typing import Literal, get_args

#: The placements a recipe may name (``rollouts.placement``); ``auto`` is resolved by ``choose_placement``.
Placement = Literal["auto", "shared", "split", "process"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)


def choose_placement(requested: Placement, *, platform: str, processes: int, trainer_local: bool) -> tuple[str, str]:
  """The placement a live run uses and, in words, where that puts the sampler and why.

  Args:
    requested: the recipe's ``rollouts.placement``.
    platform: the trainer's JAX platform in this process (``jax.default_backend()``: cpu, tpu, gpu).
    processes: the job's JAX processes.
    trainer_local: the trainer runs in this process (``trainer.location: local``).

  ``auto``: on a CPU host, or where this process does not hold the trainer's devices, ``process``; where the
  trainer holds an accelerator in a job of one process, ``shared`` (the sampler computes on the trainer's
  devices and each weight sync hands it the updated arrays there, as Tunix's single-host GRPO does). An
  explicit ``process`` beside an accelerator runs on the host's cores (its process never opens the
  accelerator).
  """
  accelerator = platform != "cpu"
  if requested == "auto":
    if accelerator and processes == 1 and trainer_local:
      return "shared", (f"on the trainer's {platform.upper()} devices (rollouts.placement=auto: one process holds"
                        " the accelerator, so the sampler shares it and takes each update's weights there)")
    if accelerator:
      why = ("a job of several processes, each holding its share of the accelerators" if processes > 1
             else "the trainer runs in another process")
      return "process", f"in a process of its own on the host's cores (rollouts.placement=auto: {why})"
    return "process", ("in a process of its own on the host's cores (rollouts.placement=auto on a CPU host: its"
                       " programs never queue between the trainer's)")
  if requested == "process":
    where = (f"on the host's cores, never on the {platform.upper()} the trainer holds" if accelerator
             else "on the host's cores")
    return "process", f"in a process of its own {where} (rollouts.placement=process)"
  if requested == "split":
    return "split", "on devices of its own beside the trainer's (rollouts.placement=split)"
  return "shared", f"on the trainer's {platform.upper()} devices (rollouts.placement=shared)"

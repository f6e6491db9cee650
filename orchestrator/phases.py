"""How long a run took to get going: when this process reached each phase of its start, for summary.json.

``mark`` notes the first time a phase is reached (later calls keep it); ``seconds_from_start`` gives each as
seconds from the process's start, which Linux records (``/proc/self/stat``; elsewhere, the first mark).
"""

from __future__ import annotations

import os
import time

#: The phases of a run's start, each with its words in the closing lines (which list them in the order they
#: came): the command's imports done (validation starts), JAX's backend up on the run's cores, the model built
#: and its weights placed on the devices, the trainer's programs compiled (or loaded from the persistent cache:
#: from weights placed to trainer built is compilation alone), the first rollouts sampled (a new live run
#: samples while its trainer is built, so these may come before; a resumed one trains first on the rollouts its
#: checkpoint carried, so they may come after the first update), the first update done.
PHASES = {"imports": "imports", "jax_ready": "JAX up", "weights_placed": "weights placed",
          "trainer_built": "trainer built", "first_rollout": "first rollouts", "first_update": "first update"}

_MARKS: dict[str, float] = {}


def mark(phase: str, at: float | None = None) -> None:
  """Notes that this process reached ``phase`` now (or at the Unix time ``at``), unless it was noted before."""
  if phase in _MARKS:  # the common case, once per sampled micro-batch: nothing to do
    return
  if phase not in PHASES:
    raise ValueError(f"phase {phase!r} is not one of {', '.join(PHASES)}")
  _MARKS[phase] = time.time() if at is None else at


def restart() -> None:
  """Forgets every mark: a run inside a longer-lived process (the tests run several) starts its own."""
  _MARKS.clear()


def process_started_at() -> float | None:
  """The Unix time this process started (Linux, to 10 ms; None elsewhere)."""
  try:
    with open("/proc/self/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the command's name
    with open("/proc/uptime") as f:
      uptime_s = float(f.read().split()[0])
    return time.time() - (uptime_s - ticks / os.sysconf("SC_CLK_TCK"))
  except (OSError, ValueError, IndexError):
    return None


def seconds_from_start() -> dict[str, float]:
  """Each phase reached, in order: seconds from the process's start (10 ms resolution)."""
  origin = process_started_at() or min(_MARKS.values(), default=0.0)
  return {phase: round(_MARKS[phase] - origin, 3) for phase in PHASES if phase in _MARKS}

"""The reduced rig: replay a recording through the real program, A/B the modes, check, report.

``rig``: ``run_rig``, a run's order; ``arms``: arms, faults, refusals;
``replay``: the steps every arm is fed; ``trainers``: where the arms run (here
or on a remote trainer); ``recording_engine``: the call-recording engine proxy;
``remote_host``: that proxy on a remote trainer's host; ``calibration``: the
component times; ``checks``: ``Check`` and every check; ``report``: the files.

Names are imported lazily, so that the JAX-free parts (arms, checks, the
proxy) load without JAX, and a trainer's host loads only ``remote_host``'s.
"""

import importlib

_EXPORTS = {
    "RigError": "orchestrator.rig.arms",
    "RigResult": "orchestrator.rig.rig",
    "run_rig": "orchestrator.rig.rig",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'orchestrator.rig' has no attribute {name!r}")
  return getattr(importlib.import_module(_EXPORTS[name]), name)

"""JAX training engine (Tunix Qwen3) with optional staging of the next micro-batch.

Names are imported lazily, so that JAX-free parts (presets, options, the recipe
schema) can be used without importing JAX — and before ``reserve_host_core``.
"""

import importlib

_EXPORTS = {
    "Computation": "orchestrator.engine.engine",
    "JaxTrainingEngine": "orchestrator.engine.engine",
    "PreparedFwdBwdInput": "orchestrator.engine.engine",
    "backend_compile_count": "orchestrator.engine.engine",
    "build_engine": "orchestrator.engine.engine",
    "EngineOptions": "orchestrator.engine.options",
    "reserve_host_core": "orchestrator.engine.host_threads",
    "MeshConfig": "orchestrator.engine.mesh",
    "ModelPreset": "orchestrator.engine.presets",
    "load_preset": "orchestrator.engine.presets",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'orchestrator.engine' has no attribute {name!r}")
  return getattr(importlib.import_module(_EXPORTS[name]), name)

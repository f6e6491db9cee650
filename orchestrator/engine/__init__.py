"""JAX training engine (Tunix Qwen3) with optional staging of the next micro-batch.

Names are imported lazily, so that JAX-free parts (presets, options, the recipe
schema) can be used without importing JAX — and before ``reserve_host_core``.
``build_backend`` builds whichever engine a recipe's ``engine.backend`` names.
"""

import importlib

_EXPORTS = {
    "JaxTrainingEngine": "orchestrator.engine.engine",
    "PreparedFwdBwdInput": "orchestrator.engine.engine",
    "EngineSnapshot": "orchestrator.engine.engine",
    "build_engine": "orchestrator.engine.engine",
    "backend_compile_count": "orchestrator.engine.diagnostics",
    "tree_digest": "orchestrator.engine.diagnostics",
    "EngineOptions": "orchestrator.engine.options",
    "BACKENDS": "orchestrator.engine.options",
    "build_backend": "orchestrator.engine.backends",
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

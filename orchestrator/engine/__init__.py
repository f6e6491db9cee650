"""The JAX training engine (Tunix models) with optional staging of the next micro-batch.

Names are imported lazily, so that JAX-free parts (the options, the backend
registry) can be used without importing JAX. Model formats live in
``orchestrator.models``, the process's host set-up in ``orchestrator.host``.
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
    "MeshConfig": "orchestrator.engine.mesh",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'orchestrator.engine' has no attribute {name!r}")
  return getattr(importlib.import_module(_EXPORTS[name]), name)

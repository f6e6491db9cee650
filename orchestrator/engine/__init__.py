"""JAX training engine (Tunix Qwen3) with optional staging of the next micro-batch."""

from orchestrator.engine.engine import (
    Computation,
    EngineOptions,
    JaxTrainingEngine,
    PreparedFwdBwdInput,
    backend_compile_count,
    build_engine,
)
from orchestrator.engine.host_threads import reserve_host_core
from orchestrator.engine.mesh import MeshConfig
from orchestrator.engine.presets import ModelPreset, load_preset

__all__ = [
    "Computation",
    "EngineOptions",
    "JaxTrainingEngine",
    "MeshConfig",
    "ModelPreset",
    "PreparedFwdBwdInput",
    "backend_compile_count",
    "build_engine",
    "load_preset",
    "reserve_host_core",
]

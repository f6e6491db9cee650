"""Step-boundary policies: a pure state machine fed with measurements (no JAX)."""

from policies.step_boundary import (
    BoundaryPlan,
    CalibrationRule,
    Mode,
    Observation,
    StagingUnsupportedError,
    StepBoundaryPolicy,
    Transition,
)

__all__ = [
    "BoundaryPlan",
    "CalibrationRule",
    "Mode",
    "Observation",
    "StagingUnsupportedError",
    "StepBoundaryPolicy",
    "Transition",
]

"""Step-boundary policies: a pure state machine fed with measurements (no JAX)."""

from policies.call_order import Action, boundary_actions
from policies.step_boundary import (
    BoundaryPlan,
    CalibrationRule,
    DeviceHeadroom,
    HeadroomRule,
    Mode,
    ModeFlags,
    MODE_TABLE,
    Observation,
    PolicyReport,
    StagingUnsupportedError,
    StepBoundaryPolicy,
    Transition,
)

__all__ = [
    "Action",
    "boundary_actions",
    "BoundaryPlan",
    "CalibrationRule",
    "DeviceHeadroom",
    "HeadroomRule",
    "Mode",
    "ModeFlags",
    "MODE_TABLE",
    "Observation",
    "PolicyReport",
    "StagingUnsupportedError",
    "StepBoundaryPolicy",
    "Transition",
]

"""Step-boundary policies: a pure state machine fed with measurements (no JAX)."""

from policies.calibration import CalibrationRule, WaitThreshold
from policies.call_order import Action, boundary_actions
from policies.headroom import DeviceHeadroom, HeadroomRule, MemoryGate
from policies.low_waits import LowWaitStreak
from policies.step_boundary import (
    BoundaryPlan,
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
    "LowWaitStreak",
    "MemoryGate",
    "Mode",
    "ModeFlags",
    "MODE_TABLE",
    "Observation",
    "PolicyReport",
    "StagingUnsupportedError",
    "StepBoundaryPolicy",
    "Transition",
    "WaitThreshold",
]

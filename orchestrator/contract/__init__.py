"""The contracts between the parts, each a runtime-checkable Protocol whose docstrings are the contract.

- ``engine``: what a training engine does (``TrainingEngine``, ``StagingEngine``,
  ``CheckpointingEngine``, ``WeightSource``, ``StateDigestingEngine``, ``MemoryReportingEngine``,
  ``SnapshotEngine``),
  its ``Receipt``, ``StepMetrics`` and ``DeviceMemory``.
- ``worker``: what the step loop drives (``Worker``, the optional ``WeightsOverWire`` part) and the
  results it hands back.
- ``source``: where the steps come from (``StepSource``, the optional ``LiveSource``
  part) and ``RolloutStats``.
- ``outputs``: what a run hands back (``RunSummary`` and its parts).

None of them imports JAX or ``orchestrator.engine``: the loop, the recorder and
the remote worker depend on these alone (docs/design.md §3–4).
"""

from orchestrator.contract.engine import (
    STAGING_METHODS,
    CheckpointingEngine,
    DeviceMemory,
    MemoryReportingEngine,
    PreparedInput,
    Receipt,
    SnapshotEngine,
    StagingEngine,
    StateDigestingEngine,
    StepMetrics,
    TrainingEngine,
    WeightSource,
    missing_methods,
)
from orchestrator.contract.outputs import (
    AgreementCost,
    Evaluation,
    ProcessTimings,
    RolloutSummary,
    RunSummary,
    StepTimings,
)
from orchestrator.contract.source import (HeldOutScore, LiveSource, RolloutStats, SourceStateError, StepSource,
                                         WeightTransfer, live_part)
from orchestrator.contract.worker import (DeferredUpdate, NoCheckpointError, StageReceipt, WeightsOverWire, Worker,
                                         WorkerCapabilities, WorkerUsageError)

__all__ = [
    "AgreementCost", "CheckpointingEngine", "DeferredUpdate", "DeviceMemory", "Evaluation", "HeldOutScore",
    "LiveSource", "MemoryReportingEngine", "NoCheckpointError", "PreparedInput", "ProcessTimings", "Receipt",
    "RolloutStats", "RolloutSummary", "RunSummary", "STAGING_METHODS",
    "SnapshotEngine", "SourceStateError", "StageReceipt", "StagingEngine", "StateDigestingEngine", "StepMetrics",
    "StepSource", "StepTimings", "TrainingEngine", "WeightSource", "WeightTransfer", "WeightsOverWire", "Worker",
    "WorkerCapabilities",
    "WorkerUsageError", "live_part", "missing_methods",
]

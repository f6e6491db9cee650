"""Trajectories, packing into micro-batches, synthetic rollouts, recordings and their replay.

Nothing here imports ``orchestrator.engine``: the engine depends on this package,
never the other way round.
"""

from orchestrator.data.trajectory import Trajectory, TrajectoryGroup

__all__ = ["Trajectory", "TrajectoryGroup"]

"""Trajectories, synthetic rollouts, and (later) recordings."""

from orchestrator.data.trajectory import Trajectory

__all__ = ["Trajectory"]

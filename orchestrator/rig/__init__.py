"""The reduced rig: replay a recording through the real program, A/B the modes, check, report."""

from orchestrator.rig.rig import RigResult, run_rig

__all__ = ["RigResult", "run_rig"]

"""The RL program side of step-boundary: engine, trainer worker, step loop, data and rig."""

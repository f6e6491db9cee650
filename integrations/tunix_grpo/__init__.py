"""The step-boundary add-on for Tunix's RL learners (``GRPOLearner`` and kin): see ``addon``."""

from integrations.tunix_grpo.addon import AddonUsageError, StepBoundaryAddon, install
from integrations.tunix_grpo.compat import SUPPORTED_TUNIX_VERSIONS, UnsupportedTunixError
from integrations.tunix_grpo.throttle import CountingThrottler

__all__ = ["StepBoundaryAddon", "install", "AddonUsageError", "UnsupportedTunixError",
           "SUPPORTED_TUNIX_VERSIONS", "CountingThrottler"]

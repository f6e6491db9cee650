"""The live RL loop: the sampler over the trained model (in this process or one of its own), the rollout thread,
GRPO's batches and the weight versions a staleness bound keeps. Its tasks, datasets, rewards and tokenizers
are ``orchestrator.tasks``."""

"""The live RL loop's parts: a character tokenizer, tasks with verifiable rewards, GRPO advantages,
and a sampler over the trained model."""

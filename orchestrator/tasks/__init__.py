"""What the live loop trains on, no JAX: tokenizers (characters, a checkpoint's), tasks with verifiable
rewards, prompt datasets and reward functions (numpy only)."""

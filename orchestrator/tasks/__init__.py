"""What the live loop trains on: tokenizers (characters, a checkpoint's), tasks with verifiable rewards, prompt
datasets and reward functions. No JAX at import (GRPO's advantages take Tunix's inside the call)."""

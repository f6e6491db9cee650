"""Model formats, no JAX: the families a preset can name, the presets, Hugging Face checkpoints and GGUF files
read to a preset and plain arrays, and the rotary and local/global attention settings they carry.

The engine builds Tunix models from what this package reads; nothing here imports ``orchestrator.engine``.
"""

"""Checkpoints: Hugging Face safetensors in and out, orbax save/restore."""

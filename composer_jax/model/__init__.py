"""The Flax NNX Kimi K2.5 / DeepSeek-V3 model."""

from composer_jax.model.transformer import CausalLM, Output

__all__ = ["CausalLM", "Output"]

"""composer_jax: train Kimi-K2.5-architecture MoE coding models in JAX."""

from composer_jax.config import ModelConfig, load_config
from composer_jax.model import CausalLM

__version__ = "0.1.0"

__all__ = ["CausalLM", "ModelConfig", "from_pretrained", "load_config"]


def from_pretrained(path, overrides=(), **kwargs) -> CausalLM:
    """Load a Hugging Face DeepSeek-V3 / Kimi K2 / K2.5 directory; see `checkpoint.hf.from_pretrained`."""
    from composer_jax.checkpoint.hf import from_pretrained as _load

    return _load(path, overrides, **kwargs)

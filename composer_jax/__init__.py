"""composer_jax: train Kimi-K2.5-architecture MoE coding models in JAX.

The model is imported lazily, so host-side packages (`sandbox`, `tasks`, `envs`) import without jax.
"""

__version__ = "0.1.0"

__all__ = ["CausalLM", "ModelConfig", "from_pretrained", "generate", "load_config"]


def __getattr__(name: str):
    if name == "CausalLM":
        from composer_jax.model import CausalLM

        return CausalLM
    if name == "generate":
        from composer_jax.infer import generate

        return generate
    if name in ("ModelConfig", "load_config"):
        from composer_jax import config

        return getattr(config, name)
    raise AttributeError(f"module 'composer_jax' has no attribute {name!r}")


def from_pretrained(path, overrides=(), **kwargs):
    """Load a Hugging Face DeepSeek-V3 / Kimi K2 / K2.5 directory; see `checkpoint.hf.from_pretrained`."""
    from composer_jax.checkpoint.hf import from_pretrained as _load

    return _load(path, overrides, **kwargs)

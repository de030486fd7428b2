"""The Flax NNX Kimi K2.5 / DeepSeek-V3 model."""

from flax import nnx

from composer_jax.model.accounting import abstract_params
from composer_jax.model.layers import RouterBias
from composer_jax.model.transformer import CausalLM, Output


def split_model(model: CausalLM):
    """(graphdef, params, biases, rest) of a model; `rest` holds any other variables (none today)."""
    return nnx.split(model, nnx.Param, RouterBias, ...)


__all__ = ["CausalLM", "Output", "abstract_params", "split_model"]

"""The inference engine: absorbed-MLA latent-cache decoding, continuous batching over fixed slots,
chunked prefill, per-request sampling, MTP speculative decoding, weight versions, and `generate()`.

Imports `model` and `parallel` only (shared/DESIGN.md)."""

from composer_jax.infer.engine import Completion, Engine, GenerationError, Update
from composer_jax.infer.generate import GenerateResult, generate
from composer_jax.infer.sampling import SamplingParams

__all__ = ["Completion", "Engine", "GenerateResult", "GenerationError", "SamplingParams", "Update", "generate"]

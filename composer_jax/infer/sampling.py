"""Per-request sampling: temperature, top-k, top-p and seeds, inside the engine's jitted programs.

Every slot carries its own settings (`SlotSampling`, one value per slot), so one program serves any
mix of requests. The random draw for the token at sequence index j of a request comes from a key
derived only from the request's seed, j and the draw's purpose (`token_keys`): a request's tokens do
not depend on which other requests share the batch, nor on the slot it runs in.

Two log-probabilities come with every token (`logprobs`):
- raw: under the model's own distribution, log_softmax(logits) (temperature 1, nothing truncated),
  what the training forward gives;
- behaviour: under the distribution the token was drawn from (`processed_logprobs`), what the RL
  step's importance correction needs. It equals the raw one when the settings change nothing, and is 0
  for greedy decoding (a point mass).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Purposes of a random draw, folded into the key after the token index (speculative decoding draws
# several numbers for one index).
SAMPLE, DRAFT, ACCEPT, RESIDUAL = range(4)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are drawn.

    temperature: 0 is greedy (argmax); top_k: keep the k most likely tokens (0: all); top_p: then keep
    the smallest set of most likely tokens whose probability reaches top_p (1: all); seed: the request's
    own random stream (0 <= seed < 2**32).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")


class SlotSampling(NamedTuple):
    """Sampling settings per slot: temperature f32[slots], top_p f32[slots], top_k int32[slots],
    seed uint32[slots]."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    seed: jax.Array

    @staticmethod
    def of(params: list[SamplingParams]) -> "SlotSampling":
        """Host arrays for a list of per-slot settings."""
        return SlotSampling(np.array([p.temperature for p in params], np.float32),
                            np.array([p.top_p for p in params], np.float32),
                            np.array([p.top_k for p in params], np.int32),
                            np.array([p.seed for p in params], np.uint32))


def processed_logprobs(logits: jax.Array, sampling: SlotSampling) -> jax.Array:
    """f32[slots, vocab]: log-probabilities of the distribution tokens are drawn from, -inf outside it.

    logits: f32[slots, vocab]. Temperature scales the logits, top-k keeps the k largest (ties at the
    k-th value are all kept), top-p then keeps the most likely tokens until the mass before the next
    one reaches top_p (renormalised over the top-k set, as vLLM orders them); temperature 0 keeps the
    argmax alone (the first one on ties). The sort that truncation needs is skipped when no slot
    truncates.
    """
    vocab = logits.shape[-1]
    greedy = sampling.temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, sampling.temperature)[:, None]
    rank = jnp.arange(vocab)

    def truncated():
        descending = -jnp.sort(-scaled, axis=-1)
        k = jnp.where(sampling.top_k > 0, jnp.minimum(sampling.top_k, vocab), vocab)
        in_top_k = rank[None] < k[:, None]
        probs = jax.nn.softmax(jnp.where(in_top_k, descending, -jnp.inf), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # top_p = 1 keeps everything: a cumulative sum that rounds to 1 must not cut the tail.
        kept = in_top_k & ((mass_before < sampling.top_p[:, None]) | (sampling.top_p[:, None] >= 1))
        threshold = jnp.min(jnp.where(kept, descending, jnp.inf), axis=-1)
        return scaled >= threshold[:, None]

    truncating = jnp.any((sampling.top_k > 0) | (sampling.top_p < 1))
    keep = jax.lax.cond(truncating, truncated, lambda: jnp.ones_like(scaled, bool))
    keep = jnp.where(greedy[:, None], rank[None] == jnp.argmax(logits, axis=-1)[:, None], keep)
    return jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)


def token_keys(seed: jax.Array, index: jax.Array, purpose: int) -> jax.Array:
    """One PRNG key per slot from its request's seed uint32[slots], the token's sequence index
    int32[slots] and the purpose of the draw."""
    def one(s, i):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), i), purpose)

    return jax.vmap(one)(seed, index)


def draw(logprobs: jax.Array, sampling: SlotSampling, index: jax.Array, purpose: int) -> jax.Array:
    """int32[slots]: one token per slot from log-probabilities f32[slots, vocab] (-inf: excluded), with
    the key of (seed, index, purpose). A greedy slot's distribution is a point mass: its argmax. When
    every slot is greedy the random work is skipped."""
    def random():
        return jax.vmap(jax.random.categorical)(token_keys(sampling.seed, index, purpose), logprobs).astype(jnp.int32)

    return jax.lax.cond(jnp.all(sampling.temperature <= 0), lambda: jnp.argmax(logprobs, axis=-1).astype(jnp.int32),
                        random)


def uniform(sampling: SlotSampling, index: jax.Array, purpose: int) -> jax.Array:
    """f32[slots] in [0, 1) with the key of (seed, index, purpose); 0 when every slot is greedy (whose
    decisions are certain)."""
    def random():
        return jax.vmap(jax.random.uniform)(token_keys(sampling.seed, index, purpose))

    return jax.lax.cond(jnp.all(sampling.temperature <= 0), lambda: jnp.zeros_like(index, jnp.float32), random)


def pick(logprobs: jax.Array, tokens: jax.Array) -> jax.Array:
    """f32[...]: logprobs[..., tokens] for logprobs f32[..., vocab] and tokens int[...]."""
    return jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]


class Sampled(NamedTuple):
    """A token per slot with its raw and behaviour log-probabilities (see the module docstring)."""

    token: jax.Array      # int32[slots]
    logprob: jax.Array    # f32[slots]
    behaviour: jax.Array  # f32[slots]


def sample(logits: jax.Array, sampling: SlotSampling, index: jax.Array) -> Sampled:
    """Draw the token at sequence index int32[slots] from logits f32[slots, vocab]."""
    processed = processed_logprobs(logits, sampling)
    token = draw(processed, sampling, index, SAMPLE)
    return Sampled(token, pick(jax.nn.log_softmax(logits, axis=-1), token), pick(processed, token))

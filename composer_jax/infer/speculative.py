"""The speculative-sampling acceptance rule (Leviathan et al. 2023; Chen et al. 2023).

A draft token d was drawn from the draft distribution q (the MTP depth's, processed with the request's
own temperature / top-k / top-p). The main model's distribution p at the same position (processed
the same way) accepts it with probability min(1, p(d) / q(d)); on rejection the token is drawn from the
normalised positive part of p - q. Whatever q is, the emitted token is distributed exactly as p:

    P(out = x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) (p(x) - q(x))+ / sum_y (p(y) - q(y))+
               = min(p(x), q(x)) + (p(x) - q(x))+ = p(x).

Greedy decoding (temperature 0) makes p and q point masses: the draft is accepted exactly when it is
the main model's argmax, and a rejection emits that argmax, so the output equals plain greedy decoding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from composer_jax.infer.sampling import ACCEPT, RESIDUAL, SlotSampling, draw, pick, uniform


class Verdict(NamedTuple):
    accepted: jax.Array     # bool[slots]: the draft is kept
    token: jax.Array        # int32[slots]: the draft if accepted, else the residual draw


def verify(target: jax.Array, draft_logprobs: jax.Array, draft: jax.Array, sampling: SlotSampling,
           index: jax.Array) -> Verdict:
    """target, draft_logprobs: f32[slots, vocab] processed log-probs of p and q at the draft's position;
    draft: int32[slots] drawn from q; index: int32[slots] the draft's sequence index (its random draws
    are keyed on it and the slot's seed)."""
    u = uniform(sampling, index, ACCEPT)
    accepted = u < jnp.exp(pick(target, draft) - pick(draft_logprobs, draft))     # P = min(1, p/q)
    residual = jnp.maximum(jnp.exp(target) - jnp.exp(draft_logprobs), 0.0)      # (p - q)+
    replacement = draw(jnp.log(residual), sampling, index, RESIDUAL)
    return Verdict(accepted, jnp.where(accepted, draft, replacement))

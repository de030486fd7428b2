"""The speculative-sampling acceptance rule (Leviathan et al. 2023; Chen et al. 2023).

A draft token d was drawn from the draft distribution q (the MTP depth's, processed with the request's
own temperature / top-k / top-p). The main model's distribution p at the same position (processed
the same way) accepts it with probability min(1, p(d) / q(d)); on rejection the token is drawn from the
normalised positive part of p - q. Whatever q is, the emitted token is distributed exactly as p:

    P(out = x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) (p(x) - q(x))+ / sum_y (p(y) - q(y))+
               = min(p(x), q(x)) + (p(x) - q(x))+ = p(x).

With several drafts d1..dK (each drawn from its own q given the ones before), the rule runs in order:
d1 is judged against p at its position, and only if it is kept is d2 judged against p given d1, and
so on; the first rejection is replaced by its residual draw and ends the step, and when all K are kept
a bonus token is drawn from p after dK. Each emitted token is thus distributed as p given the tokens
before it (the argument above, position by position).

Greedy decoding (temperature 0) makes p and q point masses: a draft is accepted exactly when it is
the main model's argmax, and a rejection emits that argmax, so the output equals plain greedy decoding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from composer_jax.infer.sampling import ACCEPT, RESIDUAL, SAMPLE, SlotSampling, draw, pick, uniform


class Verdict(NamedTuple):
    tokens: jax.Array       # int32[slots, drafts + 1]: the first `accepted + 1` are the step's tokens
    accepted: jax.Array     # int32[slots]: the drafts kept (the length of the verified prefix)


def verify(target: jax.Array, draft_logprobs: jax.Array, drafts: jax.Array, sampling: SlotSampling,
           index: jax.Array) -> Verdict:
    """target: f32[slots, drafts + 1, vocab] processed log-probs of p at each draft's position and after
    the last; draft_logprobs: f32[slots, drafts, vocab] those of q; drafts: int32[slots, drafts] drawn
    from q; index: int32[slots] the first draft's sequence index (draft j's random draws are keyed on
    index + j and the slot's seed). Column j of `tokens` holds draft j where it is kept, else its
    residual draw; the last column the bonus draw."""
    count = drafts.shape[1]
    kept, tokens = [], []
    for j in range(count):
        p, q, d = target[:, j], draft_logprobs[:, j], drafts[:, j]
        u = uniform(sampling, index + j, ACCEPT)
        kept.append(u < jnp.exp(pick(p, d) - pick(q, d)))                            # P = min(1, p/q)
        residual = jnp.maximum(jnp.exp(p) - jnp.exp(q), 0.0)                          # (p - q)+
        tokens.append(jnp.where(kept[-1], d, draw(jnp.log(residual), sampling, index + j, RESIDUAL)))
    tokens.append(draw(target[:, count], sampling, index + count, SAMPLE))
    accepted = jnp.cumprod(jnp.stack(kept, axis=1).astype(jnp.int32), axis=1).sum(axis=1)
    return Verdict(jnp.stack(tokens, axis=1), accepted)

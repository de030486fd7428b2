"""The engine's jitted programs over a fixed set of slots: a prefill chunk, and a run of decode steps
(plain, or MTP-speculative).

Both take the model's parameters as an argument next to its static graphdef, so weights of the same
shapes, dtypes and placement (a new policy version) never retrace, and both donate the cache, which
they update in place. Shapes depend only on (slots, cache length, chunk width, decode steps, attended
cache length), so a stream of requests of any lengths runs on a few decode programs and one prefill
program per chunk width. The MoE layers dispatch with the backend fastest for each program's token
count on the platform (`dispatch.inference_backend`), whatever the model trains with.

The cache holds, per layer, slot and position, the MLA latent (normalised c_kv and the rotated shared
rope key); a slot's first `lengths[slot]` positions are valid. Rolling back is lowering a length:
positions past it are masked out and overwritten later. Prefill chunks attend with the training form
of attention (keys and values decompressed from the cache), decode steps with the absorbed form.
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from composer_jax.infer.cache import Cache, Latents
from composer_jax.infer.sampling import DRAFT, SAMPLE, Sampled, SlotSampling, draw, pick, processed_logprobs, sample
from composer_jax.infer.speculative import verify
from composer_jax.model.attention import LatentCache
from composer_jax.model.dispatch import inference_backend
from composer_jax.model.moe import MoE

TRACES: collections.Counter = collections.Counter()  # traces (= compilations) per program name


class Slots(NamedTuple):
    """Per-slot decode state [slots]; the host owns it and passes it to every decode call."""

    lengths: jax.Array     # int32: positions in the cache (all tokens but the pending one)
    pending: jax.Array     # int32: the last token, not yet run through the model
    active: jax.Array      # bool: still decoding
    budget: jax.Array      # int32: tokens the slot may still emit
    stop_ids: jax.Array    # int32[slots, stops]: tokens that end the request (-1: unused)
    sampling: SlotSampling


class Emitted(NamedTuple):
    """A decode call's output: per step and slot up to `per_step` tokens (1 plain, 2 speculative)."""

    tokens: jax.Array      # int32[steps, slots, per_step]
    logprob: jax.Array     # f32[steps, slots, per_step]: raw (model) log-probs
    behaviour: jax.Array   # f32[steps, slots, per_step]: under the distribution drawn from
    count: jax.Array       # int32[steps, slots]: how many of the per_step entries are real
    drafted: jax.Array     # int32[slots]: drafts verified (speculative)
    accepted: jax.Array    # int32[slots]: drafts accepted


def _placed_like(x: jax.Array, batch_dim: int, like: jax.Array) -> jax.Array:
    """x with its `batch_dim` placed as `like`'s first dim (split over the batch axes, or replicated)."""
    sharding = jax.typeof(like).sharding
    if sharding.mesh.empty:
        return x
    spec = [None] * x.ndim
    spec[batch_dim] = sharding.spec[0] if len(sharding.spec) else None
    return jax.sharding.reshard(x, P(*spec))


def _visible(lengths: jax.Array, max_len: int) -> jax.Array:
    return jnp.arange(max_len)[None] < lengths[:, None]


def _write(latents: Latents, c_kv: jax.Array, k_rope: jax.Array, lengths: jax.Array, n_valid: jax.Array) -> Latents:
    """Store new latents [layers, slots, width, ...] at positions lengths[s] + i for i < n_valid[s]."""
    width, max_len = c_kv.shape[2], latents.c_kv.shape[2]
    offsets = jnp.arange(width)[None]
    cols = jnp.where(offsets < n_valid[:, None], lengths[:, None] + offsets, max_len)  # max_len: dropped
    rows = _placed_like(jnp.broadcast_to(jnp.arange(lengths.shape[0])[:, None], cols.shape), 0, cols)
    def put(old, new):
        sharding = jax.typeof(old).sharding
        out = {} if sharding.mesh.empty else {"out_sharding": sharding.spec}  # stays where it is
        return old.at[:, rows, cols].set(new.astype(old.dtype), mode="drop", **out)

    return Latents(put(latents.c_kv, c_kv), put(latents.k_rope, k_rope))


def _prefix(latents: Latents, lengths: jax.Array, attend: int | None) -> LatentCache:
    """The cache as attention's prefix: its first `attend` positions (None: all), those < lengths visible."""
    attend = latents.c_kv.shape[2] if attend is None else attend
    return LatentCache(latents.c_kv[:, :, :attend], latents.k_rope[:, :, :attend], _visible(lengths, attend))


def _positions(lengths: jax.Array, width: int) -> jax.Array:
    return lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None]


def _main(model, latents: Latents, lengths, tokens, n_valid, absorbed: bool, attend: int | None = None):
    """The main model over tokens int32[slots, width] at positions lengths + i, attending to the cache's
    first `attend` positions (None: all). Returns (hidden [slots, width, embed], latents with the first
    n_valid[s] new positions stored)."""
    out = model.forward(tokens, positions=_positions(lengths, tokens.shape[1]),
                        prefix=_prefix(latents, lengths, attend),
                        with_mtp=False, return_latents=True, absorbed=absorbed)
    return out.hidden, _write(latents, out.latents.c_kv, out.latents.k_rope, lengths, n_valid)


def _mtp(model, latents: Latents, lengths, hidden, following, n_valid, absorbed: bool, attend: int | None = None):
    """MTP depth 1 at the same positions: main hidden [slots, width, embed] and the tokens that follow
    them int32[slots, width]. Returns (head-normed hidden, latents with n_valid[s] positions stored)."""
    normed, (c_kv, k_rope) = model.mtp_step(hidden, following, _positions(lengths, hidden.shape[1]),
                                            _prefix(latents, lengths, attend), absorbed=absorbed)
    return normed, _write(latents, c_kv[None], k_rope[None], lengths, n_valid)


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[s, index[s]] for x [slots, width, ...] (index clipped at 0)."""
    index = jnp.maximum(index, 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, index, axis=1)[:, 0]


def _draft(model, normed: jax.Array, sampling: SlotSampling, index: jax.Array):
    """A draft for sequence index int32[slots] from MTP hidden [slots, embed]: (token, its distribution)."""
    q = processed_logprobs(model.logits(normed), sampling)
    return draw(q, sampling, index, DRAFT), q


def _use_inference_dispatch(model, tokens: int) -> None:
    """Switch the (merged, traced) model's MoE layers to the dispatch backend fastest for a forward of
    `tokens` tokens (dispatch.inference_backend). Layers placed on a mesh keep theirs: their experts
    are laid out for it."""
    k = model.cfg.moe.num_experts_per_tok
    for _, module in nnx.iter_modules(model):
        if isinstance(module, MoE) and module.mesh is None:
            module.dispatch = inference_backend(jax.default_backend(), tokens, k, module.num_experts, module.dispatch)


def _prefill(graphdef, state, cache: Cache, lengths, tokens, n_valid, lookahead, finishing, sampling, attend: int):
    """One chunk of prompt per slot: tokens int32[slots, chunk], of which the first n_valid[s] are real
    (0: the slot sits this chunk out), attending to the cache's first `attend` positions (the host's
    bound on the reading slots' lengths; 0 when they all start). Where `finishing[s]` the chunk ends
    the slot's prompt and its first new token is drawn (sequence index lengths + n_valid); in
    speculative mode MTP depth 1 also runs over the chunk (`lookahead[s]`: the prompt token after an
    unfinished chunk) and drafts the token after.
    Returns (cache, Sampled per slot: meaningful where finishing)."""
    TRACES["prefill"] += 1
    model = nnx.merge(graphdef, state)
    _use_inference_dispatch(model, tokens.size)
    hidden, main = _main(model, cache.main, lengths, tokens, n_valid, absorbed=False, attend=attend)
    last, index = n_valid - 1, lengths + n_valid
    first = sample(model.logits(_at(hidden, last)), sampling, index)
    cache = cache._replace(main=main)
    if cache.mtp is not None:
        width = tokens.shape[1]
        following = jnp.concatenate([tokens[:, 1:], lookahead[:, None]], axis=1)
        ends = (jnp.arange(width)[None] == last[:, None]) & finishing[:, None]
        following = jnp.where(ends, first.token[:, None], following)
        normed, mtp = _mtp(model, cache.mtp, lengths, hidden, following, n_valid, absorbed=False, attend=attend)
        draft, q = _draft(model, _at(normed, last), sampling, index + 1)
        cache = Cache(main, mtp, jnp.where(finishing, draft, cache.draft),
                      jnp.where(finishing[:, None], q, cache.draft_logprobs))
    return cache, first


def _advance(slots: Slots, last: jax.Array, count: jax.Array) -> Slots:
    """The slot state after emitting `count` int32[slots] tokens ending with `last`."""
    budget = slots.budget - count
    stopped = (last[:, None] == slots.stop_ids).any(axis=-1)
    return slots._replace(lengths=slots.lengths + count, pending=jnp.where(count > 0, last, slots.pending),
                          budget=budget, active=slots.active & ~stopped & (budget > 0))


def _plain_step(model, cache: Cache, slots: Slots, attend: int):
    hidden, main = _main(model, cache.main, slots.lengths, slots.pending[:, None], slots.active.astype(jnp.int32),
                         absorbed=True, attend=attend)
    out = sample(model.logits(hidden[:, 0]), slots.sampling, slots.lengths + 1)
    count = slots.active.astype(jnp.int32)
    none = jnp.zeros_like(count)
    return cache._replace(main=main), _advance(slots, out.token, count), \
        Sampled(*(x[:, None] for x in out)), count, none, none


def _speculative_step(model, cache: Cache, slots: Slots, attend: int):
    """Verify each slot's draft with one main-model pass over [pending, draft], emit 1 or 2 tokens,
    extend MTP depth 1's cache over the emitted positions and draft the next token."""
    lengths, active, sampling = slots.lengths, slots.active, slots.sampling
    tokens = jnp.stack([slots.pending, cache.draft], axis=1)
    hidden, main = _main(model, cache.main, lengths, tokens, 2 * active.astype(jnp.int32), absorbed=True,
                         attend=attend)
    logits = model.logits(hidden)                                                   # [slots, 2, vocab]
    raw = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.stack([processed_logprobs(logits[:, j], sampling) for j in range(2)], axis=1)
    verdict = verify(target[:, 0], cache.draft_logprobs, cache.draft, sampling, lengths + 1)
    bonus = draw(target[:, 1], sampling, lengths + 2, SAMPLE)
    first_stops = (verdict.token[:, None] == slots.stop_ids).any(axis=-1)
    two = verdict.accepted & ~first_stops & (slots.budget > 1)
    count = jnp.where(two, 2, 1) * active.astype(jnp.int32)
    emitted = jnp.stack([verdict.token, bonus], axis=1)
    new = _advance(slots, jnp.where(two, bonus, verdict.token), count)
    normed, mtp = _mtp(model, cache.mtp, lengths, hidden, emitted, count, absorbed=True, attend=attend)
    draft, q = _draft(model, _at(normed, count - 1), sampling, new.lengths + 1)
    cache = Cache(main, mtp, jnp.where(active, draft, cache.draft), jnp.where(active[:, None], q, cache.draft_logprobs))
    out = Sampled(emitted, pick(raw, emitted), pick(target, emitted))
    return cache, new, out, count, active.astype(jnp.int32), (verdict.accepted & active).astype(jnp.int32)


def _decode(graphdef, state, cache: Cache, slots: Slots, steps: int, attend: int):
    """Up to `steps` decode steps for every active slot (stops early once none is active), attending to
    the cache's first `attend` positions (the host's bound on every slot's length during the call).
    Returns (cache, slots, Emitted)."""
    TRACES["decode"] += 1
    model = nnx.merge(graphdef, state)
    per_step = 1 if cache.mtp is None else 2
    n = slots.lengths.shape[0]
    _use_inference_dispatch(model, n * per_step)
    step = functools.partial(_plain_step if cache.mtp is None else _speculative_step, attend=attend)
    zeros = lambda dtype, *shape: jnp.zeros(shape, dtype)  # noqa: E731
    emitted = Emitted(zeros(jnp.int32, steps, n, per_step), zeros(jnp.float32, steps, n, per_step),
                      zeros(jnp.float32, steps, n, per_step), zeros(jnp.int32, steps, n),
                      zeros(jnp.int32, n), zeros(jnp.int32, n))
    emitted = Emitted(*(_placed_like(x, 1 if x.ndim > 1 else 0, slots.lengths) for x in emitted))

    def cond(carry):
        i, _, slots, _ = carry
        return (i < steps) & slots.active.any()

    def body(carry):
        i, cache, slots, out = carry
        cache, slots, sampled, count, drafted, accepted = step(model, cache, slots)
        out = Emitted(out.tokens.at[i].set(sampled.token), out.logprob.at[i].set(sampled.logprob),
                      out.behaviour.at[i].set(sampled.behaviour), out.count.at[i].set(count),
                      out.drafted + drafted, out.accepted + accepted)
        return i + 1, cache, slots, out

    _, cache, slots, emitted = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), cache, slots, emitted))
    return cache, slots, emitted


prefill = jax.jit(_prefill, static_argnums=(0, 9), donate_argnums=2)
decode = jax.jit(_decode, static_argnums=(0, 4, 5), donate_argnums=2)

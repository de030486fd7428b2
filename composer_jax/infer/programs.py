"""The engine's jitted programs over a fixed set of slots: a prefill chunk, and a run of decode steps
(plain, or MTP-speculative: draft, verify, accept and the caches' update in one program, with no host
round-trip between steps).

Both take the model's parameters as an argument next to its static graphdef, so weights of the same
shapes, dtypes and placement (a new policy version) never retrace, and both donate the cache, which
they update in place. Shapes depend only on (slots, cache length, chunk width, decode steps, attended
cache length), so a stream of requests of any lengths runs on a few decode programs and one prefill
program per chunk width. The MoE layers dispatch with the backend fastest for each program's token
count on the platform (`dispatch.inference_backend`, chosen per forward pass), whatever the model
trains with.

The cache holds, per layer, slot and position, the MLA latent (normalised c_kv and the rotated shared
rope key); a slot's first `lengths[slot]` positions are valid. Rolling back is lowering a length:
positions past it are masked out and overwritten later. Prefill chunks attend with the training form
of attention (keys and values decompressed from the cache), decode steps with the absorbed form.

Speculative drafts chain the MTP depths as they were trained: depth k at the pending token's position
sees depth k-1's hidden state there and the token k ahead (the pending one for depth 1, then the
drafts), and drafts the token k+1 ahead. Drafts beyond the model's depths run its last depth again one
position on, its own hidden state standing in for the main model's there. After each verification
every drafting depth runs over the emitted positions, storing its latents: where a depth's input token
lies past the emitted ones it is the draft (depth k >= 2's latents at the k-1 positions before the
pending token keep their drafted input, which only the drafts' quality depends on).

Traces are counted per engine: each `Engine` counts the traces its own calls run (`counting_traces`).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from composer_jax.infer.cache import Cache, Latents
from composer_jax.infer.sampling import DRAFT, Sampled, SlotSampling, draw, pick, processed_logprobs, sample
from composer_jax.infer.speculative import verify
from composer_jax.model.attention import LatentCache
from composer_jax.model.dispatch import inference_backend
from composer_jax.model.moe import MoE

_TRACES: contextvars.ContextVar[collections.Counter | None] = contextvars.ContextVar("traces", default=None)


@contextlib.contextmanager
def counting_traces(counter: collections.Counter):
    """Count the programs traced (= compiled) inside the block into `counter`, per program name. Tracing
    runs in the calling thread, so engines in other threads count theirs apart."""
    token = _TRACES.set(counter)
    try:
        yield counter
    finally:
        _TRACES.reset(token)


def _traced(name: str) -> None:
    counter = _TRACES.get()
    if counter is not None:
        counter[name] += 1


class Slots(NamedTuple):
    """Per-slot decode state [slots]; the host owns it and passes it to every decode call."""

    lengths: jax.Array     # int32: positions in the cache (all tokens but the pending one)
    pending: jax.Array     # int32: the last token, not yet run through the model
    active: jax.Array      # bool: still decoding
    budget: jax.Array      # int32: tokens the slot may still emit
    stop_ids: jax.Array    # int32[slots, stops]: tokens that end the request (-1: unused)
    sampling: SlotSampling


class Emitted(NamedTuple):
    """A decode call's output: per step and slot up to `per_step` tokens (1 plain, drafts + 1 speculative)."""

    tokens: jax.Array      # int32[steps, slots, per_step]
    logprob: jax.Array     # f32[steps, slots, per_step]: raw (model) log-probs
    behaviour: jax.Array   # f32[steps, slots, per_step]: under the distribution drawn from
    count: jax.Array       # int32[steps, slots]: how many of the per_step entries are real
    drafted: jax.Array     # int32[slots]: drafts verified (speculative)
    accepted: jax.Array    # int32[slots]: drafts accepted (the verified prefixes' lengths)


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


def _write(latents: Latents, c_kv: jax.Array, k_rope: jax.Array, lengths: jax.Array, n_valid: jax.Array,
           depth: int | None = None) -> Latents:
    """Store new latents [layers, slots, width, ...] (with `depth`: [slots, width, ...] into that layer
    alone) at positions lengths[s] + i for i < n_valid[s]."""
    width, max_len = c_kv.shape[-2], latents.c_kv.shape[2]
    offsets = jnp.arange(width)[None]
    cols = jnp.where(offsets < n_valid[:, None], lengths[:, None] + offsets, max_len)  # max_len: dropped
    rows = _placed_like(jnp.broadcast_to(jnp.arange(lengths.shape[0])[:, None], cols.shape), 0, cols)
    layers = slice(None) if depth is None else depth

    def put(old, new):
        sharding = jax.typeof(old).sharding
        out = {} if sharding.mesh.empty else {"out_sharding": sharding.spec}  # stays where it is
        return old.at[layers, rows, cols].set(new.astype(old.dtype), mode="drop", **out)

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
    out = _dispatching(model, tokens.size).forward(tokens, positions=_positions(lengths, tokens.shape[1]),
                                                   prefix=_prefix(latents, lengths, attend),
                                                   with_mtp=False, return_latents=True, absorbed=absorbed)
    return out.hidden, _write(latents, out.latents.c_kv, out.latents.k_rope, lengths, n_valid)


def _mtp(model, latents: Latents, depth: int, lengths, hidden, following, n_valid, absorbed: bool,
         attend: int | None = None):
    """MTP depth `depth` (0-based) at positions lengths + i: the previous depth's hidden [slots, width,
    embed] there and the tokens that depth sees int32[slots, width]. Returns (hidden, head-normed hidden,
    latents with n_valid[s] positions stored in that depth's layer)."""
    out, normed, (c_kv, k_rope) = _dispatching(model, following.size).mtp_step(
        hidden, following, _positions(lengths, hidden.shape[1]), _prefix(latents, lengths, attend), depth=depth,
        absorbed=absorbed)
    return out, normed, _write(latents, c_kv, k_rope, lengths, n_valid, depth)


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[s, index[s]] for x [slots, width, ...] (index clipped at 0)."""
    index = jnp.maximum(index, 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, index, axis=1)[:, 0]


def _draft(model, normed: jax.Array, sampling: SlotSampling, index: jax.Array):
    """A draft for sequence index int32[slots] from MTP hidden [slots, embed]: (token, its distribution)."""
    q = processed_logprobs(model.logits(normed), sampling)
    return draw(q, sampling, index, DRAFT), q


def _chain(model, mtp: Latents, lengths, hidden, stream, n_valid, drafting, sampling, drafts: int, absorbed: bool,
           attend: int | None):
    """The drafting MTP depths over a window of positions lengths + i (i < width), storing the first
    n_valid[s] positions' latents, then `drafts` drafts of the tokens after the window's last valid
    position (the slot's pending token's position - 1).

    hidden: [slots, width, embed] the main model's hidden state at the window's positions; stream:
    int32[slots, width + depths - 1], stream[s, i] = the token at sequence index lengths + i + 1 (depth
    k at position i sees stream[s, i + k - 1]), known up to i = n_valid - 1 (the pending token) and,
    where not `drafting[s]`, beyond (a prompt's next tokens); where drafting, the drafts fill it on.
    Returns (mtp latents, drafts int32[slots, drafts], their distributions f32[slots, drafts, vocab])."""
    depths, width = mtp.c_kv.shape[0], hidden.shape[1]
    last, pending = n_valid - 1, lengths + n_valid      # pending: the sequence index of the slot's last token
    columns = jnp.arange(stream.shape[1])[None]
    tokens, dists = [], []
    for k in range(depths):
        hidden, normed, mtp = _mtp(model, mtp, k, lengths, hidden, stream[:, k:k + width], n_valid, absorbed, attend)
        token, q = _draft(model, _at(normed, last), sampling, pending + k + 1)
        tokens.append(token)
        dists.append(q)
        stream = jnp.where(drafting[:, None] & (columns == (last + k + 1)[:, None]), token[:, None], stream)
    hidden = _at(hidden, last)[:, None]
    for j in range(depths, drafts):     # the last depth again, one position on
        hidden, normed, mtp = _mtp(model, mtp, depths - 1, pending + j - depths, hidden, tokens[-1][:, None],
                                   drafting.astype(jnp.int32), absorbed, attend)
        token, q = _draft(model, normed[:, 0], sampling, pending + j + 1)
        tokens.append(token)
        dists.append(q)
    return mtp, jnp.stack(tokens, axis=1), jnp.stack(dists, axis=1)


def _dispatching(model, tokens: int):
    """The (traced) model with its MoE layers switched to the dispatch backend fastest for a forward of
    `tokens` tokens (dispatch.inference_backend): a view merged anew, so that each forward a program
    traces (a speculative step's passes differ in width) gets its own, also inside a loop. Layers
    placed on a mesh keep theirs: their experts are laid out for it."""
    model = nnx.merge(*nnx.split(model))
    k = model.cfg.moe.num_experts_per_tok
    for _, module in nnx.iter_modules(model):
        if isinstance(module, MoE) and module.mesh is None:
            module.dispatch = inference_backend(jax.default_backend(), tokens, k, module.num_experts, module.dispatch,
                                                module.expert_bytes)
    return model


def _prefill(graphdef, state, cache: Cache, lengths, tokens, n_valid, lookahead, finishing, sampling, attend: int):
    """One chunk of prompt per slot: tokens int32[slots, chunk], of which the first n_valid[s] are real
    (0: the slot sits this chunk out), attending to the cache's first `attend` positions (the host's
    bound on the reading slots' lengths; 0 when they all start). Where `finishing[s]` the chunk ends
    the slot's prompt and its first new token is drawn (sequence index lengths + n_valid); in
    speculative mode the drafting MTP depths also run over the chunk (`lookahead[s]` int32[depths]:
    the prompt tokens after an unfinished chunk) and draft the tokens after the first new one.
    Returns (cache, Sampled per slot: meaningful where finishing)."""
    _traced("prefill")
    model = nnx.merge(graphdef, state)
    hidden, main = _main(model, cache.main, lengths, tokens, n_valid, absorbed=False, attend=attend)
    last, index = n_valid - 1, lengths + n_valid
    first = sample(model.logits(_at(hidden, last)), sampling, index)
    cache = cache._replace(main=main)
    if cache.mtp is not None:
        stream = jnp.concatenate([tokens[:, 1:], lookahead], axis=1)
        ends = (jnp.arange(stream.shape[1])[None] == last[:, None]) & finishing[:, None]
        stream = jnp.where(ends, first.token[:, None], stream)
        mtp, drafts, q = _chain(model, cache.mtp, lengths, hidden, stream, n_valid, finishing, sampling,
                                cache.draft.shape[1], absorbed=False, attend=attend)
        cache = Cache(main, mtp, jnp.where(finishing[:, None], drafts, cache.draft),
                      jnp.where(finishing[:, None, None], q, cache.draft_logprobs))
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
    """Verify each slot's drafts with one main-model pass over [pending, drafts], emit the verified prefix
    and one more token (a residual or bonus draw), run the drafting MTP depths over the emitted positions
    and draft the next ones."""
    lengths, active, sampling = slots.lengths, slots.active, slots.sampling
    width = cache.draft.shape[1] + 1
    tokens = jnp.concatenate([slots.pending[:, None], cache.draft], axis=1)
    hidden, main = _main(model, cache.main, lengths, tokens, width * active.astype(jnp.int32), absorbed=True,
                         attend=attend)
    logits = model.logits(hidden)                                                   # [slots, width, vocab]
    raw = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.stack([processed_logprobs(logits[:, j], sampling) for j in range(width)], axis=1)
    verdict = verify(target, cache.draft_logprobs, cache.draft, sampling, lengths + 1)
    emitted = verdict.tokens
    # The step's tokens: the verified prefix and the draw after it, cut after a stop token and at the budget.
    stops = (emitted[:, :, None] == slots.stop_ids[:, None]).any(axis=-1)
    first_stop = jnp.argmax(stops, axis=1) + jnp.where(stops.any(axis=1), 1, width)
    count = jnp.minimum(jnp.minimum(verdict.accepted + 1, first_stop), slots.budget) * active.astype(jnp.int32)
    new = _advance(slots, _at(emitted, count - 1), count)
    stream = jnp.concatenate([emitted, jnp.zeros_like(emitted[:, :cache.mtp.c_kv.shape[0] - 1])], axis=1)
    mtp, drafts, q = _chain(model, cache.mtp, lengths, hidden, stream, count, active, sampling, width - 1,
                            absorbed=True, attend=attend)
    cache = Cache(main, mtp, jnp.where(active[:, None], drafts, cache.draft),
                  jnp.where(active[:, None, None], q, cache.draft_logprobs))
    out = Sampled(emitted, pick(raw, emitted), pick(target, emitted))
    return cache, new, out, count, (width - 1) * active.astype(jnp.int32), verdict.accepted * active.astype(jnp.int32)


def _decode(graphdef, state, cache: Cache, slots: Slots, steps: int, attend: int):
    """Up to `steps` decode steps for every active slot (stops early once none is active), attending to
    the cache's first `attend` positions (the host's bound on every slot's length during the call).
    Returns (cache, slots, Emitted)."""
    _traced("decode")
    model = nnx.merge(graphdef, state)
    per_step = 1 if cache.mtp is None else cache.draft.shape[1] + 1
    n = slots.lengths.shape[0]
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


# XLA:CPU's YNNPACK library fusions (matmuls fused with their neighbours) ran decode's matmuls of a
# few rows about 2x slower than XLA's own dot emitter (weight_bound at batch 8: 52 -> 115 decode
# tokens/s, at 32: 120 -> 210; docs/inference.md): the programs compile without them on CPU.
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.cache
def compiler_options(platform: str) -> dict | None:
    """The compile options of the programs on `platform`: CPU_COMPILER_OPTIONS on CPU where this XLA
    knows them (an experimental option may go), else XLA's defaults."""
    if platform != "cpu":
        return None
    try:
        jax.jit(lambda x: x + 1, compiler_options=CPU_COMPILER_OPTIONS).lower(0).compile()
    except jax.errors.JaxRuntimeError:
        return None
    return CPU_COMPILER_OPTIONS


class Programs(NamedTuple):
    prefill: Callable
    decode: Callable


@functools.cache
def for_platform(platform: str) -> Programs:
    """The jitted prefill and decode programs, compiled with `compiler_options(platform)`."""
    options = compiler_options(platform)
    return Programs(jax.jit(_prefill, static_argnums=(0, 9), donate_argnums=2, compiler_options=options),
                    jax.jit(_decode, static_argnums=(0, 4, 5), donate_argnums=2, compiler_options=options))

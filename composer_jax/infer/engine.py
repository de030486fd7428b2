"""The inference engine: continuous batching over fixed slots, chunked prefill, weight versions.

A cache of `max_slots x max_len` latent positions lives on the device. Requests queue up and take free
slots as they open; each `step()` runs one prefill chunk for the slots still reading their prompts
(while the others wait with their state intact) and then up to `steps_per_call` decode steps for every
slot that is generating, so new requests join while others keep decoding. A finished slot is freed,
or kept (`keep=True`) so that a follow-up request (`continue_from`) prefills only its new tokens after
the kept history: an agent's next turn after a tool's output.

Shapes are fixed by (max_slots, max_len, chunk width, steps_per_call) and the cache positions a call
attends to (`attend_length`: the filled part rounded up to 64 x 2^i, never all of a long cache): any
stream of requests compiles at most one decode program per attended length and one prefill program
per chunk width and attended length; each compilation is logged and listed in `compiled`.
`update_weights(weights, version)` swaps parameters of the same shapes in place, without retracing;
every token records the version that produced it. An engine over an abstract model (`nnx.eval_shape`)
holds no weights until the first version arrives (an engine process: the learner sends them), and
`release_weights` drops them so that the next version lands without the current one beside it. An INT4
policy's engine (`model.moe.expert_quant=int4`) holds its routed experts as INT4 (`model.quant`).

Under a DualMesh (`model.mesh`), the engine places the model with the inference layout
(`DualMesh.for_inference()`: replicated dense weights, experts on ep) and splits the slots over the
data axes where they divide, so any number of slots runs on any grid.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax.infer import programs, speculation
from composer_jax.infer.cache import cache_shapes, drafting_depths
from composer_jax.infer.programs import Slots
from composer_jax.infer.sampling import SamplingParams, SlotSampling
from composer_jax.model.decoder import unstack_layers
from composer_jax.model.moe import routed_expert_paths
from composer_jax.model.quant import quantize_experts
from composer_jax.parallel import record_layout, shard_model
from composer_jax.parallel.partitioning import inference_batch_sharding, param_shardings
from composer_jax.tree_paths import path_str

log = logging.getLogger(__name__)

DEFAULT_CHUNKS = (16, 64, 256)
ATTEND_ROUNDING = 64  # programs attend to a power-of-two multiple of this many cache positions


def attend_length(longest: int, max_len: int) -> int:
    """Cache positions a program attends to when no slot it serves grows past `longest`: the smallest
    ATTEND_ROUNDING x 2^i that holds it, at most max_len (few programs, never all of a long cache);
    0 for 0 (prompts that start)."""
    if longest == 0:
        return 0
    bucket = ATTEND_ROUNDING
    while bucket < longest:
        bucket *= 2
    return min(bucket, max_len)


@functools.partial(jax.jit, static_argnums=0)
def _zeros(shapes):
    """Zero arrays of `shapes` (ShapeDtypeStructs): one program per cache shape, shared by every engine
    of it (a fresh `generate` call compiles nothing here)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


class GenerationError(ValueError):
    """A request or engine setting cannot be served; the message names the culprit."""


@dataclasses.dataclass
class Completion:
    """One request's output. `tokens` are the new ids (up to and including a stop token)."""

    request_id: int
    prompt: list[int]                     # the ids this request added (after the kept history, if continuing)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)            # raw model log-probs
    behaviour_logprobs: list[float] = dataclasses.field(default_factory=list)  # under the sampling distribution
    versions: list[int] = dataclasses.field(default_factory=list)              # weights version per token
    finish_reason: str | None = None      # "stop", "stop_string" or "length" (max_new_tokens or the cache)


@dataclasses.dataclass
class Update:
    """What one `step()` produced for a request: its new tokens, and the completion once it finished."""

    request_id: int
    new_tokens: list[int]
    finished: Completion | None = None


@dataclasses.dataclass
class _Slot:
    completion: Completion
    history: list[int]          # every token of the slot's sequence, across continued turns
    cached: int                 # history tokens whose latents are in the cache
    todo: list[int]             # tokens still to prefill
    budget: int                 # tokens the current request may still emit
    sampling: SamplingParams
    stop_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    keep: bool
    phase: str = "prefill"      # prefill -> decode -> kept (or freed)


def _is_abstract(tree) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def _abstract(tree):
    """ShapeDtypeStructs of `tree`'s arrays, with their placements."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def _check_like(state, like) -> None:
    """GenerationError unless `state` has the structure, shapes and dtypes of `like`."""
    have = jax.tree_util.tree_flatten_with_path(like)[0]
    got, treedef = jax.tree_util.tree_flatten_with_path(state)
    name = lambda path: path_str([k for k in path if getattr(k, "name", None) != "value"])  # noqa: E731 (no Variable field)
    if treedef != jax.tree.structure(like):
        missing = {name(p) for p, _ in have} - {name(p) for p, _ in got}
        raise GenerationError("update_weights: the weights' structure differs from the engine's model"
                              + (f" (no '{sorted(missing)[0]}')" if missing else ""))
    for (path, old), (_, new) in zip(have, got):
        if (tuple(new.shape), np.dtype(new.dtype)) != (tuple(old.shape), np.dtype(old.dtype)):
            raise GenerationError(f"update_weights: '{name(path)}' is {np.dtype(new.dtype)}{list(new.shape)}, "
                                  f"the engine's is {np.dtype(old.dtype)}{list(old.shape)}")


class Engine:
    """See the module docstring. `model`: a CausalLM (its `mesh` decides the layout); `eos_ids`: the
    default stop tokens; `detokenize`: ids -> text, needed for stop strings."""

    def __init__(self, model, *, max_slots: int = 8, max_len: int | None = None,
                 chunk_sizes: Sequence[int] = DEFAULT_CHUNKS, steps_per_call: int = 8, speculative: bool | str = False,
                 draft_tokens: int = 0, eos_ids: Sequence[int] = (),
                 detokenize: Callable[[list[int]], str] | None = None, max_stop_ids: int = 8):
        cfg = model.cfg
        limit = cfg.rope.max_position_embeddings
        max_len = limit if max_len is None else max_len
        if max_slots <= 0 or steps_per_call <= 0 or max_stop_ids <= 0:
            raise GenerationError("max_slots, steps_per_call and max_stop_ids must be > 0")
        if not 1 < max_len <= limit:
            raise GenerationError(f"max_len={max_len} must be in [2, rope.max_position_embeddings={limit}]")
        try:   # drafts per decode step (0: plain decoding)
            self.draft_tokens = speculation.draft_tokens(speculative, cfg.mtp.num_layers, jax.default_backend(),
                                                         draft_tokens)
        except ValueError as e:
            raise GenerationError(str(e)) from None
        if not chunk_sizes or min(chunk_sizes) <= 0:
            raise GenerationError(f"chunk_sizes must be positive, got {tuple(chunk_sizes)}")
        self.cfg, self.max_slots, self.max_len, self.steps = cfg, max_slots, max_len, steps_per_call
        self.chunks = sorted({min(c, max_len) for c in chunk_sizes})
        self.speculative, self.detokenize, self.max_stop_ids = self.draft_tokens > 0, detokenize, max_stop_ids
        self.eos_ids = self._check_ids(tuple(eos_ids), "eos_ids")
        self.dual = None if model.mesh is None else model.mesh if model.mesh.inference else model.mesh.for_inference()
        self.programs = programs.for_platform(jax.default_backend())
        self.graphdef, state = self._place(model)
        # The layout weight versions arrive in (the model's, float experts), placed as this engine keeps it.
        self._model_like = _abstract(state)
        self.state = self._stored(nnx.to_flat_state(state))       # abstract over an abstract model
        self._shardings = jax.tree.map(lambda x: x.sharding, self.state)
        self._program_state = self._for_programs(self.state) if self.holds_weights else None
        shapes = cache_shapes(cfg, max_slots, max_len, self.draft_tokens)
        out = None if self.dual is None else jax.tree.map(lambda s: self._batch_sharding(s.shape, s.ndim == 4), shapes)
        with self._traced_on():
            self.cache = _zeros(shapes) if out is None else jax.jit(lambda: _zeros.__wrapped__(shapes),
                                                                     out_shardings=out)()
        self.slots: list[_Slot | None] = [None] * max_slots
        self.queue: collections.deque = collections.deque()
        self.kept: dict[int, int] = {}          # request id -> its kept slot
        self.version = 0
        self.compiled: list[str] = []
        self.traces: collections.Counter = collections.Counter()   # this engine's traces (compiles) per program
        self.stats = collections.Counter()
        self._next_id = 0

    # ------------------------------------------------------------------------------------------
    # placement

    def _place(self, model):
        if self.dual is not None:   # a placed twin: the caller's model is untouched
            graphdef, state = nnx.split(model)
            if _is_abstract(state):     # ShapeDtypeStructs (e.g. nnx.eval_shape): the placement's, no arrays
                state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                                     param_shardings(state, self.dual))
                model = record_layout(nnx.merge(graphdef, state), self.dual)
            else:
                model = shard_model(nnx.merge(graphdef, state, copy=True), self.dual)
        self._int4 = routed_expert_paths(model) if model.cfg.moe.expert_quant == "int4" else frozenset()
        return nnx.split(model)

    def _stored(self, flat) -> nnx.State:
        """Parameters in the model's layout, on the engine's devices (flat: (path, Variable) pairs) -> the
        state the engine holds: for an INT4 policy (`model.moe.expert_quant=int4`) the routed expert
        stacks as INT4 (`quant.Int4Matrix`, K2.5's quantizer), each float stack dropped once quantized."""
        return quantize_experts(flat, self._int4)

    def _for_programs(self, state):
        """The parameters the programs take: on one CPU device the layer stacks split into per-layer
        arrays (`unstack_layers`; a copy next to `state`, which keeps the model's layout for
        `place_weights` and weight exchange), else `state` itself."""
        return unstack_layers(state) if self.dual is None and jax.default_backend() == "cpu" else state

    def _traced_on(self):
        """The context the programs trace in: the dense mesh as JAX's context mesh (Explicit axes)."""
        return contextlib.nullcontext() if self.dual is None else self.dual

    def _batch_sharding(self, shape, slots_second: bool = False):
        """Placement of an inference array whose slot dim is the first (or, for latents, the second)."""
        return None if self.dual is None else inference_batch_sharding(self.dual, tuple(shape), int(slots_second))

    def _put(self, tree):
        """Host arrays with a leading slot dim -> device (split like the slots)."""
        if self.dual is None:
            return tree
        return jax.tree.map(lambda x: jax.device_put(x, self._batch_sharding(np.shape(x))), tree)

    # ------------------------------------------------------------------------------------------
    # requests

    def _check_ids(self, ids: Sequence[int], what: str) -> tuple[int, ...]:
        ids = tuple(int(i) for i in ids)
        bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
        if bad:
            raise GenerationError(f"{what}: token id {bad[0]} is out of the vocabulary [0, {self.cfg.vocab_size})")
        return ids

    def submit(self, prompt: Sequence[int], *, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
               stop_tokens: Sequence[int] | None = None, stop_strings: Sequence[str] = (), keep: bool = False,
               continue_from: int | None = None) -> int:
        """Queue a request; returns its id. `stop_tokens` None: the engine's `eos_ids`. `keep`: hold the
        slot after it finishes for a `continue_from` request, which appends `prompt` (e.g. a tool's
        output, may be empty) to the kept history and generates after it."""
        prompt = list(self._check_ids(np.asarray(prompt, np.int64).reshape(-1).tolist(), "prompt"))
        if max_new_tokens <= 0:
            raise GenerationError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        stops = self.eos_ids if stop_tokens is None else self._check_ids(stop_tokens, "stop_tokens")
        if len(stops) > self.max_stop_ids:
            raise GenerationError(f"{len(stops)} stop tokens, more than max_stop_ids={self.max_stop_ids}")
        if stop_strings and self.detokenize is None:
            raise GenerationError("stop_strings need the engine's `detokenize` (a tokenizer)")
        history: list[int] = []
        if continue_from is not None:
            if continue_from not in self.kept:
                raise GenerationError(f"request {continue_from} is not a finished request kept with keep=True")
            history = list(self.slots[self.kept[continue_from]].history)
        elif not prompt:
            raise GenerationError("prompt is empty")
        total = len(history) + len(prompt)
        room = self.max_len - total
        if room <= 0:
            raise GenerationError(f"prompt of {total} tokens{' (with the kept history)' * bool(history)} does not "
                                  f"fit the cache: max_len={self.max_len} leaves no room for a new token")
        request_id = self._next_id
        self._next_id += 1
        slot = _Slot(Completion(request_id, prompt), history + prompt, 0, [], min(max_new_tokens, room), sampling,
                     stops, tuple(stop_strings), keep)
        if continue_from is not None:
            index = self.kept.pop(continue_from)
            previous = self.slots[index]
            slot.cached, slot.todo = previous.cached, slot.history[previous.cached:]
            self.slots[index] = slot
        else:
            slot.todo = list(prompt)
            self.queue.append(slot)
        return request_id

    def release(self, request_id: int) -> None:
        """Free the slot a finished `keep=True` request holds."""
        if request_id in self.kept:
            self.slots[self.kept.pop(request_id)] = None

    @property
    def idle(self) -> bool:
        """No queued request and no slot prefilling or decoding."""
        return not self.queue and all(s is None or s.phase == "kept" for s in self.slots)

    @property
    def busy(self) -> bool:
        """A `step()` would do work: a slot prefilling or decoding, or a queued request and a free slot
        for it (queued requests wait while every slot is kept)."""
        return (any(s is not None and s.phase != "kept" for s in self.slots)
                or (bool(self.queue) and any(s is None for s in self.slots)))

    # ------------------------------------------------------------------------------------------
    # weights

    @property
    def holds_weights(self) -> bool:
        """False over an abstract model until `update_weights`, and after `release_weights`."""
        return not _is_abstract(self.state)

    @property
    def held_like(self) -> nnx.State:
        """ShapeDtypeStructs of the parameters the engine holds, placed as it holds them (INT4 experts as
        Int4Matrix): what a weight version is read into."""
        return _abstract(self.state)

    def release_weights(self) -> None:
        """Drop the parameters (the next version then lands without the current one beside it); the
        engine decodes again after `update_weights`."""
        self.state, self._program_state = self.held_like, None

    def update_weights(self, weights, version: int) -> None:
        """Swap in new parameters (a CausalLM or its nnx.State: in the model's layout, any placement, or in
        the engine's own, `held_like`); the compiled programs are reused. Arrays already placed as the
        engine holds them are kept, not copied: pass a snapshot (`place_weights`) of arrays that will be
        donated. Tokens produced from now on record `version`."""
        state = nnx.state(weights) if isinstance(weights, nnx.Module) else weights
        if jax.tree.structure(state) == jax.tree.structure(self.state):
            _check_like(state, self.state)
            self.state = jax.device_put(state, self._shardings)
        else:
            self.state = self.place_weights(state)
        self._program_state = self._for_programs(self.state)
        self.version = version

    def place_weights(self, weights) -> nnx.State:
        """`weights` (a CausalLM or its nnx.State, same structure, shapes and dtypes as the model's, or a
        state this method returned) copied device to device into the engine's layout, without installing
        them: a learner takes this snapshot before its next step donates the arrays. An INT4 policy's
        experts are quantized on the way, one stack at a time. Thread-safe (it touches no engine state)."""
        state = nnx.state(weights) if isinstance(weights, nnx.Module) else weights
        if self._int4 and jax.tree.structure(state) != jax.tree.structure(self.state):   # the model's layout
            _check_like(state, self._model_like)
            return self._stored((path, var.replace(jax.device_put(var.get_value(), like.get_value().sharding,
                                                                  may_alias=False)))
                                for (path, var), (_, like) in zip(nnx.to_flat_state(state),
                                                                  nnx.to_flat_state(self._model_like)))
        _check_like(state, self.state)
        return jax.device_put(state, self._shardings, may_alias=False)   # a copy even where the layouts agree

    # ------------------------------------------------------------------------------------------
    # running

    def _call(self, name: str, program, *args):
        before, start = sum(self.traces.values()), time.perf_counter()
        with self._traced_on(), programs.counting_traces(self.traces):
            out = program(*args)
        if sum(self.traces.values()) > before:
            self.stats["compile_s"] += time.perf_counter() - start  # tracing and compiling run in the call
            shape = f"chunk={args[4].shape[1]} attend={args[9]}" if name == "prefill" else \
                f"steps={self.steps} attend={args[5]}"
            what = (f"{name} {shape} slots={self.max_slots} max_len={self.max_len}"
                    + f" speculative drafts={self.draft_tokens}" * self.speculative)
            self.compiled.append(what)
            log.info("compiled %s in %.1f s (%d programs)", what, time.perf_counter() - start, len(self.compiled))
        return out

    def _sampling(self) -> SlotSampling:
        return SlotSampling.of([s.sampling if s is not None else SamplingParams() for s in self.slots])

    def _admit(self) -> None:
        for i, slot in enumerate(self.slots):
            if slot is None and self.queue:
                self.slots[i] = self.queue.popleft()

    def _emit(self, slot: _Slot, tokens, logprobs, behaviour) -> list[int]:
        """Append tokens (host ints/floats) to the slot's request."""
        c = slot.completion
        c.tokens += tokens
        c.logprobs += logprobs
        c.behaviour_logprobs += behaviour
        c.versions += [self.version] * len(tokens)
        slot.history += tokens
        slot.budget -= len(tokens)
        return tokens

    def _finish(self, index: int, reason: str) -> Completion:
        slot = self.slots[index]
        slot.completion.finish_reason = reason
        if slot.keep:
            slot.phase = "kept"
            self.kept[slot.completion.request_id] = index
        else:
            self.slots[index] = None
        return slot.completion

    def _stop_string_cut(self, slot: _Slot, first_new: int) -> int | None:
        """The number of generated tokens up to the one that completes a stop string (None: no stop)."""
        tokens = slot.completion.tokens
        if not slot.stop_strings or not any(s in self.detokenize(tokens) for s in slot.stop_strings):
            return None
        for k in range(first_new + 1, len(tokens) + 1):
            if any(s in self.detokenize(tokens[:k]) for s in slot.stop_strings):
                return k
        return None

    def _settle(self, index: int, first_new: int, device_done: bool) -> Completion | None:
        """Finish the slot if its new tokens (from `first_new` on) end it."""
        slot = self.slots[index]
        cut = self._stop_string_cut(slot, first_new)
        if cut is not None:
            c, extra = slot.completion, len(slot.completion.tokens) - cut
            if extra:
                del c.tokens[cut:], c.logprobs[cut:], c.behaviour_logprobs[cut:], c.versions[cut:]
                del slot.history[-extra:]
            slot.cached = min(slot.cached, len(slot.history) - 1)  # rolled back: later positions are invalid
            return self._finish(index, "stop_string")
        if device_done or slot.budget <= 0 or slot.history[-1] in slot.stop_ids:
            return self._finish(index, "stop" if slot.history[-1] in slot.stop_ids else "length")
        return None

    def _prefill_step(self, updates: list[Update]) -> None:
        reading = [i for i, s in enumerate(self.slots) if s is not None and s.phase == "prefill"]
        if not reading:
            return
        need = max(len(self.slots[i].todo) for i in reading)
        # The widest chunk the longest prompt fills (rest in narrower chunks), not a wider one it pads.
        width = max((c for c in self.chunks if c <= need), default=self.chunks[0])
        n = self.max_slots
        tokens, n_valid = np.zeros((n, width), np.int32), np.zeros(n, np.int32)
        depths = drafting_depths(self.cfg, self.draft_tokens) or 1
        lookahead, finishing = np.zeros((n, depths), np.int32), np.zeros(n, bool)
        lengths = np.array([s.cached if s is not None else 0 for s in self.slots], np.int32)
        for i in reading:
            todo = self.slots[i].todo
            take = todo[:width]
            tokens[i, :len(take)], n_valid[i] = take, len(take)
            finishing[i] = len(todo) <= width
            following = todo[width:width + depths] if not finishing[i] else []
            lookahead[i, :len(following)] = following
        start, compiling = time.perf_counter(), self.stats["compile_s"]
        args = self._put((lengths, tokens, n_valid, lookahead, finishing, self._sampling()))
        attend = attend_length(max(self.slots[i].cached for i in reading), self.max_len)
        self.cache, first = self._call("prefill", self.programs.prefill, self.graphdef, self._program_state,
                                       self.cache, *args, attend)
        first = jax.device_get(first)
        self.stats["prefill_s"] += time.perf_counter() - start - (self.stats["compile_s"] - compiling)
        self.stats["prefill_tokens"] += int(n_valid.sum())
        for i in reading:
            slot = self.slots[i]
            slot.cached += int(n_valid[i])
            slot.todo = slot.todo[int(n_valid[i]):]
            if finishing[i]:
                slot.phase = "decode"
                new = self._emit(slot, [int(first.token[i])], [float(first.logprob[i])], [float(first.behaviour[i])])
                done = self._settle(i, len(slot.completion.tokens) - 1, False)
                updates.append(Update(slot.completion.request_id, new, done))

    def _decode_step(self, updates: list[Update]) -> None:
        decoding = [i for i, s in enumerate(self.slots) if s is not None and s.phase == "decode"]
        if not decoding:
            return
        n = self.max_slots
        live = lambda f, default: [f(s) if i in decoding else default for i, s in enumerate(self.slots)]  # noqa: E731
        stop_ids = np.full((n, self.max_stop_ids), -1, np.int32)
        for i in decoding:
            stop_ids[i, :len(self.slots[i].stop_ids)] = self.slots[i].stop_ids
        slots = Slots(np.array(live(lambda s: s.cached, 0), np.int32), np.array(live(lambda s: s.history[-1], 0), np.int32),
                      np.array(live(lambda s: True, False)), np.array(live(lambda s: s.budget, 0), np.int32),
                      stop_ids, self._sampling())
        # A call's slots grow by up to drafts + 1 positions per step; the last drafts reach drafts further.
        per_step = self.draft_tokens + 1
        attend = attend_length(max(self.slots[i].cached for i in decoding) + per_step * self.steps + self.draft_tokens,
                               self.max_len)
        start, compiling = time.perf_counter(), self.stats["compile_s"]
        self.cache, out_slots, emitted = self._call("decode", self.programs.decode, self.graphdef,
                                                    self._program_state, self.cache, self._put(slots), self.steps,
                                                    attend)
        emitted, active = jax.device_get((emitted, out_slots.active))
        self.stats["decode_s"] += time.perf_counter() - start - (self.stats["compile_s"] - compiling)
        self.stats["drafted"] += int(emitted.drafted.sum())
        self.stats["accepted"] += int(emitted.accepted.sum())
        self.stats["decode_steps"] += int((emitted.count.sum(axis=1) > 0).sum())
        self.stats["decode_busy_slot_steps"] += int((emitted.count > 0).sum())   # occupancy: / (decode_steps x max_slots)
        for i in decoding:
            slot = self.slots[i]
            counts = emitted.count[:, i]
            picks = [(k, j) for k in range(counts.size) for j in range(counts[k])]
            first_new = len(slot.completion.tokens)
            new = self._emit(slot, [int(emitted.tokens[k, i, j]) for k, j in picks],
                             [float(emitted.logprob[k, i, j]) for k, j in picks],
                             [float(emitted.behaviour[k, i, j]) for k, j in picks])
            slot.cached += len(new)
            self.stats["decode_tokens"] += len(new)
            done = self._settle(i, first_new, not active[i])
            updates.append(Update(slot.completion.request_id, slot.completion.tokens[first_new:] if done else new, done))

    def step(self) -> list[Update]:
        """Admit queued requests, run one prefill chunk and one decode call; returns what they produced."""
        if self._program_state is None and self.busy:
            raise GenerationError("the engine holds no weights (built over an abstract model, or released): "
                                  "update_weights first")
        self._admit()
        updates: list[Update] = []
        self._prefill_step(updates)
        self._decode_step(updates)
        return updates

    def run(self) -> dict[int, Completion]:
        """Step until every queued and running request has finished; returns the completions by id."""
        done = {}
        while not self.idle:
            for update in self.step():
                if update.finished is not None:
                    done[update.request_id] = update.finished
        return done

    @property
    def acceptance(self) -> dict[str, float]:
        """Speculative statistics so far (what an RL step's metrics record): acceptance rate (drafts
        accepted / drafted), mean accepted length (tokens per verification pass and slot: 1 + the
        accepted drafts; the speed-up in decode steps over plain decoding, before a step's extra cost)
        and the drafts per step."""
        s = self.stats
        steps = s["drafted"] / max(self.draft_tokens, 1)
        return {"acceptance_rate": s["accepted"] / max(s["drafted"], 1),
                "mean_accepted_length": 1 + s["accepted"] / max(steps, 1), "draft_tokens": self.draft_tokens}

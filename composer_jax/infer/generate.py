"""`generate(model, prompts, ...)`: a batch of prompts through a fresh engine, in prompt order."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence

import jax

from composer_jax.config import MeshConfig, ModelConfig
from composer_jax.infer import speculation
from composer_jax.infer.cache import cache_shapes
from composer_jax.infer.engine import DEFAULT_CHUNKS, Engine, GenerationError
from composer_jax.infer.sampling import SamplingParams
from composer_jax.parallel import DualMesh

CACHE_ROUNDING = 64  # cache lengths are rounded up to a multiple of this, so calls share compiled programs
SLOT_ROUNDING = 16   # slot counts: powers of two up to this, then multiples of it (calls share programs)
CACHE_MEMORY_SHARE = 0.5  # of the free memory the default engine's cache may take


@dataclasses.dataclass
class GenerateResult:
    """Per prompt (in order): the new ids up to and including a stop token, their raw log-probs, their
    log-probs under the sampling distribution and why each stopped; plus the run's statistics: new
    tokens per second of wall time (compilation excluded), tokens of decode calls per second of their
    time (the first token of each prompt comes from its prefill), the programs compiled, and the speculative
    acceptance rate and mean accepted length (None without speculative decoding)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    behaviour_logprobs: list[list[float]]
    finish_reasons: list[str]
    tokens_per_second: float
    decode_tokens_per_second: float
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    compiled: list[str] = dataclasses.field(default_factory=list)


def engine_grids(model: ModelConfig, devices: Sequence) -> DualMesh:
    """The dual grid an engine on devices of its own decodes on: the default MeshConfig (fsdp and ep fill
    `devices`), checked against `model`; the engine takes it with the inference placement
    (`DualMesh.for_inference`)."""
    return DualMesh(MeshConfig(), devices, model=model)


def default_max_len(cfg, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """Cache positions per slot for these prompts: the longest plus max_new_tokens, rounded up to a
    multiple of CACHE_ROUNDING, at most the model's positions (rope.max_position_embeddings)."""
    limit = cfg.rope.max_position_embeddings
    longest = max(len(p) for p in prompts)
    if longest >= limit:
        raise GenerationError(f"a prompt of {longest} tokens does not fit the model's {limit} positions "
                              "(rope.max_position_embeddings)")
    return min(limit, -(-(longest + max_new_tokens) // CACHE_ROUNDING) * CACHE_ROUNDING)


def free_memory_bytes() -> int:
    """Memory the default device may still allocate: XLA's limit less its use, or on CPU the host's
    available memory."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_slots(cfg, prompts: int, max_len: int, draft_tokens: int, free_bytes: int) -> int:
    """Slots for `prompts` requests: the count rounded up to a power of two up to SLOT_ROUNDING and to a
    multiple of it beyond, at most what CACHE_MEMORY_SHARE of `free_bytes` holds with `draft_tokens`
    drafts per step (0: plain decoding; extra requests queue for a free slot)."""
    if prompts <= SLOT_ROUNDING:
        bucket = 1 << (prompts - 1).bit_length()
    else:
        bucket = -(-prompts // SLOT_ROUNDING) * SLOT_ROUNDING
    shapes = jax.tree.leaves(cache_shapes(cfg, 1, max_len, draft_tokens))
    per_slot = sum(math.prod(s.shape) * s.dtype.itemsize for s in shapes)
    return max(1, min(bucket, int(CACHE_MEMORY_SHARE * free_bytes) // per_slot))


def draft_count(model, speculative: bool | str, draft_tokens: int = 0) -> int:
    """Drafts per decode step for `model` under the `speculative` setting (0: plain decoding;
    `infer.speculation.draft_tokens`); a GenerationError naming the setting at fault."""
    try:
        return speculation.draft_tokens(speculative, model.cfg.mtp.num_layers, jax.default_backend(), draft_tokens)
    except ValueError as e:
        raise GenerationError(str(e)) from None


def request_seeds(seed: int | Sequence[int], count: int) -> list[int]:
    """Per-request seeds: `seed + i` for request i, or the given list (one per request)."""
    seeds = [(seed + i) % 2**32 for i in range(count)] if isinstance(seed, int) else [int(s) for s in seed]
    if len(seeds) != count:
        raise GenerationError(f"{len(seeds)} seeds for {count} prompts")
    return seeds


def sized_engine(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, speculative: bool | str,
                 draft_tokens: int = 0, max_slots: int | None = None, max_len: int | None = None,
                 **engine_args) -> Engine:
    """An engine for `prompts`: max_len (default: `default_max_len`) cache positions per slot, max_slots
    (default: `default_slots`, as memory allows) slots, `draft_count` drafts per step under the
    `speculative` setting; `engine_args` go to `Engine`."""
    max_len = max_len or default_max_len(model.cfg, prompts, max_new_tokens)
    drafts = draft_count(model, speculative, draft_tokens)
    slots = max_slots or default_slots(model.cfg, len(prompts), max_len, drafts, free_memory_bytes())
    return Engine(model, max_slots=slots, max_len=max_len, speculative=drafts > 0, draft_tokens=drafts,
                  **engine_args)


def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, seed: int | Sequence[int] = 0,
             stop_tokens: Sequence[int] | None = None, speculative: bool | str = False, draft_tokens: int = 0,
             stop_strings: Sequence[str] = (), detokenize: Callable[[list[int]], str] | None = None,
             max_slots: int | None = None, max_len: int | None = None, steps_per_call: int = 16,
             chunk_sizes: Sequence[int] = DEFAULT_CHUNKS) -> GenerateResult:
    """Generate for token-id prompts of any lengths.

    temperature 0 is greedy. seed: one int (request i uses seed + i) or one per prompt; a request's
    tokens depend only on its own seed, prompt and settings. stop_tokens None: the model's EOS ids
    (`model.eos_token_ids`, read from the checkpoint), if any. speculative: MTP speculative decoding
    (off / on / auto or a bool, `infer.speculation`; the same greedy output, the same sampling
    distribution) with `draft_tokens` drafts per step (0: the default). max_slots (default: every prompt
    at once, rounded up to share programs, as far as memory allows: `default_slots`), max_len (default:
    the longest prompt plus max_new_tokens, rounded up) size the engine.
    """
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise GenerationError("no prompts given")
    for i, p in enumerate(prompts):
        if not p:
            raise GenerationError(f"prompt {i} is empty")
    seeds = request_seeds(seed, len(prompts))
    engine = sized_engine(model, prompts, max_new_tokens=max_new_tokens, speculative=speculative,
                          draft_tokens=draft_tokens, max_slots=max_slots, max_len=max_len,
                          chunk_sizes=chunk_sizes, steps_per_call=steps_per_call,
                          eos_ids=getattr(model, "eos_token_ids", ()), detokenize=detokenize)
    ids = [engine.submit(p, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens, stop_strings=stop_strings,
                         sampling=SamplingParams(temperature, top_p, top_k, s))
           for p, s in zip(prompts, seeds)]
    start = time.perf_counter()
    done = engine.run()
    wall = time.perf_counter() - start
    outs = [done[i] for i in ids]
    stats = engine.acceptance if engine.speculative else {}
    return GenerateResult([c.tokens for c in outs], [c.logprobs for c in outs], [c.behaviour_logprobs for c in outs],
                          [c.finish_reason for c in outs],
                          sum(len(c.tokens) for c in outs) / max(wall - engine.stats["compile_s"], 1e-9),
                          engine.stats["decode_tokens"] / max(engine.stats["decode_s"], 1e-9),
                          stats.get("acceptance_rate"), stats.get("mean_accepted_length"), list(engine.compiled))

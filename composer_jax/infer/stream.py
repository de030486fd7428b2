"""Generation driven step by step, as a command line shows it: a batch of prompts through one engine,
streamed as the text of one request while it grows (UTF-8 safe across token boundaries), or finished as
one record per prompt, with the run's throughput."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from composer_jax.infer.config import GenerateConfig
from composer_jax.infer.engine import GenerationError, Update
from composer_jax.infer.generate import engine_grids, request_seeds, sized_engine
from composer_jax.infer.sampling import SamplingParams
from composer_jax.parallel import record_layout


class TextPieces:
    """The text of a growing token sequence, piece by piece. `add(ids)` returns the text the new ids
    complete: a UTF-8 sequence split across tokens (decoded as U+FFFD while partial) is held back until
    its last byte arrives; `finish()` returns what is left (an incomplete sequence at the very end, as
    `decode` renders it). The pieces concatenate to decode(all ids) wherever decoding a longer sequence
    keeps the text of a shorter one (a byte-level tokenizer does)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.ids, self.text = decode, [], ""

    def add(self, ids: Sequence[int]) -> str:
        self.ids += ids
        return self._advance(self.decode(self.ids).rstrip("\ufffd"))

    def finish(self) -> str:
        return self._advance(self.decode(self.ids))

    def _advance(self, text: str) -> str:
        if not text.startswith(self.text):   # not yet a continuation of the text given out: hold it back
            return ""
        piece, self.text = text[len(self.text):], text
        return piece


class Generation:
    """`prompts` ((source, token ids) pairs, the source naming the prompt in errors and records) submitted to
    one engine sized for them (`sized_engine`), sampled as `gen` says (request i: seed + i). `tokenizer`
    (optional) decodes text and stop strings; `devices` (optional): decode on these, on the engine grids
    (`engine_grids`, the inference placement). Drive it once: `text_pieces()` (one prompt) or `records()`;
    `stats()` after."""

    def __init__(self, model, prompts: Sequence[tuple[str, Sequence[int]]], gen: GenerateConfig, *,
                 tokenizer=None, eos_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                 devices: Sequence | None = None):
        if stop_strings and tokenizer is None:
            raise GenerationError("stop strings need a tokenizer, and the model has none")
        if devices is not None:
            record_layout(model, engine_grids(model.cfg, devices))
        self.tokenizer = tokenizer
        self.engine = sized_engine(model, [list(p) for _, p in prompts], max_new_tokens=gen.max_new_tokens,
                                   speculative=gen.speculative, draft_tokens=gen.draft_tokens,
                                   max_slots=gen.max_slots, max_len=gen.max_len,
                                   steps_per_call=gen.steps_per_call, eos_ids=eos_ids,
                                   detokenize=None if tokenizer is None else tokenizer.decode)
        self.sources: dict[int, str] = {}       # request id -> its prompt's source, in prompt order
        for (source, tokens), seed in zip(prompts, request_seeds(gen.seed, len(prompts))):
            try:
                request = self.engine.submit(tokens, max_new_tokens=gen.max_new_tokens,
                                             stop_strings=tuple(stop_strings),
                                             sampling=SamplingParams(gen.temperature, gen.top_p, gen.top_k, seed))
            except GenerationError as e:
                raise GenerationError(f"{source}: {e}") from None
            self.sources[request] = source
        self.done: dict = {}                    # request id -> Completion
        self.wall_s = 0.0

    def _updates(self) -> Iterator[Update]:
        """The engine's updates until every request finished (the time it takes counts in wall_s)."""
        start = time.perf_counter()
        try:
            while not self.engine.idle:
                for update in self.engine.step():
                    if update.finished is not None:
                        self.done[update.request_id] = update.finished
                    yield update
        finally:
            self.wall_s += time.perf_counter() - start

    def text_pieces(self) -> Iterator[str]:
        """The one prompt's new text as it is generated; the pieces join to the decoded completion."""
        if self.tokenizer is None or len(self.sources) != 1:
            raise GenerationError(f"streaming needs one prompt and a tokenizer (got {len(self.sources)} prompts"
                                  f"{'' if self.tokenizer else ' and none'})")
        pieces = TextPieces(self.tokenizer.decode)
        for update in self._updates():
            if piece := pieces.add(update.new_tokens):
                yield piece
        if piece := pieces.finish():
            yield piece

    def records(self) -> list[dict]:
        """Per prompt, in order: its source, new tokens, their log-probs, why it stopped, and (with a
        tokenizer) its text."""
        for _ in self._updates():
            pass
        out = []
        for request, source in self.sources.items():
            c = self.done[request]
            record = {"source": source, "tokens": c.tokens, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
            if self.tokenizer is not None:
                record["text"] = self.tokenizer.decode(c.tokens)
            out.append(record)
        return out

    def stats(self) -> dict:
        """tokens (new, all prompts), wall_s, compile_s, tokens_per_s (compilation excluded), programs
        (compiled), and with speculative decoding acceptance_rate and mean_accepted_length."""
        tokens, compiling = sum(len(c.tokens) for c in self.done.values()), self.engine.stats["compile_s"]
        out = {"tokens": tokens, "wall_s": self.wall_s, "compile_s": compiling,
               "tokens_per_s": tokens / max(self.wall_s - compiling, 1e-9), "programs": len(self.engine.compiled)}
        return {**out, **self.engine.acceptance} if self.engine.speculative else out

"""Streamed generation (`infer.stream`): text pieces, UTF-8 safe across token boundaries, that join to the
decoded completion."""

import jax

from composer_jax.config import load_config
from composer_jax.data.tokenizer import ByteTokenizer
from composer_jax.infer.config import GenerateConfig
from composer_jax.infer.stream import Generation, TextPieces
from tests.random_models import random_model

TEXT = "a é € 😀 ok"     # characters of 1 to 4 UTF-8 bytes


def test_a_character_split_across_tokens_comes_out_whole():
    """Byte-level tokens, one byte per call: a multi-byte character is held back until its last byte, the
    pieces never show a replacement character, and they join to the text; an incomplete sequence at the
    very end comes out as decode renders it."""
    tokenizer = ByteTokenizer()
    ids = [int(i) for i in tokenizer.encode(TEXT)]
    pieces = TextPieces(tokenizer.decode)
    out = [pieces.add([i]) for i in ids]
    euro = TEXT.index("€")
    first_euro_byte = len(TEXT[:euro].encode())
    assert out[first_euro_byte:first_euro_byte + 3] == ["", "", "€"]
    assert "".join(out) == TEXT and "\ufffd" not in "".join(out) and pieces.finish() == ""

    pieces = TextPieces(tokenizer.decode)
    cut = [*ids, *"😀".encode()[:2]]               # ends inside a 4-byte character
    streamed = pieces.add(cut[:5]) + pieces.add(cut[5:]) + pieces.finish()
    assert streamed == tokenizer.decode(cut) == TEXT + "\ufffd"


def test_generation_streams_the_text_of_its_completion():
    """The tiny model with random weights (a byte-level vocabulary, so it samples bytes that split
    characters or are invalid) streamed one token per step: the pieces join to tokenizer.decode of the
    generated ids; a second run, its records on the engine grids of 2 devices, generates the same."""
    cfg = load_config("tiny")
    model, tokenizer = random_model(cfg, seed=1), ByteTokenizer()
    prompt = [("--prompt", [int(i) for i in tokenizer.encode(TEXT)])]
    gen = GenerateConfig(max_new_tokens=24, temperature=0.0, max_slots=1, steps_per_call=1)
    streaming = Generation(model, prompt, gen, tokenizer=tokenizer)
    pieces = list(streaming.text_pieces())
    (completion,) = streaming.done.values()
    assert len(completion.tokens) == 24 and "".join(pieces) == tokenizer.decode(completion.tokens)
    # One token per step, so a character of several bytes in the text was split across tokens (and steps).
    assert any(ord(c) >= 0x80 and c != "\ufffd" for c in "".join(pieces))
    on_grids = Generation(model, prompt, gen, tokenizer=tokenizer, devices=jax.devices()[:2])
    (record,) = on_grids.records()
    assert on_grids.engine.dual.dense.devices.size == 2 and on_grids.engine.dual.inference
    assert record["tokens"] == completion.tokens and record["text"] == "".join(pieces)
    assert record["source"] == "--prompt" and record["finish_reason"] == "length"
    stats = streaming.stats()
    assert stats["tokens"] == 24 and stats["programs"] >= 1 and "acceptance_rate" not in stats

"""The inference engine on one device: absorbed attention, sampling, continuous batching, continued
requests, stop conditions, weight swaps and request errors.

Engines of one shape share their compiled programs (module-level jits keyed on the model's graphdef
and the shapes), so the tests here compile a handful of programs in all."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.special import log_softmax

from composer_jax import config, load_config
from composer_jax.infer import Engine, GenerationError, SamplingParams
from composer_jax.infer.cache import latent_bytes_per_token, per_head_kv_bytes_per_token
from composer_jax.infer.engine import attend_length
from composer_jax.infer.generate import default_slots
from composer_jax.infer.sampling import SlotSampling, processed_logprobs
from composer_jax.model import rope
from composer_jax.model.attention import MLA
from composer_jax.model.attention_mask import causal_mask
from tests.random_models import random_model
from tests.sampling_reference import sampling_probs

SHAPES = dict(max_slots=4, max_len=64, chunk_sizes=(8, 32), steps_per_call=4)


@pytest.fixture(scope="module")
def cfg():
    return load_config("tiny")


@pytest.fixture(scope="module")
def model(cfg):
    return random_model(cfg, 3)


def _prompts(seed, lengths, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _run_alone(engine, prompt, **kwargs):
    rid = engine.submit(prompt, **kwargs)
    return engine.run()[rid]


def test_absorbed_attention_equals_training_attention(cfg, model):
    """MLA's absorbed form (kv_b_proj folded into query and output, keys = the latent) equals the
    decompressed training form, alone and over a cache of earlier tokens."""
    mla = MLA(cfg, rngs=nnx.Rngs(11))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 6, cfg.hidden_size)), jnp.float32)
    cos, sin = rope.rope_angles(cfg.rope, cfg.mla.qk_rope_head_dim, 9 + jnp.arange(6)[None].repeat(2, 0))
    prefix = (jnp.asarray(rng.normal(size=(2, 9, cfg.mla.kv_lora_rank)), jnp.float32),
              jnp.asarray(rng.normal(size=(2, 9, cfg.mla.qk_rope_head_dim)), jnp.float32))
    order, same = jnp.arange(6)[None].repeat(2, 0), jnp.zeros((2, 6), jnp.int32)
    valid = jnp.asarray(rng.random((2, 9)) < 0.7)               # some cache positions masked out
    mask = causal_mask(same, order, same, order).with_prefix(valid)
    both = nnx.jit(lambda mla, *args: (mla(*args), mla(*args, absorbed=True)))
    (out, max_logits, latent), (absorbed, absorbed_max, absorbed_latent) = both(mla, x, cos, sin, mask, prefix)
    assert np.abs(np.asarray(out)).max() > 1e-2
    np.testing.assert_allclose(np.asarray(absorbed), np.asarray(out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(absorbed_max), np.asarray(max_logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(absorbed_latent[0]), np.asarray(latent[0]))

    # The whole model: tokens decoded over a cache of latents equal one full forward.
    @nnx.jit
    def full_and_decoded(model, tokens):
        full = model.forward(tokens, with_mtp=False).hidden
        cache = model.forward(tokens[:, :16], with_mtp=False, return_latents=True).latents
        positions = jnp.broadcast_to(16 + jnp.arange(8), (2, 8))
        return full, model.forward(tokens[:, 16:], positions=positions, prefix=cache, with_mtp=False,
                                   absorbed=True).hidden

    full, decoded = full_and_decoded(model, jnp.asarray(_prompts(1, [24, 24]), jnp.int32))
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(full[:, 16:]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0),
                                                    (1.0, 0, 0.5), (0.8, 40, 0.9), (1.0, 1, 1.0)])
def test_sampling_distribution_matches_the_numpy_reference(temperature, top_k, top_p):
    logits = np.random.default_rng(7).normal(0, 2.0, (3, 256)).astype(np.float32)
    settings = [SamplingParams(temperature, top_p, top_k)] * 3
    probs = np.exp(np.asarray(processed_logprobs(jnp.asarray(logits), SlotSampling.of(settings)), np.float64))
    for row, want in zip(probs, (sampling_probs(x, temperature, top_k, top_p) for x in logits)):
        np.testing.assert_array_equal(row > 0, want > 0)
        np.testing.assert_allclose(row, want, atol=1e-6)


def test_staggered_arrivals_equal_one_at_a_time_with_bounded_compiles(model):
    """Requests arriving while others decode, queueing for slots and sharing batches get exactly the
    tokens they get alone; both streams together compile one decode program (the cache is one attended
    length) and at most two prefill programs per chunk width (chunks that start prompts attend to no
    cache)."""
    shapes = dict(SHAPES, max_len=48)  # unique to this test: the first engine compiles its programs
    lengths, new = [3, 9, 17, 30, 41, 12], [5, 9, 4, 7, 6, 6]
    settings = [SamplingParams(0.0), SamplingParams(0.9, 1.0, 40, seed=1), SamplingParams(1.0, 0.8, 0, seed=2),
                SamplingParams(0.0), SamplingParams(1.2, seed=4), SamplingParams(0.7, 0.95, 10, seed=5)]
    requests = [dict(prompt=p, max_new_tokens=n, sampling=s, stop_tokens=[])
                for p, n, s in zip(_prompts(2, lengths), new, settings)]
    alone = Engine(model, **shapes)
    expected = [_run_alone(alone, **r) for r in requests]
    assert 2 <= len(alone.compiled) <= 2 * len(shapes["chunk_sizes"]) + 1, alone.compiled
    assert sum(1 for c in alone.compiled if c.startswith("decode")) == 1

    engine = Engine(model, **shapes)
    ids = [engine.submit(**requests[0]), engine.submit(**requests[1])]
    done, seen = {}, []
    for arrivals in ([2], [], [3, 4, 5], []):
        for update in engine.step():
            seen.append(update.request_id)
            done.update({update.request_id: update.finished} if update.finished else {})
        ids += [engine.submit(**requests[i]) for i in arrivals]
    done.update(engine.run())
    assert len(alone.compiled) + len(engine.compiled) <= 2 * len(shapes["chunk_sizes"]) + 1, engine.compiled
    assert not any(c.startswith("decode") for c in engine.compiled)
    assert set(seen[:3]) == {ids[0], ids[1]} and len(engine.queue) == 0   # the first two share the first steps
    for rid, want in zip(ids, expected):
        assert done[rid].tokens == want.tokens
        # A prompt's chunks (and so its rounding) follow the longest prompt read with it.
        np.testing.assert_allclose(done[rid].logprobs, want.logprobs, atol=1e-5)
        np.testing.assert_allclose(done[rid].behaviour_logprobs, want.behaviour_logprobs, atol=1e-5)
        assert done[rid].finish_reason == "length" and len(want.tokens) == requests[ids.index(rid)]["max_new_tokens"]
    greedy = expected[0]
    assert greedy.behaviour_logprobs == [0.0] * len(greedy.tokens)  # a point mass
    unchanged = expected[4]  # temperature 1.2 only: behaviour differs from the raw log-probs
    assert not np.allclose(unchanged.behaviour_logprobs, unchanged.logprobs)


def test_continued_request_prefills_only_its_new_tokens(model):
    """An agent's next turn: the kept slot prefills the pending token and the new ones (not the
    history) and continues exactly as one request over the whole conversation would."""
    engine = Engine(model, **SHAPES)
    prompt, tool_output = _prompts(3, [10, 5])
    first = engine.submit(prompt, max_new_tokens=6, sampling=SamplingParams(0.0), stop_tokens=[], keep=True)
    turn1 = engine.run()[first]
    before = engine.stats["prefill_tokens"]
    second = engine.submit(tool_output, max_new_tokens=6, sampling=SamplingParams(0.0), stop_tokens=[],
                           continue_from=first)
    turn2 = engine.run()[second]
    assert engine.stats["prefill_tokens"] - before == len(tool_output) + 1
    assert first not in engine.kept and all(s is None for s in engine.slots)
    whole = _run_alone(engine, prompt + turn1.tokens + tool_output, max_new_tokens=6,
                       sampling=SamplingParams(0.0), stop_tokens=[])
    assert turn2.tokens == whole.tokens
    np.testing.assert_allclose(turn2.logprobs, whole.logprobs, atol=1e-5)
    with pytest.raises(GenerationError, match="not a finished request kept"):
        engine.submit([1], max_new_tokens=1, continue_from=first)


def test_stop_tokens_stop_strings_and_rollback(model):
    """Generation ends with (and includes) a stop token or the token completing a stop string; a stop
    string found mid-call rolls the slot back, so a continuation sees exactly the kept text."""
    detok = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731  unambiguous text for any ids
    engine = Engine(model, **SHAPES, detokenize=detok, eos_ids=[255])
    prompt = _prompts(4, [7])[0]
    greedy = SamplingParams(0.0)
    free = _run_alone(engine, prompt, max_new_tokens=12, sampling=greedy, stop_tokens=[])
    assert free.finish_reason == "length" and len(free.tokens) == 12
    stop = free.tokens[5]
    cut = free.tokens.index(stop) + 1
    by_token = _run_alone(engine, prompt, max_new_tokens=12, sampling=greedy, stop_tokens=[stop])
    assert by_token.tokens == free.tokens[:cut] and by_token.finish_reason == "stop"
    if 255 not in free.tokens:
        assert _run_alone(engine, prompt, max_new_tokens=12, sampling=greedy).finish_reason == "length"

    pair = detok(free.tokens[6:8])
    end = next(k for k in range(1, 13) if pair in detok(free.tokens[:k]))
    kept = engine.submit(prompt, max_new_tokens=12, sampling=greedy, stop_tokens=[], stop_strings=[pair], keep=True)
    by_string = engine.run()[kept]
    assert by_string.tokens == free.tokens[:end] and by_string.finish_reason == "stop_string"
    more = _prompts(5, [3])[0]
    follow = engine.submit(more, max_new_tokens=5, sampling=greedy, stop_tokens=[], continue_from=kept)
    whole = engine.submit(prompt + free.tokens[:end] + more, max_new_tokens=5, sampling=greedy, stop_tokens=[])
    done = engine.run()
    assert done[follow].tokens == done[whole].tokens


def test_weights_swap_in_place_without_recompiling(cfg, model):
    engine = Engine(model, **SHAPES)
    prompt = _prompts(6, [9])[0]
    before = _run_alone(engine, prompt, max_new_tokens=6, sampling=SamplingParams(0.0), stop_tokens=[])
    traces = sum(engine.traces.values())
    other = random_model(cfg, 99)
    engine.update_weights(nnx.state(other), version=7)
    after = _run_alone(engine, prompt, max_new_tokens=6, sampling=SamplingParams(0.0), stop_tokens=[])
    assert sum(engine.traces.values()) == traces and engine.compiled == []
    fresh = _run_alone(Engine(other, **SHAPES), prompt, max_new_tokens=6, sampling=SamplingParams(0.0), stop_tokens=[])
    assert after.tokens == fresh.tokens != before.tokens
    assert after.versions == [7] * 6 and before.versions == [0] * 6

    with pytest.raises(GenerationError, match="structure differs"):
        engine.update_weights(random_model(config.replace(cfg, **{"mtp.num_layers": 0})), 8)
    state = nnx.state(other)
    state["final_norm"]["scale"].set_value(jnp.ones(cfg.hidden_size + 1))
    with pytest.raises(GenerationError, match=r"'final_norm/scale.*float32\[65\].*float32\[64\]"):
        engine.update_weights(state, 8)


def test_request_errors_name_the_culprit(cfg, model):
    engine = Engine(model, **SHAPES)
    cases = [
        (dict(prompt=[]), "prompt is empty"),
        (dict(prompt=[1] * 64), "prompt of 64 tokens does not fit the cache: max_len=64"),
        (dict(prompt=[1, 300]), r"prompt: token id 300 is out of the vocabulary \[0, 256\)"),
        (dict(prompt=[1], max_new_tokens=0), "max_new_tokens must be > 0"),
        (dict(prompt=[1], stop_strings=["x"]), "stop_strings need the engine's `detokenize`"),
        (dict(prompt=[1], stop_tokens=[-1]), "stop_tokens: token id -1"),
    ]
    for request, message in cases:
        with pytest.raises(GenerationError, match=message):
            engine.submit(**{"max_new_tokens": 4, **request})
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(GenerationError, match="max_len=65 must be in"):
        Engine(model, max_len=65)
    with pytest.raises(GenerationError, match="mtp.num_layers=0"):
        Engine(random_model(config.replace(cfg, **{"mtp.num_layers": 0})), speculative=True)


def test_cache_holds_the_576_value_latent_per_layer_and_token(model):
    """The cache arrays hold kv_lora + rope values per layer, slot and position (no head axis); at
    Kimi K2.5 size that is 576 x 61 layers x 2 bytes = 70,272 B per token, 35.6x less than per-head K/V
    (64 heads x (192 + 128) values)."""
    engine = Engine(model, **SHAPES)
    c_kv, k_rope = engine.cache.main
    assert c_kv.shape == (4, 4, 64, 32) and k_rope.shape == (4, 4, 64, 8)
    k25 = load_config("kimi-k2.5")
    assert latent_bytes_per_token(k25) == 576 * 61 * 2 == 70_272
    assert per_head_kv_bytes_per_token(k25) == 64 * (192 + 128) * 61 * 2
    assert per_head_kv_bytes_per_token(k25) / latent_bytes_per_token(k25) == pytest.approx(35.56, abs=0.01)
    assert jax.tree.leaves(engine.cache.main)[0].dtype == jnp.float32


def test_decode_attends_to_a_bucket_of_the_cache_and_keeps_the_full_forward_tokens(cfg):
    """With a cache longer than the slots have filled, decode programs attend to the bucket holding the
    filled part (64, then 128 of 192 positions) and give the greedy tokens and log-probs of the full
    forward over the prompt and the tokens generated so far."""
    model = random_model(config.replace(cfg, **{"rope.max_position_embeddings": 192}), 5)
    engine = Engine(model, max_slots=1, max_len=192, chunk_sizes=(32,), steps_per_call=32)
    prompt = _prompts(8, [20])[0]
    out = _run_alone(engine, prompt, max_new_tokens=50, sampling=SamplingParams(0.0), stop_tokens=[])
    assert [c for c in engine.compiled if c.startswith("decode")] == [
        "decode steps=32 attend=64 slots=1 max_len=192", "decode steps=32 attend=128 slots=1 max_len=192"]
    logits = np.asarray(model(np.asarray([prompt + out.tokens[:-1]], np.int32)), np.float64)[0, len(prompt) - 1:]
    assert out.tokens == logits.argmax(-1).tolist()
    np.testing.assert_allclose(out.logprobs, log_softmax(logits, axis=-1)[np.arange(50), out.tokens], atol=1e-4)


def test_attend_lengths_and_default_slots():
    assert [attend_length(n, 192) for n in (1, 64, 65, 128, 129, 500)] == [64, 64, 128, 128, 192, 192]
    tiny, free = load_config("tiny"), 1 << 40
    assert [default_slots(tiny, n, 64, 0, free) for n in (1, 3, 8, 16, 17, 33, 128)] == [1, 4, 8, 16, 32, 48, 128]
    # The bound: half the free memory over one slot's cache (main latents, plus MTP's when speculative).
    per_slot = latent_bytes_per_token(tiny) * 64
    assert default_slots(tiny, 128, 64, 0, 2 * 10 * per_slot) == 10
    assert default_slots(tiny, 128, 64, 2, 2 * 10 * per_slot) < 10
    assert default_slots(tiny, 128, 64, 0, 0) == 1

"""MTP speculative decoding: greedy output equals plain greedy decoding (at several draft counts, with
chained and repeated MTP depths), sampled output follows the exact sampling distribution of the main
model (a chi-square test against the distribution computed from the model's own forward, on a 16-token
vocabulary, with fixed seeds), the acceptance counts match models whose drafts are known to be right
or wrong, a decode call is one program with no host transfer, and the `speculative` setting resolves
and fails as documented.

The chi-square engines have one shape (one plain and one speculative compile); the draft-count engines
are small."""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from composer_jax import config, load_config
from composer_jax.bench.decode import self_drafting
from composer_jax.config import ConfigError, apply_overrides, from_dict
from composer_jax.infer import Engine, GenerationError, SamplingParams, generate, speculation
from composer_jax.infer.config import GenerateConfig
from composer_jax.infer.sampling import SlotSampling
from composer_jax.infer.speculative import verify
from composer_jax.rl.run_config import load_rl_config
from tests.random_models import random_model
from tests.sampling_reference import sampling_probs

VOCAB = 16
SHAPES = dict(max_slots=64, max_len=32, chunk_sizes=(16,), steps_per_call=4)
SMALL = dict(max_slots=8, max_len=32, chunk_sizes=(16,), steps_per_call=4)
PROMPT_LENGTHS = (3, 6, 9, 12, 15)
SAMPLES = 4096
SETTINGS = dict(temperature=1.0, top_p=0.9)   # truncation on, so p and q are both processed
ALPHA = 1e-3


@pytest.fixture(scope="module")
def model():
    return random_model(load_config("tiny", [f"vocab_size={VOCAB}"]), 2)


@pytest.fixture(scope="module")
def engines(model):
    return {mode: Engine(model, speculative=mode == "speculative", **SHAPES) for mode in ("plain", "speculative")}


def _greedy(engine, prompts, new=14):
    ids = [engine.submit(p, max_new_tokens=new, sampling=SamplingParams(0.0), stop_tokens=[]) for p in prompts]
    done = engine.run()
    return [done[i] for i in ids]


def _guarded(engine, prompts):
    with jax.transfer_guard_device_to_host("disallow"):
        return _greedy(engine, prompts)


@pytest.fixture(scope="module")
def greedy_plain(engines):
    """Prompts of several lengths (a batch whose slots decode at different lengths) and their plain
    greedy completions."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    return prompts, _greedy(engines["plain"], prompts)


def test_speculative_greedy_equals_plain_greedy(model, engines, greedy_plain):
    prompts, plain = greedy_plain
    spec = _greedy(engines["speculative"], prompts)
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    for s, p in zip(spec, plain):
        np.testing.assert_allclose(s.logprobs, p.logprobs, atol=1e-5)
    rate = engines["speculative"].acceptance["acceptance_rate"]
    assert 0 < rate < 1, f"both the accept and the reject path must run (acceptance {rate})"
    # generate() reports the statistics.
    result = generate(model, prompts[:2], max_new_tokens=6, temperature=0.0, speculative=True, stop_tokens=[],
                      max_slots=64, max_len=32, chunk_sizes=(16,), steps_per_call=4)
    assert result.tokens == [c.tokens[:6] for c in plain[:2]] and 0 <= result.acceptance_rate <= 1
    drafts = speculation.DEFAULT_DRAFT_TOKENS
    assert result.mean_accepted_length == pytest.approx(1 + drafts * result.acceptance_rate)


@pytest.mark.slow
def test_chained_depths_keep_greedy_and_count_acceptance(model, engines, greedy_plain):
    """2 drafts by two chained MTP depths (2 by one depth run twice, one position on: the test above; 1
    draft: tests/test_infer_sharded.py) give the plain greedy tokens on a batch of prompts of 5 lengths. The
    engine compiles one decode program for all its calls and makes no implicit device-to-host transfer
    while decoding; another engine decoding meanwhile in another thread counts none of its traces. With
    self-drafting weights (swapped in, nothing recompiles) every draft is accepted; with drafts that are
    always the least likely token, none is."""
    prompts, plain = greedy_plain
    depths, drafts = 2, 2
    chained = random_model(config.replace(model.cfg, **{"mtp.num_layers": depths}), 2)  # main weights: `model`'s
    engine = Engine(chained, speculative="on", draft_tokens=drafts, **SMALL)
    assert engine.cache.mtp.c_kv.shape[0] == depths and engine.cache.draft.shape == (SMALL["max_slots"], drafts)
    other, traced = engines["plain"], dict(engines["plain"].traces)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        compiling = pool.submit(lambda: _guarded(engine, prompts))  # compiles while `other` decodes
        assert [c.tokens for c in _greedy(other, prompts[:2])] == [c.tokens for c in plain[:2]]
        out = compiling.result()
    assert dict(other.traces) == traced and [c.tokens for c in out] == [c.tokens for c in plain]
    assert engine.traces == {"prefill": 1, "decode": 1} and engine.stats["decode_steps"] > 1
    assert engine.stats["drafted"] > engine.stats["accepted"] >= 0
    for wrong, expected in ((False, "all"), (True, "none")):
        engine.update_weights(self_drafting(chained, wrong), version=1)
        engine.stats.clear()
        _greedy(engine, prompts, new=9)
        drafted, accepted = engine.stats["drafted"], engine.stats["accepted"]
        assert drafted > 0 and accepted == (drafted if expected == "all" else 0), (expected, drafted, accepted)
    assert engine.traces == {"prefill": 1, "decode": 1}


def test_verify_accepts_the_longest_verified_prefix():
    """The rule on its own, against a NumPy count: greedy slots keep their drafts up to the first that is
    not the argmax, which the argmax replaces (a bonus draw after all K); a sampled slot whose draft
    distribution equals p keeps every draft, one whose first draft p gives probability 0 keeps none."""
    slots, drafts, vocab = 6, 3, 8
    rng = np.random.default_rng(3)
    log_softmax = lambda x: x - np.log(np.exp(x).sum(-1, keepdims=True))  # noqa: E731
    point = lambda tokens: np.where(np.arange(vocab) == tokens[..., None], 0.0, -np.inf)  # noqa: E731
    target = log_softmax(rng.standard_normal((slots, drafts + 1, vocab)))
    best = target.argmax(-1)                                        # [slots, drafts + 1]
    keep = np.array([0, 1, 2, 3, 3, 0])                             # greedy slots 0-3: the leading correct drafts
    d = np.where(np.arange(drafts)[None] < keep[:, None], best[:, :drafts], (best[:, :drafts] + 1) % vocab)
    q = point(d)                                                    # greedy drafts: point masses
    target[:4] = point(best[:4])                                    # greedy p: a point mass at the argmax
    q[4] = target[4, :drafts]                                       # slot 4 samples with q = p
    q[5] = log_softmax(rng.standard_normal((drafts, vocab)))
    target[5, 0, d[5, 0]] = -np.inf                                 # slot 5: p(first draft) = 0
    sampling = SlotSampling(jnp.asarray([0, 0, 0, 0, 1, 1], jnp.float32), jnp.ones(slots), jnp.zeros(slots, jnp.int32),
                            jnp.arange(slots, dtype=jnp.uint32))
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    verdict = jax.jit(verify)(f32(target), f32(q), jnp.asarray(d, jnp.int32), sampling, jnp.full(slots, 10, jnp.int32))
    assert verdict.accepted.tolist() == keep.tolist()
    tokens = np.asarray(verdict.tokens)
    for s in range(4):
        assert tokens[s, :keep[s] + 1].tolist() == best[s, :keep[s] + 1].tolist()
    assert tokens[4, :drafts].tolist() == d[4].tolist() and tokens[5, 0] != d[5, 0]


def test_speculative_setting_resolves_and_names_the_key(model):
    depths, cpu = model.cfg.mtp.num_layers, "cpu"
    assert speculation.draft_tokens("on", depths, cpu) == speculation.DEFAULT_DRAFT_TOKENS
    assert speculation.draft_tokens(True, depths, cpu, 3) == 3 and speculation.draft_tokens("off", depths, cpu, 3) == 0
    # auto: on where the bench measured speculation faster on the platform, never without MTP depths
    for platform in ("cpu", "gpu", "tpu", "unmeasured"):
        faster = speculation.MEASURED_FASTER.get(platform, False)
        assert speculation.draft_tokens("auto", depths, platform) == (speculation.DEFAULT_DRAFT_TOKENS if faster else 0)
        assert speculation.draft_tokens("auto", 0, platform) == 0
    with pytest.raises(ValueError, match=r"speculative=on drafts with the MTP depths.*mtp.num_layers=0"):
        speculation.draft_tokens("on", 0, cpu)
    # config values: YAML's on / off are booleans; bad values name the key
    for raw, want in (("on", "on"), ("off", "off"), ("true", "on"), ("auto", "auto")):
        read = from_dict(GenerateConfig, apply_overrides(GenerateConfig, {}, [f"speculative={raw}"]))
        assert read.speculative == want
    with pytest.raises(ConfigError, match="speculative.*one of off, on, auto"):
        from_dict(GenerateConfig, apply_overrides(GenerateConfig, {}, ["speculative=sometimes"]))
    with pytest.raises(ConfigError, match="draft_tokens"):
        GenerateConfig(draft_tokens=-1)
    with pytest.raises(GenerationError, match="speculative must be one of"):
        Engine(model, speculative="maybe", **SMALL)
    # the RL key: rollouts (and the runs' evaluation) pass it to the engine agent
    standalone = ["init_from=", "model=tiny", "model.rope.max_position_embeddings=256"]   # no SFT run needed
    assert load_rl_config("rl-tiny", [*standalone, "rollout.speculative=on"]).rollout.speculative == "on"
    with pytest.raises(ConfigError, match=r"rollout.speculative.*mtp.num_layers=0"):
        load_rl_config("rl-tiny", [*standalone, "rollout.speculative=on", "model.mtp.num_layers=0"])


def _exact_joint(model, prompt):
    """The exact distributions of the first two sampled tokens: the main model's p(g1) p(g2 | g1), and
    the MTP draft's q(g2 | g1), from one teacher-forced forward over prompt + [g1] for every g1."""
    rows = jnp.asarray([prompt + [v] for v in range(VOCAB)], jnp.int32)
    out = nnx.jit(lambda m, t: m.forward(t))(model, rows)
    main = np.asarray(model.logits(out.hidden), np.float64)                  # [VOCAB, P+1, VOCAB]
    draft = np.asarray(model.logits(out.mtp_hidden[0]), np.float64)
    probs = lambda logits: sampling_probs(logits, SETTINGS["temperature"], 0, SETTINGS["top_p"])  # noqa: E731
    p1 = probs(main[0, len(prompt) - 1])
    p2 = np.stack([probs(main[v, len(prompt)]) for v in range(VOCAB)])       # [g1, g2]
    q2 = np.stack([probs(draft[v, len(prompt) - 1]) for v in range(VOCAB)])  # MTP at the last prompt position
    return p1[:, None] * p2, p1, p2, q2


def _cells(values, expected):
    """The cells of Pearson's test: those expected to hold >= 5 samples, and the others pooled (cells
    of probability 0 are left out: nothing may land there)."""
    big, small = expected >= 5, (expected > 0) & (expected < 5)
    return np.append(values[big], values[small].sum()) if small.any() else values[big]


def _chi_square(counts, expected):
    assert counts[expected == 0].sum() == 0, "a pair of probability 0 was sampled"
    return stats.chisquare(_cells(counts, expected), _cells(expected, expected))


def _sample_pairs(engine, prompt):
    ids = [engine.submit(prompt, max_new_tokens=2, sampling=SamplingParams(**SETTINGS, seed=s), stop_tokens=[])
           for s in range(SAMPLES)]
    done = engine.run()
    counts = np.zeros((VOCAB, VOCAB))
    for i in ids:
        counts[tuple(done[i].tokens)] += 1
    return counts


@pytest.mark.slow
def test_speculative_sampling_follows_the_model_distribution(model, engines):
    """4096 two-token samples (fixed seeds): the pair (g1, g2) follows p(g1) p(g2 | g1) for plain and for
    speculative decoding, where g2 is the verified MTP draft or its replacement. The same test rejects
    the distributions two plausible wrong rules would give (computed exactly from p and q), so a
    biased acceptance rule would fail it."""
    prompt = [3, 14, 1, 5, 9, 2, 6]
    joint, p1, p2, q2 = _exact_joint(model, prompt)
    engine = engines["speculative"]
    before = dict(engine.stats)
    for mode in ("plain", "speculative"):
        counts = _sample_pairs(engines[mode], prompt)
        result = _chi_square(counts.ravel(), SAMPLES * joint.ravel())
        print(f"{mode}: chi-square {result.statistic:.1f}, p-value {result.pvalue:.3f}")
        assert result.pvalue > ALPHA, f"{mode}: chi-square p-value {result.pvalue:.2e}"
    drafted = engine.stats["drafted"] - before.get("drafted", 0)
    accepted = engine.stats["accepted"] - before.get("accepted", 0)
    assert drafted == engine.draft_tokens * SAMPLES and 0.05 < accepted / drafted < 0.9

    # The test's power: with these samples it rejects (with probability > 0.999) the distributions of
    # accepting with p(d) (ignoring q) and of resampling from p instead of (p - q)+.
    accept_p = lambda p, q: q * np.minimum(p, 1) + (1 - (q * p).sum()) * _residual(p, q)  # noqa: E731
    resample_p = lambda p, q: np.minimum(p, q) + (1 - np.minimum(p, q).sum()) * p  # noqa: E731
    expected = SAMPLES * joint.ravel()
    cells = _cells(expected, expected)
    critical = stats.chi2.ppf(1 - ALPHA, cells.size - 1)
    for wrong in (accept_p, resample_p):
        biased = SAMPLES * (p1[:, None] * np.stack([wrong(p2[v], q2[v]) for v in range(VOCAB)])).ravel()
        assert np.isclose(biased.sum(), SAMPLES)
        assert biased[expected == 0].sum() < 1e-9 * SAMPLES  # the wrong rules stay on p's support here
        noncentrality = ((_cells(biased, expected) - cells) ** 2 / cells).sum()
        power = stats.ncx2.sf(critical, cells.size - 1, noncentrality)
        print(f"wrong rule: noncentrality {noncentrality:.0f}, critical value {critical:.0f}, power {power:.6f}")
        assert power > 0.999


def _residual(p, q):
    r = np.maximum(p - q, 0)
    return r / r.sum() if r.sum() else p

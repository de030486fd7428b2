"""MTP speculative decoding: greedy output equals plain greedy decoding, and sampled output follows the
exact sampling distribution of the main model (a chi-square test against the distribution computed
from the model's own forward, on a 16-token vocabulary, with fixed seeds).

Every engine here has one shape, so the module compiles one plain and one speculative engine."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from composer_jax import load_config
from composer_jax.infer import Engine, SamplingParams, generate
from tests.random_models import random_model
from tests.sampling_reference import sampling_probs

VOCAB = 16
SHAPES = dict(max_slots=64, max_len=32, chunk_sizes=(16,), steps_per_call=4)
SAMPLES = 4096
SETTINGS = dict(temperature=1.0, top_p=0.9)   # truncation on, so p and q are both processed
ALPHA = 1e-3


@pytest.fixture(scope="module")
def model():
    return random_model(load_config("tiny", [f"vocab_size={VOCAB}"]), 2)


@pytest.fixture(scope="module")
def engines(model):
    return {mode: Engine(model, speculative=mode == "speculative", **SHAPES) for mode in ("plain", "speculative")}


def test_speculative_greedy_equals_plain_greedy(model, engines):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 6, 9, 12, 15)]
    out = {}
    for mode, engine in engines.items():
        ids = [engine.submit(p, max_new_tokens=14, sampling=SamplingParams(0.0), stop_tokens=[]) for p in prompts]
        done = engine.run()
        out[mode] = [done[i] for i in ids]
    assert [c.tokens for c in out["speculative"]] == [c.tokens for c in out["plain"]]
    for s, p in zip(out["speculative"], out["plain"]):
        np.testing.assert_allclose(s.logprobs, p.logprobs, atol=1e-5)
    rate = engines["speculative"].acceptance["acceptance_rate"]
    assert 0 < rate < 1, f"both the accept and the reject path must run (acceptance {rate})"
    # generate() reports the statistics.
    result = generate(model, prompts[:2], max_new_tokens=6, temperature=0.0, speculative=True, stop_tokens=[],
                      max_slots=64, max_len=32, chunk_sizes=(16,), steps_per_call=4)
    assert result.tokens == [c.tokens[:6] for c in out["plain"][:2]] and 0 <= result.acceptance_rate <= 1
    assert result.mean_accepted_length == pytest.approx(1 + result.acceptance_rate)


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
    assert drafted == SAMPLES and 0.1 < accepted / drafted < 0.9

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

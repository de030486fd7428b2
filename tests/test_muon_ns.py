"""Newton-Schulz: coefficient schedules, singular-value ranges against closed forms, FLOP counts."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from composer_jax.optim import newton_schulz as ns

# (preset, steps, smallest normalised singular value, promised output range). Jordan's quintic: his
# "S' ~ Uniform(0.5, 1.5)", in fact its oscillation band; Polar Express: within 1 +- 0.16 after 5 steps
# and 1 after 8, for inputs in its design interval [1e-3, 1]; dion's 5-step set: within 1 +- 0.035.
PROMISES = [
    ("standard", 5, 2e-3, (0.5, 1.5)),
    ("standard", 5, 1e-2, (0.68, 1.14)),
    ("dion", 5, 1e-2, (0.965, 1.035)),
    ("polar_express", 5, 1e-3, (0.84, 1.13)),
    ("polar_express", 8, 1e-3, (1 - 1e-6, 1 + 1e-6)),
]


def _matrix(m: int, n: int, lower: float, seed: int) -> np.ndarray:
    """A float64 [m, n] matrix whose Frobenius-normalised singular values t (sum t^2 = 1) have min `lower`."""
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.0, 1.0, m) ** 2
    w[0], w[1] = 0.0, 1.0
    # t = lower + a * w with sum(t^2) = 1: the positive root of a quadratic in a.
    qa, qb, qc = np.sum(w * w), 2 * lower * np.sum(w), m * lower ** 2 - 1
    t = lower + (-qb + np.sqrt(qb * qb - 4 * qa * qc)) / (2 * qa) * w
    u, _ = np.linalg.qr(rng.standard_normal((m, m)))
    v, _ = np.linalg.qr(rng.standard_normal((n, m)))
    return 3.0 * (u * t) @ v.T


# optax's own coefficient sets (optax.contrib._muon): 'standard' (Jordan's quintic, also muon's default)
# and 'dion' (5 steps).
OPTAX_PRESETS = optax.contrib._muon._NS_COEFFS_PRESET_DICT
# Polar Express, as published: Amsel, Persson, Musco, Gower, "The Polar Express", arXiv 2505.16932,
# Algorithm 1 (github.com/NoahAmsel/PolarExpress): degree 5, l = 1e-3; later steps repeat the last row.
PAPER_POLAR_EXPRESS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
PAPER_SAFETY = 1.01   # Algorithm 1 / section 4.4: p(x) -> p(x / 1.01), and X / (||X||_F * 1.01 + 1e-7)


def _shrunk(row):
    """Coefficients of x -> p(x / 1.01)."""
    return np.asarray(row, np.float64) / np.array([PAPER_SAFETY, PAPER_SAFETY ** 3, PAPER_SAFETY ** 5])


def _paper_polar_express(g: np.ndarray, steps: int) -> np.ndarray:
    """The paper's Algorithm 1 on one matrix, in float64."""
    coeffs = [_shrunk(row) for row in PAPER_POLAR_EXPRESS[:-1]] + [np.asarray(PAPER_POLAR_EXPRESS[-1])]
    wide = g.shape[0] > g.shape[1]
    x = g.T if wide else g
    x = x / (np.linalg.norm(x) * PAPER_SAFETY + 1e-7)
    for a, b, c in coeffs[:steps] + [coeffs[-1]] * max(0, steps - len(coeffs)):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if wide else x


def test_presets_match_optax():
    default = inspect.signature(optax.contrib.muon).parameters["ns_coeffs"].default
    np.testing.assert_array_equal(ns.coefficient_schedule("standard", 3), np.array([default] * 3))
    np.testing.assert_array_equal(ns.coefficient_schedule("jordan", 2), np.array([OPTAX_PRESETS["standard"]] * 2))
    np.testing.assert_array_equal(ns.coefficient_schedule("dion", 5), np.array(OPTAX_PRESETS["dion"]))
    assert set(OPTAX_PRESETS) <= set(ns.PRESETS)


def test_schedule_semantics():
    """A schedule runs in order: truncated to ns_steps, its last row repeated beyond its length."""
    dion = np.array(OPTAX_PRESETS["dion"])
    np.testing.assert_array_equal(ns.coefficient_schedule("dion", 3), dion[:3])
    np.testing.assert_array_equal(ns.coefficient_schedule("dion", 7), np.concatenate([dion, dion[-1:], dion[-1:]]))
    rows = ((1.0, 2.0, 3.0), (4.0, 5.0, 6.0))
    np.testing.assert_array_equal(ns.coefficient_schedule(rows, 3), np.array(rows + rows[-1:]))
    np.testing.assert_array_equal(ns.coefficient_schedule(rows[0], 2), np.array(rows[:1] * 2))


def test_polar_express_follows_the_paper():
    """8 steps (the paper's whole list): Algorithm 1's polynomials, the normalisation's 1.01 folded into
    the first; fewer steps: the prefix (greedy is optimal for every prefix, their Thm 4.1) with the
    safety factor omitted in the final iteration (section 4.4). Numerically: Algorithm 1 in float64."""
    algorithm1 = np.array([_shrunk(row) for row in PAPER_POLAR_EXPRESS[:-1]] + [PAPER_POLAR_EXPRESS[-1]])
    want = algorithm1.copy()
    want[0] = _shrunk(want[0])                       # X / (1.01 ||X||): p_1(x / 1.01) once more
    np.testing.assert_allclose(ns.coefficient_schedule("polar_express", 8), want, rtol=1e-15)
    want5 = np.concatenate([want[:4], [PAPER_POLAR_EXPRESS[4]]])
    np.testing.assert_allclose(ns.coefficient_schedule("polar_express", 5), want5, rtol=1e-15)

    g = np.random.default_rng(3).standard_normal((40, 24))
    ours = ns.newton_schulz(jnp.asarray(g, jnp.float32), ns.coefficient_schedule("polar_express", 8))
    np.testing.assert_allclose(np.asarray(ours, np.float64), _paper_polar_express(g, 8), atol=2e-6)


@pytest.mark.parametrize("bad, steps, match", [
    ("muon", 5, "unknown ns_coeffs preset"),
    ((1.0, 2.0), 5, r"shape \(2,\)"),
    (((1.0, 2.0, 3.0), (1.0, 2.0)), 5, "ns_coeffs must be"),
    ((1.0, float("nan"), 1.0), 5, "finite"),
    ("standard", 0, "ns_steps must be >= 1"),
    ("standard", 2.5, "static int"),
])
def test_schedule_errors(bad, steps, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ns.coefficient_schedule(bad, steps)


def test_quintic_image_is_exact():
    """The interval map agrees with dense sampling of the composed polynomials (float64)."""
    for preset in ("standard", "dion", "polar_express"):
        schedule = ns.coefficient_schedule(preset, 5)
        s = np.geomspace(1e-3, 1.0, 200_001)
        out = ns.apply_schedule(s, schedule)
        lo, hi = ns.singular_value_interval(schedule, 1e-3)
        assert lo <= out.min() <= lo + 1e-6 and hi - 1e-6 <= out.max() <= hi


@pytest.mark.parametrize("preset, steps, lower, promise", PROMISES)
def test_singular_values_in_promised_range(preset, steps, lower, promise):
    """NS output singular values: the closed-form image of the normalised inputs, inside the promise."""
    schedule = ns.coefficient_schedule(preset, steps)
    lo, hi = ns.singular_value_interval(schedule, lower)
    assert promise[0] <= lo <= hi <= promise[1]
    x = np.stack([_matrix(24, 40, lower, seed) for seed in range(3)])
    out = np.asarray(jax.jit(lambda a: ns.newton_schulz(a, schedule))(jnp.asarray(x, jnp.float32)), np.float64)
    for xi, yi in zip(x, out):
        s_in = np.linalg.svd(xi, compute_uv=False)
        s_in = s_in / np.sqrt(np.sum(s_in ** 2))
        s_out = np.linalg.svd(yi, compute_uv=False)
        np.testing.assert_allclose(np.sort(s_out), np.sort(ns.apply_schedule(s_in, schedule)), atol=2e-4)
        in_lo, in_hi = ns.singular_value_interval(schedule, s_in.min(), s_in.max())
        assert in_lo - 2e-4 <= s_out.min() and s_out.max() <= in_hi + 2e-4
        assert promise[0] - 2e-4 <= s_out.min() and s_out.max() <= promise[1] + 2e-4


def test_bfloat16_and_transpose():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 48, 20)), jnp.float32)
    schedule = ns.coefficient_schedule("polar_express", 5)
    f32 = ns.newton_schulz(x, schedule)
    # rows > cols is run on the transpose: the same matrices as orthogonalizing x^T and transposing back.
    np.testing.assert_allclose(f32, jnp.swapaxes(ns.newton_schulz(jnp.swapaxes(x, 1, 2), schedule), 1, 2), atol=1e-6)
    bf16 = ns.newton_schulz(x, schedule, dtype=jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16 and f32.dtype == jnp.float32
    lo, hi = ns.singular_value_interval(schedule, 1e-3)
    s = np.linalg.svd(np.asarray(bf16, np.float32), compute_uv=False)
    assert lo - 0.05 <= s.min() and s.max() <= hi + 0.05   # bf16 rounding stays inside the safety margin
    np.testing.assert_array_equal(ns.newton_schulz(jnp.zeros((3, 4)), schedule), 0.0)  # no NaN for zeros


def test_flop_count_matches_compiled_cost():
    x = jnp.ones((3, 40, 96), jnp.float32)
    schedule = ns.coefficient_schedule("standard", 5)

    def flops(steps):
        compiled = jax.jit(lambda a: ns.newton_schulz(a, schedule[:steps])).lower(x).compile()
        return compiled.cost_analysis()["flops"]

    assert flops(5) - flops(1) == pytest.approx(3 * ns.ns_flops(40, 96, 4), rel=0.03)
    assert ns.ns_flops(96, 40, 5) == ns.ns_flops(40, 96, 5) == 5 * (4 * 40 * 40 * 96 + 2 * 40 ** 3)

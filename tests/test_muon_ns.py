"""Newton-Schulz: coefficient schedules, singular-value ranges against closed forms, FLOP counts."""

import jax
import jax.numpy as jnp
import numpy as np
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


def test_presets_and_schedule_semantics():
    np.testing.assert_array_equal(ns.coefficient_schedule("standard", 3), np.array([ns.JORDAN] * 3))
    np.testing.assert_array_equal(ns.coefficient_schedule("jordan", 2),
                                  ns.coefficient_schedule((3.4445, -4.775, 2.0315), 2))
    np.testing.assert_array_equal(ns.coefficient_schedule("dion", 5), np.array(ns.DION))
    # A schedule runs in order: truncated to ns_steps, its last row repeated beyond its length.
    np.testing.assert_array_equal(ns.coefficient_schedule("dion", 3), np.array(ns.DION[:3]))
    np.testing.assert_array_equal(ns.coefficient_schedule("dion", 7)[5:], np.array([ns.DION[-1]] * 2))
    # Polar Express: the paper's rows with the 1.01 safety folded in (twice for the first: normalisation).
    pe, paper, f = ns.coefficient_schedule("polar_express", 5), np.array(ns.POLAR_EXPRESS_PAPER[:5]), 1.01
    np.testing.assert_allclose(pe[0], paper[0] / np.array([f, f ** 3, f ** 5]) ** 2, rtol=1e-15)
    np.testing.assert_allclose(pe[1:4], paper[1:4] / np.array([f, f ** 3, f ** 5]), rtol=1e-15)
    np.testing.assert_array_equal(pe[4], paper[4])


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

"""Newton-Schulz (NS) orthogonalization: coefficient sets, the batched iteration, its cost, and the
closed-form singular-value range each coefficient schedule produces.

One NS step applies the odd quintic p(s) = a*s + b*s^3 + c*s^5 to every singular value of X at once:
    A = X X^T;  X <- (a I + b A + c A A) X        (X: [m, n], m <= n: the Gram matrix is m x m)
After the Frobenius normalisation X / (||X||_F + eps) every singular value lies in (0, 1], so the output
singular values are the image of (0, 1] under the composed polynomials; `singular_value_interval`
computes that image exactly (interval arithmetic through each quintic's critical points).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Keller Jordan's quintic, maximal slope at zero (optax's default, 'standard' there).
JORDAN = (3.4445, -4.7750, 2.0315)
# optax's 'dion' preset (5 steps, leloykun's "quintic" set).
DION = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
# Polar Express (Amsel et al., arXiv 2505.16932): the greedy minimax quintics for singular values in
# [1e-3, 1]. Greedy is optimal for every prefix (their Thm 4.1), so the first k rows are the best k-step
# schedule; later steps repeat the last row, which converges to 1.
POLAR_EXPRESS_PAPER = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
# The paper's bf16 safety margin: every step but the last sees its input shrunk by 1.01 (so rounding
# cannot push a singular value past the end of the interval the quintic was fitted on), and so does
# the normalised input; both are folded into the coefficients: p(s / f) = (a/f) s + (b/f^3) s^3 + ...
POLAR_EXPRESS_SAFETY = 1.01
# Singular values the Polar Express schedule was designed for (after the Frobenius normalisation).
POLAR_EXPRESS_LOWER = 1e-3

PRESETS = ("standard", "jordan", "dion", "polar_express")


def _shrink_input(row: np.ndarray, factor: float) -> np.ndarray:
    """Coefficients of s -> p(s / factor)."""
    return row / np.array([factor, factor ** 3, factor ** 5])


def _extend(rows: np.ndarray, steps: int) -> np.ndarray:
    """The first `steps` rows; later steps repeat the last row."""
    if steps <= len(rows):
        return rows[:steps]
    return np.concatenate([rows, np.repeat(rows[-1:], steps - len(rows), axis=0)])


def coefficient_schedule(ns_coeffs: str | Sequence, ns_steps: int) -> np.ndarray:
    """The per-step quintic coefficients f64[ns_steps, 3].

    ns_coeffs: a preset name ('standard' = 'jordan', 'dion', 'polar_express'), one (a, b, c) triple
    (repeated every step), or a schedule of triples run in order (truncated to `ns_steps`, its last
    row repeated when `ns_steps` is longer). `ns_steps` must be a static int >= 1.
    """
    if not isinstance(ns_steps, (int, np.integer)) or isinstance(ns_steps, bool):  # a traced value is neither
        raise TypeError(f"ns_steps must be a static int, got {ns_steps!r} (under optax.inject_hyperparams "
                        "pass static_args=('ns_steps',))")
    if ns_steps < 1:
        raise ValueError(f"ns_steps must be >= 1, got {ns_steps}")
    if isinstance(ns_coeffs, str):
        if ns_coeffs in ("standard", "jordan"):
            return _extend(np.array([JORDAN], np.float64), ns_steps)
        if ns_coeffs == "dion":
            return _extend(np.array(DION, np.float64), ns_steps)
        if ns_coeffs == "polar_express":
            rows = _extend(np.array(POLAR_EXPRESS_PAPER, np.float64), ns_steps)
            rows[:-1] = _shrink_input(rows[:-1], POLAR_EXPRESS_SAFETY)
            rows[0] = _shrink_input(rows[0], POLAR_EXPRESS_SAFETY)  # the normalised input's margin
            return rows
        raise ValueError(f"unknown ns_coeffs preset {ns_coeffs!r}; expected one of {PRESETS} or coefficients")
    try:
        given = np.asarray(ns_coeffs, np.float64)
    except (TypeError, ValueError):
        given = np.empty((0,))
    rows = given[None] if given.ndim == 1 else given
    if rows.ndim != 2 or rows.shape[-1] != 3 or len(rows) == 0:
        raise ValueError(f"ns_coeffs must be (a, b, c) or a sequence of (a, b, c), got {ns_coeffs!r} "
                         f"(shape {given.shape})")
    if not np.all(np.isfinite(rows)):
        raise ValueError(f"ns_coeffs must be finite, got {rows.tolist()}")
    return _extend(rows, ns_steps)


def normalize(x: jax.Array, eps: float = 1e-8, dtype=None) -> jax.Array:
    """Every matrix of x [..., m, n] divided by its own Frobenius norm (computed in float32) plus `eps`,
    in `dtype` (default x.dtype): NS's input scaling."""
    x32 = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(x32 * x32, axis=(-2, -1), keepdims=True))
    return (x32 / (norm + eps)).astype(jnp.dtype(dtype or x.dtype))


def newton_schulz(x: jax.Array, schedule: np.ndarray, eps: float = 1e-8, dtype=None) -> jax.Array:
    """Orthogonalize every matrix of a batch: x [..., m, n] -> [..., m, n] in `dtype` (default x.dtype).

    Each matrix is scaled by `normalize`, then runs one NS step per row of `schedule` (f64[steps, 3],
    from `coefficient_schedule`); the loop is unrolled in Python so that XLA's cost analysis sees every
    step. Wide-side-inside: when m > n the matrices are transposed so that the Gram matrix is
    min(m, n) square.
    """
    dtype = jnp.dtype(dtype or x.dtype)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = jnp.swapaxes(x, -1, -2)
    x = normalize(x, eps, dtype)
    eye = jnp.eye(x.shape[-2], dtype=dtype)
    for a, b, c in np.asarray(schedule, np.float64).tolist():  # Python floats: weakly typed, keep `dtype`
        gram = x @ jnp.swapaxes(x, -1, -2)
        # (a I + b A + c A A) X: the a X term rides in the m x m factor, so no elementwise pass over
        # the m x n X (same polynomial as a X + (b A + c A A) X, one less read and write of X).
        x = (b * gram + c * gram @ gram + a * eye) @ x
    return jnp.swapaxes(x, -1, -2) if transposed else x


def split_steps(x: jax.Array, schedule: np.ndarray, reduce) -> jax.Array:
    """NS steps on matrices held as column blocks across devices: x [..., m, w] is this device's block of
    each (already `normalize`d) m x n matrix, m <= n; `reduce` sums an array over the devices holding
    the other blocks (a psum). The same polynomial as `newton_schulz`, applied as
    a X + b (A X) + c (A (A X)) with A = reduce(X X^T): every product is m x m by m x w, so a step costs
    6 m^2 w FLOPs per block and no device forms A A (2 m^3). Gram partial sums accumulate in float32."""
    dtype = x.dtype
    for a, b, c in np.asarray(schedule, np.float64).tolist():
        gram = reduce(jnp.matmul(x, jnp.swapaxes(x, -1, -2), preferred_element_type=jnp.float32)).astype(dtype)
        ax = gram @ x
        x = a * x + b * ax + c * (gram @ ax)
    return x


def ns_flops(m: int, n: int, steps: int) -> int:
    """Dense-GEMM FLOPs of `steps` NS steps on one m x n matrix: steps * (4 s^2 l + 2 s^3), s = min, l = max."""
    s, l = min(m, n), max(m, n)
    return steps * (4 * s * s * l + 2 * s ** 3)


def _quintic_image(row, lo: float, hi: float) -> tuple[float, float]:
    """Exact image of [lo, hi] (0 <= lo <= hi) under p(s) = a s + b s^3 + c s^5."""
    a, b, c = (float(v) for v in row)
    candidates = [lo, hi]
    # p'(s) = a + 3b s^2 + 5c s^4 = 0 is a quadratic in s^2 (np.roots drops leading zeros).
    for root in np.roots([5 * c, 3 * b, a]):
        if abs(root.imag) < 1e-12 and root.real > 0 and lo < np.sqrt(root.real) < hi:
            candidates.append(float(np.sqrt(root.real)))
    values = [a * s + b * s ** 3 + c * s ** 5 for s in candidates]
    return min(values), max(values)


def singular_value_interval(schedule: np.ndarray, lower: float, upper: float = 1.0) -> tuple[float, float]:
    """The exact range of output singular values for normalised input singular values in [lower, upper]."""
    lo, hi = float(lower), float(upper)
    for row in np.asarray(schedule, np.float64):
        lo, hi = _quintic_image(row, lo, hi)
    return lo, hi


def apply_schedule(s: np.ndarray, schedule: np.ndarray) -> np.ndarray:
    """The scalar map NS applies to normalised singular values s (float64, for reference checks)."""
    s = np.asarray(s, np.float64)
    for a, b, c in np.asarray(schedule, np.float64):
        s = a * s + b * s ** 3 + c * s ** 5
    return s

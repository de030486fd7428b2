"""Batched, sharded orthogonalization layout: every matrix reaches `ns` whole, exactly once, and comes
back in its leaf's own sharding, on single meshes, on the dual grid and mesh-less."""

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.optim.layout import matrix_view, orthogonalize

EXPLICIT = AxisType.Explicit


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(EXPLICIT,) * len(shape))


def _per_matrix(x):
    """A per-matrix map that needs the whole matrix: X X^T X / ||X||_F^2 (x: [..., m, n])."""
    gram = x @ jnp.swapaxes(x, -1, -2)
    return gram @ x / jnp.sum(x * x, axis=(-2, -1), keepdims=True)


def _reference(x: np.ndarray, reduction, output) -> np.ndarray:
    """The same map per matrix in numpy, on the (reduction, output) view of each batch index."""
    batch = [d for d in range(x.ndim) if d not in reduction + output]
    perm = batch + list(reduction) + list(output)
    shape = [x.shape[d] for d in perm]
    m, n = math.prod(x.shape[d] for d in reduction), math.prod(x.shape[d] for d in output)
    mats = np.transpose(x, perm).reshape(-1, m, n).astype(np.float64)
    out = np.einsum("bij,bkj,bkl->bil", mats, mats, mats) / np.sum(mats ** 2, axis=(1, 2), keepdims=True)
    return np.transpose(out.reshape(shape), np.argsort(perm))


def _run(cases, chunks, dtype=jnp.float32):
    """cases: (shape, mesh | None, spec, reduction, output). Returns outputs, inputs, NS calls and HLO."""
    rng = np.random.default_rng(0)
    xs, views = [], []
    for shape, mesh, spec, red, out in cases:
        x = jnp.asarray(rng.standard_normal(shape), dtype)
        xs.append(jax.device_put(x, NamedSharding(mesh, spec)) if mesh is not None else x)
        views.append(matrix_view(shape, red, out))
    calls = []

    def ns(x):
        calls.append(tuple(x.shape))
        return _per_matrix(x)

    meshes = tuple({case[1] for case in cases if case[1] is not None})
    fn = jax.jit(lambda xs: orthogonalize(xs, views, ns, chunks, meshes))
    lowered = fn.lower(xs)
    return fn(xs), xs, calls, lowered.compile().as_text(), lowered.as_text()


def _check(cases, outs, xs, tol=2e-5):
    for (shape, mesh, spec, red, out), x, y in zip(cases, xs, outs):
        assert y.dtype == x.dtype
        expected = _reference(np.asarray(x, np.float64), red, out)
        np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=tol, atol=tol * np.abs(expected).max())
        assert jax.typeof(y).sharding.spec == jax.typeof(x).sharding.spec, (shape, spec)


def _collectives(hlo: str) -> collections.Counter:
    ops = ("all-to-all", "all-gather", "all-reduce", "collective-permute", "reduce-scatter")
    return collections.Counter(op for line in hlo.splitlines() for op in ops if f" {op}(" in line)


@pytest.mark.parametrize("chunks", [1, 3])
def test_dual_grid_leaves(chunks):
    """Experts on ('ep', 'fsdp'), dense weights on ('replica', 'fsdp'): sharded matrix dims, sharded batch
    dims, replicated axes, transposed views and per-head views, batched into one NS per chunk."""
    expert = _mesh((4, 2), ("ep", "fsdp"))
    dense = _mesh((2, 4), ("replica", "fsdp"))
    cases = [
        ((2, 16, 8, 4), expert, P(None, "ep", "fsdp", None), (2,), (3,)),   # experts [L, E, in, out]
        ((2, 16, 4, 8), expert, P(None, "ep", None, "fsdp"), (2,), (3,)),   # same matrix shape, other side
        ((3, 8, 4), dense, P(None, "fsdp", None), (1,), (2,)),              # stacked 2-D, replicated on 'replica'
        ((8, 5, 4), dense, P("fsdp", None, None), (0,), (2,)),              # per head [r, heads, k]
        ((4, 4, 8), dense, P(None, None, "fsdp"), (1,), (2,)),              # output dim sharded
        ((4, 8), dense, P(None, None), (0,), (1,)),                         # replicated everywhere
        ((6, 6), None, None, (0,), (1,)),                                   # no mesh: global view
    ]
    outs, xs, calls, hlo, _ = _run(cases, chunks)
    _check(cases, outs, xs)
    assert "all-reduce" not in _collectives(hlo)
    # Every device runs ceil(matrices / 8) matrices of shape (4, 8): 32 + 32 experts + 3 stacked
    # + 5 + 4 per head + 1 replicated = 77 -> 10 per device, in `chunks` NS batches.
    per_device = collections.Counter()
    for shape in calls:
        per_device[shape[-2:]] += shape[1] if shape[0] == 8 else 0
    assert per_device[(4, 8)] == math.ceil(77 / 8)
    assert sum(shape[0] == 8 for shape in calls) == chunks


def test_small_buckets_share_one_layer():
    """gate/up [embed, mlp] and down [mlp, embed] of one layer are sharded on different matrix sides, so
    they travel in different all-to-alls, and a same-shape leaf lives on the other grid; yet their 4
    matrices fill one NS layer on 8 devices."""
    dense = _mesh((8,), ("fsdp",))
    expert = _mesh((4, 2), ("ep", "fsdp"))
    cases = [
        ((1, 16, 32), dense, P(None, "fsdp", None), (1,), (2,)),      # gate
        ((1, 16, 32), dense, P(None, "fsdp", None), (1,), (2,)),      # up
        ((1, 32, 16), dense, P(None, "fsdp", None), (1,), (2,)),      # down
        ((1, 16, 32), expert, P(None, "fsdp", None), (1,), (2,)),     # on the other grid
    ]
    outs, xs, calls, hlo, _ = _run(cases, chunks=1)
    _check(cases, outs, xs)
    assert calls == [(8, 1, 16, 32)]
    # Moving stacks between the two grids (same devices, same order) moves no data.
    assert "collective-permute" not in _collectives(hlo)
    # bfloat16 leaves travel and run in bfloat16: half the all-to-all bytes (XLA:CPU itself widens them).
    outs, xs, _, _, program = _run(cases, chunks=1, dtype=jnp.bfloat16)
    _check(cases, outs, xs, tol=3e-2)
    exchanges = [line for line in program.splitlines() if "all_to_all" in line]
    assert exchanges and all("bf16" in line for line in exchanges)


def test_tuple_axes_and_two_sharded_matrix_dims():
    mesh = _mesh((2, 2, 2), ("a", "b", "c"))
    cases = [
        ((8, 12), mesh, P(("a", "b"), None), (0,), (1,)),               # one dim over two axes
        ((8, 12), mesh, P("a", "b"), (0,), (1,)),                       # both matrix dims sharded
        ((2, 8, 12), mesh, P("c", ("b", "a"), None), (1,), (2,)),       # axis order b, a
        ((3, 2, 4, 12), mesh, P(None, None, "b", None), (0, 2), (3,)),  # two reduction axes
    ]
    for chunks in (1, 2):
        outs, xs, *_ = _run(cases, chunks)
        _check(cases, outs, xs)


def test_batch_sharded_leaves_need_no_communication():
    mesh = _mesh((4, 2), ("ep", "fsdp"))
    cases = [((16, 6, 10), mesh, P(("ep", "fsdp"), None, None), (1,), (2,)),
             ((2, 8, 6, 10), mesh, P("fsdp", "ep", None, None), (2,), (3,))]
    outs, xs, _, hlo, _ = _run(cases, chunks=2)
    _check(cases, outs, xs)
    assert not _collectives(hlo)


def test_layers_of_a_few_matrices_run_split_and_equal_whole_newton_schulz():
    """Layers holding fewer real matrices than devices are cut into column blocks over every device
    (the plan says where), and the result equals Newton-Schulz on each whole matrix: on one mesh and on
    a two-axis mesh, with a width that the devices do not divide (zero-padded) and a group with one
    full layer plus a split remainder."""
    from composer_jax.optim import newton_schulz as ns_lib
    from composer_jax.optim.orthogonalize_plan import leaf_info, plan_groups
    from composer_jax.optim.layout import SplitNS

    dense = _mesh((8,), ("fsdp",))
    expert = _mesh((4, 2), ("ep", "fsdp"))
    cases = [
        ((3, 16, 40), dense, P(None, "fsdp", None), (1,), (2,)),          # 3 matrices on 8 devices
        ((11, 8, 24), dense, P(None, None, "fsdp"), (1,), (2,)),          # one full layer + 3
        ((2, 12, 21), expert, P(None, "ep", None), (1,), (2,)),           # two-axis mesh, width 21
    ]
    rng = np.random.default_rng(3)
    xs, views = [], []
    for shape, mesh, spec, red, out in cases:
        xs.append(jax.device_put(jnp.asarray(rng.standard_normal(shape), jnp.float32), NamedSharding(mesh, spec)))
        views.append(matrix_view(shape, red, out))
    schedule = ns_lib.coefficient_schedule("standard", 5)
    whole = lambda x: ns_lib.newton_schulz(x, schedule)  # noqa: E731
    split = SplitNS(ns_lib.normalize, lambda x, reduce: ns_lib.split_steps(x, schedule, reduce))
    groups = plan_groups([leaf_info(i, x, v) for i, (x, v) in enumerate(zip(xs, views))], 1, (dense, expert), split=True)
    assert sorted(len(layer.real) for g in groups for layer in g.split) == [2, 3, 3]
    fn = jax.jit(lambda xs: orthogonalize(xs, views, whole, 1, (dense, expert), split))
    outs = fn(xs)
    assert "all-reduce" in _collectives(fn.lower(xs).compile().as_text())   # the Gram sums
    for x, y in zip(xs, outs):
        expected = np.asarray(whole(jnp.asarray(np.asarray(x))))             # every matrix whole, one device
        np.testing.assert_allclose(np.asarray(y), expected, rtol=2e-4, atol=2e-5)
        assert jax.typeof(y).sharding.spec == jax.typeof(x).sharding.spec

"""Muon against optax.contrib.muon (one device and the 8-device dual grid), the model's metadata,
nnx.Optimizer, optax composition, sharded state, per-device NS FLOPs and input errors."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as MDN

from composer_jax import CausalLM, load_config
from composer_jax.model.layers import RMSNorm, RouterBias, param
from composer_jax.optim import dimension_numbers, muon
from composer_jax.optim.newton_schulz import ns_flops
from composer_jax.optim.param_labels import pure

# name: (shape, dimension numbers, dense-grid spec or expert-grid spec)
LEAVES = {
    "w": ((16, 24), MDN(0, 1), ("dense", P("fsdp", None))),                        # plain 2-D
    "stack": ((2, 16, 24), MDN(1, 2), ("dense", P(None, "fsdp", None))),           # stacked layers
    "q_b": ((16, 4, 6), MDN(0, 2), ("dense", P("fsdp", None, None))),              # per head [r, heads, k]
    "o": ((8, 6, 16), MDN(1, 2), ("dense", P("fsdp", None, None))),                # per head, heads sharded
    "gate": ((8, 16, 12), MDN(1, 2), ("expert", P("ep", "fsdp", None))),           # per expert
    "down": ((8, 12, 16), MDN((-2,), (-1,)), ("expert", P("ep", None, "fsdp"))),   # per expert, transposed
    "embed": ((32, 16), None, ("dense", P("fsdp", None))),                         # AdamW
    "norm": ((16,), None, ("dense", P())),                                          # AdamW
}
DIMS = {k: d for k, (_, d, _) in LEAVES.items()}


def _meshes():
    explicit = AxisType.Explicit
    return {"dense": jax.make_mesh((8,), ("fsdp",), axis_types=(explicit,)),
            "expert": jax.make_mesh((4, 2), ("ep", "fsdp"), axis_types=(explicit,) * 2)}


def _values(seed):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(shape), jnp.float32) for k, (shape, _, _) in LEAVES.items()}


def _shard(tree):
    meshes = _meshes()
    return {k: jax.device_put(v, NamedSharding(meshes[LEAVES[k][2][0]], LEAVES[k][2][1])) for k, v in tree.items()}


def random_model(cfg_name="tiny", seed=0) -> CausalLM:
    """A CausalLM with random weights, built without running its initializers (fast): matrices and
    embeddings ~ N(0, 0.02^2), norm scales 1, router biases 0."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(load_config(cfg_name), rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def value(var):
        if not isinstance(var, nnx.Param):
            return var.replace(jnp.zeros(var.shape, var.dtype))
        if len(var.shape) - ("layers" in var.get_metadata("axes")) == 1:
            return var.replace(jnp.ones(var.shape, var.dtype))
        return var.replace(jnp.asarray(0.02 * rng.standard_normal(var.shape), var.dtype))

    return nnx.merge(graphdef, jax.tree.map(value, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _compare(settings, sharded: bool, steps=2, context=contextlib.nullcontext, inject=False):
    """Run ours (optionally on the dual grid, its steps under `context()`, its numeric settings as
    injected hyperparameters) and optax side by side; return ours' last params and state."""
    factory = optax.inject_hyperparams(muon) if inject else muon
    meshes = tuple(_meshes().values()) if sharded else ()
    ours = factory(ns_dtype="float32", muon_weight_dimension_numbers=DIMS, meshes=meshes, **settings)
    # Injected hyperparameters are float32 arrays rather than Python floats: rounding differs.
    tolerance = 3e-5 if inject else 1e-5
    ref = optax.contrib.muon(muon_weight_dimension_numbers=DIMS, **settings)
    params_ref = _values(0)
    params = _shard(params_ref) if sharded else dict(params_ref)
    state, state_ref = ours.init(params), ref.init(params_ref)
    step = jax.jit(lambda g, s, p: ours.update(g, s, p), donate_argnums=1)
    step_ref = jax.jit(ref.update)
    for i in range(steps):
        grads_ref = _values(i + 1)
        grads = _shard(grads_ref) if sharded else grads_ref
        with context():
            updates, state = step(grads, state, params)
        updates_ref, state_ref = step_ref(grads_ref, state_ref, params_ref)
        for k in LEAVES:
            assert _rel(updates[k], updates_ref[k]) <= tolerance, (i, k)
            assert jax.typeof(updates[k]).sharding.spec == jax.typeof(params[k]).sharding.spec, k
        params = optax.apply_updates(params, updates)
        params_ref = optax.apply_updates(params_ref, updates_ref)
    return params, state


@pytest.mark.parametrize("consistent_rms, nesterov", [(None, True), (0.2, False)])
def test_matches_optax_one_device(consistent_rms, nesterov):
    _compare(dict(learning_rate=0.05, consistent_rms=consistent_rms, nesterov=nesterov, weight_decay=0.1),
             sharded=False)


@pytest.mark.parametrize("consistent_rms", [None, 0.2])
def test_matches_optax_on_dual_grid(consistent_rms):
    """Same updates as optax with every leaf sharded on its grid; the state stays sharded like the
    parameters (and is donated between steps). With consistent RMS, the step also runs under the dense
    mesh as context mesh (as DualMesh sets it) and with injected hyperparameters, which come back from
    the first step committed to one mesh and must still meet leaves of the other."""
    settings = dict(learning_rate=0.05, consistent_rms=consistent_rms, weight_decay=0.1, adam_weight_decay=0.01)
    dense = _meshes()["dense"]
    context = (lambda: jax.set_mesh(dense)) if consistent_rms else contextlib.nullcontext
    params, state = _compare(settings, sharded=True, context=context, inject=consistent_rms is not None)
    state = state.inner_state if consistent_rms is not None else state
    for k, (_, dims, _) in LEAVES.items():
        if dims is not None:
            assert jax.typeof(state.mu[k]).sharding == jax.typeof(params[k]).sharding, k
    # AdamW runs once per mesh; its moments (over that mesh's leaves) are sharded like their params.
    groups, checked = state.adam.groups, []
    for members, inner in zip(groups.members, state.adam.inner):
        adam = inner.inner_state[0]
        for i, mu, nu in zip(members, adam.mu, adam.nu):
            k = groups.paths[i]
            if LEAVES[k][1] is None:
                checked.append(k)
                for moment in (mu, nu):
                    assert jax.typeof(moment).sharding == jax.typeof(params[k]).sharding, k
    assert sorted(checked) == ["embed", "norm"]


def test_model_metadata():
    """Default dimension numbers come from the model's metadata: per head for MLA, per expert, per
    stacked layer; embedding, head and norms go to AdamW; the router bias (not a Param) is frozen."""
    model = random_model()
    plan = muon(0.1).init(nnx.state(model)).plan
    views = dict(zip(plan.paths, zip(plan.labels, plan.axes)))
    assert views["moe_layers/attn/q_b_proj"] == ("muon", ((1,), (3,)))     # [layers, q_lora, heads, qk]
    assert views["moe_layers/attn/kv_b_proj"] == ("muon", ((1,), (3,)))    # [layers, kv_lora, heads, k+v]
    assert views["dense_layers/attn/o_proj"] == ("muon", ((2,), (3,)))     # [layers, heads, v, embed]
    assert views["moe_layers/mlp/down_proj"] == ("muon", ((2,), (3,)))     # [layers, experts, mlp, embed]
    assert views["mtp/depths/eh_proj"] == ("muon", ((1,), (2,)))           # [depths, 2 * embed, embed]
    assert views["moe_layers/mlp/router/kernel"] == ("muon", ((1,), (2,)))
    for path in ("embed/embedding", "lm_head", "final_norm/scale", "moe_layers/attn/q_a_norm/scale"):
        assert views[path] == ("adam", None), path
    assert [p for p, (label, _) in views.items() if label == "frozen"] == [
        "moe_layers/mlp/router/bias", "mtp/depths/layer/mlp/router/bias"]
    matrices = [p for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)) if var.has_metadata("reduction")]
    assert len(matrices) == plan.labels.count("muon")
    dims = pure(dimension_numbers(nnx.state(model, nnx.Param)))          # optax's form of the same views
    assert dims["moe_layers"]["attn"]["q_b_proj"] == MDN((1,), (3,)) and dims["lm_head"] is None


class _Toy(nnx.Module):
    """A few parameters of each kind, with the model's metadata."""

    def __init__(self, rngs: nnx.Rngs):
        self.embedding = param(rngs, (32, 16), ("vocab", "embed"), "float32")
        self.q_b = param(rngs, (16, 4, 8), ("q_lora", "heads", "qk_head"), "float32",
                         reduction=("q_lora",), output=("qk_head",))
        self.experts = param(rngs, (2, 4, 16, 12), ("layers", "experts", "embed", "mlp"), "float32",
                             reduction=("embed",), output=("mlp",))
        self.norm = RMSNorm(16, 1e-6, "embed", "float32", rngs=rngs)
        self.bias = RouterBias(jnp.zeros((4,)), axes=("experts",))


def test_nnx_optimizer_and_frozen_variables():
    """Through nnx.Optimizer (which passes plain arrays to update), same updates as optax with the same
    dimension numbers; a variable that is not a Param gets a zero update."""
    model = _Toy(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    settings = dict(learning_rate=0.02, consistent_rms=0.2, weight_decay=0.1)
    ref = optax.contrib.muon(muon_weight_dimension_numbers=pure(dimension_numbers(params)), **settings)
    rng = np.random.default_rng(1)
    grads = jax.tree.map(lambda v: v.replace(jnp.asarray(rng.standard_normal(v.shape), jnp.float32)), params,
                         is_leaf=lambda x: isinstance(x, nnx.Variable))
    values = pure(params)
    updates_ref, _ = jax.jit(ref.update)(pure(grads), ref.init(values), values)
    optimizer = nnx.Optimizer(model, muon(ns_dtype="float32", **settings), wrt=nnx.Param)
    updates = nnx.jit(lambda opt, m, g: opt.update(m, g))(optimizer, model, grads)
    for (path, u), u_ref in zip(jax.tree_util.tree_flatten_with_path(updates)[0], jax.tree.leaves(updates_ref)):
        assert _rel(u, u_ref) <= 1e-5, jax.tree_util.keystr(path)

    # The whole state, variables and metadata included, as a training step may pass it.
    everything = nnx.state(model)
    tx = muon(0.1, ns_dtype="float32")
    state = tx.init(everything)
    grads = jax.tree.map(lambda v: v.replace(jnp.ones_like(v.get_value())), everything,
                         is_leaf=lambda x: isinstance(x, nnx.Variable))
    updates, _ = jax.jit(tx.update)(grads, state, everything)
    assert isinstance(updates["bias"], RouterBias) and isinstance(updates["q_b"], nnx.Param)
    np.testing.assert_array_equal(updates["bias"].get_value(), 0.0)
    others = jax.tree.leaves({k: u for k, u in pure(updates).items() if k != "bias"})
    assert len(others) == 4 and all(np.all(np.asarray(u) != 0) for u in others)


def test_inject_hyperparams_and_chain():
    """Usable inside optax.chain and under optax.inject_hyperparams (schedule for the learning rate)."""
    schedule = optax.linear_schedule(0.1, 0.01, 10)
    plain = optax.chain(optax.clip_by_global_norm(1.0),
                        muon(schedule, ns_dtype="float32", muon_weight_dimension_numbers=DIMS))
    injected = optax.chain(optax.clip_by_global_norm(1.0),
                           optax.inject_hyperparams(muon)(learning_rate=schedule, ns_dtype="float32",
                                                          muon_weight_dimension_numbers=DIMS))
    params = _values(0)
    states = [tx.init(params) for tx in (plain, injected)]
    for i in range(2):
        grads = _values(i + 1)
        (u1, states[0]), (u2, states[1]) = (jax.jit(tx.update)(grads, s, params)
                                            for tx, s in zip((plain, injected), states))
        for k in LEAVES:
            # Injected hyperparameters are float32 arrays rather than Python floats: rounding differs.
            np.testing.assert_allclose(u1[k], u2[k], rtol=2e-5, atol=1e-7)
    assert float(states[1][1].hyperparams["learning_rate"]) == pytest.approx(float(schedule(1)))


def _compiled_ns_flops(leaves: dict, meshes: dict):
    """(params placed as `leaves` {name: (shape, dims, mesh, spec)} say, steps -> the compiled Muon
    update's FLOPs per device with `steps` NS steps)."""
    params = {k: jax.device_put(jnp.ones(shape), NamedSharding(mesh, spec))
              for k, (shape, _, mesh, spec) in leaves.items()}
    dims = {k: d for k, (_, d, _, _) in leaves.items()}

    def flops(steps):
        tx = muon(0.1, ns_steps=steps, ns_dtype="float32", muon_weight_dimension_numbers=dims,
                  meshes=tuple(meshes.values()))
        compiled = jax.jit(tx.update).lower(params, tx.init(params), params).compile()
        return compiled.cost_analysis()["flops"]

    return params, flops


def test_ns_flops_per_device_on_sharded_layout():
    """Compiled per-device NS FLOPs are total / 8 (no padding in this tree): F(6 steps) - F(1 step).
    (XLA's count includes the elementwise terms, ~2% at this size, and cheap ops it duplicates.)"""
    meshes = _meshes()
    leaves = {"experts": ((4, 16, 128, 64), MDN(2, 3), meshes["expert"], P(None, "ep", "fsdp", None)),
              "down": ((4, 16, 64, 128), MDN(2, 3), meshes["expert"], P(None, "ep", None, "fsdp")),
              "heads": ((2, 128, 8, 64), MDN(1, 3), meshes["dense"], P(None, "fsdp", None, None)),
              "dense": ((8, 128, 64), MDN(1, 2), meshes["dense"], P(None, "fsdp", None))}
    _, flops = _compiled_ns_flops(leaves, meshes)
    matrices = 64 + 64 + 16 + 8                       # all (64, 128) after transposing
    total = matrices * ns_flops(64, 128, 5)
    assert flops(6) - flops(1) == pytest.approx(total / 8, rel=0.1)


def test_split_remainders_keep_ns_flops_per_device_near_total_over_devices():
    """Three 128 x 256 matrices and 35 64 x 128 ones on 8 devices: whole-matrix layers would cost each
    device one 128 x 256 NS plus five 64 x 128 ones (1.76x the even share); the plan splits the
    remainders into column blocks. Compiled F(6 steps) - F(1 step) equals the plan's count
    (`orthogonalize_plan.ns_flops_per_device`), within 1.1x of total / 8."""
    from composer_jax.optim.orthogonalize_plan import leaf_info, matrix_view, ns_flops_per_device, plan_groups

    meshes = _meshes()
    leaves = {"mlp": ((3, 128, 256), MDN((1,), (2,)), meshes["dense"], P(None, "fsdp", None)),
              "heads": ((128, 35, 64), MDN((0,), (2,)), meshes["dense"], P("fsdp", None, None))}
    params, flops = _compiled_ns_flops(leaves, meshes)
    views = [matrix_view(shape, d.reduction_axis, d.output_axis) for shape, d, _, _ in leaves.values()]
    plan = plan_groups([leaf_info(i, params[k], v) for i, (k, v) in enumerate(zip(leaves, views))], 4,
                       tuple(meshes.values()), split=True)
    planned = ns_flops_per_device(plan, 5)
    total = 3 * ns_flops(128, 256, 5) + 35 * ns_flops(64, 128, 5)
    assert planned <= 1.1 * total / 8
    assert flops(6) - flops(1) == pytest.approx(planned, rel=0.05)


def test_errors_name_the_parameter():
    params = {"a": jnp.ones((4, 6)), "b": jnp.ones((3,)), "c": jnp.ones((2, 4, 6))}
    with pytest.raises(ValueError, match="'b'.*rank >= 2"):
        muon(0.1, muon_weight_dimension_numbers={"a": MDN(), "b": MDN(), "c": None}).init(params)
    with pytest.raises(ValueError, match="'c'.*overlapping"):
        muon(0.1, muon_weight_dimension_numbers={"a": None, "b": None, "c": MDN(1, (1, 2))}).init(params)
    with pytest.raises(ValueError, match="'c'.*reduction axes"):
        muon(0.1, muon_weight_dimension_numbers={"a": None, "b": None, "c": MDN(3, 1)}).init(params)
    with pytest.raises(TypeError, match="'a'.*MuonDimensionNumbers"):
        muon(0.1, muon_weight_dimension_numbers={"a": "rows", "b": None, "c": None}).init(params)
    with pytest.raises(ValueError, match="prefix"):
        muon(0.1, muon_weight_dimension_numbers={"a": None}).init(params)
    tx = muon(0.1)
    state = tx.init(params)
    with pytest.raises(ValueError, match="differs from the parameters"):
        tx.update({"a": jnp.ones((4, 6))}, state)
    with pytest.raises(ValueError, match="'a' has shape"):
        tx.update({**params, "a": jnp.ones((6, 4))}, state)
    bad = nnx.Param(jnp.ones((4, 6)), axes=("embed", "mlp"), reduction=("embed",), output=("vocab",))
    with pytest.raises(ValueError, match="'w'.*output axes"):
        muon(0.1).init({"w": bad})
    with pytest.raises(ValueError, match="unknown ns_coeffs preset"):
        muon(0.1, ns_coeffs="muon")
    with pytest.raises(ValueError, match="chunks"):
        muon(0.1, chunks=0)
    # Matrices on two meshes need the concrete meshes: JAX offers no public way to find them under a
    # trace, and a shard_map over an abstract mesh under another context mesh lowers wrong collectives.
    with pytest.raises(ValueError, match="'down' lives on .* pass the concrete meshes"):
        muon(0.1, muon_weight_dimension_numbers=DIMS).init(_shard(_values(0)))
    with pytest.raises(ValueError, match="'down' lives on .* pass the concrete meshes"):
        muon(0.1, muon_weight_dimension_numbers=DIMS, meshes=(_meshes()["dense"],)).init(_shard(_values(0)))


@pytest.mark.slow
def test_model_on_the_dual_mesh():
    """The tiny model placed by composer_jax.parallel on a DualMesh (dense weights on fsdp, replicated
    over replica and cp; experts on ep and efsdp), stepped under `with dual:`: optax's updates, each in
    its parameter's sharding."""
    from composer_jax.config import MeshConfig
    from composer_jax.parallel.mesh import DualMesh
    from composer_jax.parallel.partitioning import shard_model

    model = random_model()
    values = pure(nnx.state(model, nnx.Param))                   # unsharded copies for the reference
    rng = np.random.default_rng(2)
    grads = jax.tree.map(lambda v: jnp.asarray(rng.standard_normal(v.shape), jnp.float32), values)
    settings = dict(learning_rate=0.02, consistent_rms=0.2, weight_decay=0.1)
    # The reference runs on the MoE layer stack only (every kind of leaf, on both grids; optax compiles
    # one NS per leaf, slowly): its updates do not depend on the other leaves.
    dims = pure(dimension_numbers(nnx.state(model, nnx.Param)))["moe_layers"]
    ref = optax.contrib.muon(muon_weight_dimension_numbers=dims, **settings)
    moe = values["moe_layers"]
    updates_ref, _ = jax.jit(ref.update)(grads["moe_layers"], ref.init(moe), moe)

    dual = DualMesh(MeshConfig(replica=2, fsdp=2, cp=2, efsdp=2, ep=4), model=model.cfg)
    shard_model(model, dual)
    params = nnx.state(model, nnx.Param)
    placed = pure(params)
    grads = jax.tree.map(lambda g, p: jax.device_put(g, p.sharding), grads, placed)
    tx = muon(ns_dtype="float32", chunks=1, meshes=dual.meshes, **settings)
    state = tx.init(params)
    with dual:
        updates, _ = jax.jit(tx.update)(grads, state, placed)
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(placed)):
        assert u.sharding == p.sharding
    leaves = jax.tree_util.tree_flatten_with_path(updates["moe_layers"])[0]
    assert {p.sharding.mesh.axis_names for p in jax.tree.leaves(placed["moe_layers"])} == {
        dual.dense.axis_names, dual.expert.axis_names}
    for (path, u), u_ref in zip(leaves, jax.tree.leaves(updates_ref)):
        assert _rel(u, u_ref) <= 1e-5, jax.tree_util.keystr(path)
    # bf16 Newton-Schulz (the default) runs on both grids. Jordan's quintic only lands singular values in
    # a band ([0.68, 1.14]), so bf16 rounding moves the result within it: ~6% here, not float32-close.
    tx16 = muon(ns_dtype="bfloat16", chunks=1, meshes=dual.meshes, **settings)
    with dual:
        updates16, _ = jax.jit(tx16.update)(grads, tx16.init(params), placed)
    for u16, u in zip(jax.tree.leaves(updates16), jax.tree.leaves(updates)):
        assert u16.sharding == u.sharding and _rel(u16, u) <= 0.1

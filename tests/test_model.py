"""Model unit tests: router, YaRN, dispatch backends, packing, MTP, input errors, abstract lowering."""

import contextlib
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import CausalLM, config, load_config
from composer_jax.config import MeshConfig
from composer_jax.model import decoder, dispatch, rope
from composer_jax.model.router import expert_load, route, updated_bias
from composer_jax.parallel import DualMesh, shard_model
from tests.random_models import random_model


@pytest.fixture(scope="module")
def tiny():
    return load_config("tiny")


def _numpy_route(scores, bias, moe):
    """Independent per-token loop version of DeepSeek-V3 noaux_tc routing."""
    tokens, experts = scores.shape
    per_group = experts // moe.n_group
    weights, idx = [], []
    for t in range(tokens):
        choice = scores[t] + bias
        group_score = [np.sort(choice[g * per_group:(g + 1) * per_group])[-2:].sum() for g in range(moe.n_group)]
        kept = np.argsort(group_score)[::-1][: moe.topk_group]
        masked = np.full(experts, -np.inf)
        for g in kept:
            masked[g * per_group:(g + 1) * per_group] = choice[g * per_group:(g + 1) * per_group]
        top = np.argsort(masked)[::-1][: moe.num_experts_per_tok]
        w = scores[t, top] / scores[t, top].sum() * moe.routed_scaling_factor
        weights.append(w)
        idx.append(top)
    return np.array(weights), np.array(idx)


@pytest.mark.parametrize("groups", [(4, 2), (1, 1)])
def test_router_matches_reference_and_invariants(tiny, groups):
    moe = config.replace(tiny.moe, n_group=groups[0], topk_group=groups[1])
    rng = np.random.default_rng(0)
    scores = jax.nn.sigmoid(rng.normal(size=(64, 16)).astype(np.float32))
    bias = rng.uniform(0, 0.5, size=16).astype(np.float32)
    weights, idx = route(jnp.asarray(scores), jnp.asarray(bias), moe)
    ref_w, ref_idx = _numpy_route(np.asarray(scores), bias, moe)
    order, ref_order = np.argsort(idx, -1), np.argsort(ref_idx, -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1),
                                  np.take_along_axis(ref_idx, ref_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(ref_w, ref_order, -1), rtol=1e-6)
    # Weights come from the unbiased scores and sum to the scaling factor.
    np.testing.assert_allclose(np.asarray(weights).sum(-1), moe.routed_scaling_factor, rtol=1e-6)
    picked = np.take_along_axis(np.asarray(scores), np.asarray(idx), -1)
    np.testing.assert_allclose(np.asarray(weights), picked / picked.sum(-1, keepdims=True) * 2.827, rtol=1e-6)
    # Selection uses the biased scores: a large bias on one expert forces it into every token's top-k.
    forced = np.asarray(route(jnp.asarray(scores), jnp.asarray(bias).at[5].set(10.0), moe)[1])
    assert (forced == 5).any(-1).all()
    if groups[0] > 1:  # every choice lies in the kept groups: at most topk_group distinct groups
        assert max(len(set(row // 4)) for row in np.asarray(idx)) <= groups[1]


def test_bias_update_direction():
    idx = jnp.array([[0, 1], [0, 2], [0, 1]])
    load = expert_load(idx, 4)
    np.testing.assert_array_equal(load, [3, 2, 1, 0])
    new = updated_bias(jnp.zeros(4), load, 0.01)
    np.testing.assert_allclose(new, [-0.01, -0.01, 0.01, 0.01])  # mean load 1.5


def test_yarn_at_full_k25_size():
    k25 = load_config("kimi-k2.5")
    assert rope.yarn_ramp_bounds(k25.rope, 64) == (8, 20)
    assert rope.softmax_scale(k25.mla, k25.rope) == pytest.approx(0.1446796, abs=5e-8)
    assert rope.attention_factor(k25.rope) == 1.0
    inv = rope.inv_frequencies(k25.rope, 64)
    base = 50000.0 ** (-np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(inv[:9], base[:9], rtol=1e-6)          # below the ramp: unchanged
    np.testing.assert_allclose(inv[20:], base[20:] / 64, rtol=1e-6)   # above: divided by the factor
    ramp = (np.arange(32) - 8) / 12
    mid = base * (1 - np.clip(ramp, 0, 1)) + base / 64 * np.clip(ramp, 0, 1)
    np.testing.assert_allclose(inv, mid, rtol=1e-5)
    ds = load_config("deepseek-v3")
    assert rope.yarn_ramp_bounds(ds.rope, 64) == (10, 23)
    assert rope.softmax_scale(ds.mla, ds.rope) == pytest.approx(0.1352338, abs=5e-8)
    tiny = load_config("tiny")
    assert rope.softmax_scale(tiny.mla, tiny.rope) == pytest.approx(24 ** -0.5 * (0.1 * math.log(4) + 1) ** 2)


@pytest.mark.parametrize("backend", ["dense_batched", "ragged", "gather", "blocked",
                                     *(f"{b}/per_expert" for b in ("dense_batched", "gather", "blocked"))])
def test_dispatch_equals_dense_values_and_grads(backend):
    """Every backend against `dense` on stacked weights; '/per_expert': the same weights as per-expert
    arrays (the CPU inference layout), the gradient stacked back for the comparison."""
    rng = np.random.default_rng(1)
    e, d, f, t, k = 8, 12, 10, 40, 3
    x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
    w = dispatch.ExpertWeights(*(jnp.asarray(rng.normal(size=s), jnp.float32) * 0.3
                                 for s in ((e, d, f), (e, d, f), (e, f, d))))
    idx = jnp.asarray(np.stack([rng.choice(e - 2, k, replace=False) for _ in range(t)]), jnp.int32)  # 2 idle
    weights = jnp.asarray(rng.uniform(size=(t, k)), jnp.float32)

    def loss(backend, x, weights, w):
        return jnp.sum(jnp.sin(backend(x, weights, idx, w)))

    name, _, layout = backend.partition("/")
    split = dispatch.split if layout else (lambda w: w)
    assert dispatch.per_expert(split(w)) == bool(layout)
    tested = jax.value_and_grad(lambda x, weights, w: loss(dispatch.BACKENDS[name], x, weights, split(w)),
                                (0, 1, 2))(x, weights, w)
    for i, (a, b) in enumerate(zip(tested,
                                   jax.value_and_grad(lambda *a: loss(dispatch.dense, *a), (0, 1, 2))(x, weights, w))):
        for la, lb in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5, err_msg=f"output {i}")


def test_grouped_swiglu_blocks_and_ragged_dot_match_each_rows_expert(monkeypatch):
    """The CPU block layout and `ragged_dot` (forced by naming another platform) against numpy, row by
    row: empty groups, groups of one block and of several, rows past the groups giving 0; and their
    gradients against each other."""
    rng = np.random.default_rng(3)
    sizes, rows, d, f = [5, 0, 19, 3, 0, 9], 44, 12, 10
    xs = jnp.asarray(rng.normal(size=(rows, d)), jnp.float32)
    w = dispatch.ExpertWeights(*(jnp.asarray(rng.normal(size=s), jnp.float32) * 0.3
                                 for s in ((6, d, f), (6, d, f), (6, f, d))))
    expert_of = np.repeat(np.arange(6), sizes)
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    expected = np.zeros((rows, d), np.float32)
    for r, e in enumerate(expert_of):
        x = np.asarray(xs[r])
        expected[r] = (silu(x @ w.gate[e]) * (x @ w.up[e])) @ w.down[e]
    size_arr = jnp.asarray(sizes, jnp.int32)
    assert dispatch.grouped_block_rows(rows, 6) == 8    # 19 rows: three blocks, two of them padded

    def value_and_grads():
        fn = lambda xs, w: jnp.sum(jnp.sin(dispatch.grouped_swiglu(xs, size_arr, w)))  # noqa: E731
        return dispatch.grouped_swiglu(xs, size_arr, w), jax.grad(fn, (0, 1))(xs, w)

    blocks = value_and_grads()
    monkeypatch.setattr(dispatch, "platform", lambda: "gpu")
    ragged = value_and_grads()
    for out in (blocks[0], ragged[0]):
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(blocks[1]), jax.tree.leaves(ragged[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_packed_documents_equal_separate_runs(tiny):
    model = CausalLM(config.replace(tiny, **{"mtp.num_layers": 0}), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(2)
    doc_a, doc_b = rng.integers(0, 256, 20), rng.integers(0, 256, 28)
    packed = np.concatenate([doc_a, doc_b])[None].astype(np.int32)
    segments = np.array([[1] * 20 + [2] * 28], np.int32)
    logits = nnx.jit(lambda m, t, s: m(t, segment_ids=s))
    together = np.asarray(logits(model, packed, segments))
    alone_a = np.asarray(logits(model, doc_a[None].astype(np.int32), None))
    alone_b = np.asarray(logits(model, doc_b[None].astype(np.int32), None))
    np.testing.assert_allclose(together[0, :20], alone_a[0], atol=1e-5)
    np.testing.assert_allclose(together[0, 20:], alone_b[0], atol=1e-5)  # positions restart per document
    unpacked = np.asarray(logits(model, packed, None))
    assert np.abs(unpacked[0, 20:] - alone_b[0]).max() > 1e-3  # without segments, doc b does see doc a


def test_input_errors(tiny):
    model = CausalLM(tiny, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"token id 300 at position \[1, 2\] is out of range \[0, vocab_size=256\)"):
        model(np.array([[1, 2, 3], [4, 5, 300]], np.int32))
    with pytest.raises(ValueError, match="token id -1"):
        model(np.array([[-1, 2]], np.int32))
    with pytest.raises(ValueError, match="tokens must be int"):
        model(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="exceeds rope.max_position_embeddings=64"):
        model(np.zeros((1, 65), np.int32))
    with pytest.raises(ValueError, match="segment_ids shape"):
        model(np.zeros((1, 8), np.int32), segment_ids=np.zeros((1, 7), np.int32))


def test_parameters_carry_logical_axes_and_matrix_views(tiny):
    model = nnx.eval_shape(lambda: CausalLM(tiny, rngs=nnx.Rngs(0)))
    for path, var in nnx.to_flat_state(nnx.state(model)):
        axes = var.get_metadata("axes")
        assert len(axes) == var.get_value().ndim, path
        if var.has_metadata("reduction"):
            assert set(var.get_metadata("reduction")) | set(var.get_metadata("output")) <= set(axes), path
    experts = model.moe_layers.mlp.gate_proj
    assert experts.get_metadata("axes") == ("layers", "experts", "embed", "moe_mlp")
    assert experts.get_metadata("reduction") == ("embed",) and experts.get_metadata("output") == ("moe_mlp",)
    assert model.moe_layers.attn.q_b_proj.get_metadata("axes") == ("layers", "q_lora", "heads", "qk_head")
    assert not model.embed.embedding.has_metadata("reduction")  # embeddings / head go to AdamW


def test_full_kimi_forward_lowers_abstractly():
    cfg = load_config("kimi-k2.5", ["mtp.num_layers=1"])
    start = time.perf_counter()
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))

    def forward(state, tokens):
        out = nnx.merge(graphdef, state).forward(tokens)
        return out.hidden, out.mtp_hidden

    lowered = jax.jit(forward).lower(state, jax.ShapeDtypeStruct((1, 512), jnp.int32))
    elapsed = time.perf_counter() - start
    hidden, mtp_hidden = lowered.out_info
    assert hidden.shape == (1, 512, 7168) and mtp_hidden.shape == (1, 1, 512, 7168)
    assert elapsed < 120, f"lowering took {elapsed:.1f}s: is the layer stack unrolled?"
    # Dense layers, MoE layers and MTP depths are one scan each, not 62 unrolled layers.
    assert lowered.as_text().count("stablehlo.while") <= 3


def test_prefix_latents_equal_full_context(tiny):
    """Tokens run after a prefix's latents see exactly what they see in one full-context forward,
    with padded prefix slots masked out (the RL teacher's path)."""
    cfg = config.replace(tiny, **{"mtp.num_layers": 0})
    model = CausalLM(cfg, rngs=nnx.Rngs(5))
    rng = np.random.default_rng(4)
    context, new = rng.integers(0, 256, (2, 20)).astype(np.int32), rng.integers(0, 256, (2, 12)).astype(np.int32)

    @nnx.jit
    def run(model, context, new):
        full = model.forward(jnp.concatenate([context, new], axis=1)).hidden[:, 20:]
        cache = model.forward(context, return_latents=True).latents
        # Pad the prefix with 5 garbage slots that must be ignored.
        pad = lambda a: jnp.concatenate([a, jnp.full(a.shape[:2] + (5,) + a.shape[3:], 7.0, a.dtype)], axis=2)
        prefix = cache._replace(c_kv=pad(cache.c_kv), k_rope=pad(cache.k_rope),
                                valid=jnp.concatenate([cache.valid, jnp.zeros((2, 5), bool)], axis=1))
        positions = jnp.broadcast_to(20 + jnp.arange(12, dtype=jnp.int32), new.shape)
        return full, model.forward(new, positions=positions, prefix=prefix).hidden, cache

    full, with_prefix, cache = run(model, context, new)
    assert cache.c_kv.shape == (4, 2, 20, 32) and cache.k_rope.shape == (4, 2, 20, 8)
    np.testing.assert_allclose(np.asarray(with_prefix), np.asarray(full), atol=1e-5)
    with pytest.raises(ValueError, match=r"prefix.c_kv has shape \[4, 2, 20, 31\]"):
        model.forward(new, prefix=cache._replace(c_kv=cache.c_kv[..., :31]))


@pytest.mark.parametrize("placed", [False, True])
def test_unrolled_layers_equal_the_scan(placed):
    """Layers one after another (`layer_loop=unroll`) against the `lax.scan` over the stacks: the same
    loss and gradients, unplaced and on the 8-device dual grid (every stacked leaf sliced on its own
    mesh, the expert weights on the expert grid's)."""
    results = []
    for loop in ("scan", "unroll"):
        cfg = load_config("tiny", [f"layer_loop={loop}"])
        model, rows = random_model(cfg, seed=1), 2
        dual = DualMesh(MeshConfig(), model=cfg) if placed else None
        if placed:
            model, rows = shard_model(model, dual), 8
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 256, (rows, 32)).astype(np.int32)
        segments = (np.arange(32)[None] >= rng.integers(1, 32, (rows, 1))).astype(np.int32)

        def loss(model):
            out = model.forward(tokens, segments)
            return jnp.mean(model.logits(out.hidden) ** 2) + jnp.mean(out.mtp_hidden ** 2)

        with dual if placed else contextlib.nullcontext():
            results.append(nnx.jit(nnx.value_and_grad(loss))(model))
    (scan_loss, scan_grads), (loss, grads) = results
    np.testing.assert_allclose(float(loss), float(scan_loss), rtol=1e-6)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(scan_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-5, atol=1e-7)


def test_layer_loop_rule(monkeypatch):
    """`auto` unrolls on CPU up to MAX_UNROLLED_LAYERS layers without remat, scans elsewhere; an explicit
    setting always wins."""
    assert decoder.unrolls("auto", 3, "none") and decoder.unrolls("auto", decoder.MAX_UNROLLED_LAYERS, "none")
    assert not decoder.unrolls("auto", decoder.MAX_UNROLLED_LAYERS + 1, "none")
    assert not decoder.unrolls("auto", 3, "full") and not decoder.unrolls("auto", 3, "dots")
    assert decoder.unrolls("unroll", 61, "full") and not decoder.unrolls("scan", 1, "none")
    monkeypatch.setattr(decoder, "platform", lambda: "gpu")
    assert not decoder.unrolls("auto", 3, "none") and decoder.unrolls("unroll", 3, "none")

"""QK-clip (MuonClip for MLA): recomputed max logits of clipped heads are at the threshold, unclipped
heads are untouched, the shared rope key and the values are never scaled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.optim.qk_clip import clip_factors, clip_mla, clip_model
from tests.test_muon import random_model


def _between(values, low_rank, high_rank):
    """A threshold between the sorted values at two ranks, so some heads clip and some do not."""
    ordered = np.sort(np.asarray(values).ravel())
    return float(0.5 * (ordered[low_rank] + ordered[high_rank]))


def test_clip_model_stacks_and_mtp():
    """Each stacked layer's heads are clipped with its own row of max_logits (dense layers first, then
    MoE, then the MTP depths): per the Kimi K2 MLA variant, q_nope and k_nope by sqrt(gamma), q_rope by
    gamma, values and the shared rope key untouched; heads at or below tau bit-for-bit unchanged. The
    first layer sees the same input after the clip, so its clipped heads' recomputed max logit is tau
    (later layers' inputs change with the clip) and its other heads' logits are unchanged."""
    model = random_model()
    for stack in (model.dense_layers, model.moe_layers, model.mtp.depths.layer):
        stack.attn.q_b_proj[...] = stack.attn.q_b_proj[...] * 40.0
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    forward = nnx.jit(lambda m, t: m.forward(t))
    out = forward(model, tokens)
    logits, mtp_logits = np.asarray(out.max_logits), np.asarray(out.mtp_stats["max_logits"])
    tau = _between(logits[0], 1, 2)                   # half of the first layer's heads clip
    assert 0 < (logits > tau).sum() < logits.size
    stacks = [(model.dense_layers.attn, logits[:1]), (model.moe_layers.attn, logits[1:]),
              (model.mtp.depths.layer.attn, mtp_logits)]
    before = [(np.asarray(a.q_b_proj[...]), np.asarray(a.kv_b_proj[...])) for a, _ in stacks]
    rope_keys = [np.asarray(a.kv_a_proj[...]) for a, _ in stacks]

    count = clip_model(model, out.max_logits, tau, out.mtp_stats["max_logits"])
    assert int(count) == int((logits > tau).sum() + (mtp_logits > tau).sum())
    for (attn, rows), (q0, kv0) in zip(stacks, before):
        gamma = np.where(rows > tau, tau / rows, 1.0)[:, None, :, None]
        nope = model.cfg.mla.qk_nope_head_dim
        expect_q = np.concatenate([q0[..., :nope] * np.sqrt(gamma), q0[..., nope:] * gamma], axis=-1)
        expect_kv = np.concatenate([kv0[..., :nope] * np.sqrt(gamma), kv0[..., nope:]], axis=-1)
        np.testing.assert_allclose(np.asarray(attn.q_b_proj[...]), expect_q, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(attn.kv_b_proj[...]), expect_kv, rtol=1e-6)
        keep = (rows <= tau)[:, None, :, None]
        np.testing.assert_array_equal(np.where(keep, np.asarray(attn.q_b_proj[...]), 0), np.where(keep, q0, 0))
    for (attn, _), kv_a in zip(stacks, rope_keys):   # the shared rope key (and c_kv) never scaled
        np.testing.assert_array_equal(np.asarray(attn.kv_a_proj[...]), kv_a)
    recomputed = np.asarray(forward(model, tokens).max_logits)
    first = logits[0] > tau
    np.testing.assert_allclose(recomputed[0][first], tau, rtol=1e-5)
    np.testing.assert_array_equal(recomputed[0][~first], logits[0][~first])


def test_sharded_weights_keep_their_sharding():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(0)
    q = jax.device_put(jnp.asarray(rng.standard_normal((2, 16, 4, 12)), jnp.float32),
                       NamedSharding(mesh, P(None, "fsdp", None, None)))
    kv = jax.device_put(jnp.asarray(rng.standard_normal((2, 8, 4, 20)), jnp.float32),
                        NamedSharding(mesh, P(None, "fsdp", None, None)))
    logits = jnp.asarray([[50.0, 150.0, 99.0, 400.0], [100.0, 101.0, 0.0, 250.0]])
    q2, kv2 = jax.jit(lambda q, kv, m: clip_mla(q, kv, m, 100.0, 8))(q, kv, logits)
    assert jax.typeof(q2).sharding.spec == jax.typeof(q).sharding.spec
    assert jax.typeof(kv2).sharding.spec == jax.typeof(kv).sharding.spec
    gamma = np.asarray(clip_factors(logits, 100.0))
    np.testing.assert_allclose(gamma, [[1, 100 / 150, 1, 0.25], [1, 100 / 101, 1, 0.4]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(q2)[..., 8:], np.asarray(q)[..., 8:] * gamma[:, None, :, None], rtol=1e-6)


def test_errors():
    q, kv = jnp.ones((16, 4, 12)), jnp.ones((8, 4, 20))
    with pytest.raises(ValueError, match="threshold must be > 0"):
        clip_mla(q, kv, jnp.ones(4), 0.0, 8)
    with pytest.raises(ValueError, match="heads differ"):
        clip_mla(q, kv, jnp.ones(3), 10.0, 8)
    with pytest.raises(ValueError, match="qk_nope_head_dim"):
        clip_mla(q, kv, jnp.ones(4), 10.0, 12)
    with pytest.raises(ValueError, match="stacked layer axes"):
        clip_mla(q, kv, jnp.ones((2, 4)), 10.0, 8)

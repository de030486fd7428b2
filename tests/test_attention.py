"""Attention implementations (model.attention) against the dense reference: kernels and the whole model
on packed documents, a latent prefix and context parallelism (float32 values and gradients); cuDNN's
packed-offset glue against an independent emulation of its documented semantics (CPU) and the real
kernel (GPU); implementation choice and errors."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import config, load_config
from composer_jax.config import ConfigError, MeshConfig
from composer_jax.model import attention_ops, blockwise, cudnn_attention
from composer_jax.model.attention import load_balanced_order
from composer_jax.model.attention_mask import AttentionMask, causal_mask
from composer_jax.parallel import DualMesh, shard_model
from tests.random_models import random_model

SCALE = 0.3


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 8 queries x 8 keys: short test sequences span many blocks (and skip some)."""
    monkeypatch.setattr(blockwise, "Q_BLOCK", 8)
    monkeypatch.setattr(blockwise, "K_BLOCK", 8)


def _qkv(rng, batch, queries, keys, heads=3, dk=12, dv=8):
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    return normal(batch, queries, heads, dk), normal(batch, keys, heads, dk), normal(batch, keys, heads, dv)


def _packed(batch, seq, rng, docs=3):
    """int32[batch, seq]: `docs` contiguous documents per row, cut at random places."""
    cuts = np.sort(rng.choice(np.arange(1, seq), size=(batch, docs - 1), replace=True), axis=1)
    return jnp.asarray((np.arange(seq)[None, :, None] >= cuts[:, None, :]).sum(-1) + 1, jnp.int32)


def _masks(rng):
    """Masks of every kind the model builds: packed documents, a prefix with hidden slots, and a
    context-parallel shard's queries (chunk order) against every key."""
    b, t = 2, 37
    segments = _packed(b, t, rng)
    order = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    packed = causal_mask(segments, order, segments, order)
    prefix = packed.with_prefix(jnp.asarray(rng.random((b, 11)) < 0.6))
    chunked = jnp.asarray(load_balanced_order(40, 2))[None].repeat(b, 0)
    segments40 = jnp.take_along_axis(_packed(b, 40, rng), chunked, axis=1)
    shard = causal_mask(segments40[:, 20:], chunked[:, 20:], segments40, chunked)   # cp shard 1 of 2
    return {"packed": packed, "prefix": prefix, "cp_shard": shard}


def _loss(attend, q, k, v, w):
    out, max_logits = attend(q, k, v)
    return jnp.sum(out * w), max_logits


@pytest.mark.parametrize("blocks", [(8, 8), (16, 5)])
@pytest.mark.parametrize("kind", ["packed", "prefix", "cp_shard"])
def test_blockwise_kernel_equals_reference(kind, blocks):
    rng = np.random.default_rng(0)
    mask = _masks(rng)[kind]
    q, k, v = _qkv(rng, 2, mask.q_order.shape[1], mask.k_order.shape[1])
    w = jnp.asarray(rng.normal(size=q.shape[:3] + v.shape[-1:]), jnp.float32)
    ref = lambda q, k, v: attention_ops.reference_attention(q, k, v, mask, SCALE)  # noqa: E731
    ours = lambda q, k, v: blockwise.blockwise_attention(q, k, v, mask, SCALE, *blocks)  # noqa: E731
    grad = lambda f: jax.jit(jax.value_and_grad(lambda *a: _loss(f, *a, w), (0, 1, 2), has_aux=True))  # noqa: E731
    (loss, max_logits), grads = grad(ours)(q, k, v)
    (ref_loss, ref_max), ref_grads = grad(ref)(q, k, v)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(max_logits, ref_max, rtol=1e-6)
    for name, a, b in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")
    np.testing.assert_allclose(blockwise.blockwise_max_logits(q, k, mask, SCALE, *blocks), ref_max, rtol=1e-6)


def test_blockwise_skips_blocks_no_query_sees():
    """Under a causal mask the key blocks after a query block are never computed: poisoning them with
    NaN changes nothing (the reference would propagate it through 0 * NaN)."""
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 1, 32, 32)
    order = jnp.arange(32, dtype=jnp.int32)[None]
    mask = causal_mask(jnp.zeros_like(order), order, jnp.zeros_like(order), order)
    clean = blockwise.blockwise_attention(q, k, v, mask, SCALE, 8, 8)[0]
    poisoned_v = v.at[:, 24:].set(jnp.nan)            # the last key block: seen only by the last query block
    out = np.asarray(blockwise.blockwise_attention(q, k, poisoned_v, mask, SCALE, 8, 8)[0])
    np.testing.assert_array_equal(out[:, :24], np.asarray(clean)[:, :24])
    assert np.isnan(out[:, 24:]).all()
    assert np.isnan(np.asarray(attention_ops.reference_attention(q, k, poisoned_v, mask, SCALE)[0])).all()


# ------------------------------------------------------------------------------------------------
# The whole model: blockwise (small blocks) against the reference, values and gradients.


def _pair(overrides=()):
    """(reference model, blockwise model) with the same random weights."""
    cfgs = [load_config("tiny", [f"attention={impl}", *overrides]) for impl in ("reference", "blockwise")]
    return tuple(random_model(cfg, seed=3) for cfg in cfgs)


def _model_loss(model, tokens, segments):
    out = model.forward(tokens, segments)
    loss = jnp.mean(model.logits(out.hidden) ** 2) + jnp.mean(out.mtp_hidden ** 2)
    return loss, (model.logits(out.hidden), out.max_logits)


def _value_and_grads(model, tokens, segments):
    (_, (logits, max_logits)), grads = nnx.value_and_grad(_model_loss, has_aux=True)(model, tokens, segments)
    return logits, max_logits, grads


def _assert_same(ours, ref, rtol=1e-5):
    (logits, max_logits, grads), (ref_logits, ref_max, ref_grads) = ours, ref
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=rtol, atol=1e-5)
    np.testing.assert_allclose(np.asarray(max_logits), np.asarray(ref_max), rtol=rtol, atol=1e-5)
    flat_ref = dict(nnx.to_flat_state(ref_grads))
    for path, g in nnx.to_flat_state(grads):
        a, b = np.asarray(g.get_value()), np.asarray(flat_ref[path].get_value())
        rel = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
        assert rel <= rtol, f"{'/'.join(map(str, path))}: rel. error {rel:.2e}"


def test_model_blockwise_equals_reference_under_context_parallelism(small_blocks):
    """Packed documents under cp=2 (each device: 16 queries in chunk order against all 32 keys, in
    blocks of 8) on 8 fake devices, against the unsharded reference."""
    reference, ours = _pair(["moe.dispatch=ragged"])
    rng = np.random.default_rng(0)
    packed_batch = rng.integers(0, 256, (8, 32)).astype(np.int32), np.asarray(_packed(8, 32, rng))
    expected = nnx.jit(_value_and_grads)(reference, *packed_batch)
    dual = DualMesh(MeshConfig(replica=2, fsdp=2, cp=2, ep=8), model=ours.cfg)
    with dual:
        shard_model(ours, dual)
        got = nnx.jit(_value_and_grads)(ours, *packed_batch)
    _assert_same(got, expected)


def test_model_blockwise_equals_reference_with_a_prefix(small_blocks):
    """Tokens after a latent prefix with padded (hidden) slots: hidden states and the gradients of the
    parameters and of the prefix itself (the RL teacher's and the engine's chunked prefill's path)."""
    reference, ours = _pair(["mtp.num_layers=0"])
    rng = np.random.default_rng(4)
    context, new = rng.integers(0, 256, (2, 20)).astype(np.int32), rng.integers(0, 256, (2, 12)).astype(np.int32)
    cache = nnx.jit(lambda m, t: m.forward(t, return_latents=True).latents)(reference, context)
    pad = lambda a: jnp.concatenate([a, jnp.full(a.shape[:2] + (5,) + a.shape[3:], 7.0, a.dtype)], axis=2)  # noqa: E731
    valid = np.concatenate([rng.random((2, 20)) < 0.8, np.zeros((2, 5), bool)], axis=1)  # 5 garbage slots
    positions = jnp.broadcast_to(20 + jnp.arange(12, dtype=jnp.int32), new.shape)

    @nnx.jit
    def run(model, c_kv, k_rope):
        def loss(model, c_kv, k_rope):
            prefix = cache._replace(c_kv=c_kv, k_rope=k_rope, valid=jnp.asarray(valid))
            hidden = model.forward(new, positions=positions, prefix=prefix).hidden
            return jnp.sum(hidden ** 2), hidden
        (_, hidden), grads = nnx.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(model, c_kv, k_rope)
        return hidden, grads

    (hidden, (grads, d_ckv, d_krope)), (ref_hidden, (ref_grads, ref_ckv, ref_krope)) = (
        run(m, pad(cache.c_kv), pad(cache.k_rope)) for m in (ours, reference))
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(ref_hidden), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(d_ckv), np.asarray(ref_ckv), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(d_krope), np.asarray(ref_krope), rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(d_ckv)[:, ~valid]).max() == 0          # hidden slots get no gradient
    _assert_same((hidden, jnp.zeros(()), grads), (ref_hidden, jnp.zeros(()), ref_grads), rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# cuDNN: the packed-offset glue on CPU against an emulation written from cuDNN's documented THD
# semantics; the real kernel on a GPU (tools/device_check.sh).


def test_segment_runs_match_a_loop():
    rng = np.random.default_rng(5)
    segments = np.array(_packed(4, 23, rng, docs=4))
    segments[1] = 1                                              # one document
    segments[2, -6:] = 0                                         # padding after the documents
    lengths, offsets = map(np.asarray, cudnn_attention.segment_runs(jnp.asarray(segments)))
    assert lengths.shape == (4, 23) and offsets.shape == (4, 24)
    for row, length, offset in zip(segments, lengths, offsets):
        starts = [0] + [i for i in range(1, 23) if row[i] != row[i - 1]]
        runs = np.diff(starts + [23])
        np.testing.assert_array_equal(offset, starts + [-1] * (24 - len(starts)))
        np.testing.assert_array_equal(length, list(runs) + [-1] * (23 - len(runs)))


def _emulated_packed_causal(q, k, v, lengths, offsets, scale):
    """`cudnn_attention._packed_causal` as cuDNN documents its packed (THD) layout: token t of row b
    belongs to segment r when offsets[b, r] <= t < offsets[b, r] + lengths[b, r]; PADDING_CAUSAL
    attends causally within a segment."""
    t = jnp.arange(q.shape[1])[None, :, None]
    inside = (offsets[:, None, :-1] <= t) & (t < offsets[:, None, :-1] + lengths[:, None, :]) & (lengths[:, None] > 0)
    segment = jnp.where(inside.any(-1), jnp.argmax(inside, -1), -1)
    visible = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0) & jnp.tril(
        jnp.ones((q.shape[1], k.shape[1]), bool))
    scores = jnp.where(visible[:, None], jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)


def test_cudnn_glue_equals_reference_with_emulated_kernel(monkeypatch):
    monkeypatch.setattr(cudnn_attention, "_packed_causal", _emulated_packed_causal)
    rng = np.random.default_rng(6)
    mask = _masks(rng)["packed"]
    q, k, v = _qkv(rng, 2, 37, 37)
    out, max_logits = jax.jit(lambda q, k, v: cudnn_attention.attention(q, k, v, mask, SCALE))(q, k, v)
    ref, ref_max = attention_ops.reference_attention(q, k, v, mask, SCALE)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(max_logits, ref_max, rtol=1e-6)


@pytest.mark.gpu
def test_cudnn_equals_blockwise_and_reference_on_gpu():
    """bf16 on an H100/H200-class GPU: cuDNN's packed causal attention against blockwise and the dense
    reference (same bf16 inputs): outputs, max logits and gradients, MLA head dims (192 / 128)."""
    rng = np.random.default_rng(7)
    segments = _packed(2, 512, rng, docs=4)
    order = jnp.broadcast_to(jnp.arange(512, dtype=jnp.int32), (2, 512))
    mask = causal_mask(segments, order, segments, order)
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(rng, 2, 512, 512, heads=4, dk=192, dv=128))
    assert not cudnn_attention.unsupported(q, v, prefix=False, cp=1)
    w = jnp.asarray(rng.normal(size=(2, 512, 4, 128)), jnp.bfloat16)
    results = {}
    for impl in ("cudnn", "blockwise", "reference"):
        f = lambda q, k, v, impl=impl: attention_ops.attention(impl, q, k, v, mask, 192 ** -0.5)  # noqa: E731
        results[impl] = jax.jit(jax.value_and_grad(lambda *a: _loss(f, *a, w), (0, 1, 2), has_aux=True))(q, k, v)
    (loss, max_logits), grads = results["cudnn"]
    for other in ("blockwise", "reference"):
        (ref_loss, ref_max), ref_grads = results[other]
        assert abs(float(loss) - float(ref_loss)) <= 2e-2 * abs(float(ref_loss)) + 1.0, other
        np.testing.assert_allclose(np.asarray(max_logits), np.asarray(ref_max), rtol=2e-2, err_msg=other)
        for name, a, b in zip("qkv", grads, ref_grads):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.abs(a - b).max() <= 5e-2 * np.abs(b).max(), f"d{name} vs {other}"


@pytest.mark.gpu
def test_auto_picks_cudnn_for_bf16_training_on_gpu():
    cfg = load_config("tiny", ["dtype=bfloat16"])
    q = jnp.zeros((1, 64, 4, cfg.mla.qk_head_dim), jnp.bfloat16)
    v = jnp.zeros((1, 64, 4, cfg.mla.v_head_dim), jnp.bfloat16)
    order = jnp.arange(64, dtype=jnp.int32)[None]
    mask = causal_mask(jnp.zeros_like(order), order, jnp.zeros_like(order), order)
    assert attention_ops.choose("auto", q, v, mask, cp=1) == "cudnn"
    assert attention_ops.choose("auto", q, v, mask.with_prefix(jnp.ones((1, 4), bool)), cp=1) != "cudnn"


# ------------------------------------------------------------------------------------------------
# Choice and errors.


def test_auto_choice_and_errors_on_cpu():
    order = jnp.arange(4096, dtype=jnp.int32)[None]
    long = causal_mask(jnp.zeros_like(order), order, jnp.zeros_like(order), order)
    short = AttentionMask(*(x[:, :64] for x in long[:4]))
    q, v = jnp.zeros((1, 64, 4, 24), jnp.bfloat16), jnp.zeros((1, 64, 4, 24), jnp.bfloat16)
    assert attention_ops.choose("auto", q, v, short, cp=1) == "reference"
    assert attention_ops.choose("auto", q, v, long, cp=1) == "blockwise"
    with pytest.raises(ValueError, match=r"model.attention='cudnn' cannot run here: it needs an NVIDIA GPU"):
        attention_ops.choose("cudnn", q, v, short, cp=1)
    with pytest.raises(ConfigError, match=r"config key 'attention': cudnn attention runs in bfloat16"):
        load_config("tiny", ["attention=cudnn"])
    with pytest.raises(ConfigError, match=r"config key 'attention': expected one of 'auto', 'reference'.*"
                                          r"did you mean 'blockwise'"):
        load_config("tiny", ["attention=blockwize"])
    assert config.replace(load_config("tiny"), attention="blockwise").attention == "blockwise"

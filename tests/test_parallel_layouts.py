"""A tiny-model training step on 8 fake devices equals the single-device step, for each dual-grid layout."""

import jax
import numpy as np
import pytest
from flax import nnx

from composer_jax import CausalLM, load_config
from composer_jax.config import MeshConfig
from composer_jax.model.router import updated_bias
from composer_jax.parallel import DualMesh, shard_model
from tests.reference_losses import cross_entropy, mtp_loss, shift_left

# dense (replica, fsdp, cp) / expert (ereplica, ep), as in the issue
LAYOUTS = {"1x8x1/1x8": (1, 8, 1, 1, 8), "1x4x2/1x8": (1, 4, 2, 1, 8),
           "2x4x1/2x4": (2, 4, 1, 2, 4), "2x2x2/1x8": (2, 2, 2, 1, 8)}


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (8, 32)).astype(np.int32)
    # Packed documents of different lengths per row; 32 > original_max_position_embeddings (YaRN on).
    cuts = rng.integers(4, 28, 8)
    segments = (np.arange(32)[None] >= cuts[:, None]).astype(np.int32) + 1
    return tokens, segments


def _loss(model, tokens, segments):
    out = model.forward(tokens, segments)
    mask = shift_left(segments, 1, -1) == segments
    loss = cross_entropy(model.logits(out.hidden), shift_left(tokens, 1), mask)
    loss += mtp_loss(model.logits, out.mtp_hidden, tokens, model.cfg.mtp.loss_weight, segments)
    return loss, out


def _step(model, tokens, segments):
    (loss, out), grads = nnx.value_and_grad(_loss, has_aux=True)(model, tokens, segments)
    bias = updated_bias(model.moe_layers.mlp.router.bias[...], out.expert_load, model.cfg.moe.bias_update_rate)
    return loss, grads, out.expert_load, out.dropped, bias


@pytest.fixture(scope="module")
def reference():
    model = CausalLM(load_config("tiny"), rngs=nnx.Rngs(0))
    return jax.tree.map(np.asarray, nnx.jit(_step)(model, *_batch()))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_step_equals_single_device(reference, layout):
    replica, fsdp, cp, ereplica, ep = LAYOUTS[layout]
    cfg = load_config("tiny", ["moe.dispatch=ep_a2a", "moe.capacity_factor=0"])
    dual = DualMesh(MeshConfig(replica=replica, fsdp=fsdp, cp=cp, ereplica=ereplica, ep=ep), model=cfg)
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    with dual:
        shard_model(model, dual)
        loss, grads, load, dropped, bias = nnx.jit(_step)(model, *_batch())
    ref_loss, ref_grads, ref_load, _, ref_bias = reference
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    assert int(np.asarray(dropped).sum()) == 0
    np.testing.assert_array_equal(np.asarray(load), ref_load)     # router statistics under sharding
    np.testing.assert_array_equal(np.asarray(bias), ref_bias)     # and the bias update they drive
    flat_ref = dict(nnx.to_flat_state(ref_grads))
    for path, g in nnx.to_flat_state(grads):
        ours, ref = np.asarray(g.get_value()), np.asarray(flat_ref[path].get_value())
        rel = np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30)
        assert rel <= 1e-5, f"{'/'.join(map(str, path))}: rel. error {rel:.2e}"
    # Gradients come back sharded like the parameters, on their own grid.
    expert_grad = grads["moe_layers"]["mlp"]["gate_proj"].get_value()
    assert expert_grad.sharding.mesh.axis_names == ("ereplica", "efsdp", "ep")


def test_context_parallel_attention_equals_unsharded():
    """CP=2 logits, MTP hidden states and max logits equal the unsharded (CP=1) model's, with packed
    segments and YaRN positions."""
    cfg = load_config("tiny", ["moe.dispatch=ragged"])
    model = CausalLM(cfg, rngs=nnx.Rngs(1))
    tokens, segments = _batch()

    def run(model, tokens, segments):
        out = model.forward(tokens, segments)
        return model.logits(out.hidden), out.mtp_hidden, out.max_logits

    plain = jax.tree.map(np.asarray, nnx.jit(run)(model, tokens, segments))
    dual = DualMesh(MeshConfig(replica=2, fsdp=2, cp=2, ep=8), model=cfg)
    with dual:
        sharded = shard_model(nnx.clone(model), dual)
        context_parallel = jax.tree.map(np.asarray, nnx.jit(run)(sharded, tokens, segments))
    for ours, ref in zip(context_parallel, plain):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


def test_moving_tokens_between_the_grids_adds_no_collective():
    """Two rows per device with cp=2 (1x4x2/1x8) and a dispatch that only gathers the experts' weights
    (`dense` on the expert grid): the compiled training step has no all-to-all and no collective-permute.
    Each device's tokens go to the expert grid and back where they are; flattening the batch
    batch-major exchanged them with an all-to-all each way, in every MoE layer."""
    from composer_jax.plan import gpu_compile, hlo
    from composer_jax.train import step as step_lib
    from composer_jax.train.config import load_run_config
    from composer_jax.train.loop import make_mesh

    cfg = load_run_config("pretrain-tiny", ["model.moe.dispatch=dense", "mesh.fsdp=4", "mesh.cp=2", "mesh.ep=8",
                                            "train.batch_size=8", "train.seq_len=32"])
    dual = make_mesh(cfg)
    assert cfg.train.batch_size // dual.sizes["fsdp"] == 2 and dual.sizes["cp"] == 2
    summary = hlo.summarize(step_lib.lower_train_step(cfg, dual).compile().as_text(), dual.dense.size,
                            gpu_compile.grids(dual))
    assert summary.total("all-gather").count > 0, summary.collectives     # the experts' weights, gathered
    assert summary.total("all-to-all").count == summary.total("collective-permute").count == 0, summary.collectives

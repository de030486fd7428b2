"""Quantization-aware training of the routed experts (`model.moe.expert_quant=int4`).

The reference quantizer is compressed-tensors' symmetric INT4 group quantization, written here in torch
from its published code (quantization/utils/helpers.py `calculate_qparams`: scale = max(|min|, |max|) /
((q_max - q_min) / 2), at least float32's eps; then round and clamp to [-8, 7]), packed by
tests/test_quant.py's `pack_to_int32`; the scale is stored in bfloat16 as K2.5's `weight_scale` is. The
model with INT4 experts must compute exactly what the plain model computes on the weights a checkpoint of
those experts decodes to (the INT4 policy), with the gradient passing straight through to the float weights.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax import CausalLM, load_config
from composer_jax.checkpoint.quant import dequant_int4, quantize_int4
from composer_jax.config import ConfigError, MeshConfig
from composer_jax.model.moe import MoE
from composer_jax.model.quant import fake_quant_int4
from composer_jax.parallel import DualMesh, shard_model
from tests.test_quant import pack_to_int32

GROUP = 32


def compressed_tensors_int4(w: np.ndarray, group: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
    """float32 [out, in] -> (int32 [out, in / 8] packed, bfloat16 [out, in / group] scales)."""
    x = torch.from_numpy(w).reshape(w.shape[0], -1, group)
    min_vals = torch.minimum(x.amin(-1), torch.zeros(()))
    max_vals = torch.maximum(x.amax(-1), torch.zeros(()))
    q_min, q_max = -8.0, 7.0
    scales = torch.maximum(min_vals.abs(), max_vals.abs()) / ((q_max - q_min) / 2)
    scales = torch.clamp(scales, min=torch.finfo(torch.float32).eps).to(torch.bfloat16)
    q = torch.clamp(torch.round(x / scales.float()[..., None]), q_min, q_max)
    values = q.reshape(w.shape).to(torch.int8).numpy()
    return pack_to_int32(values), scales.float().numpy().astype(ml_dtypes.bfloat16)


def _weights(shape, seed=0) -> np.ndarray:
    """Expert-like values over several magnitudes, with a group of zeros and groups whose largest
    magnitude is negative (they use the nibble of -8)."""
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    w *= np.logspace(-3, 0, shape[-1], dtype=np.float32)
    w[..., :GROUP, 0] = 0.0
    w[..., GROUP:2 * GROUP, 1] = -np.abs(w[..., GROUP:2 * GROUP, 1])
    return w


def _int4_roundtrip(stack: np.ndarray) -> np.ndarray:
    """[..., in, out] expert matrices -> their values after a K2.5 checkpoint round trip ([out, in] storage)."""
    flat = stack.reshape(-1, *stack.shape[-2:])
    n = stack.shape[-2]
    out = [dequant_int4(*quantize_int4(m.T, GROUP), n, GROUP).T for m in flat]
    return np.stack(out).reshape(stack.shape)


def test_quantizer_is_compressed_tensors_symmetric_int4():
    w = _weights((96, 48)).T.copy()                        # [out, in]
    packed, scale = quantize_int4(w, GROUP)
    ref_packed, ref_scale = compressed_tensors_int4(w)
    np.testing.assert_array_equal(scale.view(np.uint16), ref_scale.view(np.uint16))
    np.testing.assert_array_equal(packed, ref_packed)
    nibbles = (packed[..., None] >> (4 * np.arange(8))) & 0xF
    assert (nibbles == 0).any(), "no group's largest magnitude reached -8"


def test_fake_quant_is_the_checkpoint_round_trip_on_the_expert_grid_with_a_straight_through_gradient():
    """On 4 experts over ep=4 with the inputs' (embed) axis split over efsdp=2: the same sharding out, the
    values of the checkpoint round trip, and d(sum(c * fake_quant(w)))/dw = c."""
    w = _weights((4, 96, 48))
    dual = DualMesh(MeshConfig(fsdp=8, ereplica=1, efsdp=2, ep=4))
    sharding = NamedSharding(dual.expert, P("ep", "efsdp", None))
    placed = jax.device_put(w, sharding)
    c = np.random.default_rng(1).standard_normal(w.shape).astype(np.float32)
    with dual.expert_scope():
        quantized, grad = jax.jit(lambda x: (fake_quant_int4(x), jax.grad(
            lambda y: jnp.sum(fake_quant_int4(y) * c))(x)))(placed)
    assert quantized.sharding.is_equivalent_to(sharding, w.ndim)
    np.testing.assert_array_equal(np.asarray(quantized), _int4_roundtrip(w))
    np.testing.assert_array_equal(np.asarray(grad), c)


def _replace_experts(model: nnx.Module, fn) -> None:
    for _, node in nnx.iter_graph(model):
        if isinstance(node, MoE):
            for var in (node.gate_proj, node.up_proj, node.down_proj):
                var.set_value(jnp.asarray(fn(np.asarray(var.get_value()))))


def _loss(model, tokens):
    logits = model(tokens)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


@pytest.mark.slow
def test_int4_experts_compute_the_model_of_their_dequantized_weights():
    """The tiny model (MoE layers and an MoE MTP depth) with expert_quant=int4 against the same parameters
    with expert_quant=none and every routed expert replaced by its checkpoint round trip: the same
    logits and loss, and the same gradient (straight through to the float experts); the INT4 model on
    the expert grid (ep_a2a, efsdp=2) gives those logits too."""
    cfg = load_config("tiny", ["moe.expert_quant=int4"])
    plain = load_config("tiny")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 32)).astype(np.int32)
    int4 = CausalLM(cfg, rngs=nnx.Rngs(0))
    reference = CausalLM(plain, rngs=nnx.Rngs(0))
    _replace_experts(reference, _int4_roundtrip)
    grad = nnx.jit(nnx.value_and_grad(_loss))
    (loss, grads), (ref_loss, ref_grads) = grad(int4, tokens), grad(reference, tokens)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads))[0],
                            jax.tree.leaves(nnx.to_pure_dict(ref_grads))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-7, err_msg=str(path))
    forward = nnx.jit(lambda m, t: m(t))
    ref_logits = np.asarray(forward(reference, tokens))
    # The comparisons discriminate: the float experts' logits differ beyond their tolerance.
    assert not np.allclose(np.asarray(forward(CausalLM(plain, rngs=nnx.Rngs(0)), tokens)), ref_logits,
                           rtol=2e-5, atol=2e-5)

    expert_grid = load_config("tiny", ["moe.expert_quant=int4", "moe.dispatch=ep_a2a", "moe.capacity_factor=0"])
    dual = DualMesh(MeshConfig(fsdp=8, ereplica=1, efsdp=2, ep=4), model=expert_grid)
    sharded = shard_model(CausalLM(expert_grid, rngs=nnx.Rngs(0)), dual)
    with dual:
        logits = forward(sharded, tokens)
    np.testing.assert_allclose(np.asarray(logits), ref_logits, rtol=2e-5, atol=2e-5)


def test_int4_experts_need_widths_of_whole_groups():
    with pytest.raises(ConfigError, match="hidden_size.*multiple of 32, got 48"):
        load_config("tiny", ["moe.expert_quant=int4", "hidden_size=48"])

"""Memory of the compiled training step (`memory_analysis()` of the real jitted step, tiny model, one
device, batch 1): linear in the sequence with blockwise attention where the dense reference grows
quadratically; per-layer remat keeps the values and lowers it; a 16K-token sequence trains on CPU."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import load_config
from composer_jax.config import MeshConfig
from composer_jax.parallel import DualMesh, shard_model
from composer_jax.train import step as step_lib
from composer_jax.train.config import RunConfig, TrainConfig
from composer_jax.train.state import StateLayout
from tests.random_models import random_model

LENGTHS = (1024, 2048, 4096)
RUN_OPTIMIZATION = {"xla_backend_optimization_level": 2}


def _cfg(seq: int, attention: str, remat: str = "none", extra: tuple[str, ...] = ()) -> RunConfig:
    model = load_config("tiny", [f"attention={attention}", f"rope.max_position_embeddings={max(seq, 64)}", *extra])
    return RunConfig(model=model, mesh=MeshConfig(fsdp=1, ep=1),
                     train=TrainConfig(batch_size=1, seq_len=seq, remat=remat, progress=False))


def _one_device() -> DualMesh:
    return DualMesh(MeshConfig(fsdp=1, ep=1), jax.devices()[:1])


def _temp_bytes(cfg: RunConfig) -> int:
    return int(step_lib.lower_train_step(cfg, _one_device()).compile().memory_analysis().temp_size_in_bytes)


# Measured on all-dense layers: XLA:CPU lowers `ragged_dot` to a dense product over every expert, whose
# [experts, tokens x k, embed] temporaries (live within one layer, untouched by remat) would otherwise
# dominate the tiny MoE's temp memory.
DENSE_LAYERS = ("num_dense_layers=4",)


@pytest.fixture(scope="module")
def temps():
    """{(attention or remat policy, seq): compiled temp bytes of the training step} (6 compiles: the
    longest blockwise step is also remat 'none')."""
    out = {("blockwise", seq): _temp_bytes(_cfg(seq, "blockwise", extra=DENSE_LAYERS)) for seq in LENGTHS}
    out[("reference", LENGTHS[-1])] = _temp_bytes(_cfg(LENGTHS[-1], "reference", extra=DENSE_LAYERS))
    out[("none", LENGTHS[-1])] = out[("blockwise", LENGTHS[-1])]
    for policy in ("dots", "full"):
        out[(policy, LENGTHS[-1])] = _temp_bytes(_cfg(LENGTHS[-1], "blockwise", policy, DENSE_LAYERS))
    return out


def _second_difference_ratio(temps, impl) -> float:
    """(t(4K) - t(2K)) / (t(2K) - t(1K)): 2 for memory linear in the length, 4 for quadratic."""
    t = [temps[(impl, seq)] for seq in LENGTHS]
    return (t[2] - t[1]) / (t[1] - t[0])


@pytest.mark.slow
def test_training_step_temp_memory_is_linear_in_sequence_length(temps):
    blockwise = _second_difference_ratio(temps, "blockwise")
    assert blockwise <= 2.2, f"blockwise temp memory grows superlinearly: ratio {blockwise:.2f}, {temps}"
    # the dense reference's f32 [heads, 4K, 4K] scores alone are 256 MiB per layer
    assert temps[("blockwise", 4096)] * 2 < temps[("reference", 4096)], temps


@pytest.mark.slow
def test_per_layer_remat_lowers_temp_memory(temps):
    none, dots, full = (temps[(policy, LENGTHS[-1])] for policy in ("none", "dots", "full"))
    assert full < dots < none, f"remat none {none}, dots {dots}, full {full}"
    assert full < 0.6 * none


@pytest.mark.slow
@pytest.mark.parametrize("attention, dual", [("reference", False), ("blockwise", False), ("blockwise", True)])
def test_per_layer_remat_keeps_loss_and_gradients(attention, dual):
    """Unplaced, and on the 8-device dual grid with the one-hot dispatch under the expert mesh's shard_map
    (whose values 'dots' does not keep: JAX would check them against the dense mesh and fail)."""
    cfg = load_config("tiny", [f"attention={attention}", *(["moe.dispatch=dense"] if dual else [])])
    model = random_model(cfg, seed=1)
    rows = 2
    if dual:
        dual = DualMesh(MeshConfig(), model=cfg)
        model, rows = shard_model(model, dual), 8
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (rows, 48)).astype(np.int32)
    segments = (np.arange(48)[None] >= rng.integers(1, 48, (rows, 1))).astype(np.int32)

    @nnx.jit(static_argnames="remat")
    def run(model, remat):
        def loss(model):
            out = model.forward(tokens, segments, remat=remat)
            return jnp.mean(model.logits(out.hidden) ** 2) + jnp.mean(out.mtp_hidden ** 2)
        return nnx.value_and_grad(loss)(model)

    context = dual if dual else contextlib.nullcontext()
    with context:
        plain_loss, plain_grads = run(model, "none")
    for policy in ("dots", "full"):
        with context:
            loss, grads = run(model, policy)
        np.testing.assert_allclose(float(loss), float(plain_loss), rtol=1e-6)
        for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-5, atol=1e-7)
    with context, pytest.raises(ValueError, match="remat='partial': expected 'none' or one of dots, full"):
        run(model, "partial")


@pytest.mark.slow
def test_16k_token_sequence_trains_on_cpu():
    """One optimizer step over one 16384-token row of two packed documents (auto attention: blockwise
    at this length): a finite loss near ln(vocab) at initialisation and updated parameters. Two decoder
    layers (one dense, one MoE) and the MTP layer: each attends over the whole row, and the step's run time
    grows with their number."""
    seq = 16384
    cfg = _cfg(seq, "auto", extra=("num_layers=2",))
    dual = _one_device()
    layout = StateLayout(cfg, dual)
    with dual:
        step = jax.jit(step_lib.make_train_step(cfg, layout.graphdef, layout.rest, layout.opt))
        state = layout.fresh()
        before = np.asarray(state.params["moe_layers"]["attn"]["q_b_proj"].get_value())
        rng = np.random.default_rng(0)
        segments = (np.arange(seq) >= 5000).astype(np.int32)
        batch = {"tokens": rng.integers(0, 256, (1, 1, seq)).astype(np.int32),
                 "segment_ids": segments[None, None],
                 "positions": (np.arange(seq) - np.where(segments, 5000, 0)).astype(np.int32)[None, None],
                 "loss_mask": np.ones((1, 1, seq), np.int32)}
        # Optimised as in a run (the suite compiles at -O0, tests/conftest.py): this step's run time dominates.
        state, metrics = step.lower(state, batch).compile(RUN_OPTIMIZATION)(state, batch)
        ce = float(metrics["ce"])
    assert np.isfinite(float(metrics["loss"])) and abs(ce - np.log(256)) < 0.5, ce
    assert bool(metrics["finite"]) and float(metrics["grad_norm"]) > 0
    after = np.asarray(state.params["moe_layers"]["attn"]["q_b_proj"].get_value())
    assert np.abs(after - before).max() > 0

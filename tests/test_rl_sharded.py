"""The fused RL step on 8 fake devices over the dual grid equals the single-device step."""

from dataclasses import replace

import jax
import numpy as np
import pytest
from flax import nnx

from composer_jax import CausalLM, load_config
from composer_jax.config import MeshConfig
from composer_jax.parallel import DualMesh, shard_model
from composer_jax.rl import RLConfig, RLStep, loss_and_grads, synthetic_batch
from composer_jax.rl.config import rl_optimizer
from tests.rl_helpers import adam_first_moment

G = 2
CFG = RLConfig(group_size=G, kl_coef=0.1, entropy_coef=0.01, sd_coef=0.5, optimizer=replace(rl_optimizer(), lr=1e-3))


def _batch():
    # 16 rows and 16 feedback windows: two micro-batches of 8, one row and one window per data-parallel
    # shard each; groups interleaved, so each spans both micro-batches.
    batch = synthetic_batch(3, batch=16, seq=32, vocab_size=256, group_size=G, slots=1, window=12, hint_len=3,
                            with_ref=True)
    return batch._replace(group_ids=(np.arange(16) % 8).astype(np.int32))


def _run(model, cfg):
    """(grads, Adam's first moment, metrics, new state) of one step, as numpy."""
    rl_step = RLStep(model, cfg)
    state = rl_step.init_state(model)
    batch = _batch()
    (_, _), grads = jax.jit(lambda s, b: loss_and_grads(rl_step.graphdef, rl_step.rest, s, b, cfg))(state, batch)
    new_state, metrics = rl_step(state, batch)
    as_numpy = lambda tree: jax.tree.map(np.asarray, tree)
    return (as_numpy(grads), as_numpy(adam_first_moment(new_state.opt_state)),
            jax.tree.map(float, metrics), new_state)


def _worst(ours, ref):
    """The largest per-leaf max|ours - ref| / max|ref| and its path."""
    flat_ref = dict(nnx.to_flat_state(ref))
    worst = (0.0, "")
    for path, leaf in nnx.to_flat_state(ours):
        a, b = np.asarray(leaf.get_value()), np.asarray(flat_ref[path].get_value())
        rel = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
        worst = max(worst, (rel, "/".join(map(str, path))))
    return worst


@pytest.mark.slow
def test_sharded_rl_step_equals_single_device():
    """Dense (replica=2, fsdp=4) x expert (ereplica=2, ep=4) with the all-to-all expert dispatch and two
    micro-batches, against one device with ragged dispatch and the whole batch at once: every metric,
    the gradients, and the clipped gradient the optimizer applied (Adam's first moment after one step).

    (Adam's first update itself, g / (|g| + eps), is sign(g) where |g| >> eps: float32 summation-order
    noise in near-zero gradient entries flips it whatever the sharding, so the updated parameters agree
    only to ~lr and are not compared.)"""
    cfg = load_config("tiny", ["moe.dispatch=ep_a2a", "moe.capacity_factor=0"])
    dual = DualMesh(MeshConfig(replica=2, fsdp=4, cp=1, ereplica=2, ep=4), model=cfg)
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    with dual:
        shard_model(model, dual)
        grads, mu, metrics, state = _run(model, replace(CFG, micro_batch=8))
    ref_grads, ref_mu, ref_metrics, _ = _run(CausalLM(load_config("tiny", ["moe.dispatch=ragged"]), rngs=nnx.Rngs(0)),
                                             CFG)
    assert metrics["sd_tokens"] > 0 and metrics["finite"] == 1 and metrics["loss_mtp"] > 0
    # The loss is a sum of terms that partly cancel: its error is relative to the terms' magnitudes.
    loss_scale = sum(abs(v) for k, v in ref_metrics.items() if k.startswith("loss_"))
    for name, ref in ref_metrics.items():
        scale = max(abs(ref), loss_scale if name.startswith("loss") else 1e-6)
        assert abs(metrics[name] - ref) <= 1e-5 * scale, (name, metrics[name], ref)
    for what, ours, ref in (("gradients", grads, ref_grads), ("Adam first moment", mu, ref_mu)):
        rel, path = _worst(ours, ref)
        print(f"{what}: worst rel. error {rel:.2e} ({path})")
        assert rel <= 1e-5, (what, path, rel)
    # The state stays on its grids: expert weights on the expert mesh, dense ones on the dense mesh.
    assert state.params["moe_layers"]["mlp"]["gate_proj"].get_value().sharding.mesh.axis_names == dual.expert.axis_names
    assert state.params["lm_head"].get_value().sharding.mesh.axis_names == dual.dense.axis_names

"""The training optimizer's weight-decay rule: matrices (parameters with reduction / output metadata)
are decayed, norm scales (also stacked [layers, dim]), embedding, head and router bias are not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import CausalLM, load_config
from composer_jax.train.config import OptimizerConfig
from composer_jax.train.optimizer import decay_mask, make_optimizer
from composer_jax.tree_paths import path_str


def _params(name):
    return nnx.state(nnx.eval_shape(lambda: CausalLM(load_config(name), rngs=nnx.Rngs(0))), nnx.Param)


@pytest.mark.parametrize("name", ["tiny", "kimi-k2.5"])
def test_decay_mask_follows_the_matrix_metadata(name):
    params = _params(name)
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    decayed = dict(zip((path_str(p) for p, _ in flat), decay_mask(params)))
    norms = [p for p in decayed if p.endswith("norm/scale")]
    assert len(norms) >= 8 and not any(decayed[p] for p in norms)
    stacked_norms = [p for (p, v) in ((path_str(p), v) for p, v in flat) if p.endswith("norm/scale") and v.ndim == 2]
    assert stacked_norms  # [layers, dim]: what an ndim >= 2 rule decayed by mistake
    assert not decayed["embed/embedding"] and not decayed["lm_head"]
    for path in ("moe_layers/attn/q_b_proj", "moe_layers/attn/kv_b_proj", "moe_layers/mlp/gate_proj",
                 "moe_layers/mlp/router/kernel", "dense_layers/mlp/down_proj"):
        assert decayed[path], path
    # Independent count: Muon's matrices are exactly the leaves that declare a matrix view.
    assert sum(decayed.values()) == sum(v.has_metadata("reduction") for _, v in flat)


def test_adamw_decays_only_matrices():
    """With a zero gradient AdamW's update is exactly -lr * wd * p on matrices and 0 elsewhere."""
    model = CausalLM(load_config("tiny"), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    cfg = OptimizerConfig(lr=0.1, warmup_steps=0, decay_fraction=0.0, weight_decay=0.5)
    opt = make_optimizer(cfg, total_steps=10, params=params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(opt.tx.update)(zeros, jax.jit(opt.tx.init)(params), params)
    flat_p = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    flat_u = jax.tree.leaves(updates, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for (path, var), upd in zip(flat_p, flat_u):
        p, u = np.asarray(var.get_value()), np.asarray(upd.get_value())
        expected = -0.1 * 0.5 * p if var.has_metadata("reduction") else np.zeros_like(p)
        np.testing.assert_allclose(u, expected, rtol=1e-6, atol=1e-12, err_msg=path_str(path))

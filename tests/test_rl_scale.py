"""The RL step at scale on the tiny model: micro-batch accumulation equals the whole-batch step; the
normalisers ignore padding; the MTP self-distillation term trains the MTP depths only and equals
pretraining's term; rows go onto the data axes."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import CausalLM, load_config
from composer_jax.config import ConfigError, MeshConfig
from composer_jax.model.layers import weight
from composer_jax.parallel import DualMesh
from composer_jax.rl import BatchError, RLConfig, RLStep, loss_and_grads, synthetic_batch
from composer_jax.rl.config import rl_optimizer
from composer_jax.rl.ingest import device_batch
from composer_jax.train import losses as lm_losses
from composer_jax.train.state import split_model
from composer_jax.tree_paths import path_keys, path_str
from tests.rl_helpers import adam_first_moment

G = 2
# eps = 1: Adam's first update lr * g / (|g| + eps) is smooth in g (with eps ~ 0 it is sign(g), which
# float32 noise flips on near-zero entries); lr = 1 keeps it well above the rounding of params + update;
# no clipping, so Adam's first moment is (1 - b1) x the gradient.
CFG = RLConfig(group_size=G, kl_coef=0.1, kl_estimator="k2_loss", entropy_coef=0.01, sd_coef=0.5, loss_chunk=8,
               mtp_distill_weight=0.3, optimizer=replace(rl_optimizer(), lr=1.0, eps=1.0, max_grad_norm=0.0))


@pytest.fixture(scope="module")
def model():
    return CausalLM(load_config("tiny"), rngs=nnx.Rngs(0))


def _batch(seed=0, rows=4):
    """Groups interleaved across the rows (0, 1, 0, 1): every group spans both micro-batches of 2 rows."""
    batch = synthetic_batch(seed, batch=rows, seq=32, vocab_size=256, group_size=G, slots=2, window=12,
                            hint_len=3, with_ref=True)
    rewards = np.random.default_rng(seed).random(rows).astype(np.float32)
    return batch._replace(group_ids=(np.arange(rows) % (rows // G)).astype(np.int32), rewards=rewards)


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _worst(ours, ref):
    """(largest leafwise relative difference, its path) of two params-shaped trees."""
    flat = jax.tree_util.tree_flatten_with_path(ref)[0]
    return max((_rel(a, b), path_str(path)) for a, (path, b) in zip(jax.tree.leaves(ours), flat, strict=True))


def _assert_metrics_equal(ours: dict, ref: dict):
    assert set(ours) == set(ref)
    # The loss is a sum of terms that partly cancel: its error is relative to the terms' magnitudes.
    loss_scale = sum(abs(v) for k, v in ref.items() if k.startswith("loss_"))
    for name, value in ref.items():
        scale = max(abs(value), loss_scale if name.startswith("loss") else 1e-6)
        assert abs(ours[name] - value) <= 1e-5 * scale, (name, ours[name], value)


@pytest.mark.slow
def test_micro_batches_equal_the_whole_batch_step(model):
    """Two micro-batches of 2 rows (each group split between them, micro-batches with different token
    and flagged-turn counts) give the whole batch's loss, metrics, gradient and update."""
    batch = _batch()
    runs = {}
    for micro in (0, 2):
        rl_step = RLStep(model, replace(CFG, micro_batch=micro))
        state = jax.tree.map(jnp.copy, rl_step.init_state(model))   # the step donates its state
        before = jax.tree.map(np.array, state.params)                # the same in both runs
        new_state, metrics = rl_step(state, batch)
        runs[micro] = (jax.tree.map(float, metrics), jax.tree.map(np.asarray, adam_first_moment(new_state.opt_state)),
                       jax.tree.map(np.asarray, new_state.params))
    (metrics, mu, params), (ref_metrics, ref_mu, ref_params) = runs[2], runs[0]
    assert {"loss_pg", "loss_kl", "loss_entropy", "loss_sd", "loss_mtp"} <= set(ref_metrics)
    _assert_metrics_equal(metrics, ref_metrics)
    rel, path = _worst(mu, ref_mu)
    assert rel <= 1e-5, ("gradient (Adam's first moment)", path, rel)
    # The updates agree to 1e-5 of their size, plus the float32 rounding of params + update.
    largest = 0.0
    for (path, new), ref, old in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params),
                                     jax.tree.leaves(before), strict=True):
        update, ref_update = new - old, ref - old
        tol = 1e-5 * np.abs(ref_update).max() + 2 * np.spacing(np.abs(old).max())
        assert np.abs(update - ref_update).max() <= tol, path_str(path)
        largest = max(largest, float(np.abs(ref_update).max()))
    assert largest > 1e-3                                             # >> the rounding of params + update


def _pad(batch, seq):
    """The batch with right padding up to `seq` slots (the rows' content unchanged)."""
    def pad(x):
        return None if x is None else np.pad(np.asarray(x), ((0, 0), (0, seq - x.shape[1])))
    fields = ("tokens", "positions", "segment_ids", "generated", "behaviour_logprobs", "ref_logprobs")
    return batch._replace(**{f: pad(getattr(batch, f)) for f in fields})


def test_padding_leaves_loss_and_gradient_unchanged(model):
    """The normalisers come from the config and the generated tokens, not the padded length: 8 more
    padding slots leave every term and the gradient as they were (max_tokens = 0: the token mean)."""
    batch = _batch(seed=1)
    padded = _pad(batch, 40)
    rl_step = RLStep(model, CFG)
    state, graphdef, rest = rl_step.init_state(model), rl_step.graphdef, rl_step.rest
    run = jax.jit(lambda st, b: loss_and_grads(graphdef, rest, st, b, CFG))
    (_, ref_metrics), ref_grads = run(state, batch)
    (_, metrics), grads = run(state, padded)
    _assert_metrics_equal(jax.tree.map(float, metrics), jax.tree.map(float, ref_metrics))
    rel, path = _worst(grads, ref_grads)
    assert rel <= 1e-5, (path, rel)


def test_mtp_distillation_trains_the_depths_only_and_equals_pretraining_term(model):
    """With the RL terms at zero (equal rewards in every group, no KL, entropy or feedback) the loss is
    the MTP term alone: it equals pretraining's distillation term on the same tokens with the generated
    ones as targets, and its gradient is zero on every parameter but the MTP depths'."""
    beta = 0.3
    batch = _batch(seed=2)._replace(rewards=np.ones(4, np.float32), teacher_tokens=None, teacher_map=None)
    cfg = RLConfig(group_size=G, mtp_distill_weight=beta, loss_chunk=8)
    graphdef, params, biases, rest = split_model(model)
    state = RLStep(model, cfg).init_state(model)
    (loss, metrics), grads = jax.jit(lambda st, b: loss_and_grads(graphdef, rest, st, b, cfg))(state, batch)

    @jax.jit
    def pretraining_term(params):
        m = nnx.merge(graphdef, params, biases, rest)
        tokens, segments = jnp.asarray(batch.tokens), jnp.asarray(batch.segment_ids)
        targets = jnp.asarray(batch.generated)
        out = m.forward(tokens, segments, jnp.asarray(batch.positions))
        sums = lm_losses.lm_loss_sums(out.hidden, out.mtp_hidden, weight(m.lm_head, out.hidden.dtype), tokens,
                                      segments, targets, chunk=8, distill=True)
        n_main, n_mtp = lm_losses.count_targets(tokens, segments, targets, m.cfg.mtp.num_layers)
        return (lm_losses.combine(sums, n_main, n_mtp, mtp_weight=0.0, distill_weight=beta)
                - lm_losses.combine(sums, n_main, n_mtp, mtp_weight=0.0, distill_weight=0.0))

    expected = float(pretraining_term(params))
    assert expected > 1e-3
    assert float(metrics["loss_mtp"]) == pytest.approx(expected, rel=1e-5)
    assert float(loss) == pytest.approx(expected, rel=1e-5)          # the policy-gradient term is 0
    moved, still = [], []
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        (moved if path_keys(path)[0] == "mtp" else still).append((path_str(path), float(jnp.abs(g).max())))
    assert all(g == 0.0 for _, g in still), [p for p, g in still if g != 0.0]
    assert max(g for _, g in moved) > 1e-4 and "lm_head" in {p.split("/")[0] for p, _ in still}


def test_rows_go_onto_the_data_axes():
    """This process's rows become global arrays sharded over (replica, fsdp); rows that do not split
    over the data-parallel shards are a one-line error."""
    dual = DualMesh(MeshConfig(replica=2, fsdp=4, cp=1, ereplica=2, ep=4))
    batch = synthetic_batch(0, batch=8, seq=16, vocab_size=256, group_size=G, slots=1, window=8)
    placed = device_batch(batch, dual)
    assert placed.ref_logprobs is None
    for name in ("tokens", "generated", "rewards", "teacher_map"):
        x = getattr(placed, name)
        assert x.sharding.spec[0] == ("replica", "fsdp") and x.sharding.mesh.axis_names == dual.dense.axis_names
        np.testing.assert_array_equal(np.asarray(x), getattr(batch, name))
    with pytest.raises(BatchError, match=r"6 rows do not split evenly over the 8 data-parallel shards"):
        device_batch(synthetic_batch(0, batch=6, seq=16, vocab_size=256, group_size=G), dual)


def test_micro_batch_that_does_not_divide_the_rows_or_the_data_shards():
    rl_step = RLStep(nnx.eval_shape(lambda: CausalLM(load_config("tiny"), rngs=nnx.Rngs(0))),
                     RLConfig(group_size=G, micro_batch=3))
    with pytest.raises(ConfigError, match=r"config key 'micro_batch': 4 rows per step are not a whole number"):
        rl_step.validate(_batch())
    dual = DualMesh(MeshConfig(replica=2, fsdp=4, cp=1, ereplica=2, ep=4))
    sharded = nnx.eval_shape(lambda: CausalLM(load_config("tiny"), rngs=nnx.Rngs(0), mesh=dual))
    rl_step = RLStep(sharded, RLConfig(group_size=G, micro_batch=4))
    with pytest.raises(ConfigError, match=r"'micro_batch': micro-batches of 4 rows do not split over the 8 "):
        rl_step.validate(_batch(rows=16))

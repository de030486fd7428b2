"""The pretrain / SFT step and eval step (jitted by the caller; the state is `train.state.TrainState`).

One step (jitted; the state is donated; no host synchronisation inside):
1. global target counts of the whole step, so micro-batch losses sum to the step mean;
2. a `lax.scan` over `grad_accum` micro-batches accumulating `value_and_grad` of
   `losses.combine(lm_loss_sums(...))`, each layer optionally rematerialised (`train.remat`, applied
   per layer inside the model's scanned stacks);
3. `update.apply_gradients`: the global gradient norm over both meshes' leaves, a finite guard (if the
   loss or the gradient norm is not finite, params, optimizer state and router biases stay as they
   were and `skipped` counts the step), clipping and the optimizer update;
4. the router correction-bias update `b <- b + rate * sign(mean(load) - load)` from the step's summed
   expert loads (main MoE layers and MTP depths), outside the optimizer.
Every leafwise op runs on its leaf's mesh (`parallel.leafwise`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.data.pipeline import FEATURES
from composer_jax.model.router import updated_bias
from composer_jax.parallel import DualMesh, leafwise
from composer_jax.parallel.mesh import BATCH_AXES
from composer_jax.parallel.partitioning import gather_whole
from composer_jax.train import losses
from composer_jax.train.accumulate import accumulate
from composer_jax.train.config import RunConfig
from composer_jax.train.optimizer import Optimizer
from composer_jax.train.state import StateLayout, TrainState
from composer_jax.train.update import apply_gradients

Batch = dict  # FEATURES -> int32[grad_accum, micro_batch, seq] (train) or [batch, seq] (eval)


def _forward_sums(cfg: RunConfig, graphdef, rest, params, biases, mb: Batch, distill: bool):
    """Loss sums and expert loads of one micro-batch ([batch, seq] arrays)."""
    model = nnx.merge(graphdef, params, biases, rest)
    out = model.forward(mb["tokens"], mb["segment_ids"], mb["positions"], remat=cfg.train.remat)
    head = model.head(out.hidden.dtype)  # gathered whole if FSDP-sharded
    sums = losses.lm_loss_sums(out.hidden, out.mtp_hidden, head, mb["tokens"], mb["segment_ids"],
                               mb["loss_mask"], chunk=cfg.train.loss_chunk, distill=distill)
    mtp_stats = out.mtp_stats or {}
    loads = {"moe_layers": out.expert_load}
    dropped = jnp.sum(out.dropped).astype(jnp.float32)
    if "expert_load" in mtp_stats:
        loads["mtp"] = mtp_stats["expert_load"]
        dropped += jnp.sum(mtp_stats["dropped"]).astype(jnp.float32)
    return sums, loads, dropped


def gather_batch(batch: Batch) -> Batch:
    """The batch whole on every device (it arrives sharded by process over the data axes); the model
    then places tokens on the dense grid itself."""
    return jax.tree.map(gather_whole, batch)


def update_biases(biases: nnx.State, loads: dict, rate: float) -> nnx.State:
    """Apply `updated_bias` to each RouterBias leaf with the load of its stack (by top-level module)."""
    def one(path, bias):
        return updated_bias(bias, loads[path[0].key], rate)

    return jax.tree_util.tree_map_with_path(one, biases)


def make_train_step(cfg: RunConfig, graphdef, rest,
                    opt: Optimizer) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """The (un-jitted) step: (state, batch [accum, micro, seq]) -> (state, metrics of f32/int32 scalars)."""
    mcfg, tcfg = cfg.model, cfg.train
    depths = mcfg.mtp.num_layers

    def loss_fn(params, biases, mb, n_main, n_mtp):
        sums, loads, dropped = _forward_sums(cfg, graphdef, rest, params, biases, mb, tcfg.mtp_distill_weight > 0)
        loss = losses.combine(sums, n_main, n_mtp, mcfg.mtp.loss_weight, tcfg.mtp_distill_weight)
        return loss, (sums, loads, dropped)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state: TrainState, batch: Batch):
        batch = gather_batch(batch)
        n_main, n_mtp = losses.count_targets(batch["tokens"], batch["segment_ids"], batch["loss_mask"], depths)

        ((loss, (sums, loads, dropped)), grads) = accumulate(
            lambda mb: grad_fn(state.params, state.biases, mb, n_main, n_mtp), batch)

        new = apply_gradients(opt, state.params, state.opt_state, grads, loss, cfg.optimizer.max_grad_norm)
        finite = new.finite
        biases = leafwise.where(finite, update_biases(state.biases, loads, mcfg.moe.bias_update_rate), state.biases)
        new_state = TrainState(state.step + 1, new.params, biases, new.opt_state,
                               state.skipped + (~finite).astype(jnp.int32))
        main_load = loads["moe_layers"]
        metrics = {
            "loss": loss,
            "ce": sums.ce / jnp.maximum(n_main, 1.0),
            "grad_norm": new.grad_norm,
            "lr": opt.schedule(state.step),
            "finite": finite,
            "skipped": new_state.skipped,
            "target_tokens": n_main,
        }
        if main_load.shape[0]:
            metrics["expert_load_max_over_mean"] = jnp.mean(main_load.max(-1) / jnp.maximum(main_load.mean(-1), 1e-9))
            # Expert assignments dropped by the dispatch's capacity (moe.capacity_factor), of all made.
            assigned = sum(jnp.sum(load) for load in loads.values())
            metrics["moe_dropped_fraction"] = dropped / jnp.maximum(assigned, 1.0)
        for k in range(depths):
            metrics[f"mtp{k + 1}_ce"] = sums.mtp_ce[k] / jnp.maximum(n_mtp[k], 1.0)
            metrics[f"mtp{k + 1}_kl"] = sums.mtp_kl[k] / jnp.maximum(n_mtp[k], 1.0)
            if tcfg.mtp_distill_weight > 0:     # speculative sampling's expected acceptance of depth k's draft
                metrics[f"mtp{k + 1}_acceptance"] = sums.mtp_accept[k] / jnp.maximum(n_mtp[k], 1.0)
        return new_state, metrics

    return step


def make_eval_step(cfg: RunConfig, graphdef, rest, token_bytes=None) -> Callable[[TrainState, Batch], dict]:
    """(state, batch [batch, seq]) -> sums {ce, targets, mtp{k}_ce, mtp{k}_targets} (held-out loss parts),
    and `bytes` (the text the targets stand for) when `token_bytes` (int[vocab], the tokenizer's) is given."""
    depths = cfg.model.mtp.num_layers

    def eval_step(state: TrainState, batch: Batch) -> dict:
        batch = gather_batch(batch)
        sums, _, _ = _forward_sums(cfg, graphdef, rest, state.params, state.biases, batch, distill=False)
        n_main, n_mtp = losses.count_targets(batch["tokens"], batch["segment_ids"], batch["loss_mask"], depths)
        out = {"ce": sums.ce, "targets": n_main}
        if token_bytes is not None:
            out["bytes"] = losses.count_target_bytes(batch["tokens"], batch["segment_ids"], batch["loss_mask"],
                                                     jnp.asarray(token_bytes, jnp.int32))
        for k in range(depths):
            out[f"mtp{k + 1}_ce"], out[f"mtp{k + 1}_targets"] = sums.mtp_ce[k], n_mtp[k]
        return out

    return eval_step


def lower_train_step(cfg: RunConfig, dual: DualMesh) -> jax.stages.Lowered:
    """The jitted, donated training step of `cfg` on `dual`, lowered for shape-only state and batch
    (nothing is allocated): `.compile().memory_analysis()` gives its per-device memory."""
    layout = StateLayout(cfg, dual)
    tc = cfg.train
    shape = (tc.grad_accum, tc.batch_size // tc.grad_accum, tc.seq_len)
    batch_sharding = NamedSharding(dual.dense, P(None, BATCH_AXES))
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding) for k in FEATURES}
    with dual:
        step = jax.jit(make_train_step(cfg, layout.graphdef, layout.rest, layout.opt), donate_argnums=0)
        return step.lower(layout.abstract, batch)

"""The per-device memory plan of the fused RL step (composer_jax/rl/objective.py): one student forward
and backward over the trajectories, and one stop-gradient teacher forward over the feedback windows.

Phases (the peak is the largest, on top of the state and the batch):
- teacher: the student's kept tensors, every layer's latents (returned for the prefix teacher), those
  latents repeated once per feedback slot (the teacher's prefix), and one teacher layer's forward over
  `slots` windows of `window` tokens attending to [prefix + window] keys (no gradient: nothing kept);
- backward: the student's kept tensors, the gradients, the largest layer backward or the chunked
  losses' working set (the policy gradient's blocks with the windows' self-distillation blocks and the
  teacher's FFN forward beside them);
- update: the gradients and the optimizer's working set.
The step takes no context parallelism with a prefix teacher (`rl.teacher_context="prefix"`).
"""

from __future__ import annotations

from composer_jax.config import ConfigError
from composer_jax.plan import activations as act
from composer_jax.plan.memory import (
    MemoryPlan,
    layer_stacks,
    layout_sizes,
    optimizer_working,
    resolve_settings,
    stacked,
)
from composer_jax.plan.state import param_leaves, state_bytes
from composer_jax.rl.config import RLConfig
from composer_jax.train.config import RunConfig

F32 = act.F32


def plan_rl(cfg: RunConfig, rl: RLConfig, devices: int, *, rows: int, seq: int, slots: int, window: int,
            attention: str | None = None, grouped_matmul: str | None = None, platform: str = "gpu") -> MemoryPlan:
    """Per-device memory of one RL step on `rows` trajectories of `seq` tokens with `slots` feedback
    windows of `window` tokens per row (`slots=0`: no self-distillation), on `cfg`'s model and layout,
    with `rl`'s optimizer, micro-batches and remat policy (the student keeps what a training step keeps
    under it)."""
    model = cfg.model
    sizes = layout_sizes(cfg, devices)
    if sizes["cp"] > 1 and slots and rl.teacher_context == "prefix":
        raise ConfigError("mesh.cp", "the RL step's prefix teacher runs without context parallelism: set mesh.cp=1")
    # one implementation for the student and the teacher: the one the prefix teacher can run
    prefix = bool(slots) and rl.teacher_context == "prefix"
    attention, grouped_matmul, settings = resolve_settings(cfg, attention, grouped_matmul, rl.optimizer.name,
                                                           platform, seq + window if slots else seq, sizes["cp"],
                                                           prefix)
    dt = 4 if model.dtype == "float32" else 2
    leaves = param_leaves(model, sizes)
    count = rl.micro_batches(rows)
    state = state_bytes(leaves, rl.optimizer.name, count)
    s = act.tokens_per_device(rows // count, seq, sizes)       # one micro-batch's rows
    dense_layers, moe_layers = model.num_dense_layers, model.num_moe_layers  # the RL step runs no MTP
    layers = layer_stacks(model, s, (dense_layers, moe_layers), attention=attention, remat=rl.remat,
                          grouped_matmul=grouped_matmul, platform=platform)
    kept = stacked(layers)
    kept.update(act.global_saved(model, s, attention))
    latent = model.mla.kv_lora_rank + model.mla.qk_rope_head_dim
    phases = {"backward": {"largest layer backward": max(layer.working for _, layer in layers)}}
    n = s.rows * slots                                  # feedback windows per device
    if slots:
        kept["student latents"] = model.num_layers * s.tokens * latent * dt
        teacher = act.Shapes(rows=n, queries=window, keys=seq + window, ep=s.ep, fsdp=s.fsdp, efsdp=s.efsdp)
        t_layer = act.layer_memory(model, teacher, moe_layers > 0, attention=attention, remat="none",
                                   factor=model.moe.capacity_factor, grouped_matmul=grouped_matmul)
        phases["teacher"] = {"teacher prefix (latents per slot)": model.num_layers * n * seq * latent * dt,
                             "teacher layer forward": t_layer.saved_total}
    loss = act.loss_working(model, s, rl.loss_chunk, seq, act.rl_loss_blocks(rl.entropy_coef > 0))
    if slots:
        # The windows' self-distillation blocks beside the policy-gradient loss (XLA computes the two
        # together), and the teacher's forward beside that loss's backward (XLA's live ranges at the peak
        # of the tiny RL step built for 2 x 8 H100s, docs/planning.md).
        loss += (act.SD_LOSS_BLOCKS * n * min(rl.loss_chunk, window) * model.vocab_size * F32
                 + 2 * n * window * model.hidden_size * dt
                 + act.ffn_forward_working(model, teacher, moe_layers > 0, model.moe.capacity_factor, grouped_matmul))
    phases["backward"]["chunked loss" + (" and the windows' logits" if slots else "")] = loss
    batch = rows * seq * 4 * (6 if rl.kl_coef else 5) + rows * slots * window * 8
    kept_total = sum(kept.values())
    candidates = {"backward": kept_total + state.gradients + max(phases["backward"].values()),
                  "update": state.gradients + optimizer_working(leaves, rl.optimizer)}
    if "teacher" in phases:
        candidates["teacher"] = kept_total + sum(phases["teacher"].values())
    phase = max(candidates, key=candidates.get)
    if phase == "update":
        activations, temporaries = {}, {"optimizer update": optimizer_working(leaves, rl.optimizer)}
    elif phase == "teacher":
        activations, temporaries = kept, phases["teacher"]
    else:
        worst = max(phases["backward"], key=phases["backward"].get)
        activations, temporaries = kept, {worst: phases["backward"][worst]}
    gradients = state.gradients if phase != "teacher" else 0
    return MemoryPlan("rl", devices, sizes, seq, state.params, state.biases, state.optimizer, gradients, batch,
                      sum(activations.values()), sum(temporaries.values()), act.dispatch_bytes(model, s),
                      {"activations": activations, "temporaries": temporaries}, dict(settings, phase=phase),
                      candidates)


"""The per-device memory plan of a training step: state (exact) + the analytic activation model, for
any device count and layout, without devices.

The step's peak is its arguments (the state and the batch; the state is donated, so the updated
state reuses its buffers) plus the larger of two phases:
- backward: the gradients being built, every layer's kept tensors (stacked over the scanned layers,
  all alive until the backward ends), tensors kept once per forward, the gathered batch, and the
  largest working set of one layer's backward or of the chunked loss (with MTP depths, the loss
  and the depth's forward, which XLA runs side by side);
- update: the gradients and the optimizer's working set (AdamW: one parameter-sized update; Muon:
  its Newton-Schulz stacks in `optimizer.ns_dtype`, about three copies of the momentum matrices).
"""

from __future__ import annotations

import dataclasses

from composer_jax.config import ConfigError, ModelConfig
from composer_jax.model.decoder import unrolls
from composer_jax.parallel.mesh import check_model, resolve_sizes
from composer_jax.plan import activations as act
from composer_jax.plan.state import param_leaves, state_bytes
from composer_jax.train.config import OptimizerConfig, RunConfig

GB = 1e9


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one step on one layout; `where` names the tensors behind each total."""

    step: str                         # 'train' or 'rl'
    devices: int
    sizes: dict[str, int]             # mesh axis sizes
    seq: int
    params: int
    biases: int
    optimizer: int
    gradients: int
    batch: int
    activations: int                  # kept for the backward (all layers)
    temporaries: int                  # the larger phase's working set
    dispatch: int                     # expert exchange buffers of one MoE layer (inside temporaries)
    where: dict[str, dict[str, int]]  # {'activations': {tensor: bytes}, 'temporaries': {...}}
    settings: dict[str, str]          # attention, remat, dispatch, grouped matmul, optimizer, platform, phase
    phases: dict[str, int]            # each phase's bytes beyond the state and the batch (the peak: the largest)

    @property
    def state(self) -> int:
        return self.params + self.biases + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.gradients + self.batch + self.activations + self.temporaries

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["total"] = self.total
        return out


def resolve_settings(cfg: RunConfig, attention: str | None, grouped_matmul: str | None, optimizer: str,
                     platform: str, keys: int, cp: int, prefix: bool = False):
    """(the attention implementation that runs, the grouped matmul, the settings a plan reports).
    `attention` overrides `model.attention`; 'auto' resolves for `platform`
    (`activations.planned_attention`), and so does a grouped matmul of None."""
    attention = act.planned_attention(cfg.model, attention or cfg.model.attention, platform, keys, cp, prefix)
    grouped_matmul = act.planned_grouped_matmul(platform, grouped_matmul)
    return attention, grouped_matmul, {"attention": attention, "remat": cfg.train.remat, "dispatch": cfg.model.moe.dispatch,
                       "capacity_factor": str(cfg.model.moe.capacity_factor), "grouped_matmul": grouped_matmul,
                       "optimizer": optimizer, "platform": platform}


def layout_sizes(cfg: RunConfig, devices: int) -> dict[str, int]:
    sizes = resolve_sizes(cfg.mesh, devices, cfg.model.moe.n_routed_experts)
    check_model(sizes, cfg.model)
    return sizes


def optimizer_working(leaves, opt: OptimizerConfig) -> int:
    """The update's working set (module docstring)."""
    if opt.name == "muon":
        ns = 4 if opt.ns_dtype == "float32" else 2
        return sum(3 * x.bytes // x.itemsize * ns for x in leaves if x.trainable and x.muon_matrix)
    return sum(x.bytes for x in leaves if x.trainable)


def layer_stacks(model: ModelConfig, s: act.Shapes, counts: tuple[int, int], *, attention: str, remat: str,
                 grouped_matmul: str, platform: str) -> list:
    """[(count, LayerMemory)] of the dense and the MoE stack (`counts`: their layers), each scanned or
    unrolled as `model.layer_loop` runs it on `platform` (`decoder.unrolls`)."""
    return [(count, act.layer_memory(model, s, moe, attention=attention, remat=remat,
                                     factor=model.moe.capacity_factor, grouped_matmul=grouped_matmul,
                                     stacked=not unrolls(model.layer_loop, count, remat, platform)))
            for count, moe in zip(counts, (False, True)) if count]


def stacked(layers) -> dict[str, int]:
    """Kept tensors of all layers by name: [(count, LayerMemory)] -> {name: bytes}."""
    kept: dict[str, int] = {}
    for count, layer in layers:
        for name, size in layer.saved.items():
            kept[name] = kept.get(name, 0) + count * size
    return kept


def plan_train(cfg: RunConfig, devices: int, *, seq: int | None = None, attention: str | None = None,
               grouped_matmul: str | None = None, platform: str = "gpu") -> MemoryPlan:
    """The training step's per-device memory on `devices` devices laid out by `cfg.mesh`; `seq`
    overrides `train.seq_len` (rows per device stay `train.batch_size / grad_accum` over the data
    axes); `attention` overrides `model.attention`."""
    model, train = cfg.model, cfg.train
    sizes = layout_sizes(cfg, devices)
    seq = train.seq_len if seq is None else seq
    if sizes["cp"] > 1 and seq % (2 * sizes["cp"]):
        raise ConfigError("mesh.cp", f"cp={sizes['cp']} needs a sequence length divisible by {2 * sizes['cp']}, "
                                     f"got {seq}")
    attention, grouped_matmul, settings = resolve_settings(cfg, attention, grouped_matmul, cfg.optimizer.name,
                                                           platform, seq, sizes["cp"])
    leaves = param_leaves(model, sizes)
    state = state_bytes(leaves, cfg.optimizer.name, train.grad_accum)
    micro = train.batch_size // train.grad_accum
    s = act.tokens_per_device(micro, seq, sizes)
    dense_layers, moe_layers = act.num_layers(model)
    layers = layer_stacks(model, s, (dense_layers, moe_layers), attention=attention, remat=train.remat,
                          grouped_matmul=grouped_matmul, platform=platform)
    kept = stacked(layers)
    kept.update(act.global_saved(model, s, attention))
    # the batch argument (four int32 features, sharded over the data axes) and its copy gathered whole
    data = sizes["replica"] * sizes["fsdp"]
    batch = 4 * 4 * train.batch_size * seq * (1 + 1 / data)
    mtp = model.mtp.num_layers > 0
    blocks = act.train_loss_blocks(4 if model.dtype == "float32" else 2, mtp, mtp and train.mtp_distill_weight > 0)
    loss = act.loss_working(model, s, train.loss_chunk, seq, blocks)
    if mtp:   # the main loss's backward needs only its forward: XLA runs it beside the first depth's forward
        loss += act.ffn_forward_working(model, s, moe_layers > 0, model.moe.capacity_factor, grouped_matmul)
    backward = {"largest layer backward": max(layer.working for _, layer in layers),
                "chunked loss" + (" beside the MTP depth's forward" if mtp else ""): loss,
                "embedding table and gradient": act.embedding_working(model, s)}
    worst = max(backward, key=backward.get)
    update = optimizer_working(leaves, cfg.optimizer)
    phases = {"backward": state.gradients + sum(kept.values()) + backward[worst], "update": state.gradients + update}
    if phases["update"] >= phases["backward"]:
        phase, activations, temporaries = "update", {}, {"optimizer update": update}
    else:
        phase, activations, temporaries = "backward", kept, {worst: backward[worst]}
    return MemoryPlan("train", devices, sizes, seq, state.params, state.biases, state.optimizer, state.gradients,
                      int(batch), sum(activations.values()), sum(temporaries.values()), act.dispatch_bytes(model, s),
                      {"activations": activations, "temporaries": temporaries}, dict(settings, phase=phase), phases)

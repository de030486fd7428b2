"""An estimate of a training step's time on a layout, for ranking layouts (docs/planning.md states the
formula): compute at the device's FLOP/s plus the bytes each collective moves per device over the link it
crosses, with no overlap between them (an upper bound that XLA's latency-hiding scheduler undercuts).

- Compute: the model's training FLOPs per token (`model.accounting`: 6 x active matmul parameters plus
  causal attention) x the step's tokens / devices; the routed experts' share x the experts each device
  runs through XLA's expanded `ragged_dot` (a dense dot over a masked [experts, rows, width] copy;
  x 1 with a grouped-matmul kernel or CPU's blocks, whose padding is not counted); remat `full` adds the forward again (x 4/3), `dots` the attention's
  forward (its scores are not saved); Muon's Newton-Schulz FLOPs / devices at the bf16 or float32 rate.
- Collectives, per device: FSDP gathers each layer's dense weights (compute dtype) in the forward and,
  under remat, again in the backward, and reduce-scatters their gradients (parameter dtype), per
  micro-batch; `replica` all-reduces the dense gradients once a step; the routed experts likewise over
  `efsdp` (and over the whole expert grid with the replicated-experts `ragged` dispatch) and `ereplica`;
  the expert-parallel dispatch sends its exchange buffers there and back in the forward, the backward and
  a recomputed forward; context parallelism gathers each layer's compressed KV latent and reduce-scatters
  its gradient; Muon moves the sharded matrix stacks to whole matrices and back (`ns_dtype`).
  A fraction (n-1)/n of a group's buffer crosses links; a group whose devices span more than one node
  moves at the inter-node bandwidth, else at the intra-node one.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from composer_jax.config import ModelConfig
from composer_jax.model.accounting import model_info
from composer_jax.model.expert_parallel import dispatch_rows
from composer_jax.parallel.mesh import DENSE_AXES, EXPERT_AXES
from composer_jax.plan import activations as act
from composer_jax.plan.memory import MemoryPlan
from composer_jax.plan.muon import ns_share
from composer_jax.plan.state import param_leaves
from composer_jax.train.config import RunConfig


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A device and its links. Rates are per device and per direction."""

    name: str
    hbm_gb: float              # memory per device
    flops: float               # dense bf16 FLOP/s
    flops_f32: float           # dense float32 matmul FLOP/s (TF32 on NVIDIA GPUs, JAX's default precision there)
    intra_bw: float            # bytes/s within a node (NVLink)
    inter_bw: float            # bytes/s between nodes (the device's network interface)
    devices_per_node: int = 8


# NVIDIA datasheets (H100 SXM5, H200 SXM: 989 TFLOP/s dense BF16 (1,979 with sparsity), 495 dense TF32,
# NVLink 4 at 900 GB/s both directions = 450 GB/s each way; 80 GB / 141 GB HBM) and the DGX H100 / H200
# user guides (one 400 Gb/s ConnectX-7 InfiniBand port per GPU = 50 GB/s); shared/reference/muon.md
# section 5 uses the same 450 and 50 GB/s, shared/reference/performance.md the same 989 TFLOP/s.
PRESETS = {
    "h100": Hardware("H100 SXM", 80.0, 989e12, 494.5e12, 450e9, 50e9),
    "h200": Hardware("H200 SXM", 141.0, 989e12, 494.5e12, 450e9, 50e9),
}


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one step: compute and each collective's (its bytes per device over its link)."""

    compute_s: float
    comm_s: dict[str, float]         # collective -> seconds
    comm_bytes: dict[str, float]     # collective -> bytes received per device

    @property
    def total_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values())


def _architecture(model: ModelConfig) -> ModelConfig:
    """`model` less how it runs (the dispatch): the key of what depends on the parameters alone."""
    return dataclasses.replace(model, moe=dataclasses.replace(model.moe, dispatch="ragged"))


@functools.lru_cache(maxsize=64)
def _flops_per_token(model: ModelConfig, seq: int) -> tuple[int, int, int]:
    """(training FLOPs per token, of which the routed experts', of which the attention's)."""
    flops = model_info(model, seq).flops
    _, moe_layers = act.num_layers(model)
    m = model.moe
    experts = 6 * 3 * model.hidden_size * m.moe_intermediate_size * m.num_experts_per_tok * moe_layers
    return flops.total, experts, flops.attention + flops.mtp_attention


@functools.lru_cache(maxsize=64)
def _ns_total(model: ModelConfig) -> int:
    """Muon's Newton-Schulz FLOPs of one step (the same on every layout)."""
    sizes = {a: 1 for a in (*DENSE_AXES, *EXPERT_AXES)}
    return ns_share(model, sizes).total


def span(sizes: dict[str, int], axes: tuple[str, ...], group: tuple[str, ...]) -> int:
    """Devices a collective over `group` (consecutive axes of mesh `axes`) spans in the flat device order:
    the group's size times the sizes of the axes inside it (row-major: the last axis is innermost)."""
    inner = axes[axes.index(group[-1]) + 1:]
    size = 1
    for a in (*group, *inner):
        size *= sizes[a]
    return size


def compute_seconds(cfg: RunConfig, plan: MemoryPlan, hw: Hardware, grouped_matmul: str) -> float:
    """The compute term (module docstring)."""
    model, train, sizes = cfg.model, cfg.train, plan.sizes
    total, experts, attention = _flops_per_token(_architecture(model), plan.seq)
    dispatch = model.moe.dispatch
    local = model.moe.n_routed_experts // (1 if dispatch in ("ragged", "dense") else sizes["ep"])
    flops = total + experts * ((local if grouped_matmul == "expanded" else 1) - 1)   # blocked: ~ its padding
    flops += {"none": 0, "dots": attention / 3, "full": flops / 3}[train.remat]
    seconds = flops * train.batch_size * plan.seq / plan.devices / hw.flops
    if cfg.optimizer.name == "muon":
        rate = hw.flops if cfg.optimizer.ns_dtype == "bfloat16" else hw.flops_f32
        seconds += _ns_total(_architecture(model)) / plan.devices / rate
    return seconds


def collective_bytes(cfg: RunConfig, plan: MemoryPlan) -> dict[str, tuple[float, tuple[str, ...]]]:
    """{collective: (bytes received per device per step, the mesh axes it runs over)} (module docstring)."""
    model, train, sizes = cfg.model, cfg.train, plan.sizes
    dt = 4 if model.dtype == "float32" else 2
    ns = 4 if cfg.optimizer.ns_dtype == "float32" else 2
    whole, elems, muon = _weights(_architecture(model), tuple(sizes.items()))
    passes = (2 if train.remat != "none" else 1) * train.grad_accum      # weight gathers a step
    out: dict[str, tuple[float, tuple[str, ...]]] = {}

    def add(name, n, axes, size_of_group):
        if size_of_group > 1 and n:
            out[name] = (n * (size_of_group - 1) / size_of_group, axes)

    f, r = sizes["fsdp"], sizes["replica"]
    add("fsdp weight all-gather", passes * elems["dense"] * dt, ("fsdp",), f)
    add("fsdp gradient reduce-scatter", train.grad_accum * whole["dense"], ("fsdp",), f)
    add("replica gradient all-reduce", 2 * whole["dense"] / f, ("replica",), r)
    replicated = model.moe.dispatch in ("ragged", "dense")
    group = ("efsdp", "ep") if replicated else ("efsdp",)
    shards = sizes["efsdp"] * (sizes["ep"] if replicated else 1)
    per_group = 1 if replicated else sizes["ep"]
    add("expert weight all-gather", passes * elems["expert"] * dt / per_group, group, shards)
    add("expert gradient reduce-scatter", train.grad_accum * whole["expert"] / per_group, group, shards)
    add("ereplica gradient all-reduce", 2 * whole["expert"] / (sizes["ep"] * sizes["efsdp"]), ("ereplica",),
        sizes["ereplica"])
    s = act.tokens_per_device(train.batch_size // train.grad_accum, plan.seq, sizes)
    _, moe_layers = act.num_layers(model)
    if not replicated and moe_layers:
        m = model.moe
        rows = dispatch_rows(m.dispatch, s.tokens, m.num_experts_per_tok, m.n_routed_experts // s.ep, s.ep,
                             m.capacity_factor)
        exchanges = 4 + 2 * (train.remat != "none")      # there and back: forward, backward, recomputed forward
        add("expert dispatch all-to-all", exchanges * rows["send"] * model.hidden_size * dt * moe_layers
            * train.grad_accum, ("ep",), sizes["ep"])
    latent = s.rows * plan.seq * (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * dt
    layers = sum(act.num_layers(model))
    add("cp latent all-gather", (2 + (train.remat != "none")) * latent * layers * train.grad_accum, ("cp",),
        sizes["cp"])
    if cfg.optimizer.name == "muon":
        add("muon dense all-to-all", 2 * muon["dense"] * ns, ("fsdp",), f)
        add("muon expert all-to-all", 2 * muon["expert"] * ns, ("efsdp",), sizes["efsdp"])
    return out


@functools.lru_cache(maxsize=256)
def _weights(model: ModelConfig, sizes: tuple) -> tuple[dict, dict, dict]:
    """Per grid ('dense', 'expert') of the trainable parameters: their whole bytes, their elements, and the
    elements each device holds of the Muon matrices."""
    leaves = [x for x in param_leaves(model, dict(sizes)) if x.trainable]
    grids = ("dense", "expert")
    elems = {g: sum(math.prod(x.shape) for x in leaves if x.grid == g) for g in grids}
    whole = {g: sum(math.prod(x.shape) * x.itemsize for x in leaves if x.grid == g) for g in grids}
    muon = {g: sum(math.prod(x.local_shape) for x in leaves if x.grid == g and x.muon_matrix) for g in grids}
    return whole, elems, muon


def step_time(cfg: RunConfig, plan: MemoryPlan, hw: Hardware) -> StepTime:
    """The estimated step time of `cfg` laid out as `plan` on `hw` (module docstring), with the grouped
    matmul the plan was made for."""
    seconds, moved = {}, {}
    for name, (n, axes) in collective_bytes(cfg, plan).items():
        mesh = DENSE_AXES if axes[0] in DENSE_AXES else EXPERT_AXES
        within = span(plan.sizes, mesh, axes) <= hw.devices_per_node
        seconds[name] = n / (hw.intra_bw if within else hw.inter_bw)
        moved[name] = n
    return StepTime(compute_seconds(cfg, plan, hw, plan.settings["grouped_matmul"]), seconds, moved)

"""Parameter and FLOP accounting from the abstract model: nothing is allocated, so the 1T config counts
in about a second on a laptop.

The model is built under `nnx.eval_shape`, so every variable holds a `jax.ShapeDtypeStruct`. Each
parameter leaf is classified by the module that owns it (an RMSNorm scale is a norm wherever it sits),
and counts come from the leaf shapes. Stacked layers carry a leading `layers` axis and routed experts an
`experts` axis (the `axes` metadata), so one leaf covers every layer and expert: no loop over either.

Conventions (as in shared/reference/kimi_arch.md 1.3):
- `total` counts every `nnx.Param` plus the router correction biases (`RouterBias`), MTP included.
- MTP depths share the embedding and the output head with the main model; those count once, under
  the main model. `mtp` is the unique part: each depth's decoder layer, enorm, hnorm, eh_proj, head norm.
- Active params per token: all non-routed params plus `num_experts_per_tok / n_routed_experts` of the
  routed experts. Reported with and without the input embedding (a lookup, not a matmul).
- Training FLOPs per token = 3 x forward (backward costs twice the forward):
    6 x active matmul params (no input embedding, no norms, no router bias; lm_head included)
  + 3 x attention scores and values per layer: forward 2*s*H*d_qk (QK^T) + 2*s*H*d_v (AV), halved for
    causal masking, where s is the sequence length.
  Each MTP depth adds one decoder layer, its eh_proj and another pass through the shared head.
"""

from __future__ import annotations

import dataclasses
import math

from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model.attention import MLA
from composer_jax.model.layers import MLP, Embed, RMSNorm, RouterBias
from composer_jax.model.moe import MoE
from composer_jax.model.mtp import MTPDepth
from composer_jax.model.router import Router
from composer_jax.model.transformer import CausalLM

# Breakdown keys, in display order. `mtp_proj` (eh_proj) exists only inside MTP depths.
COMPONENTS = ("embedding", "lm_head", "attention", "dense_ffn", "routed_experts", "shared_experts",
              "router", "norms", "mtp_proj", "other")


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter leaf of the abstract model.

    path: e.g. ('moe_layers', 'mlp', 'gate_proj'); shape: e.g. (layers, experts, embed, moe_mlp);
    params: prod(shape); active: params used per token (routed experts scaled by k / E);
    matmul: whether it multiplies activations (False for the embedding lookup, norms, router bias).
    """

    path: tuple[str, ...]
    shape: tuple[int, ...]
    component: str
    in_mtp: bool
    params: int
    active: int
    matmul: bool


@dataclasses.dataclass(frozen=True)
class Flops:
    """Training (forward + backward) FLOPs per token at sequence length `seq_len`."""

    seq_len: int
    matmul: int         # 6 x active matmul params of the main model, lm_head included
    attention: int      # QK^T and AV of the main model's layers, causal
    mtp_matmul: int     # MTP depths: eh_proj + decoder layer + the shared head, per depth
    mtp_attention: int

    @property
    def main(self) -> int:
        return self.matmul + self.attention

    @property
    def mtp(self) -> int:
        return self.mtp_matmul + self.mtp_attention

    @property
    def total(self) -> int:
        return self.main + self.mtp


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """Parameter counts and FLOPs of one ModelConfig. Every count is an exact int."""

    total: int                    # main + mtp
    main: int                     # the model without MTP depths
    mtp: int                      # unique MTP params (embedding and head are shared, counted in main)
    components: dict[str, int]    # main model by COMPONENTS key (zeros dropped); sums to `main`
    mtp_components: dict[str, int]  # the same split of the MTP depths; sums to `mtp`
    active: int                   # main-model params touched per token, input embedding included
    active_no_embed: int          # the same without the input embedding
    mtp_active: int               # per token through all MTP depths
    flops: Flops

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["flops"].update(main=self.flops.main, mtp=self.flops.mtp, total=self.flops.total)
        return out


def abstract_model(cfg: ModelConfig) -> CausalLM:
    """The CausalLM with `jax.ShapeDtypeStruct` leaves: shapes and metadata only, no memory."""
    return nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))


def abstract_params(cfg: ModelConfig) -> list[tuple[tuple[str, ...], nnx.Variable]]:
    """(path, abstract variable) of every parameter of `CausalLM(cfg)`, with its shape, dtype and
    logical `axes`: the tree checkpoint/ lays onto Hugging Face tensors. Allocates nothing."""
    return [(tuple(str(p) for p in path), var) for path, var in nnx.to_flat_state(nnx.state(abstract_model(cfg)))]


def _component(path: tuple, owner: nnx.Module, parent: nnx.Module | None, var: nnx.Variable) -> str:
    """Which COMPONENTS bucket a leaf belongs to, from the module that owns it."""
    if isinstance(owner, RMSNorm):
        return "norms"
    if isinstance(owner, Router) or isinstance(var, RouterBias):
        return "router"
    if isinstance(owner, MoE):  # MoE owns only the stacked routed-expert weights directly
        return "routed_experts"
    if isinstance(owner, MLP):
        return "shared_experts" if isinstance(parent, MoE) else "dense_ffn"
    if isinstance(owner, MLA):
        return "attention"
    if isinstance(owner, Embed):
        return "embedding"
    if isinstance(owner, MTPDepth):
        return "mtp_proj"
    if isinstance(owner, CausalLM) and path[-1] == "lm_head":
        return "lm_head"
    return "other"


def leaves(model: CausalLM) -> list[Leaf]:
    """Every Param / RouterBias leaf of `model` (abstract or concrete), classified and counted."""
    nodes = {tuple(str(p) for p in path): node for path, node in nnx.iter_graph(model)}
    cfg = model.cfg
    out = []
    for path, var in nodes.items():
        if not isinstance(var, (nnx.Param, RouterBias)):
            continue
        shape = tuple(var.get_value().shape)
        component = _component(path, nodes[path[:-1]], nodes.get(path[:-2]), var)
        params = math.prod(shape)
        active = params
        if component == "routed_experts":
            # Only k of the E experts along the `experts` axis touch a token.
            e_axis = var.get_metadata("axes").index("experts")
            active = params // shape[e_axis] * cfg.moe.num_experts_per_tok
        matmul = isinstance(var, nnx.Param) and component not in ("norms", "embedding")
        out.append(Leaf(path, shape, component, path[0] == "mtp", params, active, matmul))
    return out


def _by_component(items: list[Leaf]) -> dict[str, int]:
    sums = {c: sum(x.params for x in items if x.component == c) for c in COMPONENTS}
    return {c: n for c, n in sums.items() if n}


def attention_flops_per_layer(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token of one layer's QK^T and AV: 3 x (2*s*H*(d_qk + d_v)) / 2 (causal)."""
    mla = cfg.mla
    return 3 * seq_len * mla.num_heads * (mla.qk_head_dim + mla.v_head_dim)


def model_info(cfg: ModelConfig, seq_len: int | None = None) -> ModelInfo:
    """Counts and FLOPs for `cfg`; `seq_len` defaults to rope.original_max_position_embeddings."""
    seq_len = cfg.rope.original_max_position_embeddings if seq_len is None else seq_len
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")
    all_leaves = leaves(abstract_model(cfg))
    main = [x for x in all_leaves if not x.in_mtp]
    mtp = [x for x in all_leaves if x.in_mtp]
    embed = sum(x.params for x in main if x.component == "embedding")
    head = sum(x.params for x in main if x.component == "lm_head")
    active = sum(x.active for x in main)
    depths = cfg.mtp.num_layers
    per_layer_attn = attention_flops_per_layer(cfg, seq_len)
    flops = Flops(
        seq_len=seq_len,
        matmul=6 * sum(x.active for x in main if x.matmul),
        attention=cfg.num_layers * per_layer_attn,
        mtp_matmul=6 * (sum(x.active for x in mtp if x.matmul) + depths * head),
        mtp_attention=depths * per_layer_attn,
    )
    return ModelInfo(
        total=sum(x.params for x in all_leaves),
        main=sum(x.params for x in main),
        mtp=sum(x.params for x in mtp),
        components=_by_component(main),
        mtp_components=_by_component(mtp),
        active=active,
        active_no_embed=active - embed,
        mtp_active=sum(x.active for x in mtp),
        flops=flops,
    )

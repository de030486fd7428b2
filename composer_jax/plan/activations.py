"""Per-device activation memory of one forward + backward: what each layer keeps for its backward
(`saved`, stacked over the scanned layers) and what one layer's backward needs while it runs
(`working`), by named tensor, for every attention implementation, rematerialisation policy and MoE
dispatch backend.

The tensors are those of the model code (composer_jax/model/), at per-device shapes: `rows` sequences
of `queries` local positions (the sequence over `cp`) attending to `keys` positions (the whole
sequence, gathered under context parallelism, plus any prefix). What a layer keeps is what JAX's
autodiff saves for it (checked with `jax.ad_checkpoint.print_saved_residuals` and against compiled
programs, tests/test_plan.py):
- an RMSNorm keeps its input in float32, its normalised value and its output (8 bytes a value in
  bfloat16 and in float32, plus 4 when a float32 input is not kept anyway);
- a SwiGLU keeps both projections, three silu intermediates and their product (6 values a unit);
- the reference attention keeps the masked float32 scores and the probabilities (compute dtype), plus
  the per-head keys and values;
  the memory-efficient implementations (`blockwise`, `cudnn`) keep the output and one float32
  log-sum-exp a query and head (flash attention's residuals) and work on blocks; `auto` is one of
  the three, as `attention_ops.choose` would pick it on the planned platform (`planned_attention`);
- an FSDP-sharded weight is all-gathered for use and the gathered copy is kept for the backward.
Rematerialisation per layer (`train.remat`): `none` keeps all of that; `dots` keeps the outputs of the
projections (matmuls without batch dimensions, outside shard_maps: `model.decoder.REMAT_POLICIES`; the
routed experts' matmuls, in the dispatch's shard_map, are recomputed) and recomputes the rest; `full`
keeps each layer's input only and recomputes the layer in its backward.

Backend-specific working memory of the grouped matmuls (`dispatch.grouped_swiglu`): on CPU they run
in blocks of rows of one expert, each block with a copy of its expert's matrices (`"blocked"`); elsewhere
`jax.lax.ragged_dot`, which XLA (GPU without a grouped kernel) lowers to a dense dot over a
group-masked copy of its input, [experts, rows, width] (`"expanded"`); a grouped kernel (tokamax,
Megablox, cuDNN) needs none (`"kernel"`).

The chunked losses hold float32 [rows, chunk, vocab] blocks, as many as XLA's build of each loss's
gradient alone holds (`head_loss_blocks`, `rl_loss_blocks`, `SD_LOSS_BLOCKS`; tests/test_gpu_compile.py).
"""

from __future__ import annotations

import dataclasses

from composer_jax.config import ConfigError, ModelConfig
from composer_jax.model.attention_ops import IMPLEMENTATIONS, REFERENCE_MAX_KEYS
from composer_jax.model.blockwise import K_BLOCK, Q_BLOCK
from composer_jax.model.dispatch import grouped_block_rows
from composer_jax.model.expert_parallel import dispatch_rows

F32 = 4
PLATFORMS = ("gpu", "cpu")
REMAT_POLICIES = ("none", "dots", "full")
GROUPED_MATMULS = ("expanded", "kernel", "blocked")


def planned_grouped_matmul(platform: str, grouped_matmul: str | None) -> str:
    """`grouped_matmul` (one of GROUPED_MATMULS), or where None the one `platform` runs: blocked on CPU
    (`dispatch.grouped_swiglu`), XLA's expanded `ragged_dot` on a GPU."""
    if grouped_matmul is None:
        return "blocked" if platform == "cpu" else "expanded"
    if grouped_matmul not in GROUPED_MATMULS:
        raise ConfigError("--grouped-matmul", f"must be one of {GROUPED_MATMULS}, got {grouped_matmul!r}")
    return grouped_matmul


def planned_attention(cfg: ModelConfig, name: str, platform: str, keys: int, cp: int, prefix: bool = False) -> str:
    """The implementation `model.attention=name` runs as on `platform` (`attention_ops.choose`'s rules
    without a device): on a GPU, 'auto' is cuDNN where it applies (16-bit activations, head dims
    multiples of 8 up to 256, no latent prefix, no context parallelism), else blockwise; on CPU the
    dense reference up to REFERENCE_MAX_KEYS keys, blockwise beyond."""
    if name not in IMPLEMENTATIONS:
        raise ConfigError("model.attention", f"unknown attention {name!r}; expected one of {', '.join(IMPLEMENTATIONS)}")
    if platform not in PLATFORMS:
        raise ConfigError("--platform", f"unknown platform {platform!r}; expected one of {', '.join(PLATFORMS)}")
    if name != "auto":
        return name
    if platform == "cpu":
        return "reference" if keys <= REFERENCE_MAX_KEYS else "blockwise"
    mla = cfg.mla
    dk, dv = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
    heads_ok = max(dk, dv) <= 256 and dk % 8 == 0 and dv % 8 == 0
    cudnn = cfg.dtype == "bfloat16" and heads_ok and not prefix and cp == 1
    return "cudnn" if cudnn else "blockwise"


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Per-device sizes of one micro-batch on a layout."""

    rows: int            # sequences per device
    queries: int         # local positions per sequence (seq / cp)
    keys: int            # positions attended to (seq, plus a prefix)
    ep: int              # expert-parallel ranks
    fsdp: int            # dense-weight FSDP shards
    efsdp: int           # expert-weight FSDP shards

    @property
    def tokens(self) -> int:
        return self.rows * self.queries


def _norm(tokens: int, dim: int, dt: int, input_kept: bool) -> int:
    """RMSNorm residuals: its float32 input (unless that is the input itself, kept anyway), the
    normalised value and the output, both in the compute dtype."""
    f32_input = F32 if dt != F32 or not input_kept else 0
    return tokens * dim * (f32_input + 2 * dt)


def _swiglu(tokens: int, width: int, dt: int) -> int:
    return 6 * tokens * width * dt


def _dims(cfg: ModelConfig):
    mla = cfg.mla
    return mla.num_heads, mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim


def dense_weight_bytes(cfg: ModelConfig, moe: bool, dt: int) -> int:
    """A layer's dense (non-routed) matrices in the compute dtype: what FSDP gathers per layer."""
    d = cfg.hidden_size
    h, rq, rkv, nope, rope, dv = _dims(cfg)
    attn = d * rq + rq * h * (nope + rope) + d * (rkv + rope) + rkv * h * (nope + dv) + h * dv * d
    if moe:
        ffn = 3 * d * cfg.moe.moe_intermediate_size * cfg.moe.n_shared_experts + d * cfg.moe.n_routed_experts
    else:
        ffn = 3 * d * cfg.intermediate_size
    return (attn + ffn) * dt


def attention_saved(cfg: ModelConfig, s: Shapes, impl: str, dt: int) -> dict[str, int]:
    """What one MLA block keeps for its backward (no rematerialisation)."""
    d, t = cfg.hidden_size, s.tokens
    h, rq, rkv, nope, rope, dv = _dims(cfg)
    out = {
        "layer input": t * d * dt,
        "input norm": _norm(t, d, dt, input_kept=True),
        "q projections": _norm(t, rq, dt, input_kept=False) + t * h * (nope + rope) * dt,
        "kv latent": _norm(t, rkv, dt, input_kept=False) + t * rope * dt + 2 * 2 * t * rope // 2 * F32,
        "keys and values": s.rows * s.keys * h * (nope + dv) * dt,
        "attention output": t * h * dv * dt,
        "post-attention norm": t * d * dt + _norm(t, d, dt, input_kept=True),
    }
    if impl == "reference":
        scores = s.rows * h * s.queries * s.keys
        out["scores"] = scores * (F32 + dt)    # masked float32 scores and the probabilities
    else:  # flash residuals: the output (above) and a float32 log-sum-exp per query and head
        out["log-sum-exp"] = t * h * F32
    return out


def attention_working(cfg: ModelConfig, s: Shapes, impl: str, dt: int, stacked: bool = True) -> int:
    """Transient bytes of one MLA block's backward: two score-sized gradients and, in a scanned stack,
    the layer's kept scores read out of their stack (reference), or three float32 blocks
    (memory-efficient: the recomputed probabilities, their gradient and the scores' gradient; the scores
    fuse into the first), plus the gradients of the keys and values."""
    h, _, _, nope, _, dv = _dims(cfg)
    if impl == "reference":
        scores = s.rows * h * s.queries * s.keys * (2 * F32 + (F32 + dt) * stacked)
    else:
        scores = 3 * s.rows * h * min(Q_BLOCK, s.queries) * min(K_BLOCK, s.keys) * F32
    return scores + s.rows * s.keys * h * (nope + dv) * dt


def ffn_saved(cfg: ModelConfig, s: Shapes, moe: bool, kind: str, factor: float, dt: int,
              grouped_matmul: str) -> dict[str, int]:
    """What one FFN block (dense SwiGLU, or MoE: router, shared expert, routed experts through the
    dispatch backend `kind`) keeps for its backward (no rematerialisation). The blocked grouped matmul
    keeps its blocks' copies of their experts' matrices (the batched matmuls' operands), in float32:
    XLA:CPU runs bfloat16 matmuls on float32 copies (measured on the proxy's CPU build)."""
    d, t = cfg.hidden_size, s.tokens
    if not moe:
        return {"mlp": _swiglu(t, cfg.intermediate_size, dt)}
    m = cfg.moe
    e, k, f = m.n_routed_experts, m.num_experts_per_tok, m.moe_intermediate_size
    out = {"router": t * d * dt + 2 * t * e * F32 + t * k * (F32 + 4),
           "shared expert": _swiglu(t, f * m.n_shared_experts, dt)}
    if kind != "dense" and grouped_matmul == "blocked":
        rows, experts, _ = _expert_rows(cfg, s, kind, factor)
        out["blocked expert copies"] = 3 * _blocks(rows, experts) * d * f * F32
    if kind == "dense":   # every expert on every token
        out["experts (dense dispatch)"] = _swiglu(e * t, f, dt) + e * t * d * dt + t * k * e * F32 + t * e * F32
        out["gathered experts"] = 3 * e * d * f * dt
    elif kind == "ragged":
        rows = t * k
        out["experts (ragged)"] = rows * d * dt + _swiglu(rows, f, dt) + rows * d * F32
        out["gathered experts"] = 3 * e * d * f * dt
    else:
        rows = dispatch_rows(kind, t, k, e // s.ep, s.ep, factor)["receive"]
        # received rows, the SwiGLU over them, the empty-slot masks of their outputs (bool)
        out["experts (received rows)"] = rows * d * dt + _swiglu(rows, f, dt) + 2 * rows * d
        out["combine"] = t * k * d * F32
        if s.efsdp > 1:
            out["gathered experts"] = 3 * (e // s.ep) * d * f * dt
    return out


def _expert_rows(cfg: ModelConfig, s: Shapes, kind: str, factor: float) -> tuple[int, int, int]:
    """(rows the grouped matmuls see, experts they span, rows in the exchange buffers sent and received)
    of one MoE block on this device (`kind` != 'dense')."""
    m = cfg.moe
    e, k = m.n_routed_experts, m.num_experts_per_tok
    if kind == "ragged":
        return s.tokens * k, e, 0
    sizes = dispatch_rows(kind, s.tokens, k, e // s.ep, s.ep, factor)
    return sizes["receive"], e // s.ep, sizes["send"] + sizes["receive"]


def _blocks(rows: int, experts: int) -> int:
    """The blocked grouped matmul's blocks of `grouped_block_rows` rows (`dispatch.grouped_swiglu`)."""
    block = grouped_block_rows(rows, experts)
    return -(-(rows + experts * (block - 1)) // block)


def _blocked_working(rows: int, experts: int, d: int, f: int, dt: int, copies: int) -> int:
    """The blocked grouped matmul: `copies` [blocks, embed, width] matrices (the forward's copies of the
    blocks' experts' matrices, or the backward's gradient of one of them, which it sums into its expert's
    before the next: the copies themselves are kept, `ffn_saved`, or rebuilt, `layer_memory`), and the
    rows in blocks."""
    blocks = _blocks(rows, experts)
    return (copies * blocks * d * f + blocks * grouped_block_rows(rows, experts) * (d + 2 * f)) * dt


def ffn_working(cfg: ModelConfig, s: Shapes, moe: bool, kind: str, factor: float, dt: int,
                grouped_matmul: str) -> int:
    """Transient bytes of one FFN block's backward: the exchange buffers of an expert-parallel dispatch
    (in flight both ways) and, with the expanded grouped matmul, its masked [experts, rows, width]
    copies (three embed-wide and one expert-wide at once in the backward); with the blocked one, one
    matrix's gradient of the blocks' expert copies."""
    d, t = cfg.hidden_size, s.tokens
    if not moe:
        return 2 * t * cfg.intermediate_size * dt
    e, f = cfg.moe.n_routed_experts, cfg.moe.moe_intermediate_size
    if kind == "dense":
        return 2 * e * t * max(d, f) * dt
    rows, experts, exchanged = _expert_rows(cfg, s, kind, factor)
    if grouped_matmul == "expanded":
        grouped = experts * rows * (3 * max(d, f) + min(d, f)) * dt
    elif grouped_matmul == "blocked":
        grouped = _blocked_working(rows, experts, d, f, dt, copies=1)
    else:
        grouped = 0
    return 2 * exchanged * d * dt + grouped + 2 * rows * max(d, f) * dt


def remat_saved(saved: dict[str, int], remat: str, cfg: ModelConfig, s: Shapes, moe: bool, dt: int) -> dict[str, int]:
    """A layer's kept tensors under a rematerialisation policy (module docstring)."""
    if remat == "none":
        return saved
    d, t = cfg.hidden_size, s.tokens
    if remat == "full":
        return {"layer input": t * d * dt}
    h, rq, rkv, nope, rope, dv = _dims(cfg)
    dots = {"layer input": t * d * dt,
            "projection outputs": t * (rq + h * (nope + rope) + rkv + rope + d) * dt
            + s.rows * s.keys * h * (nope + dv) * dt}
    if moe:
        m = cfg.moe
        dots["FFN projections"] = t * (m.n_routed_experts * F32 + 3 * m.moe_intermediate_size * m.n_shared_experts) * dt
    else:
        dots["FFN projections"] = t * (2 * cfg.intermediate_size + d) * dt
    return dots


@dataclasses.dataclass(frozen=True)
class LayerMemory:
    saved: dict[str, int]     # kept from the forward until this layer's backward
    working: int              # transient, while this layer's backward runs

    @property
    def saved_total(self) -> int:
        return sum(self.saved.values())


def layer_memory(cfg: ModelConfig, s: Shapes, moe: bool, *, attention: str, remat: str, factor: float,
                 grouped_matmul: str, stacked: bool = True) -> LayerMemory:
    """One decoder layer's kept and working bytes per device; `stacked`: the layer runs in a scan over its
    stack (`model.decoder.unrolls`), whose backward reads its kept tensors out of their stacks."""
    dt = 4 if cfg.dtype == "float32" else 2
    full = {**attention_saved(cfg, s, attention, dt), **ffn_saved(cfg, s, moe, cfg.moe.dispatch, factor, dt,
                                                                  grouped_matmul)}
    weights = dense_weight_bytes(cfg, moe, dt)
    if s.fsdp > 1 or cfg.param_dtype != cfg.dtype:   # the gathered (or cast) copy is a new array
        full["gathered weights"] = weights
    saved = remat_saved(full, remat, cfg, s, moe, dt)
    # XLA schedules the attention's and the FFN's backward temporaries to overlap: both count.
    working = (attention_working(cfg, s, attention, dt, stacked)
               + ffn_working(cfg, s, moe, cfg.moe.dispatch, factor, dt, grouped_matmul)
               + weights + full.get("gathered experts", 0) + 2 * s.tokens * cfg.hidden_size * F32)
    if remat != "none":   # the backward first rebuilds what the policy dropped
        working += sum(full.values()) - sum(saved.values())
    return LayerMemory(saved, working)


def embedding_working(cfg: ModelConfig, s: Shapes) -> int:
    """The input embedding: its table gathered whole (FSDP) for the lookup and the gradient the
    backward scatters into a table-sized buffer."""
    dt = 4 if cfg.dtype == "float32" else 2
    return cfg.vocab_size * cfg.hidden_size * dt * (2 if s.fsdp > 1 else 1)


def head_loss_blocks(dt: int, teacher: bool) -> float:
    """The float32 [rows, chunk, vocab] blocks one chunk of `train/losses.head_loss_sums` holds at once
    (measured on GPU and CPU builds of its gradient, tests/test_gpu_compile.py): the logits and their gradient
    in the compute dtype (half a block in bfloat16), and a teacher's logits."""
    return 1 + dt / F32 + teacher


def train_loss_blocks(dt: int, mtp: bool, distill: bool) -> float:
    """The training step's loss blocks: the main head's, and with MTP depths the first depth's beside it
    (its teacher is the main hidden states, so XLA computes it with the main loss)."""
    return head_loss_blocks(dt, False) + mtp * head_loss_blocks(dt, distill)


# The float32 [windows, chunk, vocab] blocks of the feedback windows' self-distillation
# (`rl/objective`'s divergence through `rl/rows.chunked`, measured on GPU builds of its gradient,
# tests/test_gpu_compile.py): the student's and the teacher's logits and the student's gradient.
SD_LOSS_BLOCKS = 3


def rl_loss_blocks(entropy_bonus: bool) -> int:
    """The float32 [rows, chunk, vocab] blocks of the RL step's token statistics (`rl/objective._token_stats`
    through `rl/rows.chunked`, measured on GPU builds of its gradient, tests/test_gpu_compile.py): the
    rematerialised logits and their gradient, and with an entropy bonus the gradient of the entropy."""
    return 2 + entropy_bonus


def loss_working(cfg: ModelConfig, s: Shapes, chunk: int, seq: int, blocks: float) -> int:
    """A chunked loss: over the chunks, `blocks` float32 [rows, chunk, vocab] blocks of one chunk, the
    whole head in the compute dtype and its float32 gradient summed over the chunks; after them, that
    gradient and the copy its reduction across the row shards writes."""
    dt = 4 if cfg.dtype == "float32" else 2
    block = s.rows * min(chunk, seq) * cfg.vocab_size * F32
    head = cfg.hidden_size * cfg.vocab_size
    return max(int(blocks * block) + head * (dt + F32), 2 * head * F32)


def ffn_forward_working(cfg: ModelConfig, s: Shapes, moe: bool, factor: float, grouped_matmul: str) -> int:
    """Transient bytes of one FFN block's forward beyond what it keeps: the exchange buffers of an
    expert-parallel dispatch and the grouped matmuls' working set (expanded: the masked copies of the rows
    for the gate and up projections and of the hidden for the down one, and one projection's per-expert
    outputs before their sum, as a GPU build of the tiny model holds them; blocked: the blocks' three
    copies of their experts' matrices, and the rows in blocks).
    A dense MLP's and the dense dispatch's intermediates are kept for the backward (`ffn_saved`)."""
    kind = cfg.moe.dispatch
    if not moe or kind == "dense":
        return 0
    dt = 4 if cfg.dtype == "float32" else 2
    d, f = cfg.hidden_size, cfg.moe.moe_intermediate_size
    rows, experts, exchanged = _expert_rows(cfg, s, kind, factor)
    if grouped_matmul == "expanded":
        grouped = experts * rows * 2 * (d + f) * dt
    elif grouped_matmul == "blocked":
        grouped = _blocked_working(rows, experts, d, f, dt, copies=3)
    else:
        grouped = 0
    return exchanged * d * dt + grouped


def global_saved(cfg: ModelConfig, s: Shapes, attention: str) -> dict[str, int]:
    """Tensors of the whole forward kept once (not per layer): the attention mask (the reference
    materialises it, and its per-head broadcast), rotary tables, the final hidden states."""
    dt = 4 if cfg.dtype == "float32" else 2
    out = {"rotary tables": 2 * s.tokens * cfg.mla.qk_rope_head_dim // 2 * F32,
           "final hidden": 3 * s.rows * s.queries * cfg.hidden_size * dt}
    if attention == "reference":
        out["mask"] = s.rows * s.queries * s.keys * (1 + cfg.mla.num_heads)
    return out


def num_layers(cfg: ModelConfig) -> tuple[int, int]:
    """(dense layers, MoE layers) of the main model plus its MTP depths (of the last kind)."""
    mtp_moe = cfg.mtp.num_layers if cfg.num_moe_layers else 0
    return cfg.num_dense_layers + (cfg.mtp.num_layers - mtp_moe), cfg.num_moe_layers + mtp_moe


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def dispatch_bytes(cfg: ModelConfig, s: Shapes) -> int:
    """Exchange buffers (send + receive) of one MoE layer's expert-parallel dispatch per device."""
    if not cfg.num_moe_layers or not cfg.moe.dispatch.startswith("ep_"):
        return 0
    m = cfg.moe
    rows = dispatch_rows(m.dispatch, s.tokens, m.num_experts_per_tok, m.n_routed_experts // s.ep, s.ep,
                         m.capacity_factor)
    return sum(rows.values()) * cfg.hidden_size * (4 if cfg.dtype == "float32" else 2)


def tokens_per_device(batch: int, seq: int, sizes: dict[str, int]) -> Shapes:
    data = sizes["replica"] * sizes["fsdp"]
    return Shapes(rows=ceil_div(batch, data), queries=seq // sizes["cp"], keys=seq, ep=sizes["ep"],
                  fsdp=sizes["fsdp"], efsdp=sizes["efsdp"])


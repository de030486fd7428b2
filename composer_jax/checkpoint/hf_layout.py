"""Which Hugging Face tensor fills which slice of which parameter, and how rows move between them.

HF linear weights are `[out, in]`; ours are `[in..., out...]` (x @ W), with per-head projections keeping
their head axis. Per-expert tensors stack on an `experts` axis, layers on a leading `layers` axis, and
MTP layers stored past the last decoder layer (`model.layers.{N+k}.*`) fill MTP depth k.

Rows: an HF tensor's rows (dim 0, the output features of a linear) are the unit of streaming. For a
linear with our output dims `out = (o0, o1, ...)`, index range `[a, b)` of `o0` is HF rows
`[a * prod(o1...), b * prod(o1...))`; for any other tensor it is simply rows `[a, b)` of dim 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from composer_jax.config import ModelConfig

SIDE_PREFIXES = ("vision_tower.", "mm_projector.")  # K2.5 multimodal parts: not part of the text model


@dataclass(frozen=True)
class Tensor:
    """How one HF tensor fills a slice of our parameter.

    `hf_shape` is the checkpoint shape; `linear_in` > 0 marks a linear weight `[out, in]` whose transpose
    is reshaped to our layout, whose first `linear_in` dims (after the stack dims) form the input.
    """

    key: str
    hf_shape: tuple[int, ...]
    linear_in: int = 0


def _hf_shape(shape: tuple[int, ...], linear_in: int) -> tuple[int, ...]:
    if not linear_in:
        return shape
    return (math.prod(shape[linear_in:]), math.prod(shape[:linear_in]))


# Our path inside a decoder layer -> (HF name inside `model.layers.{i}.`, linear_in). Experts stack on
# top of these with `mlp.experts.{j}.`.
LAYER_KEYS = {
    ("input_norm", "scale"): ("input_layernorm.weight", 0),
    ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", 0),
    ("attn", "q_a_proj"): ("self_attn.q_a_proj.weight", 1),
    ("attn", "q_a_norm", "scale"): ("self_attn.q_a_layernorm.weight", 0),
    ("attn", "q_b_proj"): ("self_attn.q_b_proj.weight", 1),
    ("attn", "kv_a_proj"): ("self_attn.kv_a_proj_with_mqa.weight", 1),
    ("attn", "kv_a_norm", "scale"): ("self_attn.kv_a_layernorm.weight", 0),
    ("attn", "kv_b_proj"): ("self_attn.kv_b_proj.weight", 1),
    ("attn", "o_proj"): ("self_attn.o_proj.weight", 2),
    ("mlp", "gate_proj"): ("mlp.gate_proj.weight", 1),
    ("mlp", "up_proj"): ("mlp.up_proj.weight", 1),
    ("mlp", "down_proj"): ("mlp.down_proj.weight", 1),
    ("mlp", "router", "kernel"): ("mlp.gate.weight", 1),
    ("mlp", "router", "bias"): ("mlp.gate.e_score_correction_bias", 0),
    ("mlp", "shared", "gate_proj"): ("mlp.shared_experts.gate_proj.weight", 1),
    ("mlp", "shared", "up_proj"): ("mlp.shared_experts.up_proj.weight", 1),
    ("mlp", "shared", "down_proj"): ("mlp.shared_experts.down_proj.weight", 1),
}
EXPERT_KEYS = {("mlp", p): f"{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
MTP_KEYS = {
    ("enorm", "scale"): ("enorm.weight", 0),
    ("hnorm", "scale"): ("hnorm.weight", 0),
    ("eh_proj",): ("eh_proj.weight", 1),
    ("head_norm", "scale"): ("shared_head.norm.weight", 0),
}
# Copies of the main embedding / head stored with each DeepSeek-V3 MTP layer: (HF name, our path).
MTP_SHARED = (("embed_tokens.weight", ("embed", "embedding")), ("shared_head.head.weight", ("lm_head",)))


def tensor_plan(path: tuple[str, ...], shape: tuple[int, ...], cfg: ModelConfig, prefix: str) -> np.ndarray:
    """For one of our parameters: an array of `Tensor`s with the parameter's leading (stack) shape.

    The returned numpy object array has shape `shape[:n_stack]`; each element names the HF tensor that
    fills `param[index]`.
    """
    base = f"{prefix}model."
    if path == ("embed", "embedding"):
        return np.array(Tensor(f"{base}embed_tokens.weight", shape))
    if path == ("final_norm", "scale"):
        return np.array(Tensor(f"{base}norm.weight", shape))
    if path == ("lm_head",):
        return np.array(Tensor(f"{prefix}lm_head.weight", _hf_shape(shape, 1), 1))
    stack, rest = path[0], path[1:]
    if stack == "dense_layers":
        first = 0
    elif stack == "moe_layers":
        first = cfg.num_dense_layers
    elif stack == "mtp":
        rest, first = rest[1:], cfg.num_layers  # ("mtp", "depths", ...): MTP layers follow the last layer
        if rest and rest[0] == "layer":
            rest = rest[1:]
        elif rest in MTP_KEYS:
            name, lin = MTP_KEYS[rest]
            plan = np.empty(shape[:1], object)
            for k in range(shape[0]):
                plan[k] = Tensor(f"{base}layers.{first + k}.{name}", _hf_shape(shape[1:], lin), lin)
            return plan
    else:
        raise KeyError(path)
    per_layer = shape[1:]
    experts = rest in EXPERT_KEYS and len(per_layer) == 3  # routed experts, not the dense MLP
    plan = np.empty(shape[:1] + ((per_layer[0],) if experts else ()), object)
    for layer in range(shape[0]):
        root = f"{base}layers.{first + layer}."
        if experts:
            for j in range(per_layer[0]):
                plan[layer, j] = Tensor(f"{root}mlp.experts.{j}.{EXPERT_KEYS[rest]}",
                                        _hf_shape(per_layer[1:], 1), 1)
        else:
            name, lin = LAYER_KEYS[rest]
            plan[layer] = Tensor(root + name, _hf_shape(per_layer, lin), lin)
    return plan


def mtp_copies(cfg: ModelConfig, prefix: str, depths: int) -> list[tuple[str, tuple[str, ...]]]:
    """(HF key, our path) of the embedding / head copies stored with the first `depths` MTP layers."""
    return [(f"{prefix}model.layers.{cfg.num_layers + k}.{name}", path)
            for k in range(depths) for name, path in MTP_SHARED]


def row_dim(t: Tensor) -> int:
    """The dim of the per-tensor slice (our layout) whose index ranges map to contiguous HF rows."""
    return t.linear_in


def rows_per_index(t: Tensor, inner: tuple[int, ...]) -> int:
    """HF rows per index of `row_dim` (inner: our per-tensor shape, without stack dims)."""
    return math.prod(inner[t.linear_in + 1:]) if t.linear_in else 1


def hf_rows_to_ours(rows: np.ndarray, t: Tensor, inner: tuple[int, ...], count: int) -> np.ndarray:
    """HF rows covering `count` indices of `row_dim` -> that block of our slice.

    rows: [count * rows_per_index, *hf_shape[1:]] -> `inner` with `inner[row_dim]` replaced by count.
    """
    k = t.linear_in
    block = inner[:k] + (count,) + inner[k + 1:]
    if not k:
        return rows.reshape(block)
    return rows.reshape(rows.shape[0], math.prod(inner[:k])).T.reshape(block)


def ours_to_hf_rows(block: np.ndarray, t: Tensor) -> np.ndarray:
    """Inverse of `hf_rows_to_ours`: a block of our slice -> contiguous HF rows."""
    k = t.linear_in
    if not k:
        return np.ascontiguousarray(block.reshape((-1,) + t.hf_shape[1:]))
    return np.ascontiguousarray(block.reshape(math.prod(block.shape[:k]), -1).T)

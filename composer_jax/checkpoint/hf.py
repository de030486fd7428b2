"""Load Hugging Face DeepSeek-V3 / Kimi K2 / Kimi K2.5 directories into the NNX model.

Reads `config.json` (plain DeepSeek-V3, or K2.5's `text_config` with its `language_model.` weight
prefix; rope given as transformers 5 `rope_parameters` or the older `rope_theta` + `rope_scaling`) and
unquantized safetensors. HF linear weights `[out, in]` become our `[in, out]` layout, per-expert
tensors are stacked on the `experts` axis and layers on the `layers` axis. MTP layers stored past the
last decoder layer (`model.layers.{N}.*`) map onto our MTP depths. Vision tower and projector tensors
of K2.5 are left aside.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax import config as config_lib
from composer_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsDir
from composer_jax.config import ModelConfig
from composer_jax.model import CausalLM
from composer_jax.model.mtp import MTP

log = logging.getLogger(__name__)

SIDE_PREFIXES = ("vision_tower.", "mm_projector.")  # K2.5 multimodal parts: not part of the text model


def _unsupported(key: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"config.json: {key}={value!r} is not supported: {why}")


def _rope_from_hf(hf: dict) -> dict:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    max_pos = int(hf.get("max_position_embeddings", 4096))
    if kind == "default":
        return dict(theta=theta, max_position_embeddings=max_pos, original_max_position_embeddings=max_pos)
    if kind != "yarn":
        raise _unsupported("rope_type", kind, "only 'yarn' and 'default' rope are implemented")
    if params.get("attention_factor") is not None or params.get("truncate") is False:
        raise _unsupported("rope_parameters", params, "explicit attention_factor / truncate=false")
    return dict(
        theta=theta,
        factor=params["factor"],
        original_max_position_embeddings=params["original_max_position_embeddings"],
        max_position_embeddings=max_pos,
        beta_fast=params.get("beta_fast") or 32.0,
        beta_slow=params.get("beta_slow") or 1.0,
        mscale=params.get("mscale") or 0.0,  # absent = 0: HF then uses mscale(factor) for cos/sin
        mscale_all_dim=params.get("mscale_all_dim") or 0.0,
    )


def _dtype_from_hf(hf: dict) -> str:
    return {"bfloat16": "bfloat16"}.get(str(hf.get("dtype") or hf.get("torch_dtype")), "float32")


def config_from_hf(hf: dict, num_mtp_layers: int = 0) -> dict:
    """The raw ModelConfig dict equivalent to a DeepSeek-V3 `config.json` (text part)."""
    checks = {
        "hidden_act": ("silu", "only SwiGLU (silu) FFNs are implemented"),
        "scoring_func": ("sigmoid", "only sigmoid routing (DeepSeek-V3 / Kimi) is implemented"),
        "topk_method": ("noaux_tc", "only noaux_tc routing with a correction bias is implemented"),
        "moe_layer_freq": (1, "every layer after the dense ones must be MoE"),
        "attention_bias": (False, "the model has no attention biases"),
        "tie_word_embeddings": (False, "the output head is untied"),
    }
    for key, (want, why) in checks.items():
        if key in hf and hf[key] != want:
            raise _unsupported(key, hf[key], why)
    if hf.get("q_lora_rank") is None:
        raise _unsupported("q_lora_rank", None, "MLA without a query LoRA is not implemented")
    dtype = _dtype_from_hf(hf)
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_dense_layers=hf.get("first_k_dense_replace", 0),
        intermediate_size=hf["intermediate_size"],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        mla=dict(num_heads=hf["num_attention_heads"], q_lora_rank=hf["q_lora_rank"],
                 kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                 qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"]),
        rope=_rope_from_hf(hf),
        moe=dict(n_routed_experts=hf["n_routed_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                 moe_intermediate_size=hf["moe_intermediate_size"],
                 n_shared_experts=hf.get("n_shared_experts") or 0, n_group=hf.get("n_group") or 1,
                 topk_group=hf.get("topk_group") or 1,
                 routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
                 norm_topk_prob=hf.get("norm_topk_prob", True)),
        mtp=dict(num_layers=num_mtp_layers),
        dtype=dtype,
        param_dtype=dtype,
    )


@dataclass(frozen=True)
class Tensor:
    """How one HF tensor fills a slice of our parameter.

    `hf_shape` is the expected checkpoint shape; `linear_in` > 0 marks a linear weight `[out, in]` whose
    transpose is reshaped to our layout, whose first `linear_in` dims form the input.
    """

    key: str
    hf_shape: tuple[int, ...]
    linear_in: int = 0


def _hf_shape(shape: tuple[int, ...], linear_in: int) -> tuple[int, ...]:
    if not linear_in:
        return shape
    return (int(np.prod(shape[linear_in:])), int(np.prod(shape[:linear_in])))


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
MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # duplicates of the main embedding / head


def tensor_plan(path: tuple[str, ...], shape: tuple[int, ...], cfg: ModelConfig, prefix: str):
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


def _read_config(path: Path) -> tuple[dict, str]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON: {e}") from None
    if "text_config" in hf:  # Kimi K2.5: a multimodal wrapper around a DeepSeek-V3 text model
        return hf["text_config"], "language_model."
    return hf, ""


def _count_mtp_layers(ckpt: SafetensorsDir, prefix: str, num_layers: int) -> int:
    depth = 0
    while any(k.startswith(f"{prefix}model.layers.{num_layers + depth}.") for k in ckpt.keys()):
        depth += 1
    return depth


def from_pretrained(path: str | Path, overrides=(), *, rngs_seed: int = 0) -> CausalLM:
    """Load a HF DeepSeek-V3 / Kimi K2 / K2.5 directory (config.json + unquantized safetensors).

    `overrides`: dotted ModelConfig changes applied on top of the HF config, e.g.
    `["dtype=bfloat16", "moe.dispatch=dense", "mtp.num_layers=1"]`. MTP depths absent from the
    checkpoint but requested by `mtp.num_layers` are freshly initialized (seed `rngs_seed`).
    Returns the model; `model(tokens)` gives float32 logits [batch, seq, vocab].
    """
    path = Path(path)
    hf, prefix = _read_config(path)
    if hf.get("quantization_config"):
        raise CheckpointError(f"{path}: quantized checkpoint ({hf['quantization_config'].get('quant_method')}); "
                              "from_pretrained reads unquantized safetensors only: dequantize it first")
    ckpt = SafetensorsDir(path)
    stored_mtp = _count_mtp_layers(ckpt, prefix, hf["num_hidden_layers"])
    try:
        raw = config_from_hf(hf, stored_mtp)
        cfg = config_lib.from_dict(ModelConfig, config_lib.apply_overrides(ModelConfig, raw, overrides))
    except KeyError as e:
        raise CheckpointError(f"{path / 'config.json'}: missing required key {e}") from None
    except config_lib.ConfigError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None

    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(rngs_seed)))
    fresh = MTP(cfg, rngs=nnx.Rngs(rngs_seed)) if cfg.mtp.num_layers > stored_mtp else None
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    used, missing, values = set(), [], {}
    for path_key, var in flat.items():
        path_key = tuple(str(p) for p in path_key)
        shape, dtype = var.get_value().shape, var.get_value().dtype
        if path_key[0] == "mtp" and fresh is not None:  # not in the checkpoint: keep the fresh init
            values[path_key] = np.asarray(_get_path(fresh, path_key[1:]))
            continue
        plan = tensor_plan(path_key, shape, cfg, prefix)
        out = np.empty(shape, dtype)
        for index, t in np.ndenumerate(plan):
            if t.key not in ckpt:
                missing.append(t.key)
                continue
            got = ckpt.shape(t.key)
            if got != t.hf_shape:
                raise CheckpointError(f"tensor '{t.key}' has shape {list(got)}, expected {list(t.hf_shape)} "
                                      f"from config.json")
            w = ckpt.read(t.key).astype(np.float32)
            if t.linear_in:
                w = w.T.reshape(shape[len(index):])
            out[index] = w.astype(dtype)
            used.add(t.key)
        values[path_key] = out
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing from the checkpoint, e.g. "
                              + ", ".join(f"'{k}'" for k in missing[:5]))
    _report_unused(ckpt, used, prefix, cfg)
    for path_key, var in flat.items():
        var.set_value(jnp.asarray(values[tuple(str(p) for p in path_key)]))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _get_path(module, path: tuple[str, ...]):
    node = module
    for p in path:
        node = getattr(node, p)
    return node[...]


def _report_unused(ckpt: SafetensorsDir, used: set, prefix: str, cfg: ModelConfig) -> None:
    side = [k for k in ckpt.keys() if k.startswith(SIDE_PREFIXES)]
    if side:
        log.info("left aside %d vision tower / projector tensors", len(side))
    mtp_dup = tuple(f"{prefix}model.layers.{cfg.num_layers + k}.{n}"
                    for k in range(cfg.mtp.num_layers) for n in MTP_SHARED)
    extra = [k for k in ckpt.keys() if k not in used and not k.startswith(SIDE_PREFIXES) and k not in mtp_dup]
    if extra:
        log.warning("ignored %d checkpoint tensor(s) the model does not use, e.g. %s", len(extra), extra[:5])

"""Hugging Face `config.json` <-> ModelConfig for DeepSeek-V3 / Kimi K2 / Kimi K2.5.

Reads plain DeepSeek-V3 configs and K2.5's multimodal wrapper (the text model under `text_config`,
weights prefixed `language_model.`); rope given as transformers 5 `rope_parameters` or the older
`rope_theta` + `rope_scaling`. Writes a plain `DeepseekV3ForCausalLM` config that transformers loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from composer_jax.checkpoint.safetensors_io import CheckpointError
from composer_jax.config import ModelConfig

K25_PREFIX = "language_model."


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


# Keys of a source config that describe its storage or wrapper, not the text model we write out.
_DROPPED = ("quantization_config", "auto_map", "torch_dtype", "transformers_version", "architectures",
            "model_type", "rope_scaling", "rope_theta")


def hf_config_from(cfg: ModelConfig, dtype: str, base: dict | None = None) -> dict:
    """A `DeepseekV3ForCausalLM` config.json dict for `cfg` with weights stored as `dtype`.

    `base` (e.g. the source checkpoint's text config) contributes keys this model does not define, such
    as token ids; storage and wrapper keys (quantization, remote code, model type) are replaced.
    """
    out = {k: v for k, v in (base or {}).items() if k not in _DROPPED}
    r, mla, moe = cfg.rope, cfg.mla, cfg.moe
    if r.factor == 1.0 and r.original_max_position_embeddings == r.max_position_embeddings:
        rope = {"rope_type": "default", "rope_theta": r.theta}
    else:
        rope = {"rope_type": "yarn", "rope_theta": r.theta, "factor": r.factor,
                "original_max_position_embeddings": r.original_max_position_embeddings,
                "beta_fast": r.beta_fast, "beta_slow": r.beta_slow, "mscale": r.mscale,
                "mscale_all_dim": r.mscale_all_dim}
    out.update(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", dtype=dtype,
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        first_k_dense_replace=cfg.num_dense_layers, intermediate_size=cfg.intermediate_size,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=r.max_position_embeddings,
        rope_parameters=rope, rope_interleave=True,
        num_attention_heads=mla.num_heads, num_key_value_heads=mla.num_heads, q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim, qk_head_dim=mla.qk_head_dim, v_head_dim=mla.v_head_dim,
        head_dim=mla.qk_rope_head_dim,
        n_routed_experts=moe.n_routed_experts, num_experts_per_tok=moe.num_experts_per_tok,
        moe_intermediate_size=moe.moe_intermediate_size, n_shared_experts=moe.n_shared_experts,
        n_group=moe.n_group, topk_group=moe.topk_group, routed_scaling_factor=moe.routed_scaling_factor,
        norm_topk_prob=moe.norm_topk_prob, scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
        hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
        num_nextn_predict_layers=cfg.mtp.num_layers,
    )
    return out


def read_hf_config(path: Path) -> tuple[dict, dict, str]:
    """(whole config.json, its text-model part, the text tensors' key prefix) of a HF directory."""
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"{path} {'is not a directory' if path.exists() else 'does not exist'} (expected a "
                              "Hugging Face model directory)")
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON: {e}") from None
    if "text_config" in hf:  # Kimi K2.5: a multimodal wrapper around a DeepSeek-V3 text model
        text = dict(hf["text_config"])
        text.setdefault("quantization_config", hf.get("quantization_config"))
        return hf, text, K25_PREFIX
    return hf, hf, ""


def eos_token_ids(path: Path) -> tuple[int, ...]:
    """The end-of-sequence ids of a HF directory (what generation stops at by default): from
    generation_config.json if it names any, else config.json (top level, then K2.5's text_config);
    () when none is given."""
    sources = []
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            try:
                data = json.loads(file.read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{file}: not valid JSON: {e}") from None
            sources += [data, data.get("text_config") or {}]
    for data in sources:
        ids = data.get("eos_token_id")
        if ids is not None:
            return tuple(int(i) for i in (ids if isinstance(ids, list) else [ids]))
    return ()

"""HF config.json <-> ModelConfig, each direction checked against transformers' own DeepseekV3Config:
transformers reads the config.json we write, we read the config.json transformers writes, and the
values are compared field by field through a mapping typed here (not taken from hf_config.py)."""

import json

import pytest
import torch
from transformers import DeepseekV3Config

from composer_jax import config, load_config
from composer_jax.checkpoint.hf_config import config_from_hf, hf_config_from
from composer_jax.config import ModelConfig

# DeepseekV3Config attribute -> ModelConfig field (dotted), for every field both sides define.
FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
    "first_k_dense_replace": "num_dense_layers", "intermediate_size": "intermediate_size",
    "rms_norm_eps": "rms_norm_eps", "max_position_embeddings": "rope.max_position_embeddings",
    "num_attention_heads": "mla.num_heads", "q_lora_rank": "mla.q_lora_rank", "kv_lora_rank": "mla.kv_lora_rank",
    "qk_nope_head_dim": "mla.qk_nope_head_dim", "qk_rope_head_dim": "mla.qk_rope_head_dim",
    "v_head_dim": "mla.v_head_dim", "n_routed_experts": "moe.n_routed_experts",
    "num_experts_per_tok": "moe.num_experts_per_tok", "moe_intermediate_size": "moe.moe_intermediate_size",
    "n_shared_experts": "moe.n_shared_experts", "n_group": "moe.n_group", "topk_group": "moe.topk_group",
    "routed_scaling_factor": "moe.routed_scaling_factor", "norm_topk_prob": "moe.norm_topk_prob",
}
# `rope_parameters` key -> RopeConfig field, for YaRN.
YARN_FIELDS = {"rope_theta": "theta", "factor": "factor",
               "original_max_position_embeddings": "original_max_position_embeddings",
               "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale",
               "mscale_all_dim": "mscale_all_dim"}
# What our model is, whatever the sizes: transformers must see the same architecture.
FIXED = {"hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "rope_interleave": True,
         "model_type": "deepseek_v3"}


def _get(cfg, dotted: str):
    for name in dotted.split("."):
        cfg = getattr(cfg, name)
    return cfg


def _plain_rope(cfg: ModelConfig) -> ModelConfig:
    return config.replace(cfg, **{"rope.factor": 1.0,
                                  "rope.original_max_position_embeddings": cfg.rope.max_position_embeddings})


@pytest.mark.parametrize("name, plain_rope", [("tiny", False), ("tiny", True), ("kimi-k2.5", False),
                                              ("deepseek-v3", False)])
def test_transformers_reads_the_config_we_write(tmp_path, name, plain_rope):
    cfg = load_config(name)
    cfg = _plain_rope(cfg) if plain_rope else cfg
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from(cfg, "bfloat16")))
    hf = DeepseekV3Config.from_pretrained(tmp_path)
    for hf_name, ours in FIELDS.items():
        assert getattr(hf, hf_name) == _get(cfg, ours), hf_name
    for key, value in FIXED.items():
        assert getattr(hf, key) == value, key
    assert hf.num_key_value_heads == cfg.mla.num_heads          # MLA: one K/V per query head
    assert hf.qk_head_dim == cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
    assert hf.num_nextn_predict_layers == cfg.mtp.num_layers and hf.dtype == torch.bfloat16
    rope = hf.rope_parameters
    assert rope["rope_theta"] == cfg.rope.theta
    if plain_rope:
        assert rope["rope_type"] == "default"
    else:
        assert rope["rope_type"] == "yarn"
        for key, ours in YARN_FIELDS.items():
            assert rope[key] == getattr(cfg.rope, ours), key


# Every value differs from DeepseekV3Config's default and from every other size, so a swapped or
# defaulted field shows.
HF_VALUES = dict(
    vocab_size=320, hidden_size=96, intermediate_size=136, moe_intermediate_size=40, num_hidden_layers=5,
    first_k_dense_replace=2, num_attention_heads=6, n_shared_experts=2, n_routed_experts=12,
    routed_scaling_factor=1.75, kv_lora_rank=24, q_lora_rank=56, qk_rope_head_dim=8, v_head_dim=20,
    qk_nope_head_dim=12, n_group=3, topk_group=2, num_experts_per_tok=3, norm_topk_prob=False,
    max_position_embeddings=2048, rms_norm_eps=3e-6,
)
HF_YARN = dict(rope_type="yarn", rope_theta=12345.0, factor=8.0, original_max_position_embeddings=256,
               beta_fast=24.0, beta_slow=2.0, mscale=0.75, mscale_all_dim=0.5)


@pytest.mark.parametrize("yarn", [True, False])
def test_we_read_the_config_transformers_writes(tmp_path, yarn):
    rope = HF_YARN if yarn else dict(rope_type="default", rope_theta=12345.0)
    DeepseekV3Config(**HF_VALUES, rope_parameters=rope, dtype="bfloat16").save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    # The MTP depth comes from the tensors present (transformers drops MTP weights), not from config.json.
    cfg = config.from_dict(ModelConfig, config_from_hf(hf, num_mtp_layers=1))
    for hf_name, ours in FIELDS.items():
        assert _get(cfg, ours) == HF_VALUES[hf_name], hf_name
    assert cfg.rope.theta == 12345.0 and cfg.mtp.num_layers == 1
    assert cfg.dtype == cfg.param_dtype == "bfloat16"
    if yarn:
        for key, ours in YARN_FIELDS.items():
            assert getattr(cfg.rope, ours) == HF_YARN[key], key
    else:   # plain RoPE: no YaRN stretch
        assert cfg.rope.factor == 1.0 and cfg.rope.original_max_position_embeddings == 2048


@pytest.mark.parametrize("name", ["tiny", "kimi-k2.5", "deepseek-v3"])
def test_hf_config_round_trip(name):
    """Ours both ways keeps every field config.json has (the rest are training settings)."""
    cfg = load_config(name)
    back = config.from_dict(type(cfg), config_from_hf(hf_config_from(cfg, cfg.param_dtype), cfg.mtp.num_layers))
    hf_only = ("dispatch", "bias_update_rate", "loss_weight", "latent_norm_eps", "capacity_factor", "layer_loop")

    def strip(d):
        return {k: strip(v) if isinstance(v, dict) else v for k, v in d.items() if k not in hf_only}

    assert strip(config.to_dict(back)) == strip(config.to_dict(cfg))

"""Tiny random transformers DeepSeek-V3 checkpoints built from our configs (the logits reference)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from composer_jax.config import ModelConfig


def hf_config(cfg: ModelConfig) -> DeepseekV3Config:
    r = cfg.rope
    return DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe.moe_intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.mla.num_heads, num_key_value_heads=cfg.mla.num_heads,
        n_shared_experts=cfg.moe.n_shared_experts, n_routed_experts=cfg.moe.n_routed_experts,
        routed_scaling_factor=cfg.moe.routed_scaling_factor, kv_lora_rank=cfg.mla.kv_lora_rank,
        q_lora_rank=cfg.mla.q_lora_rank, qk_rope_head_dim=cfg.mla.qk_rope_head_dim,
        v_head_dim=cfg.mla.v_head_dim, qk_nope_head_dim=cfg.mla.qk_nope_head_dim,
        n_group=cfg.moe.n_group, topk_group=cfg.moe.topk_group,
        num_experts_per_tok=cfg.moe.num_experts_per_tok, first_k_dense_replace=cfg.num_dense_layers,
        norm_topk_prob=cfg.moe.norm_topk_prob, max_position_embeddings=r.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False, num_nextn_predict_layers=0,
        rope_parameters=dict(rope_type="yarn", rope_theta=r.theta, factor=r.factor,
                             original_max_position_embeddings=r.original_max_position_embeddings,
                             beta_fast=r.beta_fast, beta_slow=r.beta_slow, mscale=r.mscale,
                             mscale_all_dim=r.mscale_all_dim),
        attn_implementation="eager",
    )


def random_hf_model(cfg: ModelConfig, seed: int = 0) -> DeepseekV3ForCausalLM:
    """Random weights with enough spread that a swapped or mis-transposed tensor changes the logits."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_config(cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm scales: around 1 but all distinct
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # non-zero, so selection-only bias is observable
                buf.copy_(0.5 * torch.rand_like(buf))
    return model


def save_random_hf_model(cfg: ModelConfig, path: Path, seed: int = 0) -> DeepseekV3ForCausalLM:
    model = random_hf_model(cfg, seed)
    model.save_pretrained(path)
    return model


def hf_logits(model: DeepseekV3ForCausalLM, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()

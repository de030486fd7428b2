"""The causal LM (DeepSeek-V3 / Kimi K2.5 text model): embedding, dense-first and MoE layer stacks,
final norm, untied head, optional MTP depths."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model import rope as rope_lib
from composer_jax.model.attention import attention_mask
from composer_jax.model.decoder import DecoderLayer, create_stack, scan_stack
from composer_jax.model.layers import Embed, RMSNorm, param
from composer_jax.model.mtp import MTP


def document_positions(segment_ids: jax.Array) -> jax.Array:
    """int32[batch, seq]: positions restarting at 0 where the segment id changes (packed documents)."""
    idx = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)[None]
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


class Output(NamedTuple):
    hidden: jax.Array               # [batch, seq, embed], after the final norm
    expert_load: jax.Array          # f32[moe_layers, experts]: assignments per expert, for the bias update
    max_logits: jax.Array           # f32[layers, heads]: largest attention logit per head (QK-clip)
    mtp_hidden: jax.Array | None    # [depths, batch, seq, embed], after each MTP head norm
    mtp_stats: dict | None          # the MTP layers' `max_logits` / `expert_load`, leading depths axis


class CausalLM(nnx.Module):
    """Token ids int32[batch, seq] -> float32 logits [batch, seq, vocab]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg, rngs=rngs)
        self.dense_layers = (create_stack(lambda r: DecoderLayer(cfg, False, rngs=r), cfg.num_dense_layers, rngs)
                             if cfg.num_dense_layers else None)
        self.moe_layers = (create_stack(lambda r: DecoderLayer(cfg, True, rngs=r), cfg.num_moe_layers, rngs)
                           if cfg.num_moe_layers else None)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", cfg.param_dtype, rngs=rngs)
        self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype)
        self.mtp = MTP(cfg, rngs=rngs) if cfg.mtp.num_layers else None

    def _check_inputs(self, tokens, segment_ids, positions) -> None:
        cfg = self.cfg
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be int[batch, seq], got {tokens.dtype}{list(tokens.shape)}")
        for name, arr in (("segment_ids", segment_ids), ("positions", positions)):
            if arr is not None and tuple(arr.shape) != tuple(tokens.shape):
                raise ValueError(f"{name} shape {list(arr.shape)} differs from tokens shape {list(tokens.shape)}")
        if tokens.shape[1] > cfg.rope.max_position_embeddings:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds rope.max_position_embeddings="
                             f"{cfg.rope.max_position_embeddings}")
        if not isinstance(tokens, jax.core.Tracer):  # value checks need concrete ids
            ids = np.asarray(tokens)
            bad = np.argwhere((ids < 0) | (ids >= cfg.vocab_size))
            if len(bad):
                where = tuple(int(i) for i in bad[0])
                raise ValueError(f"token id {int(ids[where])} at position {list(where)} is out of range "
                                 f"[0, vocab_size={cfg.vocab_size}) ({len(bad)} out-of-range ids in total)")

    def forward(self, tokens, segment_ids=None, positions=None, *, with_mtp: bool = True) -> Output:
        """Hidden states of the main model and of every MTP depth.

        tokens: int32[batch, seq]; segment_ids: int[batch, seq] (packed documents; attention never
        crosses a segment); positions: int[batch, seq] (default: restart at 0 in each segment).
        """
        self._check_inputs(tokens, segment_ids, positions)
        if segment_ids is None:
            segment_ids = jnp.zeros(tokens.shape, jnp.int32)
        if positions is None:
            positions = document_positions(segment_ids)
        cos, sin = rope_lib.rope_angles(self.cfg.rope, self.cfg.mla.qk_rope_head_dim, positions)
        mask = attention_mask(segment_ids)
        h = self.embed(tokens)
        max_logits = []
        if self.dense_layers is not None:
            h, stats = scan_stack(self.dense_layers, h, None, cos, sin, mask)
            max_logits.append(stats["max_logits"])
        load = jnp.zeros((0, self.cfg.moe.n_routed_experts), jnp.float32)
        if self.moe_layers is not None:
            h, stats = scan_stack(self.moe_layers, h, None, cos, sin, mask)
            max_logits.append(stats["max_logits"])
            load = stats["expert_load"]
        hidden = self.final_norm(h)
        mtp_hidden = mtp_stats = None
        if with_mtp and self.mtp is not None:
            mtp_hidden, mtp_stats = self.mtp(hidden, tokens, segment_ids, self.embed, cos, sin, mask)
        return Output(hidden, load, jnp.concatenate(max_logits), mtp_hidden, mtp_stats)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[..., embed] -> float32 logits [..., vocab] through the untied output head."""
        return jnp.dot(hidden, self.lm_head[...].astype(hidden.dtype), preferred_element_type=jnp.float32)

    def __call__(self, tokens, segment_ids=None, positions=None) -> jax.Array:
        """tokens: int32[batch, seq] -> float32 logits [batch, seq, vocab]."""
        return self.logits(self.forward(tokens, segment_ids, positions, with_mtp=False).hidden)

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
from composer_jax.model.attention import LatentCache, load_balanced_order
from composer_jax.model.attention_mask import causal_mask
from composer_jax.model.decoder import DecoderLayer, create_stack, scan_stack
from composer_jax.model.layers import Embed, RMSNorm, param, weight
from composer_jax.model.mtp import MTP, shifted_tokens
from composer_jax.parallel.mesh import DualMesh
from composer_jax.parallel.partitioning import activation_spec, gather_sequence, record_layout


def head_logits(head: jax.Array, hidden: jax.Array) -> jax.Array:
    """float32 logits [..., vocab] of hidden [..., embed] through an output head [embed, vocab]."""
    return jnp.dot(hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32)


def document_positions(segment_ids: jax.Array) -> jax.Array:
    """int32[batch, seq]: positions restarting at 0 where the segment id changes (packed documents)."""
    idx = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)[None]
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


class SequenceLayout:
    """Where a batch's [..., batch, seq, ...] arrays live: unsharded without a DualMesh, else
    batch-sharded on the dense mesh with the sequence on `cp`, in the load-balanced chunk order; under
    the inference placement wherever the caller put them (`partitioning.inference_batch_sharding`)."""

    def __init__(self, seq: int, dual: DualMesh | None):
        self.dual = dual
        cp = self.dual.cp if self.dual is not None else 1
        self.order = load_balanced_order(seq, cp) if cp > 1 else None
        self.inverse = np.argsort(self.order) if cp > 1 else None

    def _spec(self, ndim: int, seq_axis: int, seq_mesh_axis):
        spec = [None] * ndim
        spec[seq_axis - 1], spec[seq_axis] = "batch", seq_mesh_axis
        return activation_spec(*spec)

    def _move(self, x, seq_axis: int, permutation, to_seq):
        if self.dual is None or self.dual.inference:  # inference: the caller placed the batch (no CP)
            return x
        if permutation is not None:
            x = jax.sharding.reshard(x, self._spec(x.ndim, seq_axis, None))
            x = jnp.take(x, permutation, axis=seq_axis)
        return jax.sharding.reshard(x, self._spec(x.ndim, seq_axis, to_seq))

    def place(self, x: jax.Array) -> jax.Array:
        """[..., batch, seq] in natural order -> sharded (and chunk-ordered under CP)."""
        return self._move(x, x.ndim - 1, self.order, "seq")

    def restore(self, x: jax.Array) -> jax.Array:
        """[..., batch, seq, dim] from `place` order -> natural sequence order (still sharded)."""
        return self._move(x, x.ndim - 2, self.inverse, "seq")


class Output(NamedTuple):
    hidden: jax.Array               # [batch, seq, embed], after the final norm
    expert_load: jax.Array          # f32[moe_layers, experts]: assignments per expert, for the bias update
    dropped: jax.Array              # int32[moe_layers]: assignments dropped by a fixed-capacity dispatch
    max_logits: jax.Array           # f32[layers, heads]: largest attention logit per head (QK-clip)
    mtp_hidden: jax.Array | None    # [depths, batch, seq, embed], after each MTP head norm
    mtp_stats: dict | None          # the MTP layers' `max_logits` / `expert_load`, leading depths axis
    latents: LatentCache | None = None  # with return_latents: every layer's MLA latent of the tokens


class CausalLM(nnx.Module):
    """Token ids int32[batch, seq] -> float32 logits [batch, seq, vocab].

    `mesh`: the DualMesh the model's parameters and activations are laid out on (None: unsharded).
    It is a static attribute, recorded here and on the MoE blocks by `parallel.shard_model` (or given
    at construction), so every trace of the model is keyed on its layout.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, mesh: DualMesh | None = None):
        self.cfg = cfg
        self.mesh = mesh
        self.eos_token_ids: tuple[int, ...] = ()  # end-of-sequence ids of the checkpoint (set by its loader)
        self.embed = Embed(cfg, rngs=rngs)
        self.dense_layers = (create_stack(lambda r: DecoderLayer(cfg, False, rngs=r), cfg.num_dense_layers, rngs)
                             if cfg.num_dense_layers else None)
        self.moe_layers = (create_stack(lambda r: DecoderLayer(cfg, True, rngs=r), cfg.num_moe_layers, rngs)
                           if cfg.num_moe_layers else None)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", cfg.param_dtype, rngs=rngs)
        self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype)
        self.mtp = MTP(cfg, rngs=rngs) if cfg.mtp.num_layers else None
        record_layout(self, mesh)

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
        try:  # value checks need concrete ids (not under a trace)
            ids = np.asarray(tokens)
        except jax.errors.TracerArrayConversionError:
            return
        bad = np.argwhere((ids < 0) | (ids >= cfg.vocab_size))
        if len(bad):
            where = tuple(int(i) for i in bad[0])
            raise ValueError(f"token id {int(ids[where])} at position {list(where)} is out of range "
                             f"[0, vocab_size={cfg.vocab_size}) ({len(bad)} out-of-range ids in total)")

    def forward(self, tokens, segment_ids=None, positions=None, *, with_mtp: bool = True,
                return_latents: bool = False, prefix: LatentCache | None = None,
                absorbed: bool = False, detach_mtp_inputs: bool = False, remat: str = "none") -> Output:
        """Hidden states of the main model and of every MTP depth.

        tokens: int32[batch, seq]; segment_ids: int[batch, seq] (packed documents; attention never
        crosses a segment); positions: int[batch, seq] (default: restart at 0 in each segment).
        return_latents: also return every layer's MLA latent of these tokens (`Output.latents`).
        prefix: latents of earlier tokens (e.g. another forward's `latents`) that every token may
        attend to where `prefix.valid`; pass the new tokens' `positions` continuing after it. Gradients
        flow into the prefix unless the caller stops them.
        absorbed: attention in the absorbed form (`MLA.attend_absorbed`: the decode path; equal to the
        default up to rounding).
        detach_mtp_inputs: the MTP depths see the main hidden states and the embeddings under
        stop-gradient (a loss on `mtp_hidden` then trains the depths only: RL's MTP self-distillation).
        remat: rematerialise each layer in the backward pass ('none', 'dots': keep the matmul outputs,
        'full': keep only the layer's input; `decoder.REMAT_POLICIES`).
        Under `self.mesh` (a DualMesh) the batch is sharded on (replica, fsdp) and the sequence on cp (in
        the load-balanced chunk order, undone on the outputs); under its inference placement
        (`DualMesh.for_inference()`) the inputs stay where the caller placed them.
        """
        self._check_inputs(tokens, segment_ids, positions)
        if segment_ids is None:
            segment_ids = jnp.zeros(tokens.shape, jnp.int32)
        if positions is None:
            positions = document_positions(segment_ids)
        layout = SequenceLayout(tokens.shape[1], self.mesh)
        order = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        order_q, segment_q = layout.place(order), layout.place(segment_ids)
        mask = causal_mask(segment_q, order_q, gather_sequence(segment_q), gather_sequence(order_q))
        if prefix is not None:
            self._check_prefix(prefix, tokens.shape[0], layout, with_mtp)
            mask = mask.with_prefix(prefix.valid)
        cos, sin = rope_lib.rope_angles(self.cfg.rope, self.cfg.mla.qk_rope_head_dim, layout.place(positions))
        h = self.embed(layout.place(tokens))
        max_logits, latents = [], []
        load = jnp.zeros((0, self.cfg.moe.n_routed_experts), jnp.float32)
        dropped = jnp.zeros((0,), jnp.int32)
        first = 0
        for stack, n in ((self.dense_layers, self.cfg.num_dense_layers), (self.moe_layers, self.cfg.num_moe_layers)):
            if stack is None:
                continue
            per_layer = None if prefix is None else {
                "prefix": (prefix.c_kv[first:first + n], prefix.k_rope[first:first + n])}
            h, stats = scan_stack(stack, h, cos, sin, mask, per_layer=per_layer, remat=remat,
                                  layer_loop=self.cfg.layer_loop, return_latents=return_latents, absorbed=absorbed)
            first += n
            max_logits.append(stats["max_logits"])
            latents.append(stats.get("latent"))
            if "expert_load" in stats:
                load, dropped = stats["expert_load"], stats["dropped"]
        hidden = self.final_norm(h)
        mtp_hidden = mtp_stats = None
        if with_mtp and self.mtp is not None:
            next_tokens = layout.place(shifted_tokens(tokens, self.cfg.mtp.num_layers))
            mtp_hidden, mtp_stats = self.mtp(hidden, next_tokens, self.embed, cos, sin, mask, remat=remat,
                                             detach_inputs=detach_mtp_inputs)
            mtp_hidden = layout.restore(mtp_hidden)
        cache = None
        if return_latents:
            c_kv, k_rope = (jnp.concatenate([lat[i] for lat in latents]) for i in (0, 1))
            cache = LatentCache(layout.restore(c_kv), layout.restore(k_rope), jnp.ones(tokens.shape, bool))
        return Output(layout.restore(hidden), load, dropped, jnp.concatenate(max_logits), mtp_hidden, mtp_stats,
                      cache)

    def _check_prefix(self, prefix: LatentCache, batch: int, layout: SequenceLayout, with_mtp: bool) -> None:
        mla, layers = self.cfg.mla, self.cfg.num_layers
        want = {"c_kv": (layers, batch, None, mla.kv_lora_rank),
                "k_rope": (layers, batch, None, mla.qk_rope_head_dim), "valid": (batch, None)}
        for name, shape in want.items():
            got = getattr(prefix, name).shape
            if len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got)):
                raise ValueError(f"prefix.{name} has shape {list(got)}, expected "
                                 f"{['len' if w is None else w for w in shape]}")
        if layout.order is not None:
            raise ValueError("a prefix cannot be combined with context parallelism (cp > 1)")
        if with_mtp and self.mtp is not None:
            raise ValueError("a prefix runs the main model only: pass with_mtp=False")

    def mtp_step(self, hidden: jax.Array, tokens: jax.Array, positions: jax.Array, prefix: LatentCache | None,
                 *, depth: int = 0, absorbed: bool = False):
        """One MTP depth over a few positions of a sequence (speculative drafting).

        hidden: [batch, seq, embed] the previous depth's hidden state at those positions (the main
        model's `Output.hidden` for depth 0); tokens: int[batch, seq] the tokens that depth sees there
        (t[i+depth+1] at position i); positions: int[batch, seq]; prefix: this depth's latents of earlier
        positions (a LatentCache with a leading depths axis) or None. The positions attend causally to
        each other and to the valid prefix.
        Returns (hidden [batch, seq, embed]: the next depth's input, head-normed hidden: `logits` gives
        the distribution of t[i+depth+2], the depth's latent (c_kv [batch, seq, kv_lora], k_rope
        [batch, seq, rope])).
        """
        if self.mtp is None:
            raise ValueError("this model has no MTP depths (mtp.num_layers=0)")
        order = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        same = jnp.zeros(tokens.shape, jnp.int32)
        mask = causal_mask(same, order, same, order)
        layer_prefix = None
        if prefix is not None:
            mask = mask.with_prefix(prefix.valid)
            layer_prefix = (prefix.c_kv[depth], prefix.k_rope[depth])
        cos, sin = rope_lib.rope_angles(self.cfg.rope, self.cfg.mla.qk_rope_head_dim, positions)
        out, (normed, stats) = self.mtp.depth(depth)(hidden, cos, sin, mask, self.embed(tokens), layer_prefix,
                                                      return_latents=True, absorbed=absorbed)
        return out, normed, stats["latent"]

    def head(self, dtype) -> jax.Array:
        """The untied output head [embed, vocab] in `dtype`, whole (gathered if FSDP-sharded)."""
        return weight(self.lm_head, dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[..., embed] -> float32 logits [..., vocab] through the untied output head."""
        return head_logits(self.head(hidden.dtype), hidden)

    def __call__(self, tokens, segment_ids=None, positions=None) -> jax.Array:
        """tokens: int32[batch, seq] -> float32 logits [batch, seq, vocab]."""
        return self.logits(self.forward(tokens, segment_ids, positions, with_mtp=False).hidden)

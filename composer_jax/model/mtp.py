"""DeepSeek-V3 multi-token prediction (MTP) depths (shared/reference/kimi_arch.md 2.4).

Depth k (1..D) at position i sees the embedding of token t[i+k] and the previous depth's hidden state
h[k-1, i], and predicts t[i+k+1]:

    h'_k = eh_proj([enorm(Emb(t[i+k])) ; hnorm(h[k-1, i])])      # concat order as in every real checkpoint
    h_k  = DecoderLayer_k(h'_k)                                   # causal over the sequence
    P_k  = softmax(head_norm(h_k) @ lm_head)                      # embedding and head shared with the model

h_0 is the main model's hidden state *after* its final norm, as vLLM and SGLang feed it when serving
DeepSeek-V3's MTP weights for speculative decoding. The MTP losses live with the other training losses
(composer_jax/train/losses.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model.decoder import DecoderLayer, create_stack, scan_stack
from composer_jax.model.layers import Embed, RMSNorm, param, weight
from composer_jax.parallel import leafwise


class MTPDepth(nnx.Module):
    """One MTP depth: (h_prev, next-token embedding) -> (h_k, (head-normed h_k, layer stats))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, eps, pd = cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype
        self.dtype = jnp.dtype(cfg.dtype)
        self.enorm = RMSNorm(d, eps, "embed", pd, rngs=rngs)
        self.hnorm = RMSNorm(d, eps, "embed", pd, rngs=rngs)
        self.eh_proj = param(rngs, (2 * d, d), ("embed_concat", "embed"), pd,
                             reduction=("embed_concat",), output=("embed",))
        # DeepSeek-V3's MTP block is a layer of the last kind (MoE when the model has MoE layers).
        self.layer = DecoderLayer(cfg, cfg.num_moe_layers > 0, rngs=rngs)
        self.head_norm = RMSNorm(d, eps, "embed", pd, rngs=rngs)

    def __call__(self, h_prev, cos, sin, mask, emb, prefix=None, return_latents: bool = False,
                 absorbed: bool = False):
        """h_prev: [batch, seq, embed] (the previous depth's hidden state, the main model's for depth 1);
        emb: [batch, seq, embed] (embeddings of the tokens this depth sees). `prefix`, `return_latents`,
        `absorbed`: as for `DecoderLayer` (a decode step over this depth's own latent cache).
        Returns (h, (head-normed h, layer stats))."""
        x = jnp.concatenate([self.enorm(emb), self.hnorm(h_prev)], axis=-1).astype(self.dtype)
        h, stats = self.layer(x @ weight(self.eh_proj, self.dtype), cos, sin, mask, prefix,
                              return_latents=return_latents, absorbed=absorbed)
        return h, (self.head_norm(h), stats)


def shift_left(x: jax.Array, k: int, fill=0) -> jax.Array:
    """x[:, i] <- x[:, i + k], padding the last k columns with `fill`. x: [batch, seq]."""
    pad = jnp.full_like(x[:, :1], fill).repeat(k, axis=1)  # sharded like x's batch (Explicit axes)
    return jnp.concatenate([x[:, k:], pad], axis=1)[:, : x.shape[1]]


class MTP(nnx.Module):
    """D stacked MTP depths, run sequentially (`scan_stack`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.num_depths = cfg.mtp.num_layers
        self.layer_loop = cfg.layer_loop
        self.depths = create_stack(lambda r: MTPDepth(cfg, rngs=r), cfg.mtp.num_layers, rngs)

    def __call__(self, hidden, next_tokens, embed: Embed, cos, sin, mask, remat: str = "none", *,
                 detach_inputs: bool = False):
        """hidden: [batch, seq, embed] (main model, after final norm); next_tokens: int[depths, batch, seq]
        (depth k sees t[i+k]: `shifted_tokens`); remat: per-depth rematerialisation (`scan_stack`).
        detach_inputs: `hidden` and the token embeddings enter under stop-gradient, so a loss on the
        outputs trains the depths alone, not the shared trunk.

        Returns head-normed hidden states [depths, batch, seq, embed] and the depths' layer stats
        (each with a leading depths axis).
        """
        emb = embed(next_tokens)
        if detach_inputs:
            hidden, emb = jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(emb)
        _, (mtp_hidden, stats) = scan_stack(self.depths, hidden, cos, sin, mask, per_layer={"emb": emb}, remat=remat,
                                            layer_loop=self.layer_loop)
        return mtp_hidden, stats

    def depth(self, k: int) -> MTPDepth:
        """Depth k+1 alone (k: 0-based index into the stack), e.g. to draft one token per decode step."""
        graphdef, state = nnx.split(self.depths)
        return nnx.merge(graphdef, leafwise.tree_map(lambda x: x[k], state))  # expert leaves: on their mesh


def shifted_tokens(tokens: jax.Array, depths: int) -> jax.Array:
    """int[depths, batch, seq]: the input tokens of MTP depths 1..D, t[i+k] (0 past the end)."""
    return jnp.stack([shift_left(tokens, k) for k in range(1, depths + 1)])

"""MTP depths and loss against a PyTorch reference built from transformers' DeepSeek-V3 pieces.

The reference follows vLLM's `DeepSeekMultiTokenPredictorLayer`: h' = eh_proj([enorm(emb(t[i+1])) ;
hnorm(h0)]), one DeepseekV3DecoderLayer, then shared_head.norm and the shared lm_head; h0 is the main
model's final (post-norm) hidden state. Checkpoint keys follow DeepSeek-V3's layer-61 layout.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from safetensors.torch import save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

from composer_jax import config, from_pretrained, load_config
from composer_jax.train.losses import mtp_target_mask
from tests.hf_reference import save_random_hf_model
from tests.reference_losses import mtp_loss


def _randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if p.ndim == 1 else p.normal_(0.0, 0.08)
        for name, buf in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.5 * torch.rand_like(buf))


def _build(tmp_path):
    cfg = load_config("tiny")
    hf_model = save_random_hf_model(config.replace(cfg, **{"mtp.num_layers": 0}), tmp_path)
    torch.manual_seed(7)
    hc, d, n = hf_model.config, cfg.hidden_size, cfg.num_layers
    mtp = torch.nn.ModuleDict(dict(
        layer=DeepseekV3DecoderLayer(hc, layer_idx=n), enorm=DeepseekV3RMSNorm(d, cfg.rms_norm_eps),
        hnorm=DeepseekV3RMSNorm(d, cfg.rms_norm_eps), head_norm=DeepseekV3RMSNorm(d, cfg.rms_norm_eps),
        eh_proj=torch.nn.Linear(2 * d, d, bias=False))).float().eval()
    _randomize(mtp)
    root = f"model.layers.{n}."
    tensors = {root + k: v for k, v in mtp["layer"].state_dict().items() if ".experts." not in k}
    experts = mtp["layer"].mlp.experts  # stored fused in memory, per expert on disk (as save_pretrained does)
    for j in range(cfg.moe.n_routed_experts):
        gate, up = experts.gate_up_proj[j].chunk(2, dim=0)
        for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", experts.down_proj[j])):
            tensors[f"{root}mlp.experts.{j}.{name}.weight"] = w
    tensors.update({root + "enorm.weight": mtp["enorm"].weight, root + "hnorm.weight": mtp["hnorm"].weight,
                    root + "eh_proj.weight": mtp["eh_proj"].weight,
                    root + "shared_head.norm.weight": mtp["head_norm"].weight,
                    root + "embed_tokens.weight": hf_model.model.embed_tokens.weight,
                    root + "shared_head.head.weight": hf_model.lm_head.weight})
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp_path / "mtp.safetensors"))
    return cfg, hf_model, mtp


def _reference_logits(hf_model, mtp, tokens):
    ids = torch.as_tensor(tokens, dtype=torch.long)
    b, s = ids.shape
    with torch.no_grad():
        h0 = hf_model.model(ids).last_hidden_state                       # after the final norm
        shifted = torch.cat([ids[:, 1:], torch.zeros(b, 1, dtype=torch.long)], dim=1)
        e = hf_model.model.embed_tokens(shifted)
        x = mtp["eh_proj"](torch.cat([mtp["enorm"](e), mtp["hnorm"](h0)], dim=-1))
        pos = torch.arange(s)[None].expand(b, s)
        cos_sin = hf_model.model.rotary_emb(x, pos)
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        h1 = mtp["layer"](x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        return hf_model.lm_head(mtp["head_norm"](h1)).numpy()


def test_mtp_logits_and_loss_match_reference(tmp_path):
    cfg, hf_model, mtp = _build(tmp_path)
    model = from_pretrained(tmp_path)
    assert model.cfg.mtp.num_layers == 1  # detected from the layer stored past the last decoder layer
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, size=(2, 40), dtype=np.int32)
    out = model.forward(tokens)
    ours = np.asarray(model.logits(out.mtp_hidden[0]))
    ref = _reference_logits(hf_model, mtp, tokens)
    np.testing.assert_allclose(ours, ref, atol=1e-4)

    # Loss: depth 1 predicts t[i+2]; the last two positions have no target.
    logp = torch.log_softmax(torch.as_tensor(ref[:, :-2]), -1)
    nll = -logp.gather(-1, torch.as_tensor(tokens[:, 2:], dtype=torch.long)[..., None]).mean()
    loss = mtp_loss(model.logits, out.mtp_hidden, jnp.asarray(tokens), cfg.mtp.loss_weight)
    np.testing.assert_allclose(float(loss), cfg.mtp.loss_weight * float(nll), rtol=1e-5)


def test_mtp_targets_stay_inside_documents():
    segments = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    np.testing.assert_array_equal(mtp_target_mask(segments, 1),
                                  [[True, True, False, False, True, False, False, False]])


def test_mtp_loss_gradient_matches_finite_differences():
    cfg = load_config("tiny", ["moe.dispatch=dense"])
    from flax import nnx

    from composer_jax import CausalLM

    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 24)), jnp.int32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_of(eh):
        p = jax.tree.map(lambda x: x, params)
        p["mtp"]["depths"]["eh_proj"].set_value(eh)
        m = nnx.merge(graphdef, p, rest)
        out = m.forward(tokens)
        return mtp_loss(m.logits, out.mtp_hidden, tokens, 0.1)

    eh = params["mtp"]["depths"]["eh_proj"].get_value()
    grad = jax.grad(loss_of)(eh)
    direction = jnp.asarray(np.random.default_rng(1).normal(size=eh.shape), jnp.float32)
    eps = 1e-3
    fd = (loss_of(eh + eps * direction) - loss_of(eh - eps * direction)) / (2 * eps)
    np.testing.assert_allclose(float(jnp.vdot(grad, direction)), float(fd), rtol=2e-2)

"""composer_jax: train Kimi-K2.5-architecture MoE coding models in JAX.

The model is imported lazily, so host-side packages (`sandbox`, `tasks`, `envs`) import without jax.
"""

__version__ = "0.1.0"

__all__ = ["CausalLM", "ModelConfig", "from_pretrained", "generate", "load_config"]


def __getattr__(name: str):
    if name == "CausalLM":
        from composer_jax.model import CausalLM

        return CausalLM
    if name == "generate":
        from composer_jax.infer import generate

        return generate
    if name in ("ModelConfig", "load_config"):
        from composer_jax import config

        return getattr(config, name)
    raise AttributeError(f"module 'composer_jax' has no attribute {name!r}")


def from_pretrained(path, overrides=(), *, rngs_seed: int = 0, strict: bool = True):
    """Load a Hugging Face DeepSeek-V3 / Kimi K2 / K2.5 directory (config.json + safetensors, quantized or not),
    or a Hugging Face model id (`moonshotai/Kimi-K2.5`: from the local cache, downloaded when missing).

    `overrides`: dotted ModelConfig changes applied on top of the HF config, e.g.
    `["dtype=bfloat16", "moe.dispatch=dense", "mtp.num_layers=1"]`. MTP depths absent from the
    checkpoint but requested by `mtp.num_layers` are freshly initialized (seed `rngs_seed`). INT4 / FP8
    weights are dequantized in float32, then cast to `param_dtype`. `strict`: unexpected tensors are an
    error (else a warning). Returns the model; `model(tokens)` gives float32 logits [batch, seq, vocab];
    `model.eos_token_ids` holds the checkpoint's end-of-sequence ids (generation's default stop tokens).
    The reading is checkpoint/hf.py's (which knows only the parameter tree); the model is built here.
    """
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from composer_jax.checkpoint.hf import check_tensors, open_hf, plan_leaves, read_leaves
    from composer_jax.checkpoint.hf_config import eos_token_ids
    from composer_jax.model import CausalLM
    from composer_jax.model.mtp import MTP

    source = open_hf(path, overrides)
    cfg = source.cfg
    fresh = cfg.mtp.num_layers > source.stored_mtp
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(rngs_seed))))
    flat = dict(nnx.to_flat_state(state))
    names = {key: tuple(str(p) for p in key) for key in flat}
    leaves = plan_leaves([(names[key], var) for key, var in flat.items()], cfg, source.prefix, with_mtp=not fresh)
    check_tensors(source, leaves, 0 if fresh else cfg.mtp.num_layers, strict)
    values = read_leaves(source, leaves)
    if fresh:  # not in the checkpoint: keep a fresh init
        for key, value in nnx.to_flat_state(nnx.state(MTP(cfg, rngs=nnx.Rngs(rngs_seed)))):
            values[("mtp",) + tuple(str(p) for p in key)] = np.asarray(value.get_value())
    for key, var in flat.items():
        var.set_value(jnp.asarray(values[names[key]]))
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    model.eos_token_ids = eos_token_ids(source.path)
    return model

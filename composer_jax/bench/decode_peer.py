"""composer_jax decoding against its peer, transformers' `generate` (torch, CPU), on the same
DeepSeek-V3-architecture checkpoint: random weights saved by transformers' `save_pretrained` and read
by our `from_pretrained`, greedy, the same prompts, side by side at each batch size.

Per model size and batch: tokens/s end to end (prefill included, compilation excluded), decode-only
tokens/s (ours: the engine's decode calls; transformers': (N - 1) tokens per row over the time a
generation of N tokens takes beyond one of 1 token), the ratio, and each side's fraction of the
memory-bandwidth roofline: the bytes a decode step must read (the weights it uses and the latent
cache) against the machine's copy bandwidth, measured in the same run. transformers runs at the torch
thread count it is faster with here (`peer_threads`). Also the MoE dispatch backends
timed at each batch's decode shape, and the one our decode program picks there.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.bench.shapes import forward_shapes
from composer_jax.bench.timing import interleaved, medians

# Model sizes (overrides of the bundled tiny config): `tiny` is compute- and overhead-bound; at
# `weight_bound` a decode step reads ~250 MB of active weights (~700 MB in all), far over any
# last-level cache, so CPU decode is bound by memory bandwidth.
MODEL_SIZES = {
    "tiny": ("hidden_size=256", "intermediate_size=768", "moe.moe_intermediate_size=128"),
    "weight_bound": ("hidden_size=1024", "intermediate_size=2816", "moe.moe_intermediate_size=1024",
                     "mla.num_heads=8", "mla.q_lora_rank=384", "mla.kv_lora_rank=256", "mla.qk_nope_head_dim=64",
                     "mla.qk_rope_head_dim=32", "mla.v_head_dim=64"),
}
COPY_BYTES = 256 * 2**20    # the bandwidth probe's array: far over the last-level cache


def peer_config(name: str, prompt_len: int, new_tokens: int, extra_overrides: tuple = ()):
    """The tiny config at MODEL_SIZES[name], no MTP, positions for `prompt_len + new_tokens` (in 64s)."""
    from composer_jax import load_config

    positions = max(64, -(-(prompt_len + new_tokens) // 64) * 64)
    return load_config("tiny", [*MODEL_SIZES[name], "mtp.num_layers=0", f"rope.max_position_embeddings={positions}",
                                *extra_overrides])


def decode_peer_shapes(sizes: tuple, batches: tuple, prompt_len: int, new_tokens: int,
                       extra_overrides: tuple = ()) -> None:
    """Trace each model `decode_peer_section` builds over the largest batch and the longest sequence."""
    for name in sizes:
        forward_shapes(peer_config(name, prompt_len, new_tokens, extra_overrides), max(batches),
                       prompt_len + new_tokens)


def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Bytes/s of a large NumPy copy (each byte read once and written once), best of `repeats`."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def step_bytes(model, batch: int, context: float) -> dict:
    """Bytes one decode step of `batch` rows must read at a mean `context` of cached positions: every
    weight but the routed experts and the embedding table, the routed experts a batch touches (expected
    distinct experts under uniform routing: E (1 - (1 - k/E)^batch) per layer), one embedding row per
    row, and each row's latent cache."""
    from flax import nnx

    from composer_jax.infer.cache import latent_bytes_per_token
    from composer_jax.tree_paths import path_str

    cfg = model.cfg
    routed = embed = other = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]:
        name, size = path_str(path), leaf.size * leaf.dtype.itemsize
        if name.startswith("moe_layers/mlp/") and name.split("/")[2] in ("gate_proj", "up_proj", "down_proj"):
            routed += size
        elif name.startswith("embed/"):
            embed += size
        else:
            other += size
    experts, k = cfg.moe.n_routed_experts, cfg.moe.num_experts_per_tok
    touched = 1 - (1 - k / experts) ** batch
    weights = other + touched * routed + batch * cfg.hidden_size * jnp.dtype(cfg.dtype).itemsize
    cache = batch * context * latent_bytes_per_token(cfg)
    return {"weights": weights, "cache": cache, "total": weights + cache, "all_weights": routed + embed + other}


def peer_checkpoint(cfg, path: Path, seed: int = 0):
    """transformers' DeepseekV3ForCausalLM for `cfg` with its own random initialisation, saved to `path`."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from composer_jax.checkpoint.hf_config import hf_config_from

    torch.manual_seed(seed)
    config = DeepseekV3Config(**hf_config_from(cfg, "float32"), attn_implementation="eager")
    model = DeepseekV3ForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = None        # both sides generate every requested token
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    return model


def peer_generate(model, prompts: np.ndarray, new_tokens: int) -> tuple[float, np.ndarray]:
    """(seconds, new tokens [batch, new_tokens]) of transformers' greedy `generate`."""
    import torch

    ids = torch.as_tensor(prompts, dtype=torch.long)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - start, out[:, prompts.shape[1]:].numpy()


def peer_threads(model, prompts: np.ndarray) -> dict:
    """{"threads": torch's thread count that generates faster here (1 or every core: on a busy machine
    many threads wait on each other at every small op), "seconds": {count: s of a short generation}}."""
    import os

    import torch

    seconds = {}
    for count in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(count)
        peer_generate(model, prompts, 2)                 # the first call at a thread count pays its set-up
        seconds[count] = min(peer_generate(model, prompts, 4)[0] for _ in range(2))
    best = min(seconds, key=seconds.get)
    torch.set_num_threads(best)
    return {"threads": best, "seconds": {str(k): round(v, 4) for k, v in seconds.items()}}


def dispatch_at_decode(cfg, batch: int, repeats: int) -> dict:
    """Median ms of one MoE layer's routed experts (forward) per dispatch backend at a decode step's
    shape (`batch` tokens), compiled as the engine's programs are, in the engine's layout on one CPU
    device (per-expert arrays for the backends that take them where `dispatch.split_pays`), and the backend
    our decode program uses there."""
    from composer_jax.infer.programs import compiler_options
    from composer_jax.model import dispatch

    moe, d = cfg.moe, cfg.hidden_size
    e, f, k = moe.n_routed_experts, moe.moe_intermediate_size, moe.num_experts_per_tok
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(batch, d)), jnp.float32)
    idx = jnp.asarray(np.argsort(rng.random((batch, e)), axis=1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(batch, k)), jnp.float32)
    w = dispatch.ExpertWeights(*(jnp.asarray(0.02 * rng.normal(size=s), jnp.float32)
                                 for s in ((e, d, f), (e, d, f), (e, f, d))))
    platform = jax.default_backend()
    split = dispatch.split(w) if platform == "cpu" and dispatch.split_pays(w.gate[0].nbytes) else w
    layout = {kind: split if kind in dispatch.PER_EXPERT else w for kind in dispatch.BACKENDS}
    options = compiler_options(platform)
    calls = {kind: (lambda fn, w: lambda: fn(x, weights, idx, w))(jax.jit(fn, compiler_options=options), layout[kind])
             for kind, fn in dispatch.BACKENDS.items()}
    ms = {kind: round(1e3 * s, 3) for kind, s in medians(interleaved(calls, repeats)).items()}
    chosen = dispatch.inference_backend(platform, batch, k, e, moe.dispatch, w.gate[0].nbytes)
    return {"median_ms": ms, "chosen": chosen, "fastest": min(ms, key=ms.get)}


def compare_at(model, peer, batch: int, prompt_len: int, new_tokens: int, repeats: int, bandwidth: float) -> dict:
    """One batch size: both engines alternately, `repeats` timed runs each after an untimed warm-up."""
    from composer_jax.infer import generate

    prompts = np.random.default_rng(batch).integers(2, model.cfg.vocab_size, (batch, prompt_len))
    ours_args = dict(max_new_tokens=new_tokens, temperature=0.0, stop_tokens=[])
    generate(model, prompts.tolist(), **ours_args)      # compiles
    threads = peer_threads(peer, prompts)
    runs = {"ours": [], "ours_decode": [], "peer": [], "peer_decode": []}
    for _ in range(repeats):
        out = generate(model, prompts.tolist(), **ours_args)
        runs["ours"].append(out.tokens_per_second)
        runs["ours_decode"].append(out.decode_tokens_per_second)
        seconds, peer_tokens = peer_generate(peer, prompts, new_tokens)
        first, _ = peer_generate(peer, prompts, 1)
        runs["peer"].append(batch * new_tokens / seconds)
        runs["peer_decode"].append(batch * (new_tokens - 1) / max(seconds - first, 1e-9))
    ours, peer_rate = statistics.median(runs["ours"]), statistics.median(runs["peer"])
    ours_decode, peer_decode = statistics.median(runs["ours_decode"]), statistics.median(runs["peer_decode"])
    read = step_bytes(model, batch, prompt_len + (new_tokens - 1) / 2)
    roofline = batch * bandwidth / read["total"]
    return {"batch": batch, "ours_tokens_per_s": round(ours, 1), "transformers_tokens_per_s": round(peer_rate, 1),
            "ratio": round(ours / peer_rate, 3),
            "ours_decode_tokens_per_s": round(ours_decode, 1),
            "transformers_decode_tokens_per_s": round(peer_decode, 1),
            "decode_ratio": round(ours_decode / peer_decode, 3),
            "step_bytes": {k: int(v) for k, v in read.items()}, "roofline_tokens_per_s": round(roofline, 1),
            "ours_roofline_fraction": round(ours_decode / roofline, 4),
            "transformers_roofline_fraction": round(peer_decode / roofline, 4),
            "transformers_threads": threads,
            "same_greedy_rows": float(np.mean([a == b.tolist() for a, b in zip(out.tokens, peer_tokens)])),
            "runs": {k: [round(v, 1) for v in r] for k, r in runs.items()},
            "dispatch": dispatch_at_decode(model.cfg, batch, repeats)}


def decode_peer_section(sizes: tuple, batches: tuple, prompt_len: int, new_tokens: int, repeats: int,
                        extra_overrides: tuple = ()) -> dict:
    """Every (model size, batch) row, the measured copy bandwidth and the machine's load."""
    import os

    from composer_jax import from_pretrained

    out = {"copy_bandwidth_bytes_per_s": copy_bandwidth(), "prompt_len": prompt_len, "new_tokens": new_tokens,
           "repeats": repeats,
           "load_average_before": [round(x, 2) for x in os.getloadavg()], "sizes": {}}
    for name in sizes:
        cfg = peer_config(name, prompt_len, new_tokens, extra_overrides)
        with tempfile.TemporaryDirectory() as tmp:
            peer = peer_checkpoint(cfg, Path(tmp))
            model = from_pretrained(tmp)
        rows = [compare_at(model, peer, b, prompt_len, new_tokens, repeats, out["copy_bandwidth_bytes_per_s"])
                for b in batches]
        out["sizes"][name] = {"overrides": list(MODEL_SIZES[name]) + list(extra_overrides),
                              "weight_bytes": int(step_bytes(model, 1, 0)["all_weights"]), "rows": rows}
    out["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return out

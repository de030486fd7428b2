"""Decoding plain vs MTP-speculative, side by side: the same prompts through both engines in
alternating repetitions (greedy and sampled); decode tokens/s is the median over repetitions of tokens
emitted / time in decode calls (compilation excluded: every engine is warmed up first), the speedup the
median of the paired per-repetition ratios. Greedy speculative output must equal plain greedy output
(`same_tokens`). Also prefill throughput and the latent cache's bytes per token.

Random MTP heads draft tokens the model almost never accepts. For speed-ups where drafts are accepted
at a size no CPU can train in minutes, `self_drafting` makes a model of any size whose MTP depths draft
exactly the main model's greedy choices, while every weight is still read (`speculative_sizes`)."""

from __future__ import annotations

import statistics
import sysconfig
from pathlib import Path

STDLIB_FILES = ("json/decoder.py", "textwrap.py", "heapq.py", "bisect.py", "fnmatch.py", "shlex.py", "glob.py",
                "colorsys.py", "copy.py", "keyword.py", "queue.py", "sched.py", "this.py", "tty.py", "uu.py",
                "wave.py")


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens: the start of a function or class in standard-library files."""
    out, root = [], Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_FILES:
        path = root / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        start = max(text.find("\ndef "), 0)
        ids = [int(i) for i in tokenizer.encode(text[start:start + 4 * length])][:length]
        if len(ids) == length:
            out.append(ids)
        if len(out) == count:
            return out
    raise FileNotFoundError(f"found only {len(out)} of {count} prompt files under {root}")


def decode_run(engine, batch, new_tokens: int, sampling, warmup: bool = False) -> tuple[dict, list[list[int]]]:
    """One repetition: the batch through the engine; (throughput figures, generated tokens)."""
    engine.stats.clear()
    ids = [engine.submit(p, max_new_tokens=new_tokens, sampling=sampling(i)) for i, p in enumerate(batch)]
    done = engine.run()
    s = engine.stats
    if s["compile_s"] and not warmup:
        raise RuntimeError("a measured repetition compiled a program")
    figures = {"decode_tokens_per_s": s["decode_tokens"] / s["decode_s"] if s["decode_s"] else 0.0,
               "prefill_tokens_per_s": s["prefill_tokens"] / s["prefill_s"],
               "drafted": s["drafted"], "accepted": s["accepted"]}
    return figures, [done[i].tokens for i in ids]


def compare(model, batch, new_tokens: int, sampling, reps: int, draft_tokens: int = 0, **engine_args) -> dict:
    """Plain against speculative decoding (`draft_tokens` per step, 0: the engine's default) of `batch`."""
    from composer_jax.infer import Engine

    engines = {mode: Engine(model, speculative=mode == "speculative", draft_tokens=draft_tokens, **engine_args)
               for mode in ("plain", "speculative")}
    outputs = {}
    for mode, engine in engines.items():  # warm-up: compile every program used
        outputs[mode] = decode_run(engine, batch, new_tokens, sampling, warmup=True)[1]
    runs = {mode: [] for mode in engines}
    for _ in range(reps):
        for mode, engine in engines.items():
            runs[mode].append(decode_run(engine, batch, new_tokens, sampling)[0])
    median = lambda mode, key: statistics.median(r[key] for r in runs[mode])  # noqa: E731
    drafted = sum(r["drafted"] for r in runs["speculative"])
    accepted = sum(r["accepted"] for r in runs["speculative"])
    plain, spec = median("plain", "decode_tokens_per_s"), median("speculative", "decode_tokens_per_s")
    # Repetitions alternate between the engines: the median of the paired ratios cancels slow drifts in
    # the machine's load.
    speedup = statistics.median(s["decode_tokens_per_s"] / p["decode_tokens_per_s"]
                                for p, s in zip(runs["plain"], runs["speculative"]))
    drafts = engines["speculative"].draft_tokens
    accepted_length = 1 + accepted * drafts / drafted      # tokens per verification pass
    return {"draft_tokens": drafts, "plain_tokens_per_s": round(plain, 1), "speculative_tokens_per_s": round(spec, 1),
            "speedup": round(speedup, 3), "acceptance_rate": round(accepted / drafted, 4),
            "mean_accepted_length": round(accepted_length, 4),
            # time of one speculative step (verify drafts + 1 positions, the MTP passes, sampling) / a plain step
            "step_cost_ratio": round(accepted_length / speedup, 3),
            "same_tokens": outputs["plain"] == outputs["speculative"],  # expected for greedy only
            "plain_runs_tokens_per_s": [round(r["decode_tokens_per_s"], 1) for r in runs["plain"]],
            "speculative_runs_tokens_per_s": [round(r["decode_tokens_per_s"], 1) for r in runs["speculative"]]}


def prefill_figures(model, tokenizer, batch: int, length: int, chunk: int, reps: int) -> dict:
    """Prompt throughput: `batch` prompts of `length` tokens prefilled in chunks of `chunk` (one new
    token each), median over repetitions."""
    from composer_jax.infer import Engine, SamplingParams

    engine = Engine(model, max_slots=batch, max_len=length + 1, chunk_sizes=(chunk,))
    batch_prompts = prompts(tokenizer, batch, length)
    rates = []
    for rep in range(reps + 1):
        figures, _ = decode_run(engine, batch_prompts, 1, lambda i: SamplingParams(temperature=0.0), warmup=rep == 0)
        if rep:
            rates.append(figures["prefill_tokens_per_s"])
    return {"prefill_tokens_per_s": round(statistics.median(rates), 1), "batch": batch, "prompt_len": length,
            "chunk": chunk}


def cache_figures(cfg) -> dict:
    from composer_jax.infer.cache import latent_bytes_per_token, per_head_kv_bytes_per_token

    latent, kv = latent_bytes_per_token(cfg), per_head_kv_bytes_per_token(cfg)
    return {"latent_bytes_per_token": latent, "per_head_kv_bytes_per_token": kv, "ratio": round(kv / latent, 2),
            "dtype": cfg.dtype, "layers": cfg.num_layers,
            "latent_values_per_layer": cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim}




def self_drafting(model, wrong: bool = False):
    """A copy of `model` (one device) whose layers add nothing to the residual stream (attention's o_proj
    and every MLP's down projection zero) and whose MTP depths see only their input token (eh_proj =
    [I; 0], enorm 1, head norm = the final norm): the main model's next token is a function of the
    current token alone, and each depth drafts that function of the token it sees, which is the main
    model's greedy choice. `wrong`: eh_proj = [-I; 0], so every draft is the least likely token, never
    the greedy one. Each weight is still read: a step costs what the model's costs."""
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)
    twin = nnx.merge(graphdef, state, copy=True)
    flat = dict((".".join(map(str, path)), var) for path, var in nnx.to_flat_state(nnx.state(twin)))
    final_scale = flat["final_norm.scale"].get_value()
    for name, var in flat.items():
        value = var.get_value()
        if name.endswith(("o_proj", "down_proj")):
            var.set_value(jnp.zeros_like(value))
        elif name == "mtp.depths.eh_proj":          # [depths, 2 embed, embed]: the token's half is the identity
            d = value.shape[-1]
            half = (-1.0 if wrong else 1.0) * jnp.eye(d, dtype=value.dtype)
            var.set_value(jnp.broadcast_to(jnp.concatenate([half, jnp.zeros_like(half)]), value.shape))
        elif name == "mtp.depths.enorm.scale":
            var.set_value(jnp.ones_like(value))
        elif name == "mtp.depths.head_norm.scale":
            var.set_value(jnp.broadcast_to(final_scale, value.shape).astype(value.dtype))
    return twin


def fallback_config(prompt_len: int, new_tokens: int):
    """The tiny config, randomly initialised where no trained run is given, with the positions decoded."""
    from composer_jax import load_config

    return load_config("tiny", [f"rope.max_position_embeddings={max(64, prompt_len + new_tokens + 1)}"])


def drafting_config(name: str, prompt_len: int, new_tokens: int):
    """The config of `speculative_sizes`' model at decode_peer.MODEL_SIZES[name]: one MTP depth,
    positions for `prompt_len + new_tokens + 1` (in 64s)."""
    from composer_jax import load_config
    from composer_jax.bench.decode_peer import MODEL_SIZES

    positions = max(64, -(-(prompt_len + new_tokens + 1) // 64) * 64)
    return load_config("tiny", [*MODEL_SIZES[name], "mtp.num_layers=1", f"rope.max_position_embeddings={positions}"])


def decode_shapes(prompt_len: int, new_tokens: int, sizes: tuple) -> None:
    """Trace (shapes only) each randomly initialised model `decode_section` decodes with, over the
    engine's longest sequence (`prompt_len + new_tokens + 1`); a trained run brings its own config."""
    from composer_jax.bench.shapes import forward_shapes

    for cfg in (fallback_config(prompt_len, new_tokens), *(drafting_config(n, prompt_len, new_tokens) for n in sizes)):
        forward_shapes(cfg, 1, prompt_len + new_tokens + 1)


def speculative_sizes(sizes: tuple, drafts: tuple, prompt_len: int, new_tokens: int, reps: int,
                      batch: int = 1) -> dict:
    """Plain against speculative greedy decoding of `batch` requests per model size of
    decode_peer.MODEL_SIZES (random weights, one MTP depth, `self_drafting`: every draft accepted) and
    draft count, one decode call per generation."""
    import numpy as np
    from flax import nnx

    from composer_jax import CausalLM
    from composer_jax.bench.decode_peer import MODEL_SIZES, step_bytes
    from composer_jax.infer import SamplingParams

    out = {}
    for name in sizes:
        cfg = drafting_config(name, prompt_len, new_tokens)
        model = self_drafting(CausalLM(cfg, rngs=nnx.Rngs(0)))
        rows = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt_len)).tolist()
        engine_args = dict(max_slots=batch, max_len=prompt_len + new_tokens + 1, steps_per_call=new_tokens,
                           chunk_sizes=(prompt_len,))
        out[name] = {"overrides": list(MODEL_SIZES[name]), "batch": batch,
                     "weight_bytes": int(step_bytes(model, 1, 0)["all_weights"]),
                     "rows": [compare(model, rows, new_tokens, lambda i: SamplingParams(temperature=0.0), reps, k,
                                      **engine_args) for k in drafts]}
    return out


def decode_section(run_dir: Path | None, prompt_len: int, new_tokens: int, sizes: tuple, reps: int) -> dict:
    """Plain vs speculative greedy decoding of one request: the trained model of `run_dir` on standard
    library prompts when it holds a checkpoint, else the tiny config randomly initialised on random
    prompts (speeds are real; the acceptance rate of an untrained MTP head is not representative); and
    `speculative_sizes` for the model `sizes` (2 drafts)."""
    import numpy as np
    from flax import nnx

    from composer_jax import CausalLM
    from composer_jax.infer import SamplingParams

    checkpoints = run_dir / "checkpoints" if run_dir is not None else None
    if checkpoints is not None and checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir()):
        from composer_jax.source_weights import open_model

        opened = open_model(run_dir, [])
        model, description = opened.model, opened.description
        batch = prompts(opened.tokenizer, 1, prompt_len)
    else:
        model = CausalLM(fallback_config(prompt_len, new_tokens), rngs=nnx.Rngs(0))
        description = f"tiny, random init (no trained run{f' in {run_dir}' if run_dir else ''})"
        batch = [np.random.default_rng(0).integers(0, model.cfg.vocab_size, prompt_len).tolist()]
    max_len = min(model.cfg.rope.max_position_embeddings, prompt_len + new_tokens + 1)
    greedy = compare(model, batch, max_len - prompt_len - 1, lambda i: SamplingParams(temperature=0.0), reps,
                     max_slots=1, max_len=max_len, steps_per_call=max_len - prompt_len - 1, chunk_sizes=(prompt_len,))
    return {"model": description, "prompt_len": prompt_len, "new_tokens": max_len - prompt_len - 1, "greedy": greedy,
            "sizes": speculative_sizes(sizes, (2,), prompt_len, new_tokens, reps)}

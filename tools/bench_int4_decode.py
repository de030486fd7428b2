"""Decoding with INT4 routed experts against bfloat16 ones, side by side on one XLA device: the same
random model (bench/decode_peer.py's sizes) in bfloat16, and with `model.moe.expert_quant=int4` (the
engine holds the experts as K2.5's packed nibbles and scales and dequantizes the experts a step uses),
greedy, the same prompts, the two engines alternating per repetition:

    python tools/bench_int4_decode.py --json int4_decode.json [--sizes weight_bound] [--batches 1,32]

Prints one line per row: decode tokens/s of both (median over repetitions; compilation excluded), the
ratio, the bytes each engine holds, and the bytes a decode step must read (decode_peer.step_bytes, with
the routed experts at their stored size); writes everything to the JSON file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from composer_jax.bench.args import add_decode_args  # noqa: E402
from composer_jax.cpu_devices import use_cpu_devices  # noqa: E402

WEIGHTS = {"bf16": ("dtype=bfloat16", "param_dtype=bfloat16"),
           "int4": ("dtype=bfloat16", "param_dtype=bfloat16", "moe.expert_quant=int4")}


def held_bytes(engine) -> dict:
    """Bytes of the parameters `engine` holds: in all, and its routed experts'."""
    import jax
    from flax import nnx

    from composer_jax.model.moe import routed_expert_paths

    routed_paths = routed_expert_paths(nnx.merge(engine.graphdef, engine.state))
    total = routed = 0
    for path, var in nnx.to_flat_state(engine.state):
        size = sum(x.nbytes for x in jax.tree.leaves(var.get_value()))
        total += size
        routed += size if path in routed_paths else 0
    return {"all": total, "routed_experts": routed}


def same_weights(size: str, prompt_len: int, new_tokens: int) -> dict:
    """{name: model} for each of WEIGHTS at decode_peer's `size`, all with the same random weights."""
    from flax import nnx

    from composer_jax import CausalLM
    from composer_jax.bench.decode_peer import peer_config

    configs = {name: peer_config(size, prompt_len, new_tokens, extra) for name, extra in WEIGHTS.items()}
    state = nnx.state(CausalLM(configs["bf16"], rngs=nnx.Rngs(0)))
    return {name: nnx.merge(nnx.split(nnx.eval_shape(lambda c=cfg: CausalLM(c, rngs=nnx.Rngs(0))))[0], state)
            for name, cfg in configs.items()}


def row(models: dict, batch: int, prompt_len: int, new_tokens: int, reps: int) -> dict:
    import numpy as np

    from composer_jax.bench.decode_peer import step_bytes
    from composer_jax.infer import Engine, generate

    cfg = models["bf16"].cfg
    prompts = np.random.default_rng(batch).integers(2, cfg.vocab_size, (batch, prompt_len)).tolist()
    args = dict(max_new_tokens=new_tokens, temperature=0.0, stop_tokens=[])
    outs = {name: generate(model, prompts, **args) for name, model in models.items()}   # compiles
    rates: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(reps):
        for name, model in models.items():
            rates[name].append(generate(model, prompts, **args).decode_tokens_per_second)
    median = {name: statistics.median(r) for name, r in rates.items()}
    held = {name: held_bytes(Engine(model, max_slots=1, max_len=prompt_len + new_tokens))
            for name, model in models.items()}
    read = step_bytes(models["bf16"], batch, prompt_len + (new_tokens - 1) / 2)
    touched = 1 - (1 - cfg.moe.num_experts_per_tok / cfg.moe.n_routed_experts) ** batch   # as step_bytes counts
    int4_read = read["total"] - touched * (held["bf16"]["routed_experts"] - held["int4"]["routed_experts"])
    same = float(np.mean([a == b for a, b in zip(outs["int4"].tokens, outs["bf16"].tokens)]))
    return {"batch": batch, "decode_tokens_per_s": {k: round(v, 1) for k, v in median.items()},
            "int4_over_bf16": round(median["int4"] / median["bf16"], 3), "held_bytes": held,
            "step_read_bytes": {"bf16": int(read["total"]), "int4": int(int4_read)},
            "same_greedy_rows": same, "runs": {k: [round(v, 1) for v in r] for k, r in rates.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_args(parser, "weight_bound", "1,32")
    args = parser.parse_args(argv)
    use_cpu_devices(1)
    import os

    from composer_jax.bench.decode_peer import MODEL_SIZES

    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in MODEL_SIZES]
    if unknown:
        parser.error(f"--sizes: unknown size {unknown[0]!r} (expected some of {', '.join(MODEL_SIZES)})")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches: expected comma-separated integers, got {args.batches!r}")
    results = {"command": " ".join(["python tools/bench_int4_decode.py", *(argv if argv is not None else sys.argv[1:])]),
               "load_average_before": [round(x, 2) for x in os.getloadavg()], "sizes": {}}
    for size in sizes:
        models = same_weights(size, args.prompt_len, args.new_tokens)
        rows = []
        for batch in batches:
            rows.append(row(models, batch, args.prompt_len, args.new_tokens, args.reps))
            r = rows[-1]
            print(f"{size:>12} batch {batch:>3}: int4 {r['decode_tokens_per_s']['int4']:8.1f} tok/s, bf16 "
                  f"{r['decode_tokens_per_s']['bf16']:8.1f} tok/s, x{r['int4_over_bf16']:.2f}; held "
                  f"{r['held_bytes']['int4']['all'] / 2**20:.0f} vs {r['held_bytes']['bf16']['all'] / 2**20:.0f} MiB; "
                  f"a step reads {r['step_read_bytes']['int4'] / 2**20:.0f} vs {r['step_read_bytes']['bf16'] / 2**20:.0f} MiB",
                  flush=True)
        results["sizes"][size] = {"overrides": list(MODEL_SIZES[size]), "rows": rows}
    results["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How well an SFT run fits each assistant turn of its demonstrations (docs/coding-study.md): the mean
negative log-likelihood of the turn's tokens, teacher-forced, and how many turns greedy decoding would
reproduce token for token. A turn the agent must copy from its context (a path, a line to edit) shows
here long before it shows as a solved task.

    python tools/sft_turn_fit.py RUN DEMOS.jsonl [--every 50] [--count 20] [--turns 5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def turn_spans(mask: np.ndarray) -> list[np.ndarray]:
    """The positions of each assistant turn: the maximal runs of trained tokens (loss_mask 1)."""
    trained = np.flatnonzero(mask)
    return np.split(trained, np.flatnonzero(np.diff(trained) > 1) + 1) if len(trained) else []


def scorer(run: str, tool: str):
    """(the opened model of `run`, a jitted `log_probs(tokens: int32[rows, seq]) -> [rows, seq, vocab]`), on
    one CPU device with dense expert dispatch; a run or model directory that cannot be read exits with one
    line naming `tool` and the path."""
    from composer_jax.cpu_devices import use_cpu_devices
    use_cpu_devices(1)
    import jax

    from composer_jax.checkpoint.safetensors_io import CheckpointError
    from composer_jax.source_weights import open_model

    try:
        opened = open_model(run, ["moe.dispatch=dense"])
    except CheckpointError as e:
        raise SystemExit(f"{tool}: {e}") from None

    @jax.jit
    def log_probs(tokens):
        out = opened.model(tokens)
        return jax.nn.log_softmax(out[0] if isinstance(out, tuple) else out, -1)

    return opened, log_probs


def turn_fit(run: str, demos: Path, every: int, count: int, turns: int) -> list[tuple[float, int, int]]:
    """Per assistant turn (1..turns): (mean NLL in nats per token, turns reproduced greedily, turns seen)."""
    from composer_jax.data.chat import tokenize_conversation

    opened, log_probs = scorer(run, "sft_turn_fit")
    limit = opened.model.cfg.rope.max_position_embeddings

    seen: list[list[tuple[float, bool]]] = [[] for _ in range(turns)]
    for line in demos.read_text().splitlines()[::every][:count]:
        record = json.loads(line)
        tokens, mask = tokenize_conversation(record["messages"], lambda t: np.asarray(opened.tokenizer.encode(t)),
                                             None, record.get("tools", ()))
        tokens, mask = tokens[:limit], mask[:limit]
        lp = np.asarray(log_probs(tokens[None]))[0]
        for t, span in enumerate(turn_spans(mask)[:turns]):
            nll = -lp[span - 1, tokens[span]]
            seen[t].append((float(nll.mean()), bool((lp[span - 1].argmax(-1) == tokens[span]).all())))
    return [(float(np.mean([n for n, _ in s])), sum(e for _, e in s), len(s)) for s in seen if s]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a training run (its latest checkpoint) or a model directory")
    p.add_argument("demos", type=Path, help="the demonstrations (tasks demos output)")
    p.add_argument("--every", type=int, default=50, help="take every N-th conversation (default 50)")
    p.add_argument("--count", type=int, default=20, help="at most this many conversations (default 20)")
    p.add_argument("--turns", type=int, default=5, help="the first T assistant turns of each (default 5)")
    args = p.parse_args()
    if not args.demos.is_file():
        sys.exit(f"sft_turn_fit: {args.demos}: no such file")
    for t, (nll, exact, n) in enumerate(turn_fit(args.run, args.demos, args.every, args.count, args.turns), 1):
        print(f"turn {t}: NLL {nll:.3f} nats/token, reproduced greedily {exact}/{n}")


if __name__ == "__main__":
    main()

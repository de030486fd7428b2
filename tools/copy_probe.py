"""Whether a model copies from its context (docs/coding-study.md): sequences of random ordinary tokens,
each read twice in a row, and the mean negative log-likelihood of the first reading against the second,
the repeated-random-tokens measure of induction heads (Olsson et al., 2022). A model that cannot copy
scores the second reading like the first (about ln V nats); one that copies scores it near 0. Every
gym task needs copying: the module the instruction names, the line an edit replaces.

    python tools/copy_probe.py RUN [RUN ...] [--length 64] [--sequences 16] [--seed 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def probe_tokens(ordinary_ids: np.ndarray, length: int, sequences: int, seed: int) -> np.ndarray:
    """int32[sequences, 2 * length]: `length` ids drawn uniformly from `ordinary_ids`, then the same again."""
    first = np.random.default_rng(seed).choice(ordinary_ids, size=(sequences, length))
    return np.concatenate([first, first], axis=1).astype(np.int32)


def copy_scores(log_probs: np.ndarray, tokens: np.ndarray) -> dict:
    """From `log_probs: [sequences, 2 * length, vocab]` (position i predicts token i + 1) of `probe_tokens`'s
    rows: the mean NLL of the first reading's tokens 2..length, of the second reading's tokens, and the share
    of the second reading's tokens that greedy decoding gives."""
    length = tokens.shape[1] // 2
    nll = -np.take_along_axis(log_probs[:, :-1], tokens[:, 1:, None], -1)[..., 0]   # [sequences, 2 * length - 1]
    greedy = log_probs[:, :-1].argmax(-1) == tokens[:, 1:]
    # Token j + 1 is predicted at position j: the first reading's 2..length are 0..length-2, the second's length-1..
    return {"first_nll": float(nll[:, :length - 1].mean()), "second_nll": float(nll[:, length - 1:].mean()),
            "second_greedy": float(greedy[:, length - 1:].mean())}


def probe(run: str, length: int, sequences: int, seed: int) -> dict:
    """`copy_scores` of the model of `run` (its latest checkpoint, or a model directory), with ln V."""
    from sft_turn_fit import scorer     # tools/sft_turn_fit.py: the model and its jitted log-probabilities

    opened, log_probs = scorer(run, "copy_probe")
    if opened.tokenizer is None:
        raise SystemExit(f"copy_probe: {run} ships no tokenizer: its ordinary ids are unknown")
    vocab = opened.model.cfg.vocab_size
    ordinary = np.flatnonzero(opened.tokenizer.token_bytes()[:vocab] > 0)
    limit = opened.model.cfg.rope.max_position_embeddings
    if 2 * length > limit:
        raise SystemExit(f"copy_probe: --length {length} reads {2 * length} positions; {run} has {limit}")
    tokens = probe_tokens(ordinary, length, sequences, seed)
    scores = copy_scores(np.asarray(log_probs(tokens)), tokens)
    return {"run": run, "model": opened.description, "ln_vocab": float(np.log(len(ordinary))), **scores}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="training runs (their latest checkpoints) or model directories")
    p.add_argument("--length", type=int, default=64, help="random tokens per reading (default 64)")
    p.add_argument("--sequences", type=int, default=16, help="sequences, each read twice (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the scores here, a list with one object per run")
    args = p.parse_args(argv)
    if args.length < 2 or args.sequences < 1:
        sys.exit("copy_probe: --length must be at least 2 and --sequences at least 1")
    scores = []
    for run in args.runs:
        s = probe(run, args.length, args.sequences, args.seed)
        print(f"{s['model']}: NLL first reading {s['first_nll']:.3f}, second {s['second_nll']:.3f} nats/token "
              f"(ln V = {s['ln_vocab']:.3f}); second reading's tokens greedy {s['second_greedy']:.1%}", flush=True)
        scores.append(s)
    if args.json:
        args.json.write_text(json.dumps(scores, indent=1) + "\n")


if __name__ == "__main__":
    main()

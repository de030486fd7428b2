"""Attempts per second of an evaluation with 1 worker and with W workers, on the same tasks and model.

    python tools/bench_eval.py [--model RUN_OR_MODEL_DIR] [--workers 4] [--out bench_eval.json]

The model defaults to the tiny byte-level architecture with random weights (2048 positions), saved as
a training run in a temporary directory; random weights write no tool call, so every attempt does
the same work: `--max-turns` turns of `max_new_tokens` tokens, then grading. Two task sets:
- coding: `--coding-tasks` example tasks in the sandboxed coding environment (what `composer-jax eval
  MODEL TASKS_DIR` runs: prompts of ~1,200 tokens, the tests graded in the sandbox at the end);
- toy: `--toy-tasks` reverse tasks in ToyEnv (one turn, no sandbox: the engine's share alone).
One EngineAgent serves every run (its programs are compiled by a warm-up first), alternating 1 and W
workers `--repeats` times; reported: attempts/s (median), the ratio, and the most episodes that
advanced in one engine step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from composer_jax.agents import load_agent
from composer_jax.envs import ToyEnv, toy_tasks
from composer_jax.eval import EvalConfig, evaluate
from composer_jax.sandbox import Sandbox
from composer_jax.tasks import load_task
from composer_jax.tasks.examples import write_example_task


def _random_run(root: Path) -> Path:
    from tests.random_models import save_random_run

    return save_random_run(root / "run", ["model.rope.max_position_embeddings=2048"])


def _timed(agent, tasks, root: Path, workers: int, config: EvalConfig, **env) -> tuple[float, int]:
    """(attempts/s, most requests in one engine step) of one evaluation into a fresh directory."""
    agent.stats.clear()
    out = root / f"run-{time.monotonic_ns()}"
    start = time.perf_counter()
    summary = evaluate(agent, tasks, out, dataclasses.replace(config, workers=workers), **env)
    seconds = time.perf_counter() - start
    return summary.tasks * summary.samples / seconds, agent.stats["max_requests_per_step"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model directory or training run (default: random tiny weights)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--coding-tasks", type=int, default=8)
    p.add_argument("--toy-tasks", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="bench_eval.json")
    args = p.parse_args()
    report = {"workers": args.workers, "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens}
    with tempfile.TemporaryDirectory(prefix="composer_jax-bench-") as tmp:
        root = Path(tmp)
        model = args.model or str(_random_run(root))
        agent = load_agent(model, overrides=[f"max_new_tokens={args.max_new_tokens}", "max_len=2048",
                                             f"max_slots={args.workers}"])
        report["model"] = agent.name if args.model else "tiny, random weights"
        coding = [load_task(write_example_task(root / "tasks" / f"t{i}", i)) for i in range(args.coding_tasks)]
        sets = {"coding": (coding, {"sandbox": Sandbox()}),
                "toy": (toy_tasks("reverse", args.toy_tasks, seed=5), {"make_env": lambda: ToyEnv(agent.fmt, True)})}
        config = EvalConfig(max_turns=args.max_turns)
        try:
            for name, (tasks, env) in sets.items():
                _timed(agent, tasks[:args.workers], root, args.workers, config, **env)   # compile, warm up
                rates = {1: [], args.workers: []}
                batch = 0
                for _ in range(args.repeats):
                    for workers in rates:
                        rate, most = _timed(agent, tasks, root, workers, config, **env)
                        rates[workers].append(rate)
                        batch = max(batch, most) if workers > 1 else batch
                one, many = (statistics.median(rates[w]) for w in rates)
                report[name] = {"attempts": len(tasks), "attempts_per_s_1_worker": round(one, 3),
                                f"attempts_per_s_{args.workers}_workers": round(many, 3),
                                "ratio": round(many / one, 2), "max_requests_per_step": batch,
                                "runs": {str(w): [round(r, 3) for r in rs] for w, rs in rates.items()}}
                print(f"{name}: {len(tasks)} attempts: 1 worker {one:.2f} attempts/s, {args.workers} workers "
                      f"{many:.2f} attempts/s: {many / one:.2f}x (up to {batch} episodes per engine step)")
        finally:
            agent.close()
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Check N generated example tasks with 1 worker, then with W workers; print the speed-up, write JSON.

    python tools/bench_tasks.py [--tasks 32] [--workers 4] [--out bench_tasks.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from composer_jax.sandbox import Sandbox
from composer_jax.tasks import check_tasks, load_task
from composer_jax.tasks.examples import write_example_task


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=32)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", default="bench_tasks.json")
    args = p.parse_args()
    sandbox = Sandbox()
    with tempfile.TemporaryDirectory(prefix="composer_jax-bench-") as tmp:
        tasks = [load_task(write_example_task(Path(tmp) / f"t{i}", i)) for i in range(args.tasks)]
        seconds, rewards = {}, {}
        for workers in (1, args.workers):
            start = time.monotonic()
            results = check_tasks(tasks, sandbox, solution=True, workers=workers)
            seconds[workers] = time.monotonic() - start
            rewards[workers] = sum(r.reward for r in results) / len(results)
    ratio = seconds[1] / seconds[args.workers]
    report = {"tasks": args.tasks, "workers": args.workers, "seconds_1_worker": round(seconds[1], 2),
              f"seconds_{args.workers}_workers": round(seconds[args.workers], 2), "speedup": round(ratio, 2),
              "mean_reward": rewards}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.tasks} tasks: 1 worker {seconds[1]:.1f} s, {args.workers} workers {seconds[args.workers]:.1f} s: "
          f"{ratio:.2f}x faster (mean reward {rewards[1]:.2f} / {rewards[args.workers]:.2f}); wrote {args.out}")


if __name__ == "__main__":
    main()

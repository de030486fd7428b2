"""The cost of recording file accesses (strace) per sandboxed command: each command runs with and without
recording, alternately, `--repeats` times; prints the medians side by side, writes JSON.

    python tools/bench_file_access.py [--repeats 10] [--backend bwrap] [--out bench_file_access.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from composer_jax.sandbox import Sandbox
from composer_jax.tasks import load_task
from composer_jax.tasks.examples import write_example_task

COMMANDS = {
    "ls": "ls",
    "python -c pass": "python -c pass",
    "pytest, 3 tests, no plugins": "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -p no:cacheprovider tests",
    "pytest, 3 tests, plugins": "python -m pytest -q -p no:cacheprovider tests",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--backend", default="bwrap", choices=("bwrap", "none"))
    p.add_argument("--out", default="bench_file_access.json")
    args = p.parse_args()
    sandbox = Sandbox(args.backend)
    rows = []
    with tempfile.TemporaryDirectory(prefix="composer_jax-bench-") as tmp:
        workspace = load_task(write_example_task(Path(tmp) / "task", 0)).repo
        for name, command in COMMANDS.items():
            seconds = {False: [], True: []}
            for _ in range(args.repeats):
                for record in (False, True):        # alternately: load on the machine hits both alike
                    start = time.perf_counter()
                    result = sandbox.run(command, workspace, record_file_access=record)
                    seconds[record].append(time.perf_counter() - start)
                    if result.exit_code not in (0, 1):      # 1: the example task's stub fails its tests
                        raise SystemExit(f"{command!r} failed: {result.describe()}: {result.stderr[-300:]}")
            off, on = (statistics.median(seconds[r]) for r in (False, True))
            rows.append({"command": name, "off_ms": round(off * 1e3, 1), "on_ms": round(on * 1e3, 1),
                         "overhead_ms": round((on - off) * 1e3, 1), "overhead_pct": round(100 * (on / off - 1), 1),
                         "files_recorded": len(result.file_accesses)})
    Path(args.out).write_text(json.dumps({"backend": args.backend, "repeats": args.repeats, "median": rows},
                                         indent=2) + "\n")
    print(f"{'command':30} {'off ms':>8} {'on ms':>8} {'+ms':>7} {'+%':>6} {'files':>6}   "
          f"(median of {args.repeats}, backend {args.backend})")
    for r in rows:
        print(f"{r['command']:30} {r['off_ms']:8.1f} {r['on_ms']:8.1f} {r['overhead_ms']:7.1f} "
              f"{r['overhead_pct']:6.1f} {r['files_recorded']:6d}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

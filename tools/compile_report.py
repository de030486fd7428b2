"""Where the suite's time goes: the per-test records of `pytest --compile-report PATH` (one file per
xdist worker) as two tables, the slowest tests and the slowest files, each with its wall time and the
seconds of CPU it used (with its subprocesses) and the seconds it spent tracing, lowering and compiling
programs in the test process; then the programs that cost the most over the whole run, by name.

    python -m pytest -q -n 2 --compile-report /tmp/cr && python tools/compile_report.py /tmp/cr*

`--write-file-seconds tests/file_seconds.json` also writes each file's wall seconds, the order in which
`tests/conftest.py` starts the files (longest first).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

COLUMNS = ("wall_s", "cpu_s", "compiles", "compile_s", "traces", "trace_s", "lower_s")


def load(paths: list[Path]) -> list[dict]:
    records = []
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{n}: not a --compile-report record ({e})")
    return records


def table(rows: list[tuple[str, dict]], title: str) -> str:
    lines = [f"| {title} | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, r in rows:
        lines.append(f"| {name} | " + " | ".join(f"{r[c]:.1f}" if c.endswith("_s") else str(r[c]) for c in COLUMNS)
                     + " |")
    return "\n".join(lines)


def program_table(records: list[dict], top: int) -> str:
    """The programs (by name) with the most seconds of tracing, lowering and compiling, over all tests."""
    programs: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0])   # compiles, seconds, tests
    for r in records:
        for name, (compiles, seconds) in r.get("programs", {}).items():
            p = programs[name]
            p[0], p[1], p[2] = p[0] + compiles, p[1] + seconds, p[2] + 1
    lines = ["| program | compiles | trace+lower+compile s | tests |", "|---|---|---|---|"]
    for name, (compiles, seconds, tests) in sorted(programs.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| {name} | {compiles} | {seconds:.1f} | {tests} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="the files --compile-report wrote")
    parser.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    parser.add_argument("--by", choices=COLUMNS, default="wall_s", help="the column to rank by (default wall_s)")
    parser.add_argument("--write-file-seconds", type=Path, metavar="JSON",
                        help="write {file: wall seconds} here (the suite's file order: tests/file_seconds.json)")
    args = parser.parse_args(argv)
    records = load(args.paths)
    by_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in records:
        by_file[r["test"].split("::")[0]].update({c: r[c] for c in COLUMNS})
    total = collections.Counter()
    for counts in by_file.values():
        total.update(counts)
    tests = sorted(records, key=lambda r: -r[args.by])[:args.top]
    files = sorted(by_file.items(), key=lambda kv: -kv[1][args.by])[:args.top]
    print(table([(r["test"], r) for r in tests], "test"), end="\n\n")
    print(table(files, "file"), end="\n\n")
    print(table([(f"all {len(records)} tests", total)], "total"), end="\n\n")
    print(program_table(records, args.top))
    if args.write_file_seconds:
        ranked = sorted(by_file.items(), key=lambda kv: -kv[1]["wall_s"])
        args.write_file_seconds.write_text(json.dumps({f: round(c["wall_s"]) for f, c in ranked}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

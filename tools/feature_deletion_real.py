"""Feature-deletion (or bug-injection) tasks from a real package: its sdist from the registry, its own
test suite.

    python tools/feature_deletion_real.py OUT_DIR [--package parse==1.20.2] [--workers 2] [--max-tasks 20]
                                                  [--min-lines 3] [--level body|definition|feature]
                                                  [--family feature-deletion|bug-injection] [--seed S]

Downloads the sdist with `pip download --no-binary :all: --no-deps`, unpacks it into a temporary
directory (which is read-only to the generator), runs `composer-jax tasks feature-deletion` on it
(or `tasks bug-injection`: --min-lines and --level do not apply), then re-checks every produced task
with `composer-jax tasks check` (the workspace, and with --solution; per-task results in
OUT_DIR/check-workspace.jsonl and check-solution.jsonl) and prints the timings.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from composer_jax import cli


def download_sdist(requirement: str, dest: Path) -> Path:
    """The unpacked source tree of `requirement`'s sdist."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
                    "--dest", str(dest), requirement], check=True)
    archive = next(p for p in dest.iterdir() if p.name.endswith((".tar.gz", ".tgz")))
    with tarfile.open(archive) as tar:
        tar.extractall(dest / "src", filter="data")
    (tree,) = (dest / "src").iterdir()
    return tree


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="a new or empty directory for the tasks and report.json")
    p.add_argument("--package", default="parse==1.20.2", help="a pinned requirement (default parse==1.20.2)")
    p.add_argument("--workers", default="2")
    p.add_argument("--max-tasks", default="20")
    p.add_argument("--min-lines", default="3", help="lines of code a deletion must remove (default 3)")
    p.add_argument("--level", default="body", help="body, definition or feature (default body)")
    p.add_argument("--family", choices=("feature-deletion", "bug-injection"), default="feature-deletion")
    p.add_argument("--seed", default="0")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="composer_jax-sdist-") as tmp:
        start = time.monotonic()
        repo = download_sdist(args.package, Path(tmp))
        print(f"{args.package}: sdist unpacked in {time.monotonic() - start:.1f} s: {repo.name}")
        start = time.monotonic()
        family = ["--min-lines", args.min_lines, "--level", args.level] if args.family == "feature-deletion" else []
        code = cli.main(["tasks", args.family, str(repo), args.out_dir, "--workers", args.workers,
                         "--max-tasks", args.max_tasks, "--seed", args.seed, *family])
        print(f"generation: {time.monotonic() - start:.1f} s (exit code {code})")
        if code:
            return code
    report = json.loads((Path(args.out_dir) / "report.json").read_text())
    dirs = [str(Path(args.out_dir) / t["id"]) for t in report["tasks"]]
    for flags, name in (([], "check-workspace.jsonl"), (["--solution"], "check-solution.jsonl")):
        start = time.monotonic()
        cli.main(["tasks", "check", *dirs, *flags, "--workers", args.workers, "--json", str(Path(args.out_dir) / name)])
        print(f"tasks check {' '.join(flags) or '(workspace)'}: {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

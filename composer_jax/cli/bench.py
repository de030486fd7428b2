"""`composer-jax bench --json PATH [--quick] [--preset cpu|gpu]`: every benchmark side by side against
its reference, in one run (composer_jax/bench/suite.py), one JSON, a short table."""

from __future__ import annotations

import difflib
import importlib.util
import json
import sys
from pathlib import Path

from composer_jax.bench.suite import PRESETS, SECTIONS
from composer_jax.config import ConfigError
from composer_jax.cpu_devices import use_cpu_devices

DEFAULT_DECODE_RUN = "~/.cache/composer-jax/runs/pretrain-tiny"   # `composer-jax pretrain`'s default run
# The sections measured against transformers (torch): what each runs of it.
PEER_SECTIONS = {"decode_peer": "transformers' generate",
                 "train_peer": "a PyTorch loop over transformers' DeepseekV3ForCausalLM"}


def parse_sections(text: str) -> tuple[str, ...]:
    """'train_step,muon' -> ('train_step', 'muon'), in the suite's order; unknown names are an error."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in SECTIONS:
            close = difflib.get_close_matches(name, SECTIONS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError("", f"--sections: unknown section {name!r} (expected some of {', '.join(SECTIONS)}){hint}")
    if not names:
        raise ConfigError("", f"--sections: no section named (expected some of {', '.join(SECTIONS)})")
    return tuple(s for s in SECTIONS if s in names)


def _run_bench(args) -> int:
    sections = parse_sections(args.sections or ",".join(SECTIONS))
    out = Path(args.json).expanduser()
    if not out.parent.is_dir():   # before minutes of measuring
        raise FileNotFoundError(f"--json {args.json}: the directory {out.parent} does not exist")
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    for name, runs in PEER_SECTIONS.items():
        if name in sections and missing:
            why = f"{name} runs {runs} and needs {' and '.join(missing)} (pip install 'composer-jax[test]')"
            if args.sections:
                raise ConfigError("", f"--sections: {why}")
            print(f"composer-jax bench: leaving out {why}", file=sys.stderr)   # the default run: every section it can
            sections = tuple(s for s in sections if s != name)
    use_cpu_devices(8)            # CPU runs: 8 fake devices (dispatch and Muon shard over them)
    import jax

    backend = jax.default_backend()
    preset = args.preset if args.preset != "auto" else ("gpu" if backend == "gpu" else "cpu")
    if preset == "gpu" and backend != "gpu":
        raise ConfigError("", f"--preset gpu: the proxy MoE needs a GPU (the backend here is {backend}); "
                              "use --preset cpu")
    from composer_jax.bench import suite

    def save(results):
        out.write_text(json.dumps(results, indent=1) + "\n")

    results = suite.run(preset, args.quick, sections, Path(args.decode_run).expanduser(),
                        progress=lambda line: print(line, file=sys.stderr, flush=True), save=save)
    print(suite.table(results))
    print(f"wrote {out}")
    bad = suite.non_finite(results)
    if bad:
        print(f"composer-jax bench: error: non-finite results: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks side by side against their references (JSON + table)",
                       description="Measure the training step (tokens/s, MFU, compiled over model FLOPs), "
                                   "attention implementations, dispatch backends against dense, the RL "
                                   "teacher's share, speculative against plain decoding, our decoding and our "
                                   "training step against transformers' and Muon against optax, in one run.")
    p.add_argument("--json", required=True, metavar="PATH", help="write the results here")
    p.add_argument("--quick", action="store_true", help="a smoke run: smallest sizes, fewest repeats")
    p.add_argument("--preset", choices=("auto",) + PRESETS, default="auto",
                   help="cpu: the tiny model; gpu: the proxy MoE (configs/model/proxy-moe.yaml) sized for one "
                        "H200; auto (default): gpu on a GPU, else cpu")
    p.add_argument("--sections", default=None,
                   help=f"comma-separated subset of {', '.join(SECTIONS)} (default: all; decode_peer and train_peer "
                        "only where transformers and torch are installed)")
    p.add_argument("--decode-run", default=DEFAULT_DECODE_RUN,
                   help="trained run whose model the decode section uses (default: composer-jax pretrain's); "
                        "without a checkpoint there, a randomly initialised tiny model")
    p.set_defaults(run=_run_bench)

"""Decode against transformers' `generate` on the same DeepSeek-V3-architecture checkpoint, side by
side per model size and batch (composer_jax/bench/decode_peer.py), on one XLA device:

    python tools/bench_decode_peer.py --json decode_peer.json [--sizes tiny,weight_bound] [--batches 1,8,32,128]

Prints one line per row: tokens/s of both, the ratio, each side's fraction of the memory-bandwidth
roofline, and the MoE dispatch our decode program picks (with the fastest measured there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from composer_jax.bench.args import add_decode_args  # noqa: E402
from composer_jax.cpu_devices import use_cpu_devices  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_args(parser, "tiny,weight_bound", "1,8,32,128")
    args = parser.parse_args(argv)
    use_cpu_devices(1)
    from composer_jax.bench.decode_peer import MODEL_SIZES, decode_peer_section

    sizes = tuple(s for s in args.sizes.split(",") if s)
    unknown = [s for s in sizes if s not in MODEL_SIZES]
    if unknown:
        parser.error(f"--sizes: unknown size {unknown[0]!r} (expected some of {', '.join(MODEL_SIZES)})")
    batches = tuple(int(b) for b in args.batches.split(","))
    results = decode_peer_section(sizes, batches, args.prompt_len, args.new_tokens, args.reps)
    results["command"] = " ".join(["python tools/bench_decode_peer.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(f"copy bandwidth {results['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; load average "
          f"{results['load_average_before']} -> {results['load_average_after']}")
    for size, r in results["sizes"].items():
        for row in r["rows"]:
            d = row["dispatch"]
            print(f"{size:>12} batch {row['batch']:>3}: ours {row['ours_tokens_per_s']:9.1f} tok/s, transformers "
                  f"{row['transformers_tokens_per_s']:9.1f} tok/s, x{row['ratio']:.2f} (decode only "
                  f"x{row['decode_ratio']:.2f}); roofline {100 * row['ours_roofline_fraction']:.1f}% vs "
                  f"{100 * row['transformers_roofline_fraction']:.1f}%; dispatch {d['chosen']} "
                  f"(fastest {d['fastest']})")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

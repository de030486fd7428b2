"""Command-line flags the decode benchmarks of tools/ share (no JAX import: the tools size the CPU
devices before JAX starts)."""

from __future__ import annotations


def add_decode_args(parser, sizes: str, batches: str) -> None:
    """The flags of a decode benchmark over model sizes and batches (tools/bench_decode_peer.py,
    tools/bench_int4_decode.py), with the default sizes and batches given."""
    parser.add_argument("--json", required=True, metavar="PATH", help="write the results here")
    parser.add_argument("--sizes", default=sizes, help=f"model sizes (default: {sizes})")
    parser.add_argument("--batches", default=batches, help=f"batch sizes (default: {batches})")
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per engine and batch (default 3)")

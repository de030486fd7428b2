"""Benchmarks measured side by side in one run, each against a reference (`composer-jax bench`,
tools/bench_*.py). One module per benchmark; `timing` holds the shared interleaved timer and the
loop-aware compiled-FLOP count."""

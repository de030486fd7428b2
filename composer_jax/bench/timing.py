"""Side-by-side timing and compiled-FLOP counting shared by every benchmark section.

`interleaved` runs the contenders in alternation (a, b, a, b, ...) so that slow drifts in the machine's
load hit all of them alike; the first round compiles and is not timed. `compiled_flops` counts the
FLOPs of a program with every `lax.scan` unrolled: XLA's cost analysis counts a loop body once, which
would hide all but one layer of a scanned stack.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from composer_jax.parallel import leafwise


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """{name: [seconds per call] * repeats}: each fn called repeats + 1 times in alternation (the first
    round, which compiles, untimed); each call's outputs are waited for."""
    times = {name: [] for name in fns}
    for i in range(repeats + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            if i:
                times[name].append(time.perf_counter() - start)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(t) for name, t in times.items()}


def _take(a, i):
    with leafwise.on_mesh(leafwise.mesh_of(a)):   # a stack of the expert grid is sliced on its own mesh
        return a[i]


def _stack(*rows):
    with leafwise.on_mesh(leafwise.mesh_of(rows[0])):
        return jnp.stack(rows)


def _python_scan(f, init, xs=None, length=None, reverse=False, unroll=1, **_):
    """`jax.lax.scan`'s semantics as a Python loop: straight-line code, one copy of `f` per iteration."""
    n = length if length is not None else jax.tree.leaves(xs)[0].shape[0]
    carry, ys = init, []
    for i in range(n - 1, -1, -1) if reverse else range(n):
        carry, y = f(carry, jax.tree.map(lambda a: _take(a, i), xs))
        ys.append(y)
    ys = ys[::-1] if reverse else ys
    return carry, jax.tree.map(_stack, *ys)


@contextlib.contextmanager
def unrolled_loops():
    """Inside: `jax.lax.scan` and `jax.lax.map` run as Python loops, so a cost analysis counts every
    iteration. Only for programs lowered to be counted, never run (unrolled 61-layer stacks compile
    slowly)."""
    scan, lax_map = jax.lax.scan, jax.lax.map

    def unrolled_map(f, xs, *, batch_size=None):
        if batch_size is not None:
            return lax_map(f, xs, batch_size=batch_size)
        return _python_scan(lambda carry, x: (carry, f(x)), None, xs)[1]

    jax.lax.scan, jax.lax.map = _python_scan, unrolled_map
    try:
        yield
    finally:
        jax.lax.scan, jax.lax.map = scan, lax_map


def flops_of(stage) -> float:
    """The FLOPs XLA's cost analysis gives a Lowered or Compiled stage (summed over partitions)."""
    analysis = stage.cost_analysis()
    analysis = analysis if isinstance(analysis, (list, tuple)) else [analysis]
    return float(sum(a.get("flops", 0.0) for a in analysis))

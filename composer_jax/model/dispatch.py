"""MoE dispatch backends. All share one signature and agree wherever no token is dropped.

    dispatch(x, weights, idx, experts) -> y
    x: [tokens, embed]; weights: f32[tokens, k]; idx: int32[tokens, k];
    experts: ExpertWeights(gate [E, embed, f], up [E, embed, f], down [E, f, embed]); y: [tokens, embed]

Expert weights come stacked (one array per matrix), or for inference on one CPU device as per-expert
arrays (a tuple of E arrays per matrix, `decoder.unstack_layers`): XLA:CPU copies every slice it takes
of a stacked array before a matmul reads it (a weight-bound decode step spent 40% of its time in those
copies), while a per-expert array is read in place; `gather` and `blocked` then pick the expert with a
`lax.switch` and `dense_batched` loops over the experts.

- `dense`: every expert on every token, combined with a one-hot weight matrix. The reference.
- `dense_batched`: `dense` with the tokens broadcast over the expert axis, so each matmul is a batched
  one over the weights as stored ("td,edf" transposes every expert's weights first: 13x slower on CPU at
  decode shapes). Its rounding differs from `dense`'s by ~1e-7, which training's reference checks must
  not see; on per-expert arrays `dense` and it both loop over the experts.
- `ragged`: assignments sorted by expert, grouped matmuls (`grouped_swiglu`: `jax.lax.ragged_dot` on
  accelerators, blocks of one expert's rows in one batched matmul on CPU), unsorted and summed. Dropless;
  compute proportional to tokens * k (plus each expert's last partial block on CPU). The training default.
- `gather`: a loop over the assignments, each applying its expert's weights to its token. Reads
  tokens * k expert matrices: for decode steps of few tokens (tokens * k <= experts).
- `blocked`: assignments sorted by expert into blocks of rows of one expert each (each expert's last
  block padded), a loop over the blocks applying its expert's weights. Dropless;
  compute proportional to tokens * k plus experts * block, like `ragged`'s CPU blocks but as a loop that
  reads per-expert arrays in place (inference on one CPU device).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from composer_jax.model.quant import dense_matrix, leading


class ExpertWeights(NamedTuple):
    """Arrays, or `quant.Int4Matrix`es dequantized where a matmul reads them: `gather` and `blocked`
    dequantize only the experts they apply, the others the whole stack."""
    gate: jax.Array  # [experts, embed, moe_mlp]
    up: jax.Array    # [experts, embed, moe_mlp]
    down: jax.Array  # [experts, moe_mlp, embed]


def per_expert(w: ExpertWeights) -> bool:
    """Whether `w` holds per-expert arrays (tuples of E arrays) rather than stacked ones."""
    return isinstance(w.gate, tuple)


def num_experts_of(w: ExpertWeights) -> int:
    return len(w.gate) if per_expert(w) else w.gate.shape[0]


def split(w: ExpertWeights) -> ExpertWeights:
    """`w`'s stacked arrays as per-expert ones (tuples of E arrays; `w` itself when already split)."""
    return w if per_expert(w) else ExpertWeights(*(tuple(m) for m in w))


SMALL_EXPERT_BYTES = 1 << 20   # an expert matrix under this: per-iteration overhead outweighs its reads on CPU


def split_pays(expert_bytes: int) -> bool:
    """Whether one CPU device's inference layout holds routed experts of `expert_bytes` a matrix as
    per-expert arrays: smaller ones cost less to copy out of the stack than the `lax.switch` that picks a
    per-expert array (which also compiles slower)."""
    return expert_bytes >= SMALL_EXPERT_BYTES


def stacked(w: ExpertWeights) -> ExpertWeights:
    """`w` as stacked arrays (per-expert ones are stacked: a copy; INT4 ones dequantized)."""
    if per_expert(w):
        w = ExpertWeights(*(jax.tree.map(lambda *a: jnp.stack(a), *m) for m in w))
    return ExpertWeights(*map(dense_matrix, w))


def apply_expert(w: ExpertWeights, expert: jax.Array, fn: Callable, *args) -> jax.Array:
    """fn(gate, up, down, *args) with the matrices of `expert` (int32[], traced): sliced in place from
    stacked arrays, or the per-expert arrays chosen by a switch (read without a copy on CPU)."""
    if per_expert(w):
        return jax.lax.switch(expert, [functools.partial(fn, *m) for m in zip(*w)], *args)
    return fn(*(leading(m, expert) for m in w), *args)


def _swiglu(gate, up, down, x):
    gate, up, down = map(dense_matrix, (gate, up, down))
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def dense(x: jax.Array, weights: jax.Array, idx: jax.Array, w: ExpertWeights, batched: bool = False) -> jax.Array:
    num_experts = num_experts_of(w)
    combine = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(idx, num_experts, dtype=weights.dtype))
    if per_expert(w):     # each expert's matmuls on its own array, in turn
        outs = [_swiglu(*m, x).astype(jnp.float32) for m in zip(*w)]
        return sum(combine[:, e, None] * out for e, out in enumerate(outs)).astype(x.dtype)
    w = stacked(w)
    if batched:     # the tokens broadcast over the experts: a batched matmul over the weights as stored
        xe = jnp.broadcast_to(x, (num_experts, *x.shape))
        h = jax.nn.silu(jnp.einsum("etd,edf->etf", xe, w.gate)) * jnp.einsum("etd,edf->etf", xe, w.up)
    else:
        h = jax.nn.silu(jnp.einsum("td,edf->etf", x, w.gate)) * jnp.einsum("td,edf->etf", x, w.up)
    out = jnp.einsum("etf,efd->etd", h, w.down)
    return jnp.einsum("te,etd->td", combine, out.astype(jnp.float32)).astype(x.dtype)


dense_batched = functools.partial(dense, batched=True)


def platform() -> str:
    """The platform the program being traced is built for: its mesh's devices' (a deviceless compile for
    a GPU topology runs on CPU), else the process's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.default_backend() if mesh.empty else mesh.abstract_device.platform


def grouped_block_rows(rows: int, experts: int) -> int:
    """Rows per block of `grouped_swiglu` on CPU: about half an expert's even share of `rows`, a power of
    two in [8, 128]. Each expert's last block is padded (up to experts * (block - 1) rows of waste), and
    each block copies its expert's matrices (fewer, larger blocks copy less)."""
    half_share = max(1, rows // (2 * experts))
    return min(128, max(8, 1 << (half_share.bit_length() - 1)))


def _group_of(starts: jax.Array, length: int) -> jax.Array:
    """int32[length]: for each position, the last group whose start (starts: int[groups], nondecreasing,
    from 0) is at or before it; positions past the last group's end count as the last group. A count of
    group starts per position and its running sum (no search loop)."""
    marks = jnp.zeros((length,), jnp.int32).at[starts[1:]].add(1, mode="drop")
    return jnp.cumsum(marks)


def grouped_swiglu(xs: jax.Array, sizes: jax.Array, w: ExpertWeights) -> jax.Array:
    """SwiGLU of rows grouped by expert. xs: [rows, embed], sorted so that its first sizes[0] rows go to
    expert 0, the next sizes[1] to expert 1, ...; sizes: int32[experts] (sum <= rows; rows past the
    groups give 0); w: stacked. Returns [rows, embed].

    Off CPU: `jax.lax.ragged_dot` (grouped matmul kernels). XLA:CPU lowers `ragged_dot` to a dense matmul
    against every expert with the other groups masked (experts times the work: 237 ms against 6 ms for
    8192 rows over 16 experts of 256 x 128, docs/training.md), so on CPU the groups are laid out in blocks
    of `grouped_block_rows` rows of one expert each (each group's last block padded with zero rows), and
    one batched matmul multiplies every block by its expert's matrices."""
    rows, embed = xs.shape
    experts = sizes.shape[0]
    if platform() != "cpu":
        h = jax.nn.silu(jax.lax.ragged_dot(xs, w.gate, sizes)) * jax.lax.ragged_dot(xs, w.up, sizes)
        out = jax.lax.ragged_dot(h, w.down, sizes)
        return jnp.where((jnp.arange(rows) < sizes.sum())[:, None], out, 0)
    block = grouped_block_rows(rows, experts)
    blocks = -(-(rows + experts * (block - 1)) // block)      # the most any grouping needs
    padded = -(-sizes // block) * block
    padded_end, end = jnp.cumsum(padded), jnp.cumsum(sizes)
    padded_start, start = padded_end - padded, end - sizes
    slot = jnp.arange(blocks * block)
    slot_expert = _group_of(padded_start, blocks * block)
    offset = slot - padded_start[slot_expert]
    source = jnp.where(offset < sizes[slot_expert], start[slot_expert] + offset, rows)   # rows: a zero row
    zero = jnp.zeros((1, embed), xs.dtype)
    xb = jnp.concatenate([xs, zero])[source].reshape(blocks, block, embed)
    gate, up, down = (jnp.take(m, slot_expert[::block], axis=0) for m in w)   # [blocks, ...] each
    h = jax.nn.silu(jnp.einsum("nbd,ndf->nbf", xb, gate)) * jnp.einsum("nbd,ndf->nbf", xb, up)
    out = jnp.einsum("nbf,nfd->nbd", h, down).reshape(blocks * block, embed)
    row = jnp.arange(rows)
    row_expert = _group_of(start, rows)
    dest = jnp.where(row < end[-1], padded_start[row_expert] + row - start[row_expert], blocks * block)
    return jnp.concatenate([out, zero.astype(out.dtype)])[dest]


def ragged(x: jax.Array, weights: jax.Array, idx: jax.Array, w: ExpertWeights) -> jax.Array:
    w = stacked(w)
    tokens, k = idx.shape
    num_experts = w.gate.shape[0]
    flat_expert = idx.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)              # assignments grouped by expert
    token_of = order // k                                      # source token of each sorted assignment
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    xs = jnp.take(x, token_of, axis=0)                         # [tokens*k, embed]
    out = grouped_swiglu(xs, group_sizes, w).astype(jnp.float32)
    out = out * jnp.take(weights.reshape(-1), order)[:, None]
    y = jnp.zeros((tokens, x.shape[-1]), jnp.float32).at[token_of].add(out)
    return y.astype(x.dtype)


def gather(x: jax.Array, weights: jax.Array, idx: jax.Array, w: ExpertWeights) -> jax.Array:
    tokens, k = idx.shape

    def assignment(y, a):
        token, expert, weight = a
        return y.at[token].add(weight * apply_expert(w, expert, _swiglu, x[token]).astype(jnp.float32)), None

    owners = jnp.repeat(jnp.arange(tokens), k)
    y, _ = jax.lax.scan(assignment, jnp.zeros_like(x, jnp.float32), (owners, idx.reshape(-1), weights.reshape(-1)))
    return y.astype(x.dtype)


def block_rows(tokens: int, k: int, experts: int) -> int:
    """`blocked`'s rows per block: small while experts get few rows each (decode), larger beyond
    (prefill), as measured on CPU."""
    return 8 if tokens * k < 64 * experts else 32


def blocked(x: jax.Array, weights: jax.Array, idx: jax.Array, w: ExpertWeights) -> jax.Array:
    tokens, k = idx.shape
    num_experts, n = num_experts_of(w), idx.size
    block = block_rows(tokens, k, num_experts)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)                          # assignments grouped by expert
    sizes = jnp.bincount(flat, length=num_experts)
    padded = -(-sizes // block) * block                               # each expert's rows end on a block
    ends = jnp.cumsum(padded)
    expert_of = flat[order]
    rank = jnp.arange(n) - (jnp.cumsum(sizes) - sizes)[expert_of]      # within the expert's group
    row = (ends - padded)[expert_of] + rank
    rows = -(-(n + num_experts * (block - 1)) // block) * block      # the most any routing needs
    assignment = jnp.full((rows,), n, jnp.int32).at[row].set(order.astype(jnp.int32))   # n: padding
    block_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(0, rows, block), side="right"), num_experts - 1)
    token = jnp.where(assignment < n, assignment // k, tokens)      # padding reads a zero row
    xs = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[token].reshape(rows // block, block, -1)

    def one_block(_, a):
        xb, expert = a
        return None, apply_expert(w, expert, _swiglu, xb)

    _, out = jax.lax.scan(one_block, None, (xs, block_expert))
    scale = jnp.concatenate([weights.reshape(-1), jnp.zeros((1,), weights.dtype)])[assignment]
    y = jnp.zeros((tokens + 1, x.shape[1]), jnp.float32).at[token].add(out.reshape(rows, -1).astype(jnp.float32)
                                                                       * scale[:, None])
    return y[:tokens].astype(x.dtype)


def inference_backend(platform: str, tokens: int, k: int, experts: int, configured: str,
                      expert_bytes: int = SMALL_EXPERT_BYTES) -> str:
    """The backend for an inference forward of `tokens` tokens (a decode step, a prefill chunk) on
    `platform` (jax.default_backend()); `expert_bytes`: one expert matrix's size.

    On CPU, as measured on per-expert arrays (`composer-jax bench --sections decode_peer` records it at
    decode shapes; docs/inference.md): `gather` while the assignments are at most the experts (it
    reads only the experts assigned, once per assignment), else `blocked` (each touched expert read
    once per block of its rows). With 16 1024x1024 experts top-4, one layer: 1 token gather 3.2 ms
    against dense_batched 10.8; 8 tokens blocked 21.8 against dense_batched 25.8 and gather 29.0; 32
    tokens blocked 33.2 against 62.4 and 78.7; `ragged` was 3-6x slower. Small experts (under
    SMALL_EXPERT_BYTES) cost little to read and a loop iteration costs about as much as one expert's
    matmuls, so there `dense_batched` (one matmul per expert, no loop) takes over from `blocked` while
    its rows (every expert on every token) are at most 3x `blocked`'s (the assignments plus each
    expert's last partial block): with 16 256x128 experts at 32 tokens 1.9 ms against 2.4.
    Elsewhere the model's own (`configured`) backend."""
    if platform != "cpu":
        return configured
    if tokens * k <= experts:
        return "gather"
    padded = tokens * k + experts * (block_rows(tokens, k, experts) - 1)
    return "dense_batched" if expert_bytes < SMALL_EXPERT_BYTES and experts * tokens <= 3 * padded else "blocked"


PER_EXPERT = ("dense_batched", "gather", "blocked")   # the backends that read per-expert arrays in place
BACKENDS: dict[str, Callable[..., jax.Array]] = {"dense": dense, "dense_batched": dense_batched, "ragged": ragged,
                                                 "gather": gather, "blocked": blocked}

"""Our sharded Muon against optax.contrib.muon on every local device (8 fake CPU devices in
tools/bench_muon.py and the CPU bench).

The tree is Kimi-shaped but scaled down: stacked layers (dense first, then MoE), per-head MLA
projections, routed experts stacked per layer, shared experts, router, embedding, head and norms, with
the model's logical axis names. It is laid out as training lays out the model: on a `DualMesh` (dense
grid: fsdp over every device; expert grid: efsdp 2, ep the rest) by the partitioning rule tables of
composer_jax.parallel.partitioning. Ours runs on those Explicit-axes meshes. optax's Muon fails on
Explicit axes once a matrix dimension is sharded, so it runs on Auto-axes copies of the same meshes
with the same PartitionSpecs. Both use the same dimension numbers, float32 NS, Jordan's coefficients,
Nesterov and no weight decay.

Timing: median of interleaved runs (ours, optax, ours, ...). NS FLOPs per device come from the
compiled programs' cost analysis: ns_steps x (F(ns_steps) - F(ns_steps - 1)) (XLA counts a loop body
once, so both implementations unroll their NS loop; every iteration multiplies the same matrices);
`ns_flops_total` is the dense-GEMM count summed over matrices.
"""

from __future__ import annotations

import functools
import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from optax.contrib import MuonDimensionNumbers as MDN

from composer_jax.bench.timing import interleaved
from composer_jax.config import MeshConfig
from composer_jax.optim import muon
from composer_jax.optim.layout import matrix_view
from composer_jax.optim.newton_schulz import ns_flops
from composer_jax.optim.orthogonalize_plan import describe_leaf, ns_flops_per_device, plan_groups
from composer_jax.parallel import DualMesh
from composer_jax.parallel.partitioning import grid_of, spec_for


def kimi_tree(d=512, heads=8, q_lora=192, kv_lora=128, nope=64, rope=32, v=64, mlp=1024, moe_mlp=256,
              experts=32, dense_layers=1, moe_layers=2, vocab=4096):
    """{name: (shape, logical axes, MuonDimensionNumbers | None)}: a scaled-down Kimi K2 tree."""
    tree = {"embed": ((vocab, d), ("vocab", "embed"), None),
            "lm_head": ((d, vocab), ("embed", "vocab"), None),
            "final_norm": ((d,), ("embed",), None)}
    for kind, layers in (("dense", dense_layers), ("moe", moe_layers)):
        def add(name, shape, axes, red=None, out=None):
            dims = MDN(tuple(axes.index(a) + 1 for a in red), tuple(axes.index(a) + 1 for a in out)) if red else None
            tree[f"{kind}/{name}"] = ((layers,) + shape, ("layers",) + axes, dims)

        add("input_norm", (d,), ("embed",))
        add("post_attn_norm", (d,), ("embed",))
        add("q_a_proj", (d, q_lora), ("embed", "q_lora"), ("embed",), ("q_lora",))
        add("q_a_norm", (q_lora,), ("q_lora",))
        add("q_b_proj", (q_lora, heads, nope + rope), ("q_lora", "heads", "qk_head"), ("q_lora",), ("qk_head",))
        add("kv_a_proj", (d, kv_lora + rope), ("embed", "kv_lora_rope"), ("embed",), ("kv_lora_rope",))
        add("kv_a_norm", (kv_lora,), ("kv_lora",))
        add("kv_b_proj", (kv_lora, heads, nope + v), ("kv_lora", "heads", "kv_head"), ("kv_lora",), ("kv_head",))
        add("o_proj", (heads, v, d), ("heads", "v_head", "embed"), ("v_head",), ("embed",))
        if kind == "dense":
            for name in ("gate", "up"):
                add(f"mlp/{name}", (d, mlp), ("embed", "mlp"), ("embed",), ("mlp",))
            add("mlp/down", (mlp, d), ("mlp", "embed"), ("mlp",), ("embed",))
            continue
        add("router", (d, experts), ("embed", "router_experts"), ("embed",), ("router_experts",))
        for name in ("gate", "up"):
            add(f"shared/{name}", (d, moe_mlp), ("embed", "moe_mlp"), ("embed",), ("moe_mlp",))
            add(f"experts/{name}", (experts, d, moe_mlp), ("experts", "embed", "moe_mlp"), ("embed",), ("moe_mlp",))
        add("shared/down", (moe_mlp, d), ("moe_mlp", "embed"), ("moe_mlp",), ("embed",))
        add("experts/down", (experts, moe_mlp, d), ("experts", "moe_mlp", "embed"), ("moe_mlp",), ("embed",))
    return tree


def dual_mesh() -> DualMesh:
    """The training layout on every local device: fsdp over all of them; experts on efsdp 2 (1 on an odd
    count) times ep."""
    return DualMesh(MeshConfig(fsdp=-1, efsdp=2 if len(jax.devices()) % 2 == 0 else 1, ep=-1))


def placements(tree, dual: DualMesh) -> dict[str, NamedSharding]:
    """{name: NamedSharding} of every leaf by the training rules: its grid's mesh, its PartitionSpec."""
    return {name: NamedSharding(dual.expert if grid_of(axes) == "expert" else dual.dense,
                                spec_for(axes, shape, dual.sizes))
            for name, (shape, axes, _) in tree.items()}


def auto_axes(sharding: NamedSharding) -> NamedSharding:
    """The same devices, axis names and spec on Auto axes (what optax's Muon runs on)."""
    mesh = sharding.mesh
    return NamedSharding(Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim),
                         sharding.spec)


def ns_total(tree, steps):
    total = 0
    for shape, _, dims in tree.values():
        if dims is not None:
            view = matrix_view(shape, dims.reduction_axis, dims.output_axis)
            count = math.prod(shape[a] for a in view.batch)
            total += count * ns_flops(math.prod(shape[a] for a in view.rows), math.prod(shape[a] for a in view.cols),
                                      steps)
    return total


def padded_ns_total(tree, steps, devices):
    """NS FLOPs including zero padding when each same-shape group is padded to a multiple of `devices`."""
    groups = {}
    for shape, _, dims in tree.values():
        if dims is not None:
            view = matrix_view(shape, dims.reduction_axis, dims.output_axis)
            key = (math.prod(shape[a] for a in view.rows), math.prod(shape[a] for a in view.cols))
            groups[key] = groups.get(key, 0) + math.prod(shape[a] for a in view.batch)
    return sum(-(-count // devices) * devices * ns_flops(m, n, steps) for (m, n), count in groups.items())


def planned_ns_flops(tree, steps, chunks) -> int:
    """NS FLOPs per device that composer_jax's exchange plan assigns for `tree` on these meshes
    (`orthogonalize_plan.ns_flops_per_device`: split layers included; no compile)."""
    dual = dual_mesh()
    shardings, leaves = placements(tree, dual), []
    for name, (shape, _, dims) in tree.items():
        if dims is not None:
            view = matrix_view(shape, dims.reduction_axis, dims.output_axis)
            leaves.append(describe_leaf(len(leaves), shape, jnp.float32, view, shardings[name].mesh,
                                        shardings[name].spec))
    return ns_flops_per_device(plan_groups(leaves, chunks, dual.meshes, split=True), steps)


def print_planned_shares(tree, steps, chunks) -> None:
    """The planned per-device NS share (x total / devices) of `tree` here and of Kimi K2.5's Muon
    matrices on 64 and 256 devices (composer_jax.plan.muon.ns_share)."""
    from composer_jax.config import MeshConfig, load_config
    from composer_jax.parallel.mesh import resolve_sizes
    from composer_jax.plan.muon import ns_share

    total, devices = ns_total(tree, steps), len(jax.devices())
    planned = planned_ns_flops(tree, steps, chunks)
    print(f"bench tree on {devices} devices: planned NS FLOPs per device {planned:.4g}, "
          f"{planned / (total / devices):.4f}x total / {devices}")
    kimi = load_config("kimi-k2.5")
    for count, mesh in ((64, MeshConfig(fsdp=64, ep=64)), (256, MeshConfig(fsdp=256, ereplica=2, ep=128))):
        share = ns_share(kimi, resolve_sizes(mesh, count), steps=steps, chunks=chunks)
        print(f"kimi-k2.5 on {count} devices ({mesh.fsdp}-way FSDP, ep={mesh.ep}): {share.matrices:,} matrices, "
              f"planned NS FLOPs per device {share.per_device:.4g}, {share.ratio:.4f}x total / {count}")


def jitted_update(tx):
    """(grads, state, params) -> updates of the transformation `tx`, jitted."""
    return jax.jit(lambda g, s, p: tx.update(g, s, p)[0])


def build(tx_fn, params, steps):
    """(compiled update, state, grads) for a transformation with `steps` NS steps."""
    tx = tx_fn(steps)
    state = tx.init(params)
    grads = jax.tree.map(lambda p: p * 0.5 + 0.1, params)
    compiled = jitted_update(tx).lower(grads, state, params).compile()
    return compiled, state, grads


def contenders(tree, chunks: int) -> dict:
    """{"ours" | "optax": (NS steps -> transformation, {leaf: NamedSharding})}: each Muon with the same
    hyperparameters and the placement it runs on (ours: Explicit axes; optax's: Auto-axes copies)."""
    dims = {k: d for k, (_, _, d) in tree.items()}
    dual = dual_mesh()
    explicit = placements(tree, dual)
    auto = {name: auto_axes(s) for name, s in explicit.items()}
    common = dict(learning_rate=0.02, muon_weight_dimension_numbers=dims)

    def ours(steps):
        return muon(ns_steps=steps, ns_dtype=jnp.float32, chunks=chunks, meshes=dual.meshes, **common)

    def theirs(steps):
        return optax.contrib.muon(ns_steps=steps, **common)

    return {"ours": (ours, explicit), "optax": (theirs, auto)}


def muon_shapes(experts: int = 32, moe_layers: int = 2, ns_steps: int = 5, chunks: int = 4) -> None:
    """Trace (shapes only) both updates `compare(experts, moe_layers, ns_steps, chunks)` times."""
    tree = kimi_tree(experts=experts, moe_layers=moe_layers)
    for tx_fn, shardings in contenders(tree, chunks).values():
        params = {k: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=shardings[k]) for k, (shape, *_) in tree.items()}
        tx = tx_fn(ns_steps)
        jax.eval_shape(jitted_update(tx), params, jax.eval_shape(tx.init, params), params)


def cost(compiled) -> dict:
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    mem = compiled.memory_analysis()
    peak = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
            - mem.alias_size_in_bytes)
    return {"flops": float(analysis["flops"]), "peak_bytes": int(peak)}


def collectives(compiled) -> dict:
    text = compiled.as_text()
    return {op: sum(f" {op}(" in line or f" {op}-start(" in line for line in text.splitlines())
            for op in ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")}


def compare(experts: int = 32, moe_layers: int = 2, ns_steps: int = 5, chunks: int = 4, repeats: int = 7) -> dict:
    """Ours and optax's Muon on the same tree and gradients: median seconds per update, the speedup,
    the largest relative difference of any leaf's update, NS FLOPs per device against total / devices,
    peak bytes and collectives of each compiled update."""
    devices = len(jax.devices())
    tree = kimi_tree(experts=experts, moe_layers=moe_layers)
    rng = np.random.default_rng(0)
    values = {k: (0.02 * rng.standard_normal(shape)).astype(np.float32) for k, (shape, *_) in tree.items()}
    results = {}
    for name, (tx_fn, shardings) in contenders(tree, chunks).items():
        params = {k: jax.device_put(values[k], shardings[k]) for k in tree}
        compiled, state, grads = build(tx_fn, params, ns_steps)
        one_fewer, *_ = build(tx_fn, params, ns_steps - 1)     # every NS iteration costs the same FLOPs
        per_iteration = cost(compiled)["flops"] - cost(one_fewer)["flops"]
        results[name] = dict(compiled=compiled, args=(grads, state, params), cost=cost(compiled),
                             ns_flops=ns_steps * per_iteration, collectives=collectives(compiled))
        results[name]["updates"] = jax.device_get(compiled(*results[name]["args"]))  # also the warm-up
    # Same numbers: the largest relative (Frobenius) difference of any leaf's update.
    max_rel_error = max(float(np.linalg.norm(results["ours"]["updates"][k] - results["optax"]["updates"][k])
                              / np.linalg.norm(results["optax"]["updates"][k])) for k in tree)

    times = interleaved({name: functools.partial(results[name]["compiled"], *results[name]["args"])
                         for name in ("ours", "optax")}, repeats)

    total = ns_total(tree, ns_steps)
    out = {
        "ours_s": statistics.median(times["ours"]),
        "optax_s": statistics.median(times["optax"]),
        "speedup": statistics.median(times["optax"]) / statistics.median(times["ours"]),
        "max_rel_error_vs_optax": max_rel_error,
        "ns_flops_total": total,
        "ns_flops_total_padded": padded_ns_total(tree, ns_steps, devices),
        "ns_flops_per_device_ideal": total / devices,
        "ns_flops_per_device_ours": results["ours"]["ns_flops"],
        "ns_flops_per_device_planned": planned_ns_flops(tree, ns_steps, chunks),
        "ns_flops_per_device_optax": results["optax"]["ns_flops"],
        "ns_share_ours": results["ours"]["ns_flops"] / (total / devices),
        "ns_share_optax": results["optax"]["ns_flops"] / (total / devices),
        "peak_bytes_ours": results["ours"]["cost"]["peak_bytes"],
        "peak_bytes_optax": results["optax"]["cost"]["peak_bytes"],
        "step_flops_per_device_ours": results["ours"]["cost"]["flops"],
        "step_flops_per_device_optax": results["optax"]["cost"]["flops"],
        "collectives_ours": results["ours"]["collectives"],
        "collectives_optax": results["optax"]["collectives"],
        "times_ours_s": times["ours"],
        "times_optax_s": times["optax"],
        "config": {"devices": devices, "ns_steps": ns_steps, "chunks": chunks, "experts": experts,
                   "moe_layers": moe_layers, "ns_dtype": "float32", "coefficients": "jordan",
                   "matrices": sum(math.prod(s[a] for a in matrix_view(s, d.reduction_axis, d.output_axis).batch)
                                   for s, _, d in tree.values() if d is not None),
                   "parameters": int(sum(math.prod(s) for s, *_ in tree.values()))},
    }
    return out

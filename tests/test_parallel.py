"""Dual-grid HSDP on 8 fake CPU devices: mesh rules, placements, grid crossings, expert-parallel dispatch."""

import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax import CausalLM, load_config
from composer_jax.config import ConfigError, MeshConfig
from composer_jax.model import dispatch, expert_parallel
from composer_jax.model.expert_parallel import sharded_dispatch
from composer_jax.parallel import DualMesh, param_shardings, state_shardings
from composer_jax.parallel.leafwise import per_mesh
from composer_jax.parallel.mesh import DENSE_TOKEN_AXES, resolve_sizes
from composer_jax.parallel.partitioning import sharding_dump

GOLDEN = Path(__file__).parent / "golden"
COLLECTIVES = re.compile(r"\b(all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute)[-.(\s]")


def test_mesh_layout_errors():
    with pytest.raises(ConfigError, match=r"replica=2 x fsdp=2 x cp=1 = 4 devices, but there are 8"):
        DualMesh(MeshConfig(replica=2, fsdp=2, cp=1))
    with pytest.raises(ConfigError, match="ep=8 must divide n_routed_experts=12"):
        DualMesh(MeshConfig(ep=8), model=load_config("tiny", ["moe.n_routed_experts=12", "moe.n_group=1",
                                                              "moe.topk_group=1"]))
    with pytest.raises(ConfigError, match="cannot fill"):
        DualMesh(MeshConfig(fsdp=-1, cp=3))
    with pytest.raises(ConfigError, match="at most one of"):
        MeshConfig(replica=-1, fsdp=-1)
    dual = DualMesh(MeshConfig(replica=2, fsdp=-1, cp=2, ereplica=2, ep=-1))
    assert dual.sizes == {"replica": 2, "fsdp": 2, "cp": 2, "ereplica": 2, "efsdp": 1, "ep": 4}
    assert list(dual.dense.devices.flat) == list(dual.expert.devices.flat)  # one device order


def _dump(config_name: str, mesh_cfg: MeshConfig, devices: int) -> dict:
    cfg = load_config(config_name)
    state = nnx.state(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))
    sizes = resolve_sizes(mesh_cfg, devices)
    return {"config": config_name, "devices": devices, "sizes": sizes, "params": sharding_dump(state, sizes)}


GOLDEN_CASES = {
    "sharding_tiny_8.json": ("tiny", MeshConfig(fsdp=8, ep=8), 8),
    "sharding_kimi-k2.5_64.json": ("kimi-k2.5", MeshConfig(replica=8, fsdp=8, cp=1, ep=64), 64),
}


@pytest.mark.parametrize("name", list(GOLDEN_CASES))
def test_golden_sharding_dump(name):
    """Every parameter's grid and spec. Regenerate on purpose with UPDATE_GOLDEN=1 and review the diff."""
    dump = _dump(*GOLDEN_CASES[name])
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(json.dumps(dump, indent=1, sort_keys=True) + "\n")
    assert dump == json.loads(path.read_text()), f"parameter placement changed: review and regenerate {name}"
    params = dump["params"]
    assert all(p["mesh"] == "expert" and p["spec"][1] == "ep" for k, p in params.items()
               if k.endswith(("mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")) and "moe_layers" in k)


def test_large_leaves_are_split_evenly_params_and_optimizer_state():
    """Per-device bytes are total / 8 for every large leaf of the params and of AdamW's state."""
    cfg = load_config("tiny")
    dual = DualMesh(MeshConfig(replica=2, fsdp=4, cp=1, ereplica=1, ep=8), model=cfg)
    state = nnx.state(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    shardings = param_shardings(state, dual)
    placed = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                          nnx.to_pure_dict(state), nnx.to_pure_dict(shardings))
    opt_state = jax.eval_shape(per_mesh(lambda mesh, members: optax.adamw(1e-3)).init, placed)
    opt_shardings = state_shardings(opt_state, dual)
    pairs = [(v.get_value(), s.get_value()) for (_, v), (_, s)
             in zip(nnx.to_flat_state(state), nnx.to_flat_state(shardings))]
    pairs += list(zip(jax.tree.leaves(opt_state), jax.tree.leaves(opt_shardings)))
    large = [(x, s) for x, s in pairs if x.size >= 4096]
    assert len(large) >= 30
    for x, s in large:
        per_device = np.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
        total = x.size * x.dtype.itemsize
        dense_share = total / 4 if s.mesh is dual.dense else total / 8  # fsdp=4, replica=2 (HSDP)
        assert per_device == dense_share, (x.shape, s.spec)
    # The expert weights hold 1/8 of their bytes per device (ep=8).
    gate = shardings["moe_layers"]["mlp"]["gate_proj"].get_value()
    assert gate.mesh is dual.expert and gate.spec == P(None, "ep", None, None)


def test_grid_crossing_compiles_to_no_collective():
    dual = DualMesh(MeshConfig(replica=2, fsdp=2, cp=2, ereplica=2, ep=4))
    x = jax.device_put(jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16),
                       NamedSharding(dual.dense, P(DENSE_TOKEN_AXES, None)))

    def cross(x):
        y = dual.to_expert(x)
        with dual.expert_scope():
            y = jnp.sin(y) * 2
        return dual.to_dense(y)

    with dual:
        fn = jax.jit(cross)
        hlo = fn.lower(x).compile().as_text()
        out = fn(x)
    assert not COLLECTIVES.search(hlo), COLLECTIVES.findall(hlo)
    np.testing.assert_allclose(out, np.sin(np.asarray(x)) * 2, rtol=1e-6)
    assert out.sharding.spec == P(DENSE_TOKEN_AXES, None)
    # Control: the same hop with a mismatched token layout does need a collective.
    with dual:
        mixed = jax.jit(lambda x: jax.sharding.reshard(x, NamedSharding(dual.expert, P(None, "ep"))))
        assert COLLECTIVES.search(mixed.lower(x).compile().as_text())


def _dispatch_case(seed=0, tokens=64, experts=16, k=4, d=12, f=10):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(tokens, d)).astype(np.float32)
    idx = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    idx[: tokens // 2, 0] = 3   # skew: half the tokens hit expert 3, so a small capacity drops
    idx[: tokens // 2] = np.stack([np.concatenate([[3], rng.choice(np.delete(np.arange(experts), 3), k - 1,
                                                                     replace=False)]) for _ in range(tokens // 2)])
    weights = rng.uniform(size=(tokens, k)).astype(np.float32)
    w = dispatch.ExpertWeights(*(0.3 * rng.normal(size=s).astype(np.float32)
                                 for s in ((experts, d, f), (experts, d, f), (experts, f, d))))
    return x, weights, idx, w


def _run_sharded(kind, factor, mesh_cfg, case):
    x, weights, idx, w = case
    dual = DualMesh(mesh_cfg)
    tok = NamedSharding(dual.dense, P(DENSE_TOKEN_AXES, None))
    args = [jax.device_put(a, tok) for a in (x, weights, idx)]
    experts = [jax.device_put(a, NamedSharding(dual.expert, P("ep"))) for a in w]

    def run(x, weights, idx, *experts):
        return sharded_dispatch(kind, dual, x, weights, idx, dispatch.ExpertWeights(*experts), factor)

    with dual:
        y, load, dropped = jax.jit(run)(*args, *experts)
    return np.asarray(y), np.asarray(load), int(dropped)


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(fsdp=8, ep=8), MeshConfig(replica=2, fsdp=2, cp=2, ereplica=2,
                                                                           efsdp=2, ep=2)])
def test_ep_a2a_dropless_equals_dense_and_reports_drops(mesh_cfg):
    case = _dispatch_case()
    x, weights, idx, w = case
    ref = np.asarray(dispatch.dense(x, weights, idx, w))
    y, load, dropped = _run_sharded("ep_a2a", 0.0, mesh_cfg, case)
    assert dropped == 0
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(load, np.bincount(idx.reshape(-1), minlength=16))
    for kind in ("ragged", "dense", "gather", "blocked"):  # the replicated-experts backends on the mesh agree too
        np.testing.assert_allclose(_run_sharded(kind, 0.0, mesh_cfg, case)[0], ref, rtol=1e-5, atol=1e-5)

    # Capacity factor 1: each device pair gets its even share of slots; the skewed expert overflows.
    y_small, _, dropped_small = _run_sharded("ep_a2a", 1.0, mesh_cfg, case)
    assert dropped_small > 0
    # Dropped copies contribute nothing: the output equals dense dispatch with those weights zeroed.
    assert np.abs(y_small - ref).max() > 1e-3


def test_ep_a2a_drops_exactly_the_overflow():
    """Against an independent per-device count: copies beyond the capacity of a (source, dest) pair."""
    case = _dispatch_case(seed=1)
    x, weights, idx, w = case
    ep, tokens_per_device, num_local = 8, 64 // 8, 16 // 8
    slots = int(np.ceil(1.0 * tokens_per_device * 4 / ep))
    expected = 0
    for device in range(8):
        dest = idx[device * tokens_per_device:(device + 1) * tokens_per_device].reshape(-1) // num_local
        expected += sum(max(0, c - slots) for c in np.bincount(dest, minlength=ep))
    kept = np.ones_like(weights)
    for device in range(8):  # zero the dropped copies: later ones in token order overflow first
        rows = slice(device * tokens_per_device, (device + 1) * tokens_per_device)
        seen = np.zeros(ep, int)
        for t in range(rows.start, rows.stop):
            for j in range(4):
                d = idx[t, j] // num_local
                kept[t, j] = seen[d] < slots
                seen[d] += 1
    y, _, dropped = _run_sharded("ep_a2a", 1.0, MeshConfig(fsdp=8, ep=8), case)
    assert dropped == expected > 0
    np.testing.assert_allclose(y, np.asarray(dispatch.dense(x, weights * kept, idx, w)), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_ep_ragged_equals_dense_on_gpu():
    case = _dispatch_case()
    x, weights, idx, w = case
    y, _, dropped = _run_sharded("ep_ragged", 0.0, MeshConfig(fsdp=-1, ep=-1), case)
    assert dropped == 0
    np.testing.assert_allclose(y, np.asarray(dispatch.dense(x, weights, idx, w)), rtol=1e-4, atol=1e-4)


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
    """jax.lax.ragged_all_to_all's documented semantics built from all_gather (XLA:CPU lacks the op):
    source s's rows [input_offsets_s[r], +send_sizes_s[r]) land in rank r's output at output_offsets_s[r]."""
    me = jax.lax.axis_index(axis_name)
    rows = jax.lax.all_gather(operand, axis_name)                       # [src, n, ...]
    start = jax.lax.all_gather(output_offsets, axis_name)[:, me]        # [src]: where its block lands here
    size = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    offset = jax.lax.all_gather(input_offsets, axis_name)[:, me]
    i = jnp.arange(output.shape[0])[:, None]
    inside = (i >= start) & (i < start + size)                          # [out_rows, src]
    src = jnp.argmax(inside, axis=1)
    row = jnp.clip(offset[src] + i[:, 0] - start[src], 0, operand.shape[0] - 1)
    got = rows[src, row]
    keep = inside.any(axis=1).reshape((-1,) + (1,) * (operand.ndim - 1))
    return jnp.where(keep, got, output)


def test_ep_ragged_exchange_logic_with_emulated_collective(monkeypatch):
    """The offsets and sizes ep_ragged computes are right: with the collective emulated on CPU it
    equals dense dispatch, on two layouts. The real op runs in the GPU test."""
    from composer_jax.model import expert_parallel

    monkeypatch.setattr(expert_parallel.jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    case = _dispatch_case(seed=2)
    x, weights, idx, w = case
    ref = np.asarray(dispatch.dense(x, weights, idx, w))
    for mesh_cfg in (MeshConfig(fsdp=8, ep=8), MeshConfig(replica=2, fsdp=4, ereplica=2, ep=4)):
        y, _, dropped = _run_sharded("ep_ragged", 0.0, mesh_cfg, case)
        assert dropped == 0
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def _ragged_kept(idx, devices, ep, num_local, rows):
    """Independent numpy model of ep_ragged's drop policy: which copies arrive. Each destination takes
    `rows` copies; past that every source's block to it is cut by the same fraction (rounded down),
    keeping each block's earliest copies in token order. Devices are the flat token shards; device i
    is ep rank i % ep of its ep group."""
    tokens, k = idx.shape
    per = tokens // devices
    kept = np.ones(idx.shape, bool)
    for group in range(devices // ep):
        members = [group * ep + r for r in range(ep)]
        dest = {m: idx[m * per:(m + 1) * per] // num_local for m in members}
        sizes = np.array([[np.sum(dest[m] == r) for r in range(ep)] for m in members])   # [src, dst]
        for r in range(ep):
            total = sizes[:, r].sum()
            quota = sizes[:, r] if total <= rows else np.floor(sizes[:, r] * rows / total).astype(int)
            for src, m in enumerate(members):
                seen = 0
                for t in range(per):
                    for j in range(k):
                        if dest[m][t, j] == r:
                            kept[m * per + t, j] = seen < quota[src]
                            seen += 1
    return kept


def test_ep_ragged_drops_past_its_receive_buffer(monkeypatch):
    """With capacity factor 1 a skewed routing overflows the receive buffer of the rank holding expert 3:
    exactly the copies the independent model of the drop policy drops are missing from the output, and
    they are counted."""
    from composer_jax.model import expert_parallel

    monkeypatch.setattr(expert_parallel.jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    case = _dispatch_case(seed=3)
    x, weights, idx, w = case
    for mesh_cfg, ep in ((MeshConfig(fsdp=8, ep=8), 8), (MeshConfig(replica=2, fsdp=4, ereplica=2, ep=4), 4)):
        rows = expert_parallel.receive_rows(64 // 8, 4, 16 // ep, ep, 1.0)
        assert rows == 8 * 4   # the expected assignments per device
        kept = _ragged_kept(idx, 8, ep, 16 // ep, rows)
        y, _, dropped = _run_sharded("ep_ragged", 1.0, mesh_cfg, case)
        assert dropped == int((~kept).sum()) > 0
        np.testing.assert_allclose(y, np.asarray(dispatch.dense(x, weights * kept, idx, w)), rtol=1e-5, atol=1e-5)


def test_dispatch_buffers_are_bounded_at_kimi_scale():
    """ep=64, k=8, 4096 local tokens, 384 experts: with the default capacity factor the exchange buffers
    hold at most ~2x the 32768 assignments of a device; dropless ep_a2a needs 48x."""
    from composer_jax.config import MoEConfig

    factor = MoEConfig(n_routed_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048).capacity_factor
    assignments = 4096 * 8
    for kind in ("ep_a2a", "ep_ragged"):
        rows = expert_parallel.dispatch_rows(kind, 4096, 8, 384 // 64, 64, factor)
        assert max(rows.values()) <= 2 * assignments, (kind, rows)
    assert expert_parallel.dispatch_rows("ep_a2a", 4096, 8, 6, 64, 0.0)["send"] == 48 * assignments


def test_model_traces_are_keyed_on_the_layout():
    """The same parameters under two DualMeshes with one dense mesh and different expert layouts: one
    `nnx.jit` traces once per layout (the layout is static model data, not a context read at trace
    time, which jit would not see), and both equal the unsharded model."""
    cfg = load_config("tiny", ["moe.dispatch=ep_a2a", "moe.capacity_factor=0", "mtp.num_layers=0"])
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 16)).astype(np.int32)
    expected = np.asarray(CausalLM(load_config("tiny", ["mtp.num_layers=0"]), rngs=nnx.Rngs(0))(tokens))
    traces = []

    @nnx.jit
    def logits(model, tokens):
        traces.append(model.mesh)
        return model(tokens)

    for expert_layout in (dict(ereplica=1, ep=8), dict(ereplica=2, ep=4)):
        dual = DualMesh(MeshConfig(replica=1, fsdp=8, cp=1, **expert_layout), model=cfg)
        model = CausalLM(cfg, rngs=nnx.Rngs(0), mesh=dual)  # same (unplaced) inputs for both layouts
        with dual:
            np.testing.assert_allclose(np.asarray(logits(model, tokens)), expected, rtol=2e-5, atol=2e-5)
    assert [t.sizes["ep"] for t in traces] == [8, 4]
    # Equal layouts built twice compare equal, so they share one trace.
    assert DualMesh(MeshConfig(fsdp=8, ep=8)) == DualMesh(MeshConfig(fsdp=8, ep=8))

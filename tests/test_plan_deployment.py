"""The plan of an RL deployment (`composer-jax plan --engines`): an engine's bytes per device against a
real engine's arrays on its devices (INT4 and float experts), a version's bytes against the learner's
offered version, the temporaries against their closed forms, and the K2.5 plan the docs quote."""

import json
import math
from types import SimpleNamespace

import jax
import pytest
from flax import nnx

from composer_jax import load_config
from composer_jax.cli import main
from composer_jax.config import MeshConfig
from composer_jax.infer import Engine
from composer_jax.infer.generate import engine_grids
from composer_jax.model.moe import routed_expert_paths
from composer_jax.parallel import DualMesh, shard_model
from composer_jax.plan.deployment import learner_quantizing, plan_engine, version_traffic
from composer_jax.plan.memory import layout_sizes
from composer_jax.rl.engines import offered_weights
from composer_jax.rl.exchange.transport_device import KEEP_VERSIONS, DeviceWeightServer
from tests.random_models import random_model
from tests.test_rl_remote import _config as _remote_config


def _bytes_on(tree, device) -> int:
    """Bytes of `tree`'s arrays held on `device`."""
    return sum(shard.data.nbytes for x in jax.tree.leaves(tree) for shard in x.addressable_shards
               if shard.device == device)


@pytest.mark.parametrize("weights", ["int4", "learner"])
def test_an_engines_bytes_per_device_are_those_it_holds(weights):
    """An engine of 2 devices (the rl-engine grid) serving 4 slots of 64 positions: parameters and cache
    on each device as planned, to the byte; with INT4, one layer's local experts dequantized."""
    cfg = load_config("tiny", ["moe.expert_quant=int4"] if weights == "int4" else [])
    devices = jax.devices()[:2]
    engine = Engine(shard_model(random_model(cfg, 1), engine_grids(cfg, devices)), max_slots=4, max_len=64)
    plan = plan_engine(cfg, 2, int4=weights == "int4", slots=4, max_len=64)
    routed = routed_expert_paths(nnx.merge(engine.graphdef, engine.state))
    held = dict(nnx.to_flat_state(engine.state))
    for device in devices:
        assert _bytes_on([v for p, v in held.items() if p in routed], device) == plan.routed_params
        assert _bytes_on([v for p, v in held.items() if p not in routed], device) == plan.dense_params
        assert _bytes_on(engine.cache, device) == plan.cache
    moe, layer = cfg.moe, cfg.moe.n_routed_experts // plan.sizes["ep"] * 3 * cfg.hidden_size
    assert plan.dequantized_layer == (layer * moe.moe_intermediate_size * 4 if weights == "int4" else 0)
    assert plan.total == plan.params + plan.cache + plan.dequantized_layer and plan.swapping == plan.total + plan.params


def test_a_versions_bytes_are_the_learners_offered_version(tmp_path):
    """The bytes each engine reads per version: the learner's offered version (INT4 experts quantized on
    the learner); a learner host's share; what the device transport's server holds of it on the learner's
    devices (the pieces it keeps of one version add up to the version); the seconds at a bandwidth, the
    slower side's."""
    for weights, int4 in (("int4", True), ("learner", False)):
        cfg = _remote_config(tmp_path, f"rollout.weights={weights}")
        learner = shard_model(random_model(cfg.model, 3), DualMesh(MeshConfig(), model=cfg.model))
        offered = offered_weights(cfg, SimpleNamespace(policy=lambda: learner))
        v = version_traffic(cfg.model, int4=int4, learner_devices=8, devices_per_host=4, engines=3, engine_devices=2,
                            bandwidth=1e9)
        assert v.bytes == sum(x.nbytes for x in jax.tree.leaves(offered))
        assert v.learner_host_buffer == v.bytes // 2
        assert v.learner_device_held == (KEEP_VERSIONS + 1) * -(-v.bytes // 8)
        server = DeviceWeightServer(tmp_path / weights)
        try:
            server.offer(offered, 0)
            assert sum(a.nbytes for _, _, pieces in server._held[0].values() for _, a in pieces) == v.bytes
        finally:
            server.close()
        assert (v.engine_s, v.learner_s, v.seconds) == (v.bytes / 2e9, 3 * v.bytes / 8e9, v.bytes / 2e9)


def test_quantizing_on_the_learner_holds_its_int4_shards_and_one_stacks_float32_copy():
    cfg = load_config("tiny")
    sizes = layout_sizes(SimpleNamespace(mesh=MeshConfig(ep=4, ereplica=2), model=cfg), 8)
    e, d, f = cfg.moe.n_routed_experts // 4, cfg.hidden_size, cfg.moe.moe_intermediate_size
    stacks = {"moe": cfg.num_moe_layers, "mtp": cfg.mtp.num_layers}
    int4_weights = sum(stacks.values()) * 3 * e * d * f
    assert learner_quantizing(cfg, sizes) == int4_weights * 9 // 16 + 4 * cfg.num_moe_layers * e * d * f


def test_the_k25_deployment_of_the_docs(tmp_path, capsys):
    """K2.5 RL: a learner on 128 H200s, 16 engines of 8 H200s with INT4 experts serving 64 slots of 32K:
    an engine process fits (it would not with float experts); a version is ~0.59 TB and takes ~1.5 s at
    50 GB/s a device."""
    path = tmp_path / "deploy.json"
    common = ["plan", "kimi-k2.5", "--devices", "128", "--engines", "16", "--engine-devices", "8",
              "--engine-slots", "64", "--engine-max-len", "32768", "model.moe.dispatch=ep_a2a", "train.remat=full",
              "mesh.fsdp=128", "mesh.ep=128", "train.seq_len=8192", "train.batch_size=128", "train.grad_accum=16"]
    assert main([*common, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "RL deployment: the learner on 128 devices (16 hosts), 16 engine(s) of 8 devices" in out
    d = json.loads(path.read_text())["deployment"]
    engine, version = d["engine"], d["version"]
    assert engine["total"] < 0.9 * 141e9 < engine["swapping"]
    assert math.isclose(version["bytes"], 594.2e9, rel_tol=1e-3) and math.isclose(version["seconds"], 1.486, rel_tol=1e-3)
    assert main([*common, "--engine-weights", "learner", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["deployment"]["engine"]["total"] > 141e9

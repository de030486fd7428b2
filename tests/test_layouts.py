"""Layouts that fit by default: the expert grid's fill, the errors that name a working layout, the layout
search and its step-time model (checked against hand computations), the plan of a model config on the
device count, and a CPU run's own device count over one fixed in XLA_FLAGS."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.cli import main
from composer_jax.config import ConfigError, MeshConfig
from composer_jax.data.pipeline import FEATURES
from composer_jax.parallel.mesh import resolve_sizes
from composer_jax.plan.memory import plan_train
from composer_jax.plan.report import load_plan_config
from composer_jax.plan.search import search, with_settings
from composer_jax.plan.timing import PRESETS, Hardware, collective_bytes, step_time
from composer_jax.train import step as step_lib
from composer_jax.train.config import load_run_config
from composer_jax.train.loop import make_mesh
from composer_jax.train.state import StateLayout

ROOT = Path(__file__).resolve().parent.parent
TWELVE = ["model.moe.n_routed_experts=12", "model.moe.n_group=1", "model.moe.topk_group=1"]


def test_the_expert_grid_fills_with_the_widest_ep_that_divides_the_experts():
    assert resolve_sizes(MeshConfig(), 8, 12) == {"replica": 1, "fsdp": 8, "cp": 1, "ereplica": 2, "efsdp": 1, "ep": 4}
    assert resolve_sizes(MeshConfig(), 8, 16)["ep"] == 8
    assert resolve_sizes(MeshConfig(efsdp=2), 8, 12) == {"replica": 1, "fsdp": 8, "cp": 1, "ereplica": 1, "efsdp": 2,
                                                         "ep": 4}
    assert resolve_sizes(MeshConfig(ereplica=4), 8, 12)["ep"] == 2       # an explicit ereplica: ep is the rest
    with pytest.raises(ConfigError, match="at most one of"):
        MeshConfig(efsdp=-1, ep=-1)


@pytest.mark.parametrize("mesh, message", [
    (MeshConfig(ep=8), "config key 'ep': ep=8 must divide n_routed_experts=12: try mesh.ep=4 mesh.ereplica=2"),
    (MeshConfig(ereplica=1), "config key 'ep': ep=8 must divide n_routed_experts=12: try mesh.ep=4 mesh.ereplica=2"),
    (MeshConfig(ep=3), "config key 'ereplica': cannot fill: the other ('ereplica', 'efsdp', 'ep') sizes (3) do not "
                       "divide the 8 devices: try mesh.ep=4 mesh.ereplica=2"),
    (MeshConfig(fsdp=3), "config key 'replica': replica=1 x fsdp=3 x cp=1 = 3 devices, but there are 8: try "
                         "mesh.fsdp=8"),
])
def test_a_layout_that_cannot_work_names_one_that_does(mesh, message):
    cfg = load_run_config("pretrain-tiny", TWELVE)
    with pytest.raises(ConfigError) as e:
        make_mesh(dataclasses.replace(cfg, mesh=mesh))
    assert str(e.value) == message


def test_twelve_experts_train_a_step_on_eight_devices_with_no_mesh_keys():
    """The held-out case of the issue: a 12-expert model on the 8 CPU devices starts with the defaults
    (ep=4 x ereplica=2) and trains a step with the expert all-to-all."""
    cfg = load_run_config("pretrain-tiny", [*TWELVE, "model.vocab_size=256", "model.num_layers=2",
                                            "model.mtp.num_layers=0", "model.moe.dispatch=ep_a2a", "train.batch_size=8",
                                            "train.seq_len=16"])
    dual = make_mesh(cfg)
    assert (dual.sizes["ep"], dual.sizes["ereplica"]) == (4, 2)
    layout = StateLayout(cfg, dual)
    state = layout.fresh()
    tokens = np.random.default_rng(0).integers(0, 256, (1, 8, 16)).astype(np.int32)
    values = {"tokens": tokens, "segment_ids": np.ones_like(tokens), "loss_mask": np.ones_like(tokens),
              "positions": np.broadcast_to(np.arange(16, dtype=np.int32), tokens.shape)}
    with dual:
        batch = {k: jax.device_put(jnp.asarray(values[k]), jax.NamedSharding(dual.dense, jax.P(None, ("replica", "fsdp"))))
                 for k in FEATURES}
        new, metrics = jax.jit(step_lib.make_train_step(cfg, layout.graphdef, layout.rest, layout.opt))(state, batch)
    assert int(new.step) == 1 and np.isfinite(float(metrics["loss"]))
    expert = next(x for x in jax.tree.leaves(new.params) if "ep" in x.sharding.mesh.axis_names)
    assert dict(expert.sharding.mesh.shape) == {"ereplica": 2, "efsdp": 1, "ep": 4} and 12 in expert.shape
    assert expert.sharding.shard_shape(expert.shape)[expert.shape.index(12)] == 3      # 3 experts a device


# A made-up device for hand computations: 1e12 FLOP/s (f32 at half), 100 GB/s within nodes of 4, 10 GB/s between.
HAND = Hardware("hand", 1e3, 1e12, 0.5e12, 100e9, 10e9, devices_per_node=4)


def test_step_time_of_fsdp_and_expert_dispatch_by_hand():
    """tiny (float32, AdamW) on fsdp=8 x ep=8 with the bounded all-to-all: each collective's bytes and
    seconds from the model's shapes, counted here."""
    cfg = load_run_config("pretrain-tiny", ["model.moe.dispatch=ep_a2a", "mesh.fsdp=8", "mesh.ep=8",
                                            "train.batch_size=16", "train.seq_len=64", "model.mtp.num_layers=0"])
    plan = plan_train(cfg, 8)
    moved = collective_bytes(cfg, plan)
    m = cfg.model
    d, h = m.hidden_size, m.mla
    attn = (d * h.q_lora_rank + h.q_lora_rank * h.num_heads * (h.qk_nope_head_dim + h.qk_rope_head_dim)
            + d * (h.kv_lora_rank + h.qk_rope_head_dim) + h.kv_lora_rank * h.num_heads * (h.qk_nope_head_dim + h.v_head_dim)
            + h.num_heads * h.v_head_dim * d + h.q_lora_rank + h.kv_lora_rank + 2 * d)        # + its two norms
    dense_ffn, shared = 3 * d * m.intermediate_size, 3 * d * m.moe.moe_intermediate_size * m.moe.n_shared_experts
    dense = (m.num_layers * attn + dense_ffn + (m.num_layers - 1) * (shared + d * m.moe.n_routed_experts)
             + 2 * m.vocab_size * d + d)                                           # embedding, head, final norm
    assert moved["fsdp weight all-gather"] == (dense * 4 * 7 / 8, ("fsdp",))
    assert moved["fsdp gradient reduce-scatter"] == (dense * 4 * 7 / 8, ("fsdp",))
    tokens, k = 16 // 8 * 64, m.moe.num_experts_per_tok       # per device: 128 tokens, top-4
    rows = 8 * min(tokens * 2, 2 * tokens * k // 8)           # capacity factor 2 of the even share, to 8 ranks
    a2a = 4 * rows * d * 4 * (m.num_layers - 1) * 7 / 8       # there and back, forward and backward; float32
    assert moved["expert dispatch all-to-all"] == (pytest.approx(a2a), ("ep",))
    assert set(moved) == {"fsdp weight all-gather", "fsdp gradient reduce-scatter", "expert dispatch all-to-all"}
    t = step_time(cfg, plan, HAND)
    # fsdp and ep span all 8 devices, two nodes of 4: the inter-node rate
    assert t.comm_s["expert dispatch all-to-all"] == pytest.approx(a2a / 10e9)
    assert t.comm_s["fsdp weight all-gather"] == pytest.approx(dense * 4 * 7 / 8 / 10e9)


def test_the_compute_term_and_the_link_a_group_crosses_by_hand():
    """cp=4 inside a node of 4, fsdp=2 across nodes; full remat; the expanded ragged_dot over the 2 local
    experts of ep=8: the compute term is the hand count of model FLOPs over the devices and the rate."""
    from composer_jax.model.accounting import model_info

    cfg = load_run_config("pretrain-tiny", ["model.moe.dispatch=ep_a2a", "mesh.fsdp=2", "mesh.cp=4", "mesh.ep=8",
                                            "train.batch_size=4", "train.seq_len=64", "train.remat=full",
                                            "model.mtp.num_layers=0"])
    plan = plan_train(cfg, 8)
    t = step_time(cfg, plan, HAND)
    m = cfg.model
    per_token = model_info(m, 64).flops.total
    experts = 6 * 3 * m.hidden_size * m.moe.moe_intermediate_size * m.moe.num_experts_per_tok * (m.num_layers - 1)
    flops = (per_token + experts * (16 // 8 - 1)) * 4 / 3 * 4 * 64 / 8
    assert t.compute_s == pytest.approx(flops / 1e12)
    latent = 4 // 2 * 64 * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * 4 * m.num_layers * 3 * 3 / 4
    assert t.comm_bytes["cp latent all-gather"] == pytest.approx(latent)
    assert t.comm_s["cp latent all-gather"] == pytest.approx(latent / 100e9)      # cp=4: within a node
    assert t.comm_s["fsdp weight all-gather"] == pytest.approx(t.comm_bytes["fsdp weight all-gather"] / 10e9)


def test_search_ranks_the_layouts_that_fit_by_step_time():
    """Every fitting layout before every other, fastest first; each candidate's time is its own step_time;
    a fixed key keeps its value; with slow links between nodes of 4, the best keeps its expert exchange
    inside a node."""
    cfg = load_plan_config("tiny", ["train.batch_size=16", "train.seq_len=64", "model.mtp.num_layers=0"])
    found = search(cfg, 8, HAND, platform="cpu")
    fitting = [c for c in found if c.fits]
    assert fitting and [c.time.total_s for c in fitting] == sorted(c.time.total_s for c in fitting)
    assert found.index(fitting[-1]) == len(fitting) - 1
    best = fitting[0]
    assert best.time.total_s == step_time(with_settings(cfg, best.settings), best.plan, HAND).total_s
    assert all(s != best.settings for s in (c.settings for c in found[1:]))
    fixed = search(cfg, 8, HAND, fixed={"train.remat"}, platform="cpu")
    assert {c.settings["train.remat"] for c in fixed} == {"none"}
    slow = dataclasses.replace(HAND, inter_bw=1e6)
    top = search(cfg, 8, slow, platform="cpu")[0]
    assert top.settings["mesh.ep"] <= 4 and top.settings["mesh.replica"] * top.settings["mesh.fsdp"] <= 8


def test_plan_of_a_model_config_chooses_a_layout_that_fits(capsys):
    """kimi-k2.5 on 128 H200s with no overrides: the search sets what the command line leaves, and it fits."""
    assert main(["plan", "kimi-k2.5", "--devices", "128", "--rl-slots", "0"]) == 0
    out = capsys.readouterr().out
    assert "run settings chosen for 128 devices by the layout search" in out
    assert "does not fit" not in out.split("vs 141 GB HBM")[1].splitlines()[0]


def test_a_plan_that_does_not_fit_ends_with_the_best_layout_that_does(capsys):
    argv = ["plan", "pretrain-tiny", "--devices", "8", "--hbm-gb", "0.03", "--platform", "cpu", "--search", "--top", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "layout search:" in out and "  1. " in out and "  2. " in out
    assert "does not fit in 0.03 GB; the fastest layout that fits" in out.splitlines()[-1]
    assert main(["plan", "pretrain-tiny", "--devices", "8", "--hbm-gb", "0.001"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert "does not fit in 0.001 GB on any layout of 8 devices: the smallest" in last and "its largest term" in last


def test_a_device_count_in_xla_flags_gives_way_to_the_runs_own(tmp_path):
    """The Quickstart's RL (learner on cpu_devices=8, its engine on a ninth) under a shell's
    XLA_FLAGS=--xla_force_host_platform_device_count=8: the learner still gets 8 devices (the run stops
    at its layout check, which names them: no RL step runs)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "XLA_FLAGS": flags}
    argv = ["rl", "rl-tiny", "init_from=", "model=tiny", "model.rope.factor=16", "model.rope.max_position_embeddings=256",
            "mesh.fsdp=5", "progress=false", f"run_dir={tmp_path / 'run'}"]
    proc = subprocess.run([sys.executable, "-m", "composer_jax.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == ["composer-jax rl: error: config key 'replica': replica=1 x fsdp=5 x "
                                                "cp=1 = 5 devices, but there are 8: try mesh.fsdp=8"]


@pytest.mark.slow
def test_the_two_best_layouts_of_the_proxy_plan_within_15_percent_of_their_compiled_steps():
    """`plan proxy-moe --search` at 3 layers (1 dense, 2 MoE; no MTP depth; 16 rows of 256 tokens, so that the
    compiles fit this machine and its time): the two best layouts' planned per-device memory is within 15% of
    their compiled training steps' on 8 CPU devices (arguments + outputs - aliased + temporaries)."""
    cfg = load_plan_config("proxy-moe", ["model.num_layers=3", "model.mtp.num_layers=0", "train.seq_len=256",
                                         "train.batch_size=16"])
    for candidate in search(cfg, 8, PRESETS["h200"], platform="cpu")[:2]:
        run = with_settings(cfg, candidate.settings)
        memory = step_lib.lower_train_step(run, make_mesh(run)).compile().memory_analysis()
        compiled = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
                    + memory.temp_size_in_bytes)
        print(f"{candidate.overrides()}: plan {candidate.plan.total / 1e9:.3f} GB, compiled {compiled / 1e9:.3f} GB")
        assert candidate.fits and candidate.plan.total == pytest.approx(compiled, rel=0.15)

"""The training loop on the tiny model, 8 fake devices (dense fsdp=4 x cp=2, experts ep=8): metrics,
TensorBoard, checkpoints, plots, the router-bias update, the finite guard, phase-2 initialisation,
packed documents never attending to each other, and input errors."""

import base64
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import cli
from composer_jax.config import ConfigError
from composer_jax.data.config import DataConfig
from composer_jax.data.pipeline import build_dataset
from composer_jax.data.tokenizer import ByteTokenizer
from composer_jax.train.config import load_run_config
from composer_jax.train.loop import Trainer

# The module shares one training run (compiling init, step and eval: ~60 s on 2 cores), so it is slow.
pytestmark = pytest.mark.slow

OVERRIDES = ["model.vocab_size=256", "data.tokenizer=byte", "train.steps=3", "train.batch_size=8", "train.seq_len=32", "train.grad_accum=2", "train.log_every=2",
             "train.eval_every=3", "train.eval_batches=1", "train.progress=false", "data.eval_fraction=0.3",
             "checkpoint.every=2", "mesh.fsdp=4", "mesh.cp=2"]


def write_code_tree(root, n=60):
    """A small tree of Python-like documents of varied lengths."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(i % 5 + 1))
        (root / f"mod{i:02d}.py").write_text(f'"""Module {i}."""\n\n{body}')
    return root


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    tree = write_code_tree(root / "code")
    cfg = load_run_config("pretrain-tiny", OVERRIDES + [f"data.path={tree}", f"run_dir={root / 'run'}"])
    trainer = Trainer(cfg)
    initial_biases = jax.tree.map(np.asarray, trainer.state.biases)
    summary = trainer.run()
    return trainer, summary, initial_biases


def test_run_writes_metrics_tensorboard_and_checkpoints(run):
    trainer, summary, _ = run
    run_dir = trainer.run_dir
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_lines] == [1, 2, 3]
    for r in train_lines:
        assert np.isfinite(r["loss"]) and r["finite"] == 1.0 and r["time"] > 0
        assert {"ce", "mtp1_ce", "mtp1_kl", "grad_norm", "lr", "expert_load_max_over_mean"} <= set(r)
        assert 0 < r["mtp1_acceptance"] <= 1
        assert r["moe_dropped_fraction"] == 0   # the dense dispatch never drops
    measured = [r for r in train_lines if "tokens_per_s" in r]  # once per log group (log_every=2, and the end)
    assert [r["step"] for r in measured] == [2, 3] and all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in measured)
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 3] and all(np.isfinite(r["eval_loss"]) for r in evals)
    # Byte tokens, no special ones: every target is one byte, so bits per byte is the loss in bits.
    assert all(r["eval_bpb"] == pytest.approx(r["eval_loss"] / np.log(2), rel=1e-6) for r in evals)
    assert summary["first_eval_loss"] == evals[0]["eval_loss"] and summary["skipped_steps"] == 0
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [2, 3]
    assert (run_dir / "config.yaml").is_file()
    assert int(trainer.state.step) == 3


def test_training_and_held_out_losses_fall(run):
    """Three warmup steps from a random init (loss ~ ln 256 = 5.5) already learn: the held-out loss on
    the same batch falls by ~0.3 and the training loss by ~0.17 (each step's loss is measured before its
    update). A step that does not move (lr = 0) or moves uphill (a sign flip) fails both bounds."""
    trainer, _, _ = run
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if "loss" in r]
    held_out = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert held_out[-1] < held_out[0] - 0.1, held_out
    assert train[-1] < train[0] - 0.05 and train == sorted(train, reverse=True), train


def test_plot_command_writes_pngs(run, capsys):
    trainer, _, _ = run
    assert cli.main(["plot", str(trainer.run_dir)]) == 0
    paths = capsys.readouterr().out.split()
    assert any(p.endswith("loss.png") for p in paths) and any(p.endswith("bits_per_byte.png") for p in paths)
    for p in paths:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_router_biases_moved_by_the_load_balancing_rule(run):
    trainer, _, initial = run
    rate = trainer.cfg.model.moe.bias_update_rate
    moved = 0
    for before, after in zip(jax.tree.leaves(initial), jax.tree.leaves(trainer.state.biases)):
        steps = (np.asarray(after) - before) / rate  # 3 steps of +-rate (or 0) each
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
        assert np.abs(steps).max() <= 3 + 1e-3
        moved += np.count_nonzero(np.round(steps))
    assert moved > 0


def test_finite_guard_skips_a_nonfinite_step(run):
    trainer, _, _ = run
    with trainer.dual:
        state = jax.tree.map(jnp.copy, trainer.state)
        poisoned = jax.tree_util.tree_map_with_path(
            lambda path, x: x * jnp.nan if "lm_head" in jax.tree_util.keystr(path) else x, state.params)
        state = state._replace(params=poisoned)
        before = jax.tree.map(np.asarray, state)
        trainer.batches.iterator = iter(trainer.batches.train_data)
        after, metrics = trainer.step_fn(state, trainer.batches.next())
    assert not bool(metrics["finite"]) and int(after.skipped) == int(before.skipped) + 1
    assert int(after.step) == int(before.step) + 1
    for name in ("params", "opt_state", "biases"):
        for a, b in zip(jax.tree.leaves(getattr(after, name)), jax.tree.leaves(getattr(before, name))):
            np.testing.assert_array_equal(np.asarray(a), b)  # NaNs compare equal here


def test_phase_two_starts_from_phase_one_params_with_longer_context(run, tmp_path):
    trainer, _, _ = run
    overrides = OVERRIDES + [f"data.path={trainer.cfg.data.path}", f"run_dir={tmp_path / 'phase2'}",
                             f"train.init_from={trainer.run_dir}", "train.seq_len=64",
                             "model.rope.factor=16", "model.rope.max_position_embeddings=256"]
    phase2 = Trainer(load_run_config("pretrain-tiny", overrides))
    assert int(phase2.state.step) == 0
    for a, b in zip(jax.tree.leaves(phase2.state.params), jax.tree.leaves(trainer.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(not np.any(np.asarray(m)) for m in jax.tree.leaves(phase2.state.opt_state))  # fresh
    phase2.checkpoints.close()


def test_packed_documents_do_not_attend_to_each_other(run):
    """Changing one document of a packed row leaves the hidden states of the others unchanged."""
    trainer, _, _ = run
    cfg = trainer.cfg.data
    batch = next(iter(build_dataset(DataConfig(path=cfg.path, eval_fraction=0.0), ByteTokenizer(), split="train",
                                    seq_len=128, batch_size=4, repeat=True)))
    tokens, segments, positions = (jnp.asarray(batch[k]) for k in ("tokens", "segment_ids", "positions"))
    row = int(np.argmax(batch["segment_ids"].max(-1)))
    assert batch["segment_ids"][row].max() >= 2
    first = segments[row] == 1
    changed = tokens.at[row].set(jnp.where(first, (tokens[row] + 7) % 256, tokens[row]))

    @jax.jit
    def forward(state, t):
        model = nnx.merge(trainer.layout.graphdef, state.params, state.biases, trainer.layout.rest)
        return model.forward(t, segments, positions).hidden

    with trainer.dual:
        h0, h1 = np.asarray(forward(trainer.state, tokens)), np.asarray(forward(trainer.state, changed))
    np.testing.assert_array_equal(h0[row][~np.asarray(first)], h1[row][~np.asarray(first)])
    assert np.abs(h0[row][np.asarray(first)] - h1[row][np.asarray(first)]).max() > 1e-3


def test_tokenizer_larger_than_the_model_vocab_is_an_error(run, tmp_path):
    trainer, _, _ = run
    path = tmp_path / "big.tiktoken"
    path.write_text("".join(f"{base64.b64encode(bytes([i % 256]) * (1 + i // 256)).decode()} {i}\n"
                            for i in range(300)))
    cfg = load_run_config("pretrain-tiny", OVERRIDES + [f"data.tokenizer={path}", f"data.path={trainer.cfg.data.path}",
                                                        f"run_dir={tmp_path / 'r'}"])
    with pytest.raises(ConfigError, match=rf"config key 'data.tokenizer': tokenizer {path} has 301 ids, more than the "
                                          "model's vocab_size=256"):
        Trainer(cfg)


def test_resume_onto_another_mesh_layout(run, tmp_path):
    """The run's last checkpoint (dense fsdp=4 x cp=2, experts ep=8) restores onto fsdp=8 / ereplica=2 x ep=4."""
    import shutil

    trainer, _, _ = run
    copy = tmp_path / "run"
    shutil.copytree(trainer.run_dir / "checkpoints", copy / "checkpoints")
    overrides = OVERRIDES + [f"data.path={trainer.cfg.data.path}", f"run_dir={copy}", "mesh.fsdp=8", "mesh.cp=1",
                             "mesh.ereplica=2", "mesh.ep=4", "train.steps=4", "train.grad_accum=1",
                             "optimizer.on_extend=continue"]
    moved = Trainer(load_run_config("pretrain-tiny", overrides))
    assert int(moved.state.step) == 3
    expert = moved.state.params["moe_layers"]["mlp"]["gate_proj"].get_value()
    assert dict(expert.sharding.mesh.shape) == {"ereplica": 2, "efsdp": 1, "ep": 4}
    for name in ("params", "biases", "opt_state"):
        for a, b in zip(jax.tree.leaves(getattr(moved.state, name)), jax.tree.leaves(getattr(trainer.state, name))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved.checkpoints.close()


def test_remat_step_matches_the_plain_step(run):
    """train.remat=full recomputes the forward in the backward: same loss, gradients and update."""
    import dataclasses

    from composer_jax.train import step as step_lib

    trainer, _, _ = run
    cfg = dataclasses.replace(trainer.cfg, train=dataclasses.replace(trainer.cfg.train, remat="full"))
    remat_step = jax.jit(step_lib.make_train_step(cfg, trainer.layout.graphdef, trainer.layout.rest, trainer.layout.opt))
    trainer.batches.iterator = iter(trainer.batches.train_data)
    with trainer.dual:
        batch = trainer.batches.next()
        plain_state, plain = trainer.step_fn(jax.tree.map(jnp.copy, trainer.state), batch)
        remat_state, remat = remat_step(jax.tree.map(jnp.copy, trainer.state), batch)
    for key in ("loss", "ce", "mtp1_ce", "mtp1_kl", "grad_norm"):
        np.testing.assert_allclose(float(remat[key]), float(plain[key]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(remat_state.params), jax.tree.leaves(plain_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

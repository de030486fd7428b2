"""A pretraining step and an RL step on the dual grid, and checkpoint saves and restores, run the same way
by one process with 8 devices (in pytest) and by each process of a group of 2 x 4 (this module as a
script, started by tests/test_distributed.py):

    python -m tests.multiprocess_steps PROCESS_ID NUM_PROCESSES PORT WORK_DIR

Each process feeds only its own rows (the global batch's rows in process order), as a group's
processes do; process 0 writes the results as WORK_DIR/results_<n>proc.npz.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# (key, value) overrides of the tiny pretraining run: dense (replica=2 across the processes, fsdp=4 within
# one) and expert (ep=8, across both) grids, the all-to-all expert dispatch.
OVERRIDES = ["model.vocab_size=256", "data.tokenizer=byte", "train.batch_size=8", "train.seq_len=32", "train.steps=10",
             "mesh.replica=2", "mesh.fsdp=4", "mesh.cp=1", "model.moe.dispatch=ep_a2a", "model.moe.capacity_factor=0", "model.num_layers=2",
             "model.mtp.num_layers=0"]
RL_ROWS, RL_SEQ, GROUP = 16, 32, 2


def _global_batch(cfg):
    """A fixed pretraining batch int32[1, batch, seq] per feature, the same in every process."""
    import numpy as np

    rng = np.random.default_rng(7)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    tokens = rng.integers(1, cfg.model.vocab_size, (1, b, s)).astype(np.int32)
    segments = np.where(np.arange(s) < s - 3 * (np.arange(b)[:, None] % 3), 1, 0)[None].astype(np.int32)
    return {"tokens": tokens * segments, "segment_ids": segments,
            "positions": np.where(segments > 0, np.arange(s), 0).astype(np.int32), "loss_mask": segments}


def _host(tree):
    """Every leaf whole, as numpy, on every process."""
    from composer_jax.parallel.distributed import to_host

    return to_host(tree)


def _flat(prefix: str, tree) -> dict:
    import jax

    from composer_jax.tree_paths import path_str

    return {f"{prefix}/{path_str(p)}": x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _layout(work_dir: Path):
    """(run config, StateLayout) of the test run on all devices of all processes."""
    from composer_jax.train.config import load_run_config
    from composer_jax.train.loop import make_mesh
    from composer_jax.train.state import StateLayout

    cfg = load_run_config("pretrain-tiny", OVERRIDES + [f"run_dir={work_dir / 'unused'}"])
    return cfg, StateLayout(cfg, make_mesh(cfg))


def _restored(layout, checkpoint: Path) -> dict:
    """The params of `checkpoint` restored onto `layout`, whole on the host, keyed 'restored/...'."""
    from composer_jax.train.checkpoints import RunCheckpoints

    source = RunCheckpoints(checkpoint)
    restored, _ = source.restore(layout.abstract)
    source.close()
    return _flat("restored", _host(restored.params))


def run_steps(work_dir: Path, restore_from: Path | None) -> dict:
    """One pretraining step then one RL step from the same fresh state; the pretrain state is saved to
    WORK_DIR/ckpt_<n>proc; `restore_from` (a checkpoint saved by the other process count) is restored.
    Returns numpy results keyed 'pretrain/...', 'rl/...', 'restored/...', 'saved/...'."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from composer_jax.parallel.mesh import BATCH_AXES
    from composer_jax.rl import RLConfig, RLStep, synthetic_batch
    from composer_jax.rl.ingest import process_rows
    from composer_jax.train import step as step_lib
    from composer_jax.train.checkpoints import RunCheckpoints
    from tests.rl_helpers import adam_first_moment

    cfg, layout = _layout(work_dir)
    dual = layout.dual
    step_fn = jax.jit(step_lib.make_train_step(cfg, layout.graphdef, layout.rest, layout.opt), donate_argnums=0)
    sharding = NamedSharding(dual.dense, P(None, BATCH_AXES))
    batch = {k: jax.make_array_from_process_local_data(sharding, process_rows(v, 1), v.shape)
             for k, v in _global_batch(cfg).items()}
    out = {}
    with dual:
        state, metrics = step_fn(layout.fresh(), batch)
        out.update(_flat("pretrain/metrics", _host(metrics)))
        out.update(_flat("pretrain/mu", _host(adam_first_moment(state.opt_state))))
        saved = RunCheckpoints(work_dir / f"ckpt_{jax.process_count()}proc")
        saved.save(1, state, {}, {})
        saved.close()
        out.update(_flat("saved", _host(state.params)))
        if restore_from is not None:
            out.update(_restored(layout, restore_from))

        model = nnx.merge(layout.graphdef, state.params, state.biases, layout.rest)
        rl_cfg = RLConfig(group_size=GROUP, kl_coef=0.1, micro_batch=8, steps=10)
        rl_step = RLStep(model, rl_cfg)
        rl_batch = synthetic_batch(3, batch=RL_ROWS, seq=RL_SEQ, vocab_size=cfg.model.vocab_size, group_size=GROUP,
                                   with_ref=True)
        rl_state, rl_metrics = rl_step(rl_step.init_state(model), jax.tree.map(lambda x: process_rows(x, 0), rl_batch))
        out.update(_flat("rl/metrics", _host(rl_metrics)))
        out.update(_flat("rl/mu", _host(adam_first_moment(rl_state.opt_state))))
    return {k: np.asarray(v) for k, v in out.items()}


def restore_params(work_dir: Path, checkpoint: Path) -> dict:
    """The params of `checkpoint` restored onto this process count's layout, keyed 'restored/...'."""
    import numpy as np

    return {k: np.asarray(v) for k, v in _restored(_layout(work_dir)[1], checkpoint).items()}


def main(argv: list[str]) -> int:
    process_id, num_processes, port, work_dir = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    os.environ["JAX_PLATFORMS"] = "cpu"
    from composer_jax.cpu_devices import use_cpu_devices

    use_cpu_devices(8 // num_processes)
    import jax
    import numpy as np

    from composer_jax.parallel.distributed import ProcessGroup, initialize

    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py sets for the reference
    watchdog = initialize(ProcessGroup(f"localhost:{port}", num_processes, process_id, "flags"),
                          peer_timeout_s=240, init_timeout_s=240, label="multiprocess_steps")
    results = run_steps(work_dir, work_dir / "ckpt_1proc")
    watchdog.finish()
    if process_id == 0:
        np.savez(work_dir / f"results_{num_processes}proc.npz", **results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The training step on one device: tokens/s, model FLOPs per token (the analytic count of
`model.accounting`), the compiled program's FLOPs per token and their ratio (the waste), and MFU
against the device's peak (datasheet on accelerators, a measured matmul on CPU)."""

from __future__ import annotations

import jax
import numpy as np

from composer_jax.bench.shapes import forward_shapes
from composer_jax.bench.timing import flops_of, interleaved, medians, unrolled_loops
from composer_jax.config import MeshConfig, ModelConfig, replace
from composer_jax.model.accounting import model_info
from composer_jax.parallel import DualMesh
from composer_jax.train import step as step_lib
from composer_jax.train.config import RunConfig, TrainConfig
from composer_jax.train.metrics import run_peak_flops
from composer_jax.train.state import StateLayout


def one_device() -> DualMesh:
    return DualMesh(MeshConfig(fsdp=1, ep=1), jax.devices()[:1])


def run_config(model: ModelConfig, batch_size: int, seq_len: int, remat: str = "none", **model_keys) -> RunConfig:
    """`model` (with `model_keys` dotted changes, positions raised to `seq_len`) trained at `batch_size`
    rows of `seq_len` tokens on one device, AdamW, no gradient accumulation."""
    positions = max(seq_len, model.rope.max_position_embeddings)
    model = replace(model, **{"rope.max_position_embeddings": positions, **model_keys})
    return RunConfig(model=model, mesh=MeshConfig(fsdp=1, ep=1),
                     train=TrainConfig(batch_size=batch_size, seq_len=seq_len, remat=remat, progress=False))


def packed_batch(batch_size: int, seq_len: int, vocab: int, rng) -> dict:
    """FEATURES -> int32[1, batch, seq]: random tokens, two packed documents per row (the second
    starting a third of the way in), loss on every token."""
    tokens = rng.integers(0, vocab, (1, batch_size, seq_len)).astype(np.int32)
    index = np.arange(seq_len)
    second = index >= seq_len // 3
    segments = np.broadcast_to((second + 1).astype(np.int32), tokens.shape)
    positions = np.broadcast_to(np.where(second, index - seq_len // 3, index).astype(np.int32), tokens.shape)
    return {"tokens": tokens, "segment_ids": np.array(segments), "positions": np.array(positions),
            "loss_mask": np.ones_like(tokens)}


def compiled_step_flops(cfg: RunConfig, dual: DualMesh) -> float:
    """FLOPs of the whole compiled training step (forward, backward, optimizer), every loop unrolled."""
    with unrolled_loops():
        return flops_of(step_lib.lower_train_step(cfg, dual).compile())


def device_memory_bytes() -> int | None:
    """What the first device may allocate (XLA's `bytes_limit`), or None where it does not say (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def fitting_batch(model: ModelConfig, seq_len: int, budget_bytes: float, most: int = 64, memory=None) -> int:
    """The largest batch (rows of `seq_len`) whose one-device training step fits in `budget_bytes`, from
    the compiled step at batch 1 (`memory`: its `memory_analysis()`, compiled here when None): the state
    once, the temporaries per row (a slight overestimate: some temporaries do not grow with the batch)."""
    mem = memory or step_lib.lower_train_step(run_config(model, 1, seq_len), one_device()).compile().memory_analysis()
    state = mem.argument_size_in_bytes
    per_row = mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    if state + per_row > budget_bytes:
        raise ValueError(f"one row of {seq_len} tokens needs {(state + per_row) / 1e9:.1f} GB on one device, "
                         f"over the {budget_bytes / 1e9:.1f} GB budget")
    return max(1, min(most, int((budget_bytes - state) // per_row)))


def steps_side_by_side(cfgs: dict[str, RunConfig], repeats: int, seed: int = 0) -> dict[str, list[float]]:
    """{name: [seconds per step]}: the training steps of `cfgs` (same batch shape) run in alternation on
    one device, each on its own fresh state and the same batch."""
    dual = one_device()
    first = next(iter(cfgs.values()))
    batch = packed_batch(first.train.batch_size, first.train.seq_len, first.model.vocab_size,
                         np.random.default_rng(seed))
    steps, states = {}, {}
    for name, cfg in cfgs.items():
        layout = StateLayout(cfg, dual)
        with dual:
            steps[name] = jax.jit(step_lib.make_train_step(cfg, layout.graphdef, layout.rest, layout.opt))
        states[name] = layout.fresh()

    def run(name):
        def call():
            with dual:
                return steps[name](states[name], batch)[1]["loss"]
        return call

    return interleaved({name: run(name) for name in cfgs}, repeats)


def train_step_shapes(model: ModelConfig, batch_size: int, seq_len: int, **model_keys) -> None:
    """The run config `train_step_section` trains (`run_config`, validated) and its model's forward
    over a batch, traced (shapes only; the whole step takes seconds more to trace)."""
    cfg = run_config(model, batch_size, seq_len, **model_keys)
    forward_shapes(cfg.model, batch_size, seq_len)


def train_step_section(model: ModelConfig, batch_size: int, seq_len: int, repeats: int) -> dict:
    """The measured step against its references: the analytic model FLOPs and the device's peak."""
    cfg = run_config(model, batch_size, seq_len)
    seconds = medians(steps_side_by_side({"step": cfg}, repeats))["step"]
    tokens = batch_size * seq_len
    model_flops = model_info(cfg.model, seq_len).flops.total
    compiled = compiled_step_flops(cfg, one_device()) / tokens
    tokens_per_s = tokens / seconds
    peak = run_peak_flops(jax.devices()[:1], cfg.train.peak_flops)
    return {"batch_size": batch_size, "seq_len": seq_len, "dispatch": cfg.model.moe.dispatch,
            "attention": cfg.model.attention, "dtype": cfg.model.dtype, "step_s": seconds,
            "tokens_per_s": tokens_per_s, "model_flops_per_token": model_flops,
            "compiled_flops_per_token": compiled, "compiled_over_model_flops": compiled / model_flops,
            "peak_flops": peak, "mfu": tokens_per_s * model_flops / peak}

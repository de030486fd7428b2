"""Our training step against its peer, a plain PyTorch loop over transformers' `DeepseekV3ForCausalLM`
(CPU), on the same DeepSeek-V3-architecture checkpoint (random fp32 weights saved by transformers'
`save_pretrained`), the same batch of token ids, side by side in one run.

Our side is what `composer-jax pretrain` runs: the run config is read from configs/pretrain-tiny.yaml
with `train.init_from` naming the checkpoint, and the step, the mesh and the state come from the
loop's own `Trainer` (its defaults: a fake device per core, the run's dispatch; the weights streamed in through
the source path). Optional rows add dotted settings (`train.num_devices=1`, `model.moe.dispatch=dense`).
The peer: AdamW with the same learning-rate schedule, betas, eps and weight decay (matrices only, as
ours), global-norm clipping at the same norm, loss = mean next-token cross-entropy (`labels=ids`),
fp32, torch threads = the machine's cores. MTP is off on both sides. Each row of the batch is one
document (positions 0..S-1, one segment, loss on every token), the case both sides define alike, so
the first step's losses must agree to fp32 rounding: the independent check that they train the same
model (the second step's, after one update, nearly). Per shape: tokens/s of each, the ratios, the
model FLOPs per token (`model.accounting`), the compiled step's FLOPs per token (every loop unrolled,
all devices) and their ratio.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import jax
import numpy as np
import yaml

from composer_jax.bench.decode_peer import peer_checkpoint
from composer_jax.bench.shapes import forward_shapes
from composer_jax.bench.timing import flops_of, interleaved, medians
from composer_jax.bench.train_step import compiled_step_flops
from composer_jax.config import CONFIG_DIR, read_yaml
from composer_jax.model.accounting import model_info
from composer_jax.train.config import RunConfig, load_run_config
from composer_jax.train.loop import Trainer, make_mesh

RECIPE = "pretrain-tiny"          # `composer-jax pretrain`'s default run config
# The held-out checkpoint of issue 41: the tiny model's structure (4 layers, one dense first; 16 routed
# experts, top-4 in 2 of 4 groups; one shared; YaRN) at hidden 256, MLA q-LoRA 96 / kv-LoRA 64, vocab 4096.
HELD_OUT = ("model=tiny", "model.hidden_size=256", "model.intermediate_size=768",
            "model.moe.moe_intermediate_size=128", "model.mla.q_lora_rank=96", "model.mla.kv_lora_rank=64",
            "model.vocab_size=4096", "model.mtp.num_layers=0", "model.rope.max_position_embeddings=256")
NO_MTP = ("model.mtp.num_layers=0",)
# Neither side reads the run's data (both train on one fixed batch): a few files, not the whole stdlib
# the recipe lists (seconds per run built).
SCHEDULE_STEPS = 1000    # the peer's learning rates follow ours this far (a bench takes a few dozen steps)
FEW_FILES = ("data.glob=json/*.py", "data.eval_fraction=0")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model and batch both sides train."""

    model: tuple           # dotted model changes (to the recipe's model, or whole: "model=tiny", ...)
    from_source: bool      # the run names no model: it takes the checkpoint's (as `pretrain train.init_from=`)
    batch_size: int
    seq_len: int


SHAPES = {
    "held_out": Shape(HELD_OUT, True, 8, 256),               # issue 41's measurement
    "tiny_recipe": Shape(NO_MTP, False, 16, 128),            # configs/pretrain-tiny.yaml's model and batch
    "tiny_quick": Shape(NO_MTP + ("model.num_layers=2",), False, 8, 32),   # the smoke run's
}


def recipe_file(directory: Path, from_source: bool) -> Path:
    """The recipe's run YAML; `from_source`: without its model keys, so the run takes the source's."""
    path = CONFIG_DIR / f"{RECIPE}.yaml"
    if not from_source:
        return path
    data = {k: v for k, v in read_yaml(path).items() if not str(k).startswith("model")}
    out = directory / f"{RECIPE}-from-source.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def shape_config(shape: Shape, directory: Path, source: Path | None = None, settings: tuple = ()) -> RunConfig:
    """The run config of `shape` with run_dir in `directory`: training from `source` (a checkpoint; then a
    `from_source` shape names no model), or, without one, the model the checkpoint is written from."""
    overrides = [f"train.batch_size={shape.batch_size}", f"train.seq_len={shape.seq_len}",
                 f"run_dir={directory / 'run'}", *FEW_FILES]
    if source is None or not shape.from_source:
        overrides += shape.model
    if source is not None:
        overrides.append(f"train.init_from={source}")
    cfg = load_run_config(recipe_file(directory, shape.from_source), [*overrides, *settings])
    if cfg.train.num_devices:
        return cfg
    # `pretrain`'s process has `host_cpu_devices` fake devices and uses them all; this one may have more
    devices = min(cfg.train.host_cpu_devices, jax.device_count())
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_devices=devices))


def train_peer_shapes(shapes: tuple, settings: tuple = ()) -> None:
    """Each shape's run config under every row's settings validated, its mesh laid out against the batch
    and its model traced over the batch (shapes only)."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in shapes:
            shape, traced = SHAPES[name], []
            for row in ((), *settings):
                cfg = shape_config(shape, Path(tmp), settings=row)
                make_mesh(cfg)
                if cfg.model not in traced:      # a row that changes only the mesh traces the same model
                    forward_shapes(cfg.model, shape.batch_size, shape.seq_len)
                    traced.append(cfg.model)


def one_document_rows(batch_size: int, seq_len: int, vocab: int, seed: int = 0) -> dict:
    """FEATURES -> int32[batch, seq]: random token ids, each row one document, loss on every token."""
    tokens = np.random.default_rng(seed).integers(0, vocab, (batch_size, seq_len)).astype(np.int32)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), tokens.shape).copy()
    return {"tokens": tokens, "segment_ids": np.ones_like(tokens), "positions": positions,
            "loss_mask": np.ones_like(tokens)}


class Ours:
    """`composer-jax pretrain`'s step on `cfg` (the loop's Trainer), stepping its own state on one batch."""

    def __init__(self, cfg: RunConfig, rows: dict):
        self.trainer = Trainer(cfg)
        self.batch = self.trainer.batches.on_device(rows, self.trainer.batches.train_sharding,
                                                     (cfg.train.grad_accum, -1, cfg.train.seq_len))

    def __call__(self) -> jax.Array:
        t = self.trainer
        with t.dual:
            t.state, metrics = t.step_fn(t.state, self.batch)
        return metrics["loss"]

    def compiled_flops(self, unrolled: bool) -> float:
        """FLOPs of the compiled step over all devices (XLA's cost analysis counts one device's program:
        times the devices). `unrolled`: every loop unrolled (another compilation); else the program that
        ran, its loop bodies counted once (exact where every loop runs once: one-layer stacks, one
        loss chunk, one micro-batch)."""
        t = self.trainer
        flops = compiled_step_flops(t.cfg, t.dual) if unrolled else flops_of(self.compiled())
        return flops * t.dual.dense.devices.size

    def compiled(self) -> jax.stages.Compiled:
        """The step's compiled program (after a call: from jax's cache, no compilation)."""
        t = self.trainer
        with t.dual:
            return t.step_fn.lower(t.state, self.batch).compile()

    def close(self) -> None:
        self.trainer.checkpoints.close()


class Peer:
    """The PyTorch loop: transformers' model from `path`, AdamW as `cfg.optimizer` (lr per step from
    `schedule`), decay on matrices only, clipping at the global norm, mean next-token CE."""

    def __init__(self, path: Path, cfg: RunConfig, schedule, tokens: np.ndarray):
        import torch
        from transformers import DeepseekV3ForCausalLM

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        self.model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).train()
        named = list(self.model.named_parameters())
        # Ours decays the matrices (reduction/output metadata): not norms, the embedding or the head.
        decayed = [p for n, p in named if p.ndim >= 2 and "embed_tokens" not in n and "lm_head" not in n]
        ids = {id(p) for p in decayed}
        o = cfg.optimizer
        groups = [{"params": decayed, "weight_decay": o.weight_decay},
                  {"params": [p for _, p in named if id(p) not in ids], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.b1, o.b2), eps=o.eps)
        # Our schedule's rates, computed once: no JAX call inside the loop's timed steps.
        self.rates = np.asarray(jax.vmap(schedule)(np.arange(SCHEDULE_STEPS)), np.float64)
        self.max_norm, self.step = o.max_grad_norm, 0
        self.ids = torch.as_tensor(tokens, dtype=torch.long)

    def __call__(self) -> float:
        for group in self.opt.param_groups:
            group["lr"] = float(self.rates[min(self.step, SCHEDULE_STEPS - 1)])
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        if self.max_norm:
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return loss.item()

    @property
    def attention(self) -> str:
        return self.model.config._attn_implementation


def row_name(settings: tuple) -> str:
    return "ours" if not settings else "ours " + " ".join(settings)


def compare_shape(name: str, settings: tuple, repeats: int, directory: Path, unrolled_flops: bool) -> dict:
    """One shape: the checkpoint, our step (defaults, then each row of `settings`) and the peer's, the
    first two steps' losses of each, then `repeats` timed steps each in alternation."""
    shape = SHAPES[name]
    model = shape_config(shape, directory).model
    source = directory / "checkpoint"
    peer_checkpoint(model, source)
    ours = {}
    try:
        for row in ((), *settings):
            cfg = shape_config(shape, directory, source, row)
            host = one_document_rows(shape.batch_size, shape.seq_len, cfg.model.vocab_size)
            ours[row_name(row)] = Ours(cfg, host)
        default = ours["ours"].trainer
        peer = Peer(source, default.cfg, default.layout.opt.schedule, host["tokens"])
        # The first two steps' losses: the second shows the first update alike (rates, Adam's moments).
        first = {k: (float(fn()), float(fn())) for k, fn in ({**ours, "torch": peer}).items()}
        times = medians(interleaved({**ours, "torch": peer}, repeats))
        flops = ours["ours"].compiled_flops(unrolled_flops)
        return shape_result(shape, default.cfg, ours, peer, first, times) | {
            "compiled_flops_counted": "unrolled" if unrolled_flops else "as run",
            **flop_ratios(flops / (shape.batch_size * shape.seq_len), default.cfg.model, shape.seq_len)}
    finally:
        for o in ours.values():
            o.close()


def shape_result(shape: Shape, cfg: RunConfig, ours: dict, peer: Peer, first: dict, times: dict) -> dict:
    tokens = shape.batch_size * shape.seq_len
    torch_rate = tokens / times["torch"]
    rows = []
    for name, o in ours.items():
        t = o.trainer
        rate = tokens / times[name]
        rows.append({"name": name, "devices": t.dual.dense.devices.size, "mesh": str(t.dual),
                     "dispatch": t.cfg.model.moe.dispatch, "step_s": times[name], "tokens_per_s": rate,
                     "over_torch": rate / torch_rate, "first_loss": first[name][0],
                     "second_loss": first[name][1]})
    return {"batch_size": shape.batch_size, "seq_len": shape.seq_len, "model":
            {"hidden_size": cfg.model.hidden_size, "num_layers": cfg.model.num_layers,
             "vocab_size": cfg.model.vocab_size, "experts": cfg.model.moe.n_routed_experts,
             "top_k": cfg.model.moe.num_experts_per_tok},
            "torch": {"step_s": times["torch"], "tokens_per_s": torch_rate, "threads": peer.torch.get_num_threads(),
                      "attention": peer.attention, "first_loss": first["torch"][0], "second_loss": first["torch"][1]},
            "rows": rows, "first_loss_abs_diff": max(abs(r["first_loss"] - first["torch"][0]) for r in rows),
            "second_loss_abs_diff": max(abs(r["second_loss"] - first["torch"][1]) for r in rows)}


def flop_ratios(compiled: float, model_cfg, seq_len: int) -> dict:
    """Compiled FLOPs per token against the model's (`model.accounting`)."""
    model = model_info(model_cfg, seq_len).flops.total
    return {"model_flops_per_token": model, "compiled_flops_per_token": compiled,
            "compiled_over_model_flops": compiled / model}


def train_peer_section(shapes: tuple, settings: tuple, repeats: int, unrolled_flops: bool = True) -> dict:
    """Every shape's comparison (`unrolled_flops`: see `Ours.compiled_flops`), and the machine's load
    before and after."""
    out = {"repeats": repeats, "settings": [list(s) for s in settings], "cpus": os.cpu_count(),
           "load_average_before": [round(x, 2) for x in os.getloadavg()], "shapes": {}}
    for name in shapes:
        with tempfile.TemporaryDirectory() as tmp:
            out["shapes"][name] = compare_shape(name, settings, repeats, Path(tmp), unrolled_flops)
    out["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return out

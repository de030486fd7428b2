"""Run configs for pretraining, context extension and SFT: model + data + train + optimizer + checkpoint.

A run YAML names its model by bundled config name or path (`model: tiny`) or spells it out as a
mapping; `load_run_config` inlines the named model before applying `a.b=value` overrides, so
`model.rope.factor=32` works either way. Dotted top-level keys inside the YAML are overrides too
(applied before the command line's). The resolved config (every default filled in) is what runs,
what checkpoints store and what `to_dict` returns.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from composer_jax.config import (ConfigError, MeshConfig, ModelConfig, apply_overrides, check_fits_model,
                                 command_line_overrides, from_dict, override_origin, parse_override, read_yaml,
                                 resolve_config_path, shipped_path)
from composer_jax.cpu_devices import count_for
from composer_jax.data.config import DataConfig


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer and its warmup-stable-decay (WSD) learning-rate schedule."""

    name: Literal["adamw", "muon"] = "adamw"   # muon: Muon for matrices, AdamW for the rest
    lr: float = 3e-3                  # peak learning rate (after warmup); 0 changes no weight
    warmup_steps: int = 20            # linear warmup from 0
    decay_fraction: float = 0.2       # the last fraction of the steps decays to lr * min_lr_ratio
    decay_shape: Literal["linear", "cosine"] = "linear"   # how the rate falls over the decay fraction
    min_lr_ratio: float = 0.1         # the rate at the end of the decay, as a fraction of lr
    b1: float = 0.9                   # Adam's first-moment decay
    b2: float = 0.95                  # Adam's second-moment decay
    eps: float = 1e-8                 # Adam's denominator epsilon
    weight_decay: float = 0.1         # decoupled; matrices only (reduction/output metadata): not norms, embedding, head
    max_grad_norm: float = 1.0        # global-norm clipping; 0 disables
    ns_dtype: Literal["float32", "bfloat16"] = "float32"   # Muon's Newton-Schulz compute dtype
    # Resuming with a different train.steps changes the schedule: "refuse" (say so and stop), "continue"
    # (keep the old schedule: after its end the rate stays decayed) or "restart" (warmup, stable, decay
    # again over the steps still to run).
    on_extend: Literal["refuse", "continue", "restart"] = "refuse"
    schedule_start: int = 0           # the schedule runs over steps [schedule_start, schedule_end] (set on resume)
    schedule_end: int = 0             # 0 = train.steps

    def __post_init__(self):
        if self.lr < 0:
            raise ConfigError("lr", f"must be >= 0 (0: a pass that changes no weight), got {self.lr}")
        if self.warmup_steps < 0:
            raise ConfigError("warmup_steps", "must be >= 0")
        if not 0 <= self.decay_fraction <= 1:
            raise ConfigError("decay_fraction", f"must be in [0, 1], got {self.decay_fraction}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ConfigError("b1", "b1 and b2 must be in [0, 1)")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ConfigError("weight_decay", "weight_decay and max_grad_norm must be >= 0")
        if self.schedule_start < 0 or self.schedule_end < 0:
            raise ConfigError("schedule_start", "schedule_start and schedule_end must be >= 0")
        if self.schedule_end and self.schedule_end <= self.schedule_start:
            raise ConfigError("schedule_end", f"must be > schedule_start={self.schedule_start}, "
                                              f"got {self.schedule_end}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100                  # save every N steps (and at the last step)
    keep: int = 3                     # keep the K most recent
    async_save: bool = True           # write in the background while training continues

    def __post_init__(self):
        if self.every <= 0 or self.keep <= 0:
            raise ConfigError("every", "every and keep must be > 0")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 300                  # optimizer steps of the whole run (a resumed run continues to it)
    batch_size: int = 16              # rows per optimizer step (all devices, all micro-batches)
    seq_len: int = 128                # tokens per packed row
    grad_accum: int = 1               # micro-batches per step; batch_size must divide evenly
    remat: Literal["none", "full", "dots"] = "none"   # per layer: recompute in the backward (dots: keep matmuls)
    loss_chunk: int = 512             # sequence positions per cross-entropy chunk: [batch, chunk, vocab] logits
    mtp_distill_weight: float = 0.1   # MTP self-distillation KL toward the main head (stop-gradient)
    log_every: int = 10               # metrics (and throughput) every N steps: the host syncs only then
    eval_every: int = 100             # held-out loss every N steps (also at step 0 and the end)
    eval_batches: int = 8             # held-out batches per evaluation (the same ones each time)
    progress: bool = True             # the progress bar (stderr)
    peak_flops: float = 0.0           # per-device peak FLOP/s for MFU; 0 = by device kind / measured on CPU
    num_devices: int = 0              # devices to use; 0 = all
    # fake host devices for CPU runs (set before JAX starts); 0 = one per usable core, at most 8, a power of
    # two dividing the micro-batch (`cpu_devices.count_for`: the fastest measured)
    cpu_devices: int = 0
    seed: int = 0                     # model initialisation
    # the model the run starts from: a Hugging Face, converted or run directory (its latest checkpoint), or a
    # Hugging Face model id (org/name: from the local Hugging Face cache, downloaded when missing; a local path
    # of that spelling wins); the run takes its architecture, tokenizer and chat format
    init_from: str = ""

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "loss_chunk", "log_every", "eval_every",
                     "eval_batches"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if self.batch_size % self.grad_accum:
            raise ConfigError("batch_size", f"{self.batch_size} is not divisible by grad_accum={self.grad_accum}")
        if self.mtp_distill_weight < 0 or self.peak_flops < 0 or self.num_devices < 0:
            raise ConfigError("mtp_distill_weight", "mtp_distill_weight, peak_flops, num_devices must be >= 0")
        if self.cpu_devices < 0:
            raise ConfigError("cpu_devices", f"must be >= 0 (0: one per core), got {self.cpu_devices}")

    @property
    def host_cpu_devices(self) -> int:
        """`cpu_devices`, or where 0 the count `cpu_devices.count_for` picks for the micro-batch."""
        return self.cpu_devices or count_for(self.batch_size // self.grad_accum)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """The agent settings a run records for its model (RUN_DIR/chat.json): what `composer-jax eval` and
    `generate` of the run use unless told otherwise, and what RL started from it inherits. Unset (null):
    the source's (train.init_from), if it recorded any."""

    tools: tuple[str, ...] | None = None      # the tools declared to the agent (as in the SFT data)
    max_output_chars: int | None = None       # a tool result is cut to this many characters
    max_turns: int | None = None              # assistant turns per episode
    temperature: float | None = None          # sampling
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None         # tokens per assistant turn

    def __post_init__(self):
        for name in ("max_output_chars", "max_turns", "max_new_tokens"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if self.tools is not None:
            from composer_jax.envs.tools import TOOL_NAMES

            unknown = [t for t in self.tools if t not in TOOL_NAMES]
            if unknown or "submit" not in self.tools:
                raise ConfigError("tools", f"unknown tool {unknown[0]!r}; the tools are {', '.join(TOOL_NAMES)}"
                                  if unknown else "must include submit (the agent ends its episode with it)")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    SOURCE_KEY = "train.init_from"    # the model source a run starts from (load_config_with_model)

    model: ModelConfig
    mesh: MeshConfig = MeshConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    agent: AgentConfig = AgentConfig()
    run_dir: str = "runs/default"     # where the run writes everything; relative = to the current directory

    def __post_init__(self):
        check_fits_model("train.seq_len", self.train.seq_len, self.model)
        if not self.run_dir:
            raise ConfigError("run_dir", "is empty")


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


def resolve_run_paths(cfg: RunConfig) -> RunConfig:
    """`run_dir`, `train.init_from`, `data.path` and `data.tokenizer` as absolute paths (`~` expanded,
    relative ones against the current directory or shipped with the configs; `train.init_from` a Hugging
    Face model id as written, when no local path is spelled so), so a resolved config means the same
    wherever it is read."""
    from composer_jax.model_dirs import source_spec   # numpy: not for every config read

    data = dataclasses.replace(cfg.data, tokenizer=shipped_path(cfg.data.tokenizer),
                               path=cfg.data.path if cfg.data.path == "stdlib" else shipped_path(cfg.data.path))
    return dataclasses.replace(cfg, run_dir=shipped_path(cfg.run_dir), data=data,
                               train=dataclasses.replace(cfg.train, init_from=source_spec(cfg.train.init_from)))


RUN_SECTIONS = ("model", "train", "data", "rl", "rollout", "env", "init_from", "run_dir")


def is_run_config(path_or_name: str | Path) -> bool:
    """Whether `path_or_name` is a run config: a bundled one, or a YAML file with a run's section (a
    model, given or taken from a source; model configs have none)."""
    try:
        path = resolve_config_path(path_or_name, kind="run")
    except FileNotFoundError:
        return False
    return any(str(k).split(".")[0] in RUN_SECTIONS for k in read_yaml(path))


def load_run_config(path_or_name: str | Path, overrides=()) -> RunConfig:
    """Read a run YAML (a path or a name under configs/), inline its model, apply overrides, validate;
    run paths are made absolute (`resolve_run_paths`)."""
    return resolve_run_paths(load_config_with_model(RunConfig, path_or_name, overrides))


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _dotted(data: dict, key: str):
    for part in key.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _bundled_run_hint(source: str) -> str:
    """How to make `source` when it is the run directory of a bundled run config (a recipe's earlier phase)."""
    from composer_jax.config import CONFIG_DIR, bundled_configs

    for name in bundled_configs("run"):
        data = read_yaml(CONFIG_DIR / f"{name}.yaml")
        if Path(str(data.get("run_dir", ""))).expanduser() == Path(source).expanduser():
            command = ("rl" if "rl" in data or "init_from" in data else
                       "sft" if (data.get("data") or {}).get("format") == "chat" else "pretrain")
            return f"the run of the bundled config {name}: make it first with `composer-jax {command} {name}`"
    return ""


def load_config_with_model(cls: type, path_or_name: str | Path, overrides=()):
    """A run-like config `cls` (with a `model` field and a `SOURCE_KEY`, the dotted key naming the model
    source it starts from) from a YAML path or a bundled run config name: the named model inlined, dotted
    keys in the file and then `overrides` applied, validated; a ConfigError says where its key was set.

    Without `model`, the architecture is the source's (its `model.*` overrides applied on top); with
    either, a model that differs from the source's architecture (`config.check_architecture`) is an
    error naming the key and the source's value."""
    from composer_jax.config import check_architecture
    from composer_jax.model_dirs import source_model

    path = resolve_config_path(path_or_name, kind="run")
    data = read_yaml(path)
    command_line = command_line_overrides(overrides)
    # Dotted top-level keys in the YAML (`model.rope.factor: 8`) act as overrides, before the CLI's.
    in_file = [(k, data.pop(k)) for k in [k for k in data if isinstance(k, str) and "." in k]]
    try:
        overrides = in_file + [parse_override(o) if isinstance(o, str) else o for o in overrides]
        for key, value in overrides:
            if key == "model":
                data["model"] = value
        explicit = "model" in data
        if explicit and isinstance(data["model"], str):
            try:
                data["model"] = read_yaml(resolve_config_path(data["model"], kind="model"))
            except FileNotFoundError as e:
                raise ConfigError("model", str(e)) from None
        data.setdefault("model", {})
        apply_overrides(cls, data, {k: v for k, v in overrides if k != "model"})
        source = None
        if _dotted(data, cls.SOURCE_KEY):
            base, source = source_model(str(_dotted(data, cls.SOURCE_KEY)), cls.SOURCE_KEY,
                                        hint=_bundled_run_hint(str(_dotted(data, cls.SOURCE_KEY))))
            if not explicit:
                data["model"] = _deep_merge(base, data["model"])
        elif not explicit:
            raise ConfigError("model", f"required key is missing (give a model, or {cls.SOURCE_KEY}: a model source "
                                       "whose architecture the run takes)")
        cfg = from_dict(cls, data)
        if source is not None:
            check_architecture(cfg.model, source.model, where=str(source.path))
        return cfg
    except ConfigError as e:
        raise override_origin(e, path, command_line) from None

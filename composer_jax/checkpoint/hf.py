"""Open Hugging Face DeepSeek-V3 / Kimi K2 / Kimi K2.5 directories and load them into the NNX model.

`open_hf` reads `config.json` (hf_config.py) and indexes the safetensors through the dequantizing
`TensorReader` (quant.py: bf16/fp16/fp32, FP8 blocks, K2.5 INT4); `plan_leaves` maps every parameter
of the model onto HF tensors (hf_layout.py) and `check_tensors` validates the checkpoint against that
plan before anything is read: missing tensors, shape mismatches and unexpected tensors are errors that
name them. K2.5's vision tower and projector are left aside; MTP layers stored past the last decoder
layer map onto our MTP depths. `from_pretrained` (in memory) and `convert` (streaming, to orbax) share
all of this.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax import config as config_lib
from composer_jax.checkpoint.hf_config import config_from_hf, eos_token_ids, read_hf_config
from composer_jax.checkpoint.hf_layout import (SIDE_PREFIXES, Tensor, hf_rows_to_ours, mtp_copies,
                                               rows_per_index, tensor_plan)
from composer_jax.checkpoint.quant import QuantConfig, TensorReader
from composer_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsDir
from composer_jax.config import ModelConfig
from composer_jax.model import CausalLM
from composer_jax.model.mtp import MTP

__all__ = ["HFSource", "Leaf", "open_hf", "plan_leaves", "check_tensors", "read_block", "from_pretrained",
           "abstract_leaves", "config_from_hf", "tensor_plan"]

log = logging.getLogger(__name__)


@dataclass
class HFSource:
    """An opened HF directory: its configs, tensors and the ModelConfig they describe."""

    path: Path
    config: dict          # the whole config.json
    text: dict            # its text-model part (== config, except for K2.5's wrapper)
    prefix: str           # key prefix of text-model tensors ('language_model.' for K2.5)
    reader: TensorReader
    stored_mtp: int       # MTP layers present in the checkpoint
    cfg: ModelConfig


@dataclass(frozen=True)
class Leaf:
    """One parameter of the model: its path, shape, dtype, logical axes and HF source tensors.

    `plan`: object array shaped like the stack dims (layers[, experts]) of Tensors; `inner` is the
    per-tensor shape `shape[plan.ndim:]`.
    """

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    axes: tuple[str, ...]
    plan: np.ndarray

    @property
    def inner(self) -> tuple[int, ...]:
        return self.shape[self.plan.ndim:]

    @property
    def name(self) -> str:
        return ".".join(self.path)


def _count_mtp_layers(keys, prefix: str, num_layers: int) -> int:
    roots = {k[len(prefix):].split(".")[2] for k in keys if k.startswith(f"{prefix}model.layers.")}
    depth = 0
    while str(num_layers + depth) in roots:
        depth += 1
    return depth


def open_hf(path: str | Path, overrides=()) -> HFSource:
    """Read config.json and index the tensors of a HF directory; `overrides` change the ModelConfig."""
    path = Path(path)
    whole, text, prefix = read_hf_config(path)
    quant = QuantConfig.from_hf(text, str(path / "config.json"))
    reader = TensorReader(SafetensorsDir(path), quant)
    try:
        stored_mtp = _count_mtp_layers(reader.keys(), prefix, text["num_hidden_layers"])
        raw = config_from_hf(text, stored_mtp)
        cfg = config_lib.from_dict(ModelConfig, config_lib.apply_overrides(ModelConfig, raw, overrides))
    except KeyError as e:
        raise CheckpointError(f"{path / 'config.json'}: missing required key {e}") from None
    except config_lib.ConfigError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    return HFSource(path, whole, text, prefix, reader, stored_mtp, cfg)


def abstract_leaves(cfg: ModelConfig, seed: int = 0) -> list[tuple[tuple[str, ...], nnx.Variable]]:
    """(path, abstract variable) of every parameter of `CausalLM(cfg)`; allocates nothing."""
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(seed)))
    return [(tuple(str(p) for p in path), var) for path, var in nnx.to_flat_state(nnx.state(abstract))]


def plan_leaves(cfg: ModelConfig, prefix: str = "", with_mtp: bool = True) -> list[Leaf]:
    """Every parameter of `CausalLM(cfg)` with its HF tensors (MTP parameters only if `with_mtp`)."""
    leaves = []
    for path, var in abstract_leaves(cfg):
        if path[0] == "mtp" and not with_mtp:
            continue
        value = var.get_value()
        shape = tuple(value.shape)
        leaves.append(Leaf(path, shape, np.dtype(value.dtype), tuple(var.get_metadata().get("axes", ())),
                           tensor_plan(path, shape, cfg, prefix)))
    return leaves


def _listed(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(f"'{k}'" for k in keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def check_tensors(source: HFSource, leaves: list[Leaf], loaded_mtp: int, strict: bool = True) -> list[str]:
    """Validate the checkpoint against the plan; returns the side (vision) tensor keys.

    `loaded_mtp`: MTP depths taken from the checkpoint; stored layers beyond them are dropped (logged).
    Unexpected tensors are an error when `strict`, else a warning.
    """
    reader, used, missing = source.reader, set(), []
    for leaf in leaves:
        for t in leaf.plan.flat:
            if t.key not in reader:
                missing.append(t.key)
            elif reader.shape(t.key) != t.hf_shape:
                raise CheckpointError(f"tensor '{t.key}' has shape {list(reader.shape(t.key))}, expected "
                                      f"{list(t.hf_shape)} from config.json (in {reader.file(t.key).name})")
            used.add(t.key)
    if missing:
        raise CheckpointError(f"{source.path}: {len(missing)} tensor(s) missing from the checkpoint: "
                              + _listed(missing))
    cfg, prefix = source.cfg, source.prefix
    side = [k for k in reader.keys() if k.startswith(SIDE_PREFIXES)]
    copies = {k for k, _ in mtp_copies(cfg, prefix, source.stored_mtp)}
    dropped = tuple(f"{prefix}model.layers.{cfg.num_layers + k}." for k in range(loaded_mtp, source.stored_mtp))
    rest = [k for k in reader.keys() if k not in used and k not in copies and not k.startswith(SIDE_PREFIXES)]
    extra = [k for k in rest if not (dropped and k.startswith(dropped))]
    if side:
        log.info("leaving aside %d vision tower / projector tensors", len(side))
    if dropped:
        log.info("dropping %d stored MTP layer(s) beyond the %d requested", len(dropped), loaded_mtp)
    if extra:
        msg = f"{source.path}: {len(extra)} unexpected tensor(s) the model does not use: {_listed(extra)}"
        if strict:
            raise CheckpointError(msg + " (check config.json, or allow extra tensors)")
        log.warning(msg)
    return side


def read_block(reader: TensorReader, t: Tensor, inner: tuple[int, ...], start: int, stop: int,
               dtype) -> np.ndarray:
    """Indices `[start, stop)` of the row dim of one tensor's slice, in our layout, as `dtype`."""
    per = rows_per_index(t, inner)
    rows = reader.read(t.key, (start * per, stop * per))
    return hf_rows_to_ours(rows.astype(dtype, copy=False), t, inner, stop - start)


def from_pretrained(path: str | Path, overrides=(), *, rngs_seed: int = 0, strict: bool = True) -> CausalLM:
    """Load a HF DeepSeek-V3 / Kimi K2 / K2.5 directory (config.json + safetensors, quantized or not).

    `overrides`: dotted ModelConfig changes applied on top of the HF config, e.g.
    `["dtype=bfloat16", "moe.dispatch=dense", "mtp.num_layers=1"]`. MTP depths absent from the
    checkpoint but requested by `mtp.num_layers` are freshly initialized (seed `rngs_seed`). INT4 / FP8
    weights are dequantized in float32, then cast to `param_dtype`. `strict`: unexpected tensors are an
    error (else a warning). Returns the model; `model(tokens)` gives float32 logits [batch, seq, vocab];
    `model.eos_token_ids` holds the checkpoint's end-of-sequence ids (generation's default stop tokens).
    """
    source = open_hf(path, overrides)
    cfg = source.cfg
    fresh = cfg.mtp.num_layers > source.stored_mtp
    leaves = plan_leaves(cfg, source.prefix, with_mtp=not fresh)
    check_tensors(source, leaves, 0 if fresh else cfg.mtp.num_layers, strict)

    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(rngs_seed)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    values = {}
    for leaf in leaves:
        out = np.empty(leaf.shape, leaf.dtype)
        for index, t in np.ndenumerate(leaf.plan):
            out[index] = read_block(source.reader, t, leaf.inner, 0, leaf.inner[t.linear_in], leaf.dtype)
        values[leaf.path] = out
    if fresh:  # not in the checkpoint: keep a fresh init
        for path, value in nnx.to_flat_state(nnx.state(MTP(cfg, rngs=nnx.Rngs(rngs_seed)))):
            values[("mtp",) + tuple(str(p) for p in path)] = np.asarray(value.get_value())
    for path_key, var in flat.items():
        var.set_value(jnp.asarray(values[tuple(str(p) for p in path_key)]))
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    model.eos_token_ids = eos_token_ids(source.path)
    return model

"""Open Hugging Face DeepSeek-V3 / Kimi K2 / Kimi K2.5 directories and read them as our parameter tree.

`open_hf` reads `config.json` (hf_config.py) and indexes the safetensors through the dequantizing
`TensorReader` (quant.py: bf16/fp16/fp32, FP8 blocks, K2.5 INT4); `plan_leaves` maps every parameter
of a tree the caller gives (the model's, `composer_jax.model.abstract_params`: this package knows
pytrees, not the model) onto HF tensors (hf_layout.py) and `check_tensors` validates the checkpoint
against that plan before anything is read: missing tensors, shape mismatches and unexpected tensors are
errors that name them. K2.5's vision tower and projector are left aside; MTP layers stored past the last
decoder layer map onto our MTP depths. `composer_jax.from_pretrained` (in memory, `read_leaves`) and
`convert` (streaming, to orbax) share all of this.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flax import nnx

from composer_jax import config as config_lib
from composer_jax.checkpoint.hf_config import config_from_hf, read_hf_config
from composer_jax.checkpoint.hf_layout import (SIDE_PREFIXES, Tensor, hf_rows_to_ours, mtp_copies,
                                               rows_per_index, tensor_plan)
from composer_jax.checkpoint.hub import local_model
from composer_jax.checkpoint.quant import QuantConfig, TensorReader
from composer_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsDir
from composer_jax.config import ModelConfig

__all__ = ["HFSource", "Leaf", "open_hf", "plan_leaves", "check_tensors", "read_block", "read_leaves",
           "config_from_hf", "tensor_plan"]

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
    """Read config.json and index the tensors of a HF directory, or of a Hugging Face model id's snapshot
    (`hub.local_model`: the local cache, else a download); `overrides` change the ModelConfig."""
    path = local_model(path)
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


ParamsOf = Callable[[ModelConfig], Iterable[tuple[tuple[str, ...], nnx.Variable]]]
"""The parameter tree of the model a config describes: (path, abstract variable with its `axes`) per
parameter, e.g. `composer_jax.model.abstract_params`. Given by the callers of convert, export and the
synthetic writer, which find the config themselves."""


def plan_leaves(params: Iterable[tuple[tuple[str, ...], nnx.Variable]], cfg: ModelConfig, prefix: str = "",
                with_mtp: bool = True) -> list[Leaf]:
    """Every parameter of `params` (path, abstract variable: the tree of the model `cfg` describes, e.g.
    `composer_jax.model.abstract_params(cfg)`) with its HF tensors (MTP parameters only if `with_mtp`)."""
    leaves = []
    for path, var in params:
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


def read_leaves(source: HFSource, leaves: list[Leaf]) -> dict[tuple[str, ...], np.ndarray]:
    """{path: whole array in our layout} of every leaf, read at once (in memory; `convert` streams)."""
    values = {}
    for leaf in leaves:
        out = np.empty(leaf.shape, leaf.dtype)
        for index, t in np.ndenumerate(leaf.plan):
            out[index] = read_block(source.reader, t, leaf.inner, 0, leaf.inner[t.linear_in], leaf.dtype)
        values[leaf.path] = out
    return values

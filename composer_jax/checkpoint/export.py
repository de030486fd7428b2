"""`export`: a converted model directory (orbax params) -> a Hugging Face directory, streamed.

Writes `config.json` (a plain `DeepseekV3ForCausalLM` config), sharded safetensors
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`, and the small files kept from
the source (tokenizer, generation config). Per-expert tensors are unstacked, linear weights go back to
`[out, in]`, MTP depths become `model.layers.{N+k}.*` with DeepSeek-V3's embedding / head copies. Each
work item reads one block of a parameter from orbax (tensorstore), transposes it into contiguous HF rows
and writes them in place into a pre-laid-out shard, so memory stays near `workers` blocks. Weights are
written unquantized. Output is staged and resumable (jobs.py).
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import ml_dtypes
import numpy as np

from composer_jax import config as config_lib
from composer_jax.checkpoint import orbax_io
from composer_jax.checkpoint.hf import Leaf, ParamsOf, plan_leaves
from composer_jax.checkpoint.hf_config import hf_config_from, read_hf_config
from composer_jax.checkpoint.hf_layout import mtp_copies, ours_to_hf_rows, rows_per_index
from composer_jax.checkpoint.jobs import Item, Staging, block_size, default_workers, file_fingerprint, run_items
from composer_jax.checkpoint.safetensors_io import (CheckpointError, SafetensorsWriter, group_shards, shard_name,
                                                    write_index)
from composer_jax.config import ModelConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}
KEEP_FLOAT32 = ("e_score_correction_bias",)  # stored in float32 whatever the weights' dtype (as K2.5 does)


def _natural(key: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


TRAIN_ITEMS = ("model", "config/metadata")  # a training checkpoint step: params item, JSON run config


def _find_params(src: Path) -> Path:
    if not src.exists():
        raise CheckpointError(f"{src} does not exist")
    for candidate in (src / orbax_io.PARAMS_DIR, src / TRAIN_ITEMS[0], src):
        if (candidate / "_METADATA").is_file():
            return candidate
    raise CheckpointError(f"{src}: neither {src / orbax_io.PARAMS_DIR}, {src / TRAIN_ITEMS[0]} nor {src} is an "
                          "orbax checkpoint (no _METADATA), nor is it a run directory with a checkpoint")


def _find_config(src: Path) -> ModelConfig:
    """The model config of a converted directory, or the `model` part of a training step's run config."""
    run_config = src / TRAIN_ITEMS[1]
    if not (src / orbax_io.MODEL_CONFIG).is_file() and run_config.is_file():
        try:
            return config_lib.from_dict(ModelConfig, json.loads(run_config.read_text())["model"], prefix="model")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{run_config}: no readable model config ({e!r}); pass --config") from None
    return orbax_io.model_config(src)


def _read_item(store, leaf: Leaf, t, index, start: int, stop: int) -> np.ndarray:
    k = t.linear_in
    try:
        block = store[index + (slice(None),) * k + (slice(start, stop),)].read().result()
    except ValueError as e:
        raise CheckpointError(f"cannot read parameter '{leaf.name}' {list(index)} (for '{t.key}'): {e}") from None
    return ours_to_hf_rows(block, t)


def _write_rows(store, leaf, t, index, start, stop, out_dtype, targets) -> None:
    rows = _read_item(store, leaf, t, index, start, stop).astype(out_dtype, copy=False)
    per = rows_per_index(t, leaf.inner)
    for writer, key in targets:
        writer.write(key, rows, start * per)


def export(src: str | Path, dst: str | Path, *, params_of: ParamsOf, cfg: ModelConfig | None = None,
           dtype: str | None = None, max_shard_bytes: int = 5 << 30, workers: int | None = None,
           chunk_bytes: int = 64 << 20, overwrite: bool = False, restart: bool = False, progress: bool = False,
           mtp: bool = True, beside: Callable[[Path], int | None] | None = None) -> dict:
    """Export converted model directory `src` (or a training checkpoint step `<run>/checkpoints/<step>`,
    or a bare orbax params checkpoint with `cfg`) to `dst`. `beside(directory)` writes more files into the
    output before it is committed and returns the EOS id for config.json, if it knows one.

    params_of: the parameter tree of the config (`composer_jax.model.abstract_params`).
    cfg: the ModelConfig (default: `src/model_config.yaml`, or the step's run config). dtype: 'float32' / 'bfloat16' / 'float16'
    for every weight (default: each parameter's own dtype; the router correction bias stays float32).
    max_shard_bytes: safetensors shard size. mtp=False leaves the MTP depths out (transformers'
    DeepseekV3ForCausalLM has no MTP module: it reports their tensors as UNEXPECTED and ignores them).
    Other options as in `convert`. Returns a summary.
    """
    started = time.monotonic()
    src = Path(src).expanduser().absolute()
    params = _find_params(src)
    cfg = cfg or _find_config(src)
    if not mtp:
        cfg = config_lib.replace(cfg, **{"mtp.num_layers": 0})
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    tree = orbax_io.OrbaxTree(params)
    leaves = plan_leaves(params_of(cfg), cfg)
    stores = {}
    for leaf in leaves:
        stored = tree.find(leaf.path)
        if stored is None:
            raise CheckpointError(f"{params}: parameter '{leaf.name}' is missing from the checkpoint")
        stores[leaf.path] = store = tree.open(stored)
        if tuple(store.shape) != leaf.shape:
            raise CheckpointError(f"{params}: parameter '{leaf.name}' has shape {list(store.shape)}, expected "
                                  f"{list(leaf.shape)} from the model config")

    def out_dtype(leaf: Leaf, key: str) -> np.dtype:
        if key.endswith(KEEP_FLOAT32):
            return np.dtype(np.float32)
        return DTYPES[dtype] if dtype else np.dtype(stores[leaf.path].dtype.numpy_dtype)

    # Every HF tensor: key -> (leaf, Tensor, index); MTP layers also store copies of embedding and head.
    by_path = {leaf.path: leaf for leaf in leaves}
    tensors = {t.key: (leaf, t, index) for leaf in leaves for index, t in np.ndenumerate(leaf.plan)}
    copies = {}
    for key, path in mtp_copies(cfg, "", cfg.mtp.num_layers):
        main = by_path[path].plan[()]
        copies.setdefault(main.key, []).append(key)
    order = sorted(list(tensors) + [k for ks in copies.values() for k in ks], key=_natural)
    specs = {}
    for key in order:
        main = next((m for m, ks in copies.items() if key in ks), key)
        leaf, t, _ = tensors[main]
        specs[key] = (out_dtype(leaf, main), t.hf_shape)

    shards = group_shards([(k, specs[k][0].itemsize * math.prod(specs[k][1])) for k in order], max_shard_bytes)
    names = [shard_name(i, len(shards)) for i in range(len(shards))]
    inputs = file_fingerprint(p for p in params.rglob("*") if p.is_file())
    fingerprint = {"job": "export", "version": 1, "inputs": inputs,
                   "config": config_lib.to_dict(cfg), "dtype": dtype, "shards": names,
                   "chunk_bytes": chunk_bytes, "max_shard_bytes": max_shard_bytes}
    workers = workers or default_workers()

    with Staging(dst, fingerprint, overwrite=overwrite, restart=restart) as stage:
        writers, shard_of = [], {}
        for name, keys in zip(names, shards):
            writers.append(SafetensorsWriter(stage.tmp / name, [(k, *specs[k]) for k in keys], {"format": "pt"}))
            shard_of.update({k: writers[-1] for k in keys})
        items = []
        for main, (leaf, t, index) in tensors.items():
            targets = [(shard_of[k], k) for k in [main] + copies.get(main, [])]
            k, per = t.linear_in, rows_per_index(t, leaf.inner)
            row_bytes = specs[main][0].itemsize * math.prod(t.hf_shape[1:]) * per
            step = block_size(leaf.inner[k], row_bytes, chunk_bytes)
            for a in range(0, leaf.inner[k], step):
                items.append(Item(f"{main}[{a}:{a + step}]", row_bytes * step * len(targets),
                                  partial(_write_rows, stores[leaf.path], leaf, t, index, a, a + step,
                                          specs[main][0], targets)))
        log.info("exporting %s -> %s: %d tensors in %d shard(s), %d workers", params, stage.dst, len(order),
                 len(names), workers)
        run_items(items, stage, workers=workers, desc="export", progress=progress)
        for w in writers:
            w.close()
        total = sum(w.size for w in writers)
        write_index(stage.tmp, {k: name for name, keys in zip(names, shards) for k in keys}, total)
        hf_files = src / orbax_io.HF_FILES
        base = None
        if (hf_files / "config.json").is_file():
            base = read_hf_config(hf_files)[1]
            for f in hf_files.iterdir():
                if f.name != "config.json":
                    shutil.copyfile(f, stage.tmp / f.name)
        if beside is not None:      # e.g. the tokenizer and its chat template (model_dirs.export_model)
            eos = beside(stage.tmp)
            base = base if base is not None or eos is None else {"eos_token_id": eos}
        weights_dtype = dtype or str(np.dtype(stores[("lm_head",)].dtype.numpy_dtype))
        (stage.tmp / "config.json").write_text(json.dumps(hf_config_from(cfg, weights_dtype, base), indent=2))
        stage.commit()
    seconds = time.monotonic() - started
    log.info("wrote %s: %.2f GB in %.1f s", stage.dst, total / 1e9, seconds)
    return {"dst": str(stage.dst), "tensors": len(order), "shards": len(names), "items": len(items), "bytes": total,
            "seconds": seconds}

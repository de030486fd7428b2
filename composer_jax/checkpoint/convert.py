"""`convert`: a Hugging Face directory -> a converted model directory (orbax params), streamed.

Everything is validated before anything is written (config, every tensor's presence, shape and
quantization companions, unexpected tensors). Then each parameter is filled slice by slice: one work
item reads one block of HF rows (whole tensor, or a row range of a large one), dequantizes INT4 / FP8 in
float32, casts to the parameter dtype, transposes into our layout and writes exactly the zarr chunks
that block covers. Chunks are at most `chunk_bytes` and never straddle a shard of the target sharding,
so host memory stays near `workers` blocks whatever the model size, and each device later reads only
its own chunks. Output is staged and resumable (jobs.py).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from functools import partial
from pathlib import Path

import numpy as np

from composer_jax.checkpoint import orbax_io
from composer_jax.checkpoint.hf import HFSource, Leaf, ParamsOf, check_tensors, open_hf, plan_leaves, read_block
from composer_jax.checkpoint.hf_layout import rows_per_index
from composer_jax.checkpoint.jobs import Item, Staging, block_size, default_workers, file_fingerprint, run_items
from composer_jax.checkpoint.safetensors_io import INDEX_FILE, CheckpointError, SafetensorsWriter

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 << 20
SMALL_FILE_LIMIT = 64 << 20  # non-weight files (tokenizer, generation config) copied into hf_files/


def _mesh_product(entry, sizes: dict[str, int]) -> int:
    """Devices along one PartitionSpec entry (None, an axis name, or a tuple of names)."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return math.prod(sizes[a] for a in names)


def shard_shapes(leaves: list[Leaf], shardings=None, mesh_sizes: dict[str, int] | None = None) -> dict:
    """{path: per-device shard shape} from jax shardings ({path: Sharding}) or from mesh axis sizes
    (the partitioning rules of composer_jax.parallel); every leaf whole when neither is given."""
    out = {}
    for leaf in leaves:
        if shardings is not None:
            if leaf.path not in shardings:
                raise CheckpointError(f"shardings: no sharding for parameter '{leaf.name}'")
            out[leaf.path] = tuple(shardings[leaf.path].shard_shape(leaf.shape))
        elif mesh_sizes is not None:
            from composer_jax.parallel.partitioning import spec_for

            spec = tuple(spec_for(leaf.axes, leaf.shape, mesh_sizes))
            out[leaf.path] = tuple(dim // _mesh_product(entry, mesh_sizes)
                                   for dim, entry in zip(leaf.shape, spec + (None,) * len(leaf.shape)))
        else:
            out[leaf.path] = leaf.shape
    return out


def leaf_chunks(leaf: Leaf, shard_shape: tuple[int, ...], chunk_bytes: int) -> tuple[int, ...]:
    """Zarr chunks of a leaf: one per stack index, whole shards split along the HF row dim to fit."""
    n, k = leaf.plan.ndim, next(iter(leaf.plan.flat)).linear_in
    inner = shard_shape[n:]
    other = leaf.dtype.itemsize * math.prod(inner[:k]) * math.prod(inner[k + 1:])
    return (1,) * n + inner[:k] + (block_size(inner[k], other, chunk_bytes),) + inner[k + 1:]


def _write_block(source: HFSource, leaf: Leaf, t, index, start: int, stop: int, store) -> None:
    block = read_block(source.reader, t, leaf.inner, start, stop, leaf.dtype)
    k = t.linear_in
    try:
        store[index + (slice(None),) * k + (slice(start, stop),)].write(block).result()
    except ValueError as e:
        raise CheckpointError(f"cannot write parameter '{leaf.name}' {list(index)} (from '{t.key}'): {e}") from None


def _copy_rows(st, key: str, rows: tuple[int, int] | None, writer: SafetensorsWriter) -> None:
    writer.write(key, st.read(key, rows), rows[0] if rows else 0)


def _param_items(source: HFSource, leaves, chunks, stores) -> list[Item]:
    items = []
    for leaf in leaves:
        n = leaf.plan.ndim
        for index, t in np.ndenumerate(leaf.plan):
            k, per = t.linear_in, rows_per_index(t, leaf.inner)
            step = chunks[leaf.path][n + k]
            for a in range(0, leaf.inner[k], step):
                items.append(Item(f"{leaf.name}{list(index)}[{a}:{a + step}]",
                                  source.reader.nbytes(t.key, (a * per, (a + step) * per)),
                                  partial(_write_block, source, leaf, t, index, a, a + step, stores[leaf.path])))
    return items


def _side_items(source: HFSource, side: list[str], writer: SafetensorsWriter, chunk_bytes: int) -> list[Item]:
    st, items = source.reader.st, []
    for key in side:
        shape = st.shape(key)
        if not shape:
            items.append(Item(f"side:{key}", st.nbytes(key), partial(_copy_rows, st, key, None, writer)))
            continue
        step = max(1, chunk_bytes // max(1, st.nbytes(key) // max(shape[0], 1)))
        for a in range(0, shape[0], step):
            rows = (a, min(a + step, shape[0]))
            items.append(Item(f"side:{key}[{rows[0]}:{rows[1]}]", st.nbytes(key, rows),
                              partial(_copy_rows, st, key, rows, writer)))
    return items


def _copy_small_files(src: Path, dst: Path) -> None:
    dst.mkdir(exist_ok=True)
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.suffix == ".safetensors" or f.name == INDEX_FILE:
            continue
        if f.stat().st_size > SMALL_FILE_LIMIT:
            log.warning("not copying %s (%d bytes): not a weight file we read, and large", f.name, f.stat().st_size)
            continue
        shutil.copyfile(f, dst / f.name)


def convert(src: str | Path, dst: str | Path, overrides=(), *, params_of: ParamsOf, shardings=None, mesh_sizes=None,
            workers: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, compress: bool = False,
            strict: bool = True, overwrite: bool = False, restart: bool = False, progress: bool = False) -> dict:
    """Convert HF directory `src` into a converted model directory `dst` (see orbax_io).

    overrides: ModelConfig changes on top of config.json (e.g. `param_dtype=float32`, or
      `mtp.num_layers=0` to drop stored MTP layers).
    params_of: the parameter tree of the config read (`composer_jax.model.abstract_params`).
    shardings: target shardings, an nnx.State / nested dict of jax Shardings (e.g.
      `parallel.param_shardings(state, dual_mesh)`); chunks follow them and `_sharding` records them,
      so orbax restores onto that mesh without a target. mesh_sizes: mesh axis sizes ({'fsdp': 8, 'ep':
      64, ...}) to chunk for without devices at hand. Neither: unsharded (chunks follow HF tensors).
    workers: parallel work items (default min(8, cpus)); chunk_bytes: largest zarr chunk / work block;
    compress: zstd-1 chunks as orbax writes (slower, ~10% smaller for bf16).
    strict: unexpected tensors are an error (else a warning). overwrite: replace an existing `dst`;
    restart: discard a partial output of a different job. progress: show a progress bar.
    Returns a summary: tensors, work items, bytes read, seconds.
    """
    started, started_ns = time.monotonic(), time.time_ns()
    source = open_hf(src, overrides)
    cfg = source.cfg
    if cfg.mtp.num_layers > source.stored_mtp:
        raise CheckpointError(f"{source.path}: mtp.num_layers={cfg.mtp.num_layers} but the checkpoint stores "
                              f"{source.stored_mtp} MTP layer(s); convert cannot initialize new ones")
    if mesh_sizes is not None:
        from composer_jax.parallel.mesh import check_model

        check_model(mesh_sizes, cfg)  # e.g. ep must divide the routed experts
    leaves = plan_leaves(params_of(cfg), cfg, source.prefix)
    side = check_tensors(source, leaves, cfg.mtp.num_layers, strict)
    by_path = orbax_io.flat_shardings(shardings) if shardings is not None else None
    shards = shard_shapes(leaves, by_path, mesh_sizes)
    chunks = {leaf.path: leaf_chunks(leaf, shards[leaf.path], chunk_bytes) for leaf in leaves}
    fingerprint = {"job": "convert", "version": 1, "inputs": file_fingerprint(source.path.iterdir()),
                   "overrides": list(overrides), "compress": compress,
                   "leaves": {leaf.name: [str(leaf.dtype), list(leaf.shape), list(chunks[leaf.path])]
                              for leaf in leaves}}
    workers = workers or default_workers()

    with Staging(dst, fingerprint, overwrite=overwrite, restart=restart) as stage:
        params = stage.tmp / orbax_io.PARAMS_DIR
        params.mkdir(exist_ok=True)
        context = orbax_io._context(4 * workers)
        stores = {leaf.path: orbax_io.create_array(params, leaf.name, leaf.shape, leaf.dtype, chunks[leaf.path],
                                                   compress, context) for leaf in leaves}
        items = _param_items(source, leaves, chunks, stores)
        side_writer = None
        if side:
            st = source.reader.st
            side_writer = SafetensorsWriter(stage.tmp / orbax_io.SIDE_FILE,
                                            [(k, st.dtype(k), st.shape(k)) for k in side], {"format": "pt"})
            items += _side_items(source, side, side_writer, chunk_bytes)
        log.info("converting %s -> %s: %d tensors, %d work items, %d workers", source.path, stage.dst,
                 sum(leaf.plan.size for leaf in leaves) + len(side), len(items), workers)
        run_items(items, stage, workers=workers, desc="convert", progress=progress)
        if side_writer is not None:
            side_writer.close()
        _copy_small_files(source.path, stage.tmp / orbax_io.HF_FILES)
        orbax_io.write_model_config(stage.tmp, cfg)
        orbax_io.write_tree_metadata(params, [(leaf.path, chunks[leaf.path]) for leaf in leaves], by_path,
                                     started_ns)
        stage.commit()
    seconds = time.monotonic() - started
    read = sum(it.nbytes for it in items)
    log.info("wrote %s: %.2f GB read in %.1f s (%.0f MB/s)", stage.dst, read / 1e9, seconds, read / 1e6 / seconds)
    return {"dst": str(stage.dst), "tensors": sum(leaf.plan.size for leaf in leaves), "side_tensors": len(side),
            "items": len(items), "bytes": read, "seconds": seconds}

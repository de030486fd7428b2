"""The exchange's file format: arrays in an npz with one JSON member (`__meta__`) for the rest; nothing is
pickled. Weight snapshots (parameter path -> array) and produced batches are written with it."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.envs.monitor import Finding, Report
from composer_jax.parallel.distributed import to_host
from composer_jax.rl.batch import RolloutBatch
from composer_jax.rl.exchange.directory import ExchangeError, atomic_write
from composer_jax.rl.rollout import ProducedBatch
from composer_jax.rl.sampler import Prompt
from composer_jax.tree_paths import path_str

META = "__meta__"


def pack(arrays: list[np.ndarray], meta: dict) -> bytes:
    """npz bytes: arrays a0, a1, ... and the JSON `meta`. Dtypes numpy cannot store (bfloat16, float8:
    kind 'V') travel as unsigned integers of their width, their names in meta['dtypes']."""
    stored, dtypes = {}, {}
    for i, array in enumerate(arrays):
        array = np.ascontiguousarray(array)
        if array.dtype.kind == "V":
            dtypes[str(i)] = array.dtype.name
            array = array.view(f"u{array.dtype.itemsize}")
        stored[f"a{i}"] = array
    buffer = io.BytesIO()
    np.savez(buffer, **stored, **{META: np.frombuffer(json.dumps({**meta, "dtypes": dtypes}).encode(), np.uint8)})
    return buffer.getvalue()


def unpack(path: Path) -> tuple[list[np.ndarray], dict]:
    """(arrays, meta) of a file `pack` wrote."""
    with np.load(path, allow_pickle=False) as npz:
        meta = json.loads(npz[META].tobytes().decode())
        count = len(npz.files) - 1
        arrays = [npz[f"a{i}"] for i in range(count)]
    for i, name in meta.pop("dtypes").items():
        arrays[int(i)] = arrays[int(i)].view(jnp.dtype(name))
    return arrays, meta


def write_weights(path: Path, state, version: int) -> None:
    """The parameters `state` (an nnx.State or any pytree of arrays) as a flat parameter path -> array file.
    In a process group every process calls it (the arrays are gathered) and process 0 writes."""
    flat = jax.tree_util.tree_flatten_with_path(to_host(state))[0]
    if jax.process_index() == 0:
        atomic_write(path, pack([np.asarray(x) for _, x in flat], {"version": version,
                                                                     "paths": [path_str(p) for p, _ in flat]}))


def read_weights(path: Path, like):
    """(a pytree shaped like `like` holding the file's arrays, version): every parameter of `like` by its
    path; shapes and dtypes are checked where the weights are installed (`Engine.place_weights`)."""
    arrays, meta = unpack(path)
    by_path = dict(zip(meta["paths"], arrays))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    missing = [path_str(p) for p, _ in leaves if path_str(p) not in by_path]
    if missing:
        raise ExchangeError(f"{path}: no parameter '{missing[0]}' ({len(missing)} of the engine's model missing)")
    return jax.tree_util.tree_unflatten(treedef, [by_path[path_str(p)] for p, _ in leaves]), meta["version"]


def write_batch(path: Path, produced: ProducedBatch) -> None:
    fields = [k for k in RolloutBatch._fields if getattr(produced.batch, k) is not None]
    meta = {"index": produced.index, "fields": fields, "draws": produced.draws,
            "trained": [list(p) for p in produced.trained], "feedback_only": produced.feedback_only,
            "metrics": produced.metrics,
            "reports": [[key, [dataclasses.asdict(f) for f in report.findings]] for key, report in produced.reports],
            "sampler_state": produced.sampler_state, "group_counts": produced.group_counts,
            "busy": list(produced.busy), "samples": produced.samples}
    atomic_write(path, pack([*(getattr(produced.batch, k) for k in fields), produced.row_versions], meta))


def read_batch(path: Path) -> ProducedBatch:
    arrays, meta = unpack(path)
    batch = RolloutBatch(**dict(zip(meta["fields"], arrays)))
    reports = [(key, Report(tuple(Finding(**f) for f in findings))) for key, findings in meta["reports"]]
    return ProducedBatch(meta["index"], batch, meta["draws"], [Prompt(*p) for p in meta["trained"]],
                         meta["feedback_only"], arrays[-1], meta["metrics"], reports,
                         meta["sampler_state"], meta["group_counts"], tuple(meta["busy"]), meta["samples"])

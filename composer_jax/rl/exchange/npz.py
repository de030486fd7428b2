"""The exchange's batch files: arrays in an npz with one JSON member (`__meta__`) for the rest; nothing is
pickled. (Weight versions are orbax checkpoints: `transport_files`.)"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from composer_jax.envs.monitor import Finding, Report
from composer_jax.rl.batch import RolloutBatch
from composer_jax.rl.exchange.directory import atomic_write
from composer_jax.rl.rollout import ProducedBatch
from composer_jax.rl.sampler import Prompt

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

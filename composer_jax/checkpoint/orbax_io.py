"""Orbax PyTree checkpoints of our parameter tree, written and read one slice at a time.

Writing uses orbax's non-OCDBT layout (`use_ocdbt=False`, zarr v2): one zarr array per leaf in
`<dir>/<dotted.path>/` whose chunks are written by tensorstore as slices arrive, then `_METADATA` (the
tree), `_sharding` (when shardings are known) and `_CHECKPOINT_METADATA`. Orbax's public API saves
whole arrays only, so these small JSON files are written here in orbax's format; tests restore them
with the installed orbax, with and without a target, and pyproject.toml bounds orbax's version. The result is an ordinary
orbax checkpoint: `ocp.StandardCheckpointer().restore(dir, target)` reads it onto any mesh, and
without a target when `_sharding` was written. Reading slices works on any orbax PyTree checkpoint
(OCDBT or not, zarr v2 or v3) through orbax's own tensorstore specs.

A converted model directory holds `params/` (this checkpoint), `model_config.yaml` (the resolved
ModelConfig), `hf_files/` (the source's config.json, tokenizer and other small files) and, for K2.5,
`side.safetensors` (vision tower and projector, untouched).
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
import yaml
from etils import epath
from flax import nnx

from composer_jax import config as config_lib
from composer_jax.checkpoint.safetensors_io import CheckpointError
from composer_jax.config import ModelConfig
from composer_jax.tree_paths import path_keys

PARAMS_DIR = "params"
MODEL_CONFIG = "model_config.yaml"
HF_FILES = "hf_files"
SIDE_FILE = "side.safetensors"
# The handler orbax records for a StandardCheckpointer save, named from the installed orbax's public class.
_HANDLER = f"{ocp.StandardCheckpointHandler.__module__}.{ocp.StandardCheckpointHandler.__qualname__}"


def _context(concurrency: int = 16) -> ts.Context:
    # No chunk cache: every chunk is written or read once, and caching would hold them in memory.
    return ts.Context({"cache_pool": {"total_bytes_limit": 0}, "cache_pool#ocdbt": {"total_bytes_limit": 64 << 20},
                       "file_io_concurrency": {"limit": concurrency}})


def _zarr_dtype(dtype: np.dtype) -> str:
    return "bfloat16" if dtype == np.dtype(ml_dtypes.bfloat16) else np.dtype(dtype).str


def create_array(directory: Path, name: str, shape, dtype, chunks, compress: bool = False,
                 context: ts.Context | None = None) -> ts.TensorStore:
    """Create (or reopen, on resume) the zarr array of leaf `name`; its chunks are `chunks`."""
    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": str(directory / name)},
        "metadata": {"shape": list(shape), "chunks": list(chunks), "dtype": _zarr_dtype(np.dtype(dtype)),
                     "compressor": {"id": "zstd", "level": 1} if compress else None, "fill_value": None,
                     "order": "C", "filters": None, "dimension_separator": "."},
        "create": True, "open": True, "store_data_equal_to_fill_value": True,
    }
    try:
        return ts.open(spec, context=context or _context()).result()
    except ValueError as e:
        raise CheckpointError(f"{directory / name}: cannot create or reopen the array: {e}") from None


def _sharding_metadata(path, sharding) -> str:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return ocp.metadata.NamedShardingMetadata.from_jax_sharding(sharding).to_serialized_string()
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return ocp.metadata.SingleDeviceShardingMetadata.from_jax_sharding(sharding).to_serialized_string()
    raise CheckpointError(f"sharding of '{'.'.join(path)}': only NamedSharding / SingleDeviceSharding can be "
                          f"recorded, got {type(sharding).__name__}")


def write_tree_metadata(directory: Path, leaves, shardings: dict | None = None, started_ns: int | None = None):
    """Orbax's metadata files for `leaves` = [(path tuple, chunk shape)] written with `create_array`.

    `shardings`: {path: jax Sharding}, recorded in `_sharding` so orbax can restore without a target.
    """
    tree = {str(tuple(path)): {"key_metadata": [{"key": k, "key_type": 2} for k in path],
                               "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                                                  "write_shape": list(chunks)}}
            for path, chunks in leaves}
    meta = {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}
    if shardings:
        encoded = {base64.urlsafe_b64encode(".".join(p).encode()).decode(): _sharding_metadata(p, s)
                   for p, s in shardings.items()}
        (directory / "_sharding").write_text(json.dumps(encoded))
    now = time.time_ns()
    (directory / "_CHECKPOINT_METADATA").write_text(json.dumps({
        "item_handlers": _HANDLER, "metrics": {}, "performance_metrics": {},
        "init_timestamp_nsecs": started_ns or now, "commit_timestamp_nsecs": now, "custom_metadata": {}}))
    (directory / "_METADATA").write_text(json.dumps(meta))  # last: its presence marks the tree complete


def _strip(path: tuple[str, ...]) -> tuple[str, ...]:
    return path[:-1] if path and path[-1] == "value" else path  # nnx Variables saved as-is end in 'value'


class OrbaxTree:
    """Slice-readable leaves of an orbax PyTree checkpoint directory."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).absolute()  # orbax's tensorstore specs need absolute paths
        meta_file = self.directory / "_METADATA"
        if not meta_file.is_file():
            raise CheckpointError(f"{self.directory}: not an orbax PyTree checkpoint (no _METADATA)")
        try:
            meta = json.loads(meta_file.read_text())
            entries = meta["tree_metadata"].values()
            self._names = {_strip(tuple(str(k["key"]) for k in e["key_metadata"])):
                           ".".join(str(k["key"]) for k in e["key_metadata"]) for e in entries}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{meta_file}: corrupt orbax metadata: {e!r}") from None
        self._ocdbt, self._zarr3 = bool(meta.get("use_ocdbt")), bool(meta.get("use_zarr3"))
        self._context = _context()

    def paths(self) -> list[tuple[str, ...]]:
        return list(self._names)

    def find(self, path: tuple[str, ...]) -> tuple[str, ...] | None:
        """The stored path of parameter `path`: itself, or under one group key (a training checkpoint's
        `('params', *path)` / `('biases', *path)`); None if absent or ambiguous."""
        if path in self._names:
            return path
        hits = [p for p in self._names if p[1:] == path]
        return hits[0] if len(hits) == 1 else None

    def open(self, path: tuple[str, ...]) -> ts.TensorStore:
        """The tensorstore of stored leaf `path` (slice it and `.read()`)."""
        info = ocp.type_handlers.ParamInfo(name=self._names[path], parent_dir=epath.Path(self.directory),
                                           use_zarr3=self._zarr3, ts_context=self._context)
        spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._ocdbt)
        try:
            return ts.open(spec, context=self._context).result()
        except ValueError as e:
            raise CheckpointError(f"{self.directory}: cannot open leaf '{self._names[path]}': {e}") from None


# ----------------------------------------------------------------------------------------------------
# Restoring a converted model directory


def flat_shardings(shardings) -> dict[tuple[str, ...], object]:
    """{path: Sharding} from an nnx.State of shardings (e.g. `parallel.param_shardings`) or a nested dict."""
    if isinstance(shardings, nnx.State):
        shardings = nnx.to_pure_dict(shardings)
    out = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, prefix + (str(k),))
        else:
            out[prefix] = node

    walk(shardings, ())
    return out


def model_config(directory: str | Path, overrides=()) -> ModelConfig:
    """The ModelConfig stored with a converted model directory."""
    path = Path(directory) / MODEL_CONFIG
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {MODEL_CONFIG} (expected a directory written by convert)")
    return config_lib.load_config(path, overrides)


def restore_params(directory: str | Path, abstract: dict, shardings=None) -> dict:
    """The params of a converted model directory, restored like `abstract` (a nested dict of arrays or
    ShapeDtypeStructs, e.g. `nnx.to_pure_dict` of an abstract model's state) with `shardings` (None:
    the first device; or an nnx.State / nested dict of shardings of the same tree)."""
    by_path = flat_shardings(shardings) if shardings is not None else {}
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def target(path, leaf):
        key = path_keys(path)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=by_path.get(key, default))

    return ocp.StandardCheckpointer().restore(Path(directory).absolute() / PARAMS_DIR,
                                              jax.tree_util.tree_map_with_path(target, abstract))


def write_model_config(directory: Path, cfg: ModelConfig) -> None:
    (directory / MODEL_CONFIG).write_text(yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False))

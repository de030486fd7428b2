"""Weight versions through the exchange directory (`rollout.weight_transfer=file`): each version an orbax
checkpoint `<session>/weights/<version>.weights` (tensorstore arrays in one OCDBT store). Every learner
process writes the shards it holds (one copy of each, orbax's replica de-duplication) in parallel with
the others: no process gathers the model, and a process's host memory holds at most its own shards on
their way to the files. Every engine process reads only the slices its own layout needs, placed on its
devices as they arrive. Works wherever both sides see one filesystem. The same calls as the device
transport: the learner `offer`s a version, the engine lists `versions()` and `pull`s one."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from jax.sharding import SingleDeviceSharding

from composer_jax.rl.exchange.directory import ExchangeError, numbered, numbered_file, prune
from composer_jax.tree_paths import path_str

KEEP_VERSIONS = 3           # weight versions kept in the directory (an engine may still be reading an older one)
SUFFIX = ".weights"         # a version's directory (orbax writes it under a temporary name, then renames it)


def _names(tree) -> tuple[list[str], list, object]:
    """(parameter names, leaves, treedef) of a parameter tree: the flat names a version's arrays have."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [path_str(p, ".") for p, _ in leaves], [x for _, x in leaves], treedef


class FileWeightServer:
    """The learner's side: `offer(state, version)` writes the version (every process of a group calls it
    with its shards) and removes all but the newest KEEP_VERSIONS."""

    def __init__(self, session_dir: Path):
        self.dir = session_dir / "weights"
        self._checkpointer = ocp.StandardCheckpointer()

    def offer(self, state, version: int) -> None:
        names, leaves, _ = _names(state)
        self._checkpointer.save(numbered_file(self.dir, version, SUFFIX).absolute(), dict(zip(names, leaves)))
        self._checkpointer.wait_until_finished()
        if jax.process_index() == 0:
            prune(self.dir, KEEP_VERSIONS, SUFFIX)

    def close(self) -> None:
        self._checkpointer.close()


def read_version(path: Path, like):
    """The parameters of the version at `path` in the structure of `like` (its arrays' shardings say which
    slices to read and where they go; a leaf without one comes back on this process's first device)."""
    names, leaves, treedef = _names(like)
    checkpointer = ocp.StandardCheckpointer()
    stored = checkpointer.metadata(path.absolute()).item_metadata if path.is_dir() else None
    if stored is None:                  # never written, or pruned by the learner meanwhile
        raise FileNotFoundError(path)
    missing = [n for n in names if n not in stored]
    if missing:
        raise ExchangeError(f"{path}: no parameter '{missing[0]}' ({len(missing)} of the engine's model missing)")
    local = SingleDeviceSharding(jax.local_devices()[0])
    target = {n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or local)
              for n, x in zip(names, leaves)}
    restored = checkpointer.restore(path.absolute(), target)
    return jax.tree_util.tree_unflatten(treedef, [restored[n] for n in names])


class FileWeightClient:
    """The engine's side: the versions in the directory, and one read in the layout of `like`."""

    def __init__(self, session_dir: Path, like):
        self.dir, self.like = session_dir / "weights", like

    def versions(self) -> list[int]:
        return numbered(self.dir, SUFFIX)

    def pull(self, version: int):
        """The parameters at `version`; None if the learner removed it meanwhile (a newer one is there)."""
        try:
            return read_version(numbered_file(self.dir, version, SUFFIX), self.like)
        except FileNotFoundError:
            return None

"""Training checkpoints with orbax's `CheckpointManager`: async saves every N steps, keep the last K.

A checkpoint is a set of named items written under `DIR/<step>/`:
- array items: pytrees of `jax.Array` (params, optimizer state, step, router biases, ...), saved
  from whatever sharding they have and restored onto the shardings of an *abstract target* (a pytree
  of `jax.ShapeDtypeStruct` with `.sharding`), so a checkpoint written on one mesh layout restores onto
  another;
- JSON items: small dicts (the data-iterator state, the resolved config).

Saves are atomic: orbax writes into a temporary directory and renames it when every file is
committed, so a process killed mid-save leaves the previous checkpoint as the latest complete one
(the partial directory is never listed, and is removed when the manager is next opened). Opening a
manager creates nothing: DIR is made by the first save, so a run that fails to start leaves no trace.

This module knows nothing about models or training: callers name the items and hand it the abstract
target when restoring.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class TrainCheckpointer:
    """Save / restore named array and JSON items every `save_every` steps, keeping the last `keep`."""

    def __init__(self, directory: str | Path, *, array_items: tuple[str, ...], json_items: tuple[str, ...] = (),
                 save_every: int = 1, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.array_items, self.json_items = tuple(array_items), tuple(json_items)
        self._options = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=keep,
                                                     enable_async_checkpointing=async_save,
                                                     cleanup_tmp_directories=True, create=False)
        # Handlers per item, so that item metadata (shapes, dtypes) can be read without restoring.
        self._registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item in self.array_items:
            for args in (ocp.args.StandardSave, ocp.args.StandardRestore):
                self._registry.add(item, args, ocp.StandardCheckpointHandler)
        for item in self.json_items:
            for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
                self._registry.add(item, args, ocp.JsonCheckpointHandler)
        self._opened = None

    @property
    def _manager(self) -> ocp.CheckpointManager:
        """orbax's manager, opened on first use: a manager starts background work (temporary-directory
        cleanup) that a short-lived query of a directory that does not exist should not leave running
        at interpreter exit."""
        if self._opened is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._opened = ocp.CheckpointManager(self.directory, options=self._options,
                                                 handler_registry=self._registry)
        return self._opened

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step() if self.directory.is_dir() else None

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps()) if self.directory.is_dir() else []

    def save(self, step: int, arrays: dict, json: dict | None = None, *, force: bool = False) -> bool:
        """Start saving `step` if it is due (every `save_every` steps) or `force`; returns whether it did.

        arrays: {item: pytree of jax.Array}; json: {item: JSON-able dict}. With async saves the call
        returns once the arrays are copied off the devices; writing continues in the background (the
        caller may donate / overwrite the arrays right away).
        """
        json = json or {}
        missing = set(self.array_items + self.json_items) - set(arrays) - set(json)
        if missing:
            raise ValueError(f"checkpoint items missing: {sorted(missing)}")
        args = {k: ocp.args.StandardSave(v) for k, v in arrays.items()}
        args.update({k: ocp.args.JsonSave(v) for k, v in json.items()})
        return self._manager.save(step, args=ocp.args.Composite(**args), force=force)

    def restore(self, step: int | None, abstract: dict, json_items: tuple[str, ...] | None = None) -> dict:
        """Restore `step` (None: the latest). abstract: {item: pytree of ShapeDtypeStruct with shardings}
        for the array items wanted (a subset is fine); json_items: JSON items wanted (default: all).

        Returns {item: restored pytree or dict}.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        json_items = self.json_items if json_items is None else json_items
        args = {k: ocp.args.StandardRestore(v) for k, v in abstract.items()}
        args.update({k: ocp.args.JsonRestore() for k in json_items})
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        return {k: restored[k] for k in args}

    def array_metadata(self, step: int | None, item: str):
        """The saved pytree of array item `item` at `step` (None: the latest) as ShapeDtypeStructs
        (shape and dtype; no sharding), read from the checkpoint's metadata without restoring."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        tree = self._manager.item_metadata(step)[item]
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), getattr(tree, "tree", tree))

    def wait(self) -> None:
        """Block until any background save is committed."""
        if self._opened is not None:
            self._opened.wait_until_finished()

    def close(self) -> None:
        if self._opened is not None:
            self._opened.wait_until_finished()
            self._opened.close()
            self._opened = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def abstract_like(tree, shardings=None):
    """ShapeDtypeStructs of `tree` (arrays or ShapeDtypeStructs), with `shardings` (a matching pytree of
    jax.sharding.Sharding, or one sharding for all leaves) or the leaves' own shardings."""
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        one = shardings
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=one or getattr(x, "sharding", None)), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

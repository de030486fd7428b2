"""A run's checkpoints: the TrainState as orbax items, the data-iterator state and the resolved config.

Items under `RUN_DIR/checkpoints/<step>/`:
- `model` (arrays): params and router biases (what `export`, `train.init_from` and RL read);
- `train` (arrays): step, optimizer state, skipped-step count;
- `data` (JSON): the train iterator's state; `config` (JSON): the resolved run config.

Whether a checkpoint fits a run is decided from the saved arrays themselves (their shapes and dtypes,
read from the checkpoint's metadata) against the run's abstract state, so a mismatch names the
tensor at fault and nothing has to keep a list of the config fields that shape parameters.
"""

from __future__ import annotations

from pathlib import Path

import jax

from composer_jax.checkpoint.manager import TrainCheckpointer
from composer_jax.config import ConfigError
from composer_jax.train.config import CheckpointConfig
from composer_jax.train.state import TrainState
from composer_jax.tree_paths import path_str

ARRAY_ITEMS, JSON_ITEMS = ("model", "train"), ("data", "config")


def state_items(state: TrainState) -> dict:
    return {"model": {"params": state.params, "biases": state.biases},
            "train": {"step": state.step, "opt_state": state.opt_state, "skipped": state.skipped}}


def join_items(items: dict) -> TrainState:
    m, t = items["model"], items["train"]
    return TrainState(t["step"], m["params"], m["biases"], t["opt_state"], t["skipped"])


def model_mismatch(saved, expected) -> str | None:
    """Where two pytrees of arrays / ShapeDtypeStructs differ in paths, shapes or dtypes, in words
    (None when they agree)."""
    def flat(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {path_str(p).removesuffix("/value"): (tuple(x.shape), str(x.dtype)) for p, x in leaves}

    have, want = flat(saved), flat(expected)
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing:
        return f"the checkpoint lacks {len(missing)} tensors of this model, e.g. '{missing[0]}'"
    if extra:
        return f"the checkpoint has {len(extra)} tensors this model lacks, e.g. '{extra[0]}'"
    for path, (shape, dtype) in want.items():
        if have[path] != (shape, dtype):
            return (f"tensor '{path}' is {have[path][1]}{list(have[path][0])} in the checkpoint, "
                    f"{dtype}{list(shape)} in this model")
    return None


class RunCheckpoints:
    """Save and restore a run's TrainState, iterator state and config under `directory`."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig | None = None):
        cfg = cfg or CheckpointConfig()
        self.directory = Path(directory).absolute()
        self._ckpt = TrainCheckpointer(self.directory, array_items=ARRAY_ITEMS, json_items=JSON_ITEMS,
                                       save_every=cfg.every, keep=cfg.keep, async_save=cfg.async_save)

    def latest_step(self) -> int | None:
        return self._ckpt.latest_step()

    def save(self, step: int, state: TrainState, data_state: dict, config: dict, *, force: bool = True) -> bool:
        return self._ckpt.save(step, state_items(state), {"data": data_state, "config": config}, force=force)

    def check_model(self, abstract: TrainState, key: str, step: int | None = None) -> None:
        """Raise ConfigError(key) when the saved params / biases differ from `abstract`'s."""
        saved = self._ckpt.array_metadata(step, "model")
        problem = model_mismatch(saved, state_items(abstract)["model"])
        if problem:
            raise ConfigError(key, f"the model of {self.directory} does not match this run's model: {problem}")

    def restore(self, abstract: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
        """(state on `abstract`'s shardings, data-iterator state) of `step` (None: the latest)."""
        restored = self._ckpt.restore(step, state_items(abstract), json_items=("data",))
        return join_items(restored), restored["data"]

    def restore_model(self, abstract: TrainState, step: int | None = None):
        """(params, biases) only, on `abstract`'s shardings."""
        model = self._ckpt.restore(step, {"model": state_items(abstract)["model"]}, json_items=())["model"]
        return model["params"], model["biases"]

    def config(self, step: int | None = None) -> dict:
        return self._ckpt.restore(step, {}, json_items=("config",))["config"]

    def wait(self) -> None:
        """Block until a save in progress is committed."""
        self._ckpt.wait()

    def close(self) -> None:
        self._ckpt.close()

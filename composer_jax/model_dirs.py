"""Open a model to sample from, whatever directory holds it: a Hugging Face directory (config.json +
safetensors), a converted directory (`composer-jax convert` output: model_config.yaml + params) or a
training run of `pretrain`, `sft` or `rl` (RUN_DIR/checkpoints: its latest step), with its tokenizer and
end-of-sequence ids.

Used by `composer-jax generate`, `composer-jax eval` (composer_jax.eval.engine_agent) and
tools/bench_decode.py; sits above `checkpoint`, `train` and `data`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from flax import nnx

from composer_jax import config as config_lib
from composer_jax.checkpoint.safetensors_io import CheckpointError
from composer_jax.config import ModelConfig
from composer_jax.data.tokenizer import Tokenizer, load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")


@dataclasses.dataclass
class OpenedModel:
    model: object                  # CausalLM, unsharded, on the first device
    tokenizer: Tokenizer | None    # None when the directory ships none
    eos_ids: tuple[int, ...]       # default stop tokens
    description: str               # e.g. "training run runs/x, step 100"


def _tokenizer_in(directory: Path) -> Tokenizer | None:
    for name in TOKENIZER_FILES:
        if (directory / name).is_file():
            return load_tokenizer(str(directory / name))
    return None


def _open_run(run_dir: Path, overrides) -> OpenedModel:
    from composer_jax.train.checkpoints import RunCheckpoints
    from composer_jax.train.config import RunConfig
    from composer_jax.train.state import TrainState, abstract_model_parts

    checkpoints = RunCheckpoints(run_dir / "checkpoints")
    try:
        step = checkpoints.latest_step()
        if step is None:
            raise CheckpointError(f"{run_dir}: no complete checkpoint in {run_dir / 'checkpoints'}")
        saved = checkpoints.config(step)
        config_lib.apply_overrides(ModelConfig, saved["model"], overrides)
        # A pretraining / SFT run's config, or an RL run's (`composer-jax rl`: its model, byte-level episodes)
        cfg = config_lib.from_dict(RunConfig, saved if "rl" not in saved else {"model": saved["model"]})
        graphdef, params, biases, rest = abstract_model_parts(cfg)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        on_device = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
        abstract = TrainState(None, on_device(params), on_device(biases), None, None)
        checkpoints.check_model(abstract, "MODEL", step)
        params, biases = checkpoints.restore_model(abstract, step)
    finally:
        checkpoints.close()
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    eos = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
    return OpenedModel(nnx.merge(graphdef, params, biases, rest), tokenizer, eos,
                       f"training run {run_dir}, step {step}")


def open_model(path: str | Path, overrides=()) -> OpenedModel:
    """The model in `path` (see the module docstring). `overrides`: ModelConfig changes that keep the
    parameter shapes, e.g. `["dtype=bfloat16", "moe.dispatch=ragged"]`."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        return _open_run(path, overrides)
    if (path / "model_config.yaml").is_file():
        from composer_jax.checkpoint.orbax_io import HF_FILES, load_model

        model = load_model(path, overrides)
        return OpenedModel(model, _tokenizer_in(path / HF_FILES), model.eos_token_ids, f"converted model {path}")
    if (path / "config.json").is_file():
        from composer_jax.checkpoint.hf import from_pretrained

        model = from_pretrained(path, overrides)
        return OpenedModel(model, _tokenizer_in(path), model.eos_token_ids, f"Hugging Face model {path}")
    if not path.exists():
        raise FileNotFoundError(f"model directory {path} does not exist")
    raise CheckpointError(f"{path} is neither a training run (checkpoints/), a converted directory "
                          "(model_config.yaml) nor a Hugging Face directory (config.json)")

"""A model source's weights on a run's layout, streamed (composer_jax.model_dirs opens the source).

    params, biases = load_state(source, cfg, abstract_params, abstract_biases, seed=0)
    opened = open_model("runs/sft")          # generate / eval: the model on one device, with its chat

Every parameter is read in the slices its devices hold (checkpoint/stream.py): from the Hugging Face
tensors through their plan (checkpoint/hf.py, dequantizing INT4 / FP8), or from the orbax leaf of a
converted directory or a run's checkpoint, cast to the run's parameter dtype. MTP depths: the first
`mtp.num_layers` stored ones, or, when the run asks for more than the source holds, all freshly
initialised (as `from_pretrained` does).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from composer_jax.checkpoint.safetensors_io import CheckpointError
from composer_jax.checkpoint.stream import DEFAULT_CHUNK_BYTES, hf_reader, orbax_reader, place
from composer_jax.config import ModelConfig, check_architecture
from composer_jax.model_dirs import Chat, ModelSource, open_source
from composer_jax.tree_paths import path_keys

STACKS = ("dense_layers", "moe_layers", "mtp")   # leaves with a leading layers / depths axis


def _flat(state) -> dict[tuple[str, ...], object]:
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {tuple(k for k in path_keys(p) if k != "value"): x for p, x in leaves}


def _fresh_mtp(cfg: ModelConfig, seed: int, targets: dict) -> dict:
    """Freshly initialised MTP leaves ({path: array} placed as `targets`), as `from_pretrained` makes them."""
    from composer_jax.model.mtp import MTP

    def init():
        return {("mtp",) + k: v for k, v in _flat(nnx.state(MTP(cfg, rngs=nnx.Rngs(seed)))).items()}

    shardings = {k: t.sharding for k, t in targets.items()}
    return jax.jit(init, out_shardings=shardings)()


def _readers(source: ModelSource, cfg: ModelConfig, targets: dict, load_mtp: int, chunk_bytes: int):
    """{path: slice reader} for every target leaf the source supplies, checked against it first."""
    if source.kind == "hf":
        from composer_jax.checkpoint.hf import check_tensors, open_hf, plan_leaves
        from composer_jax.model import abstract_params

        hf = open_hf(source.path, [f"mtp.num_layers={load_mtp}"])
        load_cfg = dataclasses.replace(cfg, mtp=dataclasses.replace(cfg.mtp, num_layers=load_mtp))
        leaves = {leaf.path: leaf for leaf in plan_leaves(abstract_params(load_cfg), load_cfg, source.hf_prefix)}
        check_tensors(hf, list(leaves.values()), load_mtp)
        return {path: hf_reader(hf.reader, leaves[path], np.dtype(t.dtype), chunk_bytes) for path, t in targets.items()}
    from composer_jax.checkpoint.orbax_io import OrbaxTree

    tree, readers = OrbaxTree(source.weights), {}
    for path, t in targets.items():
        stored = tree.find(path)
        if stored is None:
            raise CheckpointError(f"{source.weights}: parameter '{'.'.join(path)}' is missing")
        store = tree.open(stored)
        have, want = tuple(store.shape), tuple(t.shape)
        fits = have == want or (path[0] == "mtp" and have[1:] == want[1:] and have[0] >= want[0])
        if not fits:
            raise CheckpointError(f"{source.weights}: parameter '{'.'.join(path)}' is {list(have)}, this model's "
                                  f"is {list(want)}")
        readers[path] = orbax_reader(store, np.dtype(t.dtype))
    return readers


def load_state(source: ModelSource, cfg: ModelConfig, params, biases, *, seed: int = 0,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """(params, biases): nnx.States like `params` / `biases` (abstract: ShapeDtypeStructs carrying their
    shardings) filled from `source`'s weights. `cfg` must have the source's architecture
    (`config.check_architecture`); its MTP depths beyond the source's are freshly initialised with `seed`."""
    check_architecture(cfg, source.model, where=str(source.path))
    fresh = cfg.mtp.num_layers > source.stored_mtp
    flat_params, flat_biases = _flat(params), _flat(biases)
    targets = {**flat_params, **flat_biases}
    loaded = {k: t for k, t in targets.items() if not (fresh and k[0] == "mtp")}
    readers = _readers(source, cfg, loaded, 0 if fresh else cfg.mtp.num_layers, max(chunk_bytes, 1 << 20))
    values = {path: place(t, readers[path], path[0] in STACKS, chunk_bytes) for path, t in loaded.items()}
    if fresh:
        values.update(_fresh_mtp(cfg, seed, {k: t for k, t in targets.items() if k[0] == "mtp"}))

    def rebuild(state, flat):
        treedef = jax.tree_util.tree_structure(state)
        return jax.tree_util.tree_unflatten(treedef, [values[k] for k in flat])

    return rebuild(params, flat_params), rebuild(biases, flat_biases)


@dataclasses.dataclass
class OpenedModel:
    model: object                  # CausalLM, unsharded, on the first device
    tokenizer: object              # the source's Tokenizer (composer_jax.data.tokenizer); None when it ships none
    chat: Chat                     # its tokenizer spec, format and agent settings
    eos_ids: tuple[int, ...]       # default stop tokens
    description: str               # e.g. "training run runs/x, step 100"


def load_model(source: ModelSource, cfg: ModelConfig, dual=None, *, seed: int = 0,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """A CausalLM of `cfg` (the source's architecture) with the source's weights, laid out on the DualMesh
    `dual` by its rules (recorded on the model, as `parallel.shard_model` does), or on the first device."""
    from composer_jax.checkpoint.manager import abstract_like
    from composer_jax.model import CausalLM, split_model
    from composer_jax.parallel import param_shardings, record_layout

    graphdef, params, biases, rest = split_model(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(seed))))
    if dual is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        params, biases = abstract_like(params, device), abstract_like(biases, device)
    else:
        params, biases = (abstract_like(t, param_shardings(t, dual)) for t in (params, biases))
    model = nnx.merge(graphdef, *load_state(source, cfg, params, biases, seed=seed, chunk_bytes=chunk_bytes), rest)
    return record_layout(model, dual) if dual is not None else model


def open_model(path, overrides=(), *, seed: int = 0) -> OpenedModel:
    """The model of source `path` on the first device, with its tokenizer and chat. `overrides`: model
    config changes that keep the architecture (`config.RUNTIME_KEYS`), e.g. `["moe.dispatch=ragged"]`."""
    from composer_jax import config as config_lib

    source = open_source(path)
    cfg = config_lib.from_dict(ModelConfig, config_lib.apply_overrides(
        ModelConfig, config_lib.to_dict(source.model), overrides))
    check_architecture(cfg, source.model, key_prefix="", where=str(source.path))
    tokenizer = source.chat.load_tokenizer() if source.chat.tokenizer else None
    return OpenedModel(load_model(source, cfg, seed=seed), tokenizer, source.chat, source.eos_ids, source.description)
